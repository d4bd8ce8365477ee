// Checks of the non-owning tensor views that enter through the C ABI.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "mok/mok.h"
#include "ref/reference.hpp"

namespace mok {

const char* dtype_name(int32_t dtype);
std::string shape_str(const int64_t* dims, int ndim);
std::string device_str(int32_t device);
inline bool present(const mokTensor_t& t) { return t.data != nullptr || t.ndim != 0; }

// Throws mokInvalidArgument naming `who` (e.g. "forward: w_gate") unless t has one of
// `dtypes`, exactly `shape`, lives on `device`, and is contiguous row-major.
void check_tensor(const mokTensor_t& t, const std::string& who, std::initializer_list<int32_t> dtypes,
                  const std::vector<int64_t>& shape, int32_t device);

// A stack of matrices ([E, rows, cols], or one [rows, cols]) read or written in place with
// any strides the kernels can follow (ref::MatrixStrides): row-major (unit stride along cols)
// or column-major (unit stride along rows, e.g. a transposed parameter's view); lines (rows,
// or columns) and matrices that do not overlap; on CUDA (device >= 0) 16-byte aligned data
// and line stride (TMA), and an expert stride that is a multiple of the line stride (the
// kernels address expert e's lines as lines e·expert/stride of one tensor map).  A dimension
// of size 1 takes row-major where both fit.  Checks what check_tensor does but contiguity,
// and returns the strides.
ref::MatrixStrides check_matrices(const mokTensor_t& t, const std::string& who, std::initializer_list<int32_t> dtypes,
                                  const std::vector<int64_t>& shape, int32_t device);

// First dimension of a 2-D tensor after checking it is 2-D (used to read T).
int64_t leading_dim(const mokTensor_t& t, const std::string& who);

}  // namespace mok
