// A static-partition parallel for on std::thread.  Each index is computed by exactly one
// thread with no shared accumulation, so results never depend on the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace mok {

inline int resolve_num_threads(int64_t requested) {
  if (requested > 0) return static_cast<int>(std::min<int64_t>(requested, 256));
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

// fn(begin, end) over [0, n) split into contiguous ranges.
template <typename Fn>
void parallel_for(int64_t n, int num_threads, Fn&& fn) {
  if (n <= 0) return;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(num_threads, n));
  if (workers == 1) {
    fn(int64_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(workers));
  pool.reserve(static_cast<size_t>(workers));
  const int64_t chunk = (n + workers - 1) / workers;
  for (int64_t w = 0; w < workers; ++w) {
    const int64_t begin = w * chunk, end = std::min(n, begin + chunk);
    if (begin >= end) break;
    pool.emplace_back([&, w, begin, end] {
      try {
        fn(begin, end);
      } catch (...) {
        errors[static_cast<size_t>(w)] = std::current_exception();
      }
    });
  }
  for (auto& t : pool) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace mok
