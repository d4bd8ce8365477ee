// fp8_block's activation quantiser on the device (docs/precision.md): one warp per row, a block
// of 128 channels at a time (four bf16 a lane), s = max |v| / 448 (1 for zeros; or its
// power-of-two ceiling, e4m3_block_scale), q = e4m3(v / s)
// rounded to nearest even and saturating — mok.fp8.quantize_rows bit for bit (the same fp32
// division and rounding).  A row's scales go k-block-major, scales[kb · scales_ld + row], the
// block-scaled GEMM kinds' A scales.  Written for the gathers to call on the rows they copy.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

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

// Two values of a block of scale s in e4m3: v / s (IEEE division) rounded to nearest even,
// saturating at ±448 — the one rounding of every fp8 quantiser here
__device__ __forceinline__ __nv_fp8x2_storage_t e4m3x2(float v0, float v1, float s) {
  return __nv_cvt_float2_to_fp8x2(make_float2(v0 / s, v1 / s), __NV_SATFINITE, __NV_E4M3);
}

// The row's n channels (n % 128 == 0) from src (16-byte aligned) into q (n bytes, 4-byte
// aligned) and scales; every lane of the warp calls it.
__device__ __forceinline__ void quantize_row_warp(const __nv_bfloat16* __restrict__ src, uint8_t* __restrict__ q,
                                                  float* __restrict__ scales, int64_t scales_ld, int64_t row,
                                                  int64_t n, bool pow2) {
  const int lane = threadIdx.x % 32;
  for (int64_t kb = 0; kb < n / 128; ++kb) {
    // four channels a lane: one 8-byte load
    const uint2 raw = *reinterpret_cast<const uint2*>(src + kb * 128 + lane * 4);
    const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
    const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
    const float v[4] = {__low2float(lo), __high2float(lo), __low2float(hi), __high2float(hi)};
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int m = 16; m > 0; m /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    const float s = e4m3_block_scale(amax, pow2);
    *reinterpret_cast<uint32_t*>(q + kb * 128 + lane * 4) =
        static_cast<uint32_t>(e4m3x2(v[0], v[1], s)) | (static_cast<uint32_t>(e4m3x2(v[2], v[3], s)) << 16);
    if (lane == 0) scales[kb * scales_ld + row] = s;
  }
}

}  // namespace mok::gemm
