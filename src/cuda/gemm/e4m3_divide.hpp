// v / s for fp8_block's e4m3 roundings without a division instruction: the same bits as IEEE
// fp32 division (round to nearest even) wherever |v / s| stays below 2^-11 or in e4m3's range,
// and no branch per element.  A quantiser divides a block's every value by one scale s; an IEEE
// division is a reciprocal, a correction and a range check with a slow-path call, and those
// calls cut the epilogues into small blocks the scheduler cannot overlap (the dgrad-down SwiGLU
// kind ran at 0.33 of the dense fp8 rate with them, docs/perf.md session 26).
//
// Markstein's correction: with inv = RN(1/s) and q = RN(v·inv) within an ulp of v/s, the
// residual r = v − q·s is exact under an FMA and RN(q + r·inv) = RN(v/s), barring underflow and
// overflow.  s is first brought into [2^-100, 2^100] by an exact power-of-two factor f applied to
// both v and s (v·f can lose bits only where |v/s| < 2^-126: e4m3 zero either way, its sign kept).
// Host and device share the code (tests/cpp/test_e4m3_divide.cpp checks it against division).
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define MOK_E4M3_HD __host__ __device__ __forceinline__
#else
#define MOK_E4M3_HD inline
#endif

namespace mok::gemm {

struct E4m3Divisor {
  float f;    // 2^100, 2^-100 or 1: s · f in [2^-100, 2^100] (s > 0)
  float s;    // s · f
  float inv;  // RN(1 / (s · f))
};

MOK_E4M3_HD float e4m3_mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

MOK_E4M3_HD float e4m3_fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// The divisor of a block scale s > 0 (finite)
MOK_E4M3_HD E4m3Divisor e4m3_divisor(float s) {
  const float f = s < 0x1p-100f ? 0x1p100f : s > 0x1p100f ? 0x1p-100f : 1.0f;
  const float sf = e4m3_mul_rn(s, f);
#if defined(__CUDA_ARCH__)
  return E4m3Divisor{f, sf, __frcp_rn(sf)};
#else
  return E4m3Divisor{f, sf, 1.0f / sf};
#endif
}

// RN(v / s) for the divisor of s
MOK_E4M3_HD float e4m3_divide(float v, const E4m3Divisor& d) {
  const float x = e4m3_mul_rn(v, d.f);
  const float q = e4m3_mul_rn(x, d.inv);
  const float r = e4m3_fma_rn(-q, d.s, x);
  return r == 0.0f ? q : e4m3_fma_rn(r, d.inv, q);  // (q exact: kept, with a zero's sign)
}

}  // namespace mok::gemm

#undef MOK_E4M3_HD
