// Host creation of TMA tensor maps (the driver's cuTensorMapEncodeTiled, reached through
// the runtime so libmok needs no -lcuda).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace mok::gemm {

// 2-D bf16 map over [rows, cols] (cols contiguous), box (box_rows, 64 cols), 128 B swizzle:
// the operand layout of the tile engine.
CUtensorMap tensor_map_2d(const void* base, int64_t rows, int64_t cols, int box_rows);

}  // namespace mok::gemm
