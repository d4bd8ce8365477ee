// The fused forward's consumer roles (warpgroups 1 and 2 of a compute block).
#pragma once

#include "cuda/fused/forward_params.cuh"

namespace mok::cuda::fused {

// ---- consumers: MMAs and epilogues of the producer's tasks -------------------------------------
__device__ __forceinline__ void consume_tasks(FusedShared& sh, const ForwardParams& p, const Geometry& g, const TaskCounts& counts,
                              int consumer, const gemm::WaitContext& wait) {
  using C = TileConfig;
  const bool leader = threadIdx.x % 128 == 0;
  gemm::PipelineState<C::kStages> stage;
  gemm::PipelineState<2> handoff, done_state;
  const int warp_in_group = __shfl_sync(0xffffffffu, (threadIdx.x / 32) % 4, 0);
  float acc[C::kAccRegs];
  for (;;) {
    // Take the next task from the producer
    if (!gemm::wait_barrier_warp(&sh.task_full[handoff.index], handoff.phase, wait, gemm::WaitSite::kConsumerFull,
                                 -1))
      break;
    // NOTES: task fields through shuffles, so every branch on them is warp-uniform for ptxas.
    TaskInfo info = sh.tasks[handoff.index];
    info.kind = __shfl_sync(0xffffffffu, info.kind, 0);
    info.block = __shfl_sync(0xffffffffu, info.block, 0);
    info.n_block = __shfl_sync(0xffffffffu, info.n_block, 0);
    ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kConsumers), 256);
    if (leader) ptx::mbar_arrive(&sh.task_empty[handoff.index]);
    handoff.advance();
    const TaskKind kind = static_cast<TaskKind>(info.kind);
    if (kind == TaskKind::kDone) break;
    const int32_t b = info.block;
    const int32_t k_blocks = kind == TaskKind::kSharedDown ? p.shared_inter / 64
                             : kind == TaskKind::kDown     ? p.inter / 64
                                                           : p.hidden / 64;
    if (!gemm::consume_tile(sh.stages, stage, k_blocks, consumer, acc, wait)) break;
    // Epilogue, then publish the tile
    switch (kind) {
      case TaskKind::kSharedGateUp:
        gemm::epilogue_swiglu(acc, consumer, p.shared_act, p.shared_inter, int64_t{b} * 128, p.num_tokens,
                              int64_t{info.n_block} * 128);
        break;
      case TaskKind::kSharedDown:
        gemm::epilogue_store(acc, consumer, p.shared_out, p.hidden, int64_t{b} * 128, p.num_tokens,
                             int64_t{info.n_block} * 256);
        break;
      case TaskKind::kGateUp:
        gemm::epilogue_swiglu(acc, consumer, p.act, p.inter, g.ring_row(b), int64_t{p.ring_blocks} * 128,
                              int64_t{info.n_block} * 128);
        break;
      case TaskKind::kDown:
        if (p.push_mode) {
          // MOK_PUSH=comm: into the block's ring rows (its x rows are dead: every gate/up tile
          // of the block is done); the comm blocks push them home
          gemm::epilogue_store(acc, consumer, p.ring, p.hidden, g.ring_row(b), int64_t{p.ring_blocks} * 128,
                               int64_t{info.n_block} * 256);
        } else {
          gemm::epilogue_scatter(acc, consumer, [&](uint32_t rec) { return home_slots(p, rec); }, p.hidden,
                                 p.rows + int64_t{b} * 128, p.topk, int64_t{info.n_block} * 256);
        }
        break;
      default:
        break;
    }
    // Hand the finished tile to the signaler (its stores ordered before the arrive)
    ptx::fence_proxy_async_global();
    ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kConsumers), 256);
    if (warp_in_group == 0) {
      if (!gemm::wait_barrier_warp(&sh.done_empty[done_state.index], done_state.phase ^ 1u, wait,
                                   gemm::WaitSite::kProducerEmpty, -2))
        break;
      if (leader) ptx::mbar_arrive(&sh.done_full[done_state.index]);
    }
    done_state.advance();
  }
}

}  // namespace mok::cuda::fused
