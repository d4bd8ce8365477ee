// Host creation of TMA tensor maps (the driver's cuTensorMapEncodeTiled, reached through
// the runtime so libmok needs no -lcuda).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace mok::gemm {

// 2-D map over [rows, cols] (cols contiguous) of elem_bytes-wide elements (2: bf16, 1: fp8),
// box (box_rows, one 128-byte row: 64 bf16 or 128 fp8 cols), 128 B swizzle: the operand layout
// of the tile engine.
// row_stride: elements between rows (0: cols; a multiple of 16 bytes).
CUtensorMap tensor_map_2d(const void* base, int64_t rows, int64_t cols, int box_rows, int elem_bytes = 2,
                          int64_t row_stride = 0);

// 2-D map over [rows, cols] fp32 (cols contiguous, rows cols apart: cols % 4 == 0), boxes of one
// row by box_cols, no swizzle: the block scales of an operand, a k-block's row of them at a time.
CUtensorMap tensor_map_scales(const float* base, int64_t rows, int64_t cols, int box_cols);

// A stack of num [rows, cols] bf16 matrices in place, strides s (ref::MatrixStrides, checked
// by runtime/tensor.hpp check_matrices): one 2-D map whose rows are every row of the stack's
// span, matrix e's row r at map row e·pitch + r (matrix_pitch).  Frameworks' fused and
// interleaved gate/up layouts are read this way, with no copy.
struct MatrixStack {
  const void* base;
  int64_t num, rows, cols;
  int64_t expert_stride, row_stride;  // elements; 0: contiguous
};
int64_t matrix_pitch(const MatrixStack& m);  // map rows between matrices
CUtensorMap tensor_map_stack(const MatrixStack& m, int box_rows);

}  // namespace mok::gemm
