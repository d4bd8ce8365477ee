// The task list of the fused forward: data computed on the device from the plan's row count.
//
// Processing order.  Row blocks (BLOCK_M rows) form minibatches (minibatch_size rows) and
// macrobatches (macrobatch_size rows = the ring).  Macrobatches are walked last to first,
// minibatches within a macrobatch in ascending order, so when the call ends the ring holds
// macrobatch 0.  Block b lives in ring slot b % ring_blocks; the previous occupant of that
// slot is block b + ring_blocks (the same slot of the macrobatch processed just before).
//
// Task list (compute blocks claim task indices in increasing order from a global counter;
// every task waits only on lower-numbered tasks or on the comm blocks, so a waited-on task
// has always been claimed by a running block):
//   [shared gate/up tiles]  [routed gate/up of minibatch p0]  [shared down tiles]
//   [routed gate/up p1] [routed down p0]  [gate/up p2] [down p1] ...  [down p_last]
// Down tiles lag gate/up by one minibatch, except that the down tiles of a ring slot's
// previous occupant always come before the gate/up tiles that overwrite its act rows.
// Segment (task_table.cuh) = tiles of one kind over a range of row blocks, walked m-major.
#pragma once

#include <cstdint>

#include "cuda/fused/op_list.cuh"
#include "cuda/fused/task_table.cuh"
#include "cuda/fused/tile_sizes.cuh"
#include "cuda/gemm/config.hpp"
#include "plan/plan.hpp"

namespace mok::cuda::fused {

// The kinds of the task list: each but kDone is an op (ops/: what its tiles load, compute,
// wait on and signal).
enum class TaskKind : int32_t {
  kSharedGateUp = 0,  // x · [ws_gate; ws_up]ᵀ -> SwiGLU -> shared_act
  kGateUp = 1,        // ring · [w_gate; w_up]ᵀ -> SwiGLU -> act ring
  kSharedDown = 2,    // shared_act · ws_downᵀ -> shared_out
  kDown = 3,          // act ring · w_downᵀ -> route slots token*k + j
  kDone = 4,          // no more tasks (producer -> consumers)
};

// The ops of the kinds (ops/: one file each), listed here in the order of the kinds (op_list.cuh
// reads the list: visit_op, task_waits, task_signals)
namespace ops {
struct SharedGateUp;
struct GateUp;
struct SharedDown;
struct Down;
}  // namespace ops
template <>
struct OpsOf<TaskKind> {
  using type = OpList<TaskKind, ops::SharedGateUp, ops::GateUp, ops::SharedDown, ops::Down>;
};

// Two segments per minibatch (its gate/up and down tiles) plus the shared expert's two.
inline constexpr int kMaxSegments = 2 * static_cast<int>(plan::kMaxMinibatches) + 2;

// Geometry of the routed rows of this call.
struct Geometry {
  int32_t num_blocks;        // row blocks with routed rows (plan total / BLOCK_M)
  int32_t ring_blocks;       // macrobatch_size / BLOCK_M
  int32_t minibatch_blocks;  // minibatch_size / BLOCK_M
  int32_t num_macro;
  int32_t num_mini;

  MOK_HD static Geometry make(int32_t num_blocks, int32_t ring_blocks, int32_t minibatch_blocks) {
    Geometry g{num_blocks, ring_blocks, minibatch_blocks, 0, 0};
    g.num_macro = static_cast<int32_t>(plan::ceil_div(num_blocks, ring_blocks));
    g.num_mini = static_cast<int32_t>(plan::ceil_div(num_blocks, minibatch_blocks));
    return g;
  }
  // Global row block at position q of the processing order.
  MOK_HD int32_t block_at(int32_t q) const {
    const int32_t last_first = (num_macro - 1) * ring_blocks, last_count = num_blocks - last_first;
    if (q < last_count) return last_first + q;
    q -= last_count;
    const int32_t macro = num_macro - 2 - q / ring_blocks;
    return macro * ring_blocks + q % ring_blocks;
  }
  // Minibatch at position p of the processing order.
  MOK_HD int32_t minibatch_at(int32_t p) const {
    const int32_t per_macro = ring_blocks / minibatch_blocks;
    const int32_t last_first = (num_macro - 1) * per_macro, last_count = num_mini - last_first;
    if (p < last_count) return last_first + p;
    p -= last_count;
    const int32_t macro = num_macro - 2 - p / per_macro;
    return macro * per_macro + p % per_macro;
  }
  // Position of minibatch m in the processing order (inverse of minibatch_at).
  MOK_HD int32_t position_of(int32_t m) const {
    const int32_t per_macro = ring_blocks / minibatch_blocks;
    const int32_t macro = m / per_macro, last_first = (num_macro - 1) * per_macro;
    if (macro == num_macro - 1) return m - last_first;
    return (num_mini - last_first) + (num_macro - 2 - macro) * per_macro + m % per_macro;
  }
  MOK_HD int32_t ring_row(int32_t block) const { return (block % ring_blocks) * kBlockM; }
  MOK_HD int32_t previous_occupant(int32_t block) const {
    return block + ring_blocks < num_blocks ? block + ring_blocks : -1;
  }
};

struct TaskCounts {
  int32_t n_gate_up;         // ceil(I / (BLOCK_N / 2))
  int32_t n_down;            // ceil(H / BLOCK_N)
  int32_t n_shared_gate_up;  // ceil(I_s / (BLOCK_N / 2)) (0 = no shared expert)
  int32_t n_shared_down;     // ceil(H / BLOCK_N)
  int32_t shared_blocks;     // ceil(T / BLOCK_M)
};

// What a task (or a comm block's row block) waits for: counter arrays in global memory,
// each wait "counter[index] >= expected".  The one description of the dependencies, used
// by the kernel and by the host model test of the protocol (tests/cpp/test_schedule.cpp):
// a task's waits and the counters its tiles add to are its op's (ops/, through task_waits and
// task_signals of op_list.cuh), the comm blocks' are below.
enum class CounterArray : int32_t {
  kGatherReady = 0,  // rows of block b in the ring (expected BLOCK_M)
  kGateUpDone = 1,   // gate/up tiles of block b done
  kDownDone = 2,     // down tiles of block b done
  kSharedGateUpDone = 3,
  kNumArrays = 4,
  kNone = -1,        // no counter (an op whose tiles nothing waits on)
};
// The arrays' names in timeout messages (cuda/fused/wait_sites.hpp), one per array
inline constexpr const char* kCounterArrayNames[] = {"gather_ready", "gu_done", "dn_done", "sgu_done"};
using Wait = CounterWait<CounterArray>;
using Signal = CounterSignal<CounterArray>;
inline constexpr int kMaxWaits = 2, kMaxSignals = 1;

// The comm blocks' wait before gathering block b: the ring rows' previous occupant read by
// all its gate/up tiles.
MOK_HD int gather_waits(int32_t block, const Geometry& g, const TaskCounts& c, Wait* out) {
  const int32_t prev = g.previous_occupant(block);
  if (prev < 0) return 0;
  out[0] = Wait{CounterArray::kGateUpDone, prev, c.n_gate_up};
  return 1;
}

// Writes the segment table; returns the number of segments (the total task count goes to
// *num_tasks).  Identical on every block (and on the host).
MOK_HD int build_segments(const Geometry& g, const TaskCounts& c, Segment* seg, int32_t* num_tasks) {
  SegmentWriter out{seg};
  auto push = [&](TaskKind kind, int32_t first, int32_t count, int32_t num_n) {
    out.push(static_cast<int32_t>(kind), first, count, num_n);
  };
  auto mini_push = [&](TaskKind kind, int32_t p, int32_t num_n) {
    const int32_t m = g.minibatch_at(p);
    const int32_t first = m * g.minibatch_blocks;
    const int32_t count = (first + g.minibatch_blocks <= g.num_blocks) ? g.minibatch_blocks : g.num_blocks - first;
    push(kind, first, count, num_n);
  };
  const bool shared = c.n_shared_gate_up > 0 && c.shared_blocks > 0;
  if (shared) push(TaskKind::kSharedGateUp, 0, c.shared_blocks, c.n_shared_gate_up);
  if (g.num_mini == 0 && shared) push(TaskKind::kSharedDown, 0, c.shared_blocks, c.n_shared_down);
  const int32_t per_macro = g.ring_blocks / g.minibatch_blocks;
  int32_t next_down = 0;  // first position whose down tiles are not emitted yet
  for (int32_t s = 0; s < g.num_mini; ++s) {
    // Down tiles of the previous occupant of this minibatch's ring slots come first
    const int32_t prev_mini = g.minibatch_at(s) + per_macro;
    const int32_t must = prev_mini < g.num_mini ? g.position_of(prev_mini) : -1;
    for (; next_down <= must; ++next_down) mini_push(TaskKind::kDown, next_down, c.n_down);
    mini_push(TaskKind::kGateUp, s, c.n_gate_up);
    if (s == 0 && shared) push(TaskKind::kSharedDown, 0, c.shared_blocks, c.n_shared_down);
    // Then down tiles one minibatch behind
    for (; next_down < s; ++next_down) mini_push(TaskKind::kDown, next_down, c.n_down);
  }
  for (; next_down < g.num_mini; ++next_down) mini_push(TaskKind::kDown, next_down, c.n_down);
  *num_tasks = out.task;
  return out.n;
}

// Task index -> (kind, row block, N-block): the segment by binary search, the tile inside it
// by the N-grouped raster.
struct TaskTile {
  int32_t kind;
  int32_t block;
  int32_t n_block;
};
MOK_HD TaskTile decode_task(const Segment* seg, int num_segments, int32_t n_group, int32_t task) {
  const Segment& s = segment_of(seg, num_segments, task);
  const gemm::TileCoord tc = gemm::raster(task - s.first_task, s.count, s.num_n, n_group);
  return TaskTile{s.kind, s.first + tc.m, tc.n};
}

}  // namespace mok::cuda::fused
