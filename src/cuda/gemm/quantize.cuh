// fp8_block's activation quantiser on the device (docs/precision.md): one warp per row, a block
// of 128 channels a half-warp (eight bf16 a lane), s = max |v| / 448 (1 for zeros; or its
// power-of-two ceiling, e4m3_block_scale), q = e4m3(v / s)
// rounded to nearest even and saturating — mok.fp8.quantize_rows bit for bit (the same fp32
// division and rounding).  A row's scales go k-block-major, scales[kb · scales_ld + row], the
// block-scaled GEMM kinds' A scales.  Written for the gathers to call on the rows they copy.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "cuda/gemm/e4m3_divide.hpp"

namespace mok::gemm {

// A block's scale from its max |v|: amax / 448 (1 for zeros), or with pow2 its power-of-two
// ceiling (UE8M0: 2^ceil(log2(amax / 448)), exactly as mok.fp8 computes it with frexp)
__device__ __forceinline__ float e4m3_block_scale(float amax, bool pow2) {
  if (!(amax > 0.0f)) return 1.0f;
  float s = amax / 448.0f;
  if (pow2) {
    int e = 0;
    const float m = frexpf(s, &e);  // s = m · 2^e, m in [0.5, 1)
    s = ldexpf(1.0f, m == 0.5f ? e - 1 : e);
  }
  return s;
}

// Two values of a block of scale s (its divisor d = e4m3_divisor(s)) in e4m3: v / s (IEEE
// division's bits, e4m3_divide.hpp) rounded to nearest even, saturating at ±448 — the one
// rounding of every fp8 quantiser here
__device__ __forceinline__ __nv_fp8x2_storage_t e4m3x2(float v0, float v1, const E4m3Divisor& d) {
  return __nv_cvt_float2_to_fp8x2(make_float2(e4m3_divide(v0, d), e4m3_divide(v1, d)), __NV_SATFINITE, __NV_E4M3);
}

// Sixteen values of a column, value(r0) .. value(r0 + 15), as e4m3 of divisor d in one 16-byte
// word: the column quantisers' store unit (quantize_cols, the SwiGLU-backward pass)
template <class Value>
__device__ __forceinline__ uint4 e4m3x16(Value value, int r0, const E4m3Divisor& d) {
  uint32_t word[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = r0 + 4 * j;
    word[j] = static_cast<uint32_t>(e4m3x2(value(r), value(r + 1), d)) |
              (static_cast<uint32_t>(e4m3x2(value(r + 2), value(r + 3), d)) << 16);
  }
  return make_uint4(word[0], word[1], word[2], word[3]);
}

// The row's n channels (n % 128 == 0) from src (16-byte aligned) into q (n bytes, 4-byte
// aligned) and scales; every lane of the warp calls it.  A half-warp takes a block of 128
// channels (eight a lane: one 16-byte load), the two halves consecutive blocks, and kUnroll
// such pairs' loads are in flight before any of their math (one block at a time left the
// kernel latency-bound: 0.35 ms for dsv3's x, 15x its bytes' time, docs/perf.md session 26).
// copy (optional, 16-byte aligned): the bf16 row stored there too, from the same loads (the EP >= 2
// backward's gathers keep the bf16 rows for the wgrad operands).  src is read through the
// non-coherent path: it must not change during the kernel.
__device__ __forceinline__ void quantize_row_warp(const __nv_bfloat16* __restrict__ src, uint8_t* __restrict__ q,
                                                  float* __restrict__ scales, int64_t scales_ld, int64_t row,
                                                  int64_t n, bool pow2, __nv_bfloat16* __restrict__ copy = nullptr) {
  constexpr int kUnroll = 4;
  const int lane = threadIdx.x % 32, half = lane / 16, sub = lane % 16;
  const int64_t blocks = n / 128;
  const bool q8 = (reinterpret_cast<uintptr_t>(q) & 7u) == 0;  // warp-uniform
  for (int64_t kb0 = 0; kb0 < blocks; kb0 += 2 * kUnroll) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t kb = kb0 + 2 * u + half;
      raw[u] = kb < blocks ? __ldg(reinterpret_cast<const uint4*>(src + kb * 128 + sub * 8)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t kb = kb0 + 2 * u + half;
      const uint32_t w[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
      float v[8];
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const __nv_bfloat162 p = *reinterpret_cast<const __nv_bfloat162*>(&w[j]);
        v[2 * j] = __low2float(p);
        v[2 * j + 1] = __high2float(p);
        amax = fmaxf(amax, fmaxf(fabsf(v[2 * j]), fabsf(v[2 * j + 1])));
      }
#pragma unroll
      for (int m = 8; m > 0; m /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));  // the half's
      const float s = e4m3_block_scale(amax, pow2);
      const E4m3Divisor d = e4m3_divisor(s);
      uint32_t packed[2];
#pragma unroll
      for (int j = 0; j < 2; ++j)
        packed[j] = static_cast<uint32_t>(e4m3x2(v[4 * j], v[4 * j + 1], d)) |
                    (static_cast<uint32_t>(e4m3x2(v[4 * j + 2], v[4 * j + 3], d)) << 16);
      if (kb < blocks) {
        if (copy != nullptr) *reinterpret_cast<uint4*>(copy + kb * 128 + sub * 8) = raw[u];
        uint8_t* const dst = q + kb * 128 + sub * 8;
        if (q8) {
          *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
        } else {
          reinterpret_cast<uint32_t*>(dst)[0] = packed[0];
          reinterpret_cast<uint32_t*>(dst)[1] = packed[1];
        }
        if (sub == 0) scales[kb * scales_ld + row] = s;
      }
    }
  }
}

}  // namespace mok::gemm
