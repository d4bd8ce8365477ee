// The fused backward's task ops, in one list: visit_op, the dispatcher from a task's kind to
// its op, and the descriptions the schedule shares with the host (task_waits, task_signals).
// Adding an op: its file (the members listed in op.cuh), its TaskKind, its line here, and its
// tiles in the task list (build_segments, ../schedule_bwd.cuh).
#pragma once

#include "cuda/fused/ops_bwd/dgrad.cuh"
#include "cuda/fused/ops_bwd/replay.cuh"
#include "cuda/fused/ops_bwd/wgrad.cuh"

namespace mok::cuda::fused::bwd {

// f(Op{}) for the op of `kind`; otherwise() for kDone (and any other value).
template <class F, class Otherwise>
MOK_HD decltype(auto) visit_op(TaskKind kind, F&& f, Otherwise&& otherwise) {
  switch (kind) {
    case TaskKind::kSharedReplay: return f(ops::SharedReplay{});
    case TaskKind::kSharedDgradDown: return f(ops::SharedDgradDown{});
    case TaskKind::kSharedDgradGateUp: return f(ops::SharedDgradGateUp{});
    case TaskKind::kSharedWgradDown: return f(ops::SharedWgradDown{});
    case TaskKind::kSharedWgradGateUp: return f(ops::SharedWgradGateUp{});
    case TaskKind::kReplay: return f(ops::Replay{});
    case TaskKind::kDgradDown: return f(ops::DgradDown{});
    case TaskKind::kDgradGateUp: return f(ops::DgradGateUp{});
    case TaskKind::kWgradDown: return f(ops::WgradDown{});
    case TaskKind::kWgradGateUp: return f(ops::WgradGateUp{});
    default: return otherwise();
  }
}
// The same where `kind` is an op: the roles leave at kDone before they dispatch.
template <class F>
MOK_HD decltype(auto) visit_op(TaskKind kind, F&& f) {
  return visit_op(kind, f, []() -> decltype(f(ops::Replay{})) { __builtin_unreachable(); });
}

// What a task waits on (`unit`: its row block, token block or expert; `macro`: a wgrad tile's
// macrobatch, -1 for an expert without rows): its op's waits, the one description of the
// dependencies (the producer, and the host model in tests/cpp/test_schedule_bwd.cpp).
MOK_HD int task_waits(TaskKind kind, int32_t unit, int32_t macro, const Geometry& g, const TaskCounts& c, Wait* out) {
  return visit_op(kind, [=](auto op) { return decltype(op)::waits(unit, macro, g, c, out); }, [] { return 0; });
}
// The counters a finished tile of `kind` adds 1 to (the signaler, and the host model).
MOK_HD int task_signals(TaskKind kind, int32_t unit, int32_t macro, const Geometry& g, const TaskCounts& c,
                        Signal* out) {
  return visit_op(kind, [=](auto op) { return decltype(op)::signals(unit, macro, g, c, out); }, [] { return 0; });
}

}  // namespace mok::cuda::fused::bwd
