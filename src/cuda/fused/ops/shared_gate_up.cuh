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
    return p.hidden / kBlockK;
  }
  template <class Pol, class MapsArg>
  __device__ __forceinline__ static Load load(const MapsArg& maps, const ForwardParams& p, const Geometry& g,
                                                        const TaskCounts& c, const TaskInfo& t) {
    return Load{static_cast<int32_t>(kOps), &maps.x, &maps.ws_gate, &maps.ws_up, t.block * kBlockM,
                t.n_block * Pol::kTileHalfN, 0, kHalvesApart, k_blocks(p, g, c, t), 0};
  }
  template <class Pol, int kRegs>
  __device__ __forceinline__ static void epilogue(const float (&acc)[kRegs], int consumer, const ForwardParams& p,
                                                  const Geometry&, const TaskCounts&, const TaskInfo& t) {
    gemm::epilogue_swiglu(acc, consumer, p.shared_act, p.shared_inter, int64_t{t.block} * kBlockM, p.num_tokens,
                          int64_t{t.n_block} * Pol::kTileHalfN);
    if (p.saved_shared_h)
      gemm::epilogue_gate_up_preact(acc, consumer, p.saved_shared_h, 2 * int64_t{p.shared_inter},
                                    int64_t{t.block} * kBlockM, p.num_tokens, int64_t{t.n_block} * Pol::kTileHalfN);
  }
#endif
};

}  // namespace mok::cuda::fused::ops
