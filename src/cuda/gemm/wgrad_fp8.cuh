// The fp8 wgrad kind (fp8_block's weight gradients, docs/precision.md): K-grouped over the
// expert's rows, both operands e4m3 scaled per channel and 128 rows, the k-block's sum promoted
// into fp32 once per 128 rows.
//
//   out[e][m, n] = Σ_{k-blocks kb of expert e's rows} fma(Σ_{r in kb} qa[m, r]·qb[n, r],
//                                                           sa[kb, m] · sb[kb, n], ·)
//
// The operands come transposed, K-major as fp8 wgmma needs them: qa [Mo, R] and qb [No, R] e4m3
// (R: the plan's rows, every expert's segment a multiple of 128 rows, padding rows zero), their
// scales sa [R/128, Mo] and sb [R/128, No] fp32 (k-block-major, so that a tile's scales of a
// k-block are one TMA box each: mok.ops.quantize_cols_fp8 writes them so).  An expert's
// k-blocks are its rows [expert_offset[e], + count rounded up to 128) — the CPU reference's
// chunks of 128 rows, zero-padded.
//
// Tiles of 128 (Mo) x 256 (No) (TileConfigE4m3Wide), two consumer warpgroups of 64 rows each,
// a 128-column part at a time through one 64-register partial (as the block-scaled forward
// kinds); the promotion multiplies each element by its row's A scale times its column's B
// scale, both from the stage.  Tiles (e, m, n) expert-major, each owned by one block: the
// epilogue (gemm/wgrad.cuh epilogue_wgrad_to: bf16 out, fp32 acc, main_grad +=) needs no
// atomics and is deterministic.
#pragma once

#include "cuda/gemm/wgrad.cuh"

namespace mok::gemm {

using WgradFp8Tile = TileConfigE4m3Wide;

// The tile (m, n) of expert e at 128 rows a k-block
__device__ __forceinline__ WgradTile wgrad_fp8_tile(const WgradParams& p, int tile) {
  const int per_expert = p.num_m_blocks * p.num_n_blocks;
  const int e = tile / per_expert;
  const TileCoord tc = raster(tile - e * per_expert, p.num_m_blocks, p.num_n_blocks, p.n_group);
  const int32_t count = p.expert_count[e];
  return WgradTile{e, tc.m, tc.n, (count + WgradFp8Tile::kBlockK - 1) / WgradFp8Tile::kBlockK, p.expert_offset[e], 0};
}

// The rows' A scales of stage i, and one 64-register partial (a part's 128 columns from col0 of
// the stage's) promoted into acc (its 64 registers): acc = fma(partial, float(sa[row] ·
// sb[col]), acc), rows row and row + 8
template <class T>
__device__ __forceinline__ float2 row_scales(const StageStorageT<T, PrecisionE4m3Rows>& s, int i, int row) {
  return float2{ptx::ld_shared_f32(&s.sa[i][row]), ptx::ld_shared_f32(&s.sa[i][row + 8])};
}
template <class T>
__device__ __forceinline__ void promote_rows_scaled(const StageStorageT<T, PrecisionE4m3Rows>& s, int i, float2 sa,
                                                    int col0, const float (&part)[64], float* acc) {
  const int lane_col = (threadIdx.x % 4) * 2;  // and + 1, of each n8 block
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float* sb = &s.sb[i][col0 + 8 * j + lane_col];
    const float sb0 = ptx::ld_shared_f32(sb), sb1 = ptx::ld_shared_f32(sb + 1);
    float* const a = acc + j * 4;
    a[0] = fmaf(part[j * 4 + 0], sa.x * sb0, a[0]);
    a[1] = fmaf(part[j * 4 + 1], sa.x * sb1, a[1]);
    a[2] = fmaf(part[j * 4 + 2], sa.y * sb0, a[2]);
    a[3] = fmaf(part[j * 4 + 3], sa.y * sb1, a[3]);
  }
}

// Consumer warpgroup `consumer` (rows 64·consumer .. + 63 of the tile): acc over the tile's
// k-blocks (at least one), each part's four m64n128k32 MMAs into a fresh partial, promoted as
//   acc = fma(partial, float(sa[row] · sb[col]), acc)
// in k-block order from acc = 0 (the reference's order and roundings, src/ref wgrad_fp8): the
// block-scaled kinds' K loop (tile.cuh consume_tile_promoted) with this promotion.
template <class T>
__device__ __forceinline__ bool consume_tile_rows_scaled(StageStorageT<T, PrecisionE4m3Rows>& s,
                                                         PipelineState<T::kStages>& stage, int num_k_blocks,
                                                         int consumer, float (&acc)[T::kAccRegs],
                                                         const WaitContext& wait) {
  return consume_tile_promoted(
      s, stage, num_k_blocks, consumer, acc, wait, [&s](int i, int row) { return row_scales<T>(s, i, row); },
      [&s](float2 sa, int i, int, int q, const float (&part)[64], float* acc_q) {
        promote_rows_scaled<T>(s, i, sa, 128 * q, part, acc_q);
      });
}

// map_a / map_b: qa [Mo, R], qb [No, R] e4m3 (boxes of 128 rows x 128 of K); map_sa / map_sb:
// their scales [R/128, Mo] and [R/128, No] (boxes of 128 and 256 fp32).  p as the bf16 wgrad
// kind's (wgrad_layout<WgradFp8Tile>; no per-expert tables, no split outputs).
template <class T = WgradFp8Tile>
__global__ void __launch_bounds__(T::kThreads, 1)
    grouped_wgrad_fp8_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                             const __grid_constant__ CUtensorMap map_sa, const __grid_constant__ CUtensorMap map_sb,
                             const WgradParams p) {
  using C = T;
  using S = StageStorageT<T, PrecisionE4m3Rows>;
  extern __shared__ uint8_t smem_raw[];
  auto& s = *reinterpret_cast<S*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const int role = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);  // 0 producer, 1 and 2 consumers
  const WaitContext wait{ptx::globaltimer_ns() + p.timeout_ns, p.timeout_record};
  const int num_tiles = p.num_experts * p.num_m_blocks * p.num_n_blocks;
  if (threadIdx.x == 0) {
    s.init_barriers();
    ptx::fence_mbar_init();
    ptx::prefetch_tensormap(&map_a);
    ptx::prefetch_tensormap(&map_b);
    ptx::prefetch_tensormap(&map_sa);
    ptx::prefetch_tensormap(&map_sb);
  }
  __syncthreads();

  if (role == 0) {
    ptx::setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x != 0) return;
    PipelineState<C::kStages> stage;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const WgradTile t = wgrad_fp8_tile(p, tile);
      const int32_t m0 = t.m_block * C::kBlockM, n0 = t.n_block * C::kBlockN;
      const bool ok = produce_stages(s, stage, t.num_k_blocks, wait, [&](int kb, int i, uint64_t* full) {
        const int32_t k = t.row0 + kb * C::kBlockK;  // the k-block's first row (a multiple of 128)
        ptx::tma_load_2d(s.a[i], &map_a, full, k, m0);
        ptx::tma_load_2d(s.b[i], &map_b, full, k, n0);
        ptx::tma_load_2d(s.b[i] + (C::kBlockN / 2) * C::kBlockK, &map_b, full, k, n0 + C::kBlockN / 2);
        ptx::tma_load_2d(s.sa[i], &map_sa, full, m0, k / C::kBlockK);
        ptx::tma_load_2d(s.sb[i], &map_sb, full, n0, k / C::kBlockK);
      });
      if (!ok) return;
    }
    return;
  }

  ptx::setmaxnreg_inc<C::kConsumerRegs>();
  const int consumer = role - 1;
  PipelineState<C::kStages> stage;
  float acc[C::kAccRegs];
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const WgradTile t = wgrad_fp8_tile(p, tile);
    if (t.num_k_blocks == 0) {  // an expert with no rows: zeros
      epilogue_wgrad<true, false, T>(acc, consumer, p, t);
      continue;
    }
    if (!consume_tile_rows_scaled<T>(s, stage, t.num_k_blocks, consumer, acc, wait)) return;
    epilogue_wgrad<false, false, T>(acc, consumer, p, t);
  }
}

}  // namespace mok::gemm
