// The fused forward's task list (src/cuda/fused/schedule.cuh) and its ops' waits and signals
// (src/cuda/fused/ops/) on the host: every tile once, dependencies always on lower-numbered
// tasks, the processing order a permutation that walks macrobatches last to first.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <numeric>
#include <string>
#include <vector>

#include "cuda/fused/ops/ops.cuh"
#include "cuda/fused/schedule.cuh"
#include "cuda/gemm/config.hpp"

namespace mok::cuda::fused {
namespace {

uint64_t fresh_protocol_seed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

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
    for (int32_t b = seg[i].first; b < seg[i].first + seg[i].count; ++b)
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
  // Every op's waits and signals (the descriptions the kernel's producer and signaler use): a
  // wait on a counter that tiles signal counts all of them, and all of them come earlier.
  std::map<std::pair<int, int32_t>, std::vector<int32_t>> signalled_by;  // (array, index) -> tasks
  for (const auto& [tile, t] : index) {
    Signal s[kMaxSignals];
    const int n = task_signals(static_cast<TaskKind>(std::get<0>(tile)), std::get<1>(tile), 0, g, c, s);
    ASSERT_TRUE(n >= 0 && n <= kMaxSignals);
    for (int i = 0; i < n; ++i) {
      ASSERT_NE(s[i].array, CounterArray::kGatherReady) << "a tile signals the comm blocks' counter";
      signalled_by[{static_cast<int>(s[i].array), s[i].index}].push_back(t);
    }
  }
  std::map<int32_t, std::set<int32_t>> waited_on;  // task -> the tasks its waits cover
  for (const auto& [tile, t] : index) {
    Wait w[kMaxWaits];
    const int n = task_waits(static_cast<TaskKind>(std::get<0>(tile)), std::get<1>(tile), 0, g, c, w);
    ASSERT_TRUE(n >= 0 && n <= kMaxWaits);
    for (int i = 0; i < n; ++i) {
      if (w[i].array == CounterArray::kGatherReady) {  // the comm blocks' rows
        EXPECT_EQ(w[i].expected, 128);
        continue;
      }
      const auto& by = signalled_by[{static_cast<int>(w[i].array), w[i].index}];
      ASSERT_EQ(static_cast<int32_t>(by.size()), w[i].expected) << "task " << t << " wait " << i;
      for (int32_t u : by) {
        ASSERT_LT(u, t) << "task " << t << " waits on a later tile";
        waited_on[t].insert(u);
      }
    }
  }
  // ... and they cover the inputs: a routed gate/up tile the previous occupant's down tiles
  // (its act rows), a down tile its block's gate/up tiles, a shared down tile its block's
  // shared gate/up tiles.
  auto covers = [&](int32_t t, TaskKind k, int32_t b, int32_t num_n) {
    for (int32_t nn = 0; nn < num_n; ++nn)
      if (!waited_on[t].count(at(k, b, nn))) return false;
    return true;
  };
  for (int32_t b = 0; b < num_blocks; ++b) {
    const int32_t prev = g.previous_occupant(b);
    for (int32_t nn = 0; nn < c.n_gate_up; ++nn) {
      if (prev >= 0) {
        ASSERT_TRUE(covers(at(TaskKind::kGateUp, b, nn), TaskKind::kDown, prev, c.n_down)) << b;
      }
      Wait w[kMaxWaits];
      const int n = task_waits(TaskKind::kGateUp, b, 0, g, c, w);
      const auto rows = [&](const Wait& x) { return x.array == CounterArray::kGatherReady && x.index == b; };
      ASSERT_TRUE(std::any_of(w, w + n, rows)) << "gate/up of block " << b << " waits for its rows";
    }
    for (int32_t nn = 0; nn < c.n_down; ++nn)
      ASSERT_TRUE(covers(at(TaskKind::kDown, b, nn), TaskKind::kGateUp, b, c.n_gate_up)) << b;
  }
  if (shared) {
    for (int32_t b = 0; b < c.shared_blocks; ++b)
      for (int32_t nn = 0; nn < c.n_shared_down; ++nn)
        ASSERT_TRUE(covers(at(TaskKind::kSharedDown, b, nn), TaskKind::kSharedGateUp, b, c.n_shared_gate_up)) << b;
  }
}

TEST(FusedSchedule, EveryKindDispatchesToItsOp) {
  for (TaskKind k : {TaskKind::kSharedGateUp, TaskKind::kGateUp, TaskKind::kSharedDown, TaskKind::kDown})
    EXPECT_EQ(visit_op(k, [](auto op) { return decltype(op)::kKind; }), k);
  const auto kind_of = [](auto op) { return static_cast<int>(decltype(op)::kKind); };
  EXPECT_EQ(visit_op(TaskKind::kDone, kind_of, [] { return -1; }), -1);
  Signal s[kMaxSignals];
  EXPECT_EQ(task_signals(TaskKind::kDone, 0, 0, Geometry::make(4, 2, 1), TaskCounts{1, 1, 1, 1, 1}, s), 0);
  Wait w[kMaxWaits];
  EXPECT_EQ(task_waits(TaskKind::kDone, 0, 0, Geometry::make(4, 2, 1), TaskCounts{1, 1, 1, 1, 1}, w), 0);
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

// ---- a host model of the fused forward's protocol ---------------------------------------------
// Compute blocks claim tasks in order (at most two in flight each: one computing, one being
// loaded), wait for task_waits(), finish in order and signal task_signals() (both the ops'
// descriptions, as in the kernel); comm blocks gather their row blocks in processing order
// after gather_waits(), releasing each block once its last row is stored, then join the
// compute roles.  Random interleavings must always finish.
struct ProtocolModel {
  Geometry g;
  TaskCounts c;
  Segment seg[kMaxSegments];
  int num_segments = 0;
  int32_t num_tasks = 0;
  int32_t n_group = 1;
  std::vector<int32_t> counters[4];
  int32_t task_next = 0;
  int32_t first = 0;  // processing positions [0, first) gathered by every block at the start

  struct Compute {
    int32_t pending = -1;          // claimed, waiting for its inputs
    std::deque<int32_t> in_flight; // loads issued, computing (front finishes first)
    bool claimed_all = false;
  };
  struct Comm {
    int32_t next = 0;        // index of the current row block in this comm block's order
    int32_t row = 0;         // rows of it stored
    bool started = false;    // the current block's waits were met
    Compute joined;          // after its share, a comm block runs the compute roles
  };

  ProtocolModel(Geometry geo, TaskCounts counts, int32_t group) : g(geo), c(counts), n_group(group) {
    num_segments = build_segments(g, c, seg, &num_tasks);
    for (auto& v : counters) v.assign(static_cast<size_t>(std::max(g.num_blocks, c.shared_blocks) + 1), 0);
  }
  // The kernel's start gather: every block copies the first `n` positions, up to
  // the first whose ring slot has a previous occupant, before any task; comm blocks take the rest.
  void start_gather(int32_t n) {
    Wait w[kMaxWaits];
    for (first = 0; first < std::min(n, g.num_blocks) && gather_waits(g.block_at(first), g, c, w) == 0; ++first)
      counters[0][static_cast<size_t>(g.block_at(first))] = 128;
  }
  bool ready(const Wait* w, int n) const {
    for (int i = 0; i < n; ++i)
      if (counters[static_cast<int>(w[i].array)][static_cast<size_t>(w[i].index)] < w[i].expected) return false;
    return true;
  }
  // A finished tile adds 1 to its op's counter, as the signaler does.
  void finish(int32_t task) {
    const TaskTile t = decode_task(seg, num_segments, n_group, task);
    Signal s[kMaxSignals];
    const int n = task_signals(static_cast<TaskKind>(t.kind), t.block, 0, g, c, s);
    for (int i = 0; i < n; ++i) ++counters[static_cast<int>(s[i].array)][static_cast<size_t>(s[i].index)];
  }
  // One step of compute block `cb`; false when it can do nothing now.
  bool step(Compute& cb, std::mt19937_64& rng) {
    std::vector<int> actions;
    if (cb.pending < 0 && !cb.claimed_all && cb.in_flight.size() < 2) actions.push_back(0);
    if (cb.pending >= 0) {
      const TaskTile t = decode_task(seg, num_segments, n_group, cb.pending);
      Wait w[kMaxWaits];
      if (ready(w, task_waits(static_cast<TaskKind>(t.kind), t.block, 0, g, c, w))) actions.push_back(1);
    }
    if (!cb.in_flight.empty()) actions.push_back(2);
    if (actions.empty()) return false;
    switch (actions[rng() % actions.size()]) {
      case 0:
        if (task_next >= num_tasks) cb.claimed_all = true; else cb.pending = task_next++;
        break;
      case 1:
        cb.in_flight.push_back(cb.pending);
        cb.pending = -1;
        break;
      default:
        finish(cb.in_flight.front());
        cb.in_flight.pop_front();
    }
    return true;
  }
  // One step of comm block `index` of `num_comm`.
  bool step(Comm& cm, int index, int num_comm, std::mt19937_64& rng) {
    const int32_t left = g.num_blocks - first;
    const int32_t mine = index < left ? (left - index + num_comm - 1) / num_comm : 0;
    if (cm.next >= mine) return step(cm.joined, rng);
    const int32_t b = g.block_at(first + index + cm.next * num_comm);
    if (!cm.started) {
      Wait w[kMaxWaits];
      if (!ready(w, gather_waits(b, g, c, w))) return false;
      cm.started = true;
      return true;
    }
    if (++cm.row == 128) {
      counters[0][static_cast<size_t>(b)] = 128;
      cm.row = 0;
      cm.started = false;
      ++cm.next;
    }
    return true;
  }
  // EP = 1's gather warps (comm/gather.cuh, local_gather): warp `index` of `num` copies units
  // index, index + num, ... of kGatherUnitRows rows of the positions after the start gather's,
  // each after its block's gather_waits(), and adds its rows to gather_ready.
  struct GatherWarp {
    int64_t next = 0;      // units of this warp done
    bool started = false;  // the current unit's waits were met
  };
  bool step(GatherWarp& gw, int index, int num) {
    constexpr int kUnitsPerBlock = kBlockM / kGatherUnitRows;
    const int64_t u = index + gw.next * num;
    if (u >= int64_t{g.num_blocks - first} * kUnitsPerBlock) return false;
    const int32_t b = g.block_at(first + static_cast<int32_t>(u / kUnitsPerBlock));
    if (!gw.started) {
      Wait w[kMaxWaits];
      if (!ready(w, gather_waits(b, g, c, w))) return false;
      gw.started = true;
      return true;
    }
    counters[0][static_cast<size_t>(b)] += kGatherUnitRows;
    gw.started = false;
    ++gw.next;
    return true;
  }
};

// Runs compute blocks and comm blocks (comm_step(i, rng): one step of comm block i) in random
// interleavings until nothing can move; true when everything finished (finished()).
template <typename CommStep, typename Finished>
bool run_actors(ProtocolModel& m, int num_compute, int num_comm, uint64_t seed, CommStep comm_step, Finished finished,
                std::string* why) {
  std::mt19937_64 rng(seed);
  std::vector<ProtocolModel::Compute> compute(static_cast<size_t>(num_compute));
  for (int64_t steps = 0; steps < 50000000; ++steps) {
    std::vector<int> order(static_cast<size_t>(num_compute + num_comm));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    bool progressed = false;
    for (int a : order) {
      if (a < num_compute ? m.step(compute[static_cast<size_t>(a)], rng) : comm_step(a - num_compute, rng)) {
        progressed = true;
        break;
      }
    }
    if (!progressed) {
      bool done = m.task_next >= m.num_tasks && finished();
      for (auto& cb : compute) done &= cb.pending < 0 && cb.in_flight.empty();
      if (!done) *why = "deadlock at task_next " + std::to_string(m.task_next) + " of " + std::to_string(m.num_tasks);
      return done;
    }
  }
  *why = "step limit";
  return false;
}

bool run_model(ProtocolModel& m, int num_compute, int num_comm, uint64_t seed, std::string* why) {
  std::vector<ProtocolModel::Comm> comm(static_cast<size_t>(num_comm));
  return run_actors(
      m, num_compute, num_comm, seed,
      [&](int i, std::mt19937_64& rng) { return m.step(comm[static_cast<size_t>(i)], i, num_comm, rng); },
      [&] {
        bool done = true;
        for (auto& cm : comm) done &= cm.joined.pending < 0 && cm.joined.in_flight.empty();
        return done;
      },
      why);
}

// Random geometries, tile counts, rasters, grids and start gathers (none, or 1-3 minibatches of
// every block) of the protocol model: fn(m, num_compute, what, rng), `what` naming the case
template <typename Fn>
void for_random_models(Fn fn) {
  std::mt19937_64 rng(fresh_protocol_seed());
  for (int iter = 0; iter < 300; ++iter) {
    const int32_t mini = 1 << (rng() % 3), ring = mini << (rng() % 3);
    const int32_t blocks = static_cast<int32_t>(rng() % 24);
    const TaskCounts c{1 + static_cast<int32_t>(rng() % 3), 1 + static_cast<int32_t>(rng() % 2),
                       static_cast<int32_t>(rng() % 2), 1, static_cast<int32_t>(rng() % 3)};
    ProtocolModel m(Geometry::make(blocks, ring, mini), c, 1 + static_cast<int32_t>(rng() % 3));
    const int num_compute = 1 + static_cast<int>(rng() % 5);
    const int32_t start = rng() % 3 == 0 ? 0 : mini * (1 + static_cast<int32_t>(rng() % 3));
    m.start_gather(start);
    const std::string what = "blocks " + std::to_string(blocks) + ", ring " + std::to_string(ring) + ", mini " +
                             std::to_string(mini) + ", compute " + std::to_string(num_compute) + ", start " +
                             std::to_string(start);
    fn(m, num_compute, what, rng);
  }
}

// EP >= 2: comm blocks gather, then compute
TEST(FusedSchedule, ProtocolModelAlwaysFinishes) {
  for_random_models([](ProtocolModel& m, int num_compute, const std::string& what, std::mt19937_64& rng) {
    const int num_comm = 1 + static_cast<int>(rng() % 3);
    const uint64_t seed = rng();
    std::string why;
    ASSERT_TRUE(run_model(m, num_compute, num_comm, seed, &why))
        << why << " (" << what << ", comm " << num_comm << ", seed " << seed << ")";
  });
}

// EP = 1: no comm blocks; every compute block's two gather warps share the rows in units
TEST(FusedSchedule, ProtocolModelWithGatherWarpsAlwaysFinishes) {
  for_random_models([](ProtocolModel& m, int num_compute, const std::string& what, std::mt19937_64& rng) {
    const int num_warps = num_compute * kGatherWarps;
    std::vector<ProtocolModel::GatherWarp> warps(static_cast<size_t>(num_warps));
    const uint64_t seed = rng();
    std::string why;
    ASSERT_TRUE(run_actors(
        m, num_compute, num_warps, seed,
        [&](int i, std::mt19937_64&) { return m.step(warps[static_cast<size_t>(i)], i, num_warps); },
        [&] {
          for (int32_t b = 0; b < m.g.num_blocks; ++b)
            if (m.counters[0][static_cast<size_t>(b)] != kBlockM) return false;
          return true;
        },
        &why))
        << why << " (" << what << ", seed " << seed << ")";
  });
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
