// The comm role's transport: where a plan record's source row and home slot live.  NVLink peer
// pointers today (the group's symmetric regions, ep.cuh); an NVSHMEM or NCCL device-API
// transport replaces these two functions and the barriers of ep.cuh, nothing else.
#pragma once

#include "cuda/fused/forward_params.cuh"

namespace mok::cuda::fused {

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

}  // namespace mok::cuda::fused
