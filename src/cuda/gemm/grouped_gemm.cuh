// The grouped-GEMM engine: persistent, warp-specialised, TMA + wgmma (sm_90a).
//
//   C[rows of expert e, N] = A[rows, K] · B_e[N, K]ᵀ      (both operands K-major)
//   kBNMajor: C[rows of e, N] = A[rows, K] · B_e[K, N]     (B as stored: the dgrad GEMMs,
//             da = dy · W_down[e] and dx = [dg | du] · [W_gate; W_up][e]; see TileLoadNMajor)
//
// Roles (one warpgroup each, 384 threads):
//   kProducer   one elected thread issues TMA loads into a kStages-deep ring of stages
//   kConsumer0  rows [0, 64) of the tile: wgmma m64n256k16, fp32 accumulators in registers
//   kConsumer1  rows [64, 128)
// Barriers (mbarrier, one pair per stage):
//   pipe.full[s]   producer -> consumers: stage s holds A and B (TMA transaction bytes)
//   pipe.empty[s]  consumers -> producer: both warpgroups finished reading stage s
//
// B arrives as two 128-row halves per stage, each from its own tensor map.  For gate/up the
// halves are w_gate and w_up rows of the same 128 intermediate channels, so one 256-wide
// accumulator holds matching gate (cols 0..127) and up (cols 128..255) values in the same
// thread and the SwiGLU runs in the epilogue with no weight re-layout.  For down both
// halves come from w_down (rows n*256 and n*256+128).
//
// Tiles (m_block, n_block) are walked in N-groups (raster()); block_expert[m] gives the
// expert, -1 past the last row block (skipped).  Each block takes tiles blockIdx.x,
// +gridDim.x, ... (deterministic).
#pragma once

#include "cuda/gemm/epilogue_bwd.cuh"
#include <type_traits>

#include "cuda/gemm/tile.cuh"

namespace mok::gemm {

enum class Role : int32_t { kProducer = 0, kConsumer0 = 1, kConsumer1 = 2 };

inline constexpr size_t kGemmSmemBytes = kGemmSmemBytesT<TileConfig>;
static_assert(kGemmSmemBytes <= 227 * 1024 && kGemmSmemBytesT<TileConfigN128> <= 227 * 1024,
              "shared storage exceeds the 227 KB a block can have");

struct GroupedGemmParams {
  int32_t num_n_blocks;      // output tiles along N
  int32_t num_k_blocks;      // K / BLOCK_K
  int32_t max_m_blocks;      // length of block_expert
  int32_t b_rows_per_expert; // map rows between experts in the B maps (gemm::matrix_pitch)
  int32_t b_n_step;          // B rows per n_block (128 gate/up, 256 down)
  int32_t b_half_offset;     // row offset of the second half in its map (0 gate/up, 128 down)
  int32_t k_split_blocks;    // kBNMajor: k-blocks read from map_b0 before map_b1
  const int32_t* block_expert;
  Epilogue epilogue;
  __nv_bfloat16* out;
  int64_t out_ld;            // elements between output rows
  int64_t out_rows;          // rows of `out` that may be written (kStore/kSwiGLU)
  const uint32_t* plan_rows; // kScatter
  int32_t topk;              // kScatter
  int32_t n_group;           // raster: N-blocks per group
  uint64_t timeout_ns;       // deadline of every wait, from kernel entry
  int64_t* timeout_record;   // device [5], see WaitContext
  // Block-scaled precisions (PrecisionE4m3Block; A's scales come through the kernel's scale
  // map): B's 128 x 128 blocks' scales, b0's and b1's: block (r / 128, kb) of expert e's B rows
  // r at e · sb_expert_stride + (r / 128) · sb_n_stride + kb · sb_k_stride, r / 128 <
  // sb_rows_per_expert
  const float* sb0;
  const float* sb1;
  int32_t sb_rows_per_expert;
  int32_t sb_expert_stride, sb_n_stride, sb_k_stride;
  // Epilogue::kSwiGLUE4m3: out is e4m3 [rows, I]; its scales [I / 128, out_scales_ld] fp32;
  // preact (or null): h = [bf16(g) | bf16(u)] [rows, 2I] too, from the same accumulators (the
  // training forward's saved pre-activations, kGateUpPreact's layout)
  float* out_scales;
  int64_t out_scales_ld;
  int32_t out_scales_pow2;  // power-of-two scales (UE8M0)
  __nv_bfloat16* preact;
};

// The parameters of the SwiGLU-backward kernel (grouped_gemm_kernel<true, T, true>, the
// kDgradSwiGLU epilogue): out = dh [rows, 2I], out_ld = 2I.  A type of its own, so that the
// other kernels' parameters (and code) stay as they were.
struct GroupedGemmSwiGLUBwdParams : GroupedGemmParams {
  const __nv_bfloat16* h;    // [rows, 2I] bf16: the saved g | u
  const float* row_weight;   // [rows] fp32: w of each row (0 for padding rows)
  __nv_bfloat16* wa;         // [rows, I] bf16 or null
  float* dtw_partials;       // [rows, I / 128] fp32 or null
  int64_t inter;             // I
};
template <bool kSwiGLUBwd>
using GroupedGemmParamsOf = std::conditional_t<kSwiGLUBwd, GroupedGemmSwiGLUBwdParams, GroupedGemmParams>;

// T: the tile shape (config.hpp), 128 x 256 unless the launch asks for another.
// kSwiGLUBwd (with kBNMajor: the dgrad-down kind): the one epilogue is epilogue_dgrad_swiglu
// (epilogue_bwd.cuh), a kernel of its own so that the other kinds' code is not touched.
// Prec: the operands' precision (tile.cuh), the tile's bytes' unless block-scaled; map_sa:
// A's scales of a block-scaled precision (map_a otherwise, unused).
template <bool kBNMajor, class T = TileConfig, bool kSwiGLUBwd = false, class Prec = PrecisionOf<T>>
__global__ void __launch_bounds__(T::kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b0,
                        const __grid_constant__ CUtensorMap map_b1, const GroupedGemmParamsOf<kSwiGLUBwd> p,
                        const __grid_constant__ CUtensorMap map_sa) {
  using C = T;
  static_assert(!Prec::kBlockScaled || !kBNMajor, "block-scaled kinds are K-major (dgrad on transposed copies)");
  extern __shared__ uint8_t smem_raw[];
  auto& s =
      *reinterpret_cast<StageStorageT<T, Prec>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const Role role = static_cast<Role>(__shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0));
  const WaitContext wait{ptx::globaltimer_ns() + p.timeout_ns, p.timeout_record};
  const int num_tiles = p.max_m_blocks * p.num_n_blocks;

  // Initialise barriers
  if (threadIdx.x == 0) {
    s.init_barriers();
    ptx::fence_mbar_init();
    ptx::prefetch_tensormap(&map_a);
    ptx::prefetch_tensormap(&map_b0);
    ptx::prefetch_tensormap(&map_b1);
    if constexpr (Prec::kBlockScaled) ptx::prefetch_tensormap(&map_sa);
  }
  __syncthreads();

  if (role == Role::kProducer) {
    ptx::setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x != 0) return;
    PipelineState<C::kStages> stage;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileCoord tc = raster(tile, p.max_m_blocks, p.num_n_blocks, p.n_group);
      const int m_block = tc.m, n_block = tc.n;
      const int expert = p.block_expert[m_block];
      if (expert < 0) continue;
      if constexpr (kBNMajor) {
        const TileLoadNMajor load{&map_a, &map_b0, &map_b1, m_block * C::kBlockM, expert * p.b_rows_per_expert,
                                  n_block * C::kBlockN, p.k_split_blocks, p.num_k_blocks};
        if (!produce_tile_nmajor(s, stage, load, wait)) return;
      } else {
        TileLoad load{&map_a, &map_b0, &map_b1, m_block * C::kBlockM,
                      expert * p.b_rows_per_expert + n_block * p.b_n_step, p.b_half_offset, p.num_k_blocks};
        if constexpr (Prec::kBlockScaled) {
          // The scales of the tile's two B halves' blocks (rows n_block·b_n_step and
          // + b_half_offset of the expert's, in b0 and b1; a half past the expert's rows, of a
          // partial last tile, reads its last block: unused)
          const auto blocks = [&](int row) {
            return int64_t{expert} * p.sb_expert_stride + min(row / 128, p.sb_rows_per_expert - 1) * p.sb_n_stride;
          };
          load.sa = &map_sa;
          load.sb0 = p.sb0 + blocks(n_block * p.b_n_step);
          load.sb1 = p.sb1 + blocks(n_block * p.b_n_step + p.b_half_offset);
          load.sb_k_stride = p.sb_k_stride;
          if (p.k_split_blocks > 0) {  // K split: both halves from each part's matrix, by k-block
            load.k_split = p.k_split_blocks;
            load.sb1 = p.sb1 + blocks(n_block * p.b_n_step);
            load.sb0_hi = p.sb0 + blocks(n_block * p.b_n_step + p.b_half_offset);
            load.sb1_hi = p.sb1 + blocks(n_block * p.b_n_step + p.b_half_offset);
          }
        }
        if (!produce_tile(s, stage, load, wait)) return;
      }
    }
    return;
  }

  // Consumers
  ptx::setmaxnreg_inc<C::kConsumerRegs>();
  const int consumer = static_cast<int>(role) - 1;
  PipelineState<C::kStages> stage;
  float acc[C::kSlabs][C::kAccRegs];
  // NOTES: each tile's expert is read one tile ahead (its load latency under the previous
  // tile's MMAs); only its sign matters here.
  auto expert_of = [&](int tile) {
    return tile < num_tiles ? p.block_expert[raster(tile, p.max_m_blocks, p.num_n_blocks, p.n_group).m] : -1;
  };
  int expert = expert_of(blockIdx.x);
  PingPongTurns turns;  // ping-pong: over the tiles with an expert
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const TileCoord tc = raster(tile, p.max_m_blocks, p.num_n_blocks, p.n_group);
    const int m_block = tc.m, n_block = tc.n;
    const int this_expert = expert;
    expert = expert_of(tile + static_cast<int>(gridDim.x));
    if (this_expert < 0) continue;
    if constexpr (C::kPingPong) {
      // The other warpgroup's tile: its stages pass by (the producer fills tiles in order)
      if (!turns.owns(consumer)) {
        stage.advance(p.num_k_blocks);
        continue;
      }
      if (!turns.wait(s, consumer, wait)) return;
    }
    constexpr Operands kOps = kBNMajor ? Operands::kBNMajor : Operands::kKMajor;
    const auto pass_turn = [&] {
      if constexpr (C::kPingPong) PingPongTurns::pass(s, consumer);
    };
    if constexpr (Prec::kBlockScaled) {
      if (!consume_tile_block_scaled(s, stage, p.num_k_blocks, consumer, acc[0], wait)) return;
    } else if (!consume_tile<kOps>(s, stage, p.num_k_blocks, consumer, acc, wait, pass_turn)) {
      return;
    }
    // Epilogue straight from registers, a 64-row slab at a time
    const int64_t row0 = static_cast<int64_t>(m_block) * C::kBlockM;
#pragma unroll
    for (int j = 0; j < C::kSlabs; ++j) {
      const int slab = C::kPingPong ? j : consumer;  // rows 64 slab .. 64 slab + 63 of the tile
      if constexpr (kSwiGLUBwd && Prec::kBlockScaled) {
        // fp8_block's dgrad down (K-major on W_down's transposed copy): dh quantised for dgrad gate/up
        const SwiGLUBwdE4m3Args e{p.h, reinterpret_cast<uint8_t*>(p.out), p.out_scales, p.out_scales_ld,
                                  p.out_scales_pow2 != 0, p.preact, p.wa, p.dtw_partials, p.inter};
        const int64_t left = p.out_rows - row0;
        const int valid_rows = left < C::kBlockM ? static_cast<int>(left) : C::kBlockM;
        const float* __restrict__ rw = p.row_weight + row0;
        epilogue_dgrad_swiglu_e4m3(acc[j], slab, e, row0, valid_rows, int64_t{n_block} * C::kBlockN,
                                   [&](int r) { return rw[r]; });
      } else if constexpr (kSwiGLUBwd) {
        static_assert(kBNMajor, "the SwiGLU-backward epilogue belongs to the dgrad-down kind");
        const SwiGLUBwdArgs e{p.h, p.out, p.wa, p.dtw_partials, p.inter};
        const int64_t left = p.out_rows - row0;
        const int valid_rows = left < C::kBlockM ? static_cast<int>(left) : C::kBlockM;
        const float* __restrict__ rw = p.row_weight + row0;
        epilogue_dgrad_swiglu(acc[j], slab, e, row0, row0, valid_rows, int64_t{n_block} * C::kBlockN,
                              [&](int r) { return rw[r]; });
      } else {
        switch (p.epilogue) {
          case Epilogue::kSwiGLU:
            epilogue_swiglu(acc[j], slab, p.out, p.out_ld, row0, p.out_rows, int64_t{n_block} * (C::kBlockN / 2));
            break;
          case Epilogue::kSwiGLUE4m3:
            if constexpr (Prec::kBlockScaled && C::kBlockN == 256) {
              epilogue_swiglu_e4m3(acc[j], slab, reinterpret_cast<uint8_t*>(p.out), p.out_ld, row0, p.out_rows,
                                   int64_t{n_block} * (C::kBlockN / 2), p.out_scales, p.out_scales_ld,
                                   p.out_scales_pow2 != 0);
              if (p.preact != nullptr)
                epilogue_gate_up_preact(acc[j], slab, p.preact, 2 * p.out_ld, row0, p.out_rows,
                                        int64_t{n_block} * (C::kBlockN / 2));
            }
            break;
          case Epilogue::kGateUpPreact:
            epilogue_gate_up_preact(acc[j], slab, p.out, p.out_ld, row0, p.out_rows,
                                    int64_t{n_block} * (C::kBlockN / 2));
            break;
          case Epilogue::kStore:
            epilogue_store(acc[j], slab, p.out, p.out_ld, row0, p.out_rows, int64_t{n_block} * C::kBlockN);
            break;
          case Epilogue::kStoreF32:
            if constexpr (Prec::kBlockScaled)
              epilogue_store_f32(acc[j], slab, reinterpret_cast<float*>(p.out), p.out_ld, row0, p.out_rows,
                                 int64_t{n_block} * C::kBlockN);
            break;
          case Epilogue::kScatter:
            epilogue_scatter(acc[j], slab, [&](uint32_t) { return p.out; }, p.out_ld, p.plan_rows + row0, p.topk,
                             int64_t{n_block} * C::kBlockN);
            break;
        }
      }
    }
  }
}

}  // namespace mok::gemm
