// Routed gate/up: ring rows · [w_gate; w_up][e]ᵀ -> SwiGLU -> the block's act rows in the ring.
#pragma once

#include "cuda/fused/ops/op.cuh"

namespace mok::cuda::fused::ops {

struct GateUp : OpBase<TaskKind::kGateUp, CounterArray::kGateUpDone, gemm::Operands::kBNMajor> {
  // Its rows gathered; the act rows it overwrites consumed by the previous occupant's down tiles
  MOK_HD static int waits(int32_t unit, int32_t, const Geometry& g, const TaskCounts& c, Wait* out) {
    out[0] = Wait{CounterArray::kGatherReady, unit, kBlockM};
    const int32_t prev = g.previous_occupant(unit);
    if (prev < 0) return 1;
    out[1] = Wait{CounterArray::kDownDone, prev, c.n_down};
    return 2;
  }
#if defined(__CUDACC__)
  __device__ __forceinline__ static int32_t k_blocks(const ForwardParams& p, const Geometry&, const TaskCounts&,
                                                     const TaskInfo&) {
    return p.hidden_kb;
  }
  template <class Pol, class MapsArg>
  __device__ __forceinline__ static Load load(const MapsArg& maps, const ForwardParams& p, const Geometry& g,
                                                        const TaskCounts& c, const TaskInfo& t) {
    // The gate and up halves: rows of w_gate and w_up, or (transposed) their columns
    const int32_t e = p.block_expert[t.block], e_row = e * p.gate_up_pitch, ch = t.n_block * Pol::kTileHalfN;
    Load l{static_cast<int32_t>(kOpsFor<Pol::kTransposed>), &maps.ring, &maps.w_gate, &maps.w_up,
           g.ring_row(t.block), Pol::kTransposed ? e_row : e_row + ch, Pol::kTransposed ? ch : 0, kHalvesApart,
           k_blocks(p, g, c, t), 0};
    if constexpr (Pol::Precision::kBlockScaled) {  // the ring rows' scales, W_gate's and W_up's blocks
      l.sa = &maps.ring_s;
      l.sb0 = block_scales(p.w_scales[0], e, ch, p.inter, p.hidden_kb);
      l.sb1 = block_scales(p.w_scales[1], e, ch, p.inter, p.hidden_kb);
    }
    return l;
  }
  template <class Pol, int kRegs>
  __device__ __forceinline__ static void epilogue(const float (&acc)[kRegs], int consumer, const ForwardParams& p,
                                                  const Geometry& g, const TaskCounts&, const TaskInfo& t) {
    if constexpr (Pol::Precision::kBlockScaled)  // a in e4m3 and its scales, for down
      gemm::epilogue_swiglu_e4m3(acc, consumer, reinterpret_cast<uint8_t*>(p.act), p.inter, g.ring_row(t.block),
                                 int64_t{p.ring_blocks} * kBlockM, int64_t{t.n_block} * Pol::kTileHalfN, p.act_scales,
                                 p.scales_ld, p.pow2 != 0);
    else
      gemm::epilogue_swiglu(acc, consumer, p.act, p.inter, g.ring_row(t.block), int64_t{p.ring_blocks} * kBlockM,
                            int64_t{t.n_block} * Pol::kTileHalfN);
    // Training: the pre-activations too, at the block's plan rows (the backward's h)
    if (p.saved_h)
      gemm::epilogue_gate_up_preact(acc, consumer, p.saved_h, 2 * int64_t{p.inter}, int64_t{t.block} * kBlockM,
                                    int64_t{t.block + 1} * kBlockM, int64_t{t.n_block} * Pol::kTileHalfN);
  }
#endif
};

}  // namespace mok::cuda::fused::ops
