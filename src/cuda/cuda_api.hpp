// What the host runtime calls in the CUDA part.  Built from src/cuda/*.cu when nvcc is
// present; src/cuda/no_cuda.cpp stands in otherwise and reports mokNotSupported.
#pragma once

#include <cstdint>

#include "mok/mok.h"
#include "plan/plan.hpp"
#include "ref/reference.hpp"

namespace mok::cuda {

bool built();
// SMs of CUDA device `device`; 0 when unknown (no CUDA part, no such device).
int sm_count(int device);

// Device buffers of a workspace (src/cuda/forward.hpp has the byte map).
struct DeviceWorkspace;
// regions: null at EP = 1; at EP >= 2 the P symmetric regions of the group (mok.h).
DeviceWorkspace* create_workspace(const mokConfig_t& config, void* const* regions = nullptr);
void destroy_workspace(DeviceWorkspace* ws);
size_t workspace_bytes(const DeviceWorkspace* ws);
// Bytes of the timing ring (0 when off); copies it into buffer when not null (synchronises).
size_t read_trace(DeviceWorkspace& ws, void* buffer, size_t buffer_size, int64_t* events_per_recorder);
// Raises (mokDeviceInvalidRoute / mokTimeout) what the last call recorded once its copy has
// landed; with `wait`, synchronises on it first.
void check_errors(DeviceWorkspace& ws, int rank, bool wait);
// y = layer(x) of this rank on device pointers (already checked by the caller); at EP >= 2
// every rank of the group makes the same sequence of calls.
// The forward's saved pre-activations (mokSaved_t): h [max_rows, 2I] per plan row and the
// shared expert's [T, 2I_s], bf16; null: not saved.
struct Saved {
  void* h = nullptr;
  void* shared_h = nullptr;
};
void forward(DeviceWorkspace& ws, const mokConfig_t& config, const ref::RankInputs& in, void* y, void* stream,
             const Saved& save = Saved{});
// forward() in three phases, for issuing the ranks of a virtual group phase by phase: start
// (error check, EP routing exchange + start barrier), plan build, the layer kernels.
enum class ForwardPhase { kStart, kPlan, kLayer };
void forward_phase(DeviceWorkspace& ws, const mokConfig_t& config, const ref::RankInputs& in, void* y, void* stream,
                   ForwardPhase phase, const Saved& save = Saved{});
// The gradients of this rank's layer on device pointers (checked by the caller), dy [T, H]
// bf16; the shapes of unsupported_shape.
// saved: the forward's pre-activations of the same inputs (the replay is skipped), or empty.
void backward(DeviceWorkspace& ws, const mokConfig_t& config, const ref::RankInputs& in, const ref::RankGrads& grads,
              const void* dy, void* stream, const Saved& saved = Saved{});
// backward() in the forward's three phases (start: EP >= 2 publication of x, dy and the
// weights, routing exchange, start barrier; plan; the layer, with the end barrier before the
// home reductions), for issuing the ranks of a virtual group phase by phase.
void backward_phase(DeviceWorkspace& ws, const mokConfig_t& config, const ref::RankInputs& in,
                    const ref::RankGrads& grads, const void* dy, void* stream, ForwardPhase phase,
                    const Saved& saved = Saved{});
// Allocates the backward's buffers of a workspace if it has none (the first backward does it
// itself).  NOTES: cudaMalloc can wait for the device: a group issued from one process
// allocates every rank's buffers before any rank's start barrier runs, or a rank spinning in
// its barrier would wait for a peer that is only issued once the allocation returns.
void prepare_backward(DeviceWorkspace& ws, const mokConfig_t& config);
// Shape limits of the CUDA layer, checked before launch; empty when supported.
std::string unsupported_shape(const mokConfig_t& config);
// Why the CUDA layer would not read column-major (transposed) routed weights with this config
// (its forward, and its backward with `backward`): only the fused kernels read them, and this
// call would take the unfused launches (the MOK_*_PATH knobs, the fused backward's limits);
// empty when it would.  Needs no device.
std::string unsupported_transposed(const mokConfig_t& config, bool backward);

// Grouped GEMM over 128-row blocks, by kind (mokGemmKind_t; shapes in mok.h):
// out = a·b0ᵀ, silu(a·b0ᵀ) ⊙ (a·b1ᵀ), a·b0 (dgrad down), a·[b0; b1] (dgrad gate/up),
// dh = SwiGLU backward of a·b0 (dgrad down SwiGLU: h, row_weight, optional wa, dtw_partials).
struct GroupedGemmCall {
  const void* a; int64_t a_rows; int64_t k;
  const void* b0; const void* b1; int64_t num_experts; int64_t n;  // b* as in mok.h for the kind
  const int32_t* block_expert; int32_t num_m_blocks;
  void* out; int32_t kind; int32_t num_blocks;
  const void* h = nullptr; const float* row_weight = nullptr; void* wa = nullptr; float* dtw_partials = nullptr;
  // e4m3 operands with block scales (mokGroupedGemmBlockScaled): all three set, or none
  const float* a_scales = nullptr; const float* b0_scales = nullptr; const float* b1_scales = nullptr;
  bool b_scales_transposed = false;  // b*_scales [E, K/128, N/128] (the scales of b*'s transposes)
  float* out_scales = nullptr;  // gate/up: out is a in e4m3, these its scales (Epilogue::kSwiGLUE4m3)
  bool out_scales_pow2 = false;  // ... powers of two (UE8M0)
};
void grouped_gemm(const GroupedGemmCall& call, void* stream);

// K-grouped weight-gradient GEMM (mokGroupedWgrad): out[e] = a[rows of e]ᵀ · b[rows of e].
struct GroupedWgradCall {
  const void* a; const void* b; int64_t rows; int64_t mo; int64_t no; int64_t num_experts;
  const int32_t* expert_offset; const int32_t* expert_count;
  void* out; float* acc; float* main_grad; bool accumulate; bool store_acc; int32_t num_blocks;
};
void grouped_wgrad(const GroupedWgradCall& call, void* stream);
// The fp8 wgrad kind (mokGroupedWgradBlockScaled): a [mo, rows], b [no, rows] e4m3 with their
// per-channel, per-128-rows scales [rows/128, mo] and [rows/128, no]
struct GroupedWgradFp8Call {
  const void* a; const void* b; const float* a_scales; const float* b_scales;
  int64_t rows; int64_t mo; int64_t no; int64_t num_experts;
  const int32_t* expert_offset; const int32_t* expert_count;
  void* out; float* acc; float* main_grad; bool accumulate; bool store_acc; int32_t num_blocks;
};
void grouped_wgrad_fp8(const GroupedWgradFp8Call& call, void* stream);
// Its operands' quantiser (mokQuantizeColsE4m3): v [rows, cols] bf16 -> qt [cols, rows] e4m3,
// scales [rows/128, cols]
void quantize_cols(const void* v, int64_t rows, int64_t cols, void* qt, float* scales, bool pow2, void* stream);

// fp8_block's activation quantiser (mokQuantizeRowsE4m3): x [rows, n] bf16 -> q e4m3, scales [n/128, rows]
void quantize_rows(const void* x, void* q, float* scales, int64_t rows, int64_t n, bool pow2, void* stream);
// fp8_block's weight quantiser (mokQuantizeBlocksE4m3): num matrices w [rows, cols] bf16 read
// through `strides` -> scales [num, rows/128, cols/128] fp32 and either or both of q [num, rows,
// cols] and qt [num, cols, rows] e4m3 (contiguous; null: not written)
struct QuantizeBlocksCall {
  const void* w; int64_t num; int64_t rows; int64_t cols; ref::MatrixStrides strides;
  void* q; void* qt; float* scales; bool pow2;
};
void quantize_blocks(const QuantizeBlocksCall& call, void* stream);

// Builds `out` on `device` from device-resident ids on `stream`, with no host
// synchronisation.  Invalid routes are masked and the first one (lowest key) is written to
// error_record[0..3] (layout in common/defs.hpp).  Throws mok::Error on a CUDA failure.
void build_plan(const plan::PlanDims& dims, const plan::RoutingView& routing, const plan::PlanView& out,
                int64_t* error_record, int device, void* stream);
// Loads the plan build's kernels (lazy module loading: prepare_backward).
void load_plan_kernels();

}  // namespace mok::cuda
