// EP >= 2 on the device: the symmetric regions of the group and their flags.
//
// Every flag is a sequence number (int64, monotonic per workspace, never reset): a call with
// sequence number q waits until each peer's flag reaches q.  Writers publish with
// st.release.sys after fence.sc.sys; readers poll their own region with ld.acquire.sys under
// the call's deadline.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/symmetric.hpp"
#include "cuda/gemm/pipeline.cuh"
#include "cuda/ptx/ptx.cuh"

namespace mok::cuda::ep {

// The group as one rank's kernels see it.  regions: device table of the P region pointers.
struct Group {
  uint8_t* const* regions = nullptr;  // null at EP = 1
  SymLayout layout;
  int32_t rank = 0, size = 1;
  const int64_t* seq = nullptr;       // this call's sequence number (device word)
  uint64_t fingerprint = 0;           // of this rank's configuration (common/symmetric.hpp)
};

__device__ __forceinline__ uint8_t* region(const Group& g, int s) { return g.regions[s]; }
__device__ __forceinline__ int64_t* flag_start(const Group& g, int owner, int of_rank) {
  return reinterpret_cast<int64_t*>(region(g, owner) + g.layout.flags_start) + of_rank;
}
__device__ __forceinline__ int64_t* flag_end(const Group& g, int owner, int of_rank) {
  return reinterpret_cast<int64_t*>(region(g, owner) + g.layout.flags_end) + of_rank;
}
__device__ __forceinline__ const __nv_bfloat16* x_of(const Group& g, int s) {
  return reinterpret_cast<const __nv_bfloat16*>(region(g, s) + g.layout.x);
}
// fp8_block's forward: rank s's x quantised per token (e4m3 rows of H bytes) and their scales
// ([H/128, ld] k-block-major, ld the forward's x8_ld), in place of its bf16 x
__device__ __forceinline__ const uint8_t* x8_of(const Group& g, int s) { return region(g, s) + g.layout.x; }
__device__ __forceinline__ const float* x8_scales_of(const Group& g, int s) {
  return reinterpret_cast<const float*>(region(g, s) + g.layout.x8_scales);
}
__device__ __forceinline__ __nv_bfloat16* slots_of(const Group& g, int s) {
  return reinterpret_cast<__nv_bfloat16*>(region(g, s) + g.layout.slots);
}
__device__ __forceinline__ const __nv_bfloat16* dy_of(const Group& g, int s) {
  return reinterpret_cast<const __nv_bfloat16*>(region(g, s) + g.layout.dy);
}
__device__ __forceinline__ const float* weights_of(const Group& g, int s) {
  return reinterpret_cast<const float*>(region(g, s) + g.layout.weights);
}
__device__ __forceinline__ float* dtw_of(const Group& g, int s) { return reinterpret_cast<float*>(region(g, s) + g.layout.dtw); }

// Spins until *flag >= expected; false past the deadline (recorded: site, peer, expected,
// observed) or when another wait of the call already expired.
__device__ __forceinline__ bool wait_flag(const int64_t* flag, int64_t expected, const gemm::WaitContext& wait,
                                          gemm::WaitSite site, int peer) {
  for (uint32_t spin = 0;; ++spin) {
    if (spin > 16) __nanosleep(256);
    const int64_t v = ptx::ld_acquire_sys(flag);
    if (v >= expected) return true;
    if ((spin & 63u) != 63u) continue;
    if (wait.timeout_record && *reinterpret_cast<volatile int64_t*>(wait.timeout_record) != 0) return false;
    if (ptx::globaltimer_ns() > wait.deadline_ns) {
      gemm::report_timeout(wait, site, peer, expected, v);
      return false;
    }
  }
}

// Publishes `seq` in every rank's flag slot of this rank (flags_start or flags_end), after
// a system-scope fence that orders every write this thread has observed before it.
template <bool kEnd>
__device__ __forceinline__ void publish(const Group& g, int64_t seq) {
  ptx::fence_sys();
  for (int s = 0; s < g.size; ++s)
    ptx::st_release_sys(kEnd ? flag_end(g, s, g.rank) : flag_start(g, s, g.rank), seq);
}

// Waits for every rank's flag of this call in this rank's region.
template <bool kEnd>
__device__ __forceinline__ bool wait_group(const Group& g, int64_t seq, const gemm::WaitContext& wait) {
  for (int s = 0; s < g.size; ++s) {
    const int64_t* f = kEnd ? flag_end(g, g.rank, s) : flag_start(g, g.rank, s);
    if (!wait_flag(f, seq, wait, kEnd ? gemm::WaitSite::kEndBarrier : gemm::WaitSite::kStartBarrier, s))
      return false;
  }
  return true;
}

}  // namespace mok::cuda::ep
