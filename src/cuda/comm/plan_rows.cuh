// One warp per plan row, the rows spread over the grid's warps: the walk of the row-by-row
// kernels outside the fused kernel (the unfused forward's gather, the backward's gather and push).
#pragma once

#include <cstdint>

namespace mok::cuda {

// f(i, rec, lane) for every plan row i < expert_offset[num_local] (its record rows[i]), by
// every lane of the warp that takes it.
template <typename F>
__device__ __forceinline__ void for_each_plan_row(const uint32_t* __restrict__ rows,
                                                  const int32_t* __restrict__ expert_offset, int32_t num_local, F f) {
  const int64_t total = expert_offset[num_local];
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; i < total; i += warps)
    f(i, rows[i], lane);
}

}  // namespace mok::cuda
