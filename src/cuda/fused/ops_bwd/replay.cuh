// Replay: h = [bf16(x·W_gateᵀ) | bf16(x·W_upᵀ)] of a row block when the forward did not save it
// (the gate/up tile of the forward, its pre-activations stored instead of the SwiGLU).
#pragma once

#include "cuda/fused/ops_bwd/op.cuh"

namespace mok::cuda::fused::bwd::ops {

struct Replay : OpBase<TaskKind::kReplay, gemm::Operands::kKMajor, gemm::Operands::kBNMajor> {
  // Its block's x rows gathered
  MOK_HD static int waits(int32_t unit, int32_t, const Geometry&, const TaskCounts&, Wait* out) {
    out[0] = Wait{CounterArray::kXReady, unit, kBlockM};
    return 1;
  }
  MOK_HD static int signals(int32_t unit, int32_t, const Geometry&, const TaskCounts&, Signal* out) {
    out[0] = Signal{CounterArray::kReplayDone, unit};
    return 1;
  }
#if defined(__CUDACC__)
  __device__ __forceinline__ static int32_t k_blocks(const BackwardParams& p, const Geometry&, const TaskCounts&,
                                                     const Task&) {
    return p.hidden / kBlockK;
  }
  template <class Pol, class MapsArg>
  __device__ __forceinline__ static Load load(const MapsArg& m, const BackwardParams& p, const Geometry& g,
                                              const TaskCounts& c, const Task& t) {
    // The gate and up halves: rows of w_gate and w_up, or (transposed) their columns
    const int32_t e_row = g.expert_of(t.block) * p.gate_up_pitch, ch = t.n_block * kHalfN;
    return Load{static_cast<int32_t>(kOpsFor<Pol::kTransposed>), &m.x_rows_k, &m.w_gate_k, &m.w_up_k,
                t.block * kBlockM, Pol::kTransposed ? e_row : e_row + ch, Pol::kTransposed ? ch : 0, kHalvesApart,
                k_blocks(p, g, c, t), 0};
  }
  template <class Pol, int kRegs>
  __device__ __forceinline__ static void epilogue(const float (&acc)[kRegs], int consumer, const BackwardParams& p,
                                                  const Geometry&, const TaskCounts&, const Task& t) {
    gemm::epilogue_gate_up_preact(acc, consumer, p.h, 2 * int64_t{p.inter}, int64_t{t.block} * kBlockM, p.max_rows,
                                  int64_t{t.n_block} * kHalfN);
  }
#endif
};

struct SharedReplay : OpBase<TaskKind::kSharedReplay, gemm::Operands::kKMajor> {
  // The rank's own tokens: nothing to wait on
  MOK_HD static int waits(int32_t, int32_t, const Geometry&, const TaskCounts&, Wait*) { return 0; }
  MOK_HD static int signals(int32_t unit, int32_t, const Geometry&, const TaskCounts&, Signal* out) {
    out[0] = Signal{CounterArray::kSharedReplayDone, unit};
    return 1;
  }
#if defined(__CUDACC__)
  __device__ __forceinline__ static int32_t k_blocks(const BackwardParams& p, const Geometry&, const TaskCounts&,
                                                     const Task&) {
    return p.hidden / kBlockK;
  }
  template <class Pol, class MapsArg>
  __device__ __forceinline__ static Load load(const MapsArg& m, const BackwardParams& p, const Geometry& g,
                                              const TaskCounts& c, const Task& t) {
    return Load{static_cast<int32_t>(kOps), &m.x_k, &m.ws_gate_k, &m.ws_up_k, t.block * kBlockM, t.n_block * kHalfN,
                0, kHalvesApart, k_blocks(p, g, c, t), 0};
  }
  template <class Pol, int kRegs>
  __device__ __forceinline__ static void epilogue(const float (&acc)[kRegs], int consumer, const BackwardParams& p,
                                                  const Geometry&, const TaskCounts&, const Task& t) {
    gemm::epilogue_gate_up_preact(acc, consumer, p.sh_h, 2 * int64_t{p.shared_inter}, int64_t{t.block} * kBlockM,
                                  p.num_tokens, int64_t{t.n_block} * kHalfN);
  }
#endif
};

}  // namespace mok::cuda::fused::bwd::ops
