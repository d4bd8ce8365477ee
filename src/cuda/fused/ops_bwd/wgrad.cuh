// The wgrad kinds (K-grouped, both operands MN-major; K = the rows of one expert's piece in
// one macrobatch, wgrad_piece):
//   wgrad down     dW_down[e] ([H, I])          += dy_rowsᵀ · wa_rows
//   wgrad gate/up  [dW_gate; dW_up][e] ([2I, H]) += [dg | du]_rowsᵀ · x_rows
// fp32 across the macrobatches of an expert in the slot of its accumulator, bf16 (and
// main_grad +=) at its last; a tile of zeros for an expert without rows.  The shared expert's
// over its tokens (one piece, final).  The same pieces, tiles and epilogue as the unfused
// backward's grouped_wgrad_kernel: the same bits.
#pragma once

#include "cuda/fused/ops_bwd/op.cuh"

namespace mok::cuda::fused::bwd::ops {

#if defined(__CUDACC__)
// The piece of a wgrad task (the producer's decode): its k-blocks, first row, mode and slot.
template <bool kShared>
__device__ __forceinline__ void wgrad_prepare(const BackwardParams& p, Task& t) {
  if constexpr (kShared) {
    t.k_blocks = gemm::tiles_of(p.num_tokens, kBlockK);
    t.row0 = 0;
    t.mode = gemm::kWgradFinal;
    t.slot = 0;
  } else {
    const int32_t e = t.block;
    if (t.macro < 0) {  // an expert without rows: one final tile of zeros
      t.k_blocks = 0;
      t.row0 = 0;
      t.mode = gemm::kWgradFinal;
      t.slot = 0;
      return;
    }
    const int32_t ring_rows = p.ring_blocks * kBlockM;
    const WgradPiece w = wgrad_piece(p.expert_offset[e], p.expert_count[e], p.expert_offset[e + 1], t.macro, ring_rows,
                                     live_macros(p.expert_offset[p.num_local], ring_rows));
    t.k_blocks = (w.count + kBlockK - 1) / kBlockK;  // tiles_of in int32 (its int64 costs the decode 8 instructions)
    t.row0 = w.row0;
    t.mode = w.mode;
    t.slot = w.first_macro < w.last_macro ? (p.slot_by_expert ? e : w.first_macro) : 0;
  }
}
// The task's output tile: expert, (m, n) of the grid (n = m * num_n_blocks + n), its rows.
__device__ __forceinline__ gemm::WgradTile wgrad_tile(const Task& t, int32_t num_n_blocks) {
  return gemm::WgradTile{t.block, t.n_block / num_n_blocks, t.n_block % num_n_blocks, t.k_blocks, t.row0, t.mode};
}

#endif

// Mo x No of the output per kind: down [H, I], gate/up [2I, H], tiled as its target says
// (gemm::wgrad_layout: partial last tiles, the gate and up halves tiled apart).
template <TaskKind kKindV, bool kShared, bool kDown>
struct WgradOp : OpBase<kKindV, gemm::Operands::kMNMajor> {
  MOK_HD static int waits(int32_t unit, int32_t macro, const Geometry& g, const TaskCounts& c, Wait* out) {
    if constexpr (kShared) {
      // Every token block's dg_s | du_s (and a_s): the running total past the last block
      out[0] = Wait{CounterArray::kSharedDgradDownDone, c.shared_blocks, c.shared_blocks * c.n_shared_dgrad_down};
      return 1;
    } else {
      if (macro < 0) return 0;  // an expert without rows: zero tiles
      const int32_t blocks = g.expert_hi(unit, macro) - g.expert_lo(unit, macro);
      out[0] = Wait{CounterArray::kExpertDgradDone, unit * g.num_macro + macro, blocks * c.n_dgrad_down};
      // The fp32 accumulator: the expert's previous macrobatch (its rows are contiguous, so
      // that is macro - 1 when it has rows there) finished all its wgrad tiles
      if (macro == 0 || !g.expert_in(unit, macro - 1)) return 1;
      out[1] = Wait{CounterArray::kWgradDone, unit * g.num_macro + macro - 1, wgrad_tiles(c)};
      return 2;
    }
  }
  MOK_HD static int signals(int32_t unit, int32_t macro, const Geometry& g, const TaskCounts&, Signal* out) {
    if (kShared || macro < 0) return 0;  // read after the grid barrier / nothing waits on zero tiles
    out[0] = Signal{CounterArray::kWgradDone, unit * g.num_macro + macro};
    return 1;
  }
#if defined(__CUDACC__)
  __device__ __forceinline__ static const gemm::WgradParams& target(const BackwardParams& p) {
    return kShared ? (kDown ? p.wg_shared_down : p.wg_shared_gate_up) : (kDown ? p.wg_down : p.wg_gate_up);
  }
  __device__ __forceinline__ static void prepare(const BackwardParams& p, Task& t) { wgrad_prepare<kShared>(p, t); }
  __device__ __forceinline__ static int32_t k_blocks(const BackwardParams&, const Geometry&, const TaskCounts&,
                                                     const Task& t) {
    return t.k_blocks;
  }
  // Transposed routed weights: their gradients are stored transposed too, [I, H] and [H, 2I]
  // per expert, computed with the operands swapped (wa_rowsᵀ · dy_rows, x_rowsᵀ · [dg | du]);
  // gate/up's two parts are then column ranges (gemm::WgradParams::split_n)
  template <bool kTransposed>
  static constexpr bool kSwapped = kTransposed && !kShared;
  template <class Pol, class MapsArg>
  __device__ __forceinline__ static Load load(const MapsArg& m, const BackwardParams& p, const Geometry&,
                                              const TaskCounts&, const Task& t) {
    constexpr bool kSwap = kSwapped<Pol::kTransposed>;
    const gemm::WgradParams& wp = target(p);
    const gemm::WgradTile w = wgrad_tile(t, wp.num_n_blocks);
    const CUtensorMap* a = kShared ? (kDown ? &m.dy_mn : &m.sh_dh_mn) : (kDown ? &m.dy_rows_mn : &m.dh_mn);
    const CUtensorMap* b = kShared ? (kDown ? &m.sh_a_mn : &m.x_mn) : (kDown ? &m.wa_mn : &m.x_rows_mn);
    if (kSwap) {
      const CUtensorMap* const first = a;
      a = b;
      b = first;
    }
    return Load{static_cast<int32_t>(gemm::Operands::kMNMajor), a, b, b, w.row0, 0,
                static_cast<int32_t>(gemm::wgrad_col0<kSwap && !kDown>(wp, w.n_block)), 0, w.num_k_blocks,
                static_cast<int32_t>(gemm::wgrad_row0<kSwap && !kDown>(wp, w.m_block))};
  }
  template <class Pol, int kRegs>
  __device__ __forceinline__ static void epilogue(const float (&acc)[kRegs], int consumer, const BackwardParams& p,
                                                  const Geometry&, const TaskCounts&, const Task& t) {
    constexpr bool kSplitN = kSwapped<Pol::kTransposed> && !kDown;
    const gemm::WgradParams& wp = target(p);
    const gemm::WgradTile w = wgrad_tile(t, wp.num_n_blocks);
    const gemm::WgradTarget to = gemm::wgrad_target_at<kSplitN>(wp, w, t.slot);
    // Without the standalone launches' bf16-only path (kFast = false: faster here, wgrad.cuh)
    if (w.num_k_blocks == 0) gemm::epilogue_wgrad_to<true, true, false, kSplitN>(acc, consumer, wp, w, to);
    else gemm::epilogue_wgrad_to<false, true, false, kSplitN>(acc, consumer, wp, w, to);
  }
  // A routed tile that is whole, final and bf16 only (and p.wgrad_tma) goes through two
  // stages of the ring (one per consumer's 64 x 256 half, in its b) and TMA stores; the producer
  // reserves the stages after the K loop (no load: a plain arrival), the consumers write, store,
  // wait for the stores' reads and release them.  Every other tile: the register epilogue.
  static constexpr bool kRingEpilogue = !kShared;
  // Whether the tile (w, its target to) takes the TMA stores: the producer's and the consumers' test
  template <class Pol>
  __device__ __forceinline__ static bool tma_tile(const BackwardParams& p, const Task& t, const gemm::WgradTile& w,
                                                  const gemm::WgradTarget& to) {
    return !kShared && p.wgrad_tma && t.k_blocks != 0 &&
           gemm::wgrad_tile_storable<kSwapped<Pol::kTransposed> && !kDown>(target(p), w, to);
  }
  template <class Pol>
  __device__ __forceinline__ static bool tma_tile(const BackwardParams& p, const Task& t) {
    constexpr bool kSplitN = kSwapped<Pol::kTransposed> && !kDown;
    const gemm::WgradParams& wp = target(p);
    const gemm::WgradTile w = wgrad_tile(t, wp.num_n_blocks);
    return tma_tile<Pol>(p, t, w, gemm::wgrad_target_at<kSplitN>(wp, w, t.slot));
  }
  template <class Pol, class Stages, class Stage, class MapsArg>
  __device__ __forceinline__ static bool produce_epilogue(Stages& s, Stage& stage, const MapsArg&,
                                                          const BackwardParams& p, const Task& t,
                                                          const gemm::WaitContext& wait) {
    if (!tma_tile<Pol>(p, t)) return true;
    for (int q = 0; q < 2; ++q) {
      if (!s.pipe.producer_acquire(stage, wait)) return false;
      ptx::mbar_arrive(s.pipe.full_barrier(stage));
      stage.advance();
    }
    return true;
  }
  template <class Pol, int kRegs, class Ring>
  __device__ __forceinline__ static bool epilogue_ring(const float (&acc)[kRegs], int consumer, const BackwardParams& p,
                                                       const Geometry& g, const TaskCounts& c, const Task& t,
                                                       const Ring& r) {
    constexpr bool kSplitN = kSwapped<Pol::kTransposed> && !kDown;
    const gemm::WgradParams& wp = target(p);
    const gemm::WgradTile w = wgrad_tile(t, wp.num_n_blocks);
    const gemm::WgradTarget to = gemm::wgrad_target_at<kSplitN>(wp, w, t.slot);
    if (!tma_tile<Pol>(p, t, w, to)) {
      epilogue<Pol>(acc, consumer, p, g, c, t);
      return true;
    }
    // The two reserved stages (both consumers wait for and release both); this consumer's is its
    // index's
    auto second = r.stage;
    second.advance();
    if (!r.s.pipe.consumer_wait(r.stage, r.wait) || !r.s.pipe.consumer_wait(second, r.wait)) return false;
    const int index = consumer == 0 ? r.stage.index : second.index;
    const bool part1 = to.out != wp.out;
    const CUtensorMap* map = kDown ? &r.maps.wg_down_out : (part1 ? &r.maps.wg_up_out : &r.maps.wg_gate_out);
    const int64_t pitch = kDown ? p.wg_down_pitch : p.wg_gate_up_pitch;
    const int32_t row = static_cast<int32_t>(w.expert * pitch + gemm::wgrad_row0<kSplitN>(wp, w.m_block) - to.row_base +
                                             consumer * 64);
    const int32_t col = static_cast<int32_t>(gemm::wgrad_col0<kSplitN>(wp, w.n_block) - to.col_base);
    gemm::store_half_tma(acc, reinterpret_cast<uint8_t*>(r.s.b[index]), map, col, row, r.bar);
    // Both stages free once this warpgroup's store has read its buffer (each warpgroup releases
    // both, as every stage of a cooperative tile)
    if (threadIdx.x % 128 == 0) {
      ptx::bulk_wait_read<0>();
      r.s.pipe.consumer_release(r.stage.index);
      r.s.pipe.consumer_release(second.index);
    }
    r.stage.advance();
    r.stage.advance();
    return true;
  }
#endif
};

// WgradDown, WgradGateUp, SharedWgradDown, SharedWgradGateUp: WgradOp<kind, shared, down>
// (../schedule_bwd.cuh, beside the kinds)

}  // namespace mok::cuda::fused::bwd::ops
