#include "cuda/gemm/launch.hpp"

#include <cuda.h>

#include <algorithm>
#include <mutex>

#include "cuda/cuda_check.hpp"
#include "cuda/gemm/grouped_gemm.cuh"
#include "cuda/gemm/tensor_map.hpp"
#include "cuda/gemm/wgrad.cuh"
#include "runtime/env.hpp"
#include "runtime/errors.hpp"

namespace mok::gemm {

double env_gemm_timeout_s() { return std::max(0.001, std::strtod(env::get(env::kGemmTimeout).c_str(), nullptr)); }
int32_t env_tile_n_group() { return static_cast<int32_t>(std::max<long>(1, env::get_int(env::kTileNGroup))); }
uint64_t gemm_timeout_ns(double timeout_s) {
  return static_cast<uint64_t>(std::min<double>(timeout_s, env_gemm_timeout_s()) * 1e9);
}

namespace {

// The fields every kind sets: A rows, K, the B maps' sources, the row blocks and the output.
GroupedGemmArgs rows_args(const void* a, int64_t a_rows, int64_t k, const void* b0, const void* b1,
                          int64_t num_experts, int64_t b_rows_per_expert, const int32_t* block_expert,
                          int32_t max_m_blocks, Epilogue epilogue, void* out, int64_t out_ld) {
  GroupedGemmArgs g;
  g.a = a;
  g.a_rows = a_rows;
  g.k = k;
  g.b0 = b0;
  g.b1 = b1;
  g.num_experts = num_experts;
  g.b_rows_per_expert = b_rows_per_expert;
  g.block_expert = block_expert;
  g.max_m_blocks = max_m_blocks;
  g.epilogue = static_cast<int32_t>(epilogue);
  g.out = out;
  g.out_ld = out_ld;
  g.out_rows = a_rows;
  return g;
}

// The dgrad kinds: out[rows, n] = a[rows, k] · B_e, B_e the K rows of expert e in b0 (K rows
// [0, k_split)) and b1 (the rest), N-major as stored.
GroupedGemmArgs dgrad_args(const void* a, int64_t a_rows, int64_t k, const void* b0, const void* b1,
                           int64_t num_experts, int64_t b_rows_per_expert, int64_t k_split, int64_t n,
                           const int32_t* block_expert, int32_t max_m_blocks, void* out) {
  GroupedGemmArgs g = rows_args(a, a_rows, k, b0, b1, num_experts, b_rows_per_expert, block_expert, max_m_blocks,
                                Epilogue::kStore, out, n);
  g.b_n_major = true;
  g.b_k_split = k_split;
  g.n = n;
  g.num_n_blocks = tiles_of(n, TileConfig::kBlockN);
  return g;
}

}  // namespace

GroupedGemmArgs gate_up_args(const void* a, int64_t a_rows, int64_t hidden, const void* w_gate, const void* w_up,
                             int64_t num_experts, int64_t inter, const int32_t* block_expert, int32_t max_m_blocks,
                             void* out) {
  // B halves: 128 rows of w_gate and of w_up for the same channels per N block
  GroupedGemmArgs g = rows_args(a, a_rows, hidden, w_gate, w_up, num_experts, inter, block_expert, max_m_blocks,
                                Epilogue::kSwiGLU, out, inter);
  g.b_n_step = 128;
  g.b_half_offset = 0;
  g.num_n_blocks = tiles_of(inter, 128);
  return g;
}

GroupedGemmArgs gate_up_preact_args(const void* a, int64_t a_rows, int64_t hidden, const void* w_gate,
                                    const void* w_up, int64_t num_experts, int64_t inter, const int32_t* block_expert,
                                    int32_t max_m_blocks, void* out) {
  GroupedGemmArgs g = gate_up_args(a, a_rows, hidden, w_gate, w_up, num_experts, inter, block_expert, max_m_blocks, out);
  g.epilogue = static_cast<int32_t>(Epilogue::kGateUpPreact);
  g.out_ld = 2 * inter;
  return g;
}

GroupedGemmArgs down_args(const void* a, int64_t a_rows, int64_t inter, const void* w_down, int64_t num_experts,
                          int64_t hidden, const int32_t* block_expert, int32_t max_m_blocks, void* out) {
  // B halves: rows n*256 and n*256 + 128 of w_down
  GroupedGemmArgs g = rows_args(a, a_rows, inter, w_down, w_down, num_experts, hidden, block_expert, max_m_blocks,
                                Epilogue::kStore, out, hidden);
  g.b_n_step = 256;
  g.b_half_offset = 128;
  g.num_n_blocks = tiles_of(hidden, 256);
  return g;
}

GroupedGemmArgs dgrad_gate_up_e4m3_args(const void* dh_q, int64_t a_rows, int64_t inter, const void* w_gate_qt,
                                        const void* w_up_qt, int64_t num_experts, int64_t hidden,
                                        const int32_t* block_expert, int32_t max_m_blocks, void* out) {
  // The down kind's layout with K = 2I and N = H: B halves rows n·256 and n·256 + 128 of W_gateᵀ
  // for the first I of K, of W_upᵀ for the rest
  GroupedGemmArgs g = down_args(dh_q, a_rows, 2 * inter, w_gate_qt, num_experts, hidden, block_expert, max_m_blocks, out);
  g.b1 = w_up_qt;
  g.b_k_split = inter;
  g.operand_bytes = 1;
  g.b_scales_transposed = true;
  return g;
}

GroupedGemmArgs dgrad_down_swiglu_e4m3_args(const void* dy_q, int64_t a_rows, int64_t hidden, const void* w_down_qt,
                                            int64_t num_experts, int64_t inter, const int32_t* block_expert,
                                            int32_t max_m_blocks, const void* h, const float* row_weight, void* dh_q,
                                            float* dh_scales, int64_t scales_ld, bool pow2, void* dh_bf16, void* a,
                                            float* dtw_partials) {
  // The down kind's layout with K = H and N = I: B halves rows n·256 and n·256 + 128 of W_downᵀ
  GroupedGemmArgs g = down_args(dy_q, a_rows, hidden, w_down_qt, num_experts, inter, block_expert, max_m_blocks, dh_q);
  g.epilogue = static_cast<int32_t>(Epilogue::kDgradSwiGLU);
  g.operand_bytes = 1;
  g.out_ld = 2 * inter;
  g.n = inter;
  g.h = h;
  g.row_weight = row_weight;
  g.wa = a;
  g.dtw_partials = dtw_partials;
  g.preact = dh_bf16;
  g.out_scales = dh_scales;
  g.out_scales_ld = scales_ld;
  g.out_scales_pow2 = pow2;
  g.b_scales_transposed = true;
  return g;
}

GroupedGemmArgs dgrad_down_args(const void* a, int64_t a_rows, int64_t hidden, const void* w_down,
                                int64_t num_experts, int64_t inter, const int32_t* block_expert, int32_t max_m_blocks,
                                void* out) {
  // K = H rows of w_down[e] ([H, I]), one map
  return dgrad_args(a, a_rows, hidden, w_down, w_down, num_experts, hidden, hidden, inter, block_expert, max_m_blocks,
                    out);
}

GroupedGemmArgs dgrad_down_swiglu_args(const void* dy, int64_t a_rows, int64_t hidden, const void* w_down,
                                       int64_t num_experts, int64_t inter, const int32_t* block_expert,
                                       int32_t max_m_blocks, const void* h, const float* row_weight, void* dh,
                                       void* wa, float* dtw_partials) {
  GroupedGemmArgs g = dgrad_down_args(dy, a_rows, hidden, w_down, num_experts, inter, block_expert, max_m_blocks, dh);
  g.epilogue = static_cast<int32_t>(Epilogue::kDgradSwiGLU);
  g.out_ld = 2 * inter;
  g.h = h;
  g.row_weight = row_weight;
  g.wa = wa;
  g.dtw_partials = dtw_partials;
  return g;
}

GroupedGemmArgs dgrad_gate_up_args(const void* a, int64_t a_rows, int64_t inter, const void* w_gate,
                                   const void* w_up, int64_t num_experts, int64_t hidden,
                                   const int32_t* block_expert, int32_t max_m_blocks, void* out) {
  // K = 2I: the I rows of w_gate[e], then the I rows of w_up[e] ([I, H] each)
  return dgrad_args(a, a_rows, 2 * inter, w_gate, w_up, num_experts, inter, inter, hidden, block_expert,
                    max_m_blocks, out);
}

namespace {


// B's stack of expert matrices [b_rows_per_expert, cols] at q (b0 or b1), in place.
MatrixStack b_stack(const GroupedGemmArgs& g, const void* q, int64_t cols) {
  return MatrixStack{q, g.num_experts, g.b_rows_per_expert, cols, g.b_expert_stride, g.b_row_stride};
}

// The kernel parameters every orientation shares; k-blocks of the launch's tile shape (64 of K
// for bf16, 128 for e4m3: a count in the bf16 tile's k-blocks would run an e4m3 kernel over
// twice K, its loads past K zero-filled and its scale reads past the scales' end)
GroupedGemmParams common_params(const GroupedGemmArgs& g, int block_k) {
  GroupedGemmParams p{};
  p.num_n_blocks = g.num_n_blocks;
  p.num_k_blocks = static_cast<int32_t>(g.k / block_k);
  p.max_m_blocks = g.max_m_blocks;
  // B's rows per expert in its maps: the stack's pitch (independent of its columns)
  p.b_rows_per_expert = static_cast<int32_t>(matrix_pitch(b_stack(g, g.b0, g.k)));
  p.b_n_step = g.b_n_step;
  p.b_half_offset = g.b_half_offset;
  p.k_split_blocks = static_cast<int32_t>(g.b_k_split / block_k);
  p.block_expert = g.block_expert;
  p.epilogue = static_cast<Epilogue>(g.epilogue);
  p.out = static_cast<__nv_bfloat16*>(g.out);
  p.out_ld = g.out_ld;
  p.out_rows = g.out_rows;
  p.plan_rows = g.plan_rows;
  p.topk = g.topk;
  p.n_group = env_tile_n_group();
  p.timeout_ns = gemm_timeout_ns(g.timeout_s);
  p.timeout_record = g.timeout_record;
  return p;
}

// The parameters of the SwiGLU-backward kernel: the shared ones and the epilogue's operands.
GroupedGemmSwiGLUBwdParams swiglu_bwd_params(const GroupedGemmArgs& g, int block_k) {
  GroupedGemmSwiGLUBwdParams p{};
  static_cast<GroupedGemmParams&>(p) = common_params(g, block_k);
  p.h = static_cast<const __nv_bfloat16*>(g.h);
  p.row_weight = g.row_weight;
  p.wa = static_cast<__nv_bfloat16*>(g.wa);
  p.dtw_partials = g.dtw_partials;
  p.inter = g.n;
  return p;
}

// One grouped-GEMM launch of tile shape T: N-major B (dgrad) or K-major (forward), one block
// per SM (or g.num_blocks), each taking tiles blockIdx.x, +gridDim.x, ...
template <class T, bool kBNMajor, bool kSwiGLUBwd = false, class Prec = PrecisionOf<T>>
void launch_tiles(const GroupedGemmArgs& g, int sms, cudaStream_t stream) {
  constexpr int kBytes = T::kElemBytes;
  const CUtensorMap map_a = tensor_map_2d(g.a, g.a_rows, g.k, T::kBlockM, kBytes);
  // B: N-major as stored, 64 (N) x 64 (K) boxes; or K-major halves of BLOCK_N/2 rows
  const int64_t b_rows = g.num_experts * g.b_rows_per_expert;
  const MatrixStack b0 = b_stack(g, g.b0, kBNMajor ? g.n : g.k), b1 = b_stack(g, g.b1, kBNMajor ? g.n : g.k);
  CUtensorMap map_b0, map_b1;
  if constexpr (kBytes == 2) {
    map_b0 = tensor_map_stack(b0, kBNMajor ? T::kBlockK : T::kBlockN / 2);
    map_b1 = tensor_map_stack(b1, kBNMajor ? T::kBlockK : T::kBlockN / 2);
  } else {  // e4m3 operands: contiguous (the C ABI's fp8 seam)
    MOK_CHECK_ARG(g.b_expert_stride == 0 && g.b_row_stride == 0, "grouped GEMM (e4m3): B must be contiguous");
    // (a K split: each part's matrix is b_k_split columns wide)
    const int64_t b_cols = g.b_k_split > 0 ? g.b_k_split : g.k;
    map_b0 = tensor_map_2d(g.b0, b_rows, b_cols, T::kBlockN / 2, kBytes);
    map_b1 = tensor_map_2d(g.b1, b_rows, b_cols, T::kBlockN / 2, kBytes);
  }
  GroupedGemmParamsOf<kSwiGLUBwd> p;
  if constexpr (kSwiGLUBwd) p = swiglu_bwd_params(g, T::kBlockK);
  else p = common_params(g, T::kBlockK);
  CUtensorMap map_sa = map_a;
  if constexpr (Prec::kBlockScaled) {
    const int64_t k_blocks = g.k / T::kBlockK;
    map_sa = tensor_map_scales(g.a_scales, k_blocks, g.a_scales_ld > 0 ? g.a_scales_ld : g.a_rows, T::kBlockM);
    p.sb0 = g.b0_scales;
    p.sb1 = g.b1_scales;
    p.sb_rows_per_expert = static_cast<int32_t>(tiles_of(g.b_rows_per_expert, 128));
    // a K split's parts each have their own scales, over their own k-blocks
    const int32_t nb = p.sb_rows_per_expert,
                  kbs = static_cast<int32_t>(g.b_k_split > 0 ? g.b_k_split / T::kBlockK : k_blocks);
    p.sb_expert_stride = nb * kbs;
    p.sb_n_stride = g.b_scales_transposed ? 1 : kbs;
    p.sb_k_stride = g.b_scales_transposed ? nb : 1;
    p.out_scales = g.out_scales;
    p.out_scales_ld = g.out_scales_ld > 0 ? g.out_scales_ld : g.out_rows;
    p.out_scales_pow2 = g.out_scales_pow2 ? 1 : 0;
    p.preact = static_cast<__nv_bfloat16*>(g.preact);
  }
  constexpr size_t smem = kGemmSmemBytesT<T, Prec>;
  static_assert(smem <= 227 * 1024, "shared storage exceeds the 227 KB a block can have");
  MOK_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_kernel<kBNMajor, T, kSwiGLUBwd, Prec>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int grid = std::min(g.num_blocks > 0 ? g.num_blocks : sms, g.max_m_blocks * g.num_n_blocks);
  grouped_gemm_kernel<kBNMajor, T, kSwiGLUBwd, Prec><<<grid, T::kThreads, smem, stream>>>(map_a, map_b0, map_b1, p, map_sa);
  MOK_CUDA_CHECK(cudaGetLastError());
}

template <bool kBNMajor, bool kSwiGLUBwd = false>
void launch_tile_shape(const GroupedGemmArgs& g, int sms, cudaStream_t stream) {
  if (g.tile_n == 128 && g.ping_pong) launch_tiles<TileConfigPingPong, kBNMajor, kSwiGLUBwd>(g, sms, stream);
  else if (g.tile_n == 128) launch_tiles<TileConfigN128, kBNMajor, kSwiGLUBwd>(g, sms, stream);
  else launch_tiles<TileConfig, kBNMajor, kSwiGLUBwd>(g, sms, stream);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The checks of the SwiGLU-backward epilogue's operands (the C ABI checks shapes before).
void check_swiglu_bwd(const GroupedGemmArgs& g) {
  const int64_t inter = g.n;
  MOK_CHECK_ARG(g.out_ld == 2 * inter, "grouped GEMM (dgrad down SwiGLU): dh rows must be 2I = " << 2 * inter << " wide");
  MOK_CHECK_ARG(g.b_n_major, "grouped GEMM (dgrad down SwiGLU): the epilogue needs the dgrad-down orientation");
  MOK_CHECK_ARG(inter > 0 && inter % TileConfig::kBlockK == 0 && g.num_n_blocks == tiles_of(inter, g.tile_n),
                "grouped GEMM (dgrad down SwiGLU): I = " << inter << " must be a positive multiple of 64");
  MOK_CHECK_ARG(g.h != nullptr, "grouped GEMM (dgrad down SwiGLU): h ([rows, 2I] bf16, the saved g | u) is missing");
  MOK_CHECK_ARG(g.row_weight != nullptr, "grouped GEMM (dgrad down SwiGLU): row_weight ([rows] fp32) is missing");
  MOK_CHECK_ARG(g.out != nullptr, "grouped GEMM (dgrad down SwiGLU): dh ([rows, 2I] bf16) is missing");
  MOK_CHECK_ARG(aligned16(g.h) && aligned16(g.out) && aligned16(g.wa),
                "grouped GEMM (dgrad down SwiGLU): h, dh and wa must be 16-byte aligned (16-byte loads and stores)");
  MOK_CHECK_ARG((reinterpret_cast<uintptr_t>(g.row_weight) & 3u) == 0 &&
                    (reinterpret_cast<uintptr_t>(g.dtw_partials) & 3u) == 0,
                "grouped GEMM (dgrad down SwiGLU): row_weight and dtw_partials must be 4-byte aligned");
}

}  // namespace

GroupedGemmArgs with_tile_n(GroupedGemmArgs g, int32_t tile_n) {
  MOK_CHECK_ARG(tile_n == 128 || tile_n == 256, "grouped GEMM: tile N = " << tile_n << " must be 128 or 256");
  const int32_t f = g.tile_n / tile_n;  // the builders lay out for 256
  if (f == 1) return g;
  g.b_n_step /= f;
  g.b_half_offset /= f;
  // From N (the dgrad kinds' n, the forward kinds' rows per expert), so that a partial last
  // tile at 256 does not become a whole tile of nothing at 128
  g.num_n_blocks = g.b_n_major ? tiles_of(g.n, tile_n) : tiles_of(g.b_rows_per_expert, g.b_n_step);
  g.tile_n = tile_n;
  return g;
}

GroupedGemmArgs with_kind_tile(GroupedGemmArgs g) {
  if (g.epilogue != static_cast<int32_t>(Epilogue::kDgradSwiGLU) || g.tile_n != 256) return g;
  g = with_tile_n(g, 128);
  g.ping_pong = true;
  return g;
}

void launch_grouped_gemm(const GroupedGemmArgs& g, cudaStream_t stream) {
  using C = TileConfig;
  MOK_CHECK_ARG(g.k > 0 && g.k % C::kBlockK == 0, "grouped GEMM: K = " << g.k << " must be a multiple of " << C::kBlockK);
  MOK_CHECK_ARG(g.tile_n == 128 || g.tile_n == 256, "grouped GEMM: tile N = " << g.tile_n << " must be 128 or 256");
  // NOTES: A may have fewer rows than max_m_blocks*BLOCK_M: TMA fills rows past the end
  // with zeros (and still counts their bytes), and the epilogue skips rows >= out_rows.
  MOK_CHECK_ARG(g.a_rows > 0, "grouped GEMM: A has no rows");
  if (g.b_n_major) {
    MOK_CHECK_ARG(g.b_k_split > 0 && g.b_k_split % C::kBlockK == 0 && g.b_k_split <= g.k &&
                      (g.b_k_split == g.k || g.k - g.b_k_split <= g.b_rows_per_expert),
                  "grouped GEMM (dgrad): K split = " << g.b_k_split << " must be a multiple of " << C::kBlockK
                                                     << " within K = " << g.k);
    MOK_CHECK_ARG(g.b_k_split <= g.b_rows_per_expert, "grouped GEMM (dgrad): K split exceeds the rows per expert");
    MOK_CHECK_ARG(g.n % TileConfig::kBlockK == 0 && g.num_n_blocks == tiles_of(g.n, g.tile_n),
                  "grouped GEMM (dgrad): N = " << g.n << " must be a multiple of 64");
  } else {
    MOK_CHECK_ARG(g.b_rows_per_expert % TileConfig::kBlockK == 0 && g.num_n_blocks == tiles_of(g.b_rows_per_expert, g.b_n_step),
                  "grouped GEMM: N per expert = " << g.b_rows_per_expert << " must be a multiple of 64");
  }
  const bool swiglu_bwd = g.epilogue == static_cast<int32_t>(Epilogue::kDgradSwiGLU);
  if (swiglu_bwd && g.operand_bytes == 1) {
    // fp8_block's dgrad down: K-major on W_down's transposed
    // copy, dh out in e4m3 with its scales (epilogue_dgrad_swiglu_e4m3)
    const int64_t inter = g.n;
    MOK_CHECK_ARG(g.a_scales != nullptr && g.b0_scales != nullptr && g.out_scales != nullptr,
                  "grouped GEMM (e4m3 dgrad down SwiGLU): needs the block scales and out_scales (dh's)");
    MOK_CHECK_ARG(inter > 0 && inter % 128 == 0 && g.b_rows_per_expert == inter && g.out_ld == 2 * inter,
                  "grouped GEMM (e4m3 dgrad down SwiGLU): I = " << inter << " must be a positive multiple of 128, "
                                                                "B [E, I, H] and dh [rows, 2I]");
    MOK_CHECK_ARG(g.h != nullptr && g.row_weight != nullptr && g.out != nullptr,
                  "grouped GEMM (e4m3 dgrad down SwiGLU): h, row_weight and dh are required");
    MOK_CHECK_ARG(aligned16(g.h) && aligned16(g.out) && aligned16(g.wa) && aligned16(g.preact),
                  "grouped GEMM (e4m3 dgrad down SwiGLU): h, dh, a and the bf16 dh must be 16-byte aligned");
  } else if (swiglu_bwd) {
    check_swiglu_bwd(g);
  }
  MOK_CHECK_ARG(g.operand_bytes == 2 || g.operand_bytes == 1, "grouped GEMM: operands of " << g.operand_bytes << " bytes");
  if (g.operand_bytes == 1) {
    // e4m3 operands: K-major only (fp8 wgmma has no transpose bits); 128 x 128 tiles, and
    // 128 x 256 with block scales
    MOK_CHECK_ARG(!g.b_n_major, "grouped GEMM (e4m3): K-major operands only (the dgrad kinds read transposed copies)");
    MOK_CHECK_ARG(g.k % TileConfigE4m3::kBlockK == 0, "grouped GEMM (e4m3): K = " << g.k << " must be a multiple of 128");
    const int scales = (g.a_scales != nullptr) + (g.b0_scales != nullptr) + (g.b1_scales != nullptr);
    MOK_CHECK_ARG(scales == 0 || scales == 3, "grouped GEMM (e4m3): block scales need a_scales, b0_scales and b1_scales ("
                                                   << scales << " of 3 given)");
    MOK_CHECK_ARG(g.tile_n == (scales == 3 ? 256 : 128),
                  "grouped GEMM (e4m3): tile N = " << g.tile_n
                                                   << "; e4m3 runs 128 x 256 tiles with block scales and 128 x 128 "
                                                      "without (with_tile_n)");
    if (g.epilogue == static_cast<int32_t>(Epilogue::kStoreF32))
      MOK_CHECK_ARG(scales == 3 && (reinterpret_cast<uintptr_t>(g.out) & 7u) == 0 && g.out_ld % 2 == 0,
                    "grouped GEMM (e4m3 fp32 out): needs the block scales, out 8-byte aligned and an even out_ld");
    if (g.epilogue == static_cast<int32_t>(Epilogue::kSwiGLUE4m3)) {
      MOK_CHECK_ARG(scales == 3 && g.tile_n == 256 && g.out_scales != nullptr,
                    "grouped GEMM (e4m3 SwiGLU quantised): needs the block scales, tile N = 256 and out_scales");
      MOK_CHECK_ARG(aligned16(g.preact), "grouped GEMM (e4m3 SwiGLU quantised): preact (h) must be 16-byte aligned");
      MOK_CHECK_ARG(g.out_ld % 128 == 0 && (reinterpret_cast<uintptr_t>(g.out) & 1u) == 0 &&
                        (reinterpret_cast<uintptr_t>(g.out_scales) & 3u) == 0,
                    "grouped GEMM (e4m3 SwiGLU quantised): I = " << g.out_ld
                                                                 << " must be a multiple of 128 (a scale block), out "
                                                                    "2-byte and out_scales 4-byte aligned");
    }
    MOK_CHECK_ARG(g.b_k_split == 0 || (scales == 3 && g.b_k_split % 128 == 0 && g.b_k_split < g.k),
                  "grouped GEMM (e4m3): a K split (" << g.b_k_split << ") needs block scales, a multiple of 128 "
                                                        "and a second part (K = " << g.k << ")");
    if (scales == 3) {
      const int64_t a_ld = g.a_scales_ld > 0 ? g.a_scales_ld : g.a_rows;
      MOK_CHECK_ARG(a_ld % 4 == 0 && a_ld >= g.a_rows && aligned16(g.a_scales),
                    "grouped GEMM (e4m3 block scales): a_scales [K/128, " << a_ld << "] needs rows of a multiple of 4 "
                        "(16-byte aligned) covering a_rows = " << g.a_rows << ", and 16-byte alignment");
      MOK_CHECK_ARG(g.out_scales_ld == 0 || g.out_scales_ld >= g.out_rows,
                    "grouped GEMM (e4m3 block scales): out_scales_ld = " << g.out_scales_ld << " < out_rows = "
                                                                         << g.out_rows);
      MOK_CHECK_ARG((reinterpret_cast<uintptr_t>(g.b0_scales) & 3u) == 0 && (reinterpret_cast<uintptr_t>(g.b1_scales) & 3u) == 0,
                    "grouped GEMM (e4m3 block scales): b0_scales and b1_scales must be 4-byte aligned");
    }
    if (g.max_m_blocks == 0 || g.num_n_blocks == 0) return;
    int device = 0, sms = 0;
    MOK_CUDA_CHECK(cudaGetDevice(&device));
    MOK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    // The MMA turns (tile.cuh kMmaTurns) where they measured faster: every block-scaled kind but
    // down's scatter epilogue (docs/perf.md session 28)
    using Turns = MmaTurns<PrecisionE4m3Block>;
    if (scales == 3 && swiglu_bwd) return launch_tiles<TileConfigE4m3Wide, false, true, Turns>(g, sms, stream);
    if (scales == 3 && g.epilogue == static_cast<int32_t>(Epilogue::kScatter))
      return launch_tiles<TileConfigE4m3Wide, false, false, PrecisionE4m3Block>(g, sms, stream);
    if (scales == 3) return launch_tiles<TileConfigE4m3Wide, false, false, Turns>(g, sms, stream);
    return launch_tiles<TileConfigE4m3, false>(g, sms, stream);
  }
  if (g.max_m_blocks == 0 || g.num_n_blocks == 0) return;
  int device = 0, sms = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (swiglu_bwd) return launch_tile_shape<true, true>(g, sms, stream);
  if (g.b_n_major) return launch_tile_shape<true>(g, sms, stream);
  launch_tile_shape<false>(g, sms, stream);
}

void load_backward_kernels() {
  cudaFuncAttributes a;
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, grouped_gemm_kernel<false, TileConfig, false>));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, grouped_gemm_kernel<true, TileConfig, false>));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, grouped_gemm_kernel<true, TileConfig, true>));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, grouped_gemm_kernel<false, TileConfigN128, false>));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, grouped_gemm_kernel<true, TileConfigN128, false>));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, grouped_gemm_kernel<true, TileConfigN128, true>));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, grouped_gemm_kernel<true, TileConfigPingPong, true>));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, grouped_wgrad_kernel<false, TileConfigPingPong192>));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, grouped_wgrad_kernel<true, TileConfigPingPong192>));
  // fp8_block's (the tiles launch_grouped_gemm picks for e4m3 with block scales), its
  // quantisers and its wgrad kind
  using Turns = MmaTurns<PrecisionE4m3Block>;
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, grouped_gemm_kernel<false, TileConfigE4m3Wide, true, Turns>));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, grouped_gemm_kernel<false, TileConfigE4m3Wide, false, PrecisionE4m3Block>));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, grouped_gemm_kernel<false, TileConfigE4m3Wide, false, Turns>));
  load_fp8_kernels();
}

void launch_grouped_wgrad(const GroupedWgradArgs& g, cudaStream_t stream) {
  using C = TileConfig;
  MOK_CHECK_ARG(g.mo > 0 && g.mo % TileConfig::kBlockK == 0, "grouped wgrad: Mo = " << g.mo << " must be a positive multiple of 64");
  MOK_CHECK_ARG(g.no > 0 && g.no % TileConfig::kBlockK == 0, "grouped wgrad: No = " << g.no << " must be a positive multiple of 64");
  MOK_CHECK_ARG(!g.accumulate || g.acc != nullptr, "grouped wgrad: accumulate needs acc");
  MOK_CHECK_ARG(!g.store_acc || g.acc != nullptr, "grouped wgrad: store_acc needs acc");
  MOK_CHECK_ARG(g.out_split == 0 || 2 * g.out_split == g.mo,
                "grouped wgrad: out_split = " << g.out_split << " must be 0 or half of Mo = " << g.mo);
  MOK_CHECK_ARG(g.acc_slot == nullptr || g.acc != nullptr, "grouped wgrad: acc_slot without acc");
  if (g.num_experts == 0) return;
  int device = 0, sms = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // Both maps: boxes of 64 columns (Mo or No) x 64 rows (K).  No rows at all (every expert
  // empty, empty tensors): the maps must still encode, over some valid device memory of one
  // row; the kernel issues no load then (every count is 0; TMA zero-fills outside a map).
  const void* fallback = g.out ? g.out : g.acc ? static_cast<const void*>(g.acc) : g.main_grad;
  const bool no_rows = g.rows == 0 || g.a == nullptr || g.b == nullptr;
  const CUtensorMap map_a = tensor_map_2d(no_rows ? fallback : g.a, no_rows ? 1 : g.rows, g.mo, C::kBlockK);
  const CUtensorMap map_b = tensor_map_2d(no_rows ? fallback : g.b, no_rows ? 1 : g.rows, g.no, C::kBlockK);
  WgradParams p = wgrad_common_params(
      g.num_experts, g.expert_offset, g.expert_count, g.out, g.acc, g.main_grad, g.accumulate, g.store_acc, g.mo, g.no,
      env_tile_n_group(), gemm_timeout_ns(g.timeout_s), g.timeout_record);
  p.expert_mode = g.expert_mode;
  p.expert_range = g.expert_range;
  p.acc_slot = g.acc_slot;
  p.out_split = g.out_split;
  p.out1 = static_cast<__nv_bfloat16*>(g.out1);
  p.main_grad1 = g.main_grad1;
  p.out_es = g.out_expert_stride;
  p.out_rs = g.out_row_stride;
  p.mg_es = g.mg_expert_stride;
  p.mg_rs = g.mg_row_stride;
  // 128 x 192 ping-pong tiles: 1.00-1.06 of the dense rate against 0.84-0.95 at 128 x 256
  // cooperative, the same bits (docs/perf.md session 22)
  using T = TileConfigPingPong192;
  wgrad_layout<T>(p);
  const int64_t tiles = g.num_experts * p.num_m_blocks * p.num_n_blocks;
  MOK_CHECK_ARG(tiles < (int64_t{1} << 31), "grouped wgrad: " << tiles << " tiles");
  // The per-expert tables (the backward's macrobatch loop) in a kernel of their own: the plain
  // launch keeps the code it had
  const bool tables = g.expert_mode || g.expert_range || g.acc_slot || g.out_split > 0;
  auto* kernel = tables ? grouped_wgrad_kernel<true, T> : grouped_wgrad_kernel<false, T>;
  MOK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(kGemmSmemBytesT<T>)));
  const int grid = static_cast<int>(std::min<int64_t>(g.num_blocks > 0 ? g.num_blocks : sms, tiles));
  kernel<<<grid, T::kThreads, kGemmSmemBytesT<T>, stream>>>(map_a, map_b, p);
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mok::gemm
