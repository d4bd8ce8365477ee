// The dgrad kinds (B read as stored, N-major):
//   dgrad down     da = dy · W_down[e] ([H, I]) with the SwiGLU backward in its epilogue:
//                  dh = [dg | du], wa = bf16(w·a), ⟨da, a⟩ partials, h read from stages the
//                  producer loads after the K loop (gemm/epilogue_bwd.cuh: the staged epilogue)
//   dgrad gate/up  dx row = [dg | du] · [W_gate; W_up][e] (K = 2I, one chain), into the slot
//                  token·k + j of the row's home rank (EP >= 2: over NVLink)
// and the shared expert's (its tokens' rows, weight 1; its dx rows into shared_dx).
#pragma once

#include "cuda/fused/ops_bwd/op.cuh"

namespace mok::cuda::fused::bwd::ops {

struct DgradDown : OpBase<TaskKind::kDgradDown, gemm::Operands::kBNMajor, gemm::Operands::kKMajor> {
  static constexpr bool kRingEpilogue = true;  // h through the stage ring (gemm/epilogue_bwd.cuh)
  // Its block's dy rows gathered, and its h replayed where the forward did not keep it
  MOK_HD static int waits(int32_t unit, int32_t, const Geometry& g, const TaskCounts& c, Wait* out) {
    out[0] = Wait{CounterArray::kDyReady, unit, kBlockM};
    if (!replays(g, c, unit)) return 1;
    out[1] = Wait{CounterArray::kReplayDone, unit, c.n_replay};
    return 2;
  }
  // Its block, and the expert's count in the block's macrobatch (the wgrad tiles wait on it)
  MOK_HD static int signals(int32_t unit, int32_t, const Geometry& g, const TaskCounts&, Signal* out) {
    out[0] = Signal{CounterArray::kDgradDownDone, unit};
    out[1] = Signal{CounterArray::kExpertDgradDone, g.expert_of(unit) * g.num_macro + g.macro_of(unit)};
    return 2;
  }
#if defined(__CUDACC__)
  __device__ __forceinline__ static int32_t k_blocks(const BackwardParams& p, const Geometry&, const TaskCounts&,
                                                     const Task&) {
    return p.hidden / kBlockK;
  }
  template <class Pol, class MapsArg>
  __device__ __forceinline__ static Load load(const MapsArg& m, const BackwardParams& p, const Geometry& g,
                                              const TaskCounts& c, const Task& t) {
    // W_down[e] as stored: K rows, or (transposed) two neighbouring halves of its N rows
    const int32_t e_row = g.expert_of(t.block) * p.down_pitch, n0 = t.n_block * kBlockN, kb = k_blocks(p, g, c, t);
    return Load{static_cast<int32_t>(kOpsFor<Pol::kTransposed>), &m.dy_rows_k, &m.w_down_n, &m.w_down_n,
                t.block * kBlockM, Pol::kTransposed ? e_row + n0 : e_row, Pol::kTransposed ? kHalfN : n0,
                Pol::kTransposed ? kHalvesApart : kb, kb, 0};
  }
  // The tile's h passes after its k-blocks, and the SwiGLU-backward epilogue that reads them
  template <class Pol, class Stages, class Stage, class MapsArg>
  __device__ __forceinline__ static bool produce_epilogue(Stages& s, Stage& stage, const MapsArg& m,
                                                          const BackwardParams& p, const Task& t,
                                                          const gemm::WaitContext& wait) {
    return gemm::produce_swiglu_h(s, stage, &m.h_k, t.block * kBlockM, t.n_block * kBlockN, p.inter, wait);
  }
  template <class Pol, int kRegs, class Ring>
  __device__ __forceinline__ static bool epilogue_ring(const float (&acc)[kRegs], int consumer, const BackwardParams& p,
                                                       const Geometry&, const TaskCounts&, const Task& t,
                                                       const Ring& r) {
    const gemm::SwiGLUBwdArgs e{p.h, p.dh, p.wa, p.partials, p.inter, &r.maps.dh_st, &r.maps.wa_st};
    const int64_t row0 = int64_t{t.block} * kBlockM, left = p.max_rows - row0;
    const float* __restrict__ rw = p.row_weight + row0;
    return gemm::epilogue_dgrad_swiglu_staged<typename Ring::Tile>(
        acc, consumer, r.s, r.stage, r.wait, e, row0, row0,
        left < kBlockM ? static_cast<int>(left) : kBlockM, int64_t{t.n_block} * kBlockN, [&](int q) { return rw[q]; },
        r.bar);
  }
#endif
};

struct SharedDgradDown : OpBase<TaskKind::kSharedDgradDown, gemm::Operands::kBNMajor> {
  static constexpr bool kRingEpilogue = true;  // h through the stage ring (gemm/epilogue_bwd.cuh)
  // Its token block's h replayed, where the forward did not keep it
  MOK_HD static int waits(int32_t unit, int32_t, const Geometry&, const TaskCounts& c, Wait* out) {
    if (c.n_shared_replay == 0) return 0;
    out[0] = Wait{CounterArray::kSharedReplayDone, unit, c.n_shared_replay};
    return 1;
  }
  // Its token block, and the running total past the last block (the shared wgrad waits on it)
  MOK_HD static int signals(int32_t unit, int32_t, const Geometry&, const TaskCounts& c, Signal* out) {
    out[0] = Signal{CounterArray::kSharedDgradDownDone, unit};
    out[1] = Signal{CounterArray::kSharedDgradDownDone, c.shared_blocks};
    return 2;
  }
#if defined(__CUDACC__)
  __device__ __forceinline__ static int32_t k_blocks(const BackwardParams& p, const Geometry&, const TaskCounts&,
                                                     const Task&) {
    return p.hidden / kBlockK;
  }
  template <class Pol, class MapsArg>
  __device__ __forceinline__ static Load load(const MapsArg& m, const BackwardParams& p, const Geometry& g,
                                              const TaskCounts& c, const Task& t) {
    return Load{static_cast<int32_t>(kOps), &m.dy_k, &m.ws_down_n, &m.ws_down_n, t.block * kBlockM, 0,
                t.n_block * kBlockN, p.hidden / kBlockK, k_blocks(p, g, c, t), 0};
  }
  // As DgradDown's, over the shared h
  template <class Pol, class Stages, class Stage, class MapsArg>
  __device__ __forceinline__ static bool produce_epilogue(Stages& s, Stage& stage, const MapsArg& m,
                                                          const BackwardParams& p, const Task& t,
                                                          const gemm::WaitContext& wait) {
    return gemm::produce_swiglu_h(s, stage, &m.sh_h_k, t.block * kBlockM, t.n_block * kBlockN, p.shared_inter,
                                  wait);
  }
  template <class Pol, int kRegs, class Ring>
  __device__ __forceinline__ static bool epilogue_ring(const float (&acc)[kRegs], int consumer, const BackwardParams& p,
                                                       const Geometry&, const TaskCounts&, const Task& t,
                                                       const Ring& r) {
    const gemm::SwiGLUBwdArgs e{p.sh_h, p.sh_dh, p.sh_a, nullptr, p.shared_inter,
                                &r.maps.sh_dh_st, &r.maps.sh_a_st};
    const int64_t row0 = int64_t{t.block} * kBlockM, left = p.num_tokens - row0;
    return gemm::epilogue_dgrad_swiglu_staged<typename Ring::Tile>(
        acc, consumer, r.s, r.stage, r.wait, e, row0, row0,
        left < kBlockM ? static_cast<int>(left) : kBlockM, int64_t{t.n_block} * kBlockN, [](int) { return 1.0f; },
        r.bar);
  }
#endif
};

struct DgradGateUp : OpBase<TaskKind::kDgradGateUp, gemm::Operands::kBNMajor, gemm::Operands::kKMajor> {
  // Every dgrad-down tile of its block (its dg | du rows complete)
  MOK_HD static int waits(int32_t unit, int32_t, const Geometry&, const TaskCounts& c, Wait* out) {
    out[0] = Wait{CounterArray::kDgradDownDone, unit, c.n_dgrad_down};
    return 1;
  }
  MOK_HD static int signals(int32_t unit, int32_t, const Geometry&, const TaskCounts&, Signal* out) {
    out[0] = Signal{CounterArray::kDgradGateUpDone, unit};
    return 1;
  }
#if defined(__CUDACC__)
  __device__ __forceinline__ static int32_t k_blocks(const BackwardParams& p, const Geometry&, const TaskCounts&,
                                                     const Task&) {
    return 2 * p.inter / kBlockK;
  }
  template <class Pol, class MapsArg>
  __device__ __forceinline__ static Load load(const MapsArg& m, const BackwardParams& p, const Geometry& g,
                                              const TaskCounts& c, const Task& t) {
    // K = [g | u]: W_gate[e]'s K rows, then W_up[e]'s (as stored), or (transposed) two
    // neighbouring halves of their N rows, K from W_gate then from W_up
    const int32_t e_row = g.expert_of(t.block) * p.gate_up_pitch, n0 = t.n_block * kBlockN;
    return Load{static_cast<int32_t>(kOpsFor<Pol::kTransposed>), &m.dh_k, &m.w_gate_n, &m.w_up_n, t.block * kBlockM,
                Pol::kTransposed ? e_row + n0 : e_row, Pol::kTransposed ? kHalfN : n0, p.inter / kBlockK,
                k_blocks(p, g, c, t), 0};
  }
  template <class Pol, int kRegs>
  __device__ __forceinline__ static void epilogue(const float (&acc)[kRegs], int consumer, const BackwardParams& p,
                                                  const Geometry&, const TaskCounts&, const Task& t) {
    gemm::epilogue_scatter(
        acc, consumer, [&](uint32_t rec) { return home_slots(p, rec); }, p.hidden, p.rows + int64_t{t.block} * kBlockM,
        p.topk, int64_t{t.n_block} * kBlockN);
  }
#endif
};

struct SharedDgradGateUp : OpBase<TaskKind::kSharedDgradGateUp, gemm::Operands::kBNMajor> {
  MOK_HD static int waits(int32_t unit, int32_t, const Geometry&, const TaskCounts& c, Wait* out) {
    out[0] = Wait{CounterArray::kSharedDgradDownDone, unit, c.n_shared_dgrad_down};
    return 1;
  }
  // Nothing: its shared_dx rows are read after the grid barrier
  MOK_HD static int signals(int32_t, int32_t, const Geometry&, const TaskCounts&, Signal*) { return 0; }
#if defined(__CUDACC__)
  __device__ __forceinline__ static int32_t k_blocks(const BackwardParams& p, const Geometry&, const TaskCounts&,
                                                     const Task&) {
    return 2 * p.shared_inter / kBlockK;
  }
  template <class Pol, class MapsArg>
  __device__ __forceinline__ static Load load(const MapsArg& m, const BackwardParams& p, const Geometry& g,
                                              const TaskCounts& c, const Task& t) {
    return Load{static_cast<int32_t>(kOps), &m.sh_dh_k, &m.ws_gate_n, &m.ws_up_n, t.block * kBlockM, 0,
                t.n_block * kBlockN, p.shared_inter / kBlockK, k_blocks(p, g, c, t), 0};
  }
  template <class Pol, int kRegs>
  __device__ __forceinline__ static void epilogue(const float (&acc)[kRegs], int consumer, const BackwardParams& p,
                                                  const Geometry&, const TaskCounts&, const Task& t) {
    store_token_tile(acc, consumer, p.shared_dx, p.hidden, p.num_tokens, t.block, t.n_block);
  }
#endif
};

}  // namespace mok::cuda::fused::bwd::ops
