// The fused forward's producer role (warpgroup 0, thread 0 of a compute block).
#pragma once

#include "cuda/fused/forward_params.cuh"
#include "cuda/fused/ops/ops.cuh"

namespace mok::cuda::fused {

// ---- producer: claim tasks, wait for their inputs, issue their loads ---------------------------
__device__ void produce_tasks(FusedShared& sh, const Maps& maps, const ForwardParams& p, const Geometry& g,
                              const TaskCounts& counts, const gemm::WaitContext& wait) {
  using C = TileConfig;
  gemm::PipelineState<C::kStages> stage;
  gemm::PipelineState<2> handoff;
  TraceWriter trace(p, 0);
  for (;;) {
    // Claim the next task and hand it to the consumers
    const uint64_t t_claim = ptx::globaltimer_ns();
    const int32_t task = atomicAdd(&p.counters[static_cast<int>(Counter::kTaskNext)], 1);
    TaskInfo info = task < sh.num_tasks ? decode_task(sh, task) : TaskInfo{static_cast<int32_t>(TaskKind::kDone), 0, 0, 0};
    if (!gemm::wait_barrier(&sh.task_empty[handoff.index], handoff.phase ^ 1u, wait, gemm::WaitSite::kProducerEmpty, -1))
      break;
    sh.tasks[handoff.index] = info;
    ptx::mbar_arrive(&sh.task_full[handoff.index]);
    handoff.advance();
    if (info.kind == static_cast<int32_t>(TaskKind::kDone)) break;
    // Wait for the task's inputs, then load its tiles (what and from where: the op's)
    const int32_t b = info.block;
    const TaskKind kind = static_cast<TaskKind>(info.kind);
    Wait waits[kMaxWaits];
    const bool ok = wait_all(p, waits, task_waits(kind, b, g, counts, waits), wait);
    gemm::TileLoad load{};
    visit_op(kind, [&, info](auto op) { load = decltype(op)::load(maps, p, g, info); });
    if (!ok) break;
    ptx::fence_proxy_async_global();
    const uint64_t t_ready = ptx::globaltimer_ns();
    if (!gemm::produce_tile(sh.stages, stage, load, wait)) break;
    trace.add(mokTraceProducerWait, t_claim, t_ready, info.kind, b, info.n_block);
    trace.add(mokTraceProducerLoad, t_ready, ptx::globaltimer_ns(), info.kind, b, info.n_block);
  }
}

}  // namespace mok::cuda::fused
