// The runtime knobs that both fused kernels' roles read (src/runtime/env.hpp): parsed once per
// launch into either direction's parameters.
#pragma once

#include <string>

#include "runtime/env.hpp"
#include "runtime/errors.hpp"

namespace mok::cuda::fused {

// MOK_CONSUMER_SYNC -> p.consumer_lockstep, MOK_TENSORMAP_PREFETCH -> p.tensormap_prefetch.
template <class Params>
void set_engine_knobs(Params& p) {
  const std::string consumer_sync = env::get(env::kConsumerSync);
  MOK_CHECK_ARG(consumer_sync == "warpgroup" || consumer_sync == "tile",
                env::kConsumerSync.name << " = " << consumer_sync << ": expected warpgroup or tile");
  p.consumer_lockstep = consumer_sync == "tile" ? 1 : 0;
  const std::string prefetch = env::get(env::kTensormapPrefetch);
  MOK_CHECK_ARG(prefetch == "none" || prefetch == "start",
                env::kTensormapPrefetch.name << " = " << prefetch << ": expected none or start");
  p.tensormap_prefetch = prefetch == "start" ? 1 : 0;
}

}  // namespace mok::cuda::fused
