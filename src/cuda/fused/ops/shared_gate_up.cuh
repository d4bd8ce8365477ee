// The shared expert's gate/up: x · [ws_gate; ws_up]ᵀ -> SwiGLU -> shared_act, over the rank's
// own tokens (no gather: the first tasks of the list).
#pragma once

#include "cuda/fused/ops/op.cuh"

namespace mok::cuda::fused::ops {

struct SharedGateUp : OpBase<TaskKind::kSharedGateUp, CounterArray::kSharedGateUpDone> {
  MOK_HD static int waits(int32_t, int32_t, const Geometry&, const TaskCounts&, Wait*) { return 0; }
#if defined(__CUDACC__)
  __device__ __forceinline__ static int32_t k_blocks(const ForwardParams& p, const Geometry&, const TaskCounts&,
                                                     const TaskInfo&) {
    return p.hidden_kb;
  }
  template <class Pol, class MapsArg>
  __device__ __forceinline__ static Load load(const MapsArg& maps, const ForwardParams& p, const Geometry& g,
                                                        const TaskCounts& c, const TaskInfo& t) {
    const int32_t ch = t.n_block * Pol::kTileHalfN;
    Load l{static_cast<int32_t>(kOps), &maps.x, &maps.ws_gate, &maps.ws_up, t.block * kBlockM, ch, 0, kHalvesApart,
           k_blocks(p, g, c, t), 0};
    if constexpr (Pol::Precision::kBlockScaled) {  // x's per-token scales, W_s_gate's and W_s_up's blocks
      l.sa = &maps.x_s;
      l.sb0 = block_scales(p.w_scales[3], 0, ch, p.shared_inter, p.hidden_kb);
      l.sb1 = block_scales(p.w_scales[4], 0, ch, p.shared_inter, p.hidden_kb);
    }
    return l;
  }
  template <class Pol, int kRegs>
  __device__ __forceinline__ static void epilogue(const float (&acc)[kRegs], int consumer, const ForwardParams& p,
                                                  const Geometry&, const TaskCounts&, const TaskInfo& t) {
    if constexpr (Pol::Precision::kBlockScaled)
      gemm::epilogue_swiglu_e4m3(acc, consumer, reinterpret_cast<uint8_t*>(p.shared_act), p.shared_inter,
                                 int64_t{t.block} * kBlockM, p.num_tokens, int64_t{t.n_block} * Pol::kTileHalfN,
                                 p.shared_act_scales, p.x8_ld, p.pow2 != 0);
    else
      gemm::epilogue_swiglu(acc, consumer, p.shared_act, p.shared_inter, int64_t{t.block} * kBlockM, p.num_tokens,
                            int64_t{t.n_block} * Pol::kTileHalfN);
    if (p.saved_shared_h)
      gemm::epilogue_gate_up_preact(acc, consumer, p.saved_shared_h, 2 * int64_t{p.shared_inter},
                                    int64_t{t.block} * kBlockM, p.num_tokens, int64_t{t.n_block} * Pol::kTileHalfN);
  }
#endif
};

}  // namespace mok::cuda::fused::ops
