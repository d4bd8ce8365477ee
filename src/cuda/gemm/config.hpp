// Compile-time tile configuration of the grouped-GEMM engine, shared by the kernel and the
// host launchers (no kernel code here).
#pragma once

#include <cstdint>

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

}  // namespace mok::gemm
