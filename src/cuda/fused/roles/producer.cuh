// The producer role of a fused kernel (warpgroup 0, thread 0 of a compute block), generic over
// the direction (forward_dir.cuh: what a direction provides).
#pragma once

#include "cuda/fused/forward_params.cuh"

namespace mok::cuda::fused {

// ---- producer: claim tasks, wait for their inputs, issue their loads ---------------------------
template <class Dir>
__device__ void produce_tasks(typename Dir::Shared& sh, const typename Dir::MapsT& maps, const typename Dir::Params& p,
                              const typename Dir::GeometryT& g, const typename Dir::Counts& counts,
                              const gemm::WaitContext& wait) {
  using Task = typename Dir::Task;
  typename Dir::Stage stage;
  gemm::PipelineState<2> handoff;
  TraceWriter trace(p, 0);
  if constexpr (Dir::kClaimAhead) {
    // The next task is claimed and decoded while this one's loads are in flight (after its
    // first k-block is issued), so that its claim, decode and waits are off the consumers'
    // path between tiles.  Deadlock-free: a block holds at most its current task and the next
    // one, and the lowest unfinished claimed task is always some block's current task, whose
    // waits are on finished (lower) tasks only.
    const int32_t first = atomicAdd(Dir::task_counter(p), 1);
    Task info = first < sh.num_tasks ? Dir::decode(sh, p, first) : Dir::done();
    for (;;) {
      const uint64_t t_claim = ptx::globaltimer_ns();
      if (!sh.rings.tasks.producer_acquire(handoff, wait, WaitSite::kTaskSlotFree, handoff.index)) break;
      sh.tasks[handoff.index] = info;
      sh.rings.tasks.producer_commit(handoff);
      handoff.advance();
      if (info.kind == Dir::kDone) break;
      typename Dir::WaitT waits[kMaxWaits];
      const bool ok = Dir::wait_all(p, waits, Dir::waits(info, g, counts, waits), wait);
      const typename Dir::Load load = Dir::load(maps, p, g, counts, info);
      if (!ok) break;
      ptx::fence_proxy_async_global();
      const uint64_t t_ready = ptx::globaltimer_ns();
      // NOTES: the next task waits in shared memory (sh.next_task), not in the producer's 40
      // registers beside this one's load
      // (a call instead, to keep the decode's registers out of the k-block loop, makes ptxas
      // serialise the kernel's wgmma: C7518)
      auto claim_next = [&]() {
        const int32_t t = atomicAdd(Dir::task_counter(p), 1);
        sh.next_task = t < sh.num_tasks ? Dir::decode(sh, p, t) : Dir::done();
      };
      if (!Dir::produce(sh.stages, stage, load, wait, claim_next)) break;
      if (!Dir::produce_epilogue(sh.stages, stage, maps, p, info, wait)) break;
      trace.add(mokTraceProducerWait, t_claim, t_ready, info.kind, info.block, info.n_block);
      trace.add(mokTraceProducerLoad, t_ready, ptx::globaltimer_ns(), info.kind, info.block, info.n_block);
      info = sh.next_task;
    }
  } else {
  for (;;) {
    // Claim the next task and hand it to the consumers
    const uint64_t t_claim = ptx::globaltimer_ns();
    const int32_t task = atomicAdd(Dir::task_counter(p), 1);
    Task info = task < sh.num_tasks ? Dir::decode(sh, p, task) : Dir::done();
    if (!sh.rings.tasks.producer_acquire(handoff, wait, WaitSite::kTaskSlotFree, handoff.index)) break;
    sh.tasks[handoff.index] = info;
    sh.rings.tasks.producer_commit(handoff);
    handoff.advance();
    if (info.kind == Dir::kDone) break;
    // Wait for the task's inputs, then load its tiles (what and from where: the op's)
    const int32_t b = info.block;
    typename Dir::WaitT waits[kMaxWaits];
    const bool ok = Dir::wait_all(p, waits, Dir::waits(info, g, counts, waits), wait);
    typename Dir::Load load{};
    load = Dir::load(maps, p, g, counts, info);
    if (!ok) break;
    ptx::fence_proxy_async_global();
    const uint64_t t_ready = ptx::globaltimer_ns();
    if (!Dir::produce(sh.stages, stage, load, wait)) break;
    if (!Dir::produce_epilogue(sh.stages, stage, maps, p, info, wait)) break;
    trace.add(mokTraceProducerWait, t_claim, t_ready, info.kind, b, info.n_block);
    trace.add(mokTraceProducerLoad, t_ready, ptx::globaltimer_ns(), info.kind, b, info.n_block);
  }
  }
}

}  // namespace mok::cuda::fused
