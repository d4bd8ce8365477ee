#include "cuda/gemm/tensor_map.hpp"

#include <cuda_runtime.h>

#include <mutex>

#include "cuda/gemm/config.hpp"
#include "runtime/errors.hpp"

namespace mok::gemm {

namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver entry point, fetched through the runtime so libmok needs no -lcuda.
EncodeTiled encode_tiled() {
  static EncodeTiled fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<EncodeTiled>(ptr);
  });
  if (fn == nullptr) MOK_FAIL(mokCudaError, "cuTensorMapEncodeTiled is not available from the driver");
  return fn;
}

}  // namespace

CUtensorMap tensor_map_2d(const void* base, int64_t rows, int64_t cols, int box_rows, int elem_bytes,
                          int64_t row_stride) {
  MOK_CHECK_ARG(elem_bytes == 1 || elem_bytes == 2, "tensor map: elements of " << elem_bytes << " bytes");
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>((row_stride > 0 ? row_stride : cols) * elem_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / elem_bytes), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUtensorMapDataType dtype = elem_bytes == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8;
  const CUresult r = encode_tiled()(&map, dtype, 2, const_cast<void*>(base), dims, strides,
                                    box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    MOK_FAIL(mokCudaError, "cuTensorMapEncodeTiled failed (" << static_cast<int>(r) << ") for a [" << rows << ", "
                                                             << cols << "] " << (elem_bytes == 2 ? "bf16" : "fp8")
                                                             << " tensor at " << base);
  return map;
}

CUtensorMap tensor_map_scales(const float* base, int64_t rows, int64_t cols, int box_cols) {
  MOK_CHECK_ARG(rows > 0 && cols > 0 && cols % 4 == 0 && (reinterpret_cast<uintptr_t>(base) & 15u) == 0,
                "tensor map: scales [" << rows << ", " << cols << "] fp32 need 16-byte aligned rows (cols % 4 == 0)");
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols * 4)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), 1};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(base), dims, strides,
                                    box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    MOK_FAIL(mokCudaError, "cuTensorMapEncodeTiled failed (" << static_cast<int>(r) << ") for [" << rows << ", " << cols
                                                             << "] fp32 scales at " << base);
  return map;
}

int64_t matrix_pitch(const MatrixStack& m) {
  const int64_t row = m.row_stride > 0 ? m.row_stride : m.cols;
  const int64_t expert = m.expert_stride > 0 ? m.expert_stride : m.rows * row;
  MOK_CHECK_ARG(expert % row == 0, "tensor map: matrix stride " << expert << " is not a multiple of the row stride " << row);
  return m.num > 1 ? expert / row : m.rows;
}

CUtensorMap tensor_map_stack(const MatrixStack& m, int box_rows) {
  const int64_t span = m.num > 0 ? (m.num - 1) * matrix_pitch(m) + m.rows : 0;
  return tensor_map_2d(m.base, span, m.cols, box_rows, 2, m.row_stride);
}

}  // namespace mok::gemm
