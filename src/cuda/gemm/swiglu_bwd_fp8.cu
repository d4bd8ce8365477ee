// fp8_block's SwiGLU backward as a pass of its own (launch.hpp, SwiGLUBwdFp8Args): one block of
// 256 threads per 128 rows x 128 channels.  The dgrad-down kind then runs its plain K loop at the
// plain kind's rate and stores da in fp32; this pass does the epilogue's element math on all of
// the SMs' issue slots, and makes a, dg and du in both orientations from one read (the row
// orientation for the dgrad gate/up kind, the column one for the wgrad kind).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "cuda/cuda_check.hpp"
#include "cuda/gemm/epilogue_bwd.cuh"
#include "cuda/gemm/launch.hpp"
#include "cuda/gemm/quantize.cuh"
#include "runtime/errors.hpp"

namespace mok::gemm {
namespace {

constexpr int kBlock = 128, kPad = 8;  // + 8 bf16 a shared row: conflict-free row and column accesses
using BfTile = __nv_bfloat16[kBlock][kBlock + kPad];
// Staging of the block's outputs, so that they leave in whole 32-byte sectors: dh's e4m3 rows
// (dg's 128 bytes then du's, + 16 bytes of pad) and one tensor's transposed e4m3 columns
using QRows = uint8_t[kBlock][2 * kBlock + 16];
using QCols = uint8_t[kBlock][kBlock + 16];
constexpr size_t kSmemBytes = 3 * sizeof(BfTile) + sizeof(QRows) + sizeof(QCols);

__global__ void __launch_bounds__(256, 1) swiglu_bwd_fp8_kernel(const SwiGLUBwdFp8Args p) {
  extern __shared__ __align__(16) uint8_t smem[];
  BfTile* const tiles = reinterpret_cast<BfTile*>(smem);  // [0] a, [1] dg, [2] du
  QRows& qrows = *reinterpret_cast<QRows*>(smem + 3 * sizeof(BfTile));
  QCols& qcols = *reinterpret_cast<QCols*>(smem + 3 * sizeof(BfTile) + sizeof(QRows));
  __shared__ float half_amax[2][kBlock];
  const int64_t c0 = int64_t{blockIdx.x} * kBlock, r0 = int64_t{blockIdx.y} * kBlock;
  if (p.live_rows != nullptr && r0 >= __ldg(p.live_rows)) return;  // past the rows in use (block-uniform)
  const int tid = static_cast<int>(threadIdx.x), t = tid & 3, quad = tid >> 2;
  const int64_t inter = p.inter, n_chunks = inter / kBlock;
  const __nv_bfloat16* const h = static_cast<const __nv_bfloat16*>(p.h);
  // Rows of the block that exist (valid_rows: the shared expert's T)
  const int64_t left = p.valid_rows < 0 ? kBlock : p.valid_rows - r0;
  const int rows_here = left <= 0 ? 0 : left >= kBlock ? kBlock : static_cast<int>(left);

  // Rows: quad q takes rows q and q + 64 of the block, its lane t the 32 channels n8·8 + 2t, +1
  // (n8 = 0 .. 15) -- the epilogue's fragment layout, so the router-gradient partial sums in its
  // order.  Rows past valid_rows compute zeros (w = 0, nothing loaded) and store nothing; every
  // lane runs every shuffle.
#pragma unroll 1
  for (int hr = 0; hr < 2; ++hr) {
    const int rl = quad + 64 * hr;
    const int64_t row = r0 + rl;
    const bool live = rl < rows_here;
    const float w = live ? (p.row_weight != nullptr ? __ldg(p.row_weight + row) : 1.0f) : 0.0f;
    const float* const da_row = p.da + row * inter + c0 + 2 * t;
    const __nv_bfloat16* const g_row = h + row * 2 * inter + c0 + 2 * t;
    float da[32], dg[32], du[32], av[32];
    float amax_g = 0.0f, amax_u = 0.0f, amax_a = 0.0f;
#pragma unroll
    for (int n8 = 0; n8 < 16; ++n8) {
      const float2 d = live ? __ldg(reinterpret_cast<const float2*>(da_row + n8 * 8)) : make_float2(0.0f, 0.0f);
      const uint32_t gw = live ? __ldg(reinterpret_cast<const unsigned int*>(g_row + n8 * 8)) : 0u;
      const uint32_t uw = live ? __ldg(reinterpret_cast<const unsigned int*>(g_row + inter + n8 * 8)) : 0u;
      const SwiGLUBwdE4m3Elem v0 = swiglu_bwd_e4m3_elem(bf16_lo(gw), bf16_lo(uw), w, d.x);
      const SwiGLUBwdE4m3Elem v1 = swiglu_bwd_e4m3_elem(bf16_hi(gw), bf16_hi(uw), w, d.y);
      da[2 * n8] = d.x, da[2 * n8 + 1] = d.y;
      dg[2 * n8] = v0.dg, dg[2 * n8 + 1] = v1.dg;
      du[2 * n8] = v0.du, du[2 * n8 + 1] = v1.du;
      av[2 * n8] = v0.a, av[2 * n8 + 1] = v1.a;
      amax_g = fmaxf(amax_g, fmaxf(fabsf(v0.dg), fabsf(v1.dg)));
      amax_u = fmaxf(amax_u, fmaxf(fabsf(v0.du), fabsf(v1.du)));
      amax_a = fmaxf(amax_a, fmaxf(fabsf(v0.a), fabsf(v1.a)));
      // bf16 copies for the column quantisers (what the kind wrote as dh and a)
      *reinterpret_cast<uint32_t*>(&tiles[0][rl][n8 * 8 + 2 * t]) = pack_bf16x2(v0.a, v1.a);
      *reinterpret_cast<uint32_t*>(&tiles[1][rl][n8 * 8 + 2 * t]) = pack_bf16x2(v0.dg, v1.dg);
      *reinterpret_cast<uint32_t*>(&tiles[2][rl][n8 * 8 + 2 * t]) = pack_bf16x2(v0.du, v1.du);
    }
    const float s_g = e4m3_block_scale(quad_max(amax_g), p.pow2), s_u = e4m3_block_scale(quad_max(amax_u), p.pow2);
    const float s_a = e4m3_block_scale(quad_max(amax_a), p.pow2);
    const E4m3Divisor d_g = e4m3_divisor(s_g), d_u = e4m3_divisor(s_u), d_a = e4m3_divisor(s_a);
    float sum = 0.0f;  // <da, a_deq> over the lane's 32 channels in order, then the quad's four
#pragma unroll
    for (int n8 = 0; n8 < 16; ++n8) {
      sum = dtw_add_pair(sum, da[2 * n8], da[2 * n8 + 1], e4m3x2(av[2 * n8], av[2 * n8 + 1], d_a), s_a);
      *reinterpret_cast<__nv_fp8x2_storage_t*>(&qrows[rl][n8 * 8 + 2 * t]) = e4m3x2(dg[2 * n8], dg[2 * n8 + 1], d_g);
      *reinterpret_cast<__nv_fp8x2_storage_t*>(&qrows[rl][kBlock + n8 * 8 + 2 * t]) =
          e4m3x2(du[2 * n8], du[2 * n8 + 1], d_u);
    }
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 1));
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 2));
    if (live && t == 0) {
      p.dh_scales[blockIdx.x * p.scales_ld + row] = s_g;
      p.dh_scales[(n_chunks + blockIdx.x) * p.scales_ld + row] = s_u;
      if (p.dtw_partials != nullptr) p.dtw_partials[row * n_chunks + blockIdx.x] = sum;
    }
  }
  __syncthreads();
  // dh's e4m3 rows out: a row's dg and du pieces of 128 bytes, 16 bytes a lane (the existing rows)
  uint8_t* const dh_q = static_cast<uint8_t*>(p.dh_q);
#pragma unroll
  for (int i = 0; i < kBlock * 16 / 256; ++i) {
    const int idx = i * 256 + tid, r = idx / 16, piece = idx % 16, part = piece / 8, off = (piece % 8) * 16;
    if (r < rows_here)
      *reinterpret_cast<uint4*>(dh_q + (r0 + r) * 2 * inter + part * inter + c0 + off) =
          *reinterpret_cast<const uint4*>(&qrows[r][part * kBlock + off]);
  }

  // Columns: a, dg, du in turn; column c, rows 64·hc .. +63 a thread (a warp's lanes 32
  // consecutive columns of one half), the halves' maxima through shared memory; then the
  // column's 64 values as e4m3 into row c of the staging, which leaves as rows c0 + c of the
  // transposed output, 128 bytes each -- launch_quantize_cols' arithmetic (its value times a
  // row weight of 1 is the value)
  const int c = tid % kBlock, hc = tid / kBlock;
  uint8_t* const outs[3] = {static_cast<uint8_t*>(p.at), static_cast<uint8_t*>(p.dgt), static_cast<uint8_t*>(p.dut)};
  float* const out_scales[3] = {p.at_scales, p.dgt_scales, p.dut_scales};
#pragma unroll
  for (int x = 0; x < 3; ++x) {
    const auto value = [&](int r) { return __bfloat162float(tiles[x][r][c]); };
    float amax = 0.0f;
#pragma unroll 8
    for (int r = 0; r < 64; ++r) amax = fmaxf(amax, fabsf(value(64 * hc + r)));
    half_amax[hc][c] = amax;
    __syncthreads();  // (and the previous tensor's staging read out)
    amax = fmaxf(half_amax[0][c], half_amax[1][c]);
    const float s = e4m3_block_scale(amax, p.pow2);
    const E4m3Divisor d = e4m3_divisor(s);
    if (hc == 0) out_scales[x][(r0 / kBlock) * inter + c0 + c] = s;
#pragma unroll
    for (int q = 0; q < 4; ++q)
      *reinterpret_cast<uint4*>(&qcols[c][64 * hc + 16 * q]) = e4m3x16(value, 64 * hc + 16 * q, d);
    __syncthreads();  // the staging written; half_amax read
#pragma unroll
    for (int i = 0; i < kBlock * 8 / 256; ++i) {
      const int idx = i * 256 + tid, cc = idx / 8, off = (idx % 8) * 16;
      *reinterpret_cast<uint4*>(outs[x] + (c0 + cc) * p.rows + r0 + off) = *reinterpret_cast<const uint4*>(&qcols[cc][off]);
    }
  }
}

}  // namespace

void launch_swiglu_bwd_fp8(const SwiGLUBwdFp8Args& p, cudaStream_t stream) {
  MOK_CHECK_ARG(p.rows % kBlock == 0 && p.inter > 0 && p.inter % kBlock == 0,
                "SwiGLU backward (fp8): rows = " << p.rows << " and I = " << p.inter << " must be multiples of 128");
  MOK_CHECK_ARG(p.da != nullptr && p.h != nullptr && p.dh_q != nullptr && p.dh_scales != nullptr && p.at != nullptr &&
                    p.at_scales != nullptr && p.dgt != nullptr && p.dgt_scales != nullptr && p.dut != nullptr &&
                    p.dut_scales != nullptr,
                "SwiGLU backward (fp8): da, h and every output are required (dtw_partials and row_weight may be null)");
  MOK_CHECK_ARG(p.scales_ld >= p.rows || (p.valid_rows >= 0 && p.scales_ld >= p.valid_rows),
                "SwiGLU backward (fp8): scales_ld = " << p.scales_ld << " below the rows it holds");
  MOK_CHECK_ARG((reinterpret_cast<uintptr_t>(p.da) & 7u) == 0 && (reinterpret_cast<uintptr_t>(p.h) & 3u) == 0 &&
                    (reinterpret_cast<uintptr_t>(p.at) & 15u) == 0 && (reinterpret_cast<uintptr_t>(p.dgt) & 15u) == 0 &&
                    (reinterpret_cast<uintptr_t>(p.dut) & 15u) == 0,
                "SwiGLU backward (fp8): da 8-byte, h 4-byte and the transposed outputs 16-byte aligned");
  if (p.rows == 0) return;
  MOK_CUDA_CHECK(cudaFuncSetAttribute(swiglu_bwd_fp8_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(kSmemBytes)));
  const dim3 grid(static_cast<unsigned>(p.inter / kBlock), static_cast<unsigned>(p.rows / kBlock));
  swiglu_bwd_fp8_kernel<<<grid, 256, kSmemBytes, stream>>>(p);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void load_swiglu_bwd_fp8_kernel() {
  cudaFuncAttributes a;
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, swiglu_bwd_fp8_kernel));
}

}  // namespace mok::gemm
