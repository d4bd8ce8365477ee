// The fused forward megakernel: one persistent launch, grid = SM count (or config.num_blocks).
// EP >= 2: the comm blocks pull rows from the x of their rank's region (NVLink), the down
// epilogue pushes each row to the slot of its home rank, and an end barrier over the group
// comes before the combine (comm/ep.cuh).
//
// Roles (dispatched at the end of this file by block index, then warpgroup; the shared
// parameters, storage and counters in forward_params.cuh, the task ops they run in ops/,
// the comm role in ../comm/):
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

#include "cuda/comm/gather.cuh"
#include "cuda/fused/forward_dir.cuh"
#include "cuda/fused/forward_params.cuh"
#include "cuda/fused/roles/consumers.cuh"
#include "cuda/fused/roles/finish.cuh"
#include "cuda/fused/roles/producer.cuh"
#include "cuda/fused/roles/signaler.cuh"

namespace mok::cuda::fused {

// The role table: which threads of which block run which role (the roles' code is in
// roles/ and ../comm/).
//   comm blocks   blockIdx.x < p.num_comm   every thread: the comm role, then the compute roles
//   kProducerThread                          thread 0 of warpgroup 0: claims tasks, issues loads
//   kSignalerThread                          thread 32 of warpgroup 0: publishes finished tiles
//   warpgroups 1, 2                          the consumers (rows [0, 64) and [64, 128) of a tile)
// (kProducerWarpgroup, kProducerThread, kSignalerThread, kFirstConsumerWarpgroup: forward_params.cuh)

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
  const int32_t num_blocks = p.expert_offset[p.num_local] / kBlockM;
  const Geometry g = Geometry::make(num_blocks, p.ring_blocks, p.minibatch_blocks);
  // Tiles per row block: gate/up tiles of BLOCK_N / 2 channels (gate and up), down tiles of
  // BLOCK_N columns; the last of each may be partial
  const TaskCounts counts{gemm::tiles_of(p.inter, kHalfN), gemm::tiles_of(p.hidden, kBlockN),
                          gemm::tiles_of(p.shared_inter, kHalfN), gemm::tiles_of(p.hidden, kBlockN), p.shared_blocks};
  const bool comm = static_cast<int32_t>(blockIdx.x) < p.num_comm;
  if (threadIdx.x == 0) {
    int32_t num_tasks = 0;
    sh.num_segments = build_segments(g, counts, sh.segments, &num_tasks);
    sh.num_tasks = num_tasks;
    sh.n_group = p.n_group;
    init_role_barriers(sh);
  }
  __syncthreads();

  // NOTES: the role comes through a shuffle so that ptxas knows it is warp-uniform, and
  // each role returns on its own: wgmma code must not share a tail with divergent roles
  // (ptxas serialises every wgmma otherwise: C7518).
  // A comm block that has gathered its share joins the compute roles: tasks are claimed
  // dynamically, so it takes what is left.  Its staging rows are free by then (every bulk
  // copy completed) and the stage barriers were never touched.
  // Every block gathers the first minibatch (MOK_FORWARD_START_GATHER); its bulk copies are
  // complete before the stage memory is the producer's
  uint32_t phase = 0;
  if (p.start_blocks > 0) {
    phase = start_gather(sh, p, g, counts, wait, gather_ready);
    __syncthreads();
  }
  if (comm) {
    comm_gather(sh, p, g, wait, gather_ready, counts, phase);
    __syncthreads();
  }
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / kWarpgroupThreads, 0);
  if (warpgroup == kProducerWarpgroup) {
    ptx::setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x == kProducerThread) produce_tasks<ForwardDir>(sh, maps, p, g, counts, wait);
    if (threadIdx.x == kSignalerThread) signal_tasks<ForwardDir>(sh, p, g, counts, wait);
    return;
  }
  ptx::setmaxnreg_inc<C::kConsumerRegs>();
  consume_tasks<ForwardDir>(sh, p, g, counts, warpgroup - kFirstConsumerWarpgroup, wait);
  if (p.group.size > 1) __threadfence_system();  // this thread's pushes, before the end barrier
  ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kConsumers), kConsumerThreads);
  finish_and_combine(sh, p, wait);
}

}  // namespace mok::cuda::fused
