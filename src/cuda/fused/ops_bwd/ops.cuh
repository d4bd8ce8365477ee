// The fused backward's task ops, in one list: visit_op, the dispatcher from a task's kind to
// its op.  Adding an op: its file (the members listed in op.cuh), its TaskKind, its line here,
// its waits and signals (task_waits, task_signals) and its tiles in the task list
// (build_segments, ../schedule_bwd.cuh).
#pragma once

#include "cuda/fused/ops_bwd/dgrad.cuh"
#include "cuda/fused/ops_bwd/replay.cuh"
#include "cuda/fused/ops_bwd/wgrad.cuh"

namespace mok::cuda::fused::bwd {

template <class F>
__device__ __forceinline__ decltype(auto) visit_op(TaskKind kind, F&& f) {
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
    default: __builtin_unreachable();
  }
}

}  // namespace mok::cuda::fused::bwd
