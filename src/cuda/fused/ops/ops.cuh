// The fused forward's task ops, in one list (op_list.cuh reads it: visit_op, task_waits,
// task_signals).  Adding an op: its file (the members listed in op.cuh), its TaskKind, its
// place here, and its tiles in the task list (build_segments, ../schedule.cuh).
#pragma once

#include "cuda/fused/ops/down.cuh"
#include "cuda/fused/ops/gate_up.cuh"
#include "cuda/fused/ops/shared_down.cuh"
#include "cuda/fused/ops/shared_gate_up.cuh"

namespace mok::cuda::fused {

// The forward's ops, in the order of their kinds (op_list.cuh: visit_op, task_waits,
// task_signals)
template <>
struct OpsOf<TaskKind> {
  using type = OpList<TaskKind, ops::SharedGateUp, ops::GateUp, ops::SharedDown, ops::Down>;
};

}  // namespace mok::cuda::fused
