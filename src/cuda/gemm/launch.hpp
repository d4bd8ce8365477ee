// Host launchers of the grouped-GEMM engine (src/cuda/gemm/grouped_gemm.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/gemm/config.hpp"

namespace mok::gemm {

struct GroupedGemmArgs {
  const void* a = nullptr;       // [a_rows, K] bf16, row-major
  int64_t a_rows = 0;
  int64_t k = 0;
  const void* b0 = nullptr;      // [num_experts * b_rows_per_expert, K] bf16
  const void* b1 = nullptr;      // second half's source (== b0 for down)
  int64_t num_experts = 0;
  int64_t b_rows_per_expert = 0;
  // b0 / b1 in place with these strides (elements; 0: contiguous), the same for both: a
  // stack of [b_rows_per_expert, cols] matrices (gemm::MatrixStack; e.g. the halves of a fused
  // [E, 2I, H] gate_up parameter).
  int64_t b_expert_stride = 0, b_row_stride = 0;
  int32_t b_n_step = 256;
  int32_t b_half_offset = 128;
  int32_t num_n_blocks = 0;
  const int32_t* block_expert = nullptr;  // device, [max_m_blocks]
  int32_t max_m_blocks = 0;
  int32_t epilogue = 0;          // gemm::Epilogue
  void* out = nullptr;
  int64_t out_ld = 0;
  int64_t out_rows = 0;
  const uint32_t* plan_rows = nullptr;
  int32_t topk = 0;
  double timeout_s = 60.0;
  int64_t* timeout_record = nullptr;  // device [5], zeroed by the caller
  int32_t num_blocks = 0;        // grid; 0 = SM count
  // B N-major (the dgrad GEMMs): b0/b1 are [num_experts * b_rows_per_expert (K rows), N] as
  // stored; K rows [0, b_k_split) of an expert come from b0, the rest from b1 (rows from 0).
  bool b_n_major = false;
  int64_t b_k_split = 0;
  int64_t n = 0;                 // dgrad kinds: the output's columns (with_tile_n re-tiles them)
  // Tile N of the launch (config.hpp): 256, or 128 (TileConfigN128) through with_tile_n.
  int32_t tile_n = 256;
  bool ping_pong = false;  // tile_n 128: each consumer warpgroup owns whole tiles (TileConfigPingPong)
  // Operand bytes: 2 (bf16), or 1: a and b e4m3 (K-major kinds only, K % 128 == 0): 128 x 256
  // tiles with block scales (TileConfigE4m3Wide), 128 x 128 without (TileConfigE4m3).
  int32_t operand_bytes = 2;
  // e4m3 with block scales (DeepSeek-V3's recipe, PrecisionE4m3Block), all three or none:
  //   a_scales   [K / 128, a_rows] fp32: row r's scale of K columns [128 kb, 128 kb + 128) at
  //              kb · a_rows + r (k-block-major, so a tile's 128 rows are one TMA box; a_rows % 4 == 0)
  //   b0_scales  [num_experts, ceil(b_rows_per_expert / 128), K / 128] fp32: the 128 x 128
  //   b1_scales  blocks of b0 and b1 (b1_scales == b0_scales when b1 == b0)
  // out = Σ over k-blocks of (the k-block's e4m3 products summed) · a_scale · b_scale, in fp32.
  //   b_scales_transposed: b0_scales and b1_scales are [num_experts, K / 128, ceil(b_rows_per_expert
  //              / 128)] instead, the block (r / 128, kb) at (e, kb, r / 128): the scales of the
  //              matrices that b0 and b1 are transposed copies of (a 128 x 128 block's scale is its
  //              transpose's; the dgrad kinds on the weights' transposed e4m3 copies)
  const float* a_scales = nullptr;
  const float* b0_scales = nullptr;
  const float* b1_scales = nullptr;
  bool b_scales_transposed = false;
  // The scales' leading dimensions (0: a_rows, out_rows): a_scales [K / 128, a_scales_ld] and
  // out_scales [I / 128, out_scales_ld], so that a stack of rows that is not a multiple of 4
  // (the shared expert's T tokens) keeps 16-byte aligned scale rows (a_scales_ld % 4 == 0)
  int64_t a_scales_ld = 0;
  int64_t out_scales_ld = 0;
  // Epilogue::kSwiGLUE4m3 (block-scaled gate/up at tile N 256, I % 128 == 0): out is a in e4m3
  // [a_rows, I] and out_scales its scales [I / 128, out_rows] fp32 (per row and 128 channels,
  // k-block-major: the down kind's a_scales)
  float* out_scales = nullptr;
  bool out_scales_pow2 = false;  // power-of-two scales (UE8M0)
  // ... and with preact (16-byte aligned), h = [bf16(g) | bf16(u)] [a_rows, 2I] from the same
  // accumulators (kGateUpPreact's values): the training forward's saved pre-activations
  void* preact = nullptr;
  // Epilogue::kDgradSwiGLU (dgrad_down_swiglu_args): out is dh [a_rows, 2I]; these as in
  // gemm/epilogue_bwd.cuh, row r of each at row r of a.
  const void* h = nullptr;             // [a_rows, 2I] bf16
  const float* row_weight = nullptr;   // [a_rows] fp32
  void* wa = nullptr;                  // [a_rows, I] bf16 or null
  float* dtw_partials = nullptr;       // [a_rows, I / 128] fp32 or null
};

// Gate/up with the SwiGLU epilogue: out[rows, I] from w_gate/w_up [E, I, H].
GroupedGemmArgs gate_up_args(const void* a, int64_t a_rows, int64_t hidden, const void* w_gate, const void* w_up,
                             int64_t num_experts, int64_t inter, const int32_t* block_expert, int32_t max_m_blocks,
                             void* out);
// Gate/up without the SwiGLU (the backward's replay): out = h [rows, 2I] = [bf16(g) | bf16(u)].
GroupedGemmArgs gate_up_preact_args(const void* a, int64_t a_rows, int64_t hidden, const void* w_gate,
                                    const void* w_up, int64_t num_experts, int64_t inter, const int32_t* block_expert,
                                    int32_t max_m_blocks, void* out);
// Down: out rows [*, H] from w_down [E, H, I]; epilogue kStore or kScatter.
GroupedGemmArgs down_args(const void* a, int64_t a_rows, int64_t inter, const void* w_down, int64_t num_experts,
                          int64_t hidden, const int32_t* block_expert, int32_t max_m_blocks, void* out);

// dgrad of down: out[rows, I] = a[rows, H] · w_down[e] ([H, I] as stored).
GroupedGemmArgs dgrad_down_args(const void* a, int64_t a_rows, int64_t hidden, const void* w_down,
                                int64_t num_experts, int64_t inter, const int32_t* block_expert, int32_t max_m_blocks,
                                void* out);
// dgrad of gate/up: out[rows, H] = a[rows, 2I] · [w_gate; w_up][e] ([I, H] each, as stored).
GroupedGemmArgs dgrad_gate_up_args(const void* a, int64_t a_rows, int64_t inter, const void* w_gate,
                                   const void* w_up, int64_t num_experts, int64_t hidden,
                                   const int32_t* block_expert, int32_t max_m_blocks, void* out);

// dgrad of down with the SwiGLU backward in the epilogue (Epilogue::kDgradSwiGLU): da = dy ·
// w_down[e] stays in registers; dh = [dg | du] [rows, 2I] from h = [g | u] and row_weight, and
// optionally wa = bf16(w·a) [rows, I] and the router-gradient partials [rows, I / 128].
GroupedGemmArgs dgrad_down_swiglu_args(const void* dy, int64_t a_rows, int64_t hidden, const void* w_down,
                                       int64_t num_experts, int64_t inter, const int32_t* block_expert,
                                       int32_t max_m_blocks, const void* h, const float* row_weight, void* dh,
                                       void* wa, float* dtw_partials);

// fp8_block's dgrad gate/up: dx rows = dh_q [rows, 2I] · [W_gate;
// W_up][e], on the weights' transposed e4m3 copies w_gate_qt, w_up_qt [E, H, I] (a K split: the
// gate k-blocks, then the up ones; their scales W_gate's and W_up's, b_scales_transposed), bf16
// out [rows, H] (kStore, or kScatter set by the caller).  The caller sets a_scales (dh's, [2I/128,
// rows]), b0_scales (W_gate's) and b1_scales (W_up's).
GroupedGemmArgs dgrad_gate_up_e4m3_args(const void* dh_q, int64_t a_rows, int64_t inter, const void* w_gate_qt,
                                        const void* w_up_qt, int64_t num_experts, int64_t hidden,
                                        const int32_t* block_expert, int32_t max_m_blocks, void* out);
// fp8_block's dgrad down with the SwiGLU backward: da = dy_q ·
// W_downᵀ on W_down's transposed e4m3 copy w_down_qt [E, I, H] (K = H, its scales those of
// W_down, b_scales_transposed), dh out in e4m3 [rows, 2I] with dh_scales [2I/128, scales_ld]
// (gemm/epilogue_bwd.cuh epilogue_dgrad_swiglu_e4m3); h [rows, 2I] the saved bf16 pre-activations,
// row_weight [rows]; dh_bf16 [rows, 2I], a [rows, I] and dtw_partials [rows, I/128] optional.
// The caller sets the block scales (a_scales: dy's, b0_scales = b1_scales: W_down's).
GroupedGemmArgs dgrad_down_swiglu_e4m3_args(const void* dy_q, int64_t a_rows, int64_t hidden, const void* w_down_qt,
                                            int64_t num_experts, int64_t inter, const int32_t* block_expert,
                                            int32_t max_m_blocks, const void* h, const float* row_weight, void* dh_q,
                                            float* dh_scales, int64_t scales_ld, bool pow2, void* dh_bf16, void* a,
                                            float* dtw_partials);

// The same GEMM in tiles of N = tile_n (128 or 256): the builders above lay out for 256.
GroupedGemmArgs with_tile_n(GroupedGemmArgs args, int32_t tile_n);

// The tile a kind runs at (the C ABI and the unfused backward launch through it): the builders'
// 128 x 256 cooperative tiles, but for the dgrad-down SwiGLU kind 128 x 128 ping-pong tiles, whose
// epilogue runs under the other warpgroup's K loop (docs/perf.md, session 17).  Same bits.
GroupedGemmArgs with_kind_tile(GroupedGemmArgs args);

// Throws mok::Error on a CUDA failure or an unsupported shape.
void launch_grouped_gemm(const GroupedGemmArgs& g, cudaStream_t stream);

// The wgrad kind (gemm/wgrad.cuh): out[e] = A[rows of e]ᵀ · B[rows of e], K = the expert's rows.
struct GroupedWgradArgs {
  const void* a = nullptr;        // [rows, mo] bf16
  const void* b = nullptr;        // [rows, no] bf16
  int64_t rows = 0, mo = 0, no = 0;
  int64_t num_experts = 0;
  const int32_t* expert_offset = nullptr;  // device [E + 1]
  const int32_t* expert_count = nullptr;   // device [E]
  void* out = nullptr;            // [E, mo, no] bf16 or null
  float* acc = nullptr;           // [E, mo, no] fp32 or null
  float* main_grad = nullptr;     // [E, mo, no] fp32 or null
  bool accumulate = false, store_acc = false;
  double timeout_s = 60.0;
  int64_t* timeout_record = nullptr;
  int32_t num_blocks = 0;
  // Per expert (gemm/wgrad.cuh): mode (< 0 skip; kWgradAccumulate | kWgradStoreAcc |
  // kWgradFinal) and fp32 slot in acc; null: the flags above for every expert, slot = expert.
  const int32_t* expert_mode = nullptr;
  const int32_t* acc_slot = nullptr;
  // [2] on the device: only experts [range[0], range[1]) take part (the grid is sized for all)
  const int32_t* expert_range = nullptr;
  // Rows [0, out_split) of each expert's Mo to out / main_grad ([E, out_split, No]), the rest
  // to out1 / main_grad1 ([E, Mo - out_split, No]); 0: one output.  A multiple of 128.
  int64_t out_split = 0;
  void* out1 = nullptr;
  float* main_grad1 = nullptr;
  // The outputs in place (elements; 0: contiguous): expert e's row r of out / out1 at
  // e·out_expert_stride + r·out_row_stride; main_grad / main_grad1 likewise.
  int64_t out_expert_stride = 0, out_row_stride = 0, mg_expert_stride = 0, mg_row_stride = 0;
};
void launch_grouped_wgrad(const GroupedWgradArgs& args, cudaStream_t stream);

// MOK_GEMM_TIMEOUT_S: the cap on every grouped-GEMM launch's own wait deadline (seconds)
double env_gemm_timeout_s();
// The grouped launches' knobs: N-blocks per raster group (MOK_TILE_N_GROUP, at least 1), and a
// wait deadline in ns from a call's timeout_s capped by MOK_GEMM_TIMEOUT_S
int32_t env_tile_n_group();
uint64_t gemm_timeout_ns(double timeout_s);

// The fp8 wgrad kind (gemm/wgrad_fp8.cuh): out[e] = Σ over expert e's k-blocks of 128 rows of
// the e4m3 sum promoted with sa · sb.  a [Mo, R] and b [No, R] e4m3 (transposed, K-major), a_scales
// [R/128, Mo] and b_scales [R/128, No] fp32 (launch_quantize_cols writes both); expert e's rows
// [expert_offset[e], + expert_count[e]) with offsets multiples of 128 and the rows past the count
// up to the next multiple of 128 zero (the plan's padding).  Mo, No, R multiples of 128.
struct GroupedWgradFp8Args {
  const void* a = nullptr;
  const void* b = nullptr;
  const float* a_scales = nullptr;
  const float* b_scales = nullptr;
  int64_t rows = 0, mo = 0, no = 0, num_experts = 0;
  const int32_t* expert_offset = nullptr;  // device [E + 1]
  const int32_t* expert_count = nullptr;   // device [E]
  void* out = nullptr;          // [E, Mo, No] bf16 or null
  float* acc = nullptr;         // [E, Mo, No] fp32 or null
  float* main_grad = nullptr;   // [E, Mo, No] fp32 or null: += the total
  bool accumulate = false, store_acc = false;
  // out's and main_grad's matrices in place (elements; 0: contiguous [E, Mo, No]): row r of
  // expert e's at e·es + r·rs, columns contiguous
  int64_t out_es = 0, out_rs = 0, mg_es = 0, mg_rs = 0;
  double timeout_s = 60.0;
  int64_t* timeout_record = nullptr;
  int32_t num_blocks = 0;
};
void launch_grouped_wgrad_fp8(const GroupedWgradFp8Args& args, cudaStream_t stream);

// The fp8 wgrad operands' quantiser: v [rows, cols] bf16 (row i at v + i·ld; rows, cols multiples
// of 128) -> qt [cols, rows] e4m3 and scales [rows/128, cols] fp32: each column's scale over each
// 128 rows (max |v| / 448, 1 for zeros; pow2: its power-of-two ceiling), v / scale rounded to
// nearest even, saturating; the CPU reference's per-128-row column quantisation, bit for bit.
// row_weight (or null) [rows] fp32: row i's values times row_weight[i] in fp32 are quantised.
// plan_rows (or null) [rows]: row i is v's row row_token(plan_rows[i]) (zeros for a padding
// record: the plan's rows read in place, no gathered copy).  live_rows (or null, device): the
// 128-row blocks at or past *live_rows are left unwritten (the plan's rows in use).
// valid_rows (>= 0): v's rows at or past it are read as zeros (v has that many rows).
void launch_quantize_cols(const void* v, int64_t ld, int64_t rows, int64_t cols, void* qt, float* scales, bool pow2,
                          cudaStream_t stream, const float* row_weight = nullptr,
                          const uint32_t* plan_rows = nullptr, const int32_t* live_rows = nullptr,
                          int64_t valid_rows = -1);

// fp8_block's SwiGLU backward as a pass of its own over da (the block-scaled dgrad-down kind's
// fp32 output, Epilogue::kStoreF32), in place of the kind's SwiGLU-backward epilogue and the
// column quantisers of a, dg and du: per 128 rows x 128 channels, the epilogue's values and
// roundings (epilogue_bwd.cuh: dh_q and its row scales, the router-gradient partials in the
// same order) and, from the same values rounded to bf16, a, dg and du quantised per channel and
// 128 rows as launch_quantize_cols writes them (transposed [I, rows] e4m3, scales [rows/128, I]):
// bit for bit the epilogue then the three column passes.
struct SwiGLUBwdFp8Args {
  const float* da = nullptr;         // [rows, I] fp32
  const void* h = nullptr;           // [rows, 2I] bf16: g | u
  const float* row_weight = nullptr; // [rows] (null: 1, the shared expert)
  int64_t rows = 0, inter = 0;       // rows: a multiple of 128; I: of 128
  int64_t valid_rows = -1;           // rows past it are zeros and write nothing (-1: all)
  const int32_t* live_rows = nullptr;  // device word: row blocks from it on are skipped (null: none)
  void* dh_q = nullptr;              // [rows, 2I] e4m3
  float* dh_scales = nullptr;        // [2I/128, scales_ld]
  int64_t scales_ld = 0;
  float* dtw_partials = nullptr;     // [rows, I/128] or null
  void* at = nullptr;                // [I, rows] e4m3 (a), scales [rows/128, I]
  float* at_scales = nullptr;
  void* dgt = nullptr;               // dg's, likewise
  float* dgt_scales = nullptr;
  void* dut = nullptr;               // du's
  float* dut_scales = nullptr;
  bool pow2 = false;
};
void launch_swiglu_bwd_fp8(const SwiGLUBwdFp8Args& args, cudaStream_t stream);

// fp8_block's activation quantiser (gemm/quantize.cuh): x [rows, n] bf16 (n % 128 == 0) ->
// q [rows, n] e4m3 and scales [n / 128, rows] fp32, as mok.fp8.quantize_rows computes them.
// pow2: power-of-two scales (UE8M0).  scales_ld (0: rows): the scales' leading dimension.
void launch_quantize_rows(const void* x, void* q, float* scales, int64_t rows, int64_t n, bool pow2,
                          cudaStream_t stream, int64_t scales_ld = 0);

// fp8_block's weight quantiser (mok.fp8.quantize_blocks bit for bit): num matrices w [rows,
// cols] bf16 (rows, cols multiples of 128; element (e, r, c) at e·w_expert_stride +
// r·w_row_stride + c·w_col_stride, row- or column-major) -> per 128 x 128 block s = max |w| / 448
// (1 for zeros; pow2: its power-of-two ceiling) at scales[e·s_expert_stride + (r/128)·(cols/128)
// + c/128], and e4m3(w / s) in either or both orientations: q (w's, row (e, r) at
// e·q_expert_stride + r·q_row_stride) and qt (its transpose, row (e, c) at e·qt_expert_stride +
// c·qt_row_stride).  One read of w serves both (the dgrad kinds read the transposed copy; a
// block's scale is its transpose's).
struct QuantizeBlocksArgs {
  const void* w = nullptr;  // bf16
  int64_t num = 1, rows = 0, cols = 0;
  int64_t w_expert_stride = 0, w_row_stride = 0, w_col_stride = 1;
  uint8_t* q = nullptr;
  int64_t q_expert_stride = 0, q_row_stride = 0;
  uint8_t* qt = nullptr;
  int64_t qt_expert_stride = 0, qt_row_stride = 0;
  float* scales = nullptr;
  int64_t s_expert_stride = 0;
  bool pow2 = false;
};
void launch_quantize_blocks(const QuantizeBlocksArgs& args, cudaStream_t stream);

// Loads every kernel the backward launches (cudaFuncGetAttributes): with lazy module loading
// (CUDA_MODULE_LOADING=LAZY, the default) a kernel's first launch waited while a virtual peer
// spun in its barrier kernel, until that barrier's deadline.  prepare_backward calls it.
void load_backward_kernels();
// fp8_block's quantisers (rows, columns) and its wgrad kind, for the same reason
// (load_backward_kernels calls it)
void load_fp8_kernels();
void load_quantize_rows_kernel();  // (quantize.cu's part of it)
void load_swiglu_bwd_fp8_kernel();  // (swiglu_bwd_fp8.cu's)

}  // namespace mok::gemm
