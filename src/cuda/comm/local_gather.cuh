// EP = 1's gather warps (both directions): warps 2 and 3 of every block's producer warpgroup
// copy the rows after the start gather's, with no block set aside and no staging (the stage
// memory is the GEMMs'), global to global in 16-byte vectors.  The forward's units are in
// comm/gather.cuh, the backward's in fused/backward_kernel.cuh (local_gather).
#pragma once

#include "cuda/fused/forward_params.cuh"

namespace mok::cuda::fused {

// Gather warp `gw` of `num_gw` takes units gw, gw + num_gw, ... of kGatherUnitRows rows: unit u
// is rows (u mod per-block) · kGatherUnitRows .. of the row block at position first + u / per-block
// (positions < num_positions).  unit(position, first_row) copies and publishes them; false (a
// wait timed out) ends the loop.  The block's first gather warp records its span (trace kind 253).
template <class Params, class Unit>
__device__ __forceinline__ void gather_units(const Params& p, int32_t first, int32_t num_positions, int64_t gw,
                                             int64_t num_gw, Unit unit) {
  constexpr int kUnitsPerBlock = kBlockM / kGatherUnitRows;
  TraceWriter trace(p, 3, kTraceAfterStartGather);
  const uint64_t t_begin = ptx::globaltimer_ns();
  const int64_t units = int64_t{num_positions - first} * kUnitsPerBlock;
  for (int64_t u = gw; u < units; u += num_gw)
    if (!unit(first + static_cast<int32_t>(u / kUnitsPerBlock), static_cast<int>(u % kUnitsPerBlock) * kGatherUnitRows))
      break;
  if (threadIdx.x % 32 == 0 && gw % kGatherWarps == 0)
    trace.add(mokTraceGather, t_begin, ptx::globaltimer_ns(), 253, -1, -1);
}

// The warp's unit is stored: its generic stores ordered before the TMA loads that read them
// (another SM's async proxy), every lane's before lane 0 publishes
__device__ __forceinline__ void unit_stored() {
  ptx::fence_proxy_async_global();
  __syncwarp();
}

}  // namespace mok::cuda::fused
