// EP >= 2, host side of a call's start (src/cuda/ep.cu).
#pragma once

#include <cuda_runtime.h>

#include "cuda/comm/ep.cuh"
#include "mok/mok.h"
#include "plan/plan.hpp"
#include "ref/reference.hpp"

namespace mok::cuda {

struct DeviceWorkspace;

ep::Group ep_group(const DeviceWorkspace& ws);
// What every rank's configuration must agree on, hashed (written into the region header).
uint64_t ep_fingerprint(const mokConfig_t& c);
// x copy, routing exchange, start barrier: stream-ordered, no host synchronisation.
// dy (the backward): dy and topk_weights are published too, and the d topk_weights slots zeroed.
void ep_start(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, int64_t* timeout_record,
              cudaStream_t stream, const void* dy = nullptr);
// The end barrier of a call made of separate launches: every rank's pushes landed.
void ep_end(DeviceWorkspace& ws, const mokConfig_t& c, int64_t* timeout_record, cudaStream_t stream);
// The routing of the whole group as this rank's region holds it (T_s read on the device).
plan::RoutingView ep_routing(const DeviceWorkspace& ws, const mokConfig_t& c);
// Loads the EP kernels (lazy module loading: backward.cu, prepare_backward).
void ep_load_kernels();

}  // namespace mok::cuda
