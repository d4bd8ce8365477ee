// Stand-in for the CUDA part in builds without nvcc.
#include "cuda/cuda_api.hpp"
#include "runtime/errors.hpp"

namespace mok::cuda {

bool built() { return false; }

void build_plan(const plan::PlanDims&, const plan::RoutingView&, const plan::PlanView&, int64_t*, int device,
                void*) {
  MOK_FAIL(mokNotSupported, "tensors are on cuda:" << device << " but this libmok was built without CUDA (no nvcc)");
}

}  // namespace mok::cuda
