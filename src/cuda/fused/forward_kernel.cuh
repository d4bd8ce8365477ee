// The fused forward megakernel: one persistent launch, grid = SM count (or config.num_blocks).
// EP >= 2: the comm blocks pull rows from the x of their rank's region (NVLink), the down
// epilogue pushes each row to the slot of its home rank, and an end barrier over the group
// comes before the combine (comm/ep.cuh).
//
// Roles (dispatched at the end of this file by block index, then warpgroup; the shared
// parameters, storage and counters in forward_params.cuh, the comm role in ../comm/):
//   kComm       blocks [0, num_comm): gather routed rows of x into the ring (bulk copies
//               through shared memory), block by block in processing order; then they
//               join the compute roles below
//   kProducer   warpgroup 0 of a compute block: claims tasks, waits for their inputs,
//               issues TMA loads
//   kSignaler   warp 1 of warpgroup 0: publishes each finished tile to the global counters
//   kConsumer*  warpgroups 1, 2: wgmma and the epilogues (SwiGLU / scatter / store)
// after which every block joins the fixed-order combine of y (a grid barrier first).
//
// Dependencies are counters in global memory, zeroed before the launch, written with
// release and read with acquire at gpu scope:
//   gather_ready[b]   rows of block b in the ring              (comm -> gate/up tile)
//   gu_done[b]        gate/up tiles of block b finished         (-> down tiles; -> ring reuse)
//   dn_done[b]        down tiles of block b finished            (-> act ring reuse)
//   sgu_done[i]       shared gate/up tiles of block i finished  (-> shared down tiles)
//   task_next         next task index;  blocks_done  the grid barrier before the combine
// NOTES: rows written by generic stores (epilogues, zero padding) are read by TMA (the
// async proxy) in another block: writers fence.proxy.async before the release, readers
// after the acquire.
#pragma once

#include "cuda/comm/combine_token.cuh"
#include "cuda/comm/gather.cuh"
#include "cuda/fused/forward_params.cuh"

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
    // Wait for the task's inputs, then load its tiles
    const int32_t b = info.block;
    Wait waits[kMaxWaits];
    const bool ok = wait_all(p, waits, task_waits(static_cast<TaskKind>(info.kind), b, g, counts, waits), wait);
    gemm::TileLoad load{};
    switch (static_cast<TaskKind>(info.kind)) {
      case TaskKind::kSharedGateUp:
        load = gemm::TileLoad{&maps.x, &maps.ws_gate, &maps.ws_up, b * 128, info.n_block * 128, 0, p.hidden / 64};
        break;
      case TaskKind::kSharedDown:
        load = gemm::TileLoad{&maps.shared_act, &maps.ws_down, &maps.ws_down, b * 128, info.n_block * 256, 128,
                              p.shared_inter / 64};
        break;
      case TaskKind::kGateUp:
        load = gemm::TileLoad{&maps.ring, &maps.w_gate, &maps.w_up, g.ring_row(b),
                              p.block_expert[b] * p.inter + info.n_block * 128, 0, p.hidden / 64};
        break;
      case TaskKind::kDown:
        load = gemm::TileLoad{&maps.act, &maps.w_down, &maps.w_down, g.ring_row(b),
                              p.block_expert[b] * p.hidden + info.n_block * 256, 128, p.inter / 64};
        break;
      default:
        break;
    }
    if (!ok) break;
    ptx::fence_proxy_async_global();
    const uint64_t t_ready = ptx::globaltimer_ns();
    if (!gemm::produce_tile(sh.stages, stage, load, wait)) break;
    trace.add(mokTraceProducerWait, t_claim, t_ready, info.kind, b, info.n_block);
    trace.add(mokTraceProducerLoad, t_ready, ptx::globaltimer_ns(), info.kind, b, info.n_block);
  }
}

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

// ---- signaler: publish each finished tile to the global counters --------------------------------
// NOTES: kept out of the consumer warps: a single-thread branch there makes ptxas serialise
// every wgmma (C7518).  Chain: consumer stores -> named barrier -> done_full arrive
// (release.cta) -> wait here (acquire.cta) -> fence + red.release.gpu (cumulative).
__device__ void signal_tasks(FusedShared& sh, const ForwardParams& p, const gemm::WaitContext& wait) {
  int32_t* gu_done = p.counters + static_cast<int>(Counter::kHeader) + p.max_blocks;
  int32_t* dn_done = gu_done + p.max_blocks;
  int32_t* sgu_done = dn_done + p.max_blocks;
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
    int32_t* counter = kind == TaskKind::kSharedGateUp ? &sgu_done[info.block]
                       : kind == TaskKind::kGateUp     ? &gu_done[info.block]
                       : kind == TaskKind::kDown       ? &dn_done[info.block]
                                                       : nullptr;
    if (counter) {
      __threadfence();
      signal_counter(counter, 1);
    }
  }
}

// ---- end: grid barrier, then the fixed-order combine by each block's last 256 threads ---------
// Thread 128 arrives at (and waits on) the grid barrier; the named barrier then holds the
// other 255 combine threads until it has seen every block arrive.  Callers have ordered the
// block's own writes before thread 128 (a block or consumer barrier).
__device__ void finish_and_combine(FusedShared& sh, const ForwardParams& p, const gemm::WaitContext& wait) {
  int32_t* blocks_done = &p.counters[static_cast<int>(Counter::kBlocksDone)];
  TraceWriter trace(p, 2);
  const uint64_t t_arrive = ptx::globaltimer_ns();
  if (threadIdx.x == 128) {
    __threadfence();
    ptx::red_release_gpu_add(blocks_done, 1);
    if (wait_counter(blocks_done, static_cast<int32_t>(gridDim.x), wait, 9999) && p.group.size > 1) {
      // EP end barrier: every block's pushes were fenced at system scope before it arrived;
      // block 0 tells every rank that this rank's pushes landed, then each block waits for
      // every rank's word before combining its share of this rank's tokens.
      const int64_t seq = *p.group.seq;
      if (blockIdx.x == 0) ep::publish<true>(p.group, seq);
      ep::wait_group<true>(p.group, seq, wait);
    }
  }
  if (threadIdx.x < 128) return;
  ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kConsumers), 256);
  const uint64_t t_combine = ptx::globaltimer_ns();
  // Warp w of block b takes tokens b·8 + w, then every 8·gridDim-th.
  const int warp = __shfl_sync(0xffffffffu, (threadIdx.x - 128) / 32, 0);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * 8 + warp; t < p.num_tokens; t += static_cast<int64_t>(gridDim.x) * 8)
    combine_token(p, t);
  ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kConsumers), 256);
  if (threadIdx.x == 128) {
    trace.add(mokTraceGridBarrier, t_arrive, t_combine, 255, -1, -1);
    trace.add(mokTraceCombine, t_combine, ptx::globaltimer_ns(), 255, -1, -1);
  }
}

__global__ void __launch_bounds__(TileConfig::kThreads, 1)
    fused_forward_kernel(const __grid_constant__ Maps maps, const ForwardParams p) {
  using C = TileConfig;
  extern __shared__ uint8_t smem_raw[];
  auto& sh = *reinterpret_cast<FusedShared*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const gemm::WaitContext wait{ptx::globaltimer_ns() + p.timeout_ns, p.timeout_record};
  // A wait of this call already expired (EP: the start barrier): leave; the host reports it.
  if (p.timeout_record && *reinterpret_cast<volatile int64_t*>(p.timeout_record) != 0) return;
  int32_t* gather_ready = p.counters + static_cast<int>(Counter::kHeader);

  // Geometry and the task table, identical on every block
  const int32_t num_blocks = p.expert_offset[p.num_local] / 128;
  const Geometry g = Geometry::make(num_blocks, p.ring_blocks, p.minibatch_blocks);
  const TaskCounts counts{p.inter / 128, p.hidden / 256, p.shared_inter / 128, p.hidden / 256, p.shared_blocks,
                          p.push_mode};
  const bool comm = static_cast<int32_t>(blockIdx.x) < p.num_comm;
  if (threadIdx.x == 0) {
    int32_t num_tasks = 0;
    sh.num_segments = build_segments(g, counts, sh.segments, &num_tasks);
    sh.num_tasks = num_tasks;
    sh.n_group = p.n_group;
    sh.stages.init_barriers();
    for (int i = 0; i < 2; ++i) {
      ptx::mbar_init(&sh.task_full[i], 1);
      ptx::mbar_init(&sh.task_empty[i], C::kConsumers + 1);
      ptx::mbar_init(&sh.done_full[i], C::kConsumers);
      ptx::mbar_init(&sh.done_empty[i], 1);
    }
    for (int w = 0; w < 16; ++w) ptx::mbar_init(&sh.gather_bar[w], 1);
    ptx::fence_mbar_init();
  }
  __syncthreads();

  // NOTES: the role comes through a shuffle so that ptxas knows it is warp-uniform, and
  // each role returns on its own: wgmma code must not share a tail with divergent roles
  // (ptxas serialises every wgmma otherwise: C7518).
  // A comm block that has gathered its share joins the compute roles: tasks are claimed
  // dynamically, so it takes what is left.  Its staging rows are free by then (every bulk
  // copy completed) and the stage barriers were never touched.
  if (comm) {
    if (p.gather_mode == 1) {
      // Staging rows, then one zero row, in the stage memory
      uint8_t* base = reinterpret_cast<uint8_t*>(&sh.stages);
      const uint32_t row_bytes = static_cast<uint32_t>(p.hidden) * 2;
      const int slots = min(16, static_cast<int>(sizeof(sh.stages.a) + sizeof(sh.stages.b)) / static_cast<int>(row_bytes) - 1);
      uint8_t* zero_row = base + static_cast<size_t>(slots) * row_bytes;
      for (uint32_t v = threadIdx.x; v < row_bytes / 16; v += blockDim.x)
        reinterpret_cast<uint4*>(zero_row)[v] = make_uint4(0, 0, 0, 0);
      ptx::fence_proxy_async_smem();
      __syncthreads();
      if (threadIdx.x == 0)
        comm_gather_pipelined(sh, p, g, wait, gather_ready, counts.n_gate_up, base, slots, zero_row);
    } else {
      comm_gather(sh, p, g, wait, gather_ready, counts);
    }
    __syncthreads();
    if (p.push_mode) {
      // Pushing comm blocks stay comm blocks to the end: straight to the grid barrier (their
      // pushes completed and were fenced in push_block) and the combine
      finish_and_combine(sh, p, wait);
      return;
    }
  }
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x == 0) produce_tasks(sh, maps, p, g, counts, wait);
    if (threadIdx.x == 32) signal_tasks(sh, p, wait);
    return;
  }
  ptx::setmaxnreg_inc<C::kConsumerRegs>();
  consume_tasks(sh, p, g, counts, warpgroup - 1, wait);
  if (p.group.size > 1) __threadfence_system();  // this thread's pushes, before the end barrier
  ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kConsumers), 256);
  finish_and_combine(sh, p, wait);
}

}  // namespace mok::cuda::fused
