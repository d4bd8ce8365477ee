// Routed down: the block's act rows · w_down[e]ᵀ -> each row to its route slot token*k + j of
// its home rank.
#pragma once

#include "cuda/fused/ops/op.cuh"

namespace mok::cuda::fused::ops {

struct Down : OpBase<TaskKind::kDown, CounterArray::kDownDone, gemm::Operands::kBNMajor> {
  // Every gate/up tile of its block (its act rows complete)
  MOK_HD static int waits(int32_t unit, int32_t, const Geometry&, const TaskCounts& c, Wait* out) {
    out[0] = Wait{CounterArray::kGateUpDone, unit, c.n_gate_up};
    return 1;
  }
#if defined(__CUDACC__)
  __device__ __forceinline__ static int32_t k_blocks(const ForwardParams& p, const Geometry&, const TaskCounts&,
                                                     const TaskInfo&) {
    return p.inter_kb;
  }
  template <class Pol, class MapsArg>
  __device__ __forceinline__ static Load load(const MapsArg& maps, const ForwardParams& p, const Geometry& g,
                                                        const TaskCounts& c, const TaskInfo& t) {
    // Two neighbouring halves of w_down's rows, or (transposed) its columns in one K range
    const int32_t e = p.block_expert[t.block], e_row = e * p.down_pitch, n0 = t.n_block * Pol::kTileN;
    const int32_t kb = k_blocks(p, g, c, t);
    Load l{static_cast<int32_t>(kOpsFor<Pol::kTransposed>), &maps.act, &maps.w_down, &maps.w_down,
           g.ring_row(t.block), Pol::kTransposed ? e_row : e_row + n0, Pol::kTransposed ? n0 : Pol::kTileHalfN,
           Pol::kTransposed ? kb : kHalvesApart, kb, 0};
    if constexpr (Pol::Precision::kBlockScaled) {  // the act rows' scales, W_down's two blocks
      l.sa = &maps.act_s;
      l.sb0 = block_scales(p.w_scales[2], e, n0, p.hidden, p.inter_kb);
      l.sb1 = block_scales(p.w_scales[2], e, n0 + Pol::kTileHalfN, p.hidden, p.inter_kb);
    }
    return l;
  }
  template <class Pol, int kRegs>
  __device__ __forceinline__ static void epilogue(const float (&acc)[kRegs], int consumer, const ForwardParams& p,
                                                  const Geometry&, const TaskCounts&, const TaskInfo& t) {
    gemm::epilogue_scatter(acc, consumer, [&](uint32_t rec) { return home_slots(p, rec); }, p.hidden,
                           p.rows + int64_t{t.block} * kBlockM, p.topk, int64_t{t.n_block} * Pol::kTileN);
  }
#endif
};

}  // namespace mok::cuda::fused::ops
