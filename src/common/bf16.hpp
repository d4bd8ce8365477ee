// bfloat16 <-> float on the host, round to nearest even (the rounding of __float2bfloat16).
#pragma once

#include <cstdint>
#include <cstring>

namespace mok {

using bf16_t = uint16_t;  // storage of one bfloat16 on the host

inline float bf16_to_float(bf16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline bf16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0)
    return static_cast<bf16_t>((bits >> 16) | 0x0040u);  // NaN stays a (quiet) NaN
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<bf16_t>((bits + rounding) >> 16);
}

}  // namespace mok
