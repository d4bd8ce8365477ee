// Where one tile's operands come from, for every orientation: what both directions' ops return
// (load) and the one producer loop that loads it (produce_load).
//
//   ops       gemm::Operands: how the stage holds A and B (the consumers' MMA step follows)
//   kKMajor   A: rows a_row.. of a, K columns BLOCK_K·kb..  B: two halves of N / 2 rows (N: the tile's),
//             rows b_row.. and b_row + b_aux.., K columns BLOCK_K·kb..: the first half of b0,
//             the second of b1 (k_split == kHalvesApart), or both of b0 for k-blocks below
//             k_split and of b1 after (their K columns from 0 again)
//   kBNMajor  A as above.  B as stored, N / kBoxCols boxes of BLOCK_K rows (K) by kBoxCols
//             columns: K rows b_row + BLOCK_K·kb.., columns b_aux..; of b0 for k-blocks below
//             k_split and of b1 after (their K rows from b_row again), or (kHalvesApart) the
//             first half's boxes of b0 and the second half's of b1, each from column b_aux
//   kMNMajor  both operands K = rows: rows a_row + BLOCK_K·kb of a (columns a_col..,
//             BLOCK_M / kBoxCols boxes) and of b0 (columns b_aux.., N / kBoxCols boxes)
// The halves of a B tile are a gate/up tile's gate and up channels (two maps, the same rows or
// columns) or two neighbouring halves of one map (b1 == b0, b_aux = N / 2).
#pragma once

#include "cuda/fused/tile_sizes.cuh"
#include "cuda/gemm/tile.cuh"

namespace mok::cuda::fused {

inline constexpr int32_t kHalvesApart = -1;  // k_split: B's halves from b0 and b1, no K split

struct Load {
  int32_t ops;  // gemm::Operands
  const CUtensorMap* a;
  const CUtensorMap* b0;
  const CUtensorMap* b1;
  int32_t a_row, b_row, b_aux, k_split, num_k_blocks, a_col;
};

// The producer's loads of one tile, k-block by k-block; after_first() once the first k-block is
// issued (or at once for a tile of no k-blocks).  False on a timed-out wait.
template <class Stages, class Stage, class AfterFirst>
__device__ __forceinline__ bool produce_load(Stages& s, Stage& stage, const Load& l, const gemm::WaitContext& wait,
                                             AfterFirst&& after_first) {
  // The halves of B: rows of a K-major stage, whole boxes of an N-major one
  constexpr int kTileN = Stages::Tile::kBlockN, kHalf = kTileN / 2;
  static_assert(kTileN % (2 * kBoxCols) == 0, "an N-major B half is whole boxes");
  if (l.num_k_blocks == 0) {
    after_first();
    return true;
  }
  const int32_t ops = l.ops;
  return gemm::produce_stages(s, stage, l.num_k_blocks, wait, [&](int kb, int i, uint64_t* full) {
    // (the K split: past it the second map, its K from 0 again; computed in each branch, where
    // it is used: hoisted, it cost the backward's producer 24 bytes more spills)
    if (ops == static_cast<int32_t>(gemm::Operands::kKMajor)) {
      ptx::tma_load_2d(s.a[i], l.a, full, kb * kBlockK, l.a_row);
      if (l.k_split == kHalvesApart) {
        ptx::tma_load_2d(s.b[i], l.b0, full, kb * kBlockK, l.b_row);
        ptx::tma_load_2d(s.b[i] + kHalf * kBlockK, l.b1, full, kb * kBlockK, l.b_row + l.b_aux);
      } else {
        const bool second = kb >= l.k_split;
        const CUtensorMap* const map = second ? l.b1 : l.b0;
        const int32_t k = (second ? kb - l.k_split : kb) * kBlockK;
        ptx::tma_load_2d(s.b[i], map, full, k, l.b_row);
        ptx::tma_load_2d(s.b[i] + kHalf * kBlockK, map, full, k, l.b_row + l.b_aux);
      }
    } else if (ops == static_cast<int32_t>(gemm::Operands::kBNMajor)) {
      ptx::tma_load_2d(s.a[i], l.a, full, kb * kBlockK, l.a_row);
      constexpr int kBoxes = kTileN / kBoxCols, kHalfBoxes = kBoxes / 2;
      if (l.k_split == kHalvesApart) {
        const int32_t k_row = l.b_row + kb * kBlockK;
#pragma unroll
        for (int c = 0; c < kBoxes; ++c)
          ptx::tma_load_2d(s.b[i] + c * gemm::kNChunkElems, c < kHalfBoxes ? l.b0 : l.b1, full,
                           l.b_aux + (c % kHalfBoxes) * kBoxCols, k_row);
      } else {
        const bool second = kb >= l.k_split;
        const CUtensorMap* const map = second ? l.b1 : l.b0;
        const int32_t k_row = l.b_row + (second ? kb - l.k_split : kb) * kBlockK;
#pragma unroll
        for (int c = 0; c < kBoxes; ++c)
          ptx::tma_load_2d(s.b[i] + c * gemm::kNChunkElems, map, full, l.b_aux + c * kBoxCols, k_row);
      }
    } else {
      const int32_t row = l.a_row + kb * kBlockK;
#pragma unroll
      for (int c = 0; c < kBlockM / kBoxCols; ++c)
        ptx::tma_load_2d(s.a[i] + c * gemm::kNChunkElems, l.a, full, l.a_col + c * kBoxCols, row);
#pragma unroll
      for (int c = 0; c < kTileN / kBoxCols; ++c)
        ptx::tma_load_2d(s.b[i] + c * gemm::kNChunkElems, l.b0, full, l.b_aux + c * kBoxCols, row);
    }
    if (kb == 0) after_first();
  });
}

}  // namespace mok::cuda::fused
