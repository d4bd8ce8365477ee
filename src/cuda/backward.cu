// The backward on the GPU at EP = 1, as a sequence of stream-ordered launches with no host
// synchronisation (the unfused backward: the bitwise reference of the fused backward kernel,
// and the CUDA backward until that kernel lands).  The math and its roundings are the CPU
// reference's (src/ref/reference.hpp); the tiles are the engine's kinds:
//
//   plan build (the forward's plan, from the same ids)
//   gather: x rows, dy rows and each row's route weight, in plan order (padding rows 0)
//   replay   h = [g | u] = x_rows · [W_gate; W_up][e]ᵀ              (gate/up, kGateUpPreact)
//   dgrad down with the SwiGLU backward: dh = [dg | du], wa = bf16(w·a), ⟨da, a⟩ partials
//   dgrad gate/up: dx row of route (t, j) = dh · [W_gate; W_up][e] into slot t·k + j
//   wgrad per macrobatch, ascending: dW_down[e] += dyᵀ · wa, [dW_gate; dW_up][e] += dhᵀ · x
//     (an expert whose rows span macrobatches keeps its fp32 partial sum in a slot of
//     `wgrad_acc` between them; the others go straight from registers to bf16 / main_grad)
//   the shared expert over the tokens themselves (weight 1), the same kinds
//   d topk_weights[t, j] = Σ_c partials[row, c], ascending c;  dx[t] = bf16(Σ_j↑ slot + shared)
//
// The macrobatch split of the wgrad sums is the fused backward's (its ring holds one
// macrobatch), so that the two give the same bits.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <vector>
#include <cstdint>

#include "cuda/comm/combine.cuh"
#include "cuda/comm/ep.cuh"
#include "cuda/comm/plan_rows.cuh"
#include "cuda/ep.hpp"
#include "cuda/cuda_api.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/forward.hpp"
#include "cuda/fused/backward_kernel.cuh"
#include "cuda/fused/schedule_bwd.cuh"
#include "cuda/gemm/launch.hpp"
#include "cuda/gemm/quantize.cuh"
#include "cuda/gemm/tensor_map.hpp"
#include "cuda/gemm/config.hpp"
#include "plan/plan.hpp"
#include "runtime/env.hpp"
#include "runtime/errors.hpp"
#include "runtime/layer.hpp"

namespace mok::cuda {

// The backward's buffers (one allocation, made at the first backward call of a workspace).
struct BackwardBuffers {
  void* block = nullptr;
  size_t bytes = 0;
  // routed, per plan row: x, dy rows (bf16 [max_rows, H]); h, dh [max_rows, 2I]; wa [max_rows, I]
  void* x_rows = nullptr;
  void* dy_rows = nullptr;
  void* h = nullptr;
  void* dh = nullptr;
  void* wa = nullptr;
  void* dx_rows = nullptr;        // EP >= 2: [max_rows, H], the routed dx rows before their push home
  float* row_weight = nullptr;    // [max_rows]
  float* dtw_partials = nullptr;  // [max_rows, ceil(I / 128)]
  // the shared expert, per token: h_s, dh_s [T_max, 2I_s], a_s [T_max, I_s]
  void* sh_h = nullptr;
  void* sh_dh = nullptr;
  void* sh_a = nullptr;
  float* ones = nullptr;          // [max(T_max, k)] 1.0f: the shared expert's row weights
  // wgrad tables: per macrobatch m, kTableWords(E) int32 (below); the shared expert's 2 + 2
  int32_t* tables = nullptr;
  int32_t* shared_table = nullptr;
  // fp32 partial sums of the experts spanning macrobatches: [n_acc, 2I, H] and [n_acc, H, I]
  float* acc_gu = nullptr;
  float* acc_dn = nullptr;
  int64_t num_macro = 0, n_acc = 0;
  // the fused backward's dependency counters (zeroed per launch)
  int32_t* counters = nullptr;
  int64_t num_counters = 0;
};

namespace {

// Per macrobatch: range [2] (first expert, end), then offset, count, mode, slot [E] each.
int64_t table_words(int64_t E) { return 2 + 4 * E; }

// ---- gather: x and dy rows and the route weight of every plan row (padding: zeros) ----------
// The row's sources: this call's x, dy, topk_weights at EP = 1; at EP >= 2 those its source rank
// published in its region (read over NVLink, or the same device for virtual ranks).
struct RowSources {
  const uint4* x;
  const uint4* dy;
  const float* topk_weights;
  ep::Group group;  // size > 1: the sources are the record's rank's region
};
__global__ void bwd_gather_kernel(RowSources src, const uint32_t* __restrict__ rows,
                                  const int32_t* __restrict__ expert_offset, int32_t num_local, int32_t topk,
                                  int64_t row_vecs, uint4* __restrict__ x_rows, uint4* __restrict__ dy_rows,
                                  float* __restrict__ row_weight) {
  // (x_rows null: the route weights alone, fp8_block's backward reading x and dy in place)
  const int64_t copy_vecs = x_rows != nullptr ? row_vecs : 0;
  for_each_plan_row(rows, expert_offset, num_local, [&](int64_t i, uint32_t rec, int lane) {
    uint4* xd = x_rows + i * row_vecs;
    uint4* dd = dy_rows + i * row_vecs;
    if (row_is_pad(rec)) {
      for (int64_t v = lane; v < copy_vecs; v += 32) xd[v] = dd[v] = make_uint4(0, 0, 0, 0);
      if (lane == 0) row_weight[i] = 0.0f;
    } else {
      const int64_t t = row_token(rec);
      const bool peer = src.group.size > 1;
      const int s = row_rank(rec);
      const uint4* xs = (peer ? reinterpret_cast<const uint4*>(ep::x_of(src.group, s)) : src.x) + t * row_vecs;
      const uint4* ds = (peer ? reinterpret_cast<const uint4*>(ep::dy_of(src.group, s)) : src.dy) + t * row_vecs;
      for (int64_t v = lane; v < copy_vecs; v += 32) {
        xd[v] = peer ? xs[v] : __ldg(xs + v);
        dd[v] = peer ? ds[v] : __ldg(ds + v);
      }
      if (lane == 0) row_weight[i] = (peer ? ep::weights_of(src.group, s) : src.topk_weights)[t * topk + row_slot(rec)];
    }
  });
}

// ---- EP >= 2: each routed dx row to its home rank's slot token*k + j ------------------------
__global__ void bwd_push_kernel(ep::Group g, const uint32_t* __restrict__ rows,
                                const int32_t* __restrict__ expert_offset, int32_t num_local, int32_t topk,
                                int64_t row_vecs, const uint4* __restrict__ dx_rows) {
  for_each_plan_row(rows, expert_offset, num_local, [&](int64_t i, uint32_t rec, int lane) {
    if (row_is_pad(rec)) return;
    uint4* dst = reinterpret_cast<uint4*>(ep::slots_of(g, row_rank(rec))) +
                 (row_token(rec) * topk + row_slot(rec)) * row_vecs;
    const uint4* from = dx_rows + i * row_vecs;
    for (int64_t v = lane; v < row_vecs; v += 32) dst[v] = from[v];
  });
}

// ---- fp8_block at EP >= 2: x or dy of every plan row from its source rank's region, its bf16
// row kept (the wgrad operands' column quantisers read it) and, q given, the same loads
// quantised per row and 128 channels (gemm::quantize_row_warp: the bits of EP = 1's per-token
// quantisation) into q [rows, H] e4m3 and scales [H/128, scales_ld]; a padding row is zeros with
// scale 1, as gather_e4m3_rows writes it
__global__ void bwd_gather_quantize_kernel(ep::Group g, bool dy, const uint32_t* __restrict__ rows,
                                           const int32_t* __restrict__ expert_offset, int32_t num_local,
                                           int64_t hidden, __nv_bfloat16* __restrict__ copy, uint8_t* __restrict__ q,
                                           float* __restrict__ scales, int64_t scales_ld, bool pow2) {
  for_each_plan_row(rows, expert_offset, num_local, [&](int64_t i, uint32_t rec, int lane) {
    __nv_bfloat16* const dst = copy + i * hidden;
    if (row_is_pad(rec)) {
      for (int64_t v = lane; v < hidden / 8; v += 32) reinterpret_cast<uint4*>(dst)[v] = make_uint4(0, 0, 0, 0);
      if (q != nullptr) {
        for (int64_t v = lane; v < hidden / 16; v += 32)
          reinterpret_cast<uint4*>(q + i * hidden)[v] = make_uint4(0, 0, 0, 0);
        for (int64_t kb = lane; kb < hidden / 128; kb += 32) scales[kb * scales_ld + i] = 1.0f;
      }
      return;
    }
    const int s = row_rank(rec);
    const __nv_bfloat16* const src = (dy ? ep::dy_of(g, s) : ep::x_of(g, s)) + row_token(rec) * hidden;
    if (q != nullptr) {
      gemm::quantize_row_warp(src, q + i * hidden, scales, scales_ld, i, hidden, pow2, dst);
    } else {
      for (int64_t v = lane; v < hidden / 8; v += 32)
        reinterpret_cast<uint4*>(dst)[v] = __ldg(reinterpret_cast<const uint4*>(src) + v);
    }
  });
}

// ---- the wgrad tables of every macrobatch (one thread per macrobatch) and the shared one -----
// Expert e's real rows are [offset[e], offset[e] + count[e]), its blocks end at offset[e + 1].
// first(e) / last(e): the macrobatches of its first and last block (an expert without rows:
// the macrobatch where its empty range sits, clipped to the last one that exists), so that
// every expert, empty ones included, is in a contiguous range of experts of each macrobatch.
__global__ void bwd_tables_kernel(const int32_t* __restrict__ expert_offset, const int32_t* __restrict__ expert_count,
                                  int32_t num_experts, int32_t ring_rows, int32_t num_macro, int32_t slot_by_expert,
                                  int32_t* __restrict__ tables, int64_t words, int32_t* __restrict__ shared_table,
                                  int32_t shared_rows, float* __restrict__ ones, int64_t num_ones) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < num_ones; i += static_cast<int64_t>(gridDim.x) * blockDim.x) ones[i] = 1.0f;
  if (tid == 0) {
    shared_table[0] = 0;            // offset [0, rows]
    shared_table[1] = shared_rows;
    shared_table[2] = shared_rows;  // count
  }
  if (tid >= num_macro) return;
  const int32_t m = static_cast<int32_t>(tid);
  const int32_t live = fused::bwd::live_macros(expert_offset[num_experts], ring_rows);
  int32_t* t = tables + m * words;
  int32_t* offset = t + 2;
  int32_t* count = offset + num_experts;
  int32_t* mode = count + num_experts;
  int32_t* slot = mode + num_experts;
  int32_t begin = num_experts, end = 0;
  for (int32_t e = 0; e < num_experts; ++e) {
    const fused::bwd::WgradPiece w =
        fused::bwd::wgrad_piece(expert_offset[e], expert_count[e], expert_offset[e + 1], m, ring_rows, live);
    offset[e] = w.row0;
    count[e] = w.count;
    mode[e] = w.mode;
    slot[e] = w.first_macro < w.last_macro ? (slot_by_expert ? e : w.first_macro) : 0;
    if (w.mode >= 0) {
      begin = min(begin, e);
      end = max(end, e + 1);
    }
  }
  t[0] = begin < end ? begin : 0;
  t[1] = begin < end ? end : 0;
}

// ---- d topk_weights: the fixed-order sum of each routed row's partials ------------------------
// Into d_topk_weights at EP = 1; at EP >= 2 into the dtw slots of the row's home rank.
__global__ void bwd_dtw_kernel(ep::Group g, const uint32_t* __restrict__ rows, const int32_t* __restrict__ expert_offset,
                               int32_t num_local, const float* __restrict__ partials, int32_t chunks, int32_t topk,
                               float* __restrict__ d_topk_weights) {
  const int64_t total = expert_offset[num_local];
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t rec = rows[i];
    if (row_is_pad(rec)) continue;
    float s = 0.0f;
    for (int c = 0; c < chunks; ++c) s = s + partials[i * chunks + c];
    float* out = g.size > 1 ? ep::dtw_of(g, row_rank(rec)) : d_topk_weights;
    out[row_token(rec) * topk + row_slot(rec)] = s;
  }
}

// ---- dx: one warp per token, Σ_j↑ of its valid routes' rows (weight 1: exact) + the shared -----
__global__ void bwd_dx_kernel(plan::RoutingView v, int rank, const float* __restrict__ ones,
                              const uint4* __restrict__ slots, const uint4* __restrict__ shared_dx, int64_t num_tokens,
                              int64_t row_vecs, uint4* __restrict__ dx) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * 4 + threadIdx.x / 32;
  if (t >= num_tokens) return;  // warp-uniform
  const int k = v.topk;
  combine_token_warp(slots + t * k * row_vecs, row_vecs, k, ones, shared_dx ? shared_dx + t * row_vecs : nullptr,
                     dx + t * row_vecs, [&](int j) {
                       int64_t id;
                       return plan::check_route(v, rank, t, j, &id) == RouteCheck::kOk;
                     });
}

// The backward launches' first steps: the wgrad tables of every macrobatch and the ones (dx's
// combine weights), then the plan's x and dy rows and their route weights (EP >= 2: from the
// rows' source ranks, whatever this rank's T)
void gather_backward_rows(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, const void* dy,
                          const ep::Group& group, cudaStream_t stream, bool copy_rows = true) {
  BackwardBuffers& b = *ws.bwd;
  const int64_t El = plan_dims(c).local_experts(), k = c.topk, T = in.num_tokens;
  const int32_t ring_rows = static_cast<int32_t>(c.macrobatch_size);
  const int64_t num_ones = std::max<int64_t>(c.max_tokens, k);
  bwd_tables_kernel<<<static_cast<unsigned>(std::min<int64_t>(plan::ceil_div(num_ones, 256), 1024)) + 1, 256, 0,
                      stream>>>(ws.expert_offset, ws.expert_count, static_cast<int32_t>(El), ring_rows,
                                static_cast<int32_t>(b.num_macro), El <= b.num_macro - 1 ? 1 : 0, b.tables,
                                table_words(El), b.shared_table, static_cast<int32_t>(T), b.ones, num_ones);
  MOK_CUDA_CHECK(cudaGetLastError());
  if (T > 0 || group.size > 1) {
    const RowSources src{static_cast<const uint4*>(static_cast<const void*>(in.x)), static_cast<const uint4*>(dy),
                         in.topk_weights, group};
    bwd_gather_kernel<<<528, 256, 0, stream>>>(src, ws.rows, ws.expert_offset, static_cast<int32_t>(El),
                                               static_cast<int32_t>(k), c.hidden * 2 / 16,
                                               copy_rows ? static_cast<uint4*>(b.x_rows) : nullptr,
                                               copy_rows ? static_cast<uint4*>(b.dy_rows) : nullptr, b.row_weight);
    MOK_CUDA_CHECK(cudaGetLastError());
  }
}

// The buffers, from the layout's unfused_bwd entries (common/workspace_layout.hpp): one
// allocation, each entry 1 KB aligned, in the layout's order.
BackwardBuffers* create_backward_buffers(const DeviceWorkspace& ws, const mokConfig_t& c) {
  const WorkspaceLayout& L = ws.layout;
  static constexpr WsBuffer kParts[] = {WsBuffer::kUbXRows,     WsBuffer::kUbDyRows,     WsBuffer::kUbH,
                                        WsBuffer::kUbDh,        WsBuffer::kUbWa,         WsBuffer::kUbDxRows,
                                        WsBuffer::kUbRowWeight, WsBuffer::kUbDtwPartials, WsBuffer::kUbSharedH,
                                        WsBuffer::kUbSharedDh,  WsBuffer::kUbSharedA,    WsBuffer::kUbOnes,
                                        WsBuffer::kUbTables,    WsBuffer::kUbAccGateUp,  WsBuffer::kUbAccDown,
                                        WsBuffer::kUbCounters};
  int64_t total = 0;
  for (WsBuffer id : kParts)
    if (L.present(id)) total += ws_align_up(std::max<int64_t>(L[id].bytes, 1), kWsTmaAlign);
  auto* b = new BackwardBuffers();
  b->num_macro = L.n_macro;
  b->n_acc = L.n_acc;
  void* block = nullptr;
  const size_t bytes = static_cast<size_t>(total + kWsTmaAlign);
  const cudaError_t err = cudaMalloc(&block, bytes);
  if (err != cudaSuccess) delete b;
  if (err == cudaErrorMemoryAllocation)
    MOK_FAIL(mokOutOfMemory, "backward buffers: cudaMalloc of " << bytes << " bytes failed (out of device memory)");
  MOK_CUDA_CHECK(err);
  b->block = block;
  b->bytes = bytes;
  uint8_t* cur = reinterpret_cast<uint8_t*>(
      static_cast<uintptr_t>(ws_align_up(static_cast<int64_t>(reinterpret_cast<uintptr_t>(block)), kWsTmaAlign)));
  void* at[kNumWsBuffers] = {};
  for (WsBuffer id : kParts) {
    if (!L.present(id)) continue;
    at[static_cast<int>(id)] = cur;
    cur += ws_align_up(std::max<int64_t>(L[id].bytes, 1), kWsTmaAlign);
  }
  auto get = [&](WsBuffer id) { return at[static_cast<int>(id)]; };
  b->x_rows = get(WsBuffer::kUbXRows);
  b->dy_rows = get(WsBuffer::kUbDyRows);
  b->h = get(WsBuffer::kUbH);
  b->dh = get(WsBuffer::kUbDh);
  b->wa = get(WsBuffer::kUbWa);
  b->dx_rows = get(WsBuffer::kUbDxRows);
  b->row_weight = static_cast<float*>(get(WsBuffer::kUbRowWeight));
  b->dtw_partials = static_cast<float*>(get(WsBuffer::kUbDtwPartials));
  b->sh_h = get(WsBuffer::kUbSharedH);
  b->sh_dh = get(WsBuffer::kUbSharedDh);
  b->sh_a = get(WsBuffer::kUbSharedA);
  b->ones = static_cast<float*>(get(WsBuffer::kUbOnes));
  b->tables = static_cast<int32_t*>(get(WsBuffer::kUbTables));
  b->shared_table = b->tables + b->num_macro * table_words(L.El);
  b->acc_gu = static_cast<float*>(get(WsBuffer::kUbAccGateUp));
  b->acc_dn = static_cast<float*>(get(WsBuffer::kUbAccDown));
  b->counters = static_cast<int32_t*>(get(WsBuffer::kUbCounters));
  b->num_counters = L[WsBuffer::kUbCounters].count;
  // The dx sum's unit weights: constant, written once (the unfused tables kernel rewrites them)
  const std::vector<float> ones(static_cast<size_t>(L[WsBuffer::kUbOnes].count), 1.0f);
  MOK_CUDA_CHECK(cudaMemcpy(b->ones, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
  (void)c;
  return b;
}

// The two weight-gradient launches of a set of experts (`w`: rows, experts, tables): dW_down =
// dyᵀ · a_w ([H, I]) and [dW_gate; dW_up] = dhᵀ · x ([2I, H], split at I into the two).
struct WgradOperands {
  const void *dy, *a_w, *dh, *x;
  int64_t hidden, inter;
  void *d_gate, *d_up, *d_down;
  float *main_gate, *main_up, *main_down;
  float *acc_gu, *acc_dn;  // null: no expert spans calls
  // The gradients' and main_grads' strides (gate and up share theirs)
  ref::MatrixStrides s_gate_up, s_down, ms_gate_up, ms_down;
};
// The launch's outputs in place: gradient strides s, main_grad strides ms.
void set_out_strides(gemm::GroupedWgradArgs& w, const ref::MatrixStrides& s, const ref::MatrixStrides& ms) {
  w.out_expert_stride = s.expert;
  w.out_row_stride = s.row;
  w.mg_expert_stride = ms.expert;
  w.mg_row_stride = ms.row;
}
void launch_wgrad_pair(const gemm::GroupedWgradArgs& w, const WgradOperands& o, cudaStream_t stream) {
  gemm::GroupedWgradArgs dn = w;
  dn.a = o.dy;
  dn.b = o.a_w;
  dn.mo = o.hidden;
  dn.no = o.inter;
  dn.out = o.d_down;
  dn.main_grad = o.main_down;
  dn.acc = o.acc_dn;
  set_out_strides(dn, o.s_down, o.ms_down);
  gemm::launch_grouped_wgrad(dn, stream);
  gemm::GroupedWgradArgs gu = w;
  gu.a = o.dh;
  gu.b = o.x;
  gu.mo = 2 * o.inter;
  gu.no = o.hidden;
  gu.out = o.d_gate;
  gu.out1 = o.d_up;
  gu.main_grad = o.main_gate;
  gu.main_grad1 = o.main_up;
  gu.out_split = o.inter;
  gu.acc = o.acc_gu;
  set_out_strides(gu, o.s_gate_up, o.ms_gate_up);
  gemm::launch_grouped_wgrad(gu, stream);
}

// A launch of the unfused backward: B's weights in place (strides s), the call's deadline.
gemm::GroupedGemmArgs with_b(gemm::GroupedGemmArgs g, const ref::MatrixStrides& s, const mokConfig_t& c,
                             int64_t* timeout) {
  set_b_strides(g, s);
  g.timeout_s = c.timeout_s;
  g.timeout_record = timeout;
  return g;
}

// ---- the fused backward (fused/backward_kernel.cuh) ------------------------------------------
// Its minibatch (row blocks): the tiles of a minibatch's dgrad-down segment must cover the grid
// twice, so that the dgrad gate/up tiles that follow one minibatch behind find their inputs
// done (a smaller one leaves blocks waiting on tiles claimed just before); at least the
// forward's, a divisor of the macrobatch, and few enough that the task list of a worst-case
// plan fits the kernel's table (0 where none does).  MOK_BACKWARD_MINIBATCH (rows) overrides.
int32_t fused_minibatch_blocks(const DeviceWorkspace& ws, const mokConfig_t& c) {
  constexpr int kRows = fused::kBlockM;  // rows of a row block
  const int64_t ring = c.macrobatch_size / kRows;
  const long knob = env::get_int(env::kBackwardMinibatch);
  MOK_CHECK_ARG(knob >= 0 && knob % kRows == 0 && (knob == 0 || ring % (knob / kRows) == 0),
                env::kBackwardMinibatch.name << " = " << knob << ": a multiple of " << kRows
                                             << " rows that divides the macrobatch (" << c.macrobatch_size
                                             << " rows), or 0");
  const int64_t tiles_per_block = gemm::tiles_of(c.intermediate, fused::kBlockN);
  const int64_t want = knob > 0 ? knob / kRows
                                : std::max<int64_t>(c.minibatch_size / kRows, plan::ceil_div(2 * ws.grid, tiles_per_block));
  for (int64_t m = std::max<int64_t>(1, std::min(want, ring)); m <= ring; ++m)
    if (ring % m == 0 && plan::ceil_div(ws.max_blocks, m) <= fused::bwd::kMaxMinibatches) return static_cast<int32_t>(m);
  return 0;
}

// Why the unfused launches run the backward of this config (empty: the fused kernel runs it):
// MOK_BACKWARD_PATH=unfused, or a shape past the kernel's limits (H > 8192 for the comm warps'
// staging rows, more local experts than its table, a grid without a comm block and a compute
// block, a worst-case plan in more minibatches than its table even at one minibatch per
// macrobatch: fused_minibatch_blocks finds one wherever that one fits).
std::string fused_backward_unsupported(const mokConfig_t& c, int64_t grid, int64_t max_blocks) {
  const std::string path = env::get(env::kBackwardPath);
  MOK_CHECK_ARG(path == "fused" || path == "unfused",
                env::kBackwardPath.name << " = " << path << ": expected fused or unfused");
  std::ostringstream why;
  const int64_t ring = c.macrobatch_size / fused::kBlockM;
  if (path != "fused")
    why << env::kBackwardPath.name << "=" << path;
  else if (c.hidden > 8192)
    why << "hidden = " << c.hidden << " > 8192";
  else if (plan_dims(c).local_experts() > fused::bwd::kMaxExperts)
    why << plan_dims(c).local_experts() << " local experts, more than the fused backward's " << fused::bwd::kMaxExperts;
  else if (grid < 2)
    why << "a grid of " << grid << " block (num_blocks)";
  else if (ring < 1 || plan::ceil_div(max_blocks, ring) > fused::bwd::kMaxMinibatches)
    why << "a worst-case plan of " << max_blocks << " row blocks in more than " << fused::bwd::kMaxMinibatches
        << " minibatches";
  return why.str();
}

// The fused backward's minibatch (row blocks) where it runs this call, 0 where the unfused
// launches do (fused_backward_unsupported).
int32_t fused_backward_minibatch(const DeviceWorkspace& ws, const mokConfig_t& c) {
  if (!fused_backward_unsupported(c, ws.grid, ws.max_blocks).empty()) return 0;
  return fused_minibatch_blocks(ws, c);
}

void backward_fused(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, const ref::RankGrads& g,
                    const void* dy, cudaStream_t stream, const Saved& saved, int64_t* timeout,
                    int32_t minibatch_blocks) {
  namespace fb = fused::bwd;
  BackwardBuffers& b = *ws.bwd;
  const int64_t H = c.hidden, I = c.intermediate, Is = c.shared_intermediate, k = c.topk, T = in.num_tokens;
  const int64_t El = plan_dims(c).local_experts(), R = ws.max_rows;
  const bool ep = ws.ep_size > 1;
  const WeightStacks w = weight_stacks(c, in);
  fb::BackwardParams p{};
  p.hidden = static_cast<int32_t>(H);
  p.inter = static_cast<int32_t>(I);
  p.gate_up_pitch = static_cast<int32_t>(gemm::matrix_pitch(w.w_gate));
  p.down_pitch = static_cast<int32_t>(gemm::matrix_pitch(w.w_down));
  p.shared_inter = static_cast<int32_t>(Is);
  p.topk = static_cast<int32_t>(k);
  p.num_tokens = T;
  p.ring_blocks = static_cast<int32_t>(c.macrobatch_size / fused::kBlockM);
  p.minibatch_blocks = minibatch_blocks;
  // EP = 1: no comm blocks, the producer warpgroups' gather warps copy the rows (local_gather);
  // EP >= 2: bwd_num_comm_sms blocks (0: fwd_num_comm_sms) pull them from the peers first
  const int64_t comm = c.bwd_num_comm_sms > 0 ? c.bwd_num_comm_sms : c.fwd_num_comm_sms;
  p.num_comm = c.ep_size == 1 ? 0 : static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(comm, ws.grid - 1)));
  p.num_local = static_cast<int32_t>(El);
  p.shared_blocks = Is > 0 ? gemm::tiles_of(T, fused::kBlockM) : 0;
  p.replay = saved.h ? 0 : 1;
  p.shared_replay = Is > 0 && !saved.shared_h ? 1 : 0;
  p.slot_by_expert = El <= b.num_macro - 1 ? 1 : 0;
  p.n_acc = static_cast<int32_t>(b.n_acc);
  p.n_group = gemm::env_tile_n_group();
  const long start_gather = env::get_int(env::kBackwardStartGather);
  MOK_CHECK_ARG(start_gather >= 0 && start_gather <= 1024,
                env::kBackwardStartGather.name << " = " << start_gather << ": minibatches, 0 to 1024");
  p.start_blocks = static_cast<int32_t>(std::min<int64_t>(start_gather * minibatch_blocks, ws.max_blocks));
  p.max_rows = R;
  p.rows = ws.rows;
  p.expert_offset = ws.expert_offset;
  p.expert_count = ws.expert_count;
  auto bf = [](const void* q) { return static_cast<__nv_bfloat16*>(const_cast<void*>(q)); };
  p.x = bf(in.x);
  p.dy = bf(dy);
  p.topk_weights = in.topk_weights;
  p.routing = routing_of(ws, c, in);
  p.x_rows = bf(b.x_rows);
  p.dy_rows = bf(b.dy_rows);
  p.h = bf(saved.h ? saved.h : b.h);
  p.dh = bf(b.dh);
  p.wa = bf(b.wa);
  p.row_weight = b.row_weight;
  p.partials = b.dtw_partials;
  p.sh_h = bf(saved.shared_h ? saved.shared_h : b.sh_h);
  p.sh_dh = bf(b.sh_dh);
  p.sh_a = bf(b.sh_a);
  p.slots = bf(ws.slots);
  p.shared_dx = bf(ws.shared_out);
  p.ones = b.ones;
  p.dx = bf(g.dx);
  p.d_topk_weights = g.d_topk_weights;
  // The weight gradients' targets (the unfused launch_wgrad_pair's)
  // (in place: the gradients' and main_grads' strides s and ms)
  // Transposed routed weights (the fused kernel's transposed policy): their gradients are stored
  // transposed too, [I, H] and [H, 2I] per expert (the op swaps its operands; gate/up's parts
  // are column ranges, split_n); their rows are the column-major gradients' columns
  auto wgrad = [&](int64_t mo, int64_t no, void* out, float* main_grad, void* out1, float* main_grad1, int64_t split,
                   float* acc, const ref::MatrixStrides& s, const ref::MatrixStrides& ms, bool swapped = false) {
    gemm::WgradParams t{};
    t.mo = swapped ? no : mo;
    t.no = swapped ? mo : no;
    t.split_n = swapped && split > 0 ? 1 : 0;
    t.out = bf(out);
    t.main_grad = main_grad;
    t.out1 = bf(out1);
    t.main_grad1 = main_grad1;
    t.out_split = split;
    t.acc = acc;
    t.out_es = s.expert;
    t.out_rs = swapped ? s.col : s.row;
    t.mg_es = ms.expert;
    t.mg_rs = swapped ? ms.col : ms.row;
    gemm::wgrad_layout(t);
    return t;
  };
  float* const acc_dn = b.n_acc > 0 ? b.acc_dn : nullptr;
  float* const acc_gu = b.n_acc > 0 ? b.acc_gu : nullptr;
  const ref::WeightStrides &gs = g.grad_strides, &ms = g.main_strides;
  p.wg_down = wgrad(H, I, g.dw_down, g.main_down, nullptr, nullptr, 0, acc_dn, gs.w_down, ms.w_down, w.transposed);
  p.wg_gate_up =
      wgrad(2 * I, H, g.dw_gate, g.main_gate, g.dw_up, g.main_up, I, acc_gu, gs.w_gate, ms.w_gate, w.transposed);
  if (Is > 0) {
    p.wg_shared_down = wgrad(H, Is, g.dws_down, g.main_s_down, nullptr, nullptr, 0, nullptr, gs.ws_down, ms.ws_down);
    p.wg_shared_gate_up =
        wgrad(2 * Is, H, g.dws_gate, g.main_s_gate, g.dws_up, g.main_s_up, Is, nullptr, gs.ws_gate, ms.ws_gate);
  }
  p.group = ep_group(ws);
  p.trace = ws.trace;  // MOK_TRACE=1 at creation: the timing ring (tools/trace_forward.py --backward)
  p.trace_cap = ws.trace_cap;
  clear_trace(ws, stream);
  p.counters = b.counters;
  {
    // The schedule's counter layout (schedule_bwd.cuh: counter_offset)
    static_assert(fb::kCounterHeaderWords == static_cast<int64_t>(fused::Counter::kHeader), "the header words");
    const fb::CounterSizes sizes{ws.max_blocks, El * b.num_macro, ws.shared_blocks};
    for (int a = 0; a < static_cast<int>(fb::CounterArray::kNumArrays); ++a)
      p.counter_offset[a] = static_cast<int32_t>(fb::counter_offset(static_cast<fb::CounterArray>(a), sizes));
    const int64_t total = fb::counter_offset(fb::CounterArray::kNumArrays, sizes);
    if (total != b.num_counters)
      MOK_FAIL(mokInternalError, "fused backward: " << total << " counter words, the workspace has " << b.num_counters);
  }
  // Each wait's deadline: the config's, capped by MOK_GEMM_TIMEOUT_S (as the grouped launches')
  const double knob_s = std::max(0.001, std::strtod(env::get(env::kGemmTimeout).c_str(), nullptr));
  p.timeout_ns = static_cast<uint64_t>(std::min<double>(c.timeout_s, knob_s) * 1e9);
  p.timeout_record = timeout;

  // Tensor maps (gemm::tensor_map_2d): K-major A boxes of BLOCK_M rows, K-major B halves of
  // BLOCK_N / 2 rows, N-major B and the MN-major wgrad operands BLOCK_K rows (of K)
  constexpr int kA = fused::kBlockM, kB = fused::kHalfN, kK = fused::kBlockK;
  fb::Maps m{};
  auto tm = [](const void* q, int64_t rows, int64_t cols, int box) { return gemm::tensor_map_2d(q, rows, cols, box); };
  // (the routed weights' maps: _k and _n name their orientation with row-major weights; the
  // transposed policy reads them the other way, its boxes swapped)
  const int kReplayB = w.transposed ? kK : kB, kDgradB = w.transposed ? kB : kK;
  m.x_rows_k = tm(b.x_rows, R, H, kA);
  m.w_gate_k = gemm::tensor_map_stack(w.w_gate, kReplayB);
  m.w_up_k = gemm::tensor_map_stack(w.w_up, kReplayB);
  m.dy_rows_k = tm(b.dy_rows, R, H, kA);
  m.w_down_n = gemm::tensor_map_stack(w.w_down, kDgradB);
  m.dh_k = tm(b.dh, R, 2 * I, kA);
  m.h_k = tm(p.h, R, 2 * I, kA);
  m.w_gate_n = gemm::tensor_map_stack(w.w_gate, kDgradB);
  m.w_up_n = gemm::tensor_map_stack(w.w_up, kDgradB);
  m.dy_rows_mn = tm(b.dy_rows, R, H, kK);
  m.wa_mn = tm(b.wa, R, I, kK);
  m.dh_mn = tm(b.dh, R, 2 * I, kK);
  m.x_rows_mn = tm(b.x_rows, R, H, kK);
  if (Is > 0 && T > 0) {
    m.x_k = tm(in.x, T, H, kA);
    m.ws_gate_k = gemm::tensor_map_stack(w.ws_gate, kB);
    m.ws_up_k = gemm::tensor_map_stack(w.ws_up, kB);
    m.dy_k = tm(dy, T, H, kA);
    m.ws_down_n = gemm::tensor_map_stack(w.ws_down, kK);
    m.sh_dh_k = tm(b.sh_dh, T, 2 * Is, kA);
    m.sh_h_k = tm(p.sh_h, T, 2 * Is, kA);
    m.ws_gate_n = gemm::tensor_map_stack(w.ws_gate, kK);
    m.ws_up_n = gemm::tensor_map_stack(w.ws_up, kK);
    m.dy_mn = tm(dy, T, H, kK);
    m.sh_a_mn = tm(b.sh_a, T, Is, kK);
    m.sh_dh_mn = tm(b.sh_dh, T, 2 * Is, kK);
    m.x_mn = tm(in.x, T, H, kK);
  } else {
    // No shared rows: its only tiles are the wgrad zeros, which load nothing
    m.x_k = m.ws_gate_k = m.ws_up_k = m.dy_k = m.sh_dh_k = m.sh_h_k = m.x_rows_k;
    m.ws_down_n = m.ws_gate_n = m.ws_up_n = m.w_down_n;
    m.dy_mn = m.sh_a_mn = m.sh_dh_mn = m.x_mn = m.x_rows_mn;
  }
  // The dgrad-down epilogues' TMA stores of dg | du and w·a (epilogue_dgrad_swiglu_staged)
  m.dh_st = tm(b.dh, R, 2 * I, 64);
  m.wa_st = tm(b.wa, R, I, 64);
  m.sh_dh_st = Is > 0 && T > 0 ? tm(b.sh_dh, T, 2 * Is, 64) : m.dh_st;
  m.sh_a_st = Is > 0 && T > 0 ? tm(b.sh_a, T, Is, 64) : m.wa_st;
  // The routed wgrad tiles' TMA-store epilogue (ops_bwd/wgrad.cuh), over maps of the gradients as
  // stored (64 x 64 boxes; rows between experts: out_es / out_rs), where a 2-D map can follow them
  {
    auto stack_map = [&](const gemm::WgradParams& t, __nv_bfloat16* out, int64_t* pitch) {
      *pitch = t.out_es / t.out_rs;
      const int64_t rows = t.split_n ? t.mo : (t.out_split > 0 ? t.out_split : t.mo);
      const int64_t cols = t.split_n ? t.n_part : t.no;
      return gemm::tensor_map_2d(out, (El - 1) * *pitch + rows, cols, 64, 2, t.out_rs);
    };
    auto storable = [](const gemm::WgradParams& t, const void* out) {
      return out != nullptr && (reinterpret_cast<uintptr_t>(out) & 15u) == 0 && t.out_rs % 8 == 0 &&
             t.out_es % t.out_rs == 0;
    };
    const bool ok = El > 0 && storable(p.wg_down, p.wg_down.out) && storable(p.wg_gate_up, p.wg_gate_up.out) &&
                    storable(p.wg_gate_up, p.wg_gate_up.out1);
    p.wgrad_tma = ok ? 1 : 0;
    if (ok) {
      m.wg_down_out = stack_map(p.wg_down, p.wg_down.out, &p.wg_down_pitch);
      m.wg_gate_out = stack_map(p.wg_gate_up, p.wg_gate_up.out, &p.wg_gate_up_pitch);
      m.wg_up_out = stack_map(p.wg_gate_up, p.wg_gate_up.out1, &p.wg_gate_up_pitch);
    } else {
      m.wg_down_out = m.wg_gate_out = m.wg_up_out = m.x_rows_k;  // never read
    }
  }
  MOK_CUDA_CHECK(cudaMemsetAsync(b.counters, 0, static_cast<size_t>(b.num_counters) * sizeof(int32_t), stream));
  if (T > 0 && !ep)  // masked routes' d topk_weights are 0 (EP >= 2: the start zeroed the region's)
    MOK_CUDA_CHECK(cudaMemsetAsync(g.d_topk_weights, 0, static_cast<size_t>(T * k) * sizeof(float), stream));
  fused::launch_for_orientation(
      w.transposed, ws.grid, stream, [](auto pol) { return fb::fused_backward_kernel<decltype(pol)>; },
      [](auto pol) { return fb::kSmemBytes<decltype(pol)>; }, m, p);
}

}  // namespace

std::string unsupported_transposed(const mokConfig_t& c, bool backward) {
  if (env::get(env::kForwardPath) == "unfused")
    return "MOK_FORWARD_PATH=unfused reads row-major routed weights only; the fused forward reads column-major "
           "(transposed) ones";
  if (!backward) return "";
  // The grid is num_blocks where set, else the device's SM count (at least 2 on any GPU mok runs on)
  const std::string why =
      fused_backward_unsupported(c, c.num_blocks > 0 ? c.num_blocks : 2, workspace_layout(c).max_blocks);
  if (why.empty()) return "";
  return "the CUDA backward of this config runs separate launches (" + why +
         "), which read row-major routed weights only, not column-major (transposed) ones";
}

void prepare_backward(DeviceWorkspace& ws, const mokConfig_t& c) {
  if (ws.bwd != nullptr) return;
  const DeviceGuard guard(ws.device);
  // Every kernel of the backward loaded before any rank of a group can spin in a barrier
  cudaFuncAttributes a;
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, bwd_gather_kernel));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, bwd_push_kernel));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, bwd_gather_quantize_kernel));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, bwd_tables_kernel));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, bwd_dtw_kernel));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, bwd_dx_kernel));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, fused::bwd::fused_backward_kernel<fused::PolicyBf16>));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, fused::bwd::fused_backward_kernel<fused::PolicyBf16Transposed>));
  gemm::load_backward_kernels();
  ep_load_kernels();
  load_plan_kernels();
  ws.bwd = create_backward_buffers(ws, c);
}

void destroy_backward_buffers(BackwardBuffers* b) {
  if (b == nullptr) return;
  if (b->block) cudaFree(b->block);
  delete b;
}

void backward_unfused(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, const ref::RankGrads& g,
                      const void* dy, cudaStream_t stream, const Saved& saved, int64_t* timeout);
void backward_fp8(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, const ref::RankGrads& g,
                  const void* dy, cudaStream_t stream, const Saved& saved, int64_t* timeout);

namespace {
// Transposed (column-major) routed weights, before any launch: only the fused backward reads
// them (its transposed policy; the runtime checked that their gradients share their
// orientation); the unfused launches read row-major weights.
void check_orientations(const DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in) {
  if (!in.strides.w_gate.col_major()) return;
  const std::string why = fused_backward_unsupported(c, ws.grid, ws.max_blocks);
  MOK_CHECK_ARG(why.empty(), "the routed weights are column-major (transposed), which only the fused backward reads, "
                             "and this call takes the unfused launches ("
                                 << why << ")");
}
}  // namespace

void backward_phase(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, const ref::RankGrads& g,
                    const void* dy, void* stream_ptr, ForwardPhase phase, const Saved& saved) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const DeviceGuard guard(ws.device);
  const bool capturing = stream_capturing(stream_ptr);
  constexpr int kErr = kErrorWords;  // route error words, then the timeout record
  int64_t* timeout = ws.errors + kErr;
  if (phase == ForwardPhase::kStart) check_orientations(ws, c, in);
  switch (phase) {
    case ForwardPhase::kStart:
      if (ws.bwd == nullptr) {
        MOK_CHECK_ARG(!capturing, "the first backward call of a workspace allocates its backward buffers and cannot "
                                  "be captured into a CUDA graph: run one backward before capturing");
        prepare_backward(ws, c);
      }
      call_start(ws, c, in, stream_ptr, capturing, dy);  // EP >= 2: dy and the weights published too
      return;
    case ForwardPhase::kPlan:
      call_plan(ws, c, in, stream_ptr);  // the forward's plan, from the same ids
      return;
    case ForwardPhase::kLayer:
      break;
  }
  if (c.precision == mokPrecisionFP8Block) {
    backward_fp8(ws, c, in, g, dy, stream, saved, timeout);
  } else if (const int32_t minibatch = fused_backward_minibatch(ws, c); minibatch > 0) {
    backward_fused(ws, c, in, g, dy, stream, saved, timeout, minibatch);
  } else {
    backward_unfused(ws, c, in, g, dy, stream, saved, timeout);
  }
  call_finish(ws, stream, capturing);
}

void backward_unfused(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, const ref::RankGrads& g,
                      const void* dy, cudaStream_t stream, const Saved& saved, int64_t* timeout) {
  const DeviceGuard guard(ws.device);
  const int64_t H = c.hidden, I = c.intermediate, Is = c.shared_intermediate, k = c.topk, T = in.num_tokens;
  const int64_t El = plan_dims(c).local_experts();
  const bool ep = ws.ep_size > 1;
  BackwardBuffers& b = *ws.bwd;
  const plan::RoutingView v = routing_of(ws, c, in);
  const ep::Group group = ep ? ep_group(ws) : ep::Group{};
  const int64_t row_vecs = H * 2 / 16;
  const int32_t max_blocks = static_cast<int32_t>(ws.max_blocks);
  const int64_t R = ws.max_rows;
  // Tables, ones; rows, weights (EP >= 2: from the rows' source ranks, whatever this rank's T)
  gather_backward_rows(ws, c, in, dy, group, stream);

  // Routed experts: replay (unless the forward saved h), dgrad down + SwiGLU backward, dgrad
  // gate/up into the route slots
  void* const h = saved.h ? saved.h : b.h;
  if (!saved.h)
    gemm::launch_grouped_gemm(with_b(gemm::gate_up_preact_args(b.x_rows, R, H, in.w_gate, in.w_up, El, I,
                                                               ws.block_expert, max_blocks, b.h),
                                     in.strides.w_gate, c, timeout),
                              stream);
  gemm::launch_grouped_gemm(
      gemm::with_kind_tile(with_b(gemm::dgrad_down_swiglu_args(b.dy_rows, R, H, in.w_down, El, I, ws.block_expert,
                                                               max_blocks, h, b.row_weight, b.dh, b.wa, b.dtw_partials),
                                  in.strides.w_down, c, timeout)),
      stream);
  // EP = 1: the epilogue scatters each row into its slot; EP >= 2: rows in plan order, then
  // pushed to their home ranks' slots (bwd_push_kernel)
  gemm::GroupedGemmArgs dx_rows = gemm::dgrad_gate_up_args(b.dh, R, I, in.w_gate, in.w_up, El, H, ws.block_expert,
                                                           max_blocks, ep ? b.dx_rows : ws.slots);
  if (!ep) {
    dx_rows.epilogue = static_cast<int32_t>(gemm::Epilogue::kScatter);
    dx_rows.plan_rows = ws.rows;
    dx_rows.topk = static_cast<int32_t>(k);
  }
  gemm::launch_grouped_gemm(with_b(dx_rows, in.strides.w_gate, c, timeout), stream);
  if (ep) {
    bwd_push_kernel<<<528, 256, 0, stream>>>(group, ws.rows, ws.expert_offset, static_cast<int32_t>(El),
                                             static_cast<int32_t>(k), row_vecs, static_cast<const uint4*>(b.dx_rows));
    MOK_CUDA_CHECK(cudaGetLastError());
  }

  // Routed wgrad, macrobatch by macrobatch (ascending: the fp32 partial sums fold in order)
  for (int64_t m = 0; m < b.num_macro; ++m) {
    const int32_t* t = b.tables + m * table_words(El);
    gemm::GroupedWgradArgs w;
    w.rows = R;
    w.num_experts = El;
    w.expert_range = t;
    w.expert_offset = t + 2;
    w.expert_count = t + 2 + El;
    w.expert_mode = t + 2 + 2 * El;
    w.acc_slot = b.n_acc > 0 ? t + 2 + 3 * El : nullptr;  // no expert spans a macrobatch otherwise
    w.timeout_s = c.timeout_s;
    w.timeout_record = timeout;
    launch_wgrad_pair(w,
                      WgradOperands{b.dy_rows, b.wa, b.dh, b.x_rows, H, I, g.dw_gate, g.dw_up, g.dw_down, g.main_gate,
                                    g.main_up, g.main_down, b.n_acc > 0 ? b.acc_gu : nullptr,
                                    b.n_acc > 0 ? b.acc_dn : nullptr, g.grad_strides.w_gate, g.grad_strides.w_down,
                                    g.main_strides.w_gate, g.main_strides.w_down},
                      stream);
  }

  // The shared expert over the tokens themselves (weight 1)
  if (Is > 0) {
    const int32_t sblocks = static_cast<int32_t>(plan::ceil_div(T, gemm::TileConfig::kBlockM));
    void* const sh_h = saved.shared_h ? saved.shared_h : b.sh_h;
    if (T > 0) {
      if (!saved.shared_h)
        gemm::launch_grouped_gemm(with_b(gemm::gate_up_preact_args(in.x, T, H, in.ws_gate, in.ws_up, 1, Is,
                                                                   ws.shared_block, sblocks, b.sh_h),
                                         in.strides.ws_gate, c, timeout),
                                  stream);
      gemm::launch_grouped_gemm(
          gemm::with_kind_tile(with_b(gemm::dgrad_down_swiglu_args(dy, T, H, in.ws_down, 1, Is, ws.shared_block,
                                                                   sblocks, sh_h, b.ones, b.sh_dh, b.sh_a, nullptr),
                                      in.strides.ws_down, c, timeout)),
          stream);
      gemm::launch_grouped_gemm(with_b(gemm::dgrad_gate_up_args(b.sh_dh, T, Is, in.ws_gate, in.ws_up, 1, H,
                                                                ws.shared_block, sblocks, ws.shared_out),
                                       in.strides.ws_gate, c, timeout),
                                stream);
    }
    gemm::GroupedWgradArgs w;
    w.rows = T;
    w.num_experts = 1;
    w.expert_offset = b.shared_table;
    w.expert_count = b.shared_table + 2;
    w.timeout_s = c.timeout_s;
    w.timeout_record = timeout;
    launch_wgrad_pair(w,
                      WgradOperands{T > 0 ? dy : nullptr, b.sh_a, b.sh_dh, T > 0 ? in.x : nullptr, H, Is, g.dws_gate,
                                    g.dws_up, g.dws_down, g.main_s_gate, g.main_s_up, g.main_s_down, nullptr, nullptr,
                                    g.grad_strides.ws_gate, g.grad_strides.ws_down, g.main_strides.ws_gate,
                                    g.main_strides.ws_down},
                      stream);
  }

  // d topk_weights (0 for masked routes; EP >= 2: pushed home) and dx
  if (T > 0 && !ep) MOK_CUDA_CHECK(cudaMemsetAsync(g.d_topk_weights, 0, static_cast<size_t>(T * k) * sizeof(float), stream));
  if (T > 0 || ep) {
    bwd_dtw_kernel<<<264, 256, 0, stream>>>(group, ws.rows, ws.expert_offset, static_cast<int32_t>(El), b.dtw_partials,
                                            gemm::tiles_of(I, gemm::kDtwChunk), static_cast<int32_t>(k),
                                            g.d_topk_weights);
    MOK_CUDA_CHECK(cudaGetLastError());
  }
  // EP >= 2: every rank's pushes (dx rows, d topk_weights) landed in this rank's region
  if (ep) ep_end(ws, c, timeout, stream);
  if (T > 0) {
    bwd_dx_kernel<<<static_cast<unsigned>((T + 3) / 4), 128, 0, stream>>>(
        v, static_cast<int>(ws.ep_rank), b.ones, static_cast<const uint4*>(ws.slots),
        Is > 0 ? static_cast<const uint4*>(ws.shared_out) : nullptr, T, row_vecs,
        static_cast<uint4*>(static_cast<void*>(g.dx)));
    MOK_CUDA_CHECK(cudaGetLastError());
    if (ep)
      MOK_CUDA_CHECK(cudaMemcpyAsync(g.d_topk_weights, ws.regions[ws.ep_rank] + ws.sym.dtw,
                                     static_cast<size_t>(T * k) * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  }
}

// fp8_block's backward as launches (routed and shared experts; EP >= 2 as the bf16 launches:
// rows pulled from their source ranks, dx rows and d topk_weights pushed home, the end barrier):
// the CPU reference's recipe (src/ref expert_backward_fp8, docs/precision.md) on the GPU kinds:
//   the route weights of the plan's rows; h the forward's saved pre-activations (or the gate/up
//   replay on x quantised once per token, its rows gathered in e4m3); dy likewise, quantised per
//   token and 128 of H and its rows gathered in e4m3;
//   dgrad down on W_down's transposed copy, da stored in fp32, then the SwiGLU-backward pass:
//   dh in e4m3 (the dgrad gate/up kind's A), the router-gradient partials, and a, dg, du
//   quantised per channel and 128 rows (wgrad operands); dgrad gate/up on W_gate's and W_up's
//   transposed copies (a K split), scattered to the route slots; x and w·dy quantised per
//   channel and 128 rows (x and dy read through the plan's rows in place; EP >= 2 the pulled
//   rows), and the fp8 wgrad kind per weight; d topk_weights and dx as the bf16 launches.
void backward_fp8(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, const ref::RankGrads& g,
                  const void* dy, cudaStream_t stream, const Saved& saved, int64_t* timeout) {
  const DeviceGuard guard(ws.device);
  const int64_t H = c.hidden, I = c.intermediate, k = c.topk, T = in.num_tokens;
  const int64_t El = plan_dims(c).local_experts();
  const bool ep = ws.ep_size > 1;
  for (int w = 0; w < (c.shared_intermediate > 0 ? 6 : 3); ++w)
    MOK_CHECK_ARG(in.fp8_qt[w] != nullptr, "config.precision = fp8_block: the CUDA backward reads the weights' "
                                           "transposed e4m3 copies (mokFp8Weight_t.qt, mok.quantize_weights with "
                                           "transposed=True); weight "
                                               << w << " has none");
  const ref::WeightStrides& gs = g.grad_strides;
  const ref::WeightStrides& ms = g.main_strides;
  // A weight gradient and its main_grad in one orientation: row-major as they are, or both
  // column-major (written as the row-major transposes by the wgrad with its operands swapped)
  const auto same_orientation = [](const void* grad, const ref::MatrixStrides& a, const void* main,
                                   const ref::MatrixStrides& b) {
    return grad == nullptr || main == nullptr || a.col_major() == b.col_major();
  };
  MOK_CHECK_ARG(same_orientation(g.dw_gate, gs.w_gate, g.main_gate, ms.w_gate) &&
                    same_orientation(g.dw_up, gs.w_up, g.main_up, ms.w_up) &&
                    same_orientation(g.dw_down, gs.w_down, g.main_down, ms.w_down) &&
                    same_orientation(g.dws_gate, gs.ws_gate, g.main_s_gate, ms.ws_gate) &&
                    same_orientation(g.dws_up, gs.ws_up, g.main_s_up, ms.ws_up) &&
                    same_orientation(g.dws_down, gs.ws_down, g.main_s_down, ms.ws_down),
                "config.precision = fp8_block: a weight's gradient and main_grad must both be row-major or both "
                "column-major");
  BackwardBuffers& b = *ws.bwd;
  const plan::RoutingView v = routing_of(ws, c, in);
  const int64_t R = ws.max_rows;
  const int32_t max_blocks = static_cast<int32_t>(ws.max_blocks);
  const bool pow2 = c.fp8_pow2_scales != 0;
  const int64_t Is = c.shared_intermediate;
  const Fp8BwdParts parts = fp8_bwd_parts(R, H, I, c.max_tokens, Is);
  const int64_t t4 = fp8_t4(c.max_tokens);
  if (ws.fp8_bwd == nullptr) {
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, static_cast<size_t>(parts.total));
    if (err == cudaErrorMemoryAllocation)
      MOK_FAIL(mokOutOfMemory, "workspace: cudaMalloc of " << parts.total << " bytes for fp8_block's backward failed "
                                                           "(out of device memory)");
    MOK_CUDA_CHECK(err);
    ws.fp8_bwd = static_cast<uint8_t*>(p);
  }
  uint8_t* const f = ws.fp8_bwd;
  auto fl = [&](int64_t offset) { return reinterpret_cast<float*>(f + offset); };
  const int64_t row_vecs = H * 2 / 16;
  // The ones (dx's combine weights) and the route weights of the plan's rows (EP >= 2: from the
  // rows' source ranks).  EP = 1: x and dy are read in place (no bf16 row copies), quantised once
  // per token, then their rows gathered in e4m3.  EP >= 2: each row of x and dy pulled once from
  // its source rank's region, kept in bf16 (x_rows, dy_rows: the column quantisers' input) and
  // quantised from the same loads (bwd_gather_quantize_kernel; the same bits per row)
  const ep::Group group = ep ? ep_group(ws) : ep::Group{};
  gather_backward_rows(ws, c, in, dy, group, stream, /*copy_rows=*/false);
  const int32_t* const live_rows = ws.expert_offset + El;  // the plan's rows in use (device)
  auto gather_quantized = [&](const void* src) {  // src [T, H] bf16 -> the plan's rows at parts.dy
    gemm::launch_quantize_rows(src, f + parts.tok, fl(parts.tok_scales), T, H, pow2, stream, t4);
    if (T > 0)
      launch_gather_e4m3_rows(f + parts.tok, fl(parts.tok_scales), t4, ws.rows, ws.expert_offset,
                              static_cast<int32_t>(El), H, f + parts.dy, fl(parts.dy_scales), R, stream);
  };
  auto pull_rows = [&](bool of_dy, bool quantize) {  // EP >= 2: x or dy rows (and e4m3 at parts.dy)
    bwd_gather_quantize_kernel<<<528, 256, 0, stream>>>(
        group, of_dy, ws.rows, ws.expert_offset, static_cast<int32_t>(El), H,
        static_cast<__nv_bfloat16*>(of_dy ? b.dy_rows : b.x_rows), quantize ? f + parts.dy : nullptr,
        quantize ? fl(parts.dy_scales) : nullptr, R, pow2);
    MOK_CUDA_CHECK(cudaGetLastError());
  };
  auto scaled = [&](gemm::GroupedGemmArgs a, const float* a_scales, const float* b0s, const float* b1s) {
    a.operand_bytes = 1;
    a.a_scales = a_scales;
    a.a_scales_ld = R;
    a.b0_scales = b0s;
    a.b1_scales = b1s;
    a.timeout_s = c.timeout_s;
    a.timeout_record = timeout;
    return a;
  };
  // h: the forward's, or the replay on x quantised once per token (in dy's buffers, before dy):
  // the routed rows gathered from it, and the shared expert's tokens read from it as they are
  void* const h = saved.h ? saved.h : b.h;
  const int32_t sblocks = static_cast<int32_t>(plan::ceil_div(T, gemm::TileConfig::kBlockM));
  if (ep) {
    if (Is > 0 && !saved.shared_h)
      gemm::launch_quantize_rows(in.x, f + parts.tok, fl(parts.tok_scales), T, H, pow2, stream, t4);
    pull_rows(false, !saved.h);
  } else if (!saved.h) {
    gather_quantized(in.x);
  } else if (Is > 0 && !saved.shared_h) {
    gemm::launch_quantize_rows(in.x, f + parts.tok, fl(parts.tok_scales), T, H, pow2, stream, t4);
  }
  if (Is > 0 && !saved.shared_h && T > 0) {
    gemm::GroupedGemmArgs sgu =
        scaled(gemm::with_tile_n(gemm::gate_up_preact_args(f + parts.tok, T, H, in.fp8_q[3], in.fp8_q[4], 1, Is,
                                                           ws.shared_block, sblocks, b.sh_h),
                                 256),
               fl(parts.tok_scales), in.fp8_scales[3], in.fp8_scales[4]);
    sgu.a_scales_ld = t4;
    gemm::launch_grouped_gemm(sgu, stream);
  }
  if (!saved.h) {
    gemm::launch_grouped_gemm(
        scaled(gemm::with_tile_n(gemm::gate_up_preact_args(f + parts.dy, R, H, in.fp8_q[0], in.fp8_q[1], El, I,
                                                           ws.block_expert, max_blocks, b.h),
                                 256),
               fl(parts.dy_scales), in.fp8_scales[0], in.fp8_scales[1]),
        stream);
  }
  // dy per row and 128 of H (the shared expert's per token)
  if (ep) {
    pull_rows(true, true);
    if (Is > 0)  // the shared expert's dy, its own tokens per token (tok)
      gemm::launch_quantize_rows(dy, f + parts.tok, fl(parts.tok_scales), T, H, pow2, stream, t4);
  } else {
    gather_quantized(dy);
  }
  // da = dy · W_down in fp32 (into dh's bytes: [R, 2I] bf16 is [R, I] fp32), then the SwiGLU
  // backward's pass: dh in e4m3 and its scales, the router-gradient partials, and a, dg, du
  // quantised per channel and 128 rows for the wgrad kind (launch_swiglu_bwd_fp8; the same bits
  // as the dgrad-down kind's SwiGLU-backward epilogue then three column passes, 5.6 % faster on
  // dsv3's forward + backward: docs/perf.md session 29)
  auto dgrad_down_f32 = [&](const void* a, int64_t a_rows, const void* w_qt, int64_t experts, int64_t n,
                            const int32_t* block_expert, int32_t blocks, void* da) {
    gemm::GroupedGemmArgs d = gemm::down_args(a, a_rows, H, w_qt, experts, n, block_expert, blocks, da);
    d.operand_bytes = 1;
    d.b_scales_transposed = true;
    d.epilogue = static_cast<int32_t>(gemm::Epilogue::kStoreF32);
    return d;
  };
  // (parts: the e4m3 outputs' offsets in the fp8 buffers -- dh, then a, dg, du transposed -- and
  // their scales')
  auto swiglu_pass = [&](void* da, const void* hh, const float* rw, int64_t rows, int64_t inter, int64_t valid,
                         const int32_t* live, int64_t scales_ld, float* partials, const int64_t (&q)[4],
                         const int64_t (&qs)[4]) {
    gemm::SwiGLUBwdFp8Args sp;
    sp.da = static_cast<const float*>(da);
    sp.h = hh;
    sp.row_weight = rw;
    sp.rows = rows;
    sp.inter = inter;
    sp.valid_rows = valid;
    sp.live_rows = live;
    sp.dh_q = f + q[0];
    sp.dh_scales = fl(qs[0]);
    sp.scales_ld = scales_ld;
    sp.dtw_partials = partials;
    sp.at = f + q[1];
    sp.at_scales = fl(qs[1]);
    sp.dgt = f + q[2];
    sp.dgt_scales = fl(qs[2]);
    sp.dut = f + q[3];
    sp.dut_scales = fl(qs[3]);
    sp.pow2 = pow2;
    gemm::launch_swiglu_bwd_fp8(sp, stream);
  };
  gemm::launch_grouped_gemm(scaled(dgrad_down_f32(f + parts.dy, R, in.fp8_qt[2], El, I, ws.block_expert, max_blocks,
                                                  b.dh),
                                   fl(parts.dy_scales), in.fp8_scales[2], in.fp8_scales[2]),
                            stream);
  swiglu_pass(b.dh, h, b.row_weight, R, I, -1, live_rows, R, b.dtw_partials, {parts.dh, parts.at, parts.dgt, parts.dut},
              {parts.dh_scales, parts.at_scales, parts.dgt_scales, parts.dut_scales});
  // dgrad gate/up on the two transposed copies, each row into its route slot (EP >= 2: rows in
  // plan order, then pushed to their home ranks' slots, as the bf16 launches)
  gemm::GroupedGemmArgs dg = gemm::dgrad_gate_up_e4m3_args(f + parts.dh, R, I, in.fp8_qt[0], in.fp8_qt[1], El, H,
                                                           ws.block_expert, max_blocks, ep ? b.dx_rows : ws.slots);
  if (!ep) {
    dg.epilogue = static_cast<int32_t>(gemm::Epilogue::kScatter);
    dg.plan_rows = ws.rows;
    dg.topk = static_cast<int32_t>(k);
  }
  gemm::launch_grouped_gemm(scaled(dg, fl(parts.dh_scales), in.fp8_scales[0], in.fp8_scales[1]), stream);
  if (ep) {
    bwd_push_kernel<<<528, 256, 0, stream>>>(group, ws.rows, ws.expert_offset, static_cast<int32_t>(El),
                                             static_cast<int32_t>(k), row_vecs, static_cast<const uint4*>(b.dx_rows));
    MOK_CUDA_CHECK(cudaGetLastError());
  }
  // The wgrad operands, transposed per channel and 128 rows: x, w·dy (the row weights applied
  // in fp32 by the quantiser), a, dg, du; then dW_down = (w·dy)ᵀ · a, dW_gate = dgᵀ · x, dW_up = duᵀ · x
  // (x and dy through the plan's rows in place; only the blocks of rows in use)
  // (EP >= 2: the pulled bf16 rows, in plan order)
  gemm::launch_quantize_cols(ep ? b.x_rows : in.x, H, R, H, f + parts.xt, fl(parts.xt_scales), pow2, stream, nullptr,
                             ep ? nullptr : ws.rows, live_rows);
  gemm::launch_quantize_cols(ep ? b.dy_rows : dy, H, R, H, f + parts.wdyt, fl(parts.wdyt_scales), pow2, stream,
                             b.row_weight, ep ? nullptr : ws.rows, live_rows);
  // dW [mo, no] = aᵀ · b; a column-major gradient (and main_grad) as its row-major transpose
  // dWᵀ = bᵀ · a: the operands swapped, the column stride its row stride
  // (rows, experts: the operands' rows and their experts' segments; the routed plan's by default)
  struct Segments {
    int64_t rows, experts;
    const int32_t* offset;
    const int32_t* count;
  };
  const Segments routed{R, El, ws.expert_offset, ws.expert_count};
  auto wgrad = [&](const void* a, const float* as, int64_t mo, const void* bb, const float* bs, int64_t no, void* out,
                   const ref::MatrixStrides& os, float* main_grad, const ref::MatrixStrides& mgs,
                   const Segments& seg) {
    if (out == nullptr && main_grad == nullptr) return;
    const bool swap = (out != nullptr ? os : mgs).col_major();
    gemm::GroupedWgradFp8Args w;
    w.a = swap ? bb : a;
    w.a_scales = swap ? bs : as;
    w.b = swap ? a : bb;
    w.b_scales = swap ? as : bs;
    w.rows = seg.rows;
    w.mo = swap ? no : mo;
    w.no = swap ? mo : no;
    if (out != nullptr) {
      w.out_es = os.expert_or(mo, no);
      w.out_rs = swap ? os.col : os.row_or(no);
    }
    if (main_grad != nullptr) {
      w.mg_es = mgs.expert_or(mo, no);
      w.mg_rs = swap ? mgs.col : mgs.row_or(no);
    }
    w.num_experts = seg.experts;
    w.expert_offset = seg.offset;
    w.expert_count = seg.count;
    w.out = out;
    w.main_grad = main_grad;
    w.timeout_s = c.timeout_s;
    w.timeout_record = timeout;
    gemm::launch_grouped_wgrad_fp8(w, stream);
  };
  wgrad(f + parts.wdyt, fl(parts.wdyt_scales), H, f + parts.at, fl(parts.at_scales), I, g.dw_down, gs.w_down,
        g.main_down, ms.w_down, routed);
  wgrad(f + parts.dgt, fl(parts.dgt_scales), I, f + parts.xt, fl(parts.xt_scales), H, g.dw_gate, gs.w_gate,
        g.main_gate, ms.w_gate, routed);
  wgrad(f + parts.dut, fl(parts.dut_scales), I, f + parts.xt, fl(parts.xt_scales), H, g.dw_up, gs.w_up, g.main_up,
        ms.w_up, routed);

  // The shared expert over the tokens themselves (weight 1), the same kinds: its h (saved, or
  // replayed above on x quantised per token), dgrad down with
  // the SwiGLU backward on dy quantised per token (tok), dgrad gate/up into its dx rows, and its
  // weight gradients over the T tokens as one expert (T rounded up to 128 with zero rows)
  if (Is > 0) {
    const int64_t t128 = plan::ceil_div(T, 128) * 128;
    void* const sh_h = saved.shared_h ? saved.shared_h : b.sh_h;  // (replayed above, beside the routed h)
    if (T > 0) {
      gemm::GroupedGemmArgs sdd =
          scaled(dgrad_down_f32(f + parts.tok, T, in.fp8_qt[5], 1, Is, ws.shared_block, sblocks, b.sh_dh),
                 fl(parts.tok_scales), in.fp8_scales[5], in.fp8_scales[5]);
      sdd.a_scales_ld = t4;
      gemm::launch_grouped_gemm(sdd, stream);
      swiglu_pass(b.sh_dh, sh_h, nullptr, t128, Is, T, nullptr, t4, nullptr,
                  {parts.sdh, parts.sat, parts.sdgt, parts.sdut},
                  {parts.sdh_scales, parts.sat_scales, parts.sdgt_scales, parts.sdut_scales});
      gemm::GroupedGemmArgs sdg =
          scaled(gemm::dgrad_gate_up_e4m3_args(f + parts.sdh, T, Is, in.fp8_qt[3], in.fp8_qt[4], 1, H,
                                               ws.shared_block, sblocks, ws.shared_out),
                 fl(parts.sdh_scales), in.fp8_scales[3], in.fp8_scales[4]);
      sdg.a_scales_ld = t4;
      gemm::launch_grouped_gemm(sdg, stream);
      gemm::launch_quantize_cols(in.x, H, t128, H, f + parts.sxt, fl(parts.sxt_scales), pow2, stream, nullptr, nullptr,
                                 nullptr, T);
      gemm::launch_quantize_cols(dy, H, t128, H, f + parts.sdyt, fl(parts.sdyt_scales), pow2, stream, nullptr,
                                 nullptr, nullptr, T);
    }
    // (no tokens: the kind writes zeros, its maps over the outputs)
    const Segments shared{t128, 1, b.shared_table, b.shared_table + 2};
    wgrad(f + parts.sdyt, fl(parts.sdyt_scales), H, f + parts.sat, fl(parts.sat_scales), Is, g.dws_down, gs.ws_down,
          g.main_s_down, ms.ws_down, shared);
    wgrad(f + parts.sdgt, fl(parts.sdgt_scales), Is, f + parts.sxt, fl(parts.sxt_scales), H, g.dws_gate, gs.ws_gate,
          g.main_s_gate, ms.ws_gate, shared);
    wgrad(f + parts.sdut, fl(parts.sdut_scales), Is, f + parts.sxt, fl(parts.sxt_scales), H, g.dws_up, gs.ws_up,
          g.main_s_up, ms.ws_up, shared);
  }
  // d topk_weights (0 for masked routes; EP >= 2: pushed home, the start zeroed them) and dx
  if (T > 0 && !ep) MOK_CUDA_CHECK(cudaMemsetAsync(g.d_topk_weights, 0, static_cast<size_t>(T * k) * sizeof(float), stream));
  if (T > 0 || ep) {
    bwd_dtw_kernel<<<264, 256, 0, stream>>>(group, ws.rows, ws.expert_offset, static_cast<int32_t>(El),
                                            b.dtw_partials, static_cast<int32_t>(I / 128), static_cast<int32_t>(k),
                                            g.d_topk_weights);
    MOK_CUDA_CHECK(cudaGetLastError());
  }
  // EP >= 2: every rank's pushes (dx rows, d topk_weights) landed in this rank's region
  if (ep) ep_end(ws, c, timeout, stream);
  if (T > 0) {
    bwd_dx_kernel<<<static_cast<unsigned>((T + 3) / 4), 128, 0, stream>>>(
        v, static_cast<int>(ws.ep_rank), b.ones, static_cast<const uint4*>(ws.slots),
        Is > 0 ? static_cast<const uint4*>(ws.shared_out) : nullptr, T, row_vecs,
        static_cast<uint4*>(static_cast<void*>(g.dx)));
    MOK_CUDA_CHECK(cudaGetLastError());
    if (ep)
      MOK_CUDA_CHECK(cudaMemcpyAsync(g.d_topk_weights, ws.regions[ws.ep_rank] + ws.sym.dtw,
                                     static_cast<size_t>(T * k) * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  }
}

void backward(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, const ref::RankGrads& g,
              const void* dy, void* stream, const Saved& saved) {
  for (ForwardPhase phase : {ForwardPhase::kStart, ForwardPhase::kPlan, ForwardPhase::kLayer})
    backward_phase(ws, c, in, g, dy, stream, phase, saved);
}

}  // namespace mok::cuda
