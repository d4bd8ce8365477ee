// The quantisers' division (src/cuda/gemm/e4m3_divide.hpp) against IEEE fp32 division, on the
// host (the device runs the same code): every quotient a quantiser forms, |v| <= 448·s, equal
// bit for bit where |v / s| >= 2^-11 (below, e4m3 rounds both to a zero of v's sign).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include "cuda/gemm/e4m3_divide.hpp"

namespace {

uint32_t bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// One (v, s): the division's bits, or (below 2^-11) a quotient of the same sign below 2^-10
::testing::AssertionResult same(float v, float s) {
  volatile float sv = s;  // no constant folding
  const float want = v / sv;
  const float got = mok::gemm::e4m3_divide(v, mok::gemm::e4m3_divisor(s));
  if (std::fabs(want) < 0x1p-11f) {
    if (std::signbit(got) == std::signbit(want) && std::fabs(got) < 0x1p-10f) return ::testing::AssertionSuccess();
  } else if (bits(got) == bits(want)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << std::hexfloat << v << " / " << s << ": " << got << ", IEEE " << want;
}

TEST(E4m3Divide, RandomBlocksAcrossTheScaleRange) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-150, 127);
  int64_t checked = 0;
  for (int block = 0; block < 20000; ++block) {
    // A block's max, its scale as e4m3_block_scale forms it, and values up to the max
    const float amax = std::ldexp(std::fabs(unit(rng)) + 0x1p-24f, exp(rng));
    float s = amax / 448.0f;
    if (!(s > 0.0f) || !std::isfinite(s)) continue;
    if (block % 2) s = std::ldexp(1.0f, std::ilogb(s) + 1);  // pow2 scales too
    for (int i = 0; i < 256; ++i) {
      const float v = unit(rng) * amax * std::ldexp(1.0f, -(i % 24));
      ASSERT_TRUE(same(v, s));
      ++checked;
    }
    ASSERT_TRUE(same(amax, s));
    ASSERT_TRUE(same(-amax, s));
  }
  EXPECT_GT(checked, 4000000);
}

TEST(E4m3Divide, EveryMantissaOfOneBinade) {
  // Every fp32 value in [1, 2) (2^23 of them) over three scales: exact ties and near-ties of
  // the quotient's rounding included
  for (const float s : {3.0f / 448.0f, 0.7f, 1.0f / 3.0f}) {
    for (uint32_t m = 0; m < (1u << 23); m += 1) {
      const uint32_t b = 0x3f800000u | m;
      float v;
      std::memcpy(&v, &b, sizeof v);
      ASSERT_TRUE(same(v * 0.0078125f, s));
    }
  }
}

TEST(E4m3Divide, Edges) {
  for (const float s : {0x1p-149f, 0x1p-130f, 0x1p-101f, 0x1p-100f, 0x1p-99f, 1.0f, 0x1p100f, 0x1p101f, 0x1p127f,
                        3.4e38f / 448.0f}) {
    for (const float r : {0.0f, -0.0f, 1.0f, -1.0f, 448.0f, -448.0f, 0.5f, 1e-3f, 1e-6f, 3.0f / 7.0f}) {
      const float v = r * s;
      if (!std::isfinite(v)) continue;
      EXPECT_TRUE(same(v, s));
    }
  }
}

}  // namespace
