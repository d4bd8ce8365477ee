// The fixed-order combine of a token's output row:
//   y = bf16(Σ_{j ascending, valid} w_j · slot_j + shared)     fp32, one rounding
// Shared by the unfused combine kernel and the fused kernel's final phase, so both give
// the same bits (and the CPU reference's: src/ref/ sums in the same order).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace mok::cuda {

// One warp combines one token's whole row.  Lane j < k decides route j (valid, weight); each
// lane then owns chunks lane, lane + 32, ...  Every valid route's chunk is loaded before any is
// summed (8 routes at a time, kChunks chunks per lane per step), so a warp keeps up to
// 8·kChunks × 16 B per lane in flight: the combine is a pure HBM stream.  The sum: ascending j,
// one fmaf per route, the shared expert added last, one rounding.
// route_ok(j) is called by lane j only.
template <typename RouteOk>
__device__ __forceinline__ void combine_token_warp(const uint4* __restrict__ slots, int64_t row_vecs, int k,
                                                   const float* __restrict__ token_weights,
                                                   const uint4* __restrict__ shared_row, uint4* __restrict__ y_row,
                                                   RouteOk route_ok) {
  constexpr int kChunks = 2;
  const int lane = threadIdx.x & 31;
  const bool mine = lane < k && route_ok(lane);
  const uint32_t valid = __ballot_sync(0xffffffffu, mine);
  const float my_weight = lane < k ? token_weights[lane] : 0.f;
  for (int64_t base = 0; base < row_vecs; base += 32 * kChunks) {  // warp-uniform trip count
    const int64_t c0 = base + lane;
    float acc[kChunks][8];
#pragma unroll
    for (int u = 0; u < kChunks; ++u)
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[u][q] = 0.f;
    for (int j0 = 0; j0 < k; j0 += 8) {
      uint4 raw[8][kChunks];
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
#pragma unroll
        for (int u = 0; u < kChunks; ++u) {
          const int64_t c = c0 + 32 * u;
          raw[jj][u] = ((valid >> (j0 + jj)) & 1u) && c < row_vecs ? __ldcs(slots + (j0 + jj) * row_vecs + c)
                                                                   : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const float w = __shfl_sync(0xffffffffu, my_weight, (j0 + jj) & 31);
        if (!((valid >> (j0 + jj)) & 1u)) continue;
#pragma unroll
        for (int u = 0; u < kChunks; ++u) {
          const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw[jj][u]);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float2 f = __bfloat1622float2(h[q]);
            acc[u][2 * q] = __fmaf_rn(w, f.x, acc[u][2 * q]);
            acc[u][2 * q + 1] = __fmaf_rn(w, f.y, acc[u][2 * q + 1]);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kChunks; ++u) {
      const int64_t c = c0 + 32 * u;
      if (c >= row_vecs) continue;
      if (shared_row) {
        const uint4 raw = shared_row[c];
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(h[q]);
          acc[u][2 * q] = __fadd_rn(acc[u][2 * q], f.x);
          acc[u][2 * q + 1] = __fadd_rn(acc[u][2 * q + 1], f.y);
        }
      }
      uint4 out;
      __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
      for (int q = 0; q < 4; ++q) o[q] = __floats2bfloat162_rn(acc[u][2 * q], acc[u][2 * q + 1]);
      y_row[c] = out;
    }
  }
}

}  // namespace mok::cuda
