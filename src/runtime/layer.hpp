// Host-side checks of a layer call and the workspace.  Everything here runs before any
// launch; a failing check leaves the workspace as it was.
#pragma once

#include <string>
#include <vector>

#include "mok/mok.h"
#include "plan/plan.hpp"
#include "ref/reference.hpp"

namespace mok {

// Throws mokInvalidArgument naming the bad field.  Config structs from newer or older
// callers are accepted by `size`/`version` (fields past the caller's size keep defaults).
mokConfig_t normalize_config(const mokConfig_t* config);
// The shape and grid the minibatch rule reads (plan::resolve_batch_sizes).
plan::BatchRule batch_rule(const mokConfig_t& config);
void check_config(const mokConfig_t& config);
plan::PlanDims plan_dims(const mokConfig_t& config);
ref::LayerDims layer_dims(const mokConfig_t& config);
std::string describe_buffers(const mokConfig_t& config);

// Validates one rank's forward arguments (shapes, dtypes, devices, strides; on host memory
// also every id) and returns typed views.  `rank_tag` prefixes messages ("" or "rank 2: ").
ref::RankInputs check_forward_args(const mokConfig_t& config, const mokForwardArgs_t& args,
                                   int32_t device, const std::string& rank_tag, bool check_y);
ref::RankGrads check_backward_args(const mokConfig_t& config, const mokBackwardArgs_t& args,
                                   int32_t device, const std::string& rank_tag);

// Host check of ids: out of [-1, E) or a duplicate within a token.
void check_ids_host(const plan::RoutingView& routing, int rank, const std::string& rank_tag);

namespace cuda {
struct DeviceWorkspace;
}

struct Workspace {
  mokConfig_t config;
  std::string description;
  cuda::DeviceWorkspace* device = nullptr;  // CUDA buffers when config.device >= 0
};

}  // namespace mok
