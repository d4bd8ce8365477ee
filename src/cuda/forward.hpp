// The CUDA layer at EP=1: device workspace and the forward pipeline.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include <vector>

#include "common/symmetric.hpp"
#include "mok/mok.h"
#include "cuda/cuda_api.hpp"
#include "ref/reference.hpp"

namespace mok::cuda {

// Device buffers of one workspace.  Byte map (docs/design.md, "Workspace"):
//   plan.rows          max_rows x 4        plan.block_expert  max_blocks x 4
//   plan.expert_count  E_l x 4             plan.expert_offset (E_l+1) x 4
//   plan.scratch       chunks*E_l x 4      (chunk bases of the device plan build)
//   ring               ring_rows x H x 2   routed rows gathered from x (ring_rows = min(macrobatch, max_rows))
//   act                ring_rows x I x 2   SwiGLU output of gate/up, the down GEMM's A
//   counters           (2 + 5*max_blocks) x 4   dependency counters of the fused kernel
//   slots              T_max*k x H x 2     one output row per route, slot token*k + j
//   shared_block       ceil(T_max/128) x 4 (zeros: every block of the shared expert is expert 0)
//   shared_act         T_max x I_s x 2     shared_out  T_max x H x 2
//   errors             11 x 8              route error [4] + timeout record [7]
// EP >= 2: slots live in this rank's symmetric region (common/symmetric.hpp has its map);
//   regions_dev        P x 8               the group's region pointers, as this process sees them
//   ep_seq             8                   sequence number of the last call
struct DeviceWorkspace {
  int device = 0;
  int32_t ep_size = 1, ep_rank = 0;
  SymLayout sym;
  std::vector<uint8_t*> regions;   // host copy of regions_dev (EP >= 2)
  uint8_t** regions_dev = nullptr;
  int64_t* ep_seq = nullptr;
  uint64_t fingerprint = 0;        // of the configuration, in the own region's header
  int32_t grid = 0;                // blocks of the persistent kernels (config.num_blocks or SMs)
  int64_t max_rows = 0, max_blocks = 0, shared_blocks = 0, ring_rows = 0;
  int32_t num_sms = 0;
  uint32_t* rows = nullptr;
  int32_t* expert_count = nullptr;
  int32_t* expert_offset = nullptr;
  int32_t* block_expert = nullptr;
  int32_t* shared_block = nullptr;
  void* ring = nullptr;
  void* act = nullptr;
  int32_t* counters = nullptr;
  int64_t num_counters = 0;
  void* unfused_ring = nullptr;    // max_rows x H, allocated on first use of the unfused path
  void* unfused_act = nullptr;     // max_rows x I
  void* slots = nullptr;
  void* shared_act = nullptr;
  void* shared_out = nullptr;
  int64_t* errors = nullptr;       // device: [0,4) route error, [4,9) timeout record
  mokTraceEvent_t* trace = nullptr;  // timing ring (MOK_TRACE=1 at creation)
  int32_t trace_cap = 0;           // events per recorder
  int64_t* host_errors = nullptr;  // pinned copy of `errors` from the last call
  cudaEvent_t errors_ready = nullptr;
  bool pending = false;            // a call's error copy is in flight
  bool captured = false;           // a call was captured into a graph (its copies carry no event)
  size_t bytes = 0;
};

}  // namespace mok::cuda
