// Helpers shared by the C++ tests: random routings and tensors, fresh per run.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.hpp"
#include "mok/mok.h"
#include "plan/plan.hpp"

namespace mok::test {

// A seed that changes every run; printed by the tests that use it so a failure can be replayed.
inline uint64_t fresh_seed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

enum class Routing { kUniform, kZipf, kOneExpert, kOneRank, kMasked };

inline const char* routing_name(Routing r) {
  switch (r) {
    case Routing::kUniform: return "uniform";
    case Routing::kZipf: return "zipf";
    case Routing::kOneExpert: return "one-expert";
    case Routing::kOneRank: return "one-rank";
    case Routing::kMasked: return "masked";
  }
  return "?";
}

// [T, k] ids with distinct experts per token (or -1).  kOneExpert sends every token to
// experts 0..k-1; kOneRank keeps every id inside rank 0's experts (needs k <= E_l).
inline std::vector<int64_t> make_ids(std::mt19937_64& rng, int64_t T, int k, int64_t E, int64_t E_l,
                                     Routing routing) {
  std::vector<int64_t> ids(static_cast<size_t>(T * k), -1);
  std::vector<double> pop(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) pop[static_cast<size_t>(e)] = routing == Routing::kZipf ? std::pow(e + 1.0, -1.2) : 1.0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> chosen;
    const int64_t pool = routing == Routing::kOneRank ? E_l : E;
    while (static_cast<int>(chosen.size()) < k) {
      int64_t e;
      if (routing == Routing::kOneExpert) {
        e = static_cast<int64_t>(chosen.size());
      } else {
        std::discrete_distribution<int64_t> dist(pop.begin(), pop.begin() + pool);
        e = dist(rng);
      }
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    std::shuffle(chosen.begin(), chosen.end(), rng);
    for (int j = 0; j < k; ++j) {
      const bool mask = routing == Routing::kMasked && (rng() % 3 == 0);
      ids[static_cast<size_t>(t * k + j)] = mask ? -1 : chosen[static_cast<size_t>(j)];
    }
    if (routing == Routing::kMasked && t % 5 == 0)  // a token with every route masked
      for (int j = 0; j < k; ++j) ids[static_cast<size_t>(t * k + j)] = -1;
  }
  return ids;
}

inline std::vector<bf16_t> random_bf16(std::mt19937_64& rng, size_t n, float scale) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<bf16_t> v(n);
  for (auto& x : v) x = float_to_bf16(dist(rng));
  return v;
}

inline std::vector<float> random_f32(std::mt19937_64& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// A contiguous view of data, [dims...] (mok::tensor_view without mok.hpp, whose C++ types the
// tests of the runtime's own headers cannot include).
inline mokTensor_t host_view(void* data, mokDtype_t dtype, const std::vector<int64_t>& shape,
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

// Where element (r, c) of matrix e of a view lies: e*expert + r*row + c*col elements.
struct Strided {
  int64_t expert, row, col;
  int64_t at(int64_t e, int64_t r, int64_t c) const { return e * expert + r * row + c * col; }
};

// A [num, rows, cols] view (or [rows, cols] when num == 0) of data with strides s.
inline mokTensor_t strided_view(void* data, mokDtype_t dtype, int64_t num, int64_t rows, int64_t cols, Strided s,
                                int32_t device = MOK_DEVICE_CPU) {
  mokTensor_t t = num > 0 ? host_view(data, dtype, {num, rows, cols}, device)
                          : host_view(data, dtype, {rows, cols}, device);
  if (num > 0) t.strides[0] = s.expert;
  t.strides[t.ndim - 2] = s.row;
  t.strides[t.ndim - 1] = s.col;
  return t;
}

inline std::vector<int32_t> to_int32(const std::vector<int64_t>& v) {
  return std::vector<int32_t>(v.begin(), v.end());
}

// A host plan with its arrays.
struct HostPlan {
  std::vector<uint32_t> rows;
  std::vector<int32_t> expert_count, expert_offset, block_expert;
  plan::RouteError error;
  plan::PlanView view() {
    return plan::PlanView{rows.data(), expert_count.data(), expert_offset.data(), block_expert.data()};
  }
};

inline HostPlan build_host(const plan::PlanDims& d, const plan::RoutingView& v) {
  HostPlan p;
  p.rows.assign(static_cast<size_t>(plan::max_rows(d)), 0x12345678u);  // poison
  p.expert_count.assign(static_cast<size_t>(d.local_experts()), -7);
  p.expert_offset.assign(static_cast<size_t>(d.local_experts() + 1), -7);
  p.block_expert.assign(static_cast<size_t>(plan::max_blocks(d)), -7);
  plan::build_plan_host(d, v, p.view(), &p.error);
  return p;
}

}  // namespace mok::test
