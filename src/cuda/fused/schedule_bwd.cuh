// The task list of the fused backward (docs/design.md, "The fused backward"): data computed
// from the plan's row count and expert ranges, identical on every block and on the host, where
// tests/cpp/test_schedule_bwd.cpp checks it and runs a model of its protocol.  The kernel is
// fused/backward_kernel.cuh; its ops, with what each waits on and signals, ops_bwd/.
//
// Processing order: macrobatches ascending (macrobatch 0 is in the ring from the forward),
// row blocks ascending, so position q is block q.  Block b lives in ring slot b % ring_blocks;
// its previous occupant is b - ring_blocks.
//
// Task list (claimed in increasing order; a task waits only on lower-numbered tasks or on the
// comm blocks, whose waits are on lower-numbered tasks than any task that waits on them):
//   per minibatch p (its macrobatch M):
//     [replay(p) when M >= 1]  [dgrad down(p)]  [dgrad gate/up(p-1)]  [wgrad of the experts
//     whose last block in M is in minibatch p-1]
//   and at the end of each macrobatch everything lagged is flushed, so that the readers of a
//   ring slot's previous occupant come before the tasks of the block that overwrites it.
// The shared expert's tasks come first (its rows are the rank's own tokens: no gather, the
// comm blocks' pulls start meanwhile), then the zero wgrad tiles of experts without rows.
#pragma once

#include <cstdint>

#include "cuda/fused/op_list.cuh"
#include "cuda/fused/task_table.cuh"
#include "cuda/fused/tile_sizes.cuh"
#include "cuda/gemm/config.hpp"
#include "plan/plan.hpp"

namespace mok::cuda::fused::bwd {

enum class TaskKind : int32_t {
  kReplay = 0,       // h = x · [W_gate; W_up]ᵀ of a block (macrobatches >= 1)
  kDgradDown = 1,    // da = dy · W_down[e]; epilogue: dg | du, w·a, ⟨da, a⟩ partials
  kDgradGateUp = 2,  // dx = [dg | du] · [W_gate; W_up][e], pushed home
  kWgradDown = 3,    // dW_down[e] += dyᵀ · (w·a) over e's rows in a macrobatch (block = expert)
  kWgradGateUp = 4,  // [dW_gate; dW_up][e] += [dg | du]ᵀ · x                 (block = expert)
  // The shared expert over the rank's tokens (unit = a block of BLOCK_M tokens; its wgrad: unit 0)
  kSharedReplay = 5,      // h_s = x · [Ws_gate; Ws_up]ᵀ (unless the forward kept it)
  kSharedDgradDown = 6,   // da_s = dy · Ws_down; epilogue: dg_s | du_s (weight 1)
  kSharedDgradGateUp = 7, // dx_s = [dg_s | du_s] · [Ws_gate; Ws_up], for the combine
  kSharedWgradDown = 8,   // dWs_down += dyᵀ · a_s over every token
  kSharedWgradGateUp = 9, // [dWs_gate; dWs_up] += [dg_s | du_s]ᵀ · x
  kDone = 10,
};

// The ops of the kinds (ops_bwd/: one file per GEMM kind, its routed and its shared op), listed
// here in the order of the kinds (op_list.cuh reads the list: visit_op, task_waits, task_signals)
namespace ops {
struct Replay;
struct DgradDown;
struct DgradGateUp;
struct SharedReplay;
struct SharedDgradDown;
struct SharedDgradGateUp;
template <TaskKind kKindV, bool kShared, bool kDown>
struct WgradOp;  // ops_bwd/wgrad.cuh: the wgrad kinds, routed or shared, down or gate/up
using WgradDown = WgradOp<TaskKind::kWgradDown, false, true>;
using WgradGateUp = WgradOp<TaskKind::kWgradGateUp, false, false>;
using SharedWgradDown = WgradOp<TaskKind::kSharedWgradDown, true, true>;
using SharedWgradGateUp = WgradOp<TaskKind::kSharedWgradGateUp, true, false>;
}  // namespace ops
}  // namespace mok::cuda::fused::bwd

namespace mok::cuda::fused {
template <>
struct OpsOf<bwd::TaskKind> {
  using type = OpList<bwd::TaskKind, bwd::ops::Replay, bwd::ops::DgradDown, bwd::ops::DgradGateUp, bwd::ops::WgradDown,
                      bwd::ops::WgradGateUp, bwd::ops::SharedReplay, bwd::ops::SharedDgradDown,
                      bwd::ops::SharedDgradGateUp, bwd::ops::SharedWgradDown, bwd::ops::SharedWgradGateUp>;
};
}  // namespace mok::cuda::fused

namespace mok::cuda::fused::bwd {

// Tiles per unit of work (from the shape and the tile engine).
struct TaskCounts {
  int32_t n_replay;          // ceil(2I / BLOCK_N) tiles per block
  int32_t n_dgrad_down;      // ceil(I / BLOCK_N) tiles per block
  int32_t n_dgrad_gate_up;   // ceil(H / BLOCK_N) tiles per block
  int32_t n_wgrad_down;      // ceil(H / BLOCK_M) * ceil(I / BLOCK_N) tiles per expert and macrobatch
  int32_t n_wgrad_gate_up;   // 2 ceil(I / BLOCK_M) * ceil(H / BLOCK_N) tiles per expert and macrobatch
  int32_t replay_all = 0;    // recompute_forward_context: replay macrobatch 0 too
  // The shared expert (0 tiles: none): per block of BLOCK_M tokens, and its wgrad tiles
  int32_t shared_blocks = 0, n_shared_replay = 0, n_shared_dgrad_down = 0, n_shared_dgrad_gate_up = 0;
  int32_t n_shared_wgrad_down = 0, n_shared_wgrad_gate_up = 0;
  // The forward saved h of every row (the fused backward over resident rows): no replay at all
  int32_t saved_all = 0;
  // Every plan row keeps its own place in the row buffers (the fused backward's layout): no
  // ring slot is reused, so a macrobatch need not drain its readers before the next one
  // starts, and the gathers never wait
  int32_t resident = 0;
  // The order of the tiles (decode_task): N-groups of raster_group N-blocks (0 or 1: row-block-
  // major), and the N-blocks of each wgrad kind's output grid (0: its tiles in index order)
  int32_t raster_group = 0;
  int32_t wgrad_down_n_blocks = 0, wgrad_gate_up_n_blocks = 0;
  int32_t shared_wgrad_down_n_blocks = 0, shared_wgrad_gate_up_n_blocks = 0;
};

// Rows of the call: routed row blocks, the ring, minibatches, and each local expert's blocks
// [expert_begin[e], expert_end[e]) (from the plan's expert_offset / BLOCK_M).
struct Geometry {
  int32_t num_blocks, ring_blocks, minibatch_blocks, num_experts;
  const int32_t* expert_begin;
  const int32_t* expert_end;
  int32_t num_macro, num_mini;

  MOK_HD static Geometry make(int32_t blocks, int32_t ring, int32_t mini, int32_t experts, const int32_t* begin,
                              const int32_t* end) {
    Geometry g{blocks, ring, mini, experts, begin, end, 0, 0};
    g.num_macro = static_cast<int32_t>(plan::ceil_div(blocks, ring));
    g.num_mini = static_cast<int32_t>(plan::ceil_div(blocks, mini));
    return g;
  }
  MOK_HD int32_t macro_of(int32_t b) const { return b / ring_blocks; }
  MOK_HD int32_t previous_occupant(int32_t b) const { return b >= ring_blocks ? b - ring_blocks : -1; }
  MOK_HD int32_t expert_of(int32_t b) const {
    int32_t lo = 0, hi = num_experts - 1;  // the expert whose [begin, end) holds b
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) / 2;
      if (expert_begin[mid] <= b) lo = mid; else hi = mid - 1;
    }
    return lo;
  }
  // Blocks of expert e in macrobatch m: [lo, hi) (empty when lo >= hi).
  MOK_HD int32_t expert_lo(int32_t e, int32_t m) const {
    const int32_t a = expert_begin[e], b = m * ring_blocks;
    return a > b ? a : b;
  }
  MOK_HD int32_t expert_hi(int32_t e, int32_t m) const {
    const int32_t a = expert_end[e], b = (m + 1) * ring_blocks;
    return a < b ? a : b;
  }
  MOK_HD bool expert_in(int32_t e, int32_t m) const { return expert_lo(e, m) < expert_hi(e, m); }
};

// Counter arrays (global memory, zeroed before the launch), each wait "counter >= expected".
enum class CounterArray : int32_t {
  kDyReady = 0,        // [block] dy rows gathered (expected BLOCK_M)
  kXReady = 1,         // [block] x rows gathered again (macrobatches >= 1; expected BLOCK_M)
  kReplayDone = 2,     // [block] replay tiles finished
  kDgradDownDone = 3,  // [block] dgrad-down tiles finished
  kDgradGateUpDone = 4,  // [block] dgrad gate/up tiles finished
  kExpertDgradDone = 5,  // [expert * num_macro + macro] dgrad-down tiles of the expert's blocks in it
  kWgradDone = 6,        // [expert * num_macro + macro] wgrad tiles (both kinds) finished
  kSharedReplayDone = 7,     // [token block] shared replay tiles finished
  kSharedDgradDownDone = 8,  // [token block] shared dgrad-down tiles finished; [shared_blocks]: all of them
  kNumArrays = 9,
};
// The counter layout: the header words (task claim, grid barrier), then each array in the order
// above, as many words as what it is indexed by.  The host fills BackwardParams::counter_offset
// from it and checks its total against the workspace's counter words.
struct CounterSizes {
  int64_t max_blocks;     // row blocks of the largest call
  int64_t expert_macros;  // local experts x macrobatches
  int64_t shared_blocks;  // the shared expert's token blocks
};
MOK_HD int64_t counter_words(CounterArray a, const CounterSizes& s) {
  switch (a) {
    case CounterArray::kExpertDgradDone:
    case CounterArray::kWgradDone: return s.expert_macros;
    case CounterArray::kSharedReplayDone:
    case CounterArray::kSharedDgradDownDone: return s.shared_blocks + 1;  // per token block, and the total
    default: return s.max_blocks;  // per row block
  }
}
inline constexpr int64_t kCounterHeaderWords = 2;
// Where array `a` starts, and (a = kNumArrays) the layout's total words
MOK_HD int64_t counter_offset(CounterArray a, const CounterSizes& s) {
  int64_t at = kCounterHeaderWords;
  for (int i = 0; i < static_cast<int>(a); ++i) at += counter_words(static_cast<CounterArray>(i), s);
  return at;
}

// The arrays' names in timeout messages (cuda/fused/wait_sites.hpp), one per array
inline constexpr const char* kCounterArrayNames[] = {
    "dy_ready",          "x_ready",    "replay_done",        "dgrad_down_done",       "dgrad_gate_up_done",
    "expert_dgrad_done", "wgrad_done", "shared_replay_done", "shared_dgrad_down_done"};
using Wait = CounterWait<CounterArray>;
inline constexpr int kMaxWaits = 3;

MOK_HD bool replays(const Geometry& g, const TaskCounts& c, int32_t b) {
  return !c.saved_all && (c.replay_all || g.macro_of(b) >= 1);
}
MOK_HD int32_t wgrad_tiles(const TaskCounts& c) { return c.n_wgrad_down + c.n_wgrad_gate_up; }

// What a finished tile adds 1 to: (array, index) pairs.  What each kind waits on and signals is
// its op's (ops_bwd/: waits, signals), dispatched by task_waits / task_signals (op_list.cuh),
// which the kernel and the host protocol model of tests/cpp/test_schedule_bwd.cpp both read.
using Signal = CounterSignal<CounterArray>;
inline constexpr int kMaxSignals = 2;

// The rows of one expert that the wgrad tiles of macrobatch m sum over, and what those tiles
// do with the fp32 sum (gemm::kWgradAccumulate / kWgradStoreAcc / kWgradFinal; mode < 0: the
// expert has no rows in m).  The expert's rows are [begin_row, begin_row + real_rows), its
// padded blocks end at end_row; a macrobatch holds ring_rows rows and the call has
// live_macros of them.  An expert without rows sits in the macrobatch of its (empty) range,
// clamped to the last one: one final tile of zeros.  The unfused backward's tables
// (backward.cu) and the fused backward's wgrad tiles both take their K loops from here, so that
// the two sum the same rows in the same pieces.
struct WgradPiece {
  int32_t row0, count, mode;
  int32_t first_macro, last_macro;  // the expert's; first < last: its sum spans macrobatches
};
MOK_HD WgradPiece wgrad_piece(int32_t begin_row, int32_t real_rows, int32_t end_row, int32_t m, int32_t ring_rows,
                              int32_t live_macros) {
  const int32_t first = plan::min64(begin_row / ring_rows, live_macros - 1);
  const int32_t last = end_row > begin_row ? (end_row - 1) / ring_rows : first;
  const int32_t lo = begin_row > m * ring_rows ? begin_row : m * ring_rows;
  if (m < first || m > last) return WgradPiece{lo, 0, -1, first, last};
  const int32_t real_end = begin_row + real_rows, m_end = (m + 1) * ring_rows;
  const int32_t hi = real_end < m_end ? real_end : m_end;
  const int32_t mode = (m > first ? gemm::kWgradAccumulate : 0) | (m < last ? gemm::kWgradStoreAcc : 0) |
                       (m == last ? gemm::kWgradFinal : 0);
  return WgradPiece{lo, hi > lo ? hi - lo : 0, mode, first, last};
}
// Macrobatches that hold rows of a call of total_rows (at least 1).
MOK_HD int32_t live_macros(int32_t total_rows, int32_t ring_rows) {
  return total_rows > 0 ? (total_rows + ring_rows - 1) / ring_rows : 1;
}

// The comm blocks' wait before gathering block b (dy rows, and x rows when it replays): every
// reader of its ring slot's previous occupant finished (dgrad down reads dy and h, dgrad
// gate/up reads dg | du, the wgrad tiles read dy, w·a, dg | du and x).
MOK_HD int gather_waits(int32_t b, const Geometry& g, const TaskCounts& c, Wait* out) {
  const int32_t prev = g.previous_occupant(b);
  if (prev < 0 || c.resident) return 0;
  const int32_t e = g.expert_of(prev);
  out[0] = Wait{CounterArray::kDgradDownDone, prev, c.n_dgrad_down};
  out[1] = Wait{CounterArray::kDgradGateUpDone, prev, c.n_dgrad_gate_up};
  out[2] = Wait{CounterArray::kWgradDone, e * g.num_macro + g.macro_of(prev), wgrad_tiles(c)};
  return 3;
}

// Segment (task_table.cuh) = tiles of one kind over a range of row blocks, or the wgrad tiles
// of a range of experts in one macrobatch (kind kSegmentWgrad: per expert, its wgrad-down tiles
// then its wgrad gate/up tiles; num_n counts both; macro: the macrobatch, -1 for experts without
// rows).
inline constexpr int32_t kSegmentWgrad = 100;

// Most segments a call can need: per minibatch four (replay, dgrad down, the lagged dgrad
// gate/up, the wgrad tiles of the experts whose rows in the macrobatch end in the lagged
// minibatch), the shared expert's five, and the experts without rows before the first row.
MOK_HD int32_t max_segments(const Geometry& g) { return 4 * g.num_mini + 6; }

// Writes the segment table; returns the number of segments (*num_tasks gets the task count).
// O(experts + minibatches): the experts' wgrad ranges come from one sweep.
MOK_HD int build_segments(const Geometry& g, const TaskCounts& c, Segment* seg, int32_t* num_tasks) {
  SegmentWriter out{seg};
  auto mini_range = [&](int32_t p, int32_t* lo, int32_t* hi) {
    *lo = p * g.minibatch_blocks;
    *hi = *lo + g.minibatch_blocks < g.num_blocks ? *lo + g.minibatch_blocks : g.num_blocks;
  };
  // The shared expert, first: replay, dgrad down, dgrad gate/up over its token blocks, its wgrad
  // (a rank without tokens still writes its shared wgrad tiles: zeros)
  out.push(static_cast<int32_t>(TaskKind::kSharedReplay), 0, c.shared_blocks, c.n_shared_replay, 0);
  out.push(static_cast<int32_t>(TaskKind::kSharedDgradDown), 0, c.shared_blocks, c.n_shared_dgrad_down, 0);
  out.push(static_cast<int32_t>(TaskKind::kSharedDgradGateUp), 0, c.shared_blocks, c.n_shared_dgrad_gate_up, 0);
  out.push(static_cast<int32_t>(TaskKind::kSharedWgradDown), 0, 1, c.n_shared_wgrad_down, 0);
  out.push(static_cast<int32_t>(TaskKind::kSharedWgradGateUp), 0, 1, c.n_shared_wgrad_gate_up, 0);
  const int32_t per_expert = wgrad_tiles(c);
  // The experts without rows before the first row (their zero tiles wait on nothing); every
  // later expert without rows goes with the expert before it (decode_task gives it macro -1)
  int32_t e_next = 0;
  while (e_next < g.num_experts && g.expert_end[e_next] <= 0) ++e_next;
  out.push(kSegmentWgrad, 0, e_next, per_expert, -1);
  // The wgrad tiles of the experts whose last block in macrobatch m lies before `hi` (the
  // lagged minibatch's end), from e_next on: a contiguous range.  An expert that continues
  // into the next macrobatch stays next (its rows there are a pair of their own).
  auto wgrad_ending_before = [&](int32_t m, int32_t hi) {
    const int32_t first = e_next;
    int32_t e = e_next;
    bool continues = false;
    while (e < g.num_experts) {
      const bool empty = g.expert_begin[e] >= g.expert_end[e];
      if (!empty && !g.expert_in(e, m)) break;  // its rows start in a later macrobatch
      const int32_t last = empty ? g.expert_begin[e] - 1 : g.expert_hi(e, m) - 1;
      if (last >= hi) break;
      ++e;
      continues = !empty && g.expert_end[e - 1] > (m + 1) * g.ring_blocks;
      if (continues) break;
    }
    out.push(kSegmentWgrad, first, e - first, per_expert, m);
    e_next = continues ? e - 1 : e;
  };
  int32_t lag = -1;  // the minibatch whose dgrad gate/up and wgrad tiles are not emitted yet
  auto flush = [&]() {
    if (lag < 0) return;
    int32_t lo, hi;
    mini_range(lag, &lo, &hi);
    out.push(static_cast<int32_t>(TaskKind::kDgradGateUp), lo, hi - lo, c.n_dgrad_gate_up, 0);
    // The call's last minibatch takes every expert left (those without rows after the last row)
    wgrad_ending_before(g.macro_of(lo), hi == g.num_blocks ? 0x7fffffff : hi);
    lag = -1;
  };
  for (int32_t p = 0; p < g.num_mini; ++p) {
    int32_t lo, hi;
    mini_range(p, &lo, &hi);
    // A new macrobatch overwrites the ring slots of the previous one: its readers first
    if (!c.resident && lag >= 0 && g.macro_of(lag * g.minibatch_blocks) != g.macro_of(lo)) flush();
    if (replays(g, c, lo)) out.push(static_cast<int32_t>(TaskKind::kReplay), lo, hi - lo, c.n_replay, 0);
    out.push(static_cast<int32_t>(TaskKind::kDgradDown), lo, hi - lo, c.n_dgrad_down, 0);
    flush();
    lag = p;
  }
  flush();
  // No rows at all: every expert went with the leading segment above
  *num_tasks = out.task;
  return out.n;
}

// Task index -> (kind, unit, n, macro): the segment by binary search, then the tile in it.  A
// segment of row blocks is walked in N-groups of raster_group N-blocks (gemm::raster, as the
// grouped launches and the forward); a wgrad range expert by expert, each expert's wgrad-down
// tiles then its wgrad gate/up tiles, each output grid in the same raster.  The order only
// permutes tiles within a segment, so every wait still points at earlier segments.
struct TaskTile {
  int32_t kind, unit, n, macro;
};
// Tile `local` of a num_m x num_n grid in the raster, as its index m * num_n + n.
MOK_HD int32_t raster_index(int32_t local, int32_t num_tiles, int32_t num_n, int32_t group) {
  if (group <= 1 || num_n <= 0) return local;
  const gemm::TileCoord tc = gemm::raster(local, num_tiles / num_n, num_n, group);
  return tc.m * num_n + tc.n;
}
MOK_HD TaskTile decode_task(const Segment* seg, int num_segments, int32_t task, const Geometry& g,
                            const TaskCounts& c) {
  const Segment& s = segment_of(seg, num_segments, task);
  const int32_t local = task - s.first_task;
  const TaskKind kind = static_cast<TaskKind>(s.kind);
  if (s.kind != kSegmentWgrad) {
    if (kind == TaskKind::kSharedWgradDown || kind == TaskKind::kSharedWgradGateUp) {
      const int32_t nb = kind == TaskKind::kSharedWgradDown ? c.shared_wgrad_down_n_blocks : c.shared_wgrad_gate_up_n_blocks;
      return TaskTile{s.kind, s.first, raster_index(local, s.num_n, nb, c.raster_group), s.macro};
    }
    if (c.raster_group > 1) {
      const gemm::TileCoord tc = gemm::raster(local, s.count, s.num_n, c.raster_group);
      return TaskTile{s.kind, s.first + tc.m, tc.n, s.macro};
    }
    return TaskTile{s.kind, s.first + local / s.num_n, local % s.num_n, s.macro};
  }
  const int32_t unit = s.first + local / s.num_n, n = local % s.num_n;
  const int32_t macro = g.expert_begin[unit] >= g.expert_end[unit] ? -1 : s.macro;
  if (n < c.n_wgrad_down)
    return TaskTile{static_cast<int32_t>(TaskKind::kWgradDown), unit,
                    raster_index(n, c.n_wgrad_down, c.wgrad_down_n_blocks, c.raster_group), macro};
  return TaskTile{static_cast<int32_t>(TaskKind::kWgradGateUp), unit,
                  raster_index(n - c.n_wgrad_down, c.n_wgrad_gate_up, c.wgrad_gate_up_n_blocks, c.raster_group),
                  macro};
}

}  // namespace mok::cuda::fused::bwd
