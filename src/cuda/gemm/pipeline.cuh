// The one pipeline-state type of mok's kernels, the ring of mbarrier-guarded slots that uses
// it (Pipeline), and deadline-bounded barrier waits.
#pragma once

#include <cstdint>

#include "common/defs.hpp"
#include "cuda/ptx/ptx.cuh"

namespace mok::gemm {

// Position in a ring of kStages mbarrier-guarded slots: index and the parity to wait for.
template <int kStages>
struct PipelineState {
  int index = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1u;
    }
  }
  // n slots on (n >= 0): the position after n advance() calls
  __device__ __forceinline__ void advance(int n) {
    const int to = index + n;
    phase ^= static_cast<uint32_t>(to / kStages) & 1u;
    index = to % kStages;
  }
};

// Where a timed-out wait reports: words of the kernel's error record (see common/defs.hpp
// kTimeout* layout).  The first expiry wins; the others only leave.
struct WaitContext {
  uint64_t deadline_ns;     // %globaltimer value; set at kernel entry from the timeout
  int64_t* timeout_record;  // [kTimeoutWords]: flag, site, block, detail, expected, observed, rank
};

// Words of a timeout record (the workspace's error words after the route error record).
inline constexpr int kTimeoutWords = 7;

using mok::WaitSite;  // common/defs.hpp: what each site's detail holds

static __device__ __forceinline__ void report_timeout(const WaitContext& ctx, WaitSite site, int64_t detail,
                                                      int64_t expected, int64_t observed = -1) {
  if (ctx.timeout_record == nullptr) return;
  if (atomicCAS(reinterpret_cast<unsigned long long*>(ctx.timeout_record), 0ull, 1ull) == 0ull) {
    ctx.timeout_record[1] = static_cast<int64_t>(site);
    ctx.timeout_record[2] = blockIdx.x;
    ctx.timeout_record[3] = detail;
    ctx.timeout_record[4] = expected;
    ctx.timeout_record[5] = observed;
    __threadfence();
  }
}

// Spins on an mbarrier phase; false after the deadline (recorded once).
__device__ __forceinline__ bool wait_barrier(uint64_t* bar, uint32_t phase, const WaitContext& ctx, WaitSite site,
                                             int64_t detail) {
  if (ptx::mbar_try_wait(bar, phase)) return true;
  for (uint32_t spin = 1;; ++spin) {
    if (ptx::mbar_try_wait(bar, phase)) return true;
    if ((spin & 255u) != 0) continue;
    // Leave when another wait of this launch already expired, or at our own deadline.
    if (ctx.timeout_record && *reinterpret_cast<volatile int64_t*>(ctx.timeout_record) != 0) return false;
    if (ptx::globaltimer_ns() > ctx.deadline_ns) {
      report_timeout(ctx, site, detail, phase);
      return false;
    }
  }
}

// The same wait for a whole warp, with a warp-uniform exit: every lane spins until all
// lanes see the phase.  Keeps the code after it provably converged, which wgmma needs
// (ptxas serialises wgmma issued on paths it considers divergent: C7518).
__device__ __forceinline__ bool wait_barrier_warp(uint64_t* bar, uint32_t phase, const WaitContext& ctx, WaitSite site,
                                                  int64_t detail) {
  for (uint32_t spin = 0;; ++spin) {
    if (__all_sync(0xffffffffu, ptx::mbar_try_wait(bar, phase))) return true;
    if ((spin & 255u) != 255u) continue;
    bool expired = ctx.timeout_record && *reinterpret_cast<volatile int64_t*>(ctx.timeout_record) != 0;
    if (!expired && ptx::globaltimer_ns() > ctx.deadline_ns) {
      if ((threadIdx.x & 31) == 0) report_timeout(ctx, site, detail, phase);
      expired = true;
    }
    if (__any_sync(0xffffffffu, expired)) return false;
  }
}

// A ring of kStages slots, each guarded by a pair of mbarriers:
//   full[s]   producer -> consumers: slot s holds its data (TMA transaction bytes, or arrivals)
//   empty[s]  consumers -> producer: every consumer released slot s
// The state (index, phase) walks the ring; nobody flips a phase by hand.  A producer acquires
// the slot at its state (waits for the previous use to be released), fills it and arms or
// commits full_barrier(); a consumer waits for the slot at its state, reads it and releases it.
// The stage rings of the GEMMs use it (sites kStageEmpty / kStageFull, detail = the slot), and
// so do the fused kernels' hand-off rings between roles, each wait with its own site.  kWarp:
// the whole warp waits and leaves converged (wgmma code needs it: C7518); else one thread.
// Tested alone by tests/cpp/test_pipeline_gpu.cu.
template <int kStages>
struct Pipeline {
  using State = PipelineState<kStages>;
  uint64_t full[kStages];
  uint64_t empty[kStages];

  // full_arrivals: arrivals that complete a fill (1: the producer's, with TMA bytes on top);
  // empty_arrivals: releases that free a slot (one per consumer).
  __device__ __forceinline__ void init(uint32_t full_arrivals, uint32_t empty_arrivals) {
    for (int i = 0; i < kStages; ++i) {
      ptx::mbar_init(&full[i], full_arrivals);
      ptx::mbar_init(&empty[i], empty_arrivals);
    }
  }
  // Producer: the slot at `st` is free (its previous use released); false past the deadline,
  // recorded at `site` with `detail` (a stage ring: kStageEmpty, the slot).
  template <bool kWarp = false>
  __device__ __forceinline__ bool producer_acquire(const State& st, const WaitContext& wait, WaitSite site,
                                                   int64_t detail) {
    return kWarp ? wait_barrier_warp(&empty[st.index], st.phase ^ 1u, wait, site, detail)
                 : wait_barrier(&empty[st.index], st.phase ^ 1u, wait, site, detail);
  }
  __device__ __forceinline__ bool producer_acquire(const State& st, const WaitContext& wait) {
    return producer_acquire(st, wait, WaitSite::kStageEmpty, st.index);
  }
  __device__ __forceinline__ uint64_t* full_barrier(const State& st) { return &full[st.index]; }
  // Producer: the slot at `st` is filled (one arrival: a fill that is not a TMA transaction)
  __device__ __forceinline__ void producer_commit(const State& st) { ptx::mbar_arrive(&full[st.index]); }
  // Consumer: the slot at `st` is full; false past the deadline (a stage ring: kStageFull).
  template <bool kWarp = true>
  __device__ __forceinline__ bool consumer_wait(const State& st, const WaitContext& wait, WaitSite site,
                                                int64_t detail) {
    return kWarp ? wait_barrier_warp(&full[st.index], st.phase, wait, site, detail)
                 : wait_barrier(&full[st.index], st.phase, wait, site, detail);
  }
  __device__ __forceinline__ bool consumer_wait(const State& st, const WaitContext& wait) {
    return consumer_wait(st, wait, WaitSite::kStageFull, st.index);
  }
  // Consumer: release slot `index` (one arrival of this consumer).
  __device__ __forceinline__ void consumer_release(int index) { ptx::mbar_arrive(&empty[index]); }
};

}  // namespace mok::gemm
