// The fused forward megakernel: one persistent launch, grid = SM count (or config.num_blocks).
// EP >= 2: the comm blocks pull rows from the x of their rank's region (NVLink), the down
// epilogue pushes each row to the slot of its home rank, and an end barrier over the group
// comes before the combine (comm/ep.cuh).
//
// Roles (dispatched by block index, then warpgroup: run_megakernel, megakernel.cuh; the
// shared parameters, storage and counters in forward_params.cuh, the task ops they run in
// ops/, the comm role in ../comm/):
//   kComm       EP >= 2, blocks [0, num_comm): gather routed rows of x into the ring (bulk
//               copies through shared memory), block by block in processing order; then they
//               join the compute roles below
//   kProducer   warpgroup 0 of a compute block: claims tasks, waits for their inputs,
//               issues TMA loads
//   kSignaler   warp 1 of warpgroup 0: publishes each finished tile to the global counters
//   gather      EP = 1, warps 2 and 3 of warpgroup 0 of every block: gather the rows after
//               the start gather (local_gather), 8-row units in processing order
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
#include "cuda/fused/megakernel.cuh"
#include "cuda/fused/roles/finish.cuh"

namespace mok::cuda::fused {

// ---- the kernel entry's hooks (megakernel.cuh) ------------------------------------------------
// Geometry and the task table, identical on every block; the geometry and tile counts stay in
// the roles' registers
template <class Pol>
__device__ __forceinline__ auto ForwardDir<Pol>::setup(Shared& sh, const Params& p, Geometry& g, TaskCounts& counts)
    -> Setup {
  int32_t* gather_ready = p.counters + static_cast<int>(Counter::kHeader);
  const int32_t num_blocks = p.expert_offset[p.num_local] / kBlockM;
  g = Geometry::make(num_blocks, p.ring_blocks, p.minibatch_blocks);
  // Tiles per row block: gate/up tiles of the policy's N / 2 channels (gate and up), down tiles
  // of N columns; the last of each may be partial
  counts = TaskCounts{gemm::tiles_of(p.inter, Pol::kTileHalfN), gemm::tiles_of(p.hidden, Pol::kTileN),
                      gemm::tiles_of(p.shared_inter, Pol::kTileHalfN), gemm::tiles_of(p.hidden, Pol::kTileN),
                      p.shared_blocks};
  const bool comm = static_cast<int32_t>(blockIdx.x) < p.num_comm;
  if (threadIdx.x == 0) {
    int32_t num_tasks = 0;
    sh.num_segments = build_segments(g, counts, sh.segments, &num_tasks);
    sh.num_tasks = num_tasks;
    sh.n_group = p.n_group;
    init_role_barriers(sh);
  }
  __syncthreads();
  return Setup{g, counts, gather_ready, comm};
}
// Every block gathers the first minibatch (MOK_FORWARD_START_GATHER): one copy per real row
template <class Pol>
__device__ __forceinline__ uint32_t ForwardDir<Pol>::start_gather(Shared& sh, const Params& p, const Setup& s,
                                                                  const gemm::WaitContext& wait) {
  return fused::start_gather(sh, p, s.g, s.counts, wait, s.gather_ready);
}
template <class Pol>
__device__ __forceinline__ bool ForwardDir<Pol>::comm_gather(Shared& sh, const Params& p, const Setup& s,
                                                             const gemm::WaitContext& wait, uint32_t phase) {
  if (!s.comm) return false;
  fused::comm_gather(sh, p, s.g, wait, s.gather_ready, s.counts, phase);
  return true;
}
template <class Pol>
__device__ __forceinline__ void ForwardDir<Pol>::finish(Shared& sh, const Params& p, const gemm::WaitContext& wait) {
  finish_and_combine(sh, p, wait);
}

// One instantiation per policy (policy.cuh); the host picks it per call (forward.cu)
template <class Pol>
__global__ void __launch_bounds__(Pol::Tile::kThreads, 1)
    fused_forward_kernel(const __grid_constant__ MapsWith<typename Pol::ScaleMaps> maps, const ForwardParams p) {
  run_megakernel<ForwardDir<Pol>>(maps, p);
}

}  // namespace mok::cuda::fused
