// The fused backward's task ops: every op file (the members listed in op.cuh).  Their list, in
// the order of their kinds, is beside the kinds (OpsOf<TaskKind>, ../schedule_bwd.cuh).
#pragma once

#include "cuda/fused/ops_bwd/dgrad.cuh"
#include "cuda/fused/ops_bwd/replay.cuh"
#include "cuda/fused/ops_bwd/wgrad.cuh"
