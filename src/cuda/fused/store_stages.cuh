// Epilogues that leave through the stage ring (ops' kRingEpilogue): the tile's producer
// reserves two stages after its K loop (no load: a plain arrival on their full barriers), each
// consumer warpgroup writes its 64 rows of the tile into one of them, hands them to the async
// proxy (TMA stores or bulk copies) and goes on to its next tile once they have been read; the
// copies' writes complete under the next tiles' MMAs.  Each warpgroup releases both stages (every
// stage of a cooperative tile is released by both).  The consumers wait for their last copies'
// writes before the end phase (roles/consumers.cuh).
#pragma once

#if defined(__CUDACC__)
#include "cuda/fused/forward_params.cuh"
#include "cuda/gemm/tile.cuh"

namespace mok::cuda::fused {

inline constexpr int kStoreStages = 2;

// Producer: the two stages of a tile's store epilogue, after its k-blocks; false on a timed-out wait.
template <class Stages, class Stage>
__device__ __forceinline__ bool reserve_store_stages(Stages& s, Stage& stage, const gemm::WaitContext& wait) {
  for (int q = 0; q < kStoreStages; ++q) {
    if (!s.pipe.producer_acquire(stage, wait)) return false;
    ptx::mbar_arrive(s.pipe.full_barrier(stage));
    stage.advance();
  }
  return true;
}

// Consumer: waits for both reserved stages; this consumer's stage index, or -1 on a timed-out wait.
template <class Ring>
__device__ __forceinline__ int acquire_store_stage(int consumer, const Ring& r) {
  auto second = r.stage;
  second.advance();
  if (!r.s.pipe.consumer_wait(r.stage, r.wait) || !r.s.pipe.consumer_wait(second, r.wait)) return -1;
  return consumer == 0 ? r.stage.index : second.index;
}

// Consumer, after every thread that issued copies from the stages waited for their reads: the
// warpgroup's barrier, then its leader releases both stages.
template <class Ring>
__device__ __forceinline__ void release_store_stages(const Ring& r) {
  ptx::named_barrier_sync(r.bar, 128);
  if (threadIdx.x % 128 == 0) {
    auto second = r.stage;
    second.advance();
    r.s.pipe.consumer_release(r.stage.index);
    r.s.pipe.consumer_release(second.index);
  }
  r.stage.advance();
  r.stage.advance();
}

// gemm::epilogue_scatter through this consumer's reserved stage (the same rows and bits): its 64
// rows of bf16 go into the stage at a row pitch of the row's bytes + 16 (4-byte writes from the
// accumulator fragment, whose 8 rows per instruction then fall on distinct banks), the rows past
// what the stage's B area holds into its A area at the same bank offsets; then lanes 0-15 of each
// warp copy one row each to its slot (a 1-D bulk copy of the row's columns below ld).  Padding
// rows are skipped.  False on a timed-out wait.
template <int kRegs, class Ring, typename Slots>
__device__ __forceinline__ bool epilogue_scatter_staged(const float (&acc)[kRegs], int consumer, const Ring& r,
                                                        Slots slots, int64_t ld, const uint32_t* tile_rows, int topk,
                                                        int64_t col0) {
  constexpr int kRowBytes = kRegs * 4;  // BLOCK_N bf16
  constexpr int kPitch = kRowBytes + 16;
  constexpr int kBBytes = static_cast<int>(sizeof(r.s.b[0])), kABytes = static_cast<int>(sizeof(r.s.a[0]));
  constexpr int kRowsInB = kBBytes / kPitch;
  constexpr int kPitchA = (kPitch + 127) / 128 * 128;  // rows in A: whole 128-byte lines apart
  static_assert(kRowsInB < 64 && (64 - kRowsInB) * kPitchA <= kABytes, "a consumer's 64 rows fit in one stage");
  const int index = acquire_store_stage(consumer, r);
  if (index < 0) return false;
  uint8_t* const b = reinterpret_cast<uint8_t*>(r.s.b[index]);
  uint8_t* const a = reinterpret_cast<uint8_t*>(r.s.a[index]);
  // Row rr's place: in A, at the 128-byte offset it would have in B (the same banks)
  auto row_at = [&](int rr) {
    return rr < kRowsInB ? b + rr * kPitch : a + (rr - kRowsInB) * kPitchA + (rr * kPitch) % 128;
  };
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4, t = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint8_t* const row = row_at(warp * 16 + lane / 4 + half * 8);
#pragma unroll
    for (int n8 = 0; n8 < kRegs / 4; ++n8)
      *reinterpret_cast<uint32_t*>(row + n8 * 16 + t * 4) =
          gemm::pack_bf16x2(acc[n8 * 4 + half * 2], acc[n8 * 4 + half * 2 + 1]);
  }
  ptx::fence_proxy_async_smem();
  ptx::named_barrier_sync(r.bar, 128);
  if (lane < 16) {
    const int rr = warp * 16 + lane;
    const uint32_t rec = tile_rows[consumer * 64 + rr];
    if (!row_is_pad(rec)) {
      const int64_t cols = ld - col0 < kRowBytes / 2 ? ld - col0 : kRowBytes / 2;
      __nv_bfloat16* dst = slots(rec) + (row_token(rec) * topk + row_slot(rec)) * ld + col0;
      ptx::bulk_store(dst, row_at(rr), static_cast<uint32_t>(cols * 2));
      ptx::bulk_commit();
      ptx::bulk_wait_read<0>();
    }
  }
  release_store_stages(r);
  return true;
}

}  // namespace mok::cuda::fused
#endif
