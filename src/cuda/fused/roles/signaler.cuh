// The signaler role of a fused kernel (warp 1 of warpgroup 0), generic over the direction
// (forward_dir.cuh).
#pragma once

#include "cuda/fused/forward_params.cuh"

namespace mok::cuda::fused {

// ---- signaler: publish each finished tile to the global counters --------------------------------
// NOTES: kept out of the consumer warps: a single-thread branch there makes ptxas serialise
// every wgmma (C7518).  Chain: consumer stores -> named barrier -> done ring's full arrive
// (release.cta) -> wait here (acquire.cta) -> fence + red.release.gpu (cumulative).
template <class Dir>
__device__ void signal_tasks(typename Dir::Shared& sh, const typename Dir::Params& p, const typename Dir::GeometryT& g,
                             const typename Dir::Counts& counts, const gemm::WaitContext& wait) {
  const typename Dir::SignalTargets targets = Dir::signal_targets(p);
  gemm::PipelineState<2> handoff, done_state;
  TraceWriter trace(p, 1);
  for (;;) {
    if (!sh.rings.tasks.template consumer_wait<false>(handoff, wait, WaitSite::kSignalerTaskFull, handoff.index))
      return;
    // NOTES: the tile starts when the consumers are free and the task is posted: both are
    // true here (the signaler trails the consumers by at most the tile in flight).
    const uint64_t t_start = ptx::globaltimer_ns();
    const typename Dir::Task info = sh.tasks[handoff.index];
    sh.rings.tasks.consumer_release(handoff.index);
    handoff.advance();
    if (info.kind == Dir::kDone) return;
    if (!sh.rings.done.template consumer_wait<false>(done_state, wait, WaitSite::kDoneSlotFull, done_state.index))
      return;
    sh.rings.done.consumer_release(done_state.index);
    done_state.advance();
    trace.add(mokTraceTile, t_start, ptx::globaltimer_ns(), info.kind, info.block, info.n_block);
    // The op's counters, if its tiles have any
    Dir::signal(targets, info, g, counts);
  }
}

}  // namespace mok::cuda::fused
