// The comm role of the fused forward: gather routed rows into the ring through the transport
// (pull), one row in flight per warp.
#pragma once

#include "cuda/comm/local_gather.cuh"
#include "cuda/comm/staging.cuh"
#include "cuda/comm/transport.cuh"
#include "cuda/fused/forward_params.cuh"

namespace mok::cuda::fused {

// What the gathers copy (the start gather, the EP = 1 gather warps, the EP >= 2 comm blocks):
// bf16 rows of x, or fp8_block's e4m3 rows of x quantised per token by the row's source rank
// (H bytes: at EP >= 2 the pull moves half the bf16 bytes) and their H / 128 scales.
__device__ __forceinline__ int64_t gathered_row_bytes(const ForwardParams& p) {
  return p.x8 != nullptr ? int64_t{p.hidden} : 2 * int64_t{p.hidden};
}
__device__ __forceinline__ uint8_t* ring_row_ptr(const ForwardParams& p, int64_t ring_row) {
  return reinterpret_cast<uint8_t*>(p.ring) + ring_row * gathered_row_bytes(p);
}
__device__ __forceinline__ const void* gathered_source(const ForwardParams& p, uint32_t rec) {
  return p.x8 != nullptr ? static_cast<const void*>(x8_row(p, rec)) : x_row(p, rec);
}
// fp8_block: scale k-block kb of the row of record rec (1 for padding: its zeros), into the
// ring's scale rows (k-block-major, the TMA box of a tile's rows) at ring_row
__device__ __forceinline__ void gather_scale(const ForwardParams& p, uint32_t rec, int64_t ring_row, int32_t kb) {
  p.ring_scales[kb * p.scales_ld + ring_row] = row_is_pad(rec) ? 1.0f : x8_scale(p, rec, kb);
}

// Gathers row block b (processing position q) into its ring rows, zeros for padding rows;
// releases gather_ready[b] per warp once its stores completed.
__device__ void gather_block(CommWarp& w, const ForwardParams& p, const Geometry& g, int32_t b,
                             const gemm::WaitContext& wait, int32_t* gather_ready) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  const int64_t row_vecs = gathered_row_bytes(p) / 16;
  int32_t rows_done = 0;
  for (int i = warp; i < kBlockM; i += num_warps, ++rows_done) {
    const uint32_t rec = p.rows[static_cast<int64_t>(b) * kBlockM + i];
    const int64_t ring_row = g.ring_row(b) + i;
    uint8_t* dst = ring_row_ptr(p, ring_row);
    if (p.x8 != nullptr)  // fp8_block: the row's scales (1 for padding), generic stores
      for (int32_t kb = lane; kb < p.hidden_kb; kb += 32) gather_scale(p, rec, ring_row, kb);
    if (row_is_pad(rec)) {
      // Padding rows are zeros (generic stores)
      for (int64_t v = lane; v < row_vecs; v += 32) reinterpret_cast<uint4*>(dst)[v] = make_uint4(0, 0, 0, 0);
      continue;
    }
    copy_row(w, gathered_source(p, rec), dst, wait);
  }
  // Publish this warp's rows of block b once its stores completed
  if (lane == 0) ptx::bulk_wait<0>();
  ptx::fence_proxy_async_global();  // every lane: its generic stores (zero rows, scales)
  __syncwarp();
  if (lane == 0) ptx::red_release_gpu_add(&gather_ready[b], rows_done);
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
template <class SharedT>
__device__ uint32_t start_gather(SharedT& sh, const ForwardParams& p, const Geometry& g, const TaskCounts& counts,
                                 const gemm::WaitContext& wait, int32_t* gather_ready) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  const plan::RowRun run = plan::row_run(int64_t{start_positions(p, g, counts)} * kBlockM,
                                         int64_t{blockIdx.x} * num_warps + warp, int64_t{gridDim.x} * num_warps);
  const int64_t r0 = run.begin, r1 = run.end;
  if (r0 >= r1) return 0;
  const int64_t row_bytes = gathered_row_bytes(p);
  CommWarp w{reinterpret_cast<uint8_t*>(&sh.stages) + static_cast<size_t>(warp) * row_bytes, &sh.gather_bar[warp], {},
             static_cast<uint32_t>(row_bytes)};
  TraceWriter trace(p, 3);
  const uint64_t t_begin = ptx::globaltimer_ns();
  for (int64_t r = r0; r < r1; ++r) {
    const int32_t b = g.block_at(static_cast<int32_t>(r / kBlockM));
    const int i = static_cast<int>(r % kBlockM);
    const uint32_t rec = p.rows[static_cast<int64_t>(b) * kBlockM + i];
    const int64_t ring_row = g.ring_row(b) + i;
    uint8_t* dst = ring_row_ptr(p, ring_row);
    if (p.x8 != nullptr)
      for (int32_t kb = lane; kb < p.hidden_kb; kb += 32) gather_scale(p, rec, ring_row, kb);
    if (row_is_pad(rec)) {
      for (int64_t v = lane; v < row_bytes / 16; v += 32) reinterpret_cast<uint4*>(dst)[v] = make_uint4(0, 0, 0, 0);
      continue;
    }
    copy_row(w, gathered_source(p, rec), dst, wait);
  }
  if (lane == 0) ptx::bulk_wait<0>();
  ptx::fence_proxy_async_global();  // every lane: its generic zero-row stores
  __syncwarp();
  if (lane == 0)
    for (int64_t q = r0 / kBlockM; q * kBlockM < r1; ++q)
      ptx::red_release_gpu_add(&gather_ready[g.block_at(static_cast<int32_t>(q))],
                               static_cast<int32_t>(run.rows_in(q, kBlockM)));
  if (threadIdx.x == 0)
    trace.add(mokTraceGather, t_begin, ptx::globaltimer_ns(), 254, static_cast<int32_t>(r0 / kBlockM), -1);
  return __shfl_sync(0xffffffffu, w.state.phase, 0);
}

// EP = 1 (no comm blocks): gather warp `gw` of `num_gw` (local_gather.cuh) copies its units of
// the positions after the start gather's, in processing order, each once its ring slot's
// previous occupant is consumed, then adds its rows to gather_ready[b].
__device__ void local_gather(const ForwardParams& p, const Geometry& g, const TaskCounts& counts,
                             const gemm::WaitContext& wait, int64_t gw, int64_t num_gw) {
  int32_t* const gather_ready = counter_of(p, CounterArray::kGatherReady, 0);
  const int lane = threadIdx.x % 32;
  const int64_t row_vecs = gathered_row_bytes(p) / 16;
  Wait waits[kMaxWaits];
  gather_units(p, start_positions(p, g, counts), g.num_blocks, gw, num_gw, [&](int32_t q, int i0) {
    const int32_t b = g.block_at(q);
    if (!wait_counters<kForwardDirection>(p, waits, gather_waits(b, g, counts, waits), wait, WaitSite::kGatherCounter))
      return false;
    const int64_t row0 = static_cast<int64_t>(b) * kBlockM, ring0 = g.ring_row(b);
    for (int i = i0; i < i0 + kGatherUnitRows; ++i) {
      const uint32_t rec = p.rows[row0 + i];
      uint4* dst = reinterpret_cast<uint4*>(ring_row_ptr(p, ring0 + i));
      if (row_is_pad(rec)) {
        for (int64_t v = lane; v < row_vecs; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
        continue;
      }
      const uint4* src = static_cast<const uint4*>(gathered_source(p, rec));
#pragma unroll 4
      for (int64_t v = lane; v < row_vecs; v += 32) dst[v] = __ldg(src + v);
    }
    // fp8_block: the unit's scales, 8 lanes a k-block (the unit's 8 ring rows: one 32-byte
    // sector of the k-block's scale row)
    static_assert(kGatherUnitRows == 8, "a unit's scales of a k-block are 8 lanes' stores");
    if (p.x8 != nullptr)
      for (int32_t j = lane; j < kGatherUnitRows * p.hidden_kb; j += 32)
        gather_scale(p, p.rows[row0 + i0 + j % kGatherUnitRows], ring0 + i0 + j % kGatherUnitRows, j / kGatherUnitRows);
    unit_stored();
    if (lane == 0) ptx::red_release_gpu_add(&gather_ready[b], kGatherUnitRows);
    return true;
  });
}

// Comm block i: the processing positions after the start gather's, i, i + num_comm, ..., each
// once its ring slot's previous occupant is consumed; the staging barrier continues at `phase`.
template <class SharedT>
__device__ void comm_gather(SharedT& sh, const ForwardParams& p, const Geometry& g, const gemm::WaitContext& wait,
                            int32_t* gather_ready, const TaskCounts& counts, uint32_t phase) {
  const int warp = threadIdx.x / 32;
  const int64_t row_bytes = gathered_row_bytes(p);
  CommWarp w{reinterpret_cast<uint8_t*>(&sh.stages) + static_cast<size_t>(warp) * row_bytes, &sh.gather_bar[warp],
             {0, phase}, static_cast<uint32_t>(row_bytes)};
  TraceWriter trace(p, 3, kTraceAfterStartGather);
  Wait waits[kMaxWaits];
  for (int32_t q = start_positions(p, g, counts) + static_cast<int32_t>(blockIdx.x); q < g.num_blocks; q += p.num_comm) {
    const int32_t b = g.block_at(q);
    const uint64_t t_begin = ptx::globaltimer_ns();
    // Wait until the previous occupant of the ring slot was consumed by its gate/up tiles
    if (!wait_counters<kForwardDirection>(p, waits, gather_waits(b, g, counts, waits), wait, WaitSite::kGatherCounter))
      return;
    gather_block(w, p, g, b, wait, gather_ready);
    if (warp == 0 && (threadIdx.x & 31) == 0) trace.add(mokTraceGather, t_begin, ptx::globaltimer_ns(), 255, b, -1);
  }
}

}  // namespace mok::cuda::fused
