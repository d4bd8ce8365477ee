// The forward on the GPU, as a sequence of stream-ordered launches with no host sync:
//   [EP >= 2: x into the symmetric region, routing exchange, start barrier (ep.cu)] ->
//   plan build -> the fused megakernel (or, MOK_FORWARD_PATH=unfused at EP = 1, separate
//   launches: gather -> gate/up GEMM with SwiGLU -> down GEMM scattering each row to its
//   slot token*k+j -> shared expert -> combine), whose combine is
//   y[t] = bf16(Σ_j↑ w[t,j]·slot[t,j] + shared[t]).
#include "cuda/forward.hpp"

#include <cuda_bf16.h>

#include <algorithm>
#include <sstream>

#include "cuda/cuda_api.hpp"
#include "cuda/comm/combine.cuh"
#include "cuda/comm/plan_rows.cuh"
#include "cuda/cuda_check.hpp"
#include "cuda/ep.hpp"
#include "cuda/fused/forward_kernel.cuh"
#include "cuda/fused/wait_sites.hpp"
#include "cuda/gemm/launch.hpp"
#include "cuda/gemm/quantize.cuh"
#include "cuda/gemm/tensor_map.hpp"
#include "plan/plan.hpp"
#include "runtime/env.hpp"
#include "runtime/layer.hpp"

namespace mok::cuda {
// The timing ring, zeroed before a fused launch that records into it (MOK_TRACE=1).
void clear_trace(const DeviceWorkspace& ws, cudaStream_t stream) {
  if (!ws.trace) return;
  MOK_CUDA_CHECK(cudaMemsetAsync(
      ws.trace, 0, static_cast<size_t>(ws.num_sms) * MOK_TRACE_RECORDERS * ws.trace_cap * sizeof(mokTraceEvent_t),
      stream));
}

// The end of every call: its error words to pinned memory, read at the next call or at
// check_errors(wait) (a captured call's copy lands at each replay).
void call_finish(DeviceWorkspace& ws, cudaStream_t stream, bool capturing) {
  MOK_CUDA_CHECK(cudaMemcpyAsync(ws.host_errors, ws.errors, kWsErrorWords * sizeof(int64_t), cudaMemcpyDeviceToHost,
                                 stream));
  if (capturing) {
    ws.captured = true;
  } else {
    MOK_CUDA_CHECK(cudaEventRecord(ws.errors_ready, stream));
    ws.pending = true;
  }
}

namespace {

constexpr int kRouteErrorWords = kErrorWords;        // [0, 4)
constexpr int kTimeoutWords = gemm::kTimeoutWords;   // [4, 11)
constexpr int kAllErrorWords = kRouteErrorWords + kTimeoutWords;

// ---- gather: ring[i] = x[token of plan row i], zeros for padding --------------------------
__global__ void gather_rows_kernel(const uint4* __restrict__ x, const uint32_t* __restrict__ rows,
                                   const int32_t* __restrict__ expert_offset, int32_t num_local, int64_t row_vecs,
                                   uint4* __restrict__ ring) {
  for_each_plan_row(rows, expert_offset, num_local, [&](int64_t i, uint32_t rec, int lane) {
    uint4* dst = ring + i * row_vecs;
    if (row_is_pad(rec)) {
      for (int64_t v = lane; v < row_vecs; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
    } else {
      const uint4* src = x + row_token(rec) * row_vecs;
      for (int64_t v = lane; v < row_vecs; v += 32) dst[v] = __ldg(src + v);
    }
  });
}

// fp8_block: the plan's rows of x gathered from x quantised once per token (q [T, H] e4m3, its
// scales [H/128, q_scales_ld]): ring [max_rows, H] e4m3, scales [H/128, scales_ld]; a padding row
// is zeros with scale 1.  One warp a row, 16 bytes a lane.
__global__ void gather_e4m3_rows_kernel(const uint4* __restrict__ q, const float* __restrict__ q_scales,
                                        int64_t q_scales_ld, const uint32_t* __restrict__ rows,
                                        const int32_t* __restrict__ expert_offset, int32_t num_local,
                                        int64_t hidden, uint4* __restrict__ ring, float* __restrict__ scales,
                                        int64_t scales_ld) {
  const int64_t row_vecs = hidden / 16;
  for_each_plan_row(rows, expert_offset, num_local, [&](int64_t i, uint32_t rec, int lane) {
    uint4* dst = ring + i * row_vecs;
    if (row_is_pad(rec)) {
      for (int64_t v = lane; v < row_vecs; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
      for (int64_t kb = lane; kb < hidden / 128; kb += 32) scales[kb * scales_ld + i] = 1.0f;
    } else {
      const int64_t t = row_token(rec);
      const uint4* src = q + t * row_vecs;
      // four loads a lane in flight before their stores
      for (int64_t v0 = lane; v0 < row_vecs; v0 += 4 * 32) {
        uint4 piece[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (v0 + u * 32 < row_vecs) piece[u] = __ldg(src + v0 + u * 32);
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (v0 + u * 32 < row_vecs) dst[v0 + u * 32] = piece[u];
      }
      for (int64_t kb = lane; kb < hidden / 128; kb += 32) scales[kb * scales_ld + i] = __ldg(q_scales + kb * q_scales_ld + t);
    }
  });
}

}  // namespace

void launch_gather_e4m3_rows(const void* q, const float* q_scales, int64_t q_scales_ld, const uint32_t* rows,
                             const int32_t* expert_offset, int32_t num_local, int64_t hidden, void* ring,
                             float* scales, int64_t scales_ld, cudaStream_t stream) {
  gather_e4m3_rows_kernel<<<528, 256, 0, stream>>>(static_cast<const uint4*>(q), q_scales, q_scales_ld, rows,
                                                   expert_offset, num_local, hidden, static_cast<uint4*>(ring),
                                                   scales, scales_ld);
  MOK_CUDA_CHECK(cudaGetLastError());
}

namespace {

// ---- combine: one warp per token (combine_token_warp), 4 warps per block -------------------------
__global__ void combine_kernel(plan::RoutingView v, const float* __restrict__ topk_weights,
                               const uint4* __restrict__ slots, const uint4* __restrict__ shared_out,
                               int64_t row_vecs, uint4* __restrict__ y) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * 4 + threadIdx.x / 32;
  if (t >= v.num_tokens[0]) return;  // warp-uniform
  const int k = v.topk;
  combine_token_warp(slots + t * k * row_vecs, row_vecs, k, topk_weights + t * k,
                     shared_out ? shared_out + t * row_vecs : nullptr, y + t * row_vecs, [&](int j) {
                       int64_t id;
                       return plan::check_route(v, 0, t, j, &id) == RouteCheck::kOk;
                     });
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

// fp8_block's forward buffers (e4m3 rows and their scales, fp8_buffer_parts), allocated at the
// first fp8 call
uint8_t* fp8_buffers(DeviceWorkspace& ws, const Fp8BufferParts& parts) {
  if (ws.fp8_block == nullptr) {
    size_t unused = 0;
    ws.fp8_block = device_alloc<uint8_t>(static_cast<size_t>(parts.total), &unused);
  }
  return ws.fp8_block;
}

// fp8_block (docs/precision.md): the layer's forward as launches, the unfused path's sequence
// in e4m3 with block scales: x quantised once, the plan's rows gathered in e4m3, gate/up writing a in
// e4m3 with its scales (128 x 256 tiles: a tile's gate half is one scale block), down
// scattering bf16 rows to the route slots; the shared expert on x quantised once; the bf16
// combine.  The weights are the caller's e4m3 copies (in.fp8_*: w_gate, w_up, w_down, ws_gate,
// ws_up, ws_down).  EP = 1.
void forward_fp8(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, const plan::RoutingView& v,
                 void* y, cudaStream_t stream, const Saved& save) {
  const int64_t H = c.hidden, I = c.intermediate, Is = c.shared_intermediate, k = c.topk, T = in.num_tokens;
  const int64_t El = plan_dims(c).local_experts();
  const bool pow2 = c.fp8_pow2_scales != 0;
  const Fp8BufferParts parts = fp8_buffer_parts(ws.max_rows, H, I, c.max_tokens, Is);
  uint8_t* const b = fp8_buffers(ws, parts);
  auto scales_at = [&](int64_t offset) { return reinterpret_cast<float*>(b + offset); };
  const int64_t t4 = fp8_t4(c.max_tokens);
  const int32_t max_blocks = static_cast<int32_t>(ws.max_blocks);
  int64_t* timeout = ws.errors + kRouteErrorWords;
  // A kind of the block-scaled step: A's scales (leading dimension a_ld) and the scales of
  // weights w0 and w1 (indices into in.fp8_*)
  auto block_scaled = [&](gemm::GroupedGemmArgs g, const float* a_scales, int64_t a_ld, int w0, int w1) {
    g.operand_bytes = 1;
    g.a_scales = a_scales;
    g.a_scales_ld = a_ld;
    g.b0_scales = in.fp8_scales[w0];
    g.b1_scales = in.fp8_scales[w1];
    g.timeout_s = c.timeout_s;
    g.timeout_record = timeout;
    return g;
  };
  // x quantised once per token (the shared expert reads it too), then the plan's rows gathered
  // in e4m3 with their scales (half the bytes of a bf16 gather)
  if (T > 0) {
    gemm::launch_quantize_rows(in.x, b + parts.x, scales_at(parts.x_scales), T, H, pow2, stream, t4);
    launch_gather_e4m3_rows(b + parts.x, scales_at(parts.x_scales), t4, ws.rows, ws.expert_offset,
                            static_cast<int32_t>(El), H, b + parts.ring, scales_at(parts.ring_scales), ws.max_rows,
                            stream);
  }
  // Gate/up writing a in e4m3 (and its scales) for down
  gemm::GroupedGemmArgs gu = block_scaled(
      gemm::with_tile_n(gemm::gate_up_args(b + parts.ring, ws.max_rows, H, in.fp8_q[0], in.fp8_q[1], El, I,
                                           ws.block_expert, max_blocks, b + parts.act),
                        256),
      scales_at(parts.ring_scales), ws.max_rows, 0, 1);
  gu.epilogue = static_cast<int32_t>(gemm::Epilogue::kSwiGLUE4m3);
  gu.out_scales = scales_at(parts.act_scales);
  gu.out_scales_ld = ws.max_rows;
  gu.out_scales_pow2 = pow2;
  gu.preact = save.h;  // the pre-activations at the plan rows, bf16, from the same accumulators
  gemm::launch_grouped_gemm(gu, stream);
  gemm::GroupedGemmArgs dn = block_scaled(
      gemm::with_tile_n(gemm::down_args(b + parts.act, ws.max_rows, I, in.fp8_q[2], El, H, ws.block_expert,
                                        max_blocks, ws.slots),
                        256),
      scales_at(parts.act_scales), ws.max_rows, 2, 2);
  dn.epilogue = static_cast<int32_t>(gemm::Epilogue::kScatter);
  dn.plan_rows = ws.rows;
  dn.topk = static_cast<int32_t>(k);
  gemm::launch_grouped_gemm(dn, stream);

  // Shared expert: every token, on x quantised above (scale rows of t4)
  if (Is > 0 && T > 0) {
    const int32_t blocks = static_cast<int32_t>(plan::ceil_div(T, gemm::TileConfig::kBlockM));
    gemm::GroupedGemmArgs sg = block_scaled(
        gemm::with_tile_n(gemm::gate_up_args(b + parts.x, T, H, in.fp8_q[3], in.fp8_q[4], 1, Is, ws.shared_block,
                                             blocks, b + parts.shared_act),
                          256),
        scales_at(parts.x_scales), t4, 3, 4);
    sg.epilogue = static_cast<int32_t>(gemm::Epilogue::kSwiGLUE4m3);
    sg.out_scales = scales_at(parts.shared_act_scales);
    sg.out_scales_ld = t4;
    sg.out_scales_pow2 = pow2;
    sg.preact = save.shared_h;
    gemm::launch_grouped_gemm(sg, stream);
    gemm::launch_grouped_gemm(
        block_scaled(gemm::with_tile_n(gemm::down_args(b + parts.shared_act, T, Is, in.fp8_q[5], 1, H,
                                                       ws.shared_block, blocks, ws.shared_out),
                                       256),
                     scales_at(parts.shared_act_scales), t4, 5, 5),
        stream);
  }

  // Fixed-order combine (bf16, as the other paths)
  if (T > 0) {
    const int64_t row_vecs = H * 2 / 16;
    combine_kernel<<<static_cast<unsigned>((T + 3) / 4), 128, 0, stream>>>(
        v, in.topk_weights, static_cast<const uint4*>(ws.slots),
        Is > 0 ? static_cast<const uint4*>(ws.shared_out) : nullptr, row_vecs, static_cast<uint4*>(y));
    MOK_CUDA_CHECK(cudaGetLastError());
  }
}

// MOK_FORWARD_PATH=unfused selects the unfused sequence of launches (same tiles, same
// reduction order): the bitwise reference of the fused kernel in tests.
bool use_unfused_path() { return env::get(env::kForwardPath) == "unfused"; }

void forward_unfused(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, const plan::RoutingView& v,
                     void* y, cudaStream_t stream, const Saved& save) {
  const int64_t H = c.hidden, I = c.intermediate, Is = c.shared_intermediate, k = c.topk, T = in.num_tokens;
  const int64_t El = plan_dims(c).local_experts();
  size_t unused = 0;
  if (ws.unfused_ring == nullptr) {
    // Separate entries of the layout: max_rows x H and max_rows x I bf16
    ws.unfused_ring = device_alloc<uint16_t>(static_cast<size_t>(ws.layout[WsBuffer::kUnfusedRing].count), &unused);
    ws.unfused_act = device_alloc<uint16_t>(static_cast<size_t>(ws.layout[WsBuffer::kUnfusedAct].count), &unused);
  }
  // Gather routed rows into the ring
  const int64_t row_vecs = H * 2 / 16;
  if (T > 0) {
    gather_rows_kernel<<<528, 256, 0, stream>>>(static_cast<const uint4*>(static_cast<const void*>(in.x)), ws.rows,
                                                ws.expert_offset, static_cast<int32_t>(El), row_vecs,
                                                static_cast<uint4*>(ws.unfused_ring));
    MOK_CUDA_CHECK(cudaGetLastError());
  }
  const int32_t max_blocks = static_cast<int32_t>(ws.max_blocks);
  int64_t* timeout = ws.errors + kRouteErrorWords;

  // Gate/up with SwiGLU, then down scattering to the route slots
  gemm::GroupedGemmArgs gu = gemm::gate_up_args(ws.unfused_ring, ws.max_rows, H, in.w_gate, in.w_up, El, I, ws.block_expert,
                                                max_blocks, ws.unfused_act);
  set_b_strides(gu, in.strides.w_gate);
  gu.timeout_s = c.timeout_s;
  gu.timeout_record = timeout;
  gemm::launch_grouped_gemm(gu, stream);
  if (save.h) {  // the same tiles without the SwiGLU: the pre-activations at the plan rows
    gemm::GroupedGemmArgs pre = gemm::gate_up_preact_args(ws.unfused_ring, ws.max_rows, H, in.w_gate, in.w_up, El, I,
                                                          ws.block_expert, max_blocks, save.h);
    set_b_strides(pre, in.strides.w_gate);
    pre.timeout_s = c.timeout_s;
    pre.timeout_record = timeout;
    gemm::launch_grouped_gemm(pre, stream);
  }
  gemm::GroupedGemmArgs dn = gemm::down_args(ws.unfused_act, ws.max_rows, I, in.w_down, El, H, ws.block_expert, max_blocks,
                                             ws.slots);
  set_b_strides(dn, in.strides.w_down);
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
    set_b_strides(sg, in.strides.ws_gate);
    sg.timeout_s = c.timeout_s;
    sg.timeout_record = timeout;
    gemm::launch_grouped_gemm(sg, stream);
    if (save.shared_h) {
      gemm::GroupedGemmArgs pre = gemm::gate_up_preact_args(in.x, T, H, in.ws_gate, in.ws_up, 1, Is, ws.shared_block,
                                                            blocks, save.shared_h);
      set_b_strides(pre, in.strides.ws_gate);
      pre.timeout_s = c.timeout_s;
      pre.timeout_record = timeout;
      gemm::launch_grouped_gemm(pre, stream);
    }
    gemm::GroupedGemmArgs sd = gemm::down_args(ws.shared_act, T, Is, in.ws_down, 1, H, ws.shared_block, blocks,
                                               ws.shared_out);
    set_b_strides(sd, in.strides.ws_down);
    sd.timeout_s = c.timeout_s;
    sd.timeout_record = timeout;
    gemm::launch_grouped_gemm(sd, stream);
  }

  // Fixed-order combine
  if (T > 0) {
    combine_kernel<<<static_cast<unsigned>((T + 3) / 4), 128, 0, stream>>>(
        v, in.topk_weights, static_cast<const uint4*>(ws.slots),
        Is > 0 ? static_cast<const uint4*>(ws.shared_out) : nullptr, row_vecs, static_cast<uint4*>(y));
    MOK_CUDA_CHECK(cudaGetLastError());
  }

}

// fp8_block's fused forward (fused::ForwardPolicyFp8): x quantised once per token (the gathers
// copy its e4m3 rows and scales into the ring, the shared gate/up reads it), then the
// megakernel on the caller's e4m3 weight copies (in.fp8_q, contiguous [E, N, K]) and their
// block scales: the launches' tiles (forward_fp8), in one persistent kernel.  p: the call's
// parameters, the bf16 ones set (forward_fused).
void forward_fused_fp8(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, fused::ForwardParams& p,
                       cudaStream_t stream) {
  using Pol = fused::ForwardPolicyFp8;
  const int64_t H = c.hidden, I = c.intermediate, Is = c.shared_intermediate, T = in.num_tokens;
  const int64_t El = plan_dims(c).local_experts();
  const Fp8BufferParts parts = fp8_buffer_parts(ws.max_rows, H, I, c.max_tokens, Is);
  uint8_t* const b = fp8_buffers(ws, parts);
  const auto scales_at = [&](int64_t offset) { return reinterpret_cast<float*>(b + offset); };
  const int64_t t4 = fp8_t4(c.max_tokens);
  if (ws.ep_size > 1) {
    // x quantised per token into the own region by the call's start (ep_start), before the
    // start barrier lets the peers pull its rows
    uint8_t* const own = ws.regions[ws.ep_rank];
    p.x8 = own + ws.sym.x;
    p.x8_scales = reinterpret_cast<const float*>(own + ws.sym.x8_scales);
  } else {
    if (T > 0)
      gemm::launch_quantize_rows(in.x, b + parts.x, scales_at(parts.x_scales), T, H, c.fp8_pow2_scales != 0, stream,
                                 t4);
    p.x8 = b + parts.x;
    p.x8_scales = scales_at(parts.x_scales);
  }
  p.ring = reinterpret_cast<__nv_bfloat16*>(b + parts.ring);  // (e4m3 rows: the kernel reads them as bytes)
  p.act = reinterpret_cast<__nv_bfloat16*>(b + parts.act);
  p.shared_act = reinterpret_cast<__nv_bfloat16*>(b + parts.shared_act);
  p.x8_ld = t4;
  p.ring_scales = scales_at(parts.ring_scales);
  p.act_scales = scales_at(parts.act_scales);
  p.shared_act_scales = scales_at(parts.shared_act_scales);
  p.scales_ld = ws.max_rows;
  for (int i = 0; i < 6; ++i) p.w_scales[i] = in.fp8_scales[i];
  p.pow2 = c.fp8_pow2_scales != 0 ? 1 : 0;

  // Operand maps of e4m3 (boxes of 128 rows x 128 bytes; B halves of 128 rows), and the
  // activations' scale maps (boxes of BLOCK_M scales of a k-block)
  constexpr int kA = fused::kBlockM, kB = Pol::kTileHalfN;
  fused::MapsWith<Pol::ScaleMaps> m{};
  m.ring = gemm::tensor_map_2d(p.ring, ws.ring_rows, H, kA, 1);
  m.w_gate = gemm::tensor_map_2d(in.fp8_q[0], El * I, H, kB, 1);
  m.w_up = gemm::tensor_map_2d(in.fp8_q[1], El * I, H, kB, 1);
  m.act = gemm::tensor_map_2d(p.act, ws.ring_rows, I, kA, 1);
  m.w_down = gemm::tensor_map_2d(in.fp8_q[2], El * H, I, kB, 1);
  m.ring_s = gemm::tensor_map_scales(p.ring_scales, H / 128, ws.max_rows, kA);
  m.act_s = gemm::tensor_map_scales(p.act_scales, I / 128, ws.max_rows, kA);
  if (Is > 0 && T > 0) {
    m.x = gemm::tensor_map_2d(p.x8, T, H, kA, 1);
    m.ws_gate = gemm::tensor_map_2d(in.fp8_q[3], Is, H, kB, 1);
    m.ws_up = gemm::tensor_map_2d(in.fp8_q[4], Is, H, kB, 1);
    m.shared_act = gemm::tensor_map_2d(p.shared_act, c.max_tokens, Is, kA, 1);
    m.ws_down = gemm::tensor_map_2d(in.fp8_q[5], H, Is, kB, 1);
    m.x_s = gemm::tensor_map_scales(p.x8_scales, H / 128, t4, kA);
    m.shared_act_s = gemm::tensor_map_scales(p.shared_act_scales, Is / 128, t4, kA);
  } else {
    m.x = m.ws_gate = m.ws_up = m.ring;
    m.shared_act = m.act;
    m.ws_down = m.w_down;
    m.x_s = m.ring_s;
    m.shared_act_s = m.act_s;
  }
  fused::launch_for_orientation<Pol, Pol>(
      false, ws.grid, stream, [](auto pol) { return fused::fused_forward_kernel<decltype(pol)>; },
      [](auto pol) { return fused::kFusedSmemBytes<decltype(pol)>; }, m, p);
}

void forward_fused(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, const plan::RoutingView& v,
                   void* y, cudaStream_t stream, const Saved& save) {
  const bool fp8 = c.precision == mokPrecisionFP8Block;
  const WeightStacks w = weight_stacks(c, in);
  const int64_t H = c.hidden, I = c.intermediate, Is = c.shared_intermediate, T = in.num_tokens;
  const plan::PlanDims d = plan_dims(c);
  // EP = 1: no comm blocks, the producer warpgroups' gather warps copy the rows (local_gather);
  // EP >= 2: fwd_num_comm_sms blocks pull them from the peers first
  const int32_t num_comm =
      c.ep_size == 1 ? 0 : static_cast<int32_t>(std::min<int64_t>(c.fwd_num_comm_sms, ws.grid - 1));
  MOK_CHECK_ARG(c.ep_size == 1 || num_comm >= 1,
                "fwd_num_comm_sms = " << c.fwd_num_comm_sms << " must be at least 1 at EP >= 2 (the comm blocks pull rows)");
  fused::ForwardParams p{};
  p.hidden = static_cast<int32_t>(H);
  p.inter = static_cast<int32_t>(I);
  p.shared_inter = static_cast<int32_t>(Is);
  p.gate_up_pitch = static_cast<int32_t>(fp8 ? I : gemm::matrix_pitch(w.w_gate));  // (e4m3 copies: contiguous)
  p.down_pitch = static_cast<int32_t>(fp8 ? H : gemm::matrix_pitch(w.w_down));
  const int64_t k_block = fp8 ? fused::ForwardPolicyFp8::Tile::kBlockK : fused::ForwardPolicyBf16::Tile::kBlockK;
  static_assert(fused::ForwardPolicyBf16::Tile::kBlockK == fused::ForwardPolicyBf16Transposed::Tile::kBlockK);
  MOK_CHECK_ARG(H % k_block == 0 && I % k_block == 0 && Is % k_block == 0,
                "the fused forward: H = " << H << ", I = " << I << " and I_s = " << Is << " must be multiples of "
                                          << k_block);
  p.hidden_kb = static_cast<int32_t>(H / k_block);
  p.inter_kb = static_cast<int32_t>(I / k_block);
  p.shared_inter_kb = static_cast<int32_t>(Is / k_block);
  p.topk = static_cast<int32_t>(c.topk);
  p.num_tokens = T;
  p.ring_blocks = static_cast<int32_t>(c.macrobatch_size / fused::kBlockM);
  p.minibatch_blocks = static_cast<int32_t>(c.minibatch_size / fused::kBlockM);
  p.num_comm = num_comm;
  p.max_blocks = static_cast<int32_t>(ws.max_blocks);
  p.shared_blocks = Is > 0 ? gemm::tiles_of(T, fused::kBlockM) : 0;
  p.n_group = gemm::env_tile_n_group();
  const long start_gather = env::get_int(env::kForwardStartGather);
  MOK_CHECK_ARG(start_gather >= 0 && start_gather <= 1024,
                env::kForwardStartGather.name << " = " << start_gather << ": minibatches, 0 to 1024");
  p.start_blocks = static_cast<int32_t>(std::min<int64_t>(start_gather * p.minibatch_blocks, p.max_blocks));
  p.rows = ws.rows;
  p.expert_offset = ws.expert_offset;
  p.block_expert = ws.block_expert;
  p.num_local = static_cast<int32_t>(d.local_experts());
  p.x = static_cast<const __nv_bfloat16*>(static_cast<const void*>(in.x));
  p.topk_weights = in.topk_weights;
  p.routing = v;
  p.ring = static_cast<__nv_bfloat16*>(ws.ring);
  p.act = static_cast<__nv_bfloat16*>(ws.act);
  p.slots = static_cast<__nv_bfloat16*>(ws.slots);
  p.shared_act = static_cast<__nv_bfloat16*>(ws.shared_act);
  p.shared_out = static_cast<__nv_bfloat16*>(ws.shared_out);
  p.y = static_cast<__nv_bfloat16*>(y);
  p.saved_h = static_cast<__nv_bfloat16*>(save.h);
  p.saved_shared_h = Is > 0 ? static_cast<__nv_bfloat16*>(save.shared_h) : nullptr;
  p.group = ep_group(ws);
  p.counters = ws.counters;
  p.trace = ws.trace;
  p.trace_cap = ws.trace_cap;
  clear_trace(ws, stream);
  p.timeout_ns = static_cast<uint64_t>(c.timeout_s * 1e9);
  p.timeout_record = ws.errors + kRouteErrorWords;

  MOK_CUDA_CHECK(cudaMemsetAsync(ws.counters, 0, static_cast<size_t>(ws.num_counters) * sizeof(int32_t), stream));
  if (fp8) {
    forward_fused_fp8(ws, c, in, p, stream);
    return;
  }

  // Tensor maps: operands of the four tile kinds (unused shared maps alias routed ones), all
  // K-major: A boxes of BLOCK_M rows, B halves of the policy's tile N / 2; transposed routed
  // weights N-major, boxes of BLOCK_K rows (their K) as stored
  constexpr int kA = fused::kBlockM;
  const int kB = w.transposed ? fused::ForwardPolicyBf16Transposed::kTileHalfN : fused::ForwardPolicyBf16::kTileHalfN;
  const int kRoutedB = w.transposed ? fused::kBlockK : kB;
  fused::Maps m{};
  m.ring = gemm::tensor_map_2d(ws.ring, ws.ring_rows, H, kA);
  m.w_gate = gemm::tensor_map_stack(w.w_gate, kRoutedB);
  m.w_up = gemm::tensor_map_stack(w.w_up, kRoutedB);
  m.act = gemm::tensor_map_2d(ws.act, ws.ring_rows, I, kA);
  m.w_down = gemm::tensor_map_stack(w.w_down, kRoutedB);
  if (Is > 0 && T > 0) {
    m.x = gemm::tensor_map_2d(in.x, T, H, kA);
    m.ws_gate = gemm::tensor_map_stack(w.ws_gate, kB);
    m.ws_up = gemm::tensor_map_stack(w.ws_up, kB);
    m.shared_act = gemm::tensor_map_2d(ws.shared_act, c.max_tokens, Is, kA);
    m.ws_down = gemm::tensor_map_stack(w.ws_down, kB);
  } else {
    m.x = m.ws_gate = m.ws_up = m.ring;
    m.shared_act = m.act;
    m.ws_down = m.w_down;
  }
  fused::launch_for_orientation<fused::ForwardPolicyBf16, fused::ForwardPolicyBf16Transposed>(
      w.transposed, ws.grid, stream, [](auto pol) { return fused::fused_forward_kernel<decltype(pol)>; },
      [](auto pol) { return fused::kFusedSmemBytes<decltype(pol)>; }, m, p);
}
}  // namespace

// The layout's constants restate the kernels' (common/workspace_layout.hpp is host code too).
static_assert(kWsErrorWords == kAllErrorWords, "error words of the layout differ from the kernels'");
static_assert(kWsDtwChunk == gemm::kDtwChunk, "channels per router-gradient partial differ from the dgrad-down epilogue's");
static_assert(kWsCounterHeader == static_cast<int>(fused::Counter::kHeader) &&
                  kWsCounterArrays == static_cast<int>(fused::CounterArray::kSharedGateUpDone) + 1,
              "counters of the layout differ from the fused kernel's");

DeviceWorkspace* create_workspace(const mokConfig_t& c, void* const* regions) {
  auto* ws = new DeviceWorkspace();
  try {
    ws->device = static_cast<int>(c.device);
    const DeviceGuard guard(ws->device);
    ws->ep_size = static_cast<int32_t>(c.ep_size);
    ws->ep_rank = static_cast<int32_t>(c.ep_rank);
    MOK_CUDA_CHECK(cudaDeviceGetAttribute(&ws->num_sms, cudaDevAttrMultiProcessorCount, ws->device));
    ws->grid = c.num_blocks > 0 ? static_cast<int32_t>(std::min<int64_t>(c.num_blocks, ws->num_sms)) : ws->num_sms;
    WorkspaceOptions options;
    options.num_sms = ws->num_sms;
    options.trace_cap = env::get_int(env::kTrace) != 0 ? kWsTraceCap : 0;
    ws->layout = workspace_layout(c, options);
    const WorkspaceLayout& L = ws->layout;
    ws->max_rows = L.max_rows;
    ws->max_blocks = L.max_blocks;
    ws->shared_blocks = L.shared_blocks;
    ws->ring_rows = L.ring_rows;
    ws->num_counters = L[WsBuffer::kCounters].count;  // 4 arrays (fused/forward_kernel.cuh); max_blocks >= shared_blocks
    size_t& b = ws->bytes;

    // One allocation for every block entry; cudaMalloc aligns to 256 B, the layout's offsets
    // count from a 1 KB aligned base.
    ws->block = device_alloc<uint8_t>(static_cast<size_t>(L.total_bytes() + kWsTmaAlign - kWsAlign), &b);
    ws->base = reinterpret_cast<uint8_t*>(
        static_cast<uintptr_t>(ws_align_up(static_cast<int64_t>(reinterpret_cast<uintptr_t>(ws->block)), kWsTmaAlign)));
    uint8_t* base = ws->base;
    uint8_t* own_region = nullptr;
    if (ws->ep_size > 1) {
      // The group's regions: slots live in this rank's own; the table goes to the device.
      MOK_CHECK_ARG(regions != nullptr, "ep_size = " << c.ep_size << " needs the group's symmetric regions "
                                                     "(mokWorkspaceCreateSymmetric)");
      ws->sym = L.sym;
      for (int s = 0; s < ws->ep_size; ++s) {
        MOK_CHECK_ARG(regions[s] != nullptr, "symmetric region of rank " << s << " is null");
        MOK_CHECK_ARG(reinterpret_cast<uintptr_t>(regions[s]) % 1024 == 0,
                      "symmetric region of rank " << s << " at " << regions[s] << " is not 1 KB aligned");
        ws->regions.push_back(static_cast<uint8_t*>(regions[s]));
      }
      own_region = ws->regions[ws->ep_rank];
    }
    ws->rows = L.get<WsBuffer::kRows>(base);
    ws->expert_count = L.get<WsBuffer::kExpertCount>(base);
    ws->expert_offset = L.get<WsBuffer::kExpertOffset>(base);
    ws->block_expert = L.get<WsBuffer::kBlockExpert>(base);
    ws->ring = L.get<WsBuffer::kRing>(base);
    ws->act = L.get<WsBuffer::kAct>(base);
    ws->counters = L.get<WsBuffer::kCounters>(base);
    ws->regions_dev = L.get<WsBuffer::kRegionsDev>(base);  // EP >= 2, else nullptr
    ws->ep_seq = L.get<WsBuffer::kEpSeq>(base);
    ws->slots = L.get<WsBuffer::kSlots>(base, own_region);  // EP >= 2: in the own region
    ws->shared_block = L.get<WsBuffer::kSharedBlock>(base);  // I_s > 0, else nullptr
    ws->shared_act = L.get<WsBuffer::kSharedAct>(base);
    ws->shared_out = L.get<WsBuffer::kSharedOut>(base);
    ws->errors = L.get<WsBuffer::kErrors>(base);
    // What was zeroed at creation before the layout, and only that: errors, ep_seq, shared_block
    for (int i = 0; i < kNumWsBuffers; ++i) {
      const WsBuffer id = static_cast<WsBuffer>(i);
      if (L[id].place == WsPlace::kBlock && L[id].zero_at_creation)
        MOK_CUDA_CHECK(cudaMemset(L.address(id, base), 0, static_cast<size_t>(L[id].bytes)));
    }
    if (ws->ep_size > 1) {
      MOK_CUDA_CHECK(cudaMemcpy(ws->regions_dev, ws->regions.data(), ws->regions.size() * sizeof(uint8_t*),
                                cudaMemcpyHostToDevice));
      // The configuration's fingerprint in the own header: peers compare it before writing here
      ws->fingerprint = ep_fingerprint(c);
      MOK_CUDA_CHECK(cudaMemcpy(own_region + ws->sym.header, &ws->fingerprint, sizeof(uint64_t),
                                cudaMemcpyHostToDevice));
    }
    if (L.present(WsBuffer::kTrace)) {  // separate: sized by the SM count, optional
      ws->trace_cap = options.trace_cap;
      ws->trace = device_alloc<mokTraceEvent_t>(static_cast<size_t>(L[WsBuffer::kTrace].count), &b);
    }
    MOK_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&ws->host_errors),
                                  static_cast<size_t>(L[WsBuffer::kHostErrors].bytes)));
    MOK_CUDA_CHECK(cudaEventCreateWithFlags(&ws->errors_ready, cudaEventDisableTiming));
  } catch (...) {
    destroy_workspace(ws);
    throw;
  }
  return ws;
}

void destroy_workspace(DeviceWorkspace* ws) {
  if (ws == nullptr) return;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(ws->device);
  // The block holds every layout pointer (slots at EP >= 2 are in the caller's region).
  for (void* p : {static_cast<void*>(ws->block), ws->unfused_ring, ws->unfused_act, static_cast<void*>(ws->fp8_block),
                  static_cast<void*>(ws->fp8_bwd), static_cast<void*>(ws->trace)})
    if (p) cudaFree(p);
  destroy_backward_buffers(ws->bwd);
  if (ws->host_errors) cudaFreeHost(ws->host_errors);
  if (ws->errors_ready) cudaEventDestroy(ws->errors_ready);
  cudaSetDevice(previous);
  delete ws;
}

void check_errors(DeviceWorkspace& ws, int rank, bool wait) {
  if (ws.captured && wait) {
    // A graph replays the error-word copy without an event: wait for the device.
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
  } else {
    if (!ws.pending) return;
    if (wait) MOK_CUDA_CHECK(cudaEventSynchronize(ws.errors_ready));
    const cudaError_t q = cudaEventQuery(ws.errors_ready);
    if (q == cudaErrorNotReady) return;
    MOK_CUDA_CHECK(q);
    ws.pending = false;
  }
  const int64_t* e = ws.host_errors;
  if (e[kRouteErrorWords] != 0) {
    const int64_t* t = e + kRouteErrorWords;
    const int64_t site = t[1];
    std::ostringstream what;
    what << "rank " << rank << ": a device-side wait passed its deadline (timeout_s): ";
    if (site == static_cast<int64_t>(gemm::WaitSite::kConfigMismatch)) {
      if (t[5] == 0)
        MOK_FAIL(mokInvalidUsage, "rank " << rank << ": peer " << t[3]
                                          << " has no workspace over its symmetric region yet: create every rank's "
                                             "workspace before any rank's first call; the call did not run");
      MOK_FAIL(mokInvalidUsage, "rank " << rank << ": the symmetric region of peer " << t[3]
                                        << " was created with another configuration (fingerprint " << std::hex
                                        << t[5] << ", this rank's " << t[4] << std::dec
                                        << "): every rank of a group needs the same ep_size, max_tokens, topk, "
                                           "hidden, intermediate, shared_intermediate, num_experts, block_m and "
                                           "precision; nothing was written, the call did not run");
    }
    what << fused::describe_timeout(t);
    MOK_FAIL(mokTimeout, what.str());
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

size_t read_trace(DeviceWorkspace& ws, void* buffer, size_t buffer_size, int64_t* events_per_recorder) {
  const size_t bytes = ws.trace ? static_cast<size_t>(ws.num_sms) * MOK_TRACE_RECORDERS * ws.trace_cap *
                                      sizeof(mokTraceEvent_t)
                                : 0;
  if (events_per_recorder) *events_per_recorder = ws.trace_cap;
  if (buffer == nullptr || bytes == 0) return bytes;
  MOK_CHECK_ARG(buffer_size >= bytes, "trace buffer of " << buffer_size << " bytes; " << bytes << " needed");
  const DeviceGuard guard(ws.device);
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  MOK_CUDA_CHECK(cudaMemcpy(buffer, ws.trace, bytes, cudaMemcpyDeviceToHost));
  return bytes;
}

std::string unsupported_shape(const mokConfig_t& c) {
  std::ostringstream why;
  // Model dimensions in k-blocks: one TMA box and one k-block of 64 bf16 (the tiles' last of a
  // dimension may be partial: config.hpp, tiles_of)
  constexpr int kK = gemm::TileConfig::kBlockK;
  if (c.hidden % kK != 0)
    why << "hidden = " << c.hidden << " must be a multiple of " << kK << " on the CUDA backend";
  else if (c.intermediate % kK != 0)
    why << "intermediate = " << c.intermediate << " must be a multiple of " << kK << " on the CUDA backend";
  else if (c.shared_intermediate % kK != 0)
    why << "shared_intermediate = " << c.shared_intermediate << " must be a multiple of " << kK
        << " on the CUDA backend";
  else if (c.block_m != gemm::TileConfig::kBlockM)
    why << "block_m = " << c.block_m << " must be " << gemm::TileConfig::kBlockM << " on the CUDA backend";
  else if (c.hidden > 8192)
    why << "hidden = " << c.hidden << " exceeds 8192: the comm blocks stage 12 rows of H bf16 in shared memory";
  else if (plan::ceil_div(plan::max_rows(plan_dims(c)), c.minibatch_size) > plan::kMaxMinibatches)
    why << "minibatch_size = " << c.minibatch_size << " makes more than " << plan::kMaxMinibatches
        << " minibatches for max_tokens = " << c.max_tokens << "; raise minibatch_size (or leave it 0: chosen by mok)";
  return why.str();
}

void grouped_gemm(const GroupedGemmCall& call, void* stream) {
  gemm::GroupedGemmArgs g;
  if (call.a_scales != nullptr && call.kind == mokGemmDgradGateUp) {
    // fp8_block's dgrad gate/up: b0 / b1 W_gate's and W_up's transposed copies [E, H, I] (n = H,
    // k = 2I), a K split
    g = gemm::dgrad_gate_up_e4m3_args(call.a, call.a_rows, call.k / 2, call.b0, call.b1, call.num_experts, call.n,
                                      call.block_expert, call.num_m_blocks, call.out);
    g.num_blocks = call.num_blocks;
    g.a_scales = call.a_scales;
    g.b0_scales = call.b0_scales;
    g.b1_scales = call.b1_scales;
    gemm::launch_grouped_gemm(g, static_cast<cudaStream_t>(stream));
    return;
  }
  if (call.a_scales != nullptr && call.kind == mokGemmDgradDownSwiGLU) {
    // fp8_block's dgrad down with the SwiGLU backward: b0 is W_down's transposed copy [E, I, H]
    // (n = I, k = H), out dh in e4m3 with out_scales, wa the bf16 a
    g = gemm::dgrad_down_swiglu_e4m3_args(call.a, call.a_rows, call.k, call.b0, call.num_experts, call.n,
                                          call.block_expert, call.num_m_blocks, call.h, call.row_weight, call.out,
                                          call.out_scales, 0, call.out_scales_pow2, nullptr, call.wa,
                                          call.dtw_partials);
    g.num_blocks = call.num_blocks;
    g.a_scales = call.a_scales;
    g.b0_scales = call.b0_scales;
    g.b1_scales = call.b0_scales;
    gemm::launch_grouped_gemm(g, static_cast<cudaStream_t>(stream));
    return;
  }
  switch (call.kind) {
    case mokGemmGateUp:
      g = gemm::gate_up_args(call.a, call.a_rows, call.k, call.b0, call.b1, call.num_experts, call.n,
                             call.block_expert, call.num_m_blocks, call.out);
      break;
    case mokGemmGateUpPreact:
      g = gemm::gate_up_preact_args(call.a, call.a_rows, call.k, call.b0, call.b1, call.num_experts, call.n,
                                    call.block_expert, call.num_m_blocks, call.out);
      break;
    case mokGemmDown:
      g = gemm::down_args(call.a, call.a_rows, call.k, call.b0, call.num_experts, call.n, call.block_expert,
                          call.num_m_blocks, call.out);
      break;
    case mokGemmDgradDown:
      g = gemm::dgrad_down_args(call.a, call.a_rows, call.k, call.b0, call.num_experts, call.n, call.block_expert,
                                call.num_m_blocks, call.out);
      break;
    case mokGemmDgradGateUp:
      g = gemm::dgrad_gate_up_args(call.a, call.a_rows, call.k / 2, call.b0, call.b1, call.num_experts, call.n,
                                   call.block_expert, call.num_m_blocks, call.out);
      break;
    case mokGemmDgradDownSwiGLU:
      g = gemm::dgrad_down_swiglu_args(call.a, call.a_rows, call.k, call.b0, call.num_experts, call.n,
                                       call.block_expert, call.num_m_blocks, call.h, call.row_weight, call.out,
                                       call.wa, call.dtw_partials);
      break;
    default:
      MOK_FAIL(mokInvalidArgument, "grouped GEMM kind = " << call.kind << " is not a mokGemmKind_t");
  }
  g.num_blocks = call.num_blocks;
  if (call.a_scales != nullptr) {
    // e4m3 with block scales (PrecisionE4m3Block): 128 x 256 tiles (docs/perf.md, session 25:
    // 0.79 of the dense fp8 rate on dsv3's gate/up against 0.70 at 128 x 128)
    const bool quantized_out = call.out_scales != nullptr;
    g = gemm::with_tile_n(g, 256);
    if (quantized_out) {
      g.epilogue = static_cast<int32_t>(gemm::Epilogue::kSwiGLUE4m3);
      g.out_scales = call.out_scales;
      g.out_scales_pow2 = call.out_scales_pow2;
    }
    g.operand_bytes = 1;
    g.a_scales = call.a_scales;
    g.b0_scales = call.b0_scales;
    g.b1_scales = call.b1_scales;
    g.b_scales_transposed = call.b_scales_transposed;
    gemm::launch_grouped_gemm(g, static_cast<cudaStream_t>(stream));
    return;
  }
  gemm::launch_grouped_gemm(gemm::with_kind_tile(g), static_cast<cudaStream_t>(stream));
}

void grouped_wgrad_fp8(const GroupedWgradFp8Call& c, void* stream) {
  gemm::GroupedWgradFp8Args g;
  g.a = c.a;
  g.b = c.b;
  g.a_scales = c.a_scales;
  g.b_scales = c.b_scales;
  g.rows = c.rows;
  g.mo = c.mo;
  g.no = c.no;
  g.num_experts = c.num_experts;
  g.expert_offset = c.expert_offset;
  g.expert_count = c.expert_count;
  g.out = c.out;
  g.acc = c.acc;
  g.main_grad = c.main_grad;
  g.accumulate = c.accumulate;
  g.store_acc = c.store_acc;
  g.num_blocks = c.num_blocks;
  gemm::launch_grouped_wgrad_fp8(g, static_cast<cudaStream_t>(stream));
}

void quantize_cols(const void* v, int64_t rows, int64_t cols, void* qt, float* scales, bool pow2, void* stream) {
  gemm::launch_quantize_cols(v, cols, rows, cols, qt, scales, pow2, static_cast<cudaStream_t>(stream));
}

void quantize_rows(const void* x, void* q, float* scales, int64_t rows, int64_t n, bool pow2, void* stream) {
  gemm::launch_quantize_rows(x, q, scales, rows, n, pow2, static_cast<cudaStream_t>(stream));
}

void quantize_blocks(const QuantizeBlocksCall& c, void* stream) {
  gemm::QuantizeBlocksArgs a;
  a.w = c.w;
  a.num = c.num;
  a.rows = c.rows;
  a.cols = c.cols;
  a.w_expert_stride = c.strides.expert_or(c.rows, c.cols);
  a.w_row_stride = c.strides.col_major() ? 1 : c.strides.row_or(c.cols);
  a.w_col_stride = c.strides.col;
  a.q = static_cast<uint8_t*>(c.q);
  a.q_expert_stride = c.rows * c.cols;
  a.q_row_stride = c.cols;
  a.qt = static_cast<uint8_t*>(c.qt);
  a.qt_expert_stride = c.rows * c.cols;
  a.qt_row_stride = c.rows;
  a.scales = c.scales;
  a.s_expert_stride = (c.rows / 128) * (c.cols / 128);
  a.pow2 = c.pow2;
  gemm::launch_quantize_blocks(a, static_cast<cudaStream_t>(stream));
}

void grouped_wgrad(const GroupedWgradCall& call, void* stream) {
  gemm::GroupedWgradArgs g;
  g.a = call.a;
  g.b = call.b;
  g.rows = call.rows;
  g.mo = call.mo;
  g.no = call.no;
  g.num_experts = call.num_experts;
  g.expert_offset = call.expert_offset;
  g.expert_count = call.expert_count;
  g.out = call.out;
  g.acc = call.acc;
  g.main_grad = call.main_grad;
  g.accumulate = call.accumulate;
  g.store_acc = call.store_acc;
  g.num_blocks = call.num_blocks;
  gemm::launch_grouped_wgrad(g, static_cast<cudaStream_t>(stream));
}

// The routing the plan build and the combine read: this call's ids at EP = 1; at EP >= 2 the
// whole group's, as exchanged into the own region.
WeightStacks weight_stacks(const mokConfig_t& c, const ref::RankInputs& in) {
  const int64_t H = c.hidden, I = c.intermediate, Is = c.shared_intermediate;
  const int64_t El = plan_dims(c).local_experts();
  const ref::WeightStrides& s = in.strides;
  // A column-major [rows, cols] matrix is the row-major [cols, rows] one it is stored as
  auto stack = [](const void* q, int64_t num, int64_t rows, int64_t cols, const ref::MatrixStrides& st) {
    return st.col_major() ? gemm::MatrixStack{q, num, cols, rows, st.expert, st.col}
                          : gemm::MatrixStack{q, num, rows, cols, st.expert, st.row};
  };
  return WeightStacks{stack(in.w_gate, El, I, H, s.w_gate),    stack(in.w_up, El, I, H, s.w_up),
                      stack(in.w_down, El, H, I, s.w_down),    stack(in.ws_gate, 1, Is, H, s.ws_gate),
                      stack(in.ws_up, 1, Is, H, s.ws_up),      stack(in.ws_down, 1, H, Is, s.ws_down),
                      s.w_gate.col_major()};
}

void set_b_strides(gemm::GroupedGemmArgs& g, const ref::MatrixStrides& s) {
  g.b_expert_stride = s.expert;
  g.b_row_stride = s.row;
}

plan::RoutingView routing_of(const DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in) {
  if (ws.ep_size > 1) return ep_routing(ws, c);
  plan::RoutingView v;
  v.num_ranks = 1;
  v.topk = static_cast<int32_t>(c.topk);
  v.num_experts = c.num_experts;
  v.ids_are_int64 = in.ids_are_int64;
  v.ids[0] = in.topk_ids;
  v.num_tokens[0] = in.num_tokens;
  return v;
}

bool stream_capturing(void* stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MOK_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture));
  return capture != cudaStreamCaptureStatusNone;
}

void call_start(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, void* stream_ptr, bool capturing,
                const void* dy) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  // Raise what an earlier call recorded, without waiting for it (never while capturing: an
  // event query would invalidate the capture).
  if (!capturing) check_errors(ws, static_cast<int>(c.ep_rank), false);
  // The timeout record is reset only once the previous call's copy has been read: a timeout
  // of a call whose copy has not landed yet stays set (this call's kernels then leave at once
  // and its own copy reports it), so that no timeout is lost.
  if (capturing || !ws.pending)
    MOK_CUDA_CHECK(cudaMemsetAsync(ws.errors + kRouteErrorWords, 0, kTimeoutWords * sizeof(int64_t), stream));
  // EP >= 2: x (the backward: dy and the weights too) into the region, the routing exchange,
  // the start barrier
  if (ws.ep_size > 1) ep_start(ws, c, in, ws.errors + kRouteErrorWords, stream, dy);
}

void call_plan(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, void* stream_ptr) {
  // Plan build from the device-resident ids (EP >= 2: the whole group's, in the own region)
  const plan::PlanView pv{ws.rows, ws.expert_count, ws.expert_offset, ws.block_expert};
  build_plan(plan_dims(c), routing_of(ws, c, in), pv, ws.errors, ws.device, stream_ptr);
}

void forward_phase(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, void* y, void* stream_ptr,
                   ForwardPhase phase, const Saved& save) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const DeviceGuard guard(ws.device);
  const bool capturing = stream_capturing(stream_ptr);
  MOK_CHECK_ARG(!use_unfused_path() || !in.strides.w_gate.col_major(),
                "MOK_FORWARD_PATH=unfused reads row-major routed weights only, and w_gate is column-major "
                "(transposed); the fused forward reads both");
  switch (phase) {
    case ForwardPhase::kStart:
      call_start(ws, c, in, stream_ptr, capturing, nullptr);
      return;
    case ForwardPhase::kPlan:
      call_plan(ws, c, in, stream_ptr);
      return;
    case ForwardPhase::kLayer:
      if (c.precision == mokPrecisionFP8Block && use_unfused_path()) {
        MOK_CHECK_ARG(ws.ep_size == 1, "MOK_FORWARD_PATH=unfused runs at EP = 1 only (this workspace has ep_size = "
                                           << ws.ep_size << "); the fused forward runs fp8_block at any EP");
        forward_fp8(ws, c, in, routing_of(ws, c, in), y, stream, save);
      } else if (use_unfused_path()) {
        MOK_CHECK_ARG(ws.ep_size == 1, "MOK_FORWARD_PATH=unfused runs at EP = 1 only (this workspace has ep_size = "
                                           << ws.ep_size << ")");
        forward_unfused(ws, c, in, routing_of(ws, c, in), y, stream, save);
      } else {
        forward_fused(ws, c, in, routing_of(ws, c, in), y, stream, save);
      }
      call_finish(ws, stream, capturing);
      return;
  }
}

void forward(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, void* y, void* stream,
             const Saved& save) {
  for (ForwardPhase phase : {ForwardPhase::kStart, ForwardPhase::kPlan, ForwardPhase::kLayer})
    forward_phase(ws, c, in, y, stream, phase, save);
}

}  // namespace mok::cuda
