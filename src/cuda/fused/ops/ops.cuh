// The fused forward's task ops: every op file (the members listed in op.cuh).  Their list, in
// the order of their kinds, is beside the kinds (OpsOf<TaskKind>, ../schedule.cuh).
#pragma once

#include "cuda/fused/ops/down.cuh"
#include "cuda/fused/ops/gate_up.cuh"
#include "cuda/fused/ops/shared_down.cuh"
#include "cuda/fused/ops/shared_gate_up.cuh"
