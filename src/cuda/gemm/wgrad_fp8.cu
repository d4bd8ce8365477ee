// The fp8 wgrad kind's launch (gemm/wgrad_fp8.cuh) and its operands' quantiser: a matrix's
// columns per 128 rows, written transposed (qt [C, R] e4m3, scales [R/128, C] fp32), the
// K-major layout fp8 wgmma reads.
#include <cuda_bf16.h>

#include <algorithm>

#include "cuda/cuda_check.hpp"
#include "cuda/gemm/launch.hpp"
#include "cuda/gemm/quantize.cuh"
#include "cuda/gemm/tensor_map.hpp"
#include "cuda/gemm/wgrad_fp8.cuh"

namespace mok::gemm {
namespace {

// One 256-thread block per 128 x 128 tile (rows r0.., columns c0..) of v: the tile in shared
// memory, each column's max |v| over its 128 rows (two threads a column, 64 rows each, in two
// warps), its scale
// (e4m3_block_scale: max / 448, 1 for zeros; pow2: its power-of-two ceiling), and the column's
// 128 rows as e4m3 (v / s, nearest even, saturating) into row c of qt: 64 contiguous bytes a
// thread.  With row_weight, v's rows times their weights (fp32) are quantised: w·dy.  The CPU reference's quantize_columns (src/ref), bit for bit.
constexpr int kColTile = 128;
__global__ void __launch_bounds__(256) quantize_cols_kernel(const __nv_bfloat16* __restrict__ v, int64_t ld,
                                                            int64_t rows, int64_t cols, uint8_t* __restrict__ qt,
                                                            float* __restrict__ scales, bool pow2,
                                                            const float* __restrict__ row_weight,
                                                            const uint32_t* __restrict__ plan_rows,
                                                            const int32_t* __restrict__ live_rows, int64_t valid_rows) {
  __shared__ __nv_bfloat16 tile[kColTile][kColTile + 8];  // + 8: the column reads' banks
  __shared__ float weight[kColTile];
  __shared__ float half_amax[2][kColTile];
  const int64_t r0 = int64_t{blockIdx.y} * kColTile, c0 = int64_t{blockIdx.x} * kColTile;
  if (live_rows != nullptr && r0 >= __ldg(live_rows)) return;  // past the rows in use (block-uniform)
  const int t = threadIdx.x;
  if (t < kColTile) weight[t] = row_weight != nullptr ? __ldg(row_weight + r0 + t) : 1.0f;
  // Load: 128 rows x 16 uint4 (8 bf16 each), 8 a thread, coalesced along the row; with plan
  // rows, row i is v's row of its record's token (zeros for a padding record)
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int idx = i * 256 + t, r = idx / 16, v8 = idx % 16;
    int64_t src = valid_rows >= 0 && r0 + r >= valid_rows ? -1 : r0 + r;  // (past valid_rows: zeros)
    if (plan_rows != nullptr) {
      const uint32_t rec = __ldg(plan_rows + r0 + r);
      src = row_is_pad(rec) ? -1 : row_token(rec);
    }
    const uint4 x = src < 0 ? make_uint4(0, 0, 0, 0) : __ldg(reinterpret_cast<const uint4*>(v + src * ld + c0) + v8);
    *reinterpret_cast<uint2*>(&tile[r][v8 * 8]) = make_uint2(x.x, x.y);
    *reinterpret_cast<uint2*>(&tile[r][v8 * 8 + 4]) = make_uint2(x.z, x.w);
  }
  __syncthreads();
  // Column c, rows 64 h .. 64 h + 63: a warp's lanes take 32 consecutive columns of one half, so
  // their reads are one 64-byte piece of a row (no bank conflict; with a column's halves on
  // neighbouring lanes, rows r and r + 64 shared banks: 3 % slower, docs/perf.md session 28), and
  // the halves' maxima meet in shared memory
  const int c = t % kColTile, h = t / kColTile;
  // v[r0 + r, c0 + c], times the row's weight in fp32 (exact for w = 1)
  const auto value = [&](int r) { return __fmul_rn(__bfloat162float(tile[r][c]), weight[r]); };
  float amax = 0.0f;
#pragma unroll 8
  for (int r = 0; r < 64; ++r) amax = fmaxf(amax, fabsf(value(64 * h + r)));
  half_amax[h][c] = amax;
  __syncthreads();
  amax = fmaxf(half_amax[0][c], half_amax[1][c]);
  const float s = e4m3_block_scale(amax, pow2);
  const E4m3Divisor d = e4m3_divisor(s);
  if (h == 0) scales[(r0 / kColTile) * cols + c0 + c] = s;
  uint8_t* dst = qt + (c0 + c) * rows + r0 + 64 * h;
#pragma unroll
  for (int w = 0; w < 4; ++w) *reinterpret_cast<uint4*>(dst + 16 * w) = e4m3x16(value, 64 * h + 16 * w, d);
}

}  // namespace

void launch_quantize_cols(const void* v, int64_t ld, int64_t rows, int64_t cols, void* qt, float* scales, bool pow2,
                          cudaStream_t stream, const float* row_weight, const uint32_t* plan_rows,
                          const int32_t* live_rows, int64_t valid_rows) {
  MOK_CHECK_ARG(rows > 0 && cols > 0 && rows % 128 == 0 && cols % 128 == 0,
                "quantize columns: [" << rows << ", " << cols << "] must be positive multiples of 128");
  MOK_CHECK_ARG(ld >= cols && ld % 8 == 0 && (reinterpret_cast<uintptr_t>(v) & 15u) == 0 &&
                    (reinterpret_cast<uintptr_t>(qt) & 15u) == 0 && (reinterpret_cast<uintptr_t>(scales) & 3u) == 0,
                "quantize columns: v's rows 16-byte aligned (ld = " << ld << "), qt 16-byte and scales 4-byte aligned");
  MOK_CHECK_ARG(rows / 128 <= 65535, "quantize columns: " << rows << " rows (at most 65535 · 128)");
  const dim3 grid(static_cast<unsigned>(cols / 128), static_cast<unsigned>(rows / 128));
  quantize_cols_kernel<<<grid, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(v), ld, rows, cols,
                                                  static_cast<uint8_t*>(qt), scales, pow2, row_weight, plan_rows,
                                                  live_rows, valid_rows);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void launch_grouped_wgrad_fp8(const GroupedWgradFp8Args& g, cudaStream_t stream) {
  using T = WgradFp8Tile;
  MOK_CHECK_ARG(g.mo > 0 && g.mo % 128 == 0 && g.no > 0 && g.no % 128 == 0,
                "grouped wgrad (fp8): Mo = " << g.mo << " and No = " << g.no << " must be positive multiples of 128");
  MOK_CHECK_ARG(g.rows % 128 == 0, "grouped wgrad (fp8): R = " << g.rows << " rows must be a multiple of 128");
  MOK_CHECK_ARG(!g.accumulate || g.acc != nullptr, "grouped wgrad (fp8): accumulate needs acc");
  MOK_CHECK_ARG(!g.store_acc || g.acc != nullptr, "grouped wgrad (fp8): store_acc needs acc");
  MOK_CHECK_ARG((g.out == nullptr || g.out_rs == 0 || g.out_rs >= g.no) &&
                    (g.main_grad == nullptr || g.mg_rs == 0 || g.mg_rs >= g.no) && g.out_es >= 0 && g.mg_es >= 0,
                "grouped wgrad (fp8): an output's row stride (out " << g.out_rs << ", main_grad " << g.mg_rs
                                                                    << ") below No = " << g.no);
  // out leaves in 8-byte pieces of four bf16, main_grad in float2 pairs
  MOK_CHECK_ARG(g.out == nullptr || ((reinterpret_cast<uintptr_t>(g.out) & 7u) == 0 && g.out_rs % 4 == 0 && g.out_es % 4 == 0),
                "grouped wgrad (fp8): out must be 8-byte aligned with strides of multiples of 4 elements (rs = "
                    << g.out_rs << ", es = " << g.out_es << ")");
  MOK_CHECK_ARG(g.main_grad == nullptr ||
                    ((reinterpret_cast<uintptr_t>(g.main_grad) & 7u) == 0 && g.mg_rs % 2 == 0 && g.mg_es % 2 == 0),
                "grouped wgrad (fp8): main_grad must be 8-byte aligned with even strides (rs = " << g.mg_rs
                                                                                                 << ", es = " << g.mg_es << ")");
  if (g.num_experts == 0) return;
  int device = 0, sms = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // No rows at all: the maps must still encode (over the scales' and output's memory); every
  // expert's count is 0 then and the kernel issues no load
  const void* fallback = g.out ? g.out : g.acc ? static_cast<const void*>(g.acc) : g.main_grad;
  const bool no_rows = g.rows == 0;
  const int64_t r = no_rows ? 128 : g.rows;
  const CUtensorMap map_a = tensor_map_2d(no_rows ? fallback : g.a, g.mo, r, T::kBlockM, 1);
  const CUtensorMap map_b = tensor_map_2d(no_rows ? fallback : g.b, g.no, r, T::kBlockN / 2, 1);
  const CUtensorMap map_sa =
      tensor_map_scales(no_rows ? static_cast<const float*>(fallback) : g.a_scales, r / 128, g.mo, T::kBlockM);
  const CUtensorMap map_sb =
      tensor_map_scales(no_rows ? static_cast<const float*>(fallback) : g.b_scales, r / 128, g.no, T::kBlockN);
  WgradParams p = wgrad_common_params(
      g.num_experts, g.expert_offset, g.expert_count, g.out, g.acc, g.main_grad, g.accumulate, g.store_acc, g.mo, g.no,
      env_tile_n_group(), gemm_timeout_ns(g.timeout_s), g.timeout_record);
  p.out_es = g.out_es;
  p.out_rs = g.out_rs;
  p.mg_es = g.mg_es;
  p.mg_rs = g.mg_rs;
  wgrad_layout<T>(p);  // (the strides left 0: contiguous)
  const int64_t tiles = g.num_experts * p.num_m_blocks * p.num_n_blocks;
  MOK_CHECK_ARG(tiles < (int64_t{1} << 31), "grouped wgrad (fp8): " << tiles << " tiles");
  constexpr size_t smem = kGemmSmemBytesT<T, PrecisionE4m3Rows>;
  static_assert(smem <= 227 * 1024, "shared storage exceeds the 227 KB a block can have");
  MOK_CUDA_CHECK(cudaFuncSetAttribute(grouped_wgrad_fp8_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  const int grid = static_cast<int>(std::min<int64_t>(g.num_blocks > 0 ? g.num_blocks : sms, tiles));
  grouped_wgrad_fp8_kernel<T><<<grid, T::kThreads, smem, stream>>>(map_a, map_b, map_sa, map_sb, p);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void load_fp8_kernels() {
  cudaFuncAttributes a;
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, quantize_cols_kernel));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, grouped_wgrad_fp8_kernel<WgradFp8Tile>));
  load_quantize_rows_kernel();
  load_swiglu_bwd_fp8_kernel();
}

}  // namespace mok::gemm
