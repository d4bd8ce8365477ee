// The fused forward's last step of every block: the grid barrier, then its share of the combine.
#pragma once

#include "cuda/fused/forward_params.cuh"
#include "cuda/comm/combine_token.cuh"
#include "cuda/comm/transport.cuh"

namespace mok::cuda::fused {

// ---- end: grid barrier, then the fixed-order combine by each block's consumer threads --------
// The first consumer thread (128) arrives at (and waits on) the grid barrier; the named barrier
// then holds the other 255 combine threads until it has seen every block arrive.  Callers have
// ordered the block's own writes before that thread (a block or consumer barrier).
template <class SharedT>
__device__ void finish_and_combine(SharedT& sh, const ForwardParams& p, const gemm::WaitContext& wait) {
  int32_t* blocks_done = &p.counters[static_cast<int>(Counter::kBlocksDone)];
  TraceWriter trace(p, 2);
  const uint64_t t_arrive = ptx::globaltimer_ns();
  if (threadIdx.x == kFirstConsumerThread) {
    __threadfence();
    ptx::red_release_gpu_add(blocks_done, 1);
    if (wait_counter(blocks_done, static_cast<int32_t>(gridDim.x), wait, WaitSite::kGridBarrier, 0) &&
        p.group.size > 1) {
      // EP end barrier (every block's pushes were fenced at system scope before it arrived),
      // before each block combines its share of this rank's tokens
      end_barrier(p.group, wait);
    }
  }
  if (threadIdx.x < kFirstConsumerThread) return;
  ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kConsumers), kConsumerThreads);
  const uint64_t t_combine = ptx::globaltimer_ns();
  // Warp w of block b takes tokens b·8 + w, then every 8·gridDim-th.
  const int warp = __shfl_sync(0xffffffffu, (threadIdx.x - kFirstConsumerThread) / 32, 0);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * 8 + warp; t < p.num_tokens; t += static_cast<int64_t>(gridDim.x) * 8)
    combine_token(p, t);
  ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kConsumers), kConsumerThreads);
  if (threadIdx.x == kFirstConsumerThread) {
    trace.add(mokTraceGridBarrier, t_arrive, t_combine, 255, -1, -1);
    trace.add(mokTraceCombine, t_combine, ptx::globaltimer_ns(), 255, -1, -1);
  }
}

}  // namespace mok::cuda::fused
