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

// The tile of a wgrad task: expert, (m, n) of the output tile, its rows, and its fp32 mode.
struct WgradTask {
  gemm::WgradTile tile;
  int64_t slot;
};
template <bool kShared>
__device__ __forceinline__ WgradTask wgrad_task(const BackwardParams& p, const Task& t, int32_t num_n_blocks) {
  const int32_t m_block = t.n_block / num_n_blocks, n_block = t.n_block % num_n_blocks;
  if constexpr (kShared) {
    const int32_t rows = static_cast<int32_t>(p.num_tokens);
    return WgradTask{gemm::WgradTile{0, m_block, n_block, (rows + 63) / 64, 0, gemm::kWgradFinal}, 0};
  } else {
    const int32_t e = t.block;
    if (t.macro < 0)  // an expert without rows: one final tile of zeros
      return WgradTask{gemm::WgradTile{e, m_block, n_block, 0, 0, gemm::kWgradFinal}, 0};
    const int32_t ring_rows = p.ring_blocks * 128;
    const WgradPiece w = wgrad_piece(p.expert_offset[e], p.expert_count[e], p.expert_offset[e + 1], t.macro, ring_rows,
                                     live_macros(p.expert_offset[p.num_local], ring_rows));
    const int64_t slot = w.first_macro < w.last_macro ? (p.slot_by_expert ? e : w.first_macro) : 0;
    return WgradTask{gemm::WgradTile{e, m_block, n_block, (w.count + 63) / 64, w.row0, w.mode}, slot};
  }
}

// Mo x No of the output per kind: down [H, I] (n blocks I/256), gate/up [2I, H] (H/256).
template <TaskKind kKindV, bool kShared, bool kDown>
struct WgradOp {
  static constexpr TaskKind kKind = kKindV;
  static constexpr gemm::Operands kOps = gemm::Operands::kMNMajor;
  __device__ __forceinline__ static int32_t num_n_blocks(const BackwardParams& p) {
    return kDown ? (kShared ? p.shared_inter : p.inter) / 256 : p.hidden / 256;
  }
  __device__ __forceinline__ static const gemm::WgradParams& target(const BackwardParams& p) {
    return kShared ? (kDown ? p.wg_shared_down : p.wg_shared_gate_up) : (kDown ? p.wg_down : p.wg_gate_up);
  }
  __device__ __forceinline__ static int32_t k_blocks(const BackwardParams& p, const Geometry&, const TaskCounts&,
                                                     const Task& t) {
    return wgrad_task<kShared>(p, t, num_n_blocks(p)).tile.num_k_blocks;
  }
  __device__ __forceinline__ static Load load(const Maps& m, const BackwardParams& p, const Geometry&,
                                              const TaskCounts&, const Task& t) {
    const gemm::WgradTile w = wgrad_task<kShared>(p, t, num_n_blocks(p)).tile;
    const CUtensorMap* a = kShared ? (kDown ? &m.dy_mn : &m.sh_dh_mn) : (kDown ? &m.dy_rows_mn : &m.dh_mn);
    const CUtensorMap* b = kShared ? (kDown ? &m.sh_a_mn : &m.x_mn) : (kDown ? &m.wa_mn : &m.x_rows_mn);
    return Load{static_cast<int32_t>(kOps), a, b, b, w.row0, 0, w.n_block * 256, 0, w.num_k_blocks, w.m_block * 128};
  }
  template <int kRegs>
  __device__ __forceinline__ static void epilogue(const float (&acc)[kRegs], int consumer, const BackwardParams& p,
                                                  const Geometry&, const TaskCounts&, const Task& t) {
    const WgradTask w = wgrad_task<kShared>(p, t, num_n_blocks(p));
    const gemm::WgradParams& wp = target(p);
    const gemm::WgradTarget to = gemm::wgrad_target_at(wp, w.tile, w.slot);
    if (w.tile.num_k_blocks == 0) gemm::epilogue_wgrad_to<true, true>(acc, consumer, wp, w.tile, to);
    else gemm::epilogue_wgrad_to<false, true>(acc, consumer, wp, w.tile, to);
  }
};

using WgradDown = WgradOp<TaskKind::kWgradDown, false, true>;
using WgradGateUp = WgradOp<TaskKind::kWgradGateUp, false, false>;
using SharedWgradDown = WgradOp<TaskKind::kSharedWgradDown, true, true>;
using SharedWgradGateUp = WgradOp<TaskKind::kSharedWgradGateUp, true, false>;

}  // namespace mok::cuda::fused::bwd::ops
