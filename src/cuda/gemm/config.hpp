// Compile-time tile configuration of the grouped-GEMM engine, shared by the kernel and the
// host launchers (no kernel code here).
#pragma once

#include <cstdint>

#include "common/defs.hpp"

namespace mok::gemm {

// Operand orientations of the engine (docs/design.md, "Operand orientations"); host-visible for
// the ops' descriptions.
enum class Operands : int32_t {
  kKMajor = 0,   // A K-major, B K-major: the forward (weights [N, K])
  kBNMajor = 1,  // A K-major, B N-major: dgrad (weights as stored, [K, N])
  kMNMajor = 2,  // A M-major, B N-major: wgrad (both row-major rows, K = rows)
};

// One tile shape of the engine: BLOCK_M x BLOCK_N outputs, two consumer warpgroups of 64 rows
// each, operands of kElemBytes (2: bf16, 1: fp8 e4m3), K-steps of one 128-byte swizzle row of
// them (64 bf16, 128 e4m3).  The stage ring is as deep as 200 KB of shared memory allows.  The
// shape is a parameter of every building block in tile.cuh; the kernels name the one they run
// (TileConfig, 128 x 256 bf16, unless a launch asks for another: the dgrad-down epilogue and
// the fp8 path want 128 x 128, the fused forward 128 x 192 ping-pong).  What the consumers issue per stage is the MMA policy
// (tile.cuh: MmaBf16, MmaE4m3), chosen by the operand bytes.
// kPingPong: the schedule of the consumers.  false (cooperative): both warpgroups share every
// tile, 64 rows each, and read every stage.  true (ping-pong): each warpgroup owns whole tiles in
// turn (all BLOCK_M rows, as kSlabs 64-row slabs), reading only its tiles' stages, so one's
// epilogue runs under the other's MMAs.
// The registers a block of 384 threads (three warpgroups) holds between its setmaxnreg calls: what
// the launch allocates, 168 a thread (65536 / 384 in steps of 8), not the 65536 of the file.  A
// setmaxnreg.inc stalls until its registers are free, so budgets past this pool hang (measured:
// 48 / 232 does, session 22; 40 / 232 and 64 / 216 run).
inline constexpr int kRegisterPool = (65536 / 384) / 8 * 8 * 384;

template <int kBlockM_, int kBlockN_, int kElemBytes_ = 2, bool kPingPong_ = false>
struct TileShape {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kElemBytes = kElemBytes_;
  static constexpr bool kPingPong = kPingPong_;
  static constexpr int kBlockK = 128 / kElemBytes;
  static constexpr int kConsumers = 2;
  static constexpr int kStageReaders = kPingPong ? 1 : kConsumers;  // releases that free a stage
  static constexpr int kSlabs = kPingPong ? kBlockM / 64 : 1;        // 64-row accumulators per consumer
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static constexpr int kATileBytes = kBlockM * kBlockK * kElemBytes;        // 16 KB
  static constexpr int kBHalfBytes = (kBlockN / 2) * kBlockK * kElemBytes;  // 16 KB at N = 256
  static constexpr int kStageBytes = kATileBytes + 2 * kBHalfBytes; // 48 KB at N = 256
  static constexpr int kStages = (200 * 1024) / kStageBytes;        // 4 at N = 256, 6 at N = 128, 5 at 192
  static constexpr int kAccRegs = kBlockN / 2;                      // fp32 per thread of a slab (64 x N / 128)
  static_assert(kBlockM == 128, "two consumer warpgroups of 64 rows");
  static_assert(kBlockN == 128 || kBlockN == 192 || kBlockN == 256, "wgmma N of the generated wrappers");
  static_assert(kElemBytes == 1 || kElemBytes == 2, "operands: bf16 (2 bytes) or fp8 e4m3 (1 byte)");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= kRegisterPool,
                "register budgets exceed what the launch allocates (kRegisterPool)");
};
using TileConfig = TileShape<128, 256>;
using TileConfigN128 = TileShape<128, 128>;
using TileConfigE4m3 = TileShape<128, 128, 1>;  // fp8 operands: the seam of the fp8 recipes
using TileConfigE4m3Wide = TileShape<128, 256, 1>;  // fp8, block-scaled: a B half per 128-column part
using TileConfigPingPong = TileShape<128, 128, 2, true>;  // 128 x 128 tiles, a warpgroup each
using TileConfigPingPong192 = TileShape<128, 192, 2, true>;  // 128 x 192 tiles, a warpgroup each (the fused forward)
static_assert(TileConfig::kStages == 4 && TileConfigPingPong192::kStages == 5, "the measured configurations");

// Channels of I per router-gradient partial of the dgrad-down SwiGLU epilogue (epilogue_bwd.cuh):
// the same for every tile shape, so the partials do not depend on it.
inline constexpr int kDtwChunk = 128;

enum class Epilogue : int32_t {
  kStore = 0,    // out[row, col] = bf16(acc)
  kSwiGLU = 1,   // out[row, ch] = bf16(silu(gate) * up), ch = n_block*BLOCK_N/2 + col (col < BLOCK_N/2)
  kScatter = 2,  // out[token*k + j, col] = bf16(acc) for the plan row's (token, j); padding skipped
  kDgradSwiGLU = 3,  // dgrad down: out = dh = [dg | du] from da = acc and h (epilogue_bwd.cuh); wa, partials
  kGateUpPreact = 4,  // gate/up without the SwiGLU: out = h = [bf16(g) | bf16(u)], g at ch, u at out_ld/2 + ch
  kSwiGLUE4m3 = 5,    // block-scaled 128 x 256 gate/up: a = silu(gate) * up quantised per row and 128 channels
                      // (tile.cuh epilogue_swiglu_e4m3): out e4m3 [rows, I], out_scales [I/128, rows]
  kStoreF32 = 6,      // block-scaled kinds: out[row, col] = acc in fp32 (out_ld floats a row): the fp8
                      // dgrad-down kind's da, which the SwiGLU-backward pass reads (swiglu_bwd_fp8.cu)
};

// Tiles of `tile` covering n (model dimensions are multiples of 64, tiles 128 or 256 wide:
// the last tile of a dimension may be partial; its loads past the end read neighbouring rows
// or TMA's zero fill, and the epilogues write only the columns below n).
MOK_HD int32_t tiles_of(int64_t n, int64_t tile) { return static_cast<int32_t>(ceil_div(n, tile)); }

// Bits of the wgrad kind's per-expert mode (gemm/wgrad.cuh; < 0: the expert is skipped)
inline constexpr int32_t kWgradAccumulate = 1, kWgradStoreAcc = 2, kWgradFinal = 4;

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
