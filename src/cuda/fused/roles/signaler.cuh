// The fused forward's signaler role (warp 1 of warpgroup 0).
#pragma once

#include "cuda/fused/forward_params.cuh"
#include "cuda/fused/ops/ops.cuh"

namespace mok::cuda::fused {

// ---- signaler: publish each finished tile to the global counters --------------------------------
// NOTES: kept out of the consumer warps: a single-thread branch there makes ptxas serialise
// every wgmma (C7518).  Chain: consumer stores -> named barrier -> done_full arrive
// (release.cta) -> wait here (acquire.cta) -> fence + red.release.gpu (cumulative).
__device__ void signal_tasks(FusedShared& sh, const ForwardParams& p, const gemm::WaitContext& wait) {
  // The counter arrays a tile can add to, by CounterArray (gather_ready, push_done: the comm blocks')
  int32_t* gu_done = p.counters + static_cast<int>(Counter::kHeader) + p.max_blocks;
  int32_t* dn_done = gu_done + p.max_blocks;
  int32_t* sgu_done = dn_done + p.max_blocks;
  int32_t* const arrays[] = {nullptr, gu_done, dn_done, sgu_done};
  gemm::PipelineState<2> handoff, done_state;
  TraceWriter trace(p, 1);
  for (;;) {
    if (!gemm::wait_barrier(&sh.task_full[handoff.index], handoff.phase, wait, gemm::WaitSite::kConsumerFull, -3)) return;
    // NOTES: the tile starts when the consumers are free and the task is posted: both are
    // true here (the signaler trails the consumers by at most the tile in flight).
    const uint64_t t_start = ptx::globaltimer_ns();
    const TaskInfo info = sh.tasks[handoff.index];
    ptx::mbar_arrive(&sh.task_empty[handoff.index]);
    handoff.advance();
    const TaskKind kind = static_cast<TaskKind>(info.kind);
    if (kind == TaskKind::kDone) return;
    if (!gemm::wait_barrier(&sh.done_full[done_state.index], done_state.phase, wait, gemm::WaitSite::kConsumerFull, -4))
      return;
    ptx::mbar_arrive(&sh.done_empty[done_state.index]);
    done_state.advance();
    trace.add(mokTraceTile, t_start, ptx::globaltimer_ns(), info.kind, info.block, info.n_block);
    // The op's counter, if its tiles have one
    int32_t* counter = visit_op(kind, [=](auto op) -> int32_t* {
      constexpr CounterArray array = decltype(op)::kSignals;
      static_assert(array != CounterArray::kGatherReady && array != CounterArray::kPushDone, "comm blocks' counters");
      if constexpr (array == CounterArray::kNone) return nullptr;
      else return arrays[static_cast<int>(array)] + info.block;
    });
    if (counter) {
      __threadfence();
      signal_counter(counter, 1);
    }
  }
}

}  // namespace mok::cuda::fused
