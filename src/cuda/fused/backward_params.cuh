// The fused backward's parameters, tensor maps, shared storage and counters: what its roles
// (fused/backward_kernel.cuh, ops_bwd/) share.  The task list is fused/schedule_bwd.cuh.
//
// Rows are resident: every plan row has its place in the row buffers (x_rows, dy_rows, h, dh,
// wa, row_weight, partials: row = plan row), so a gather never waits for a ring slot to be
// read; the macrobatches of the schedule are those of the forward's ring, which fix how the
// fp32 weight-gradient sums are split (wgrad_piece), the same as the unfused backward's.
#pragma once

#include "cuda/comm/ep.cuh"
#include "cuda/fused/forward_params.cuh"
#include "cuda/fused/schedule_bwd.cuh"
#include "cuda/gemm/epilogue_bwd.cuh"
#include "cuda/gemm/wgrad.cuh"

namespace mok::cuda::fused::bwd {

// Limits of the shared-memory tables (the host falls back to the unfused backward past them).
inline constexpr int kMaxMinibatches = 256;
inline constexpr int kMaxSegments = 4 * kMaxMinibatches + 6;
inline constexpr int kMaxExperts = 512;

// A task as the roles pass it: kind (TaskKind), unit (row block, token block or expert),
// n (tile within the unit), macro (wgrad: the macrobatch, -1 for an expert without rows); for
// the wgrad kinds also its piece (wgrad_piece), found by the producer when it claims the task
// so that the consumers read it from the hand-off instead of global memory: k-blocks, first
// row, fp32 mode and accumulator slot.
struct Task {
  int32_t kind;
  int32_t block;
  int32_t n_block;
  int32_t macro;
  int32_t k_blocks, row0, mode, slot;
};

struct BackwardParams {
  // Dimensions
  int32_t hidden, inter, shared_inter, topk;
  // Map rows between experts of the weight stacks (gemm::matrix_pitch: I and H when contiguous)
  int32_t gate_up_pitch, down_pitch;
  int64_t num_tokens;
  int32_t ring_blocks, minibatch_blocks, num_comm, num_local;
  int32_t shared_blocks;      // ceil(T / BLOCK_M) with a shared expert, else 0
  int32_t replay;             // 1: the routed h is replayed (no saved h)
  int32_t shared_replay;      // 1: the shared h is replayed
  int32_t slot_by_expert;     // fp32 accumulator slot: the expert (1) or its first macrobatch (0)
  int32_t n_acc;              // fp32 accumulator slots (0: no expert spans macrobatches)
  int32_t n_group;            // the tiles' raster: N-blocks per group (MOK_TILE_N_GROUP)
  int32_t start_blocks;       // row blocks [0, start_blocks) gathered by every block at the start
                              // (MOK_BACKWARD_START_GATHER minibatches); the comm blocks gather the rest
  int64_t max_rows;
  // Plan
  const uint32_t* rows;
  const int32_t* expert_offset;
  const int32_t* expert_count;
  // Inputs (EP >= 2: x, dy and the weights of a row come from its source rank's region)
  const __nv_bfloat16* x;
  const __nv_bfloat16* dy;
  const float* topk_weights;
  plan::RoutingView routing;
  // Rows (plan order) and the shared expert's (token order)
  __nv_bfloat16 *x_rows, *dy_rows, *h, *dh, *wa;
  float* row_weight;
  float* partials;            // [max_rows, ceil(I / kDtwChunk)]
  __nv_bfloat16 *sh_h, *sh_dh, *sh_a;
  __nv_bfloat16* slots;       // [T*k, H]: each route's dx row (EP >= 2: this rank's region)
  __nv_bfloat16* shared_dx;   // [T, H]
  const float* ones;          // [k] 1.0f
  // Outputs
  __nv_bfloat16* dx;
  float* d_topk_weights;
  // The weight gradients' tiles: out, out1 / out_split, main_grad(1), acc, mo, no of each kind
  gemm::WgradParams wg_down, wg_gate_up, wg_shared_down, wg_shared_gate_up;
  // 1: the routed wgrad tiles that are whole, final and bf16 leave through two stages of the ring
  // and TMA stores (Maps::wg_*_out; map rows between experts of each target); 0: every tile
  // through registers (gradients that 2-D maps cannot follow)
  int32_t wgrad_tma;
  int64_t wg_down_pitch, wg_gate_up_pitch;
  ep::Group group;
  // Timing ring (null = off): the producer's waits and loads, the signaler's tiles
  mokTraceEvent_t* trace;
  int32_t trace_cap;
  // Synchronisation: kHeader words, then the CounterArray arrays at counter_offset[array]
  int32_t* counters;
  int32_t counter_offset[static_cast<int>(CounterArray::kNumArrays)];
  uint64_t timeout_ns;
  int64_t* timeout_record;
};

// Tensor maps: K-major ones have BLOCK_M-row boxes (A) or BLOCK_N/2-row boxes (B halves);
// N-major B and MN-major wgrad operands boxes of BLOCK_K rows (K) by kBoxCols columns.
// The operand maps, after a precision's scale maps (a base: none for bf16, policy.cuh)
template <class ScaleMapsT = gemm::NoScales>
struct MapsWith : ScaleMapsT {
  // routed
  CUtensorMap x_rows_k, w_gate_k, w_up_k;    // replay
  CUtensorMap dy_rows_k, w_down_n;           // dgrad down
  CUtensorMap dh_k, w_gate_n, w_up_n;        // dgrad gate/up
  CUtensorMap dy_rows_mn, wa_mn, dh_mn, x_rows_mn;  // wgrad
  // shared
  CUtensorMap x_k, ws_gate_k, ws_up_k, dy_k, ws_down_n, sh_dh_k, ws_gate_n, ws_up_n;
  CUtensorMap dy_mn, sh_a_mn, sh_dh_mn, x_mn;
  // h and the shared h, 128-row x 64-channel boxes (the dgrad-down epilogues' passes)
  CUtensorMap h_k, sh_h_k;
  // The routed weight gradients as stored, 64-row x 64-column boxes (wgrad_tma)
  CUtensorMap wg_down_out, wg_gate_out, wg_up_out;
  // dh, wa and the shared dh, a, 64-row x 64-column boxes (the dgrad-down epilogues' TMA stores)
  CUtensorMap dh_st, wa_st, sh_dh_st, sh_a_st;
};
using Maps = MapsWith<>;

template <class StagesT>
struct alignas(1024) SharedT {
  StagesT stages;                           // the policy's stage ring; also the comm blocks' row staging
  Segment segments[kMaxSegments];
  int32_t expert_blocks[kMaxExperts + 1];   // each local expert's first row block, then the end
  Geometry geo;                             // the call's (expert arrays: expert_blocks)
  TaskCounts counts;
  Task tasks[2];
  Task next_task;                           // the producer's claimed-ahead task (kClaimAhead)
  RoleRings rings;                          // the hand-offs between the roles (forward_params.cuh)
  uint64_t gather_bar[TileConfig::kThreads / 32];  // comm: one per warp's staging row
  int32_t num_segments;
  int32_t num_tasks;
};
template <class Policy>
inline constexpr size_t kSmemBytes = sizeof(SharedT<typename Policy::Stages>) + 1024;

__device__ __forceinline__ int32_t* counter_of(const BackwardParams& p, CounterArray a, int32_t index) {
  return p.counters + p.counter_offset[static_cast<int>(a)] + index;
}

// The tile counts of the call (the schedule's TaskCounts) from the parameters.
__device__ __forceinline__ TaskCounts task_counts(const BackwardParams& p) {
  TaskCounts c{};
  // Gate/up replay tiles of BLOCK_N / 2 channels (gate and up), dgrad tiles of BLOCK_N
  // columns, the wgrad tiling of its targets (gemm::wgrad_layout); the last tile of each
  // dimension may be partial
  const int32_t H = p.hidden, I = p.inter, Is = p.shared_inter;
  c.n_replay = p.replay ? gemm::tiles_of(I, kHalfN) : 0;
  c.n_dgrad_down = gemm::tiles_of(I, kBlockN);
  c.n_dgrad_gate_up = gemm::tiles_of(H, kBlockN);
  c.n_wgrad_down = p.wg_down.num_m_blocks * p.wg_down.num_n_blocks;
  c.n_wgrad_gate_up = p.wg_gate_up.num_m_blocks * p.wg_gate_up.num_n_blocks;
  c.replay_all = p.replay;
  c.saved_all = p.replay ? 0 : 1;
  c.raster_group = p.n_group;
  c.resident = 1;
  c.wgrad_down_n_blocks = p.wg_down.num_n_blocks;
  c.wgrad_gate_up_n_blocks = p.wg_gate_up.num_n_blocks;
  if (Is > 0) {
    c.shared_blocks = p.shared_blocks;
    c.n_shared_replay = p.shared_replay ? gemm::tiles_of(Is, kHalfN) : 0;
    c.n_shared_dgrad_down = gemm::tiles_of(Is, kBlockN);
    c.n_shared_dgrad_gate_up = gemm::tiles_of(H, kBlockN);
    c.n_shared_wgrad_down = p.wg_shared_down.num_m_blocks * p.wg_shared_down.num_n_blocks;
    c.n_shared_wgrad_gate_up = p.wg_shared_gate_up.num_m_blocks * p.wg_shared_gate_up.num_n_blocks;
    c.shared_wgrad_down_n_blocks = p.wg_shared_down.num_n_blocks;
    c.shared_wgrad_gate_up_n_blocks = p.wg_shared_gate_up.num_n_blocks;
  }
  return c;
}

}  // namespace mok::cuda::fused::bwd
