// CUDA runtime checks for host code: a failing call throws mok::Error(mokCudaError)
// naming the call, the CUDA message and file:line.
#pragma once

#include <cuda_runtime.h>

#include "runtime/errors.hpp"

#define MOK_CUDA_CHECK(expr)                                                                 \
  do {                                                                                       \
    const cudaError_t mok_err_ = (expr);                                                     \
    if (mok_err_ != cudaSuccess)                                                             \
      MOK_FAIL(mokCudaError, #expr << " failed: " << cudaGetErrorString(mok_err_) << " (" \
                                   << __FILE__ << ":" << __LINE__ << ")");                   \
  } while (0)

namespace mok::cuda {

// Makes `device` current for a scope and restores the caller's device after it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    MOK_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) MOK_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace mok::cuda
