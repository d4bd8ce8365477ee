// The fused forward megakernel: one persistent launch, grid = SM count (or config.num_blocks).
// EP >= 2: the comm blocks pull rows from the x of their rank's region (NVLink), the down
// epilogue pushes each row to the slot of its home rank, and an end barrier over the group
// comes before the combine (ep.cuh).
//
// Roles (dispatched at the end of this file by block index, then warpgroup):
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

#include "cuda/combine.cuh"
#include "cuda/ep.cuh"
#include "cuda/fused/schedule.cuh"
#include "cuda/gemm/tile.cuh"

namespace mok::cuda::fused {

using gemm::TileConfig;

enum class NamedBarrier : uint32_t {
  kBlock = 0,      // __syncthreads
  kConsumers = 1,  // both consumer warpgroups (256 threads): a tile's stores are all issued
};

enum class Counter : int32_t { kTaskNext = 0, kBlocksDone = 1, kHeader = 2 };

struct TaskInfo {
  int32_t kind;     // TaskKind
  int32_t block;    // row block (routed: global plan block; shared: token block)
  int32_t n_block;
  int32_t unused;
};

struct ForwardParams {
  // Dimensions
  int32_t hidden, inter, shared_inter, topk;
  int64_t num_tokens;
  int32_t ring_blocks, minibatch_blocks, num_comm;
  int32_t max_blocks, shared_blocks;
  int32_t n_group;            // raster: N-blocks per group within a segment
  int32_t gather_mode;        // 0: one row in flight per comm warp; 1: one thread, a deep pipeline
  int32_t push_mode;          // 0: the down epilogue stores rows to their slots; 1: it stores them
                              // into the ring and the comm blocks push them home (MOK_PUSH=comm)
  // Plan
  const uint32_t* rows;
  const int32_t* expert_offset;
  const int32_t* block_expert;
  int32_t num_local;
  // Data
  const __nv_bfloat16* x;
  const float* topk_weights;
  plan::RoutingView routing;
  __nv_bfloat16* ring;        // [macrobatch_size, H]
  __nv_bfloat16* act;         // [macrobatch_size, I]
  __nv_bfloat16* slots;       // [T*k, H]
  __nv_bfloat16* shared_act;  // [T_max, I_s]
  __nv_bfloat16* shared_out;  // [T_max, H]
  __nv_bfloat16* y;           // [T, H]
  // EP >= 2: the group's regions (pull from x_of(rank), push to slots_of(rank)); size 1 at EP = 1
  ep::Group group;
  // Timing ring (null = off): kTraceRecorders regions of trace_cap events per block
  mokTraceEvent_t* trace;
  int32_t trace_cap;
  // Synchronisation
  int32_t* counters;          // kHeader words, then gather_ready, gu_done, dn_done, sgu_done, push_done [max_blocks]
  uint64_t timeout_ns;
  int64_t* timeout_record;
};

struct Maps {
  CUtensorMap ring, w_gate, w_up, act, w_down, x, ws_gate, ws_up, shared_act, ws_down;
};

struct alignas(1024) FusedShared {
  gemm::StageStorage stages;                // also the comm blocks' row staging
  Segment segments[kMaxSegments];
  TaskInfo tasks[2];                        // producer -> consumers + signaler task handoff
  uint64_t task_full[2];                    // producer -> (consumers, signaler)
  uint64_t task_empty[2];                   // (2 consumer leaders + signaler) -> producer
  uint64_t done_full[2];                    // consumer leaders -> signaler: the tile's stores are issued
  uint64_t done_empty[2];                   // signaler -> consumer leaders
  uint64_t gather_bar[16];                  // comm: one per staging row (warps: per warp)
  int32_t num_segments;
  int32_t num_tasks;
  int32_t n_group;
};
inline constexpr size_t kFusedSmemBytes = sizeof(FusedShared) + 1024;
static_assert(kFusedSmemBytes <= 227 * 1024, "fused shared storage exceeds 227 KB");

// ---- global counters ------------------------------------------------------------------------
__device__ __forceinline__ bool wait_counter(const int32_t* counter, int32_t expected, const gemm::WaitContext& wait,
                                             int64_t which) {
  if (ptx::ld_acquire_gpu(counter) >= expected) return true;
  for (uint32_t spin = 1;; ++spin) {
    // NOTES: a spinning thread costs power the tensor cores need under the power cap
    // (sustained runs clock down ~18 %); back off after the first polls.
    if (spin > 16) __nanosleep(spin > 256 ? 256 : 64);
    if (ptx::ld_acquire_gpu(counter) >= expected) return true;
    if ((spin & 63u) != 0) continue;
    if (wait.timeout_record && *reinterpret_cast<volatile int64_t*>(wait.timeout_record) != 0) return false;
    if (ptx::globaltimer_ns() > wait.deadline_ns) {
      gemm::report_timeout(wait, gemm::WaitSite::kCounter, which, expected);
      return false;
    }
  }
}

__device__ __forceinline__ void signal_counter(int32_t* counter, int32_t add) {
  ptx::fence_proxy_async_global();
  ptx::red_release_gpu_add(counter, add);
}

// Counter arrays after the header: gather_ready, gu_done, dn_done, sgu_done, push_done, each
// [max_blocks] (max_blocks >= ceil(T_max / 128), the shared blocks).
__device__ __forceinline__ int32_t* counter_of(const ForwardParams& p, const Wait& w) {
  return p.counters + static_cast<int>(Counter::kHeader) + static_cast<int64_t>(w.array) * p.max_blocks + w.index;
}

__device__ __forceinline__ bool wait_all(const ForwardParams& p, const Wait* waits, int n,
                                         const gemm::WaitContext& wait) {
  for (int i = 0; i < n; ++i)
    if (!wait_counter(counter_of(p, waits[i]), waits[i].expected, wait,
                      static_cast<int64_t>(waits[i].array) * 100000 + waits[i].index))
      return false;
  return true;
}

// ---- timing ring ------------------------------------------------------------------------------
// One writer per (block, recorder): 0 producer, 1 signaler, 2 combine thread, 3 comm.
struct TraceWriter {
  mokTraceEvent_t* base = nullptr;
  int32_t cap = 0, count = 0;
  __device__ TraceWriter(const ForwardParams& p, int recorder) {
    if (p.trace) {
      base = p.trace + (static_cast<int64_t>(blockIdx.x) * MOK_TRACE_RECORDERS + recorder) * p.trace_cap;
      cap = p.trace_cap;
    }
  }
  __device__ void add(mokTraceRole_t role, uint64_t begin, uint64_t end, int32_t kind, int32_t block, int32_t detail) {
    if (base == nullptr || count >= cap) return;
    base[count++] = mokTraceEvent_t{begin, end, static_cast<uint32_t>(role), static_cast<uint32_t>(kind), block, detail};
  }
};

// ---- task decode ------------------------------------------------------------------------------
__device__ __forceinline__ TaskInfo decode_task(const FusedShared& sh, int32_t task) {
  const TaskTile t = fused::decode_task(sh.segments, sh.num_segments, sh.n_group, task);
  return TaskInfo{t.kind, t.block, t.n_block, 0};
}

// ---- comm role: gather routed rows into the ring (and, MOK_PUSH=comm, push outputs home) ------
// The source row of a plan record: x of its rank (EP >= 2: that rank's region, over NVLink).
__device__ __forceinline__ const __nv_bfloat16* x_row(const ForwardParams& p, uint32_t rec) {
  const __nv_bfloat16* x = p.group.size > 1 ? ep::x_of(p.group, row_rank(rec)) : p.x;
  return x + row_token(rec) * p.hidden;
}
// The slot array of a plan record's home rank (EP >= 2: in that rank's region); p.slots for
// padding records, which are never stored.
__device__ __forceinline__ __nv_bfloat16* home_slots(const ForwardParams& p, uint32_t rec) {
  return p.group.size > 1 && !row_is_pad(rec) ? ep::slots_of(p.group, row_rank(rec)) : p.slots;
}
// The slot row of a (non-padding) plan record in its home rank's slots.
__device__ __forceinline__ __nv_bfloat16* slot_row(const ForwardParams& p, uint32_t rec) {
  return home_slots(p, rec) + (row_token(rec) * p.topk + row_slot(rec)) * p.hidden;
}

// One warp's staging row in the (otherwise unused) stage memory, and its barrier.
struct CommWarp {
  uint8_t* slot;
  uint64_t* bar;
  uint32_t phase = 0;
  uint32_t row_bytes;
};

// Copies row src -> dst through the warp's staging row (lane 0: bulk load, wait, bulk store).
// NOTES: on a timeout the row is skipped, not the loop: the other lanes must still reach
// __syncwarp; the recorded timeout makes every other wait of the launch leave.
__device__ __forceinline__ void copy_row(CommWarp& w, const void* src, void* dst, const gemm::WaitContext& wait,
                                         int64_t detail) {
  if ((threadIdx.x & 31) != 0) return;
  ptx::bulk_wait_read<0>();  // the staging row's previous store has read it
  ptx::mbar_arrive_expect_tx(w.bar, w.row_bytes);
  ptx::bulk_load(w.slot, src, w.row_bytes, w.bar);
  if (!gemm::wait_barrier(w.bar, w.phase, wait, gemm::WaitSite::kConsumerFull, detail)) return;
  w.phase ^= 1u;
  ptx::bulk_store(dst, w.slot, w.row_bytes);
  ptx::bulk_commit();
}

// Gathers row block b (processing position q) into its ring rows, zeros for padding rows;
// releases gather_ready[b] per warp once its stores completed.
__device__ void gather_block(CommWarp& w, const ForwardParams& p, const Geometry& g, int32_t b,
                             const gemm::WaitContext& wait, int32_t* gather_ready) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  const int64_t row_vecs = p.hidden / 8;
  int32_t rows_done = 0;
  for (int i = warp; i < 128; i += num_warps, ++rows_done) {
    const uint32_t rec = p.rows[static_cast<int64_t>(b) * 128 + i];
    __nv_bfloat16* dst = p.ring + static_cast<int64_t>(g.ring_row(b) + i) * p.hidden;
    if (row_is_pad(rec)) {
      // Padding rows are zeros (generic stores)
      for (int64_t v = lane; v < row_vecs; v += 32) reinterpret_cast<uint4*>(dst)[v] = make_uint4(0, 0, 0, 0);
      continue;
    }
    copy_row(w, x_row(p, rec), dst, wait, 6000 + warp);
  }
  // Publish this warp's rows of block b once its stores completed
  if (lane == 0) ptx::bulk_wait<0>();
  ptx::fence_proxy_async_global();  // every lane: its generic zero-row stores
  __syncwarp();
  if (lane == 0) ptx::red_release_gpu_add(&gather_ready[b], rows_done);
}

// MOK_PUSH=comm: pushes the down outputs of row block b (in its ring rows) to their home
// slots; releases push_done[b] per warp once its stores completed.
__device__ void push_block(CommWarp& w, const ForwardParams& p, const Geometry& g, int32_t b,
                           const gemm::WaitContext& wait, int32_t* push_done) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  int32_t rows_done = 0;
  for (int i = warp; i < 128; i += num_warps, ++rows_done) {
    const uint32_t rec = p.rows[static_cast<int64_t>(b) * 128 + i];
    if (row_is_pad(rec)) continue;
    copy_row(w, p.ring + static_cast<int64_t>(g.ring_row(b) + i) * p.hidden, slot_row(p, rec), wait, 8000 + warp);
  }
  if (lane == 0) {
    ptx::bulk_wait<0>();
    ptx::fence_proxy_async_global();
    if (p.group.size > 1) __threadfence_system();  // pushed rows visible to their home rank
    ptx::red_release_gpu_add(&push_done[b], rows_done);
  }
  __syncwarp();
}

__device__ void comm_gather(FusedShared& sh, const ForwardParams& p, const Geometry& g, const gemm::WaitContext& wait,
                            int32_t* gather_ready, const TaskCounts& counts) {
  const int warp = threadIdx.x / 32;
  CommWarp w{reinterpret_cast<uint8_t*>(&sh.stages) + static_cast<size_t>(warp) * p.hidden * 2, &sh.gather_bar[warp],
             0, static_cast<uint32_t>(p.hidden) * 2};
  TraceWriter trace(p, 3);
  Wait waits[kMaxWaits];
  if (!counts.push_by_comm) {
    for (int32_t q = blockIdx.x; q < g.num_blocks; q += p.num_comm) {
      const int32_t b = g.block_at(q);
      const uint64_t t_begin = ptx::globaltimer_ns();
      // Wait until the previous occupant of the ring slot was consumed by its gate/up tiles
      if (!wait_all(p, waits, gather_waits(b, g, counts, waits), wait)) return;
      gather_block(w, p, g, b, wait, gather_ready);
      if (warp == 0 && (threadIdx.x & 31) == 0) trace.add(mokTraceGather, t_begin, ptx::globaltimer_ns(), 255, b, -1);
    }
    return;
  }
  // MOK_PUSH=comm: gathers and pushes of this comm block's row blocks in CommJobs order
  int32_t* push_done = p.counters + static_cast<int>(Counter::kHeader) +
                       static_cast<int64_t>(CounterArray::kPushDone) * p.max_blocks;
  CommJobs jobs(g, static_cast<int32_t>(blockIdx.x), p.num_comm);
  while (!jobs.done()) {
    int32_t q;
    const bool push = jobs.next(g, &q);
    const int32_t b = g.block_at(q);
    const uint64_t t_begin = ptx::globaltimer_ns();
    if (push) {
      if (!wait_all(p, waits, push_waits(b, counts, waits), wait)) return;
      ptx::fence_proxy_async_global();  // the down epilogue's generic stores, read by bulk loads
      push_block(w, p, g, b, wait, push_done);
      ++jobs.next_push;
    } else {
      if (!wait_all(p, waits, gather_waits(b, g, counts, waits), wait)) return;
      gather_block(w, p, g, b, wait, gather_ready);
      ++jobs.next_gather;
    }
    if (warp == 0 && (threadIdx.x & 31) == 0)
      trace.add(mokTraceGather, t_begin, ptx::globaltimer_ns(), push ? 254 : 255, b, -1);
  }
}

// One thread keeps a pipeline of bulk copies: up to (slots - kStoreDepth) row loads and
// kStoreDepth row stores in flight, staging rows in the stage memory; padding rows are
// stored from a zero row.  A row block is released once every store of it completed.
// (mode 1 of MOK_GATHER; the zero row is filled by the caller.)
__device__ void comm_gather_pipelined(FusedShared& sh, const ForwardParams& p, const Geometry& g,
                                      const gemm::WaitContext& wait, int32_t* gather_ready, int32_t n_gate_up,
                                      uint8_t* base, int slots, const uint8_t* zero_row) {
  constexpr int kStoreDepth = 4;
  const uint32_t row_bytes = static_cast<uint32_t>(p.hidden) * 2;
  const int32_t total = g.num_blocks;
  const int32_t my_blocks = static_cast<int32_t>(blockIdx.x) < total
                                ? (total - static_cast<int32_t>(blockIdx.x) + p.num_comm - 1) / p.num_comm
                                : 0;
  const int64_t rows = static_cast<int64_t>(my_blocks) * 128;
  auto block_of = [&](int64_t r) { return g.block_at(static_cast<int32_t>(blockIdx.x + (r / 128) * p.num_comm)); };
  auto record_of = [&](int64_t r) { return p.rows[static_cast<int64_t>(block_of(r)) * 128 + r % 128]; };
  auto issue = [&](int64_t r) {
    const uint32_t rec = record_of(r);
    if (row_is_pad(rec)) return;
    const int s = static_cast<int>(r % slots);
    ptx::mbar_arrive_expect_tx(&sh.gather_bar[s], row_bytes);
    ptx::bulk_load(base + static_cast<size_t>(s) * row_bytes, x_row(p, rec), row_bytes, &sh.gather_bar[s]);
  };
  TraceWriter trace(p, 3);
  uint64_t t_begin = 0;
  uint32_t phases = 0;
  int64_t issued = 0;
  int32_t released = 0;
  auto release_upto = [&](int64_t complete_rows) {
    // Blocks whose 128 stores all completed
    for (; released < my_blocks && (static_cast<int64_t>(released) + 1) * 128 <= complete_rows; ++released) {
      const int32_t b = block_of(static_cast<int64_t>(released) * 128);
      ptx::fence_proxy_async_global();
      ptx::red_release_gpu_add(&gather_ready[b], 128);
      trace.add(mokTraceGather, t_begin, ptx::globaltimer_ns(), 255, b, -1);
    }
  };
  for (; issued < rows && issued < slots - kStoreDepth; ++issued) issue(issued);
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t b = block_of(r);
    const int i = static_cast<int>(r % 128);
    if (i == 0) {
      // The ring slot's previous occupant must be consumed before its rows are overwritten.
      // NOTES: drain and release our earlier blocks first: the previous occupant may be one
      // of them, and its gate/up tiles wait for its release (a cycle otherwise).
      Wait waits[kMaxWaits];
      const int n = gather_waits(b, g, TaskCounts{n_gate_up, 0, 0, 0, 0}, waits);
      if (n > 0) {
        ptx::bulk_wait<0>();
        release_upto(r);
        if (!wait_all(p, waits, n, wait)) return;
      }
      t_begin = ptx::globaltimer_ns();
    }
    __nv_bfloat16* dst = p.ring + static_cast<int64_t>(g.ring_row(b) + i) * p.hidden;
    if (row_is_pad(record_of(r))) {
      ptx::bulk_store(dst, zero_row, row_bytes);
    } else {
      const int s = static_cast<int>(r % slots);
      if (!gemm::wait_barrier(&sh.gather_bar[s], (phases >> s) & 1u, wait, gemm::WaitSite::kConsumerFull, 7000 + s))
        return;
      phases ^= 1u << s;
      ptx::bulk_store(dst, base + static_cast<size_t>(s) * row_bytes, row_bytes);
    }
    ptx::bulk_commit();
    // Stores up to row r - kStoreDepth completed: release finished blocks, refill their slot
    ptx::bulk_wait<kStoreDepth>();
    release_upto(r + 1 - kStoreDepth);
    if (issued < rows) issue(issued++);
  }
  ptx::bulk_wait<0>();
  release_upto(rows);
}

// ---- fixed-order combine of one token by one warp -------------------------------------------
__device__ __forceinline__ void combine_token(const ForwardParams& p, int64_t t) {
  const int64_t row_vecs = p.hidden / 8;
  const int k = p.topk;
  const uint4* shared_out = reinterpret_cast<const uint4*>(p.shared_out);
  combine_token_warp(reinterpret_cast<const uint4*>(p.slots) + t * k * row_vecs, row_vecs, k, p.topk_weights + t * k,
                     p.shared_inter > 0 ? shared_out + t * row_vecs : nullptr,
                     reinterpret_cast<uint4*>(p.y) + t * row_vecs, [&](int j) {
                       int64_t id;
                       return plan::check_route(p.routing, p.group.rank, t, j, &id) == RouteCheck::kOk;
                     });
}

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
