// The fused forward's parameters, shared storage, global dependency counters and timing ring:
// what its roles (fused/forward_kernel.cuh, comm/) share.
#pragma once

#include "cuda/comm/ep.cuh"
#include "cuda/fused/schedule.cuh"
#include "cuda/fused/tile_sizes.cuh"
#include "cuda/gemm/tile.cuh"

namespace mok::cuda::fused {

enum class NamedBarrier : uint32_t {
  kBlock = 0,      // __syncthreads
  kConsumers = 1,  // both consumer warpgroups (256 threads): a tile's stores are all issued
  kConsumer0 = 2,  // one consumer warpgroup (128 threads): kConsumer0 + its index
};

// The role table's threads (every fused kernel): thread 0 of warpgroup 0 produces, thread 32
// signals, warps 2 and 3 gather (EP = 1), warpgroups 1 and 2 consume.
inline constexpr int kProducerWarpgroup = 0;
inline constexpr uint32_t kProducerThread = 0, kSignalerThread = 32;
inline constexpr int kFirstGatherWarp = 2;  // kGatherWarps of them (tile_sizes.cuh)
inline constexpr int kFirstConsumerWarpgroup = 1;
// Threads of a warpgroup; of both consumer warpgroups (the kConsumers barrier, the end phases),
// which the first consumer thread leads at the grid barrier
inline constexpr int kWarpgroupThreads = 128;
inline constexpr int kConsumerThreads = kWarpgroupThreads * TileConfig::kConsumers;
inline constexpr int kFirstConsumerThread = kFirstConsumerWarpgroup * kWarpgroupThreads;

enum class Counter : int32_t { kTaskNext = 0, kBlocksDone = 1, kHeader = 2 };

struct TaskInfo {
  int32_t kind;     // TaskKind
  int32_t block;    // row block (routed: global plan block; shared: token block)
  int32_t n_block;
  int32_t macro;    // 0 (the backward's tiles have one: the op contract is the same)
};

struct ForwardParams {
  // Dimensions
  int32_t hidden, inter, shared_inter, topk;
  // Map rows between experts of the weight stacks (gemm::matrix_pitch: I and H when contiguous)
  int32_t gate_up_pitch, down_pitch;
  // k-blocks of H, I and I_s at the policy's K per k-block (Tile::kBlockK: 64 bf16, 128 e4m3)
  int32_t hidden_kb, inter_kb, shared_inter_kb;
  int64_t num_tokens;
  int32_t ring_blocks, minibatch_blocks, num_comm;
  int32_t max_blocks, shared_blocks;
  int32_t n_group;            // raster: N-blocks per group within a segment
  int32_t start_blocks;       // processing positions [0, start_blocks) gathered by every block at the start
                              // (MOK_FORWARD_START_GATHER minibatches); the comm blocks gather the rest
  // Plan
  const uint32_t* rows;
  const int32_t* expert_offset;
  const int32_t* block_expert;
  int32_t num_local;
  // Data
  const __nv_bfloat16* x;
  const float* topk_weights;
  plan::RoutingView routing;
  __nv_bfloat16* ring;        // [macrobatch_size, H]
  __nv_bfloat16* act;         // [macrobatch_size, I]
  __nv_bfloat16* slots;       // [T*k, H]
  __nv_bfloat16* shared_act;  // [T_max, I_s]
  __nv_bfloat16* shared_out;  // [T_max, H]
  __nv_bfloat16* y;           // [T, H]
  __nv_bfloat16* saved_h;     // [max_rows, 2I] or null: [bf16(g) | bf16(u)] per plan row, for the backward
  __nv_bfloat16* saved_shared_h;  // [T, 2I_s] or null: the shared expert's
  // fp8_block (PrecisionFp8Block policies; else null): ring, act and shared_act hold e4m3 rows
  // (H, I, I_s bytes), their scales [K / 128, ld] fp32 k-block-major beside them; x8 is x
  // quantised per token [T, H] e4m3 (scales x8_scales [H / 128, x8_ld]), what the gathers copy
  // and the shared gate/up reads; w_scales the weights' 128 x 128 block scales [E, N / 128,
  // K / 128] (w_gate, w_up, w_down, ws_gate, ws_up, ws_down); pow2: power-of-two scales of a
  const uint8_t* x8;
  const float* x8_scales;
  float* ring_scales;        // [H / 128, scales_ld]
  float* act_scales;         // [I / 128, scales_ld]
  float* shared_act_scales;  // [I_s / 128, x8_ld]
  int64_t x8_ld, scales_ld;
  const float* w_scales[6];
  int32_t pow2;  // EP >= 2: the group's regions (pull from x_of(rank), push to slots_of(rank)); size 1 at EP = 1
  ep::Group group;
  // Timing ring (null = off): kTraceRecorders regions of trace_cap events per block
  mokTraceEvent_t* trace;
  int32_t trace_cap;
  // Synchronisation
  int32_t* counters;          // kHeader words, then gather_ready, gu_done, dn_done, sgu_done [max_blocks]
  uint64_t timeout_ns;
  int64_t* timeout_record;
};

// The operand maps, after a precision's scale maps (a base: none for bf16, policy.cuh)
template <class ScaleMapsT = gemm::NoScales>
struct MapsWith : ScaleMapsT {
  CUtensorMap ring, w_gate, w_up, act, w_down, x, ws_gate, ws_up, shared_act, ws_down;
};
using Maps = MapsWith<>;

// The hand-offs between a fused kernel's roles, two slots each (gemm::Pipeline):
//   tasks  producer -> consumers + signaler: the task in tasks[slot] (full: the producer's
//          arrival; empty: both consumer warpgroups' leaders and the signaler)
//   done   consumer leaders -> signaler: a tile's stores are issued (full: both leaders, or the
//          owner of a ping-pong tile; empty: the signaler, once it took the tile)
struct RoleRings {
  gemm::Pipeline<2> tasks;
  gemm::Pipeline<2> done;
};

template <class StagesT>
struct alignas(1024) FusedSharedT {
  StagesT stages;                           // the policy's stage ring; also the comm blocks' row staging
  Segment segments[kMaxSegments];
  TaskInfo tasks[2];                        // producer -> consumers + signaler task handoff
  RoleRings rings;                          // the hand-offs between the roles
  uint64_t gather_bar[TileConfig::kThreads / 32];  // comm: one per warp's staging row
  int32_t num_segments;
  int32_t num_tasks;
  int32_t n_group;
};
template <class Policy>
inline constexpr size_t kFusedSmemBytes = sizeof(FusedSharedT<typename Policy::Stages>) + 1024;

// The role hand-off barriers of a fused kernel's shared storage (both directions' Shared have
// them): the stage ring's, producer -> consumers + signaler task hand-off, consumers ->
// signaler tile done, and the comm warps' staging rows.  Thread 0, before the block barrier.
template <class SharedT>
__device__ __forceinline__ void init_role_barriers(SharedT& sh) {
  using C = typename decltype(sh.stages)::Tile;
  sh.stages.init_barriers();
  sh.rings.tasks.init(1, C::kConsumers + 1);
  // A tile's done: both warpgroups of a cooperative tile, its owner of a ping-pong one
  sh.rings.done.init(C::kPingPong ? 1 : C::kConsumers, 1);
  for (int w = 0; w < static_cast<int>(sizeof(sh.gather_bar) / sizeof(sh.gather_bar[0])); ++w)
    ptx::mbar_init(&sh.gather_bar[w], 1);
  ptx::fence_mbar_init();
}

// ---- global counters ------------------------------------------------------------------------
// Spins until *counter >= expected; false past the deadline (recorded at `site` with
// `detail`, the expected and the last observed value) or when another wait already expired.
__device__ __forceinline__ bool wait_counter(const int32_t* counter, int32_t expected, const gemm::WaitContext& wait,
                                             WaitSite site, int64_t detail) {
  int32_t v = ptx::ld_acquire_gpu(counter);
  if (v >= expected) return true;
  for (uint32_t spin = 1;; ++spin) {
    // NOTES: a spinning thread costs power the tensor cores need under the power cap
    // (sustained runs clock down ~18 %); back off after the first polls.
    if (spin > 16) __nanosleep(spin > 256 ? 256 : 64);
    v = ptx::ld_acquire_gpu(counter);
    if (v >= expected) return true;
    if ((spin & 63u) != 0) continue;
    if (wait.timeout_record && *reinterpret_cast<volatile int64_t*>(wait.timeout_record) != 0) return false;
    if (ptx::globaltimer_ns() > wait.deadline_ns) {
      gemm::report_timeout(wait, site, detail, expected, v);
      return false;
    }
  }
}

__device__ __forceinline__ void signal_counter(int32_t* counter, int32_t add) {
  ptx::fence_proxy_async_global();
  ptx::red_release_gpu_add(counter, add);
}

// Counter arrays after the header: gather_ready, gu_done, dn_done, sgu_done, each [max_blocks]
// (max_blocks >= ceil(T_max / BLOCK_M), the shared blocks).
__device__ __forceinline__ int32_t* counter_of(const ForwardParams& p, CounterArray a, int32_t index) {
  return p.counters + static_cast<int>(Counter::kHeader) + static_cast<int64_t>(a) * p.max_blocks + index;
}

// What an epilogue that reads stages after the K loop needs (ops' kRingEpilogue):
// the stage ring and the consumer's place in it, the deadline, its warpgroup's named barrier.
template <class StagesT, class MapsT>
struct EpilogueRing {
  using Tile = typename StagesT::Tile;
  StagesT& s;
  gemm::PipelineState<StagesT::Tile::kStages>& stage;
  const gemm::WaitContext& wait;
  uint32_t bar;
  const MapsT& maps;  // the kernel's tensor maps (an epilogue that stores with TMA)
};

// The shared expert's output tile (token block `block`, N block `n_block` of 2 kRegs columns: the
// tile's N) into out [tokens, ld]: what the forward's shared down and the backward's shared dgrad
// gate/up store.
template <int kRegs>
__device__ __forceinline__ void store_token_tile(const float (&acc)[kRegs], int consumer, __nv_bfloat16* out,
                                                 int64_t ld, int64_t num_tokens, int32_t block, int32_t n_block) {
  gemm::epilogue_store(acc, consumer, out, ld, int64_t{block} * kBlockM, num_tokens, int64_t{n_block} * (2 * kRegs));
}

// The counter waits of a task (the producer) or of a row block's gather (a comm warp:
// kGatherCounter), at the counters of a direction's parameters (its counter_of); kDirection
// goes into the timeout record's detail.
template <int kDirection, class Params, class Array>
__device__ __forceinline__ bool wait_counters(const Params& p, const CounterWait<Array>* waits, int n,
                                              const gemm::WaitContext& wait, WaitSite site = WaitSite::kTaskCounter) {
  for (int i = 0; i < n; ++i)
    if (!wait_counter(counter_of(p, waits[i].array, waits[i].index), waits[i].expected, wait, site,
                      counter_wait_detail(kDirection, static_cast<int32_t>(waits[i].array), waits[i].index)))
      return false;
  return true;
}

// ---- timing ring ------------------------------------------------------------------------------
// One writer per (block, recorder): 0 producer, 1 signaler, 2 combine thread, 3 gathers.  A
// recorder written in turns by several writers gives each its first event (`first`): the
// gather recorder's event 0 is the start gather's, then the comm block's (EP >= 2) or the
// first gather warp's (EP = 1) from kTraceAfterStartGather on.
inline constexpr int32_t kTraceAfterStartGather = 1;
struct TraceWriter {
  mokTraceEvent_t* base = nullptr;
  int32_t cap = 0, count = 0;
  template <class Params>
  __device__ TraceWriter(const Params& p, int recorder, int32_t first = 0) : count(first) {
    if (p.trace) {
      base = p.trace + (static_cast<int64_t>(blockIdx.x) * MOK_TRACE_RECORDERS + recorder) * p.trace_cap;
      cap = p.trace_cap;
    }
  }
  __device__ void add(mokTraceRole_t role, uint64_t begin, uint64_t end, int32_t kind, int32_t block, int32_t detail) {
    if (base == nullptr || count >= cap) return;
    base[count++] = mokTraceEvent_t{begin, end, static_cast<uint32_t>(role), static_cast<uint32_t>(kind), block, detail};
  }
};

// ---- task decode ------------------------------------------------------------------------------
template <class SharedT>
__device__ __forceinline__ TaskInfo decode_task(const SharedT& sh, int32_t task) {
  const TaskTile t = fused::decode_task(sh.segments, sh.num_segments, sh.n_group, task);
  return TaskInfo{t.kind, t.block, t.n_block, 0};
}

}  // namespace mok::cuda::fused
