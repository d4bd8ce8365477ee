// The fused forward's task list (src/cuda/fused/schedule.cuh) on the host: every tile once,
// dependencies always on lower-numbered tasks, the processing order a permutation that
// walks macrobatches last to first.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "cuda/fused/schedule.cuh"
#include "cuda/gemm/config.hpp"

namespace mok::cuda::fused {
namespace {

void check(int32_t num_blocks, int32_t ring_blocks, int32_t mini_blocks, TaskCounts c) {
  SCOPED_TRACE("blocks=" + std::to_string(num_blocks) + " ring=" + std::to_string(ring_blocks) +
               " mini=" + std::to_string(mini_blocks) + " shared_blocks=" + std::to_string(c.shared_blocks));
  const Geometry g = Geometry::make(num_blocks, ring_blocks, mini_blocks);
  // Processing order: a permutation; each macrobatch contiguous, last macrobatch first.
  std::vector<int32_t> order;
  std::set<int32_t> seen;
  for (int32_t q = 0; q < num_blocks; ++q) {
    const int32_t b = g.block_at(q);
    ASSERT_TRUE(b >= 0 && b < num_blocks);
    ASSERT_TRUE(seen.insert(b).second) << "block " << b << " twice";
    order.push_back(b);
  }
  for (int32_t q = 1; q < num_blocks; ++q) {
    const int32_t prev_macro = order[q - 1] / ring_blocks, macro = order[q] / ring_blocks;
    ASSERT_TRUE(macro == prev_macro ? order[q] == order[q - 1] + 1 : macro == prev_macro - 1) << "q " << q;
  }
  if (num_blocks > 0) {
    EXPECT_EQ(order.back() / ring_blocks, 0) << "macrobatch 0 is resident at the end";
  }
  // Minibatch order agrees with the block order.
  std::vector<int32_t> from_minis;
  for (int32_t p = 0; p < g.num_mini; ++p) {
    const int32_t m = g.minibatch_at(p);
    for (int32_t b = m * mini_blocks; b < std::min(num_blocks, (m + 1) * mini_blocks); ++b) from_minis.push_back(b);
  }
  EXPECT_EQ(from_minis, order);
  for (int32_t p = 0; p < g.num_mini; ++p) ASSERT_EQ(g.position_of(g.minibatch_at(p)), p);

  Segment seg[kMaxSegments];
  int32_t num_tasks = 0;
  const int n = build_segments(g, c, seg, &num_tasks);
  ASSERT_LE(n, kMaxSegments);
  // Expand the task list; record the index of each tile.
  std::map<std::tuple<int32_t, int32_t, int32_t>, int32_t> index;  // (kind, block, n) -> task
  int32_t task = 0;
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(seg[i].first_task, task);
    for (int32_t b = seg[i].first_block; b < seg[i].first_block + seg[i].num_blocks; ++b)
      for (int32_t nn = 0; nn < seg[i].num_n; ++nn)
        ASSERT_TRUE(index.emplace(std::make_tuple(seg[i].kind, b, nn), task++).second) << "tile twice";
  }
  ASSERT_EQ(task, num_tasks);
  const bool shared = c.n_shared_gate_up > 0 && c.shared_blocks > 0;
  EXPECT_EQ(num_tasks, num_blocks * (c.n_gate_up + c.n_down) +
                           (shared ? c.shared_blocks * (c.n_shared_gate_up + c.n_shared_down) : 0));
  auto at = [&](TaskKind k, int32_t b, int32_t nn) { return index.at({static_cast<int32_t>(k), b, nn}); };
  // Dependencies point backwards.
  for (int32_t b = 0; b < num_blocks; ++b)
    for (int32_t nn = 0; nn < c.n_down; ++nn)
      for (int32_t gu = 0; gu < c.n_gate_up; ++gu)
        ASSERT_LT(at(TaskKind::kGateUp, b, gu), at(TaskKind::kDown, b, nn));
  for (int32_t b = 0; b < num_blocks; ++b) {
    const int32_t prev = g.previous_occupant(b);
    if (prev < 0) continue;
    EXPECT_EQ(g.ring_row(prev), g.ring_row(b));
    for (int32_t dn = 0; dn < c.n_down; ++dn)
      ASSERT_LT(at(TaskKind::kDown, prev, dn), at(TaskKind::kGateUp, b, 0)) << "act ring reuse";
  }
  if (shared) {
    for (int32_t b = 0; b < c.shared_blocks; ++b)
      ASSERT_LT(at(TaskKind::kSharedGateUp, b, c.n_shared_gate_up - 1), at(TaskKind::kSharedDown, b, 0));
  }
}

TEST(FusedSchedule, CoversEveryTileInTopologicalOrder) {
  const TaskCounts with_shared{16, 28, 16, 28, 32}, no_shared{16, 28, 0, 28, 0};
  for (TaskCounts c : {with_shared, no_shared}) {
    check(272, 128, 8, c);  // dsv3-like: 34816 rows, macrobatch 16384, minibatch 1024
    check(272, 16, 8, c);
    check(5, 2, 1, c);
    check(7, 4, 2, c);
    check(1, 128, 8, c);
    check(0, 4, 2, c);
    check(17, 17, 17, c);
  }
}

TEST(TileRaster, EveryTileOnceGroupsOfNBlocks) {
  for (int32_t num_m : {1, 3, 8, 16, 272})
    for (int32_t num_n : {1, 5, 16, 28})
      for (int32_t group : {1, 3, 8, 16, 64}) {
        std::set<std::pair<int32_t, int32_t>> seen;
        const int64_t total = int64_t{num_m} * num_n;
        int32_t prev_group = 0;
        for (int64_t t = 0; t < total; ++t) {
          const gemm::TileCoord c = gemm::raster(t, num_m, num_n, group);
          ASSERT_TRUE(c.m >= 0 && c.m < num_m && c.n >= 0 && c.n < num_n) << t;
          ASSERT_TRUE(seen.insert({c.m, c.n}).second) << "tile twice at " << t;
          ASSERT_GE(c.n / group, prev_group) << "groups are walked in order";
          prev_group = c.n / group;
        }
        ASSERT_EQ(static_cast<int64_t>(seen.size()), total);
      }
}

}  // namespace
}  // namespace mok::cuda::fused
