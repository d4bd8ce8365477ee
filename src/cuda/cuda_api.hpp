// What the host runtime calls in the CUDA part.  Built from src/cuda/*.cu when nvcc is
// present; src/cuda/no_cuda.cpp stands in otherwise and reports mokNotSupported.
#pragma once

#include <cstdint>

#include "plan/plan.hpp"

namespace mok::cuda {

bool built();

// Builds `out` on `device` from device-resident ids on `stream`, with no host
// synchronisation.  Invalid routes are masked and the first one (lowest key) is written to
// error_record[0..3] (layout in common/defs.hpp).  Throws mok::Error on a CUDA failure.
void build_plan(const plan::PlanDims& dims, const plan::RoutingView& routing, const plan::PlanView& out,
                int64_t* error_record, int device, void* stream);

}  // namespace mok::cuda
