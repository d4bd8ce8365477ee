// fp8_block's quantisers as kernels of their own (gemm/quantize.cuh has the device functions):
// activation rows (per row and 128 channels) and weight blocks (per 128 x 128 block, in both
// orientations from the one bf16 read).
#include <cuda_bf16.h>

#include <algorithm>

#include "cuda/cuda_check.hpp"
#include "cuda/gemm/launch.hpp"
#include "cuda/gemm/quantize.cuh"
#include "runtime/errors.hpp"

namespace mok::gemm {

namespace {

__global__ void quantize_rows_kernel(const __nv_bfloat16* __restrict__ x, uint8_t* __restrict__ q,
                                     float* __restrict__ scales, int64_t scales_ld, int64_t rows, int64_t n,
                                     bool pow2) {
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t r = int64_t{blockIdx.x} * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps)
    quantize_row_warp(x + r * n, q + r * n, scales, scales_ld, r, n, pow2);
}

// One 128 x 128 block (blockIdx.x: its 128 columns, .y: its 128 rows, .z: the matrix) per
// block of 256 threads: the bf16 block into shared memory along its contiguous dimension (8
// bytes a load), its max |w| across the block, then q and qt written from the one copy (4
// bytes a store), and its scale.
constexpr int kQuantizeThreads = 256;
constexpr int kPad = 8;  // bf16 a shared row past the block's 128 (a row's 8-byte pieces stay aligned)

__global__ void __launch_bounds__(kQuantizeThreads) quantize_blocks_kernel(const QuantizeBlocksArgs a) {
  __shared__ __align__(16) __nv_bfloat16 tile[128][128 + kPad];  // [outer][inner]: inner is w's contiguous dimension
  __shared__ float warp_max[kQuantizeThreads / 32];
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t e = blockIdx.z, r0 = int64_t{blockIdx.y} * 128, c0 = int64_t{blockIdx.x} * 128;
  const bool cols_inner = a.w_col_stride == 1;  // else a.w_row_stride == 1 (checked on the host)
  const int64_t outer_stride = cols_inner ? a.w_row_stride : a.w_col_stride;
  const __nv_bfloat16* const w = static_cast<const __nv_bfloat16*>(a.w) + e * a.w_expert_stride + r0 * a.w_row_stride + c0 * a.w_col_stride;
  float amax = 0.0f;
#pragma unroll 4
  for (int it = 0; it < 128 * 128 / 4 / kQuantizeThreads; ++it) {
    const int idx = it * kQuantizeThreads + tid, outer = idx / 32, inner = (idx % 32) * 4;
    const uint2 raw = *reinterpret_cast<const uint2*>(w + outer * outer_stride + inner);
    *reinterpret_cast<uint2*>(&tile[outer][inner]) = raw;
    const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
    const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
    amax = fmaxf(amax, fmaxf(fmaxf(fabsf(__low2float(lo)), fabsf(__high2float(lo))),
                             fmaxf(fabsf(__low2float(hi)), fabsf(__high2float(hi)))));
  }
#pragma unroll
  for (int m = 16; m > 0; m /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  if (tid % 32 == 0) warp_max[tid / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
#pragma unroll
  for (int i = 1; i < kQuantizeThreads / 32; ++i) amax = fmaxf(amax, warp_max[i]);
  const float s = e4m3_block_scale(amax, a.pow2);
  const E4m3Divisor d = e4m3_divisor(s);
  // The block's element (r, c), r and c in [0, 128)
  const auto at = [&](int r, int c) { return __bfloat162float(cols_inner ? tile[r][c] : tile[c][r]); };
  // Four e4m3 of one output row: (row, col .. col + 3) of the orientation `transposed`
  const auto store4 = [&](uint8_t* dst, bool transposed, int row, int col) {
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = transposed ? at(col + j, row) : at(row, col + j);
    *reinterpret_cast<uint32_t*>(dst) =
        static_cast<uint32_t>(e4m3x2(v[0], v[1], d)) | (static_cast<uint32_t>(e4m3x2(v[2], v[3], d)) << 16);
  };
#pragma unroll 4
  for (int it = 0; it < 128 * 128 / 4 / kQuantizeThreads; ++it) {
    const int idx = it * kQuantizeThreads + tid, row = idx / 32, col = (idx % 32) * 4;
    if (a.q != nullptr)
      store4(a.q + e * a.q_expert_stride + (r0 + row) * a.q_row_stride + c0 + col, false, row, col);
    if (a.qt != nullptr)  // qt's row c0 + row holds w's column c0 + row, its rows r0 .. as columns
      store4(a.qt + e * a.qt_expert_stride + (c0 + row) * a.qt_row_stride + r0 + col, true, row, col);
  }
  if (tid == 0) a.scales[e * a.s_expert_stride + blockIdx.y * (a.cols / 128) + blockIdx.x] = s;
}

}  // namespace

void launch_quantize_rows(const void* x, void* q, float* scales, int64_t rows, int64_t n, bool pow2,
                          cudaStream_t stream, int64_t scales_ld) {
  if (scales_ld == 0) scales_ld = rows;
  MOK_CHECK_ARG(scales_ld >= rows, "quantize rows: scales_ld = " << scales_ld << " < rows = " << rows);
  MOK_CHECK_ARG(n > 0 && n % 128 == 0, "quantize rows: n = " << n << " must be a positive multiple of 128");
  MOK_CHECK_ARG((reinterpret_cast<uintptr_t>(x) & 15u) == 0 && (reinterpret_cast<uintptr_t>(q) & 3u) == 0 &&
                    (reinterpret_cast<uintptr_t>(scales) & 3u) == 0,
                "quantize rows: x must be 16-byte, q and scales 4-byte aligned");
  if (rows == 0) return;
  constexpr int kThreads = 256;  // 8 rows a block
  const int64_t blocks = std::min<int64_t>((rows + kThreads / 32 - 1) / (kThreads / 32), 65535);
  quantize_rows_kernel<<<static_cast<int>(blocks), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x),
                                                                          static_cast<uint8_t*>(q), scales, scales_ld, rows, n,
                                                                          pow2);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void load_quantize_rows_kernel() {
  cudaFuncAttributes a;
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, quantize_rows_kernel));
}

void launch_quantize_blocks(const QuantizeBlocksArgs& a, cudaStream_t stream) {
  MOK_CHECK_ARG(a.rows > 0 && a.cols > 0 && a.rows % 128 == 0 && a.cols % 128 == 0,
                "quantize blocks: [" << a.rows << ", " << a.cols << "] must be whole 128 x 128 blocks");
  MOK_CHECK_ARG(a.num > 0 && a.num <= 65535, "quantize blocks: " << a.num << " matrices (1 .. 65535)");
  MOK_CHECK_ARG(a.w_col_stride == 1 || a.w_row_stride == 1,
                "quantize blocks: w must be row-major (column stride 1) or column-major (row stride 1)");
  const int64_t outer = a.w_col_stride == 1 ? a.w_row_stride : a.w_col_stride;
  MOK_CHECK_ARG((reinterpret_cast<uintptr_t>(a.w) & 7u) == 0 && outer % 4 == 0 && a.w_expert_stride % 4 == 0,
                "quantize blocks: w must be 8-byte aligned with strides of multiples of 4 elements");
  MOK_CHECK_ARG(a.q != nullptr || a.qt != nullptr, "quantize blocks: neither q nor qt given");
  MOK_CHECK_ARG(a.q == nullptr || ((reinterpret_cast<uintptr_t>(a.q) & 3u) == 0 && a.q_row_stride % 4 == 0 &&
                                   a.q_expert_stride % 4 == 0 && a.q_row_stride >= a.cols),
                "quantize blocks: q must be 4-byte aligned, its row stride >= cols, strides multiples of 4");
  MOK_CHECK_ARG(a.qt == nullptr || ((reinterpret_cast<uintptr_t>(a.qt) & 3u) == 0 && a.qt_row_stride % 4 == 0 &&
                                    a.qt_expert_stride % 4 == 0 && a.qt_row_stride >= a.rows),
                "quantize blocks: qt must be 4-byte aligned, its row stride >= rows, strides multiples of 4");
  MOK_CHECK_ARG(a.scales != nullptr, "quantize blocks: scales is null");
  const dim3 grid(static_cast<unsigned>(a.cols / 128), static_cast<unsigned>(a.rows / 128), static_cast<unsigned>(a.num));
  quantize_blocks_kernel<<<grid, kQuantizeThreads, 0, stream>>>(a);
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mok::gemm
