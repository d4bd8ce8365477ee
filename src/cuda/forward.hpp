// The CUDA layer at EP=1: device workspace and the forward pipeline.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include <vector>

#include "common/symmetric.hpp"
#include "common/workspace_layout.hpp"
#include "mok/mok.h"
#include "cuda/cuda_api.hpp"
#include "cuda/gemm/launch.hpp"
#include "cuda/gemm/tensor_map.hpp"
#include "ref/reference.hpp"

namespace mok::cuda {

struct BackwardBuffers;

// Device buffers of one workspace.  The byte map is code: common/workspace_layout.hpp
// (WorkspaceLayout: every buffer with its formula, offset and bytes; docs/design.md,
// "Workspace byte map (CUDA)").  create_workspace makes ONE allocation of
// layout.total_bytes() and sets the pointers below from layout.get<...>(base); EP >= 2:
// slots come from this rank's symmetric region (common/symmetric.hpp).  Kept separate:
// host_errors (pinned host), unfused_ring/act (first unfused call), trace (MOK_TRACE=1).
struct DeviceWorkspace {
  int device = 0;
  int32_t ep_size = 1, ep_rank = 0;
  WorkspaceLayout layout;          // of this workspace's config (with_backward = false)
  uint8_t* block = nullptr;        // the one cudaMalloc (layout.total_bytes() + alignment slack)
  uint8_t* base = nullptr;         // block rounded up to 1 KB: the layout's offsets start here
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
  // fp8_block's buffers (WsBuffer::kFp8Buffers: one allocation at its first forward), e4m3 rows
  // and their fp32 scales, parts as fp8_buffer_parts lays them out
  uint8_t* fp8_block = nullptr;
  // fp8_block's backward buffers (one allocation at its first backward, fp8_bwd_parts)
  uint8_t* fp8_bwd = nullptr;
  void* slots = nullptr;
  void* shared_act = nullptr;
  void* shared_out = nullptr;
  int64_t* errors = nullptr;       // device: [0,4) route error, [4,11) timeout record
  mokTraceEvent_t* trace = nullptr;  // timing ring (MOK_TRACE=1 at creation)
  int32_t trace_cap = 0;           // events per recorder
  int64_t* host_errors = nullptr;  // pinned copy of `errors` from the last call
  cudaEvent_t errors_ready = nullptr;
  bool pending = false;            // a call's error copy is in flight
  bool captured = false;           // a call was captured into a graph (its copies carry no event)
  size_t bytes = 0;
  BackwardBuffers* bwd = nullptr;  // the backward's buffers, at its first call (backward.cu)
};

// The six weights of `in` in place, as stacks of matrices for their tensor maps (a shared
// weight is a stack of one; absent ones have no base).
// Column-major weights (transposed) are the row-major stacks they are stored as: transposed
// says so for the routed three (one orientation, checked by the runtime).
struct WeightStacks {
  gemm::MatrixStack w_gate, w_up, w_down, ws_gate, ws_up, ws_down;
  bool transposed;
};
WeightStacks weight_stacks(const mokConfig_t& c, const ref::RankInputs& in);
// The routed B operand of a grouped-GEMM launch in place (its strides: gate and up share them).
void set_b_strides(gemm::GroupedGemmArgs& g, const ref::MatrixStrides& s);

// The routing of this call (EP = 1: its ids; EP >= 2: the group's, in the own region).
plan::RoutingView routing_of(const DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in);
void destroy_backward_buffers(BackwardBuffers* b);
// fp8_block: the plan's rows (rows, expert_offset[num_local] of them) gathered from q [T, hidden]
// e4m3 quantised once per token (scales [hidden/128, q_scales_ld]) into ring [.., hidden] and
// scales [hidden/128, scales_ld]; a padding row is zeros with scale 1 (forward.cu)
void launch_gather_e4m3_rows(const void* q, const float* q_scales, int64_t q_scales_ld, const uint32_t* rows,
                             const int32_t* expert_offset, int32_t num_local, int64_t hidden, void* ring,
                             float* scales, int64_t scales_ld, cudaStream_t stream);
// The phases every call shares (forward.cu): the error check and reset, EP >= 2 publication,
// routing exchange and start barrier (dy: the backward's); the plan build.
bool stream_capturing(void* stream);
// The end of every call: the error words' copy to pinned memory (and the pending/captured mark).
void call_finish(DeviceWorkspace& ws, cudaStream_t stream, bool capturing);
// The timing ring, zeroed before a fused launch that records into it (MOK_TRACE=1).
void clear_trace(const DeviceWorkspace& ws, cudaStream_t stream);
void call_start(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, void* stream, bool capturing,
                const void* dy);
void call_plan(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, void* stream);

}  // namespace mok::cuda
