// Building blocks of one 128 x 256 output tile, shared by the grouped-GEMM kernel and the
// fused megakernel: the stage ring in shared memory, the producer's loads, the consumers'
// MMAs, and the epilogues.
//
// Roles (one warpgroup each):
//   producer   one thread issues TMA loads into a kStages-deep ring of stages
//   consumer0  rows [0, 64) of the tile: wgmma m64n256k16, fp32 accumulators in registers
//   consumer1  rows [64, 128)
// Barriers (mbarrier, one pair per stage):
//   pipe.full[s]   producer -> consumers: stage s holds A and B (TMA transaction bytes)
//   pipe.empty[s]  consumers -> producer: both warpgroups finished reading stage s
//
// B arrives as two 128-row halves per stage, each from its own tensor map.  For gate/up the
// halves are w_gate and w_up rows of the same 128 intermediate channels, so one 256-wide
// accumulator holds matching gate (cols 0..127) and up (cols 128..255) values in the same
// thread and the SwiGLU runs in the epilogue with no weight re-layout.  For down both
// halves come from w_down (rows n*256 and n*256+128).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "common/defs.hpp"
#include "cuda/gemm/config.hpp"
#include "cuda/gemm/pipeline.cuh"
#include "cuda/gemm/quantize.cuh"
#include "cuda/ptx/wgmma.cuh"

namespace mok::gemm {

inline constexpr int kNChunkElems = 64 * TileConfig::kBlockK;  // one 64 N x 64 K box (N- or MN-major): 8 KB
static_assert(TileConfig::kBlockN % 64 == 0 &&
                  (TileConfig::kBlockN / 64) * kNChunkElems * 2 == 2 * TileConfig::kBHalfBytes &&
                  (TileConfigN128::kBlockN / 64) * kNChunkElems * 2 == 2 * TileConfigN128::kBHalfBytes,
              "an N-major B stage is kBlockN/64 boxes of 64 x 64 and as large as the K-major one");

// The MMA step of the engine: what a consumer warpgroup issues on one stage (one k-block) for
// its 64 rows, by operand orientation (gemm::Operands, config.hpp); consume_tile runs the
// pipeline around it.  A policy per operand type, the Mma of a precision (below):
//   MmaBf16   bf16 x bf16 -> fp32, every orientation (the wgmma transpose bits)
//   MmaE4m3   e4m3 x e4m3 -> fp32, K-major only (Hopper's fp8 wgmma has no transpose bits: an
//             fp8 dgrad or wgrad reads transposed fp8 copies).  No scales: the block-scaled
//             recipes (a scale per 128 of K, promoted into the fp32 sum once per k-block) add
//             them around this step.
struct MmaBf16 {
  template <Operands kOps>
  static constexpr bool kSupports = true;
  template <Operands kOps, class T, class S>
  __device__ __forceinline__ static void issue(float (&acc)[T::kAccRegs], S& s, int index,
                                               int consumer, int kb) {
    using C = T;
    if constexpr (kOps == Operands::kKMajor) {
      const uint64_t desc_a = ptx::desc_kmajor_sw128(s.a[index] + consumer * 64 * C::kBlockK);
      const uint64_t desc_b = ptx::desc_kmajor_sw128(s.b[index]);
      ptx::wgmma_fence();
#pragma unroll
      for (int k = 0; k < C::kBlockK / 16; ++k)
        ptx::mma_bf16<C::kBlockN>(acc, desc_a + 2 * k, desc_b + 2 * k, (kb | k) != 0);
    } else if constexpr (kOps == Operands::kBNMajor) {
      const uint64_t desc_a = ptx::desc_kmajor_sw128(s.a[index] + consumer * 64 * C::kBlockK);
      const uint64_t desc_b = ptx::desc_mnmajor_sw128(s.b[index], kNChunkElems * 2);
      ptx::wgmma_fence();
#pragma unroll
      for (int k = 0; k < C::kBlockK / 16; ++k)
        ptx::mma_bf16_tb<C::kBlockN>(acc, desc_a + 2 * k, desc_b + 128 * k, (kb | k) != 0);
    } else {
      // NOTES: A's box is exactly this warpgroup's 64 rows, so its LBO (between 64-row
      // chunks) is never used; B's boxes are 8 KB apart.
      const uint64_t desc_a = ptx::desc_mnmajor_sw128(s.a[index] + consumer * kNChunkElems, kNChunkElems * 2);
      const uint64_t desc_b = ptx::desc_mnmajor_sw128(s.b[index], kNChunkElems * 2);
      ptx::wgmma_fence();
#pragma unroll
      for (int k = 0; k < C::kBlockK / 16; ++k)
        ptx::mma_bf16_tatb<C::kBlockN>(acc, desc_a + 128 * k, desc_b + 128 * k, (kb | k) != 0);
    }
  }
};
struct MmaE4m3 {
  template <Operands kOps>
  static constexpr bool kSupports = kOps == Operands::kKMajor;
  template <Operands kOps, class T, class S>
  __device__ __forceinline__ static void issue(float (&acc)[T::kAccRegs], S& s, int index,
                                               int consumer, int kb) {
    using C = T;
    static_assert(kSupports<kOps>, "fp8 wgmma reads K-major operands only");
    static_assert(C::kElemBytes == 1, "e4m3 operands are one byte");
    // One 128-byte row holds 128 e4m3: a k32 step is 32 bytes along K, +2 in the descriptor
    const uint64_t desc_a = ptx::desc_kmajor_sw128(s.a[index] + consumer * 64 * C::kBlockK);
    const uint64_t desc_b = ptx::desc_kmajor_sw128(s.b[index]);
    ptx::wgmma_fence();
#pragma unroll
    for (int k = 0; k < C::kBlockK / 32; ++k)
      ptx::mma_e4m3<C::kBlockN>(acc, desc_a + 2 * k, desc_b + 2 * k, (kb | k) != 0);
  }
};

// The precisions of the engine: what a tile's operands are and how a consumer multiplies them
// (the fused kernels are instantiated with one: fused/policy.cuh).
//   kElemBytes, Elem   the operand element, in shared memory and in the tensor maps
//   Mma                the MMA step of one stage (MmaBf16, MmaE4m3 above)
//   StageScales<T>     what a stage of tile shape T holds besides its operands: a block-scaled
//                      precision's scales of the stage's k-block (NoScales: none)
//   ScaleMaps          the tensor maps of those scales, beside a kernel's operand maps (NoScales)
//   kBlockScaled       the k-block's sum is promoted into the fp32 accumulator with scales
//                      (consume_tile_block_scaled), kScaleTxBytes<T> of them in each stage
// PrecisionE4m3 is the unscaled seam of the fp8 recipes (the standalone e4m3 launches);
// PrecisionE4m3Block is DeepSeek-V3's block scaling: A scaled per row and 128 of K, B per 128 x
// 128 block, one fp32 FFMA an element per k-block (128 of K) promoting the fp8 MMAs' partial sum.
struct NoScales {};
// The scales of each stage's k-block: A's, one per tile row (a TMA box of BLOCK_M fp32), and
// the two B halves' 128 x 128 blocks' (sb[stage][h]: the producer's cp.async copies, whose
// completion is the second arrival on the stage's full barrier), so that neither the consumers
// nor the producer waits on a global load in its K loop
template <class T>
struct BlockScales {
  alignas(128) float sa[T::kStages][T::kBlockM];
  float sb[T::kStages][2];
};
// The scales of each stage's k-block when both operands are scaled per row (A per tile row, B
// per tile column), each one TMA box: the K-grouped wgrad's operands, quantised per 128 rows
// (tokens) of the expert and per channel (PrecisionE4m3Rows)
template <class T>
struct RowScales {
  alignas(128) float sa[T::kStages][T::kBlockM];
  alignas(128) float sb[T::kStages][T::kBlockN];
};
// kPromoted: each k-block's MMA sum is promoted into the fp32 accumulator with the stage's
// scales, and each warp of a reader releases the stage (it read the scales itself);
// kMmaTurns (promoted only): the two consumers issue their parts' MMAs in turns
// (consume_tile_promoted), each once the other's are issued; what it buys depends on the kind
// (docs/perf.md session 28: +5 % the dgrad kinds, -3 % the wgrad kind and the scatter
// epilogue's down, -7 % the fused forward), so the kinds choose (MmaTurns);
// kStageFills: the arrivals that fill a stage (the producer's, and cp.async's for E4m3Block)
struct PrecisionBf16 {
  static constexpr int kElemBytes = 2;
  using Elem = __nv_bfloat16;
  using Mma = MmaBf16;
  template <class T>
  using StageScales = NoScales;
  using ScaleMaps = NoScales;
  static constexpr bool kBlockScaled = false;
  static constexpr bool kPromoted = false;
  static constexpr int kStageFills = 1;
  template <class T>
  static constexpr uint32_t kScaleTxBytes = 0;
};
struct PrecisionE4m3 {
  static constexpr int kElemBytes = 1;
  using Elem = __nv_fp8_e4m3;
  using Mma = MmaE4m3;
  template <class T>
  using StageScales = NoScales;
  using ScaleMaps = NoScales;
  static constexpr bool kBlockScaled = false;
  static constexpr bool kPromoted = false;
  static constexpr int kStageFills = 1;
  template <class T>
  static constexpr uint32_t kScaleTxBytes = 0;
};
struct PrecisionE4m3Block : PrecisionE4m3 {
  template <class T>
  using StageScales = BlockScales<T>;  // (ScaleMaps: the standalone launches pass A's scale map)
  static constexpr bool kBlockScaled = true;
  static constexpr bool kPromoted = true;
  static constexpr bool kMmaTurns = false;
  static constexpr int kStageFills = 2;
  template <class T>
  static constexpr uint32_t kScaleTxBytes = T::kBlockM * sizeof(float);  // A's; B's come by cp.async
};
// Both operands scaled per row and 128 of K (the fp8 wgrad kind, gemm/wgrad_fp8.cuh)
struct PrecisionE4m3Rows : PrecisionE4m3 {
  template <class T>
  using StageScales = RowScales<T>;
  static constexpr bool kPromoted = true;
  static constexpr bool kMmaTurns = false;
  static constexpr int kStageFills = 1;
  template <class T>
  static constexpr uint32_t kScaleTxBytes = (T::kBlockM + T::kBlockN) * sizeof(float);
};
// The precision of a tile shape's operand bytes (the standalone launches name shapes only)
template <class T>
using PrecisionOf = std::conditional_t<T::kElemBytes == 1, PrecisionE4m3, PrecisionBf16>;
// A promoted precision whose consumers issue their MMAs in turns (kMmaTurns above)
template <class P>
struct MmaTurns : P {
  static constexpr bool kMmaTurns = true;
};

// The stage ring of one tile shape T (config.hpp) in precision Prec (below: the operands' element,
// and what a stage holds besides them, its StageScales: a base, empty for bf16, so that the
// operands' offsets do not move).
template <class T, class Prec = PrecisionOf<T>>
struct StageStorageT : Prec::template StageScales<T> {
  using Tile = T;
  using Precision = Prec;
  using Elem = typename Prec::Elem;
  static_assert(Prec::kElemBytes == T::kElemBytes, "a tile shape's operand bytes are its precision's");
  // What a stage's full barrier expects: the operands and the k-block's scales
  static constexpr uint32_t kTxBytes = T::kStageBytes + Prec::template kScaleTxBytes<T>;
  // Arrivals that free a stage: one a reader (warpgroup), one a warp of it when each warp reads
  // the stage's scales itself (block-scaled)
  static constexpr int kReleases = T::kStageReaders * (Prec::kPromoted ? 4 : 1);
  alignas(1024) Elem a[T::kStages][T::kBlockM * T::kBlockK];  // (BLOCK_M, BLOCK_K, kStages)
  alignas(1024) Elem b[T::kStages][T::kBlockN * T::kBlockK];  // (BLOCK_N, BLOCK_K, kStages)
  Pipeline<T::kStages> pipe;  // the stages' full/empty barriers
  // Ping-pong: turn[c] completes a phase when the other consumer has passed every stage wait of
  // its tile, so that consumer c waits on its next tile's stages at most one phase ahead of
  // their barriers (an mbarrier's parity cannot tell phase p from p + 2).  Promoted, with MMA
  // turns (cooperative): turn[c] completes a phase when the other consumer's four warps have
  // issued a part's MMAs, consumer 0's first part's turn at init (consume_tile_promoted).
  uint64_t turn[2];

  // Arrivals that fill a stage: the producer's with the TMA bytes, and a block-scaled stage's
  // B scales' (the completion of the producer's cp.async copies)
  static constexpr int kFills = Prec::kStageFills;
  __device__ void init_barriers() {
    pipe.init(kFills, kReleases);
    if constexpr (T::kPingPong) {
      ptx::mbar_init(&turn[0], 1);
      ptx::mbar_init(&turn[1], 1);
    } else if constexpr (Prec::kPromoted) {
      if constexpr (Prec::kMmaTurns) {
        ptx::mbar_init(&turn[0], 4);
        ptx::mbar_init(&turn[1], 4);
        for (int w = 0; w < 4; ++w) ptx::mbar_arrive(&turn[0]);
      }
    }
  }
};
using StageStorage = StageStorageT<TileConfig>;
template <class T, class Prec = PrecisionOf<T>>
inline constexpr size_t kStageStorageBytesT = sizeof(StageStorageT<T, Prec>);
inline constexpr size_t kStageStorageBytes = kStageStorageBytesT<TileConfig>;
// The dynamic shared memory of a standalone kernel of tile shape T in precision Prec
// (grouped_gemm.cuh, wgrad.cuh)
template <class T, class Prec = PrecisionOf<T>>
inline constexpr size_t kGemmSmemBytesT = kStageStorageBytesT<T, Prec> + 1024;  // + alignment slack

// A ping-pong consumer warpgroup's turns (StageStorageT::turn), in the order the producer fills
// the tiles: owns() counts a tile and says whether this warpgroup owns it (tiles alternate);
// before its tile's stage waits the owner wait()s until the other warpgroup has passed every
// stage wait of the tile before (every tile but the block's first), and once its own have
// passed it pass()es the turn on.  So a warpgroup waits on stages at most one phase ahead of
// their barriers (an mbarrier's parity cannot tell phase p from p + 2).
struct PingPongTurns {
  int taken = 0;  // tiles so far
  uint32_t phase = 0;
  __device__ __forceinline__ bool owns(int consumer) { return (taken++ & 1) == consumer; }
  template <class S>
  __device__ __forceinline__ bool wait(S& s, int consumer, const WaitContext& ctx) {
    if (taken <= 1) return true;
    if (!wait_barrier_warp(&s.turn[consumer], phase, ctx, WaitSite::kPingPongTurn, consumer)) return false;
    phase ^= 1u;
    return true;
  }
  template <class S>
  __device__ __forceinline__ static void pass(S& s, int consumer) {
    if (threadIdx.x % 128 == 0) ptx::mbar_arrive(&s.turn[consumer ^ 1]);
  }
};

// Where one tile's operands come from.
struct TileLoad {
  const CUtensorMap* a;   // rows a_row .. a_row+BLOCK_M-1, all K
  const CUtensorMap* b0;  // rows b_row .. b_row+BLOCK_N/2-1
  const CUtensorMap* b1;  // rows b_row + b_half_offset .. +BLOCK_N/2-1
  int32_t a_row;
  int32_t b_row;
  int32_t b_half_offset;
  int32_t num_k_blocks;
  // Block-scaled precisions: A's scales, [K / BLOCK_K rows, A's rows] fp32 (the tile's BLOCK_M
  // scales of a k-block are one box at (a_row, kb)); the B halves' 128 x 128 blocks' scales, a
  // k-block's at sb0[kb · sb_k_stride] and sb1[kb · sb_k_stride]
  const CUtensorMap* sa = nullptr;
  const float* sb0 = nullptr;
  const float* sb1 = nullptr;
  int32_t sb_k_stride = 1;
  // K split (block-scaled only; 0: none): k-blocks [0, k_split) read both B halves from b0,
  // the rest from b1 at k-blocks from 0 (the dgrad gate/up kind on the weights' transposed
  // copies, K = 2I: W_gateᵀ's, then W_upᵀ's); the halves' scales then sb0 / sb0_hi for the
  // first part and sb1 / sb1_hi for the second (half 0 / half 1)
  int32_t k_split = 0;
  const float* sb0_hi = nullptr;
  const float* sb1_hi = nullptr;
};

// The producer's loop: for each k-block of [first, last), wait for an empty stage, arm its full
// barrier with the stage's bytes and issue `load(kb, stage_index, full)`.  False on a timed-out
// wait.
template <class T, class P, typename Load>
__device__ __forceinline__ bool produce_stages(StageStorageT<T, P>& s, PipelineState<T::kStages>& stage, int first,
                                               int last, const WaitContext& wait, Load load) {
  for (int kb = first; kb < last; ++kb) {
    // Wait for empty slot
    if (!s.pipe.producer_acquire(stage, wait)) return false;
    uint64_t* full = s.pipe.full_barrier(stage);
    ptx::mbar_arrive_expect_tx(full, StageStorageT<T, P>::kTxBytes);
    load(kb, stage.index, full);
    stage.advance();
  }
  return true;
}
template <class T, class P, typename Load>
__device__ __forceinline__ bool produce_stages(StageStorageT<T, P>& s, PipelineState<T::kStages>& stage,
                                               int num_k_blocks, const WaitContext& wait, Load load) {
  return produce_stages(s, stage, 0, num_k_blocks, wait, load);
}

// Producer of a forward tile: activations and both weight halves per stage; a block-scaled
// precision's scales too: A's k-block box by TMA, and the B halves' two block scales, loaded
// one k-block ahead (so their load runs under the next stage's acquire and copies), stored into
// the stage, then the stage's second arrival (a release: the consumers' wait sees the stores)
template <class T, class P>
__device__ __forceinline__ bool produce_tile(StageStorageT<T, P>& s, PipelineState<T::kStages>& stage,
                                             const TileLoad& t, const WaitContext& wait) {
  using C = T;
  auto operands = [&](int kb, int i, uint64_t* full) {
    ptx::tma_load_2d(s.a[i], t.a, full, kb * C::kBlockK, t.a_row);
    ptx::tma_load_2d(s.b[i], t.b0, full, kb * C::kBlockK, t.b_row);
    ptx::tma_load_2d(s.b[i] + (C::kBlockN / 2) * C::kBlockK, t.b1, full, kb * C::kBlockK, t.b_row + t.b_half_offset);
  };
  if constexpr (P::kBlockScaled) {
    // B's two scales of the k-block land in the stage by cp.async, whose completion is the full
    // barrier's second arrival: the producer never waits on a global load (a load it waited on
    // bounded the ring at one L2 round trip a k-block)
    if (t.k_split > 0) {
      return produce_stages(s, stage, t.num_k_blocks, wait, [&](int kb, int i, uint64_t* full) {
        const bool second = kb >= t.k_split;
        const int32_t kl = second ? kb - t.k_split : kb;  // the k-block in its part
        const CUtensorMap* b = second ? t.b1 : t.b0;
        ptx::tma_load_2d(s.a[i], t.a, full, kb * C::kBlockK, t.a_row);
        ptx::tma_load_2d(s.b[i], b, full, kl * C::kBlockK, t.b_row);
        ptx::tma_load_2d(s.b[i] + (C::kBlockN / 2) * C::kBlockK, b, full, kl * C::kBlockK, t.b_row + t.b_half_offset);
        ptx::tma_load_2d(s.sa[i], t.sa, full, t.a_row, kb);
        ptx::cp_async_4(&s.sb[i][0], (second ? t.sb1 : t.sb0) + kl * t.sb_k_stride);
        ptx::cp_async_4(&s.sb[i][1], (second ? t.sb1_hi : t.sb0_hi) + kl * t.sb_k_stride);
        ptx::cp_async_mbar_arrive_noinc(full);
      });
    }
    return produce_stages(s, stage, t.num_k_blocks, wait, [&](int kb, int i, uint64_t* full) {
      operands(kb, i, full);
      ptx::tma_load_2d(s.sa[i], t.sa, full, t.a_row, kb);
      ptx::cp_async_4(&s.sb[i][0], t.sb0 + kb * t.sb_k_stride);
      ptx::cp_async_4(&s.sb[i][1], t.sb1 + kb * t.sb_k_stride);
      ptx::cp_async_mbar_arrive_noinc(full);
    });
  } else {
    return produce_stages(s, stage, t.num_k_blocks, wait, operands);
  }
}

// Where one tile's operands come from when B is N-major (the dgrad GEMMs: weights read as
// they are stored, [K rows, N contiguous]).  A stage holds A (128 x 64, K-major) and B as
// four boxes of 64 N x 64 K (N-major), box c at b + c * kNChunkElems.  The K loop reads
// b0 for k-blocks [0, k_split_blocks) and b1 after (dgrad gate/up: w_gate then w_up rows).
struct TileLoadNMajor {
  const CUtensorMap* a;   // rows a_row .. a_row+127, all K
  const CUtensorMap* b0;  // [K rows of every expert, N]
  const CUtensorMap* b1;
  int32_t a_row;
  int32_t b_row;          // first K row of the expert in b0 / b1
  int32_t n0;             // first output column of the tile
  int32_t k_split_blocks;
  int32_t num_k_blocks;
};

// Producer of a dgrad tile: the A tile and the four N boxes of B at the k-block's K rows.
template <class T, class P>
__device__ __forceinline__ bool produce_tile_nmajor(StageStorageT<T, P>& s, PipelineState<T::kStages>& stage,
                                                    const TileLoadNMajor& t, const WaitContext& wait) {
  using C = T;
  return produce_stages(s, stage, t.num_k_blocks, wait, [&](int kb, int i, uint64_t* full) {
    ptx::tma_load_2d(s.a[i], t.a, full, kb * C::kBlockK, t.a_row);
    const bool second = kb >= t.k_split_blocks;
    const CUtensorMap* map = second ? t.b1 : t.b0;
    const int32_t k_row = t.b_row + (second ? kb - t.k_split_blocks : kb) * C::kBlockK;
#pragma unroll
    for (int c = 0; c < C::kBlockN / 64; ++c) ptx::tma_load_2d(s.b[i] + c * kNChunkElems, map, full, t.n0 + c * 64, k_row);
  });
}

// Consumer warpgroup `consumer`: acc = A[rows of this warpgroup] · B over all k-blocks (at
// least one), the operands in the stage as `kOps` says, each k-block issued by the MMA policy.
// Cooperative tiles: the warpgroup's 64 rows (consumer selects them).  Ping-pong tiles: every
// row, slab j (rows 64j .. 64j + 63) into acc[j]; the k-block's MMAs are one group.
// after_waits() runs once every stage wait of the tile has passed (before the last MMAs drain).
struct NoHook {
  __device__ __forceinline__ void operator()() const {}
};
template <Operands kOps = Operands::kKMajor, class T, class P, class AfterWaits = NoHook>
__device__ __forceinline__ bool consume_tile(StageStorageT<T, P>& s, PipelineState<T::kStages>& stage,
                                             int num_k_blocks, int consumer, float (&acc)[T::kSlabs][T::kAccRegs],
                                             const WaitContext& wait, AfterWaits after_waits = {}) {
  const bool leader = threadIdx.x % 128 == 0;
  int prev_index = 0;
  for (int kb = 0; kb < num_k_blocks; ++kb) {
    // Wait for the stage, then issue its MMAs
    if (!s.pipe.consumer_wait(stage, wait)) return false;
#pragma unroll
    for (int j = 0; j < T::kSlabs; ++j)
      P::Mma::template issue<kOps, T>(acc[j], s, stage.index, T::kPingPong ? j : consumer, kb);
    ptx::wgmma_commit();
    // NOTES: no register fence here: touching acc while a group is in flight makes ptxas
    // inject a wait (C7517) and serialise the MMAs.
    // Release the previous stage once its MMAs retired (one group stays in flight)
    if (kb > 0) {
      ptx::wgmma_wait<1>();
      if (leader) s.pipe.consumer_release(prev_index);
    }
    prev_index = stage.index;
    stage.advance();
  }
  after_waits();
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < T::kSlabs; ++j) ptx::fence_regs(acc[j]);
  if (leader) s.pipe.consumer_release(prev_index);
  return true;
}
// A cooperative tile's one slab
template <Operands kOps = Operands::kKMajor, class T, class P>
__device__ __forceinline__ bool consume_tile(StageStorageT<T, P>& s, PipelineState<T::kStages>& stage,
                                             int num_k_blocks, int consumer, float (&acc)[T::kAccRegs],
                                             const WaitContext& wait) {
  static_assert(T::kSlabs == 1, "a ping-pong tile has a slab per 64 rows");
  return consume_tile<kOps>(s, stage, num_k_blocks, consumer, reinterpret_cast<float(&)[1][T::kAccRegs]>(acc),
                                    wait);
}

// Block-scaled consumer warpgroup `consumer` (P::kBlockScaled; cooperative tiles, K-major
// operands): per k-block (128 of K) and per 128 columns of the tile (a part: one of a 256-wide
// tile's B halves, or a 128-wide tile's two halves together), the MMAs into a fresh partial
// sum, then, in fp32,
//   acc = fma(partial, sa[row] · sb[half], acc)       (sa · sb rounded to fp32 first)
// with sa the stage's scale of the row (A: per row and k-block) and sb[half] the stage's scale
// of the k-block's 128 x 128 block of the column's B half (BlockScales: both come with the
// stage's operands).  So the fp8 MMAs' sum, kept to a partial of 128 products, is promoted
// once per k-block; one partial of 64 registers serves the parts in turn.  acc starts at zero.
// Each warp releases the stage once its scales are in registers and its last MMAs retired (the
// stage's barrier counts a release a warp: StageStorageT::kReleases).  NOTES: a partial is
// waited for before its promotion (wgmma.wait 0): the other warpgroup's MMAs run meanwhile.
// The promoted K loop of every fp8 scaled precision (block-scaled here, per-row-scaled for the
// wgrad kind: gemm/wgrad_fp8.cuh): per k-block, sc = scales_of(i, row) from stage i (before
// its release), then per part q of 128 columns its four k32 MMAs into the partial, waited for,
// and promote(sc, i, row, q, part, acc + 64 q) folding the partial into the accumulator.
template <class T, class P, class ScalesOf, class Promote>
__device__ __forceinline__ bool consume_tile_promoted(StageStorageT<T, P>& s, PipelineState<T::kStages>& stage,
                                                      int num_k_blocks, int consumer, float (&acc)[T::kAccRegs],
                                                      const WaitContext& wait, ScalesOf scales_of, Promote promote) {
  static_assert(P::kPromoted && !T::kPingPong, "promoted tiles are cooperative");
  static_assert(T::kBlockN % 128 == 0 && T::kBlockK == 128, "parts of 128 columns, k-blocks of 128");
  constexpr int kParts = T::kBlockN / 128, kPartRegs = 64;  // m64n128: 64 fp32 a thread
  // The MMA turns (P::kMmaTurns): each warpgroup's n-th part waits for phase n of its turn
  // barrier (consumer 0: the init's, then consumer 1's part n - 1 issued; consumer 1: consumer 0's
  // part n issued), so the two warpgroups' parts reach the tensor cores alternately rather than
  // at once.  Whether that is faster is the kind's (measured: docs/perf.md session 28).  n's
  // parity from the stage: the k-blocks so far are the stage's index modulo 2 when the ring is
  // even.
  static_assert(!P::kMmaTurns || kParts % 2 == 0 || T::kStages % 2 == 0, "the turns' parity from the stage");
  const bool warp_leader = threadIdx.x % 32 == 0;
  const int row = consumer * 64 + ((threadIdx.x / 32) % 4) * 16 + (threadIdx.x % 32) / 4;  // and row + 8
  float part[kPartRegs];
#pragma unroll
  for (int i = 0; i < T::kAccRegs; ++i) acc[i] = 0.0f;
  for (int kb = 0; kb < num_k_blocks; ++kb) {
    if (!s.pipe.consumer_wait(stage, wait)) return false;
    const int i = stage.index;
    const uint64_t desc_a = ptx::desc_kmajor_sw128(s.a[i] + consumer * 64 * T::kBlockK);
    const auto sc = scales_of(i, row);
#pragma unroll
    for (int q = 0; q < kParts; ++q) {
      // The part's four k32 steps: B rows [128 q, 128 q + 128) of the stage, a fresh sum
      const uint64_t desc_b = ptx::desc_kmajor_sw128(s.b[i] + q * 128 * T::kBlockK);
      if constexpr (P::kMmaTurns) {
        const uint32_t parity = static_cast<uint32_t>((i & 1) * kParts + q) & 1u;
        if (!wait_barrier_warp(&s.turn[consumer], parity, wait, WaitSite::kMmaTurn, consumer)) return false;
      }
      ptx::wgmma_fence();
#pragma unroll
      for (int k = 0; k < T::kBlockK / 32; ++k) ptx::mma_e4m3<128>(part, desc_a + 2 * k, desc_b + 2 * k, k != 0);
      ptx::wgmma_commit();
      if constexpr (P::kMmaTurns) {
        if (warp_leader) ptx::mbar_arrive(&s.turn[consumer ^ 1]);
      }
      ptx::wgmma_wait<0>();
      ptx::fence_regs(part);
      promote(sc, i, row, q, part, acc + q * kPartRegs);
    }
    // The stage is free once the last part's MMAs retired and the warp's scale loads were
    // used (a register dependency, besides the arrival's release order)
    ptx::fence_regs(acc);
    if (warp_leader) s.pipe.consumer_release(i);
    stage.advance();
  }
  return true;
}

template <class T, class P>
__device__ __forceinline__ bool consume_tile_block_scaled(StageStorageT<T, P>& s, PipelineState<T::kStages>& stage,
                                                          int num_k_blocks, int consumer, float (&acc)[T::kAccRegs],
                                                          const WaitContext& wait) {
  static_assert(P::kBlockScaled, "block-scaled stages");
  constexpr int kHalfCols = T::kBlockN / 2;  // columns of a B half
  // The rows' A scales and the two B halves' block scales of the k-block
  const auto scales_of = [&s](int i, int row) {
    return float4{ptx::ld_shared_f32(&s.sa[i][row]), ptx::ld_shared_f32(&s.sa[i][row + 8]),
                  ptx::ld_shared_f32(&s.sb[i][0]), ptx::ld_shared_f32(&s.sb[i][1])};
  };
  const auto promote = [](const float4& sc, int, int, int q, const float (&part)[64], float* acc_q) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      // columns 128 q + 8 j .. + 7 of the tile: B half (128 q + 8 j) / kHalfCols
      const bool second = (128 * q + 8 * j) / kHalfCols == 1;
      const float lo = sc.x * (second ? sc.w : sc.z), hi = sc.y * (second ? sc.w : sc.z);
      float* const a = acc_q + j * 4;
      a[0] = fmaf(part[j * 4 + 0], lo, a[0]);
      a[1] = fmaf(part[j * 4 + 1], lo, a[1]);
      a[2] = fmaf(part[j * 4 + 2], hi, a[2]);
      a[3] = fmaf(part[j * 4 + 3], hi, a[3]);
    }
  };
  return consume_tile_promoted(s, stage, num_k_blocks, consumer, acc, wait, scales_of, promote);
}

// ---- epilogues: one consumer's 64 x 256 accumulator tile ------------------------------------
// Fragment layout (wgmma D): thread (warp w, lane l) holds, for n8 in [0, 32), columns
// n8*8 + (l%4)*2 + {0,1} of rows w*16 + l/4 (regs n8*4 + {0,1}) and +8 (regs n8*4 + {2,3}).

// The byte offset, in a 64-row box of 128-byte rows in TMA's 128-byte swizzle (the 16-byte chunk
// c of row r at c ^ r % 8), of the 4-byte word t of row r's chunk c: what a lane of a quad reads
// or writes of the fragment's n8 block c, conflict-free.
__device__ __forceinline__ uint32_t swizzled_word(int r, int chunk, int t) {
  return static_cast<uint32_t>(r * 128 + ((chunk ^ (r & 7)) << 4) + 4 * t);
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

// Row of this thread within the tile for half h (0: regs {0,1}, 1: regs {2,3}).
__device__ __forceinline__ int fragment_row(int consumer, int half) {
  return consumer * 64 + ((threadIdx.x / 32) % 4) * 16 + (threadIdx.x % 32) / 4 + half * 8;
}

// The pairs p0, p1 of n8 blocks b (even) and b + 1 of this thread's row, stored at row + 8b in
// 8-byte pieces: lanes t and t^1 of the quad swap one pair (one shuffle), so even lanes hold
// block b's columns 4(t/2) .. +3 and odd lanes block b+1's; one warp store then writes 32
// contiguous bytes (a whole sector) of each of its 8 rows.  Every lane must call it.
__device__ __forceinline__ void store_block_pair_8b(__nv_bfloat16* row_b, uint32_t p0, uint32_t p1, bool write) {
  const int t = threadIdx.x & 3;
  const bool odd = (t & 1) != 0;
  const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? p0 : p1, 1);
  ptx::st_global_v2_pred(row_b + (odd ? 8 : 0) + 4 * (t >> 1), odd ? got : p0, odd ? p1 : got, write);
}

// Stores this thread's row of `kBlocks` n8 blocks (pairs from `pair(n8)`) at dst + n8*8,
// two blocks per store_block_pair_8b: one shuffle per two pairs (a 16-byte-per-lane quad
// transpose took 4 shuffles and 28 selects per four, and was 2-12 % slower in whole kinds,
// docs/perf.md session 13).  `write` predicates the stores only; so does `cols`: the row's
// columns [0, cols) exist (the last tile of a dimension may be partial; cols is a multiple of
// 64, a pair of blocks 16 columns, so a pair is wholly in or out).
template <int kBlocks, typename Pair>
__device__ __forceinline__ void store_row(__nv_bfloat16* dst, bool write, int64_t cols, Pair pair) {
#pragma unroll
  for (int b = 0; b < kBlocks; b += 2) store_block_pair_8b(dst + b * 8, pair(b), pair(b + 1), write && b * 8 < cols);
}

// Epilogues take the accumulator of any tile shape: kRegs = BLOCK_N / 2 registers, the tile's
// BLOCK_N / 8 n8 blocks.  Their output rows are contiguous, ld wide: each writes rows below its
// row limit and columns below ld (the last tile of a dimension may be partial: its other
// accumulator columns hold products of rows past the matrix, never stored).
// out[row0 + r, ch0 + c] = bf16(silu(gate) * up) for r < rows_limit - row0, c < BLOCK_N / 2,
// ch0 + c < ld (gate in the accumulator's first half of columns, up in the second).
template <int kRegs>
__device__ __forceinline__ void epilogue_swiglu(const float (&acc)[kRegs], int consumer,
                                                __nv_bfloat16* out, int64_t ld, int64_t row0, int64_t rows_limit,
                                                int64_t ch0) {
  constexpr int kHalfBlocks = kRegs / 8;  // n8 blocks of the gate half
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = row0 + fragment_row(consumer, half);
    store_row<kHalfBlocks>(out + row * ld + ch0, row < rows_limit, ld - ch0, [&](int n8) {
      const float g0 = acc[n8 * 4 + half * 2], g1 = acc[n8 * 4 + half * 2 + 1];
      const float u0 = acc[(n8 + kHalfBlocks) * 4 + half * 2], u1 = acc[(n8 + kHalfBlocks) * 4 + half * 2 + 1];
      return pack_bf16x2(silu(g0) * u0, silu(g1) * u1);
    });
  }
}

// The SwiGLU quantised for the down GEMM (Epilogue::kSwiGLUE4m3; block-scaled 128 x 256 tiles,
// whose gate half is one scale block of 128 channels): a = silu(gate) · up in fp32; per row, s =
// max |a| over the tile's channels / 448 (1 when 0; pow2: its power-of-two ceiling,
// e4m3_block_scale), out[row0 + r, ch0 + c] = e4m3(a / s)
// (round to nearest even, saturating) and scales[(ch0 / 128) · scales_ld + row0 + r] = s, for
// rows below rows_limit: mok.fp8.quantize_rows of the fp32 a, bit for bit, and the down kind's
// A scales as they are read (k-block-major).  out rows ld bytes apart (ld = I, I % 128 == 0).
template <int kRegs>
__device__ __forceinline__ void epilogue_swiglu_e4m3(const float (&acc)[kRegs], int consumer, uint8_t* out,
                                                     int64_t ld, int64_t row0, int64_t rows_limit, int64_t ch0,
                                                     float* scales, int64_t scales_ld, bool pow2) {
  constexpr int kHalfBlocks = kRegs / 8;  // n8 blocks of the gate half
  static_assert(kHalfBlocks * 8 == 128, "the gate half of the tile is one scale block of 128 channels");
  const int quad_lane = threadIdx.x % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = row0 + fragment_row(consumer, half);
    float a[2 * kHalfBlocks];
    float amax = 0.0f;
#pragma unroll
    for (int n8 = 0; n8 < kHalfBlocks; ++n8) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        a[2 * n8 + e] = silu(acc[n8 * 4 + half * 2 + e]) * acc[(n8 + kHalfBlocks) * 4 + half * 2 + e];
        amax = fmaxf(amax, fabsf(a[2 * n8 + e]));
      }
    }
    // The row's 128 channels are in the four lanes of its quad
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const float s = e4m3_block_scale(amax, pow2);
    const E4m3Divisor d = e4m3_divisor(s);
    if (row >= rows_limit) continue;
    uint8_t* const dst = out + row * ld + ch0 + quad_lane * 2;
#pragma unroll
    for (int n8 = 0; n8 < kHalfBlocks; ++n8)
      *reinterpret_cast<__nv_fp8x2_storage_t*>(dst + n8 * 8) = e4m3x2(a[2 * n8], a[2 * n8 + 1], d);
    if (quad_lane == 0) scales[(ch0 / 128) * scales_ld + row] = s;
  }
}

// The gate/up pre-activations (the backward's replay): out[row0 + r, ch0 + c] = bf16(gate) and
// out[row0 + r, ld/2 + ch0 + c] = bf16(up), for r < rows_limit - row0, c < BLOCK_N / 2 and
// ch0 + c < ld / 2: the rows of h = [g | u], 2I wide (ld = 2I).
template <int kRegs>
__device__ __forceinline__ void epilogue_gate_up_preact(const float (&acc)[kRegs], int consumer,
                                                        __nv_bfloat16* out, int64_t ld, int64_t row0,
                                                        int64_t rows_limit, int64_t ch0) {
  constexpr int kHalfBlocks = kRegs / 8;  // n8 blocks of the gate half
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = row0 + fragment_row(consumer, half);
#pragma unroll
    for (int part = 0; part < 2; ++part)
      store_row<kHalfBlocks>(out + row * ld + part * (ld / 2) + ch0, row < rows_limit, ld / 2 - ch0, [&](int n8) {
        const int r = (n8 + part * kHalfBlocks) * 4 + half * 2;
        return pack_bf16x2(acc[r], acc[r + 1]);
      });
  }
}

// out[row0 + r, col0 + c] = bf16(acc) for r < rows_limit - row0, c < BLOCK_N, col0 + c < ld.
template <int kRegs>
__device__ __forceinline__ void epilogue_store(const float (&acc)[kRegs], int consumer,
                                               __nv_bfloat16* out, int64_t ld, int64_t row0, int64_t rows_limit,
                                               int64_t col0) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = row0 + fragment_row(consumer, half);
    store_row<kRegs / 4>(out + row * ld + col0, row < rows_limit, ld - col0,
                         [&](int n8) { return pack_bf16x2(acc[n8 * 4 + half * 2], acc[n8 * 4 + half * 2 + 1]); });
  }
}

// fp32 rows: lane pair (n8 block, 2t) as one 8-byte store; each warp store writes 32 bytes
// (a whole sector) of each of its 8 rows.  Rows below rows_limit, columns below ld.
template <int kRegs>
__device__ __forceinline__ void epilogue_store_f32(const float (&acc)[kRegs], int consumer, float* out, int64_t ld,
                                                   int64_t row0, int64_t rows_limit, int64_t col0) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = row0 + fragment_row(consumer, half);
    if (row >= rows_limit) continue;
    float* const dst = out + row * ld + col0 + 2 * t;
#pragma unroll
    for (int n8 = 0; n8 < kRegs / 4; ++n8)
      if (col0 + n8 * 8 + 2 * t < ld)
        *reinterpret_cast<float2*>(dst + n8 * 8) = make_float2(acc[n8 * 4 + half * 2], acc[n8 * 4 + half * 2 + 1]);
  }
}

// Each tile row r goes to slots(rec)[token*k + j] of its plan row record (slots(rec): the
// slot array of the record's home rank; EP >= 2 pushes to a peer); padding rows are skipped.
template <int kRegs, typename Slots>
__device__ __forceinline__ void epilogue_scatter(const float (&acc)[kRegs], int consumer, Slots slots,
                                                 int64_t ld, const uint32_t* tile_rows, int topk, int64_t col0) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint32_t rec = tile_rows[fragment_row(consumer, half)];
    const bool pad = row_is_pad(rec);
    const int64_t row = pad ? 0 : row_token(rec) * topk + row_slot(rec);
    __nv_bfloat16* out = slots(pad ? kPadRow : rec);
    store_row<kRegs / 4>(out + row * ld + col0, !pad, ld - col0,
                         [&](int n8) { return pack_bf16x2(acc[n8 * 4 + half * 2], acc[n8 * 4 + half * 2 + 1]); });
  }
}

}  // namespace mok::gemm
