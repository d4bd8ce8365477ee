// The shared expert's down: shared_act · ws_downᵀ -> shared_out (the combine adds it last).
#pragma once

#include "cuda/fused/ops/op.cuh"

namespace mok::cuda::fused::ops {

// Nothing waits on its tiles: shared_out is read after the grid barrier
struct SharedDown : OpBase<TaskKind::kSharedDown, CounterArray::kNone> {
  // Every shared gate/up tile of its token block
  MOK_HD static int waits(int32_t unit, int32_t, const Geometry&, const TaskCounts& c, Wait* out) {
    out[0] = Wait{CounterArray::kSharedGateUpDone, unit, c.n_shared_gate_up};
    return 1;
  }
#if defined(__CUDACC__)
  __device__ __forceinline__ static int32_t k_blocks(const ForwardParams& p, const Geometry&, const TaskCounts&,
                                                     const TaskInfo&) {
    return p.shared_inter_kb;
  }
  template <class Pol, class MapsArg>
  __device__ __forceinline__ static Load load(const MapsArg& maps, const ForwardParams& p, const Geometry& g,
                                                        const TaskCounts& c, const TaskInfo& t) {
    const int32_t n0 = t.n_block * Pol::kTileN;
    Load l{static_cast<int32_t>(kOps), &maps.shared_act, &maps.ws_down, &maps.ws_down, t.block * kBlockM, n0,
           Pol::kTileHalfN, kHalvesApart, k_blocks(p, g, c, t), 0};
    if constexpr (Pol::Precision::kBlockScaled) {  // shared_act's scales, W_s_down's two blocks
      l.sa = &maps.shared_act_s;
      l.sb0 = block_scales(p.w_scales[5], 0, n0, p.hidden, p.shared_inter_kb);
      l.sb1 = block_scales(p.w_scales[5], 0, n0 + Pol::kTileHalfN, p.hidden, p.shared_inter_kb);
    }
    return l;
  }
  template <class Pol, int kRegs>
  __device__ __forceinline__ static void epilogue(const float (&acc)[kRegs], int consumer, const ForwardParams& p,
                                                  const Geometry&, const TaskCounts&, const TaskInfo& t) {
    store_token_tile(acc, consumer, p.shared_out, p.hidden, p.num_tokens, t.block, t.n_block);
  }
#endif
};

}  // namespace mok::cuda::fused::ops
