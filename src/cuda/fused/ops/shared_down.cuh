// The shared expert's down: shared_act · ws_downᵀ -> shared_out (the combine adds it last).
#pragma once

#include "cuda/fused/ops/op.cuh"

namespace mok::cuda::fused::ops {

struct SharedDown {
  static constexpr TaskKind kKind = TaskKind::kSharedDown;
  static constexpr CounterArray kSignals = CounterArray::kNone;  // read after the grid barrier
  // Every shared gate/up tile of its token block
  MOK_HD static int waits(int32_t block, const Geometry&, const TaskCounts& c, Wait* out) {
    out[0] = Wait{CounterArray::kSharedGateUpDone, block, c.n_shared_gate_up};
    return 1;
  }
#if defined(__CUDACC__)
  __device__ __forceinline__ static int32_t k_blocks(const ForwardParams& p) { return p.shared_inter / kBlockK; }
  __device__ __forceinline__ static gemm::TileLoad load(const Maps& maps, const ForwardParams& p, const Geometry&,
                                                        const TaskInfo& t) {
    return gemm::TileLoad{&maps.shared_act, &maps.ws_down, &maps.ws_down, t.block * kBlockM, t.n_block * kBlockN,
                          kHalfN, k_blocks(p)};
  }
  template <int kRegs>
  __device__ __forceinline__ static void epilogue(const float (&acc)[kRegs], int consumer, const ForwardParams& p,
                                                  const Geometry&, const TaskInfo& t) {
    gemm::epilogue_store(acc, consumer, p.shared_out, p.hidden, int64_t{t.block} * kBlockM, p.num_tokens,
                         int64_t{t.n_block} * kBlockN);
  }
#endif
};

}  // namespace mok::cuda::fused::ops
