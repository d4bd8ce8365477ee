// mok — the public C++ API: a header-only layer over the C ABI (include/mok/mok.h).
// Result codes become mok::Error exceptions on this side of the ABI; handles are RAII.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mok/mok.h"

namespace mok {

// Raised for every failing call; code() is the C result, what() the detail message.
class ApiError : public std::runtime_error {
 public:
  ApiError(mokResult_t code, const std::string& detail)
      : std::runtime_error(std::string(mokGetErrorString(code)) + ": " + detail), code_(code) {}
  mokResult_t code() const { return code_; }

 private:
  mokResult_t code_;
};

inline void check(mokResult_t result) {
  if (result != mokSuccess) throw ApiError(result, mokGetLastError());
}

// A row-major, contiguous view (strides computed from the shape).
inline mokTensor_t tensor_view(void* data, mokDtype_t dtype, const std::vector<int64_t>& shape,
                               int32_t device = MOK_DEVICE_CPU) {
  mokTensor_t t{};
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int32_t>(shape.size());
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[static_cast<size_t>(i)];
    t.strides[i] = stride;
    stride *= shape[static_cast<size_t>(i)];
  }
  t.device = device;
  return t;
}

inline mokConfig_t default_config() {
  mokConfig_t c = MOK_CONFIG_INITIALIZER;
  return c;
}

// Owns a mokWorkspace_t: buffers sized once from the config (T_max, shapes, device).
class Workspace {
 public:
  explicit Workspace(const mokConfig_t& config) { check(mokWorkspaceCreate(&config, &handle_)); }
  ~Workspace() {
    if (handle_) mokWorkspaceDestroy(handle_);
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  Workspace(Workspace&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  Workspace& operator=(Workspace&& other) noexcept {
    if (this != &other) {
      if (handle_) mokWorkspaceDestroy(handle_);
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }

  mokWorkspace_t handle() const { return handle_; }
  mokConfig_t config() const {
    mokConfig_t c = MOK_CONFIG_INITIALIZER;
    check(mokWorkspaceGetConfig(handle_, &c));
    return c;
  }
  // The buffers and the formulas of their sizes.
  std::string describe() const {
    size_t needed = 0;
    check(mokWorkspaceDescribe(handle_, nullptr, 0, &needed));
    std::vector<char> buf(needed);
    check(mokWorkspaceDescribe(handle_, buf.data(), buf.size(), nullptr));
    return std::string(buf.data());
  }
  // Raises what device-side checks recorded (invalid routes, timeouts); `wait` synchronises.
  void check_errors(bool wait = true) const { check(mokWorkspaceCheckErrors(handle_, wait ? 1 : 0)); }

  void forward(const mokForwardArgs_t& args, void* stream = nullptr) const { check(mokForward(handle_, &args, stream)); }
  void backward(const mokBackwardArgs_t& args, void* stream = nullptr) const {
    check(mokBackward(handle_, &args, stream));
  }

 private:
  mokWorkspace_t handle_ = nullptr;
};

// The EP group emulated in one process on the CPU reference (args[r]: rank r).
inline void forward_emulated(const mokConfig_t& config, const std::vector<mokForwardArgs_t>& args) {
  check(mokForwardEmulated(&config, args.data(), static_cast<int64_t>(args.size())));
}
inline void backward_emulated(const mokConfig_t& config, const std::vector<mokBackwardArgs_t>& args) {
  check(mokBackwardEmulated(&config, args.data(), static_cast<int64_t>(args.size())));
}

inline int version() { return mokGetVersion(); }
inline bool has_cuda() { return mokHasCuda() != 0; }

}  // namespace mok
