// The fixed-order combine of one 16-byte chunk (8 columns) of a token's output row:
//   y = bf16(Σ_{j ascending, valid} w_j · slot_j + shared)     fp32, one rounding
// Shared by the unfused combine kernel and the fused kernel's final phase, so both give
// the same bits.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace mok::cuda {

// slots: the token's k route rows (row stride row_vecs uint4); shared_row: null or the
// shared expert's row; valid/weight: per route j.
__device__ __forceinline__ uint4 combine_chunk(const uint4* __restrict__ slots, int64_t row_vecs, int k,
                                               const int32_t* valid, const float* weight,
                                               const uint4* __restrict__ shared_row, int64_t c) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int j = 0; j < k; ++j) {
    if (!valid[j]) continue;
    const float w = weight[j];
    const uint4 raw = slots[j * row_vecs + c];
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 f = __bfloat1622float2(h[q]);
      acc[2 * q] = __fmaf_rn(w, f.x, acc[2 * q]);
      acc[2 * q + 1] = __fmaf_rn(w, f.y, acc[2 * q + 1]);
    }
  }
  if (shared_row) {
    const uint4 raw = shared_row[c];
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 f = __bfloat1622float2(h[q]);
      acc[2 * q] = __fadd_rn(acc[2 * q], f.x);
      acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], f.y);
    }
  }
  uint4 out;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int q = 0; q < 4; ++q) o[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
  return out;
}

}  // namespace mok::cuda
