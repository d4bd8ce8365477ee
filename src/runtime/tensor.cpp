#include "runtime/tensor.hpp"

#include <algorithm>
#include <sstream>

#include "runtime/errors.hpp"

namespace mok {

const char* dtype_name(int32_t dtype) {
  switch (dtype) {
    case mokBFloat16: return "bfloat16";
    case mokFloat32: return "float32";
    case mokInt32: return "int32";
    case mokInt64: return "int64";
    case mokFloat8E4M3: return "float8_e4m3fn";
    case mokUInt8: return "uint8";
    default: return "unknown dtype";
  }
}

std::string shape_str(const int64_t* dims, int ndim) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << dims[i];
  os << "]";
  return os.str();
}

std::string device_str(int32_t device) {
  return device < 0 ? std::string("cpu") : "cuda:" + std::to_string(device);
}

namespace {

// dtype, shape, device and data of t (what every tensor check starts with).
void check_kind(const mokTensor_t& t, const std::string& who, std::initializer_list<int32_t> dtypes,
                const std::vector<int64_t>& shape, int32_t device) {
  MOK_CHECK_ARG(present(t), who << " is missing");
  bool dtype_ok = false;
  std::string allowed;
  for (int32_t d : dtypes) {
    dtype_ok |= (t.dtype == d);
    allowed += (allowed.empty() ? "" : " or ") + std::string(dtype_name(d));
  }
  MOK_CHECK_ARG(dtype_ok, who << " must be " << allowed << ", got " << dtype_name(t.dtype));
  MOK_CHECK_ARG(t.ndim == static_cast<int32_t>(shape.size()) &&
                    std::equal(shape.begin(), shape.end(), t.shape),
                who << " has shape " << shape_str(t.shape, t.ndim) << ", expected "
                    << shape_str(shape.data(), static_cast<int>(shape.size())));
  MOK_CHECK_ARG(t.device == device,
                who << " is on " << device_str(t.device) << ", expected " << device_str(device));
}

int elem_bytes(int32_t dtype) {
  switch (dtype) {
    case mokFloat32: case mokInt32: return 4;
    case mokInt64: return 8;
    case mokFloat8E4M3: case mokUInt8: return 1;
    default: return 2;
  }
}

}  // namespace

void check_tensor(const mokTensor_t& t, const std::string& who, std::initializer_list<int32_t> dtypes,
                  const std::vector<int64_t>& shape, int32_t device) {
  check_kind(t, who, dtypes, shape, device);
  int64_t numel = 1, expect = 1;
  for (int i = 0; i < t.ndim; ++i) numel *= t.shape[i];
  for (int i = t.ndim - 1; i >= 0; --i) {
    MOK_CHECK_ARG(numel == 0 || t.shape[i] == 1 || t.strides[i] == expect,
                  who << " must be contiguous: strides " << shape_str(t.strides, t.ndim) << " for shape "
                      << shape_str(t.shape, t.ndim));
    expect *= t.shape[i];
  }
  MOK_CHECK_ARG(numel == 0 || t.data != nullptr, who << " has a null data pointer");
}

ref::MatrixStrides check_matrices(const mokTensor_t& t, const std::string& who, std::initializer_list<int32_t> dtypes,
                                  const std::vector<int64_t>& shape, int32_t device) {
  check_kind(t, who, dtypes, shape, device);
  const int n = t.ndim;
  const int64_t rows = t.shape[n - 2], cols = t.shape[n - 1], num = n == 3 ? t.shape[0] : 1;
  if (num * rows * cols == 0) return ref::MatrixStrides{};
  MOK_CHECK_ARG(t.data != nullptr, who << " has a null data pointer");
  const std::string strides = shape_str(t.strides, n), dims = shape_str(t.shape, n);
  // A dimension of size 1 has no stride to follow: take the contiguous one, and row-major
  // wherever both orientations fit (a single row with unit stride, or a single column)
  const int64_t row_inner = cols == 1 ? 1 : t.strides[n - 1];
  const int64_t col_inner = rows == 1 ? 1 : t.strides[n - 2];
  MOK_CHECK_ARG(row_inner == 1 || col_inner == 1,
                who << " has strides " << strides << " for shape " << dims << ": mok reads row-major matrices "
                    << "(stride 1 in the last dimension) or column-major ones (stride 1 in the second-to-last "
                    << "dimension, e.g. a transposed [E, H, 2I] parameter's .transpose(1, 2) view)");
  ref::MatrixStrides s;
  int64_t step = 0;  // the stride between the matrix's lines (rows, or columns when column-major)
  if (row_inner == 1) {
    s.row = rows == 1 ? cols : t.strides[n - 2];
    s.col = 1;
    step = s.row;
    MOK_CHECK_ARG(s.row >= cols, who << " has rows that overlap: row stride " << s.row << " < " << cols
                                     << " columns (strides " << strides << " for shape " << dims << ")");
  } else {
    s.row = 1;
    s.col = t.strides[n - 1];  // cols > 1 here: a single column is row-major
    step = s.col;
    MOK_CHECK_ARG(s.col >= rows, who << " is column-major with columns that overlap: column stride " << s.col << " < "
                                     << rows << " rows (strides " << strides << " for shape " << dims << ")");
  }
  // One matrix spans (lines - 1)·step + line length elements
  const int64_t lines = s.col_major() ? cols : rows, length = s.col_major() ? rows : cols;
  s.expert = num == 1 ? lines * step : t.strides[0];
  MOK_CHECK_ARG(s.expert >= (lines - 1) * step + length,
                who << " has matrices that overlap: stride " << s.expert << " along dimension 0 is below the "
                    << (lines - 1) * step + length << " elements one [" << rows << ", " << cols
                    << "] matrix spans (strides " << strides << ")");
  if (device >= 0) {
    // TMA reads each matrix as lines of unit stride, `step` elements apart
    const int bytes = elem_bytes(t.dtype);
    const char* step_name = s.col_major() ? "column stride" : "row stride";
    MOK_CHECK_ARG((reinterpret_cast<uintptr_t>(t.data) & 15u) == 0,
                  who << " must be 16-byte aligned on CUDA (TMA reads), its data is at " << t.data);
    MOK_CHECK_ARG((step * bytes) % 16 == 0, who << ": " << step_name << " " << step << " (" << step * bytes
                                                << " bytes) must be a multiple of 16 bytes on CUDA (TMA strides); "
                                                << "strides " << strides << " for shape " << dims);
    MOK_CHECK_ARG(s.expert % step == 0,
                  who << ": stride " << s.expert << " along dimension 0 must be a multiple of the " << step_name << " "
                      << step << " on CUDA (expert e's " << (s.col_major() ? "columns are columns" : "rows are rows")
                      << " e*" << s.expert << "/" << step << " of one tensor map); strides " << strides);
  }
  return s;
}

int64_t leading_dim(const mokTensor_t& t, const std::string& who) {
  MOK_CHECK_ARG(present(t), who << " is missing");
  MOK_CHECK_ARG(t.ndim == 2, who << " must be 2-D, got shape " << shape_str(t.shape, t.ndim));
  MOK_CHECK_ARG(t.shape[0] >= 0, who << " has a negative dimension");
  return t.shape[0];
}

}  // namespace mok
