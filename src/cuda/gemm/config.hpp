// Compile-time tile configuration of the grouped-GEMM engine, shared by the kernel and the
// host launchers (no kernel code here).
#pragma once

#include <cstdint>

#include "common/defs.hpp"

namespace mok::gemm {

struct TileConfig {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 256;
  static constexpr int kBlockK = 64;  // one 128-byte swizzle row of bf16
  static constexpr int kStages = 4;
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static constexpr int kATileBytes = kBlockM * kBlockK * 2;         // 16 KB
  static constexpr int kBHalfBytes = (kBlockN / 2) * kBlockK * 2;   // 16 KB
  static constexpr int kStageBytes = kATileBytes + 2 * kBHalfBytes; // 48 KB
  static constexpr int kAccRegs = kBlockN / 2;                      // fp32 per thread (64 x 256 / 128)
};
static_assert(TileConfig::kProducerRegs * 128 + TileConfig::kConsumerRegs * 128 * TileConfig::kConsumers <= 65536,
              "register budgets exceed the register file");

enum class Epilogue : int32_t {
  kStore = 0,    // out[row, col] = bf16(acc)
  kSwiGLU = 1,   // out[row, ch] = bf16(silu(gate) * up), ch = n_block*128 + col (col < 128)
  kScatter = 2,  // out[token*k + j, col] = bf16(acc) for the plan row's (token, j); padding skipped
};

// Raster of a (num_m x num_n) tile grid: groups of `group` N-blocks, m-major inside a group,
// so one group's weight tiles stay in L2 while the row blocks pass over them.
struct TileCoord {
  int32_t m;
  int32_t n;
};
MOK_HD TileCoord raster(int64_t local, int32_t num_m, int32_t num_n, int32_t group) {
  const int32_t groups = (num_n + group - 1) / group;
  const int64_t per_group = static_cast<int64_t>(num_m) * group;
  const int32_t g = static_cast<int32_t>(local / per_group < groups - 1 ? local / per_group : groups - 1);
  const int64_t within = local - g * per_group;
  const int32_t size = group < num_n - g * group ? group : num_n - g * group;
  return TileCoord{static_cast<int32_t>(within / size), g * group + static_cast<int32_t>(within % size)};
}

}  // namespace mok::gemm
