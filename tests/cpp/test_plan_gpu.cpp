// The device-built plan equals the host-built plan bit for bit; device-side validation
// masks bad routes and records the first one.  Skips cleanly without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>

#include "mok/mok.h"
#include "mok/mok.hpp"
#include "gpu_util.hpp"
#include "test_util.hpp"

namespace mok::test {
namespace {

using mok::tensor_view;

struct GpuCase {
  int P;
  int64_t E_l;
  int k;
  int block_m;
  Routing routing;
  bool ids64;
  std::vector<int64_t> tokens;
  int64_t t_max;
};

// Builds every rank's plan on host (through build_plan_host) and on the device (through
// the C ABI), and compares all arrays and the error record.  `corrupt` plants bad ids.
void compare(const GpuCase& c, uint64_t seed, bool corrupt) {
  SCOPED_TRACE("seed=" + std::to_string(seed) + " P=" + std::to_string(c.P) + " E_l=" + std::to_string(c.E_l) +
               " k=" + std::to_string(c.k) + " routing=" + routing_name(c.routing));
  std::mt19937_64 rng(seed);
  const int64_t E = c.E_l * c.P;
  std::vector<std::vector<int64_t>> ids64(static_cast<size_t>(c.P));
  std::vector<std::vector<int32_t>> ids32(static_cast<size_t>(c.P));
  std::vector<DeviceBuffer> dev_ids;
  std::vector<mokTensor_t> id_views;
  plan::RoutingView host_view;
  host_view.num_ranks = c.P;
  host_view.topk = c.k;
  host_view.num_experts = E;
  host_view.ids_are_int64 = c.ids64;
  dev_ids.reserve(static_cast<size_t>(c.P));
  for (int s = 0; s < c.P; ++s) {
    const int64_t T = c.tokens[static_cast<size_t>(s)];
    auto& i64 = ids64[static_cast<size_t>(s)];
    i64 = make_ids(rng, T, c.k, E, c.E_l, c.routing);
    if (corrupt && T > 2) {
      i64[static_cast<size_t>((T - 1) * c.k)] = E + 3;  // out of range
      if (c.k > 1) i64[static_cast<size_t>(T / 2 * c.k + 1)] = i64[static_cast<size_t>(T / 2 * c.k)] == -1 ? -5 : i64[static_cast<size_t>(T / 2 * c.k)];
    }
    ids32[static_cast<size_t>(s)] = to_int32(i64);
    const void* src = c.ids64 ? static_cast<const void*>(i64.data()) : static_cast<const void*>(ids32[static_cast<size_t>(s)].data());
    const size_t bytes = static_cast<size_t>(T * c.k) * (c.ids64 ? 8 : 4);
    dev_ids.emplace_back(bytes);
    CUDA_OK(cudaMemcpy(dev_ids.back().ptr, src, bytes, cudaMemcpyHostToDevice));
    host_view.ids[s] = src;
    host_view.num_tokens[s] = T;
    id_views.push_back(tensor_view(dev_ids.back().ptr, c.ids64 ? mokInt64 : mokInt32, {T, c.k}, 0));
  }
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  for (int r = 0; r < c.P; ++r) {
    mokConfig_t cfg = MOK_CONFIG_INITIALIZER;
    cfg.num_experts = E;
    cfg.topk = c.k;
    cfg.ep_size = c.P;
    cfg.ep_rank = r;
    cfg.max_tokens = c.t_max;
    cfg.block_m = c.block_m;
    cfg.minibatch_size = c.block_m;
    cfg.macrobatch_size = c.block_m * 4;
    mokPlanCapacity_t cap{};
    ASSERT_EQ(mokPlanGetCapacity(&cfg, &cap), mokSuccess) << mokGetLastError();
    // Poison 0xA5: unlike 0xFF it is not a valid padding record or -1.
    DeviceBuffer rows(static_cast<size_t>(cap.max_rows) * 4, 0xA5), count(static_cast<size_t>(c.E_l) * 4, 0xA5),
        offset(static_cast<size_t>(c.E_l + 1) * 4, 0xA5), blocks(static_cast<size_t>(cap.max_blocks) * 4, 0xA5),
        err(4 * 8, 0xA5);
    mokPlanArgs_t pa{c.P,
                     id_views.data(),
                     tensor_view(rows.ptr, mokInt32, {cap.max_rows}, 0),
                     tensor_view(count.ptr, mokInt32, {c.E_l}, 0),
                     tensor_view(offset.ptr, mokInt32, {c.E_l + 1}, 0),
                     tensor_view(blocks.ptr, mokInt32, {cap.max_blocks}, 0),
                     tensor_view(err.ptr, mokInt64, {4}, 0)};
    ASSERT_EQ(mokPlanBuild(&cfg, &pa, stream), mokSuccess) << mokGetLastError();
    CUDA_OK(cudaStreamSynchronize(stream));

    plan::PlanDims d;
    d.num_ranks = c.P;
    d.rank = r;
    d.num_experts = E;
    d.topk = c.k;
    d.block_m = c.block_m;
    d.max_tokens = c.t_max;
    d.minibatch_size = cfg.minibatch_size;
    d.macrobatch_size = cfg.macrobatch_size;
    HostPlan h = build_host(d, host_view);
    const auto dev_rows = rows.get<uint32_t>();
    ASSERT_EQ(dev_rows.size(), h.rows.size());
    EXPECT_EQ(0, std::memcmp(dev_rows.data(), h.rows.data(), h.rows.size() * 4)) << "rows of rank " << r;
    EXPECT_EQ(count.get<int32_t>(), h.expert_count) << "rank " << r;
    EXPECT_EQ(offset.get<int32_t>(), h.expert_offset) << "rank " << r;
    EXPECT_EQ(blocks.get<int32_t>(), h.block_expert) << "rank " << r;
    const auto e = err.get<int64_t>();
    EXPECT_EQ(e[0], h.error.key) << "rank " << r;
    EXPECT_EQ(e[1], h.error.any() ? h.error.id : 0);
    EXPECT_EQ(e[2], static_cast<int64_t>(h.error.kind));
    if (corrupt) EXPECT_TRUE(h.error.any()) << "the planted bad id must be seen";
  }
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST(PlanGpu, DeviceEqualsHostBitwise) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = fresh_seed();
  compare({1, 16, 8, 128, Routing::kUniform, false, {4096}, 4096}, seed, false);
  compare({1, 256, 8, 128, Routing::kZipf, true, {1000}, 1024}, seed + 1, false);
  compare({2, 16, 8, 128, Routing::kOneExpert, false, {777, 4096}, 4096}, seed + 2, false);
  compare({4, 8, 6, 128, Routing::kOneRank, true, {300, 0, 1, 513}, 600}, seed + 3, false);
  compare({8, 4, 3, 16, Routing::kMasked, false, {10, 0, 255, 256, 257, 0, 1000, 3}, 1000}, seed + 4, false);
  compare({3, 5, 2, 1, Routing::kUniform, true, {0, 0, 0}, 0}, seed + 5, false);
}

TEST(PlanGpu, DeviceValidationMasksAndRecordsFirstBadRoute) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = fresh_seed();
  compare({1, 16, 4, 128, Routing::kUniform, false, {500}, 512}, seed, true);
  compare({4, 8, 4, 64, Routing::kZipf, true, {100, 7, 0, 300}, 300}, seed + 1, true);
}

TEST(PlanGpu, RandomSweep) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Routing routings[] = {Routing::kUniform, Routing::kZipf, Routing::kOneExpert, Routing::kMasked};
  for (int it = 0; it < 20; ++it) {
    GpuCase c;
    c.P = 1 + static_cast<int>(rng() % 8);
    c.E_l = 1 + static_cast<int64_t>(rng() % 40);
    c.k = 1 + static_cast<int>(rng() % std::min<int64_t>(10, c.E_l * c.P));
    c.block_m = (rng() % 2) ? 128 : 8;
    c.routing = routings[it % 4];
    c.ids64 = rng() % 2;
    c.t_max = 0;
    for (int s = 0; s < c.P; ++s) {
      c.tokens.push_back(static_cast<int64_t>(rng() % 1500));
      c.t_max = std::max(c.t_max, c.tokens.back());
    }
    compare(c, rng(), it % 5 == 0);
  }
}

}  // namespace
}  // namespace mok::test
