// A comm warp's row copy through its staging row in shared memory (bulk copies): the forward's
// gather and push (gather.cuh) and the backward's gather (fused/backward_kernel.cuh).
#pragma once

#include "cuda/gemm/pipeline.cuh"
#include "cuda/ptx/ptx.cuh"

namespace mok::cuda::fused {

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

// Two rows at once through two staging rows (lane 0): both loads in flight together, then
// both stores; the same rule as copy_row for timeouts.
__device__ __forceinline__ void copy_rows2(CommWarp& a, CommWarp& b, const void* src_a, void* dst_a, const void* src_b,
                                           void* dst_b, const gemm::WaitContext& wait, int64_t detail) {
  if ((threadIdx.x & 31) != 0) return;
  ptx::bulk_wait_read<0>();  // both staging rows' previous stores have read them
  ptx::mbar_arrive_expect_tx(a.bar, a.row_bytes);
  ptx::bulk_load(a.slot, src_a, a.row_bytes, a.bar);
  ptx::mbar_arrive_expect_tx(b.bar, b.row_bytes);
  ptx::bulk_load(b.slot, src_b, b.row_bytes, b.bar);
  if (!gemm::wait_barrier(a.bar, a.phase, wait, gemm::WaitSite::kConsumerFull, detail)) return;
  a.phase ^= 1u;
  ptx::bulk_store(dst_a, a.slot, a.row_bytes);
  if (!gemm::wait_barrier(b.bar, b.phase, wait, gemm::WaitSite::kConsumerFull, detail + 500)) return;
  b.phase ^= 1u;
  ptx::bulk_store(dst_b, b.slot, b.row_bytes);
  ptx::bulk_commit();
}

// The pipelined gathers' staging: `slots` rows of row_bytes at the start of the stage memory
// (at most 16, one barrier each), then one zero row (the padding rows' source).  Every thread
// of the block calls it; it ends with a block barrier.
struct StagingRows {
  uint8_t* base;
  int slots;
  const uint8_t* zero_row;
};
template <class Stages>
__device__ __forceinline__ StagingRows make_staging_rows(Stages& stages, uint32_t row_bytes) {
  uint8_t* base = reinterpret_cast<uint8_t*>(&stages);
  const int slots = min(16, static_cast<int>(sizeof(stages.a) + sizeof(stages.b)) / static_cast<int>(row_bytes) - 1);
  uint8_t* zero_row = base + static_cast<size_t>(slots) * row_bytes;
  for (uint32_t v = threadIdx.x; v < row_bytes / 16; v += blockDim.x)
    reinterpret_cast<uint4*>(zero_row)[v] = make_uint4(0, 0, 0, 0);
  ptx::fence_proxy_async_smem();
  __syncthreads();
  return StagingRows{base, slots, zero_row};
}

}  // namespace mok::cuda::fused
