// The signaler role of a fused kernel (warp 1 of warpgroup 0), generic over the direction
// (forward_dir.cuh).
#pragma once

#include "cuda/fused/forward_params.cuh"

namespace mok::cuda::fused {

// ---- signaler: publish each finished tile to the global counters --------------------------------
// NOTES: kept out of the consumer warps: a single-thread branch there makes ptxas serialise
// every wgmma (C7518).  Chain: consumer stores -> named barrier -> done_full arrive
// (release.cta) -> wait here (acquire.cta) -> fence + red.release.gpu (cumulative).
template <class Dir>
__device__ void signal_tasks(typename Dir::Shared& sh, const typename Dir::Params& p, const typename Dir::GeometryT& g,
                             const typename Dir::Counts& counts, const gemm::WaitContext& wait) {
  const typename Dir::SignalTargets targets = Dir::signal_targets(p);
  gemm::PipelineState<2> handoff, done_state;
  TraceWriter trace(p, 1);
  for (;;) {
    if (!gemm::wait_barrier(&sh.task_full[handoff.index], handoff.phase, wait, gemm::WaitSite::kConsumerFull, -3)) return;
    // NOTES: the tile starts when the consumers are free and the task is posted: both are
    // true here (the signaler trails the consumers by at most the tile in flight).
    const uint64_t t_start = ptx::globaltimer_ns();
    const typename Dir::Task info = sh.tasks[handoff.index];
    ptx::mbar_arrive(&sh.task_empty[handoff.index]);
    handoff.advance();
    if (info.kind == Dir::kDone) return;
    if (!gemm::wait_barrier(&sh.done_full[done_state.index], done_state.phase, wait, gemm::WaitSite::kConsumerFull, -4))
      return;
    ptx::mbar_arrive(&sh.done_empty[done_state.index]);
    done_state.advance();
    trace.add(mokTraceTile, t_start, ptx::globaltimer_ns(), info.kind, info.block, info.n_block);
    // The op's counters, if its tiles have any
    Dir::signal(targets, info, g, counts);
  }
}

}  // namespace mok::cuda::fused
