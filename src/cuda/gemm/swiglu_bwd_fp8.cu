// fp8_block's SwiGLU backward as a pass of its own (launch.hpp, SwiGLUBwdFp8Args): one block of
// 256 threads per 128 rows x 128 channels.  The dgrad-down kind then runs its plain K loop at the
// plain kind's rate and stores da in fp32; this pass does the epilogue's element math on all of
// the SMs' issue slots, and makes a, dg and du in both orientations from one read (the row
// orientation for the dgrad gate/up kind, the column one for the wgrad kind).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdlib>

#include "cuda/cuda_check.hpp"
#include "cuda/gemm/epilogue_bwd.cuh"
#include "cuda/gemm/launch.hpp"
#include "cuda/gemm/quantize.cuh"
#include "runtime/errors.hpp"

namespace mok::gemm {
namespace {

constexpr int kBlock = 128, kPad = 8;  // + 8 bf16 a shared row: conflict-free row and column accesses
using BfTile = __nv_bfloat16[kBlock][kBlock + kPad];
constexpr size_t kSmemBytes = 3 * sizeof(BfTile);  // a, dg, du of the block in bf16

template <int kMinBlocks>
__global__ void __launch_bounds__(256, kMinBlocks) swiglu_bwd_fp8_kernel(const SwiGLUBwdFp8Args p) {
  extern __shared__ __align__(16) uint8_t smem[];
  BfTile* const tiles = reinterpret_cast<BfTile*>(smem);  // [0] a, [1] dg, [2] du
  __shared__ float half_amax[2][kBlock];
  const int64_t c0 = int64_t{blockIdx.x} * kBlock, r0 = int64_t{blockIdx.y} * kBlock;
  if (p.live_rows != nullptr && r0 >= __ldg(p.live_rows)) return;  // past the rows in use (block-uniform)
  const int tid = static_cast<int>(threadIdx.x), t = tid & 3, quad = tid >> 2;
  const int64_t inter = p.inter, n_chunks = inter / kBlock;
  const __nv_bfloat16* const h = static_cast<const __nv_bfloat16*>(p.h);
  uint8_t* const dh_q = static_cast<uint8_t*>(p.dh_q);

  // Rows: quad q takes rows q and q + 64 of the block, its lane t the 32 channels n8·8 + 2t, +1
  // (n8 = 0 .. 15) -- the epilogue's fragment layout, so the router-gradient partial sums in its
  // order.  Rows past valid_rows compute zeros (w = 0, nothing loaded) and store nothing; every
  // lane runs every shuffle.
#pragma unroll 1
  for (int hr = 0; hr < 2; ++hr) {
    const int rl = quad + 64 * hr;
    const int64_t row = r0 + rl;
    const bool live = p.valid_rows < 0 || row < p.valid_rows;
    const float w = live ? (p.row_weight != nullptr ? __ldg(p.row_weight + row) : 1.0f) : 0.0f;
    const float* const da_row = p.da + row * inter + c0 + 2 * t;
    const __nv_bfloat16* const g_row = h + row * 2 * inter + c0 + 2 * t;
    float dg[32], du[32], av[32];
    float amax_g = 0.0f, amax_u = 0.0f, amax_a = 0.0f;
#pragma unroll
    for (int n8 = 0; n8 < 16; ++n8) {
      const float2 da = live ? __ldg(reinterpret_cast<const float2*>(da_row + n8 * 8)) : make_float2(0.0f, 0.0f);
      const uint32_t gw = live ? __ldg(reinterpret_cast<const unsigned int*>(g_row + n8 * 8)) : 0u;
      const uint32_t uw = live ? __ldg(reinterpret_cast<const unsigned int*>(g_row + inter + n8 * 8)) : 0u;
      const SwiGLUBwdE4m3Elem v0 = swiglu_bwd_e4m3_elem(bf16_lo(gw), bf16_lo(uw), w, da.x);
      const SwiGLUBwdE4m3Elem v1 = swiglu_bwd_e4m3_elem(bf16_hi(gw), bf16_hi(uw), w, da.y);
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
    uint8_t* const qg = dh_q + row * 2 * inter + c0 + 2 * t;
    float sum = 0.0f;  // <da, a_deq> over the lane's 32 channels in order, then the quad's four
#pragma unroll
    for (int n8 = 0; n8 < 16; ++n8) {
      // da again (this thread's own load above: L1), rather than 32 more live registers
      const float2 da = live ? __ldg(reinterpret_cast<const float2*>(da_row + n8 * 8)) : make_float2(0.0f, 0.0f);
      sum = dtw_add_pair(sum, da.x, da.y, e4m3x2(av[2 * n8], av[2 * n8 + 1], d_a), s_a);
      if (!live) continue;
      *reinterpret_cast<__nv_fp8x2_storage_t*>(qg + n8 * 8) = e4m3x2(dg[2 * n8], dg[2 * n8 + 1], d_g);
      *reinterpret_cast<__nv_fp8x2_storage_t*>(qg + inter + n8 * 8) = e4m3x2(du[2 * n8], du[2 * n8 + 1], d_u);
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

  // Columns: a, dg, du in turn; column c, rows 64·hc .. +63 a thread (a warp's lanes 32
  // consecutive columns of one half), the halves' maxima through shared memory; then the
  // column's 64 values as e4m3 into row c0 + c of the transposed output -- launch_quantize_cols'
  // arithmetic (its value times a row weight of 1 is the value)
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
    __syncthreads();
    amax = fmaxf(half_amax[0][c], half_amax[1][c]);
    const float s = e4m3_block_scale(amax, p.pow2);
    const E4m3Divisor d = e4m3_divisor(s);
    if (hc == 0) out_scales[x][(r0 / kBlock) * inter + c0 + c] = s;
    uint8_t* const dst = outs[x] + (c0 + c) * p.rows + r0 + 64 * hc;
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // 16 bytes at a time
      uint32_t word[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = 64 * hc + 16 * q + 4 * j;
        word[j] = static_cast<uint32_t>(e4m3x2(value(r), value(r + 1), d)) |
                  (static_cast<uint32_t>(e4m3x2(value(r + 2), value(r + 3), d)) << 16);
      }
      *reinterpret_cast<uint4*>(dst + 16 * q) = make_uint4(word[0], word[1], word[2], word[3]);
    }
    __syncthreads();  // half_amax is the next tensor's
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
  const dim3 grid(static_cast<unsigned>(p.inter / kBlock), static_cast<unsigned>(p.rows / kBlock));
  // TEMPORARY (session 29 A/B): MOK_TMP_SWIGLU_OCC=1 runs 142 registers, one block an SM
  const char* occ = std::getenv("MOK_TMP_SWIGLU_OCC");
  if (occ != nullptr && occ[0] == '1') {
    MOK_CUDA_CHECK(cudaFuncSetAttribute(swiglu_bwd_fp8_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kSmemBytes)));
    swiglu_bwd_fp8_kernel<1><<<grid, 256, kSmemBytes, stream>>>(p);
  } else {
    MOK_CUDA_CHECK(cudaFuncSetAttribute(swiglu_bwd_fp8_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kSmemBytes)));
    swiglu_bwd_fp8_kernel<2><<<grid, 256, kSmemBytes, stream>>>(p);
  }
  MOK_CUDA_CHECK(cudaGetLastError());
}

void load_swiglu_bwd_fp8_kernel() {
  cudaFuncAttributes a;
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, swiglu_bwd_fp8_kernel<1>));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, swiglu_bwd_fp8_kernel<2>));
}

}  // namespace mok::gemm
