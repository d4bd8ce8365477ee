// EP=1 forward on the GPU, as a sequence of stream-ordered launches with no host sync:
//   plan build -> gather routed rows into the ring -> gate/up GEMM with SwiGLU epilogue ->
//   down GEMM scattering each row to its slot token*k+j -> shared expert (dense) ->
//   fixed-order combine: y[t] = bf16(Σ_j↑ w[t,j]·slot[t,j] + shared[t]).
#include "cuda/forward.hpp"

#include <cuda_bf16.h>

#include <algorithm>
#include <sstream>

#include "cuda/cuda_api.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/gemm/launch.hpp"
#include "plan/plan.hpp"
#include "runtime/layer.hpp"

namespace mok::cuda {
namespace {

constexpr int kRouteErrorWords = kErrorWords;  // [0, 4)
constexpr int kTimeoutWords = 5;               // [4, 9)
constexpr int kAllErrorWords = kRouteErrorWords + kTimeoutWords;

// ---- gather: ring[i] = x[token of plan row i], zeros for padding --------------------------
__global__ void gather_rows_kernel(const uint4* __restrict__ x, const uint32_t* __restrict__ rows,
                                   const int32_t* __restrict__ expert_offset, int32_t num_local, int64_t row_vecs,
                                   uint4* __restrict__ ring) {
  const int64_t total = expert_offset[num_local];
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; i < total; i += warps) {
    const uint32_t rec = rows[i];
    uint4* dst = ring + i * row_vecs;
    if (row_is_pad(rec)) {
      for (int64_t v = lane; v < row_vecs; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
    } else {
      const uint4* src = x + row_token(rec) * row_vecs;
      for (int64_t v = lane; v < row_vecs; v += 32) dst[v] = __ldg(src + v);
    }
  }
}

// ---- combine: one block per token, 8 bf16 (16 B) per thread per step ------------------------
__global__ void combine_kernel(plan::RoutingView v, const float* __restrict__ topk_weights,
                               const uint4* __restrict__ slots, const uint4* __restrict__ shared_out,
                               int64_t row_vecs, uint4* __restrict__ y) {
  __shared__ float weight[kMaxTopK];
  __shared__ int32_t valid[kMaxTopK];
  const int64_t t = blockIdx.x;
  const int k = v.topk;
  if (threadIdx.x < k) {
    int64_t id;
    valid[threadIdx.x] = plan::check_route(v, 0, t, threadIdx.x, &id) == RouteCheck::kOk;
    weight[threadIdx.x] = topk_weights[t * k + threadIdx.x];
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < row_vecs; c += blockDim.x) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < k; ++j) {
      if (!valid[j]) continue;
      const uint4 raw = slots[(t * k + j) * row_vecs + c];
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(h[q]);
        acc[2 * q] = __fmaf_rn(weight[j], f.x, acc[2 * q]);
        acc[2 * q + 1] = __fmaf_rn(weight[j], f.y, acc[2 * q + 1]);
      }
    }
    if (shared_out) {
      const uint4 raw = shared_out[t * row_vecs + c];
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(h[q]);
        acc[2 * q] = __fadd_rn(acc[2 * q], f.x);
        acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], f.y);
      }
    }
    uint4 out;
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int q = 0; q < 4; ++q) o[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
    y[t * row_vecs + c] = out;
  }
}

template <typename T>
T* device_alloc(size_t count, size_t* total) {
  void* p = nullptr;
  const size_t bytes = std::max<size_t>(count, 1) * sizeof(T);
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation)
    MOK_FAIL(mokOutOfMemory, "workspace: cudaMalloc of " << bytes << " bytes failed (out of device memory)");
  MOK_CUDA_CHECK(err);
  *total += bytes;
  return static_cast<T*>(p);
}

}  // namespace

DeviceWorkspace* create_workspace(const mokConfig_t& c) {
  auto* ws = new DeviceWorkspace();
  try {
    ws->device = static_cast<int>(c.device);
    MOK_CUDA_CHECK(cudaSetDevice(ws->device));
    const plan::PlanDims d = plan_dims(c);
    const int64_t El = d.local_experts(), H = c.hidden, I = c.intermediate, Is = c.shared_intermediate;
    ws->max_rows = plan::max_rows(d);
    ws->max_blocks = plan::max_blocks(d);
    ws->shared_blocks = plan::ceil_div(c.max_tokens, gemm::TileConfig::kBlockM);
    size_t& b = ws->bytes;
    ws->rows = device_alloc<uint32_t>(static_cast<size_t>(ws->max_rows), &b);
    ws->expert_count = device_alloc<int32_t>(static_cast<size_t>(El), &b);
    ws->expert_offset = device_alloc<int32_t>(static_cast<size_t>(El + 1), &b);
    ws->block_expert = device_alloc<int32_t>(static_cast<size_t>(ws->max_blocks), &b);
    ws->ring = device_alloc<uint16_t>(static_cast<size_t>(ws->max_rows * H), &b);
    ws->act = device_alloc<uint16_t>(static_cast<size_t>(ws->max_rows * I), &b);
    ws->slots = device_alloc<uint16_t>(static_cast<size_t>(c.max_tokens * c.topk * H), &b);
    if (Is > 0) {
      ws->shared_block = device_alloc<int32_t>(static_cast<size_t>(ws->shared_blocks), &b);
      MOK_CUDA_CHECK(cudaMemset(ws->shared_block, 0, static_cast<size_t>(std::max<int64_t>(ws->shared_blocks, 1)) * 4));
      ws->shared_act = device_alloc<uint16_t>(static_cast<size_t>(c.max_tokens * Is), &b);
      ws->shared_out = device_alloc<uint16_t>(static_cast<size_t>(c.max_tokens * H), &b);
    }
    ws->errors = device_alloc<int64_t>(kAllErrorWords, &b);
    MOK_CUDA_CHECK(cudaMemset(ws->errors, 0, kAllErrorWords * sizeof(int64_t)));
    MOK_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&ws->host_errors), kAllErrorWords * sizeof(int64_t)));
    MOK_CUDA_CHECK(cudaEventCreateWithFlags(&ws->errors_ready, cudaEventDisableTiming));
  } catch (...) {
    destroy_workspace(ws);
    throw;
  }
  return ws;
}

void destroy_workspace(DeviceWorkspace* ws) {
  if (ws == nullptr) return;
  cudaSetDevice(ws->device);
  for (void* p : {static_cast<void*>(ws->rows), static_cast<void*>(ws->expert_count),
                  static_cast<void*>(ws->expert_offset), static_cast<void*>(ws->block_expert),
                  static_cast<void*>(ws->shared_block), ws->ring, ws->act, ws->slots, ws->shared_act, ws->shared_out,
                  static_cast<void*>(ws->errors)})
    if (p) cudaFree(p);
  if (ws->host_errors) cudaFreeHost(ws->host_errors);
  if (ws->errors_ready) cudaEventDestroy(ws->errors_ready);
  delete ws;
}

void check_errors(DeviceWorkspace& ws, int rank, bool wait) {
  if (!ws.pending) return;
  if (wait) MOK_CUDA_CHECK(cudaEventSynchronize(ws.errors_ready));
  const cudaError_t q = cudaEventQuery(ws.errors_ready);
  if (q == cudaErrorNotReady) return;
  MOK_CUDA_CHECK(q);
  ws.pending = false;
  const int64_t* e = ws.host_errors;
  if (e[kRouteErrorWords] != 0) {
    static const char* kSites[] = {"?", "producer waiting for an empty stage", "consumer waiting for a full stage",
                                   "dependency counter"};
    const int64_t site = e[kRouteErrorWords + 1];
    MOK_FAIL(mokTimeout, "rank " << rank << ": a device-side wait passed its deadline: "
                                 << kSites[(site >= 0 && site <= 3) ? site : 0] << ", block " << e[kRouteErrorWords + 2]
                                 << ", stage/phase " << e[kRouteErrorWords + 3] << ", expected "
                                 << e[kRouteErrorWords + 4]);
  }
  if (e[0] != kNoError) {
    const char* kind = e[2] == static_cast<int64_t>(RouteCheck::kDuplicate) ? "duplicates an earlier id of the token"
                                                                              : "is outside [-1, E)";
    MOK_FAIL(mokDeviceInvalidRoute, "rank " << rank << ": device-side validation: topk_ids of rank "
                                            << error_key_rank(e[0]) << " [" << error_key_token(e[0]) << ", "
                                            << error_key_slot(e[0]) << "] = " << e[1] << " " << kind
                                            << " (the route was masked)");
  }
}

size_t workspace_bytes(const DeviceWorkspace* ws) { return ws ? ws->bytes : 0; }

std::string unsupported_shape(const mokConfig_t& c) {
  std::ostringstream why;
  if (c.hidden % 256 != 0)
    why << "hidden = " << c.hidden << " must be a multiple of 256 on the CUDA backend (down GEMM tile N)";
  else if (c.intermediate % 128 != 0)
    why << "intermediate = " << c.intermediate << " must be a multiple of 128 on the CUDA backend";
  else if (c.shared_intermediate % 128 != 0)
    why << "shared_intermediate = " << c.shared_intermediate << " must be a multiple of 128 on the CUDA backend";
  else if (c.block_m != gemm::TileConfig::kBlockM)
    why << "block_m = " << c.block_m << " must be " << gemm::TileConfig::kBlockM << " on the CUDA backend";
  else if (c.ep_size != 1)
    why << "ep_size = " << c.ep_size << ": the multi-GPU CUDA forward is not built yet";
  return why.str();
}

void grouped_gemm(const GroupedGemmCall& call, void* stream) {
  gemm::GroupedGemmArgs g =
      call.swiglu ? gemm::gate_up_args(call.a, call.a_rows, call.k, call.b0, call.b1, call.num_experts, call.n,
                                       call.block_expert, call.num_m_blocks, call.out)
                  : gemm::down_args(call.a, call.a_rows, call.k, call.b0, call.num_experts, call.n, call.block_expert,
                                    call.num_m_blocks, call.out);
  g.num_blocks = call.num_blocks;
  gemm::launch_grouped_gemm(g, static_cast<cudaStream_t>(stream));
}

void forward(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, void* y, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  MOK_CUDA_CHECK(cudaSetDevice(ws.device));
  // Raise what an earlier call recorded, without waiting for it.
  check_errors(ws, static_cast<int>(c.ep_rank), false);
  const int64_t H = c.hidden, I = c.intermediate, Is = c.shared_intermediate, k = c.topk, T = in.num_tokens;
  const plan::PlanDims d = plan_dims(c);
  const int64_t El = d.local_experts();
  MOK_CUDA_CHECK(cudaMemsetAsync(ws.errors + kRouteErrorWords, 0, kTimeoutWords * sizeof(int64_t), stream));

  // Plan build from the device-resident ids
  plan::RoutingView v;
  v.num_ranks = 1;
  v.topk = static_cast<int32_t>(k);
  v.num_experts = c.num_experts;
  v.ids_are_int64 = in.ids_are_int64;
  v.ids[0] = in.topk_ids;
  v.num_tokens[0] = T;
  const plan::PlanView pv{ws.rows, ws.expert_count, ws.expert_offset, ws.block_expert};
  build_plan(d, v, pv, ws.errors, ws.device, stream_ptr);

  // Gather routed rows into the ring
  const int64_t row_vecs = H * 2 / 16;
  if (T > 0) {
    gather_rows_kernel<<<528, 256, 0, stream>>>(static_cast<const uint4*>(static_cast<const void*>(in.x)), ws.rows,
                                                ws.expert_offset, static_cast<int32_t>(El), row_vecs,
                                                static_cast<uint4*>(ws.ring));
    MOK_CUDA_CHECK(cudaGetLastError());
  }
  const int32_t max_blocks = static_cast<int32_t>(ws.max_blocks);
  int64_t* timeout = ws.errors + kRouteErrorWords;

  // Gate/up with SwiGLU, then down scattering to the route slots
  gemm::GroupedGemmArgs gu = gemm::gate_up_args(ws.ring, ws.max_rows, H, in.w_gate, in.w_up, El, I, ws.block_expert,
                                                max_blocks, ws.act);
  gu.timeout_s = c.timeout_s;
  gu.timeout_record = timeout;
  gemm::launch_grouped_gemm(gu, stream);
  gemm::GroupedGemmArgs dn = gemm::down_args(ws.act, ws.max_rows, I, in.w_down, El, H, ws.block_expert, max_blocks,
                                             ws.slots);
  dn.epilogue = static_cast<int32_t>(gemm::Epilogue::kScatter);
  dn.plan_rows = ws.rows;
  dn.topk = static_cast<int32_t>(k);
  dn.timeout_s = c.timeout_s;
  dn.timeout_record = timeout;
  gemm::launch_grouped_gemm(dn, stream);

  // Shared expert: every token, one "expert" over x itself
  if (Is > 0 && T > 0) {
    const int32_t blocks = static_cast<int32_t>(plan::ceil_div(T, gemm::TileConfig::kBlockM));
    gemm::GroupedGemmArgs sg = gemm::gate_up_args(in.x, T, H, in.ws_gate, in.ws_up, 1, Is, ws.shared_block, blocks,
                                                  ws.shared_act);
    sg.timeout_s = c.timeout_s;
    sg.timeout_record = timeout;
    gemm::launch_grouped_gemm(sg, stream);
    gemm::GroupedGemmArgs sd = gemm::down_args(ws.shared_act, T, Is, in.ws_down, 1, H, ws.shared_block, blocks,
                                               ws.shared_out);
    sd.timeout_s = c.timeout_s;
    sd.timeout_record = timeout;
    gemm::launch_grouped_gemm(sd, stream);
  }

  // Fixed-order combine
  if (T > 0) {
    combine_kernel<<<static_cast<unsigned>(T), 128, 0, stream>>>(
        v, in.topk_weights, static_cast<const uint4*>(ws.slots),
        Is > 0 ? static_cast<const uint4*>(ws.shared_out) : nullptr, row_vecs, static_cast<uint4*>(y));
    MOK_CUDA_CHECK(cudaGetLastError());
  }

  // Error words to pinned memory; read at the next call or at check_errors(wait)
  MOK_CUDA_CHECK(cudaMemcpyAsync(ws.host_errors, ws.errors, kAllErrorWords * sizeof(int64_t), cudaMemcpyDeviceToHost,
                                 stream));
  MOK_CUDA_CHECK(cudaEventRecord(ws.errors_ready, stream));
  ws.pending = true;
}

}  // namespace mok::cuda
