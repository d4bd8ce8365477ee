// A comm warp's row copy through its staging row in shared memory (bulk copies): the forward's
// gather (gather.cuh) and the backward's (fused/backward_kernel.cuh).
#pragma once

#include "cuda/gemm/pipeline.cuh"
#include "cuda/ptx/ptx.cuh"

namespace mok::cuda::fused {

// One warp's staging row in the (otherwise unused) stage memory, and its barrier: a ring of
// one slot (the state's phase: the completed loads' parity).
struct CommWarp {
  uint8_t* slot;
  uint64_t* bar;
  gemm::PipelineState<1> state;
  uint32_t row_bytes;
};

// Copies row src -> dst through the warp's staging row (lane 0: bulk load, wait, bulk store);
// a wait past the deadline is recorded as kRowCopy of this warp (of the block).
// NOTES: on a timeout the row is skipped, not the loop: the other lanes must still reach
// __syncwarp; the recorded timeout makes every other wait of the launch leave.
__device__ __forceinline__ void copy_row(CommWarp& w, const void* src, void* dst, const gemm::WaitContext& wait) {
  if ((threadIdx.x & 31) != 0) return;
  ptx::bulk_wait_read<0>();  // the staging row's previous store has read it
  ptx::mbar_arrive_expect_tx(w.bar, w.row_bytes);
  ptx::bulk_load(w.slot, src, w.row_bytes, w.bar);
  if (!gemm::wait_barrier(w.bar, w.state.phase, wait, WaitSite::kRowCopy, threadIdx.x / 32)) return;
  w.state.advance();
  ptx::bulk_store(dst, w.slot, w.row_bytes);
  ptx::bulk_commit();
}

}  // namespace mok::cuda::fused
