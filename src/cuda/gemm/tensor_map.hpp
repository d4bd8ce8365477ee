// Host creation of TMA tensor maps (the driver's cuTensorMapEncodeTiled, reached through
// the runtime so libmok needs no -lcuda).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace mok::gemm {

// 2-D map over [rows, cols] (cols contiguous) of elem_bytes-wide elements (2: bf16, 1: fp8),
// box (box_rows, one 128-byte row: 64 bf16 or 128 fp8 cols), 128 B swizzle: the operand layout
// of the tile engine.
CUtensorMap tensor_map_2d(const void* base, int64_t rows, int64_t cols, int box_rows, int elem_bytes = 2);

}  // namespace mok::gemm
