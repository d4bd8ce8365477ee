// The comm role's transport, for both directions: where a plan record's source rows and its
// home rank's outputs live, and the end barrier.  NVLink peer pointers today (the group's
// symmetric regions, ep.cuh); an NVSHMEM or NCCL device-API transport replaces these
// functions and the barriers of ep.cuh, nothing else.  P: the direction's parameters
// (ForwardParams, BackwardParams: group, x, hidden, slots; the backward's dy, topk_weights,
// d_topk_weights).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/defs.hpp"
#include "cuda/comm/ep.cuh"

namespace mok::cuda::fused {

// The x row of a plan record: x of its source rank (EP >= 2: that rank's region, over NVLink).
template <class P>
__device__ __forceinline__ const __nv_bfloat16* x_row(const P& p, uint32_t rec) {
  const __nv_bfloat16* x = p.group.size > 1 ? ep::x_of(p.group, row_rank(rec)) : p.x;
  return x + row_token(rec) * p.hidden;
}
// fp8_block's forward: the e4m3 row of x of a plan record (H bytes: x quantised per token by
// its source rank) and the scale of its k-block kb (the scales k-block-major at p.x8_ld)
template <class P>
__device__ __forceinline__ const uint8_t* x8_row(const P& p, uint32_t rec) {
  const uint8_t* x8 = p.group.size > 1 ? ep::x8_of(p.group, row_rank(rec)) : p.x8;
  return x8 + row_token(rec) * p.hidden;
}
template <class P>
__device__ __forceinline__ float x8_scale(const P& p, uint32_t rec, int32_t kb) {
  const float* s = p.group.size > 1 ? ep::x8_scales_of(p.group, row_rank(rec)) : p.x8_scales;
  return __ldg(s + kb * p.x8_ld + row_token(rec));  // (written before the call's start barrier)
}
// The backward's dy row of a plan record, and its route's weight, from its source rank.
template <class P>
__device__ __forceinline__ const __nv_bfloat16* dy_row(const P& p, uint32_t rec) {
  const __nv_bfloat16* dy = p.group.size > 1 ? ep::dy_of(p.group, row_rank(rec)) : p.dy;
  return dy + row_token(rec) * p.hidden;
}
template <class P>
__device__ __forceinline__ float route_weight(const P& p, uint32_t rec) {
  const float* w = p.group.size > 1 ? ep::weights_of(p.group, row_rank(rec)) : p.topk_weights;
  return w[row_token(rec) * p.topk + row_slot(rec)];
}
// The slot array of a plan record's home rank (EP >= 2: in that rank's region); p.slots for
// padding records, which are never stored.
template <class P>
__device__ __forceinline__ __nv_bfloat16* home_slots(const P& p, uint32_t rec) {
  return p.group.size > 1 && !row_is_pad(rec) ? ep::slots_of(p.group, row_rank(rec)) : p.slots;
}
// Where the backward's d topk_weights of a (real) record go: its home rank's array (EP >= 2:
// in that rank's region, copied out after the end barrier: own_dtw).
template <class P>
__device__ __forceinline__ float* home_dtw(const P& p, uint32_t rec) {
  return p.group.size > 1 ? ep::dtw_of(p.group, row_rank(rec)) : p.d_topk_weights;
}
template <class P>
__device__ __forceinline__ const float* own_dtw(const P& p) {
  return ep::dtw_of(p.group, p.group.rank);
}

// EP end barrier, by one thread of every block once its block's pushes are fenced at system
// scope: block 0 tells every rank that this rank's pushes landed, then each block waits for
// every rank's word.
__device__ __forceinline__ void end_barrier(const ep::Group& group, const gemm::WaitContext& wait) {
  const int64_t seq = *group.seq;
  if (blockIdx.x == 0) ep::publish<true>(group, seq);
  ep::wait_group<true>(group, seq, wait);
}

}  // namespace mok::cuda::fused
