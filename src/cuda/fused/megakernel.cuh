// The entry of a fused kernel, written once for both directions: each direction's __global__
// (forward_kernel.cuh, backward_kernel.cuh) is run_megakernel<Dir>, and the steps where the
// two differ are hooks of Dir (forward_dir.cuh lists them): its setup, gathers, end phase and
// register budgets.
//
// The role table: which threads of which block run which role (the roles' code is in roles/
// and ../comm/).
//   comm blocks   blockIdx.x < p.num_comm   every thread: the comm role, then the compute roles
//                                            (EP >= 2; at EP = 1 num_comm is 0)
//   kProducerThread                          thread 0 of warpgroup 0: claims tasks, issues loads
//   kSignalerThread                          thread 32 of warpgroup 0: publishes finished tiles
//   kFirstGatherWarp, + 1                    warps 2, 3 of warpgroup 0, at EP = 1: gather the
//                                            rows after the start gather (Dir::gather_warps)
//   warpgroups 1, 2                          the consumers (rows [0, BLOCK_M / 2), [BLOCK_M / 2, BLOCK_M))
// (kProducerWarpgroup, kProducerThread, kSignalerThread, kFirstConsumerWarpgroup: forward_params.cuh)
#pragma once

#include "cuda/fused/forward_params.cuh"
#include "cuda/fused/roles/consumers.cuh"
#include "cuda/fused/roles/producer.cuh"
#include "cuda/fused/roles/signaler.cuh"

namespace mok::cuda::fused {

template <class Dir>
__device__ __forceinline__ void run_megakernel(const typename Dir::MapsT& maps, const typename Dir::Params& p) {
  static_assert(Dir::kProducerRegs * kWarpgroupThreads + Dir::kConsumerRegs * kConsumerThreads <= gemm::kRegisterPool &&
                    Dir::kProducerRegs % 8 == 0 && Dir::kConsumerRegs % 8 == 0,
                "register budgets: multiples of 8 within what the launch allocates (gemm::kRegisterPool)");
  extern __shared__ uint8_t smem_raw[];
  auto& sh = *reinterpret_cast<typename Dir::Shared*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                                      ~uintptr_t{1023});
  const gemm::WaitContext wait{ptx::globaltimer_ns() + p.timeout_ns, p.timeout_record};
  // A wait of this call already expired (EP: the start barrier): leave; the host reports it.
  if (p.timeout_record && *reinterpret_cast<volatile int64_t*>(p.timeout_record) != 0) return;

  // Geometry, tile counts, the task table and the role barriers, identical on every block: the
  // geometry and counts in these stores (the forward: registers) or in the direction's shared
  // storage (the backward: the stores are empty)
  typename Dir::GeometryStore geometry_store;
  typename Dir::CountsStore counts_store;
  const typename Dir::Setup s = Dir::setup(sh, p, geometry_store, counts_store);
  const typename Dir::GeometryT& g = s.g;
  const typename Dir::Counts& counts = s.counts;

  // Gathers: every block the first row blocks (the start gather); the rest at EP >= 2 the comm
  // blocks, their staging barriers continuing from the phase the start gather leaves, and at
  // EP = 1 the gather warps of every block (under the compute roles, below).  The bulk copies are
  // complete before the stage memory is the producer's.  A comm block that has gathered its share
  // joins the compute roles: tasks are claimed dynamically, so it takes what is left (its staging
  // rows are free by then and the stage barriers were never touched).
  uint32_t phase = 0;
  if (p.start_blocks > 0) {
    phase = Dir::start_gather(sh, p, s, wait);
    __syncthreads();
  }
  if (Dir::comm_gather(sh, p, s, wait, phase)) __syncthreads();

  // The roles.  NOTES: the role comes through a shuffle so that ptxas knows it is warp-uniform,
  // and each role returns on its own: wgmma code must not share a tail with divergent roles
  // (ptxas serialises every wgmma otherwise: C7518).
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / kWarpgroupThreads, 0);
  if (warpgroup == kProducerWarpgroup) {
    ptx::setmaxnreg_dec<Dir::kProducerRegs>();
    if (threadIdx.x == kProducerThread) produce_tasks<Dir>(sh, maps, p, g, counts, wait);
    if (threadIdx.x == kSignalerThread) signal_tasks<Dir>(sh, p, g, counts, wait);
    const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 32), 0);
    if (warp >= kFirstGatherWarp && p.num_comm == 0) Dir::gather_warps(p, s, wait, warp - kFirstGatherWarp);
    return;
  }
  ptx::setmaxnreg_inc<Dir::kConsumerRegs>();
  consume_tasks<Dir>(sh, maps, p, g, counts, warpgroup - kFirstConsumerWarpgroup, wait);
  // The end phase: grid barrier, reductions
  if (p.group.size > 1) __threadfence_system();  // this thread's pushes, before the end barrier
  ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kConsumers), kConsumerThreads);
  Dir::finish(sh, p, wait);
}

}  // namespace mok::cuda::fused
