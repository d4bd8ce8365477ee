// The fused forward's task ops, in one list: visit_op, the dispatcher from a task's kind to
// its op, and the op descriptions the schedule shares with the host (task_waits, task_signals).
// Adding an op: its file (the members listed in op.cuh), its TaskKind, its line in visit_op,
// and its tiles in the task list (build_segments, ../schedule.cuh).
#pragma once

#include "cuda/fused/ops/down.cuh"
#include "cuda/fused/ops/gate_up.cuh"
#include "cuda/fused/ops/shared_down.cuh"
#include "cuda/fused/ops/shared_gate_up.cuh"

namespace mok::cuda::fused {

// f(Op{}) for the op of `kind`; otherwise() for kDone (and any other value).
// NOTES: one switch, inlined into each role: the role's code over the ops is the branch on
// the kind its per-kind code was.  Role lambdas take the role's locals by copy (references
// only to parameters and outputs): a local captured by reference has its address taken, and
// the PTX moves its registers differently.
template <class F, class Otherwise>
MOK_HD decltype(auto) visit_op(TaskKind kind, F&& f, Otherwise&& otherwise) {
  switch (kind) {
    case TaskKind::kSharedGateUp: return f(ops::SharedGateUp{});
    case TaskKind::kGateUp: return f(ops::GateUp{});
    case TaskKind::kSharedDown: return f(ops::SharedDown{});
    case TaskKind::kDown: return f(ops::Down{});
    default: return otherwise();
  }
}
// The same where `kind` is an op: the roles leave at kDone before they dispatch, and the
// decode makes no other value.
template <class F>
MOK_HD decltype(auto) visit_op(TaskKind kind, F&& f) {
  return visit_op(kind, f, []() -> decltype(f(ops::GateUp{})) { __builtin_unreachable(); });
}

// What a tile of `kind` over row block `block` waits on: its op's waits, the one description
// of the dependencies (the producer, and the host model in tests/cpp/test_schedule.cpp).
MOK_HD int task_waits(TaskKind kind, int32_t block, const Geometry& g, const TaskCounts& c, Wait* out) {
  return visit_op(kind, [=](auto op) { return decltype(op)::waits(block, g, c, out); }, [] { return 0; });
}

// The counter array a finished tile of `kind` adds 1 to at its row block (kNone: none).
MOK_HD CounterArray task_signals(TaskKind kind) {
  return visit_op(kind, [](auto op) { return decltype(op)::kSignals; }, [] { return CounterArray::kNone; });
}

}  // namespace mok::cuda::fused
