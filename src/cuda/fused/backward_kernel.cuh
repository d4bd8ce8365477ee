// The fused backward megakernel: one persistent launch, grid = SM count (or config.num_blocks),
// the forward's roles and entry (megakernel.cuh) over the backward's task list
// (schedule_bwd.cuh) and ops (ops_bwd/):
//   comm blocks   EP >= 2, blockIdx.x < p.num_comm: gather x, dy and the route weight of every
//                 plan row from the row's source rank's region over NVLink (the pull of the
//                 reverse combine), block by block in order, then join the compute roles
//   producer      thread 0 of warpgroup 0: claims tasks, waits for their inputs, issues loads
//   signaler      thread 32 of warpgroup 0: publishes each finished tile to the counters
//   gather        EP = 1, warps 2 and 3 of warpgroup 0 of every block: the same gather, 8-row
//                 units in order (local_gather)
//   consumers     warpgroups 1, 2: wgmma and the ops' epilogues
// then every block's consumers meet at a grid barrier (EP >= 2: and the group's end barrier)
// and reduce: d topk_weights[t, j] = Σ_c partials (ascending c; EP >= 2 pushed to the home
// rank first), dx[t] = bf16(Σ_j↑ slot rows + shared dx) (fp32, one rounding).
// Counters: schedule_bwd.cuh's CounterArray, zeroed before the launch, released and acquired
// at gpu scope; generic writes read by TMA elsewhere are fenced (proxy.async) before release.
#pragma once

#include "cuda/comm/combine.cuh"
#include "cuda/comm/local_gather.cuh"
#include "cuda/comm/staging.cuh"
#include "cuda/comm/transport.cuh"
#include "cuda/fused/backward_dir.cuh"
#include "cuda/fused/megakernel.cuh"

namespace mok::cuda::fused::bwd {

// ---- one plan row: x and dy through the warp's staging row, and its route weight -------------
// (a padding row: zeros and weight 0).  Every lane calls it; lane 0 copies.
__device__ __forceinline__ void gather_row(const BackwardParams& p, int64_t row, CommWarp& w,
                                           const gemm::WaitContext& wait) {
  const int lane = threadIdx.x % 32;
  const uint32_t rec = p.rows[row];
  __nv_bfloat16* xd = p.x_rows + row * p.hidden;
  __nv_bfloat16* dd = p.dy_rows + row * p.hidden;
  if (row_is_pad(rec)) {
    for (int64_t v = lane; v < p.hidden / 8; v += 32)
      reinterpret_cast<uint4*>(xd)[v] = reinterpret_cast<uint4*>(dd)[v] = make_uint4(0, 0, 0, 0);
    if (lane == 0) p.row_weight[row] = 0.0f;
    return;
  }
  if (lane == 0) p.row_weight[row] = route_weight(p, rec);
  copy_row(w, x_row(p, rec), xd, wait);
  copy_row(w, dy_row(p, rec), dd, wait);
}

// ---- start: every block gathers the first row blocks ------------------------------------------
// How many: p.start_blocks, within the plan, and (rows not resident) within the ring's first
// pass, whose slots have no previous occupant.  The comm blocks start after exactly these, so
// every caller takes the count from here.
__device__ __forceinline__ int32_t start_block_count(const BackwardParams& p, const Geometry& g, const TaskCounts& c) {
  const int32_t nb = min(min(p.start_blocks, g.num_blocks), c.resident ? INT32_MAX : g.ring_blocks);
  return nb > 0 ? nb : 0;
}

// Blocks [0, p.start_blocks) (the first minibatch by default), split over every warp of the
// grid in runs of consecutive rows, so that the first dgrad-down tiles do not wait for the comm
// blocks (8 SMs gather ~280 GB/s; the whole grid several TB/s).  Each warp copies its run
// through its staging row, then releases dy_ready / x_ready of the blocks it touched.  Two
// copies per row leave every staging barrier at phase parity 0 for the comm gather after.
template <class Shared>
__device__ void start_gather(Shared& sh, const BackwardParams& p, const Geometry& g, const gemm::WaitContext& wait) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  const int32_t nb = start_block_count(p, g, sh.counts);
  if (nb == 0) return;
  const plan::RowRun run =
      plan::row_run(int64_t{nb} * kBlockM, int64_t{blockIdx.x} * num_warps + warp, int64_t{gridDim.x} * num_warps);
  const int64_t r0 = run.begin, r1 = run.end;
  if (r0 >= r1) return;
  const uint32_t row_bytes = static_cast<uint32_t>(p.hidden) * 2;
  uint8_t* const staging = reinterpret_cast<uint8_t*>(&sh.stages);
  CommWarp w{staging + static_cast<size_t>(warp) * row_bytes, &sh.gather_bar[warp], {}, row_bytes};
  TraceWriter trace(p, 3);
  const uint64_t t_begin = ptx::globaltimer_ns();
  for (int64_t r = r0; r < r1; ++r) gather_row(p, r, w, wait);
  if (lane == 0) ptx::bulk_wait<0>();
  ptx::fence_proxy_async_global();
  __syncwarp();
  if (lane == 0) {
    for (int64_t b = r0 / kBlockM; b * kBlockM < r1; ++b) {
      const int32_t n = static_cast<int32_t>(run.rows_in(b, kBlockM));
      ptx::red_release_gpu_add(counter_of(p, CounterArray::kDyReady, static_cast<int32_t>(b)), n);
      ptx::red_release_gpu_add(counter_of(p, CounterArray::kXReady, static_cast<int32_t>(b)), n);
    }
  }
  if (threadIdx.x == 0)
    trace.add(mokTraceGather, t_begin, ptx::globaltimer_ns(), 254, static_cast<int32_t>(r0 / kBlockM), -1);
}

// ---- comm: the rows of every routed block after the start gather's, in order -----------------
// Warp w copies rows w, w + 12, ... of each of its blocks through its staging row (bulk copies,
// x then dy), zeros for padding rows, and the route weight; then releases dy_ready / x_ready.
template <class Shared>
__device__ void comm_gather(Shared& sh, const BackwardParams& p, const Geometry& g, const gemm::WaitContext& wait) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  const uint32_t row_bytes = static_cast<uint32_t>(p.hidden) * 2;
  uint8_t* const staging = reinterpret_cast<uint8_t*>(&sh.stages);
  CommWarp w{staging + static_cast<size_t>(warp) * row_bytes, &sh.gather_bar[warp], {}, row_bytes};
  TraceWriter trace(p, 3, kTraceAfterStartGather);
  for (int32_t b = start_block_count(p, g, sh.counts) + static_cast<int32_t>(blockIdx.x); b < g.num_blocks;
       b += p.num_comm) {
    const uint64_t t_block = ptx::globaltimer_ns();
    int32_t rows_done = 0;
    for (int i = warp; i < kBlockM; i += num_warps, ++rows_done)
      gather_row(p, static_cast<int64_t>(b) * kBlockM + i, w, wait);
    // Publish this warp's rows of block b once its stores completed
    if (lane == 0) ptx::bulk_wait<0>();
    ptx::fence_proxy_async_global();
    __syncwarp();
    if (lane == 0) {
      ptx::red_release_gpu_add(counter_of(p, CounterArray::kDyReady, b), rows_done);
      ptx::red_release_gpu_add(counter_of(p, CounterArray::kXReady, b), rows_done);
    }
    if (threadIdx.x == 0) trace.add(mokTraceGather, t_block, ptx::globaltimer_ns(), 255, b, -1);
  }
  if (lane == 0) ptx::bulk_wait<0>();
  __syncwarp();
}

// ---- EP = 1 (no comm blocks): the gather warps ------------------------------------------------
// Gather warp `gw` of `num_gw` (../comm/local_gather.cuh) copies its units of the plan rows
// after the start gather's blocks, in order: x and dy, the route weight; then adds its rows to
// dy_ready[b] and x_ready[b].
__device__ void local_gather(const BackwardParams& p, const Geometry& g, const TaskCounts& counts,
                             const gemm::WaitContext&, int64_t gw, int64_t num_gw) {
  const int lane = threadIdx.x % 32;
  const int64_t row_vecs = p.hidden / 8;
  gather_units(p, start_block_count(p, g, counts), g.num_blocks, gw, num_gw, [&](int32_t b, int i0) {
    for (int64_t row = int64_t{b} * kBlockM + i0; row < int64_t{b} * kBlockM + i0 + kGatherUnitRows; ++row) {
      const uint32_t rec = p.rows[row];
      uint4* xd = reinterpret_cast<uint4*>(p.x_rows + row * p.hidden);
      uint4* dd = reinterpret_cast<uint4*>(p.dy_rows + row * p.hidden);
      if (row_is_pad(rec)) {
        for (int64_t v = lane; v < row_vecs; v += 32) xd[v] = dd[v] = make_uint4(0, 0, 0, 0);
        if (lane == 0) p.row_weight[row] = 0.0f;
        continue;
      }
      if (lane == 0) p.row_weight[row] = route_weight(p, rec);
      const uint4* xs = reinterpret_cast<const uint4*>(x_row(p, rec));
      const uint4* ds = reinterpret_cast<const uint4*>(dy_row(p, rec));
#pragma unroll 2
      for (int64_t v = lane; v < row_vecs; v += 32) {
        const uint4 a = __ldg(xs + v), c = __ldg(ds + v);
        xd[v] = a;
        dd[v] = c;
      }
    }
    unit_stored();
    if (lane == 0) {
      ptx::red_release_gpu_add(counter_of(p, CounterArray::kDyReady, b), kGatherUnitRows);
      ptx::red_release_gpu_add(counter_of(p, CounterArray::kXReady, b), kGatherUnitRows);
    }
    return true;
  });
}

// ---- the reductions: d topk_weights of a plan row, dx of a token (finish) ---------------------
// d topk_weights of routed plan row i: the fixed-order sum of its partials (EP >= 2: into the
// row's source rank's region); padding rows have none.
__device__ __forceinline__ void dtw_row(const BackwardParams& p, int64_t i, int chunks) {
  const uint32_t rec = p.rows[i];
  if (row_is_pad(rec)) return;
  float s = 0.0f;
  for (int c = 0; c < chunks; ++c) s = s + p.partials[i * chunks + c];
  home_dtw(p, rec)[row_token(rec) * p.topk + row_slot(rec)] = s;
}
// dx[t] = bf16(Σ_j↑ slot rows + shared dx): one warp (combine_token_warp)
__device__ __forceinline__ void dx_token(const BackwardParams& p, int64_t t) {
  const int64_t row_vecs = p.hidden / 8;
  const int k = p.topk;
  const uint4* slots = reinterpret_cast<const uint4*>(p.slots);
  const uint4* shared_dx = reinterpret_cast<const uint4*>(p.shared_dx);
  combine_token_warp(slots + t * k * row_vecs, row_vecs, k, p.ones,
                              p.shared_inter > 0 ? shared_dx + t * row_vecs : nullptr,
                              reinterpret_cast<uint4*>(p.dx) + t * row_vecs, [&](int j) {
                                int64_t id;
                                return plan::check_route(p.routing, p.group.rank, t, j, &id) == RouteCheck::kOk;
                              });
}

// ---- end: grid barrier, d topk_weights, (EP >= 2: end barrier), dx ----------------------------
// Run by the consumer threads of every block; the first (128) arrives at the barriers.
__device__ void finish(const BackwardParams& p, const gemm::WaitContext& wait) {
  int32_t* blocks_done = &p.counters[static_cast<int>(Counter::kBlocksDone)];
  const bool ep = p.group.size > 1;
  const int tid = static_cast<int>(threadIdx.x) - kFirstConsumerThread;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kConsumerThreads;
  TraceWriter trace(p, 2);
  const uint64_t t_arrive = ptx::globaltimer_ns();
  uint64_t t_reduce = 0;
  if (threadIdx.x == kFirstConsumerThread) {
    __threadfence();
    ptx::red_release_gpu_add(blocks_done, 1);
    wait_counter(blocks_done, static_cast<int32_t>(gridDim.x), wait, WaitSite::kGridBarrier, 0);
    t_reduce = ptx::globaltimer_ns();
  }
  ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kConsumers), kConsumerThreads);
  // d topk_weights of every routed row here: the fixed-order sum of its partials
  const int64_t total = p.expert_offset[p.num_local];
  const int chunks = gemm::tiles_of(p.inter, gemm::kDtwChunk);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kConsumerThreads + tid; i < total; i += stride)
    dtw_row(p, i, chunks);
  if (ep) {
    // Every rank's dx rows and d topk_weights landed here before the reductions
    __threadfence_system();
    ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kConsumers), kConsumerThreads);
    if (threadIdx.x == kFirstConsumerThread) {
      ptx::red_release_gpu_add(blocks_done, 1);
      if (wait_counter(blocks_done, 2 * static_cast<int32_t>(gridDim.x), wait, WaitSite::kGridBarrier, 1))
        end_barrier(p.group, wait);
    }
    ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kConsumers), kConsumerThreads);
    const float* own = own_dtw(p);
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kConsumerThreads + tid; i < p.num_tokens * p.topk; i += stride)
      p.d_topk_weights[i] = own[i];
  }
  // dx: warp w of block b takes tokens b·8 + w, then every 8·gridDim-th
  const int warp = __shfl_sync(0xffffffffu, tid / 32, 0);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * 8 + warp; t < p.num_tokens; t += static_cast<int64_t>(gridDim.x) * 8)
    dx_token(p, t);
  if (p.trace) {
    ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kConsumers), kConsumerThreads);
    if (threadIdx.x == kFirstConsumerThread) {
      trace.add(mokTraceGridBarrier, t_arrive, t_reduce, 255, -1, -1);
      trace.add(mokTraceCombine, t_reduce, ptx::globaltimer_ns(), 255, -1, -1);
    }
  }
}

// ---- the kernel entry's hooks (megakernel.cuh) ------------------------------------------------
// Each local expert's first row block, then the geometry, tile counts and task table in
// shared memory, identical on every block
template <class Pol>
__device__ __forceinline__ auto BackwardDir<Pol>::setup(Shared& sh, const Params& p, GeometryStore&, CountsStore&)
    -> Setup {
  for (int i = threadIdx.x; i <= p.num_local; i += blockDim.x) sh.expert_blocks[i] = p.expert_offset[i] / kBlockM;
  __syncthreads();
  if (threadIdx.x == 0) {
    sh.geo = Geometry::make(sh.expert_blocks[p.num_local], p.ring_blocks, p.minibatch_blocks, p.num_local,
                            sh.expert_blocks, sh.expert_blocks + 1);
    sh.counts = task_counts(p);
    int32_t num_tasks = 0;
    sh.num_segments = build_segments(sh.geo, sh.counts, sh.segments, &num_tasks);
    sh.num_tasks = num_tasks;
    init_role_barriers(sh);
  }
  __syncthreads();
  return Setup{sh.geo, sh.counts};
}
// Every block gathers the first minibatch (MOK_BACKWARD_START_GATHER): two copies per row
// leave the staging barriers at phase 0, where the comm gather starts
template <class Pol>
__device__ __forceinline__ uint32_t BackwardDir<Pol>::start_gather(Shared& sh, const Params& p, const Setup& s,
                                                                   const gemm::WaitContext& wait) {
  bwd::start_gather(sh, p, s.g, wait);
  return 0;
}
template <class Pol>
__device__ __forceinline__ bool BackwardDir<Pol>::comm_gather(Shared& sh, const Params& p, const Setup& s,
                                                              const gemm::WaitContext& wait, uint32_t) {
  if (static_cast<int32_t>(blockIdx.x) >= p.num_comm) return false;
  bwd::comm_gather(sh, p, s.g, wait);
  return true;
}
template <class Pol>
__device__ __forceinline__ void BackwardDir<Pol>::finish(Shared&, const Params& p, const gemm::WaitContext& wait) {
  bwd::finish(p, wait);
}

// One instantiation per policy (policy.cuh); the host picks it per call (backward.cu)
template <class Pol>
__global__ void __launch_bounds__(Pol::Tile::kThreads, 1)
    fused_backward_kernel(const __grid_constant__ MapsWith<typename Pol::ScaleMaps> maps, const BackwardParams p) {
  run_megakernel<BackwardDir<Pol>>(maps, p);
}

}  // namespace mok::cuda::fused::bwd
