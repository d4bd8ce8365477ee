// The tile of the fused kernels, gemm::TileConfig (128 x 256, k-blocks of 64 bf16), by what its
// sizes count in them.  Every tile size and tile count of fused/, and of the host code that
// sets the fused kernels up, is one of these or derives from them.  Host and device: the
// schedules and their host protocol models read them too.
#pragma once

#include "cuda/gemm/config.hpp"
#include "mok/mok.h"

namespace mok::cuda::fused {

using gemm::TileConfig;

// Rows of a tile, and of a row block: the plan's block_m (the host refuses another block_m)
inline constexpr int kBlockM = TileConfig::kBlockM;
// Columns of a tile (down, dgrad, wgrad; a store or scatter epilogue's columns)
inline constexpr int kBlockN = TileConfig::kBlockN;
// Rows of a K-major B half (a stage's B is two): the channels of a gate/up tile, whose
// accumulator holds kHalfN gate columns, then the kHalfN up columns of the same channels
inline constexpr int kHalfN = TileConfig::kBlockN / 2;
// K of a k-block: one 128-byte swizzle row of bf16, the K rows of an N-major or MN-major TMA
// box; the model dimensions are multiples of it
inline constexpr int kBlockK = TileConfig::kBlockK;
// Columns of a TMA box (gemm::tensor_map_2d: one 128-byte swizzle row, BLOCK_K elements): an
// N-major B stage is kBlockN / kBoxCols boxes side by side, an MN-major A kBlockM / kBoxCols
inline constexpr int kBoxCols = TileConfig::kBlockK;
// EP = 1's gather warps (warps 2 and 3 of each block's producer warpgroup) and their unit of
// work: rows of one row block
inline constexpr int kGatherWarps = 2;
inline constexpr int kGatherUnitRows = 8;
static_assert(kBlockM % kGatherUnitRows == 0, "a row block is whole gather units");

static_assert(MOK_DEFAULT_BLOCK_M == kBlockM, "the plan's row block is the fused tile's BLOCK_M");

}  // namespace mok::cuda::fused
