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
  // A dimension of size 1 has no stride to follow: take the contiguous one
  const int64_t inner = cols == 1 ? 1 : t.strides[n - 1];
  const int64_t row = rows == 1 ? cols : t.strides[n - 2];
  const int64_t expert = num == 1 ? rows * row : t.strides[0];
  const std::string strides = shape_str(t.strides, n), dims = shape_str(t.shape, n);
  MOK_CHECK_ARG(inner == 1, who << " must have unit stride in its last dimension (rows along K), got strides "
                                << strides << " for shape " << dims);
  MOK_CHECK_ARG(row >= cols, who << " has rows that overlap: row stride " << row << " < " << cols << " columns (strides "
                                 << strides << " for shape " << dims << ")");
  MOK_CHECK_ARG(expert >= (rows - 1) * row + cols,
                who << " has matrices that overlap: stride " << expert << " along dimension 0 is below the "
                    << (rows - 1) * row + cols << " elements one [" << rows << ", " << cols << "] matrix spans (strides "
                    << strides << ")");
  if (device >= 0) {
    const int bytes = elem_bytes(t.dtype);
    MOK_CHECK_ARG((reinterpret_cast<uintptr_t>(t.data) & 15u) == 0,
                  who << " must be 16-byte aligned on CUDA (TMA reads), its data is at " << t.data);
    MOK_CHECK_ARG((row * bytes) % 16 == 0, who << ": row stride " << row << " (" << row * bytes
                                               << " bytes) must be a multiple of 16 bytes on CUDA (TMA strides); strides "
                                               << strides << " for shape " << dims);
    MOK_CHECK_ARG(expert % row == 0, who << ": stride " << expert << " along dimension 0 must be a multiple of the row "
                                         << "stride " << row << " on CUDA (expert e's rows are rows e*" << expert
                                         << "/" << row << " of one tensor map); strides " << strides);
  }
  return ref::MatrixStrides{expert, row};
}

int64_t leading_dim(const mokTensor_t& t, const std::string& who) {
  MOK_CHECK_ARG(present(t), who << " is missing");
  MOK_CHECK_ARG(t.ndim == 2, who << " must be 2-D, got shape " << shape_str(t.shape, t.ndim));
  MOK_CHECK_ARG(t.shape[0] >= 0, who << " has a negative dimension");
  return t.shape[0];
}

}  // namespace mok
