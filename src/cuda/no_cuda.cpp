// Stand-in for the CUDA part in builds without nvcc.
#include "cuda/cuda_api.hpp"
#include "runtime/errors.hpp"

namespace mok::cuda {

bool built() { return false; }
int sm_count(int) { return 0; }

void build_plan(const plan::PlanDims&, const plan::RoutingView&, const plan::PlanView&, int64_t*, int device,
                void*) {
  MOK_FAIL(mokNotSupported, "tensors are on cuda:" << device << " but this libmok was built without CUDA (no nvcc)");
}

namespace {
[[noreturn]] void no_cuda() { MOK_FAIL(mokNotSupported, "this libmok was built without its CUDA part (no nvcc)"); }
}  // namespace

DeviceWorkspace* create_workspace(const mokConfig_t&, void* const*) { no_cuda(); }
void destroy_workspace(DeviceWorkspace*) {}
size_t workspace_bytes(const DeviceWorkspace*) { return 0; }
size_t read_trace(DeviceWorkspace&, void*, size_t, int64_t* events_per_recorder) {
  if (events_per_recorder) *events_per_recorder = 0;
  return 0;
}
void check_errors(DeviceWorkspace&, int, bool) {}
void forward(DeviceWorkspace&, const mokConfig_t&, const ref::RankInputs&, void*, void*, const Saved&) { no_cuda(); }
void forward_phase(DeviceWorkspace&, const mokConfig_t&, const ref::RankInputs&, void*, void*, ForwardPhase,
                   const Saved&) {
  no_cuda();
}
std::string unsupported_shape(const mokConfig_t&) { return "this libmok was built without its CUDA part"; }
std::string unsupported_transposed(const mokConfig_t&, bool) { return "this libmok was built without its CUDA part"; }
void backward(DeviceWorkspace&, const mokConfig_t&, const ref::RankInputs&, const ref::RankGrads&, const void*, void*,
              const Saved&) {
  no_cuda();
}
void backward_phase(DeviceWorkspace&, const mokConfig_t&, const ref::RankInputs&, const ref::RankGrads&, const void*,
                    void*, ForwardPhase, const Saved&) {
  no_cuda();
}
void prepare_backward(DeviceWorkspace&, const mokConfig_t&) { no_cuda(); }
void load_plan_kernels() { no_cuda(); }
void grouped_gemm(const GroupedGemmCall&, void*) { no_cuda(); }
void grouped_wgrad(const GroupedWgradCall&, void*) { no_cuda(); }
void grouped_wgrad_fp8(const GroupedWgradFp8Call&, void*) { no_cuda(); }
void quantize_cols(const void*, int64_t, int64_t, void*, float*, bool, void*) { no_cuda(); }
void quantize_rows(const void*, void*, float*, int64_t, int64_t, bool, void*) { no_cuda(); }
void quantize_blocks(const QuantizeBlocksCall&, void*) { no_cuda(); }

}  // namespace mok::cuda
