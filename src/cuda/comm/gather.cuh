// The comm role of the fused forward: gather routed rows into the ring through the transport
// (pull), and with MOK_PUSH=comm push the down outputs home; two modes (MOK_GATHER): one row in
// flight per warp, or one thread with a deep pipeline of bulk copies.
#pragma once

#include "cuda/comm/staging.cuh"
#include "cuda/comm/transport.cuh"

namespace mok::cuda::fused {

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

// The processing positions [0, n) that every block gathers at the kernel's start: the first
// p.start_blocks, up to the first whose ring slot has a previous occupant (none on the ring's
// first pass).  The same on every block.
__device__ __forceinline__ int32_t start_positions(const ForwardParams& p, const Geometry& g, const TaskCounts& counts) {
  const int32_t n = min(p.start_blocks, g.num_blocks);
  Wait waits[kMaxWaits];
  for (int32_t q = 0; q < n; ++q)
    if (gather_waits(g.block_at(q), g, counts, waits) > 0) return q;
  return n;
}

// Every block, at the start: the rows of positions [0, start_positions) split over every warp
// of the grid in runs of consecutive rows (so that the first gate/up tiles do not wait for the
// comm blocks), each copied through the warp's staging row; then gather_ready of the blocks
// the run touched.  Returns the warp's staging-barrier phase (one copy per real row), which
// the comm gather continues from.
__device__ uint32_t start_gather(FusedShared& sh, const ForwardParams& p, const Geometry& g, const TaskCounts& counts,
                                 const gemm::WaitContext& wait, int32_t* gather_ready) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  const plan::RowRun run = plan::row_run(int64_t{start_positions(p, g, counts)} * 128,
                                         int64_t{blockIdx.x} * num_warps + warp, int64_t{gridDim.x} * num_warps);
  const int64_t r0 = run.begin, r1 = run.end;
  if (r0 >= r1) return 0;
  CommWarp w{reinterpret_cast<uint8_t*>(&sh.stages) + static_cast<size_t>(warp) * p.hidden * 2, &sh.gather_bar[warp],
             0, static_cast<uint32_t>(p.hidden) * 2};
  TraceWriter trace(p, 3);
  const uint64_t t_begin = ptx::globaltimer_ns();
  for (int64_t r = r0; r < r1; ++r) {
    const int32_t b = g.block_at(static_cast<int32_t>(r / 128));
    const int i = static_cast<int>(r % 128);
    const uint32_t rec = p.rows[static_cast<int64_t>(b) * 128 + i];
    __nv_bfloat16* dst = p.ring + static_cast<int64_t>(g.ring_row(b) + i) * p.hidden;
    if (row_is_pad(rec)) {
      for (int64_t v = lane; v < p.hidden / 8; v += 32) reinterpret_cast<uint4*>(dst)[v] = make_uint4(0, 0, 0, 0);
      continue;
    }
    copy_row(w, x_row(p, rec), dst, wait, 6500 + warp);
  }
  if (lane == 0) ptx::bulk_wait<0>();
  ptx::fence_proxy_async_global();  // every lane: its generic zero-row stores
  __syncwarp();
  if (lane == 0)
    for (int64_t q = r0 / 128; q * 128 < r1; ++q)
      ptx::red_release_gpu_add(&gather_ready[g.block_at(static_cast<int32_t>(q))],
                               static_cast<int32_t>(run.rows_in(q, 128)));
  if (threadIdx.x == 0) trace.add(mokTraceGather, t_begin, ptx::globaltimer_ns(), 254, static_cast<int32_t>(r0 / 128), -1);
  return __shfl_sync(0xffffffffu, w.phase, 0);
}

__device__ void comm_gather(FusedShared& sh, const ForwardParams& p, const Geometry& g, const gemm::WaitContext& wait,
                            int32_t* gather_ready, const TaskCounts& counts, uint32_t phase) {
  const int warp = threadIdx.x / 32;
  CommWarp w{reinterpret_cast<uint8_t*>(&sh.stages) + static_cast<size_t>(warp) * p.hidden * 2, &sh.gather_bar[warp],
             phase, static_cast<uint32_t>(p.hidden) * 2};
  TraceWriter trace(p, 3);
  Wait waits[kMaxWaits];
  if (!counts.push_by_comm) {
    for (int32_t q = start_positions(p, g, counts) + static_cast<int32_t>(blockIdx.x); q < g.num_blocks; q += p.num_comm) {
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

}  // namespace mok::cuda::fused
