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
  // Block-scaled policies (K-major, halves apart): A's scale map (its box at (a_row, kb)) and
  // the B halves' 128 x 128 block scales of the tile's rows, k-block kb's at sb0[kb], sb1[kb]
  const CUtensorMap* sa = nullptr;
  const float* sb0 = nullptr;
  const float* sb1 = nullptr;
};

// The producer's loads of one tile, k-block by k-block; after_first() once the first k-block is
// issued (or at once for a tile of no k-blocks).  False on a timed-out wait.  NOTES: one loop
// per orientation, and the first k-block peeled off it with after_first() (the backward's next
// task's claim and decode) between: with the decode and the three orientations inside one loop,
// the ping-pong backward's producer (40 registers) reloaded ten spilled words from local memory
// every k-block and became the kernel's limit (docs/perf.md, session 23).
template <class Stages, class Stage, class AfterFirst>
__device__ __forceinline__ bool produce_load(Stages& s, Stage& stage, const Load& l, const gemm::WaitContext& wait,
                                             AfterFirst&& after_first) {
  // The halves of B: rows of a K-major stage, whole boxes of an N-major one
  constexpr int kTileN = Stages::Tile::kBlockN, kHalf = kTileN / 2;
  // An N-major B half read from its own map is whole boxes (kHalvesApart below; only the
  // transposed-weight policies load so, policy.cuh checks their tiles); a tile of 192 columns
  // reads N-major B from one map
  constexpr bool kWholeBoxHalves = kTileN % (2 * kBoxCols) == 0;
  const int32_t n = l.num_k_blocks;
  if (n == 0) {
    after_first();
    return true;
  }
  // The k-blocks [0, 1), then after_first(), then [1, n)
  auto run = [&](auto issue) {
    if (!gemm::produce_stages(s, stage, 0, 1, wait, issue)) return false;
    after_first();
    return gemm::produce_stages(s, stage, 1, n, wait, issue);
  };
  if (l.ops == static_cast<int32_t>(gemm::Operands::kKMajor)) {
    const CUtensorMap *const a = l.a, *const b0 = l.b0, *const b1 = l.b1;
    const int32_t a_row = l.a_row, b_row = l.b_row, b_aux = l.b_aux, k_split = l.k_split;
    if (k_split == kHalvesApart)
      return run([=, &s](int kb, int i, uint64_t* full) {
        ptx::tma_load_2d(s.a[i], a, full, kb * kBlockK, a_row);
        ptx::tma_load_2d(s.b[i], b0, full, kb * kBlockK, b_row);
        ptx::tma_load_2d(s.b[i] + kHalf * kBlockK, b1, full, kb * kBlockK, b_row + b_aux);
      });
    // The K split: past it the second map, its K from 0 again
    return run([=, &s](int kb, int i, uint64_t* full) {
      ptx::tma_load_2d(s.a[i], a, full, kb * kBlockK, a_row);
      const bool second = kb >= k_split;
      const CUtensorMap* const map = second ? b1 : b0;
      const int32_t k = (second ? kb - k_split : kb) * kBlockK;
      ptx::tma_load_2d(s.b[i], map, full, k, b_row);
      ptx::tma_load_2d(s.b[i] + kHalf * kBlockK, map, full, k, b_row + b_aux);
    });
  }
  if (l.ops == static_cast<int32_t>(gemm::Operands::kBNMajor)) {
    constexpr int kBoxes = kTileN / kBoxCols, kHalfBoxes = kBoxes / 2;
    const CUtensorMap *const a = l.a, *const b0 = l.b0, *const b1 = l.b1;
    const int32_t a_row = l.a_row, b_row = l.b_row, b_aux = l.b_aux, k_split = l.k_split;
    if (kWholeBoxHalves && k_split == kHalvesApart)
      return run([=, &s](int kb, int i, uint64_t* full) {
        ptx::tma_load_2d(s.a[i], a, full, kb * kBlockK, a_row);
        const int32_t k_row = b_row + kb * kBlockK;
#pragma unroll
        for (int c = 0; c < kBoxes; ++c)
          ptx::tma_load_2d(s.b[i] + c * gemm::kNChunkElems, c < kHalfBoxes ? b0 : b1, full,
                           b_aux + (c % kHalfBoxes) * kBoxCols, k_row);
      });
    return run([=, &s](int kb, int i, uint64_t* full) {
      ptx::tma_load_2d(s.a[i], a, full, kb * kBlockK, a_row);
      const bool second = kb >= k_split;
      const CUtensorMap* const map = second ? b1 : b0;
      const int32_t k_row = b_row + (second ? kb - k_split : kb) * kBlockK;
#pragma unroll
      for (int c = 0; c < kBoxes; ++c)
        ptx::tma_load_2d(s.b[i] + c * gemm::kNChunkElems, map, full, b_aux + c * kBoxCols, k_row);
    });
  }
  const CUtensorMap *const a = l.a, *const b = l.b0;
  const int32_t a_row = l.a_row, a_col = l.a_col, b_aux = l.b_aux;
  return run([=, &s](int kb, int i, uint64_t* full) {
    const int32_t row = a_row + kb * kBlockK;
#pragma unroll
    for (int c = 0; c < kBlockM / kBoxCols; ++c)
      ptx::tma_load_2d(s.a[i] + c * gemm::kNChunkElems, a, full, a_col + c * kBoxCols, row);
#pragma unroll
    for (int c = 0; c < kTileN / kBoxCols; ++c)
      ptx::tma_load_2d(s.b[i] + c * gemm::kNChunkElems, b, full, b_aux + c * kBoxCols, row);
  });
}

}  // namespace mok::cuda::fused
