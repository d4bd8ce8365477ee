// The fused backward's task ops, in one list (op_list.cuh reads it: visit_op, task_waits,
// task_signals).  Adding an op: its file (the members listed in op.cuh), its TaskKind, its
// place here, and its tiles in the task list (build_segments, ../schedule_bwd.cuh).
#pragma once

#include "cuda/fused/ops_bwd/dgrad.cuh"
#include "cuda/fused/ops_bwd/replay.cuh"
#include "cuda/fused/ops_bwd/wgrad.cuh"

namespace mok::cuda::fused {

// The backward's ops, in the order of their kinds (op_list.cuh: visit_op, task_waits,
// task_signals)
template <>
struct OpsOf<bwd::TaskKind> {
  using type = OpList<bwd::TaskKind, bwd::ops::Replay, bwd::ops::DgradDown, bwd::ops::DgradGateUp, bwd::ops::WgradDown,
                      bwd::ops::WgradGateUp, bwd::ops::SharedReplay, bwd::ops::SharedDgradDown,
                      bwd::ops::SharedDgradGateUp, bwd::ops::SharedWgradDown, bwd::ops::SharedWgradGateUp>;
};

}  // namespace mok::cuda::fused
