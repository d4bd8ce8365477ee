// The fused backward's task list (src/cuda/fused/schedule_bwd.cuh) on the host: every tile
// once, every wait on lower-numbered tasks (or on comm gathers whose own waits are lower
// still), and a model of the protocol (compute blocks claiming tasks in order, comm blocks
// gathering their row blocks in order) that must finish under random interleavings.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/fused/ops_bwd/ops.cuh"
#include "cuda/fused/wait_sites.hpp"

namespace mok::cuda::fused::bwd {
namespace {

uint64_t fresh_seed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// A call's rows: each local expert's block count, laid end to end.
struct Case {
  std::vector<int32_t> blocks_per_expert;
  int32_t ring_blocks, mini_blocks;
  TaskCounts c;
  std::vector<int32_t> begin, end;
  int32_t num_blocks = 0;

  Case(std::vector<int32_t> per_expert, int32_t ring, int32_t mini, TaskCounts counts)
      : blocks_per_expert(std::move(per_expert)), ring_blocks(ring), mini_blocks(mini), c(counts) {
    for (int32_t n : blocks_per_expert) {
      begin.push_back(num_blocks);
      num_blocks += n;
      end.push_back(num_blocks);
    }
  }
  Geometry geometry() const {
    return Geometry::make(num_blocks, ring_blocks, mini_blocks, static_cast<int32_t>(begin.size()), begin.data(),
                          end.data());
  }
  std::string name() const {
    return "blocks=" + std::to_string(num_blocks) + " experts=" + std::to_string(begin.size()) +
           " ring=" + std::to_string(ring_blocks) + " mini=" + std::to_string(mini_blocks) +
           " replay_all=" + std::to_string(c.replay_all) + " saved_all=" + std::to_string(c.saved_all);
  }
};

struct Expanded {
  std::vector<Segment> seg;
  int32_t num_tasks = 0;
  std::vector<TaskTile> tiles;  // by task index
};

Expanded expand(const Geometry& g, const TaskCounts& c) {
  Expanded x;
  x.seg.resize(static_cast<size_t>(max_segments(g)));
  const int n = build_segments(g, c, x.seg.data(), &x.num_tasks);
  EXPECT_LE(n, max_segments(g));
  x.seg.resize(static_cast<size_t>(n));
  for (int32_t t = 0; t < x.num_tasks; ++t) x.tiles.push_back(decode_task(x.seg.data(), n, t, g, c));
  return x;
}

// The counters a finished tile adds to: (array, index) pairs, from the schedule's description.
std::vector<std::pair<CounterArray, int32_t>> signals(const TaskTile& t, const Geometry& g, const TaskCounts& c) {
  Signal out[kMaxSignals];
  const int n = task_signals(static_cast<TaskKind>(t.kind), t.unit, t.macro, g, c, out);
  std::vector<std::pair<CounterArray, int32_t>> v;
  for (int i = 0; i < n; ++i) v.emplace_back(out[i].array, out[i].index);
  return v;
}

void check_list(const Case& k) {
  SCOPED_TRACE(k.name());
  const Geometry g = k.geometry();
  const TaskCounts& c = k.c;
  const Expanded x = expand(g, c);
  // Every tile once
  std::set<std::tuple<int32_t, int32_t, int32_t, int32_t>> seen;
  for (const TaskTile& t : x.tiles) ASSERT_TRUE(seen.insert({t.kind, t.unit, t.n, t.macro}).second) << "tile twice";
  int64_t want = int64_t{g.num_blocks} * (c.n_dgrad_down + c.n_dgrad_gate_up) +
                 int64_t{c.shared_blocks} * (c.n_shared_replay + c.n_shared_dgrad_down + c.n_shared_dgrad_gate_up) +
                 c.n_shared_wgrad_down + c.n_shared_wgrad_gate_up;  // zeros at T = 0
  for (int32_t b = 0; b < g.num_blocks; ++b) want += replays(g, c, b) ? c.n_replay : 0;
  for (int32_t e = 0; e < g.num_experts; ++e) {
    int32_t pairs = 0;
    for (int32_t m = 0; m < g.num_macro; ++m) pairs += g.expert_in(e, m);
    want += int64_t{pairs == 0 ? 1 : pairs} * wgrad_tiles(c);
  }
  ASSERT_EQ(x.num_tasks, want);
  // Which tasks signal each counter, and the first task that waits on each gather
  std::map<std::pair<int, int32_t>, std::vector<int32_t>> signalers;
  std::map<int32_t, int32_t> first_waiter_on_gather;
  for (int32_t t = 0; t < x.num_tasks; ++t)
    for (const auto& s : signals(x.tiles[static_cast<size_t>(t)], g, c))
      signalers[{static_cast<int>(s.first), s.second}].push_back(t);
  // Waits point at lower-numbered tasks, and expect exactly what their signalers add
  for (int32_t t = 0; t < x.num_tasks; ++t) {
    const TaskTile& tile = x.tiles[static_cast<size_t>(t)];
    Wait w[kMaxWaits]{};
    const int n = task_waits(static_cast<TaskKind>(tile.kind), tile.unit, tile.macro, g, c, w);
    for (int i = 0; i < n; ++i) {
      if (w[i].array == CounterArray::kDyReady || w[i].array == CounterArray::kXReady) {
        first_waiter_on_gather.emplace(w[i].index, t);
        continue;
      }
      const auto& who = signalers[{static_cast<int>(w[i].array), w[i].index}];
      ASSERT_EQ(static_cast<int32_t>(who.size()), w[i].expected)
          << "task " << t << " kind " << tile.kind << " waits on array " << static_cast<int>(w[i].array) << "["
          << w[i].index << "]";
      for (int32_t s : who) ASSERT_LT(s, t) << "task " << t << " waits on a later task " << s;
    }
  }
  // The fp32 accumulator: a wgrad tile of an expert that had rows in the previous macrobatch
  // waits for all of that macrobatch's wgrad tiles (ascending order of the sums)
  for (int32_t t = 0; t < x.num_tasks; ++t) {
    const TaskTile& tile = x.tiles[static_cast<size_t>(t)];
    const TaskKind kind = static_cast<TaskKind>(tile.kind);
    if ((kind != TaskKind::kWgradDown && kind != TaskKind::kWgradGateUp) || tile.macro < 1 ||
        !g.expert_in(tile.unit, tile.macro - 1))
      continue;
    Wait w[kMaxWaits]{};
    const int n = task_waits(kind, tile.unit, tile.macro, g, c, w);
    bool found = false;
    for (int i = 0; i < n; ++i)
      found |= w[i].array == CounterArray::kWgradDone && w[i].index == tile.unit * g.num_macro + tile.macro - 1 &&
               w[i].expected == wgrad_tiles(c);
    ASSERT_TRUE(found) << "wgrad of expert " << tile.unit << " in macrobatch " << tile.macro
                       << " does not wait for its accumulator's previous macrobatch";
  }
  // A gather's waits point at tasks below every task that waits on that gather
  for (int32_t b = 0; b < g.num_blocks; ++b) {
    Wait w[kMaxWaits];
    const int n = gather_waits(b, g, c, w);
    const auto it = first_waiter_on_gather.find(b);
    ASSERT_NE(it, first_waiter_on_gather.end()) << "nothing waits on the gather of block " << b;
    for (int i = 0; i < n; ++i) {
      const auto& who = signalers[{static_cast<int>(w[i].array), w[i].index}];
      ASSERT_EQ(static_cast<int32_t>(who.size()), w[i].expected) << "gather " << b << " array " << static_cast<int>(w[i].array);
      for (int32_t s : who) ASSERT_LT(s, it->second) << "gather " << b << " waits on task " << s;
    }
  }
}

// Compute blocks claim tasks in order and hold at most one claimed-but-waiting and one
// computing; comm blocks gather their row blocks (b = index, index + num_comm, ...) in
// order, after the first start_blocks that every block gathers at the kernel's start (no
// waits: clamped to the ring's first pass when rows are not resident).  Random interleavings
// must always finish.
bool run_model(const Case& k, int num_compute, int num_comm, uint64_t seed, std::string* why, int32_t start_blocks = 0) {
  const Geometry g = k.geometry();
  const Expanded x = expand(g, k.c);
  std::vector<std::vector<int32_t>> counters(static_cast<size_t>(CounterArray::kNumArrays));
  const size_t width = static_cast<size_t>(
      std::max<int32_t>({g.num_blocks, g.num_experts * std::max(g.num_macro, 1), k.c.shared_blocks}) + 1);
  for (auto& v : counters) v.assign(width, 0);
  auto ready = [&](const Wait* w, int n) {
    for (int i = 0; i < n; ++i)
      if (counters[static_cast<size_t>(w[i].array)][static_cast<size_t>(w[i].index)] < w[i].expected) return false;
    return true;
  };
  struct Compute {
    int32_t pending = -1, computing = -1;
    int64_t busy_until = 0;  // a slow block: its tile finishes no earlier than this step
  };
  std::vector<Compute> compute(static_cast<size_t>(num_compute));
  std::vector<int32_t> comm_next(static_cast<size_t>(num_comm), 0);
  start_blocks = std::min(start_blocks, g.num_blocks);
  if (!k.c.resident) start_blocks = std::min(start_blocks, g.ring_blocks);
  for (int32_t b = 0; b < start_blocks; ++b)
    counters[static_cast<size_t>(CounterArray::kDyReady)][static_cast<size_t>(b)] =
        counters[static_cast<size_t>(CounterArray::kXReady)][static_cast<size_t>(b)] = 128;
  int32_t next_task = 0, finished = 0;
  // The fp32 accumulator of a wgrad tile (kind, expert, n) is read and written by its
  // macrobatches in ascending order: the last macrobatch that finished it
  std::map<std::tuple<int32_t, int32_t, int32_t>, int32_t> acc_last;
  auto wgrad = [](const TaskTile& t) {
    return static_cast<TaskKind>(t.kind) == TaskKind::kWgradDown || static_cast<TaskKind>(t.kind) == TaskKind::kWgradGateUp;
  };
  std::mt19937_64 rng(seed);
  for (int64_t steps = 0; steps < 20000000 && finished < x.num_tasks; ++steps) {
    std::vector<int> actors(static_cast<size_t>(num_compute + num_comm));
    std::iota(actors.begin(), actors.end(), 0);
    std::shuffle(actors.begin(), actors.end(), rng);
    bool progressed = false;
    for (int a : actors) {
      if (a < num_compute) {
        Compute& cb = compute[static_cast<size_t>(a)];
        std::vector<int> moves;
        if (cb.pending < 0 && next_task < x.num_tasks) moves.push_back(0);
        if (cb.pending >= 0 && cb.computing < 0) {
          const TaskTile& t = x.tiles[static_cast<size_t>(cb.pending)];
          Wait w[kMaxWaits];
          if (ready(w, task_waits(static_cast<TaskKind>(t.kind), t.unit, t.macro, g, k.c, w))) moves.push_back(1);
        }
        if (cb.computing >= 0 && steps >= cb.busy_until) moves.push_back(2);
        if (moves.empty()) continue;
        const int move = moves[rng() % moves.size()];
        if (move == 0) {
          cb.pending = next_task++;
        } else if (move == 1) {
          const TaskTile& t = x.tiles[static_cast<size_t>(cb.pending)];
          if (wgrad(t) && t.macro >= 1 && g.expert_in(t.unit, t.macro - 1)) {
            const auto it = acc_last.find({t.kind, t.unit, t.n});
            if (it == acc_last.end() || it->second != t.macro - 1) {
              *why = "wgrad tile of expert " + std::to_string(t.unit) + " in macrobatch " + std::to_string(t.macro) +
                     " started before its accumulator's previous macrobatch finished";
              return false;
            }
          }
          cb.computing = cb.pending;
          cb.pending = -1;
          // Now and then a block is slow (preempted, clocked down): adversarial schedules
          if (rng() % 8 == 0) cb.busy_until = steps + static_cast<int64_t>(rng() % 4000);
        } else {
          const TaskTile& t = x.tiles[static_cast<size_t>(cb.computing)];
          if (wgrad(t) && t.macro >= 0) acc_last[{t.kind, t.unit, t.n}] = t.macro;
          for (const auto& s : signals(t, g, k.c))
            ++counters[static_cast<size_t>(s.first)][static_cast<size_t>(s.second)];
          cb.computing = -1;
          ++finished;
        }
        progressed = true;
      } else {
        const int i = a - num_compute;
        const int32_t b = start_blocks + i + comm_next[static_cast<size_t>(i)] * num_comm;
        if (b >= g.num_blocks) continue;
        Wait w[kMaxWaits];
        if (!ready(w, gather_waits(b, g, k.c, w))) continue;
        counters[static_cast<size_t>(CounterArray::kDyReady)][static_cast<size_t>(b)] = 128;
        if (replays(g, k.c, b)) counters[static_cast<size_t>(CounterArray::kXReady)][static_cast<size_t>(b)] = 128;
        ++comm_next[static_cast<size_t>(i)];
        progressed = true;
      }
    }
    bool waiting_on_slow = false;
    for (const Compute& cb : compute) waiting_on_slow |= cb.computing >= 0 && steps < cb.busy_until;
    if (!progressed && !waiting_on_slow) {
      *why = "deadlock after " + std::to_string(finished) + " of " + std::to_string(x.num_tasks) + " tasks";
      return false;
    }
  }
  if (finished < x.num_tasks) {
    *why = "did not finish";
    return false;
  }
  // Every row block's dgrad-down and dgrad gate/up counters end at their tile counts (what
  // gather_waits expects of a ring slot's previous occupant)
  auto at = [&](CounterArray a, int32_t i) { return counters[static_cast<size_t>(a)][static_cast<size_t>(i)]; };
  for (int32_t b = 0; b < g.num_blocks; ++b)
    if (at(CounterArray::kDgradDownDone, b) != k.c.n_dgrad_down ||
        at(CounterArray::kDgradGateUpDone, b) != k.c.n_dgrad_gate_up) {
      *why = "row block " + std::to_string(b) + ": dgrad counters differ from their tile counts";
      return false;
    }
  return true;
}

const TaskCounts kDsv3Like{16, 8, 28, 56 * 8, 32 * 28, 0};  // 128 x 256 tiles, H = 7168, I = 2048
const TaskCounts kSmall{2, 1, 2, 3, 4, 0};
// With a shared expert over 5 token blocks (replayed, or its h kept by the forward)
const TaskCounts kSmallShared{2, 1, 2, 3, 4, 0, 5, 2, 1, 2, 3, 4};
const TaskCounts kSmallSharedKept{2, 1, 2, 3, 4, 0, 5, 0, 1, 2, 3, 4};
const TaskCounts kSharedNoTokens{2, 1, 2, 3, 4, 0, 0, 2, 1, 2, 3, 4};  // a rank with T = 0: zero shared wgrad tiles

std::vector<Case> cases() {
  std::vector<Case> out;
  for (TaskCounts c : {kDsv3Like, kSmall, kSmallShared, kSmallSharedKept, kSharedNoTokens}) {
    // 0: the ring's macrobatch saved, 1: replay everything, 2: every row's h saved (no replay)
    for (int replay : {0, 1, 2}) {
      c.replay_all = replay == 1;
      c.saved_all = replay == 2;
      out.emplace_back(std::vector<int32_t>(16, 17), 128, 8, c);                // dsv3: one macrobatch
      out.emplace_back(std::vector<int32_t>(16, 17), 16, 8, c);                 // experts span macrobatches
      out.emplace_back(std::vector<int32_t>{0, 40, 0, 1, 3, 0, 22}, 8, 4, c);   // empty and 1-block experts
      out.emplace_back(std::vector<int32_t>{64}, 8, 2, c);                      // one hot expert
      out.emplace_back(std::vector<int32_t>{0, 0, 0}, 4, 2, c);                 // no rows at all
      out.emplace_back(std::vector<int32_t>{1}, 1, 1, c);
    }
    // The tiles in N-group raster order (the kernel's default): a permutation within segments
    TaskCounts r = c;
    r.raster_group = 3;
    r.wgrad_down_n_blocks = 1;
    r.wgrad_gate_up_n_blocks = 2;
    r.shared_wgrad_down_n_blocks = c.n_shared_wgrad_down > 0 ? 1 : 0;
    out.emplace_back(std::vector<int32_t>{0, 40, 0, 1, 3, 0, 22}, 8, 4, r);
    out.emplace_back(std::vector<int32_t>(16, 17), 16, 8, r);
    // Resident rows (the fused kernel): no drain at macrobatch boundaries, gathers never wait
    TaskCounts res = r;
    res.resident = 1;
    out.emplace_back(std::vector<int32_t>{0, 40, 0, 1, 3, 0, 22}, 8, 4, res);
    out.emplace_back(std::vector<int32_t>(16, 17), 16, 8, res);
    out.emplace_back(std::vector<int32_t>(16, 17), 16, 16, res);
    // Many experts, every other one without rows: the wgrad ranges hold them (few segments)
    std::vector<int32_t> alternating(256);
    for (size_t e = 0; e < alternating.size(); ++e) alternating[e] = e % 2 ? 0 : static_cast<int32_t>(1 + e % 3);
    out.emplace_back(alternating, 16, 4, c);
  }
  return out;
}

TEST(BackwardSchedule, CoversEveryTileAndWaitsOnlyBackwards) {
  for (const Case& k : cases()) check_list(k);
  // Random expert sizes
  std::mt19937_64 rng(fresh_seed());
  for (int trial = 0; trial < 30; ++trial) {
    std::vector<int32_t> per(static_cast<size_t>(1 + rng() % 12));
    for (auto& n : per) n = static_cast<int32_t>(rng() % 4 == 0 ? 0 : rng() % 20);
    const int32_t mini = static_cast<int32_t>(1 + rng() % 4), ring = mini * static_cast<int32_t>(1 + rng() % 4);
    check_list(Case(per, ring, mini, kSmall));
  }
}

TEST(BackwardSchedule, ProtocolModelFinishesUnderRandomInterleavings) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const Case& k : cases()) {
    if (k.c.n_wgrad_down > 100 && k.num_blocks > 100) continue;  // the dsv3-sized lists: list checks only
    for (int rep = 0; rep < 5; ++rep) {
      std::string why;
      const int compute = static_cast<int>(1 + rng() % 6), comm = static_cast<int>(1 + rng() % 3);
      // The kernel's start gather: none, the first minibatch (the default), or more
      const int32_t start = rep < 2 ? 0 : static_cast<int32_t>(rep - 1) * k.geometry().minibatch_blocks;
      ASSERT_TRUE(run_model(k, compute, comm, rng(), &why, start))
          << k.name() << " compute=" << compute << " comm=" << comm << " start=" << start << ": " << why;
    }
  }
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<int32_t> per(static_cast<size_t>(1 + rng() % 8));
    for (auto& n : per) n = static_cast<int32_t>(rng() % 4 == 0 ? 0 : rng() % 12);
    const int32_t mini = static_cast<int32_t>(1 + rng() % 3), ring = mini * static_cast<int32_t>(1 + rng() % 3);
    const Case k(per, ring, mini, kSmall);
    std::string why;
    ASSERT_TRUE(run_model(k, static_cast<int>(1 + rng() % 4), static_cast<int>(1 + rng() % 3), rng(), &why))
        << k.name() << ": " << why;
  }
}

// The wgrad pieces (wgrad_piece: the rows each macrobatch's wgrad tiles of an expert sum, and
// what they do with the fp32 sum) on random plans: every real row in exactly one piece, in
// ascending macrobatches; the first piece starts the sum, the last writes it, the others carry
// it in the accumulator; an expert without rows gets one final piece of no rows; and a piece
// exists exactly where the fused schedule emits the expert's wgrad tiles (expert_in).
TEST(BackwardSchedule, WgradPiecesCoverEveryRowOnceInOrder) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 300; ++trial) {
    const int32_t E = static_cast<int32_t>(1 + rng() % 9), ring_blocks = static_cast<int32_t>(1 + rng() % 5);
    const int32_t R = ring_blocks * 128;
    std::vector<int32_t> offset{0}, count, begin, end;
    for (int32_t e = 0; e < E; ++e) {
      const int32_t c = rng() % 4 == 0 ? 0 : rng() % 3 == 0 ? static_cast<int32_t>(1 + rng() % 3) * 128
                                                            : static_cast<int32_t>(rng() % 900);
      count.push_back(c);
      offset.push_back(offset.back() + (c + 127) / 128 * 128);
      begin.push_back(offset[static_cast<size_t>(e)] / 128);
      end.push_back(offset.back() / 128);
    }
    const int32_t live = live_macros(offset.back(), R);
    const Geometry g = Geometry::make(offset.back() / 128, ring_blocks, 1, E, begin.data(), end.data());
    for (int32_t e = 0; e < E; ++e) {
      SCOPED_TRACE("trial " + std::to_string(trial) + " expert " + std::to_string(e) + " rows " +
                   std::to_string(count[static_cast<size_t>(e)]) + " ring " + std::to_string(R));
      int32_t covered = 0, finals = 0, next_row = offset[static_cast<size_t>(e)], pieces = 0;
      for (int32_t m = 0; m < live; ++m) {
        const WgradPiece w = wgrad_piece(offset[static_cast<size_t>(e)], count[static_cast<size_t>(e)],
                                         offset[static_cast<size_t>(e) + 1], m, R, live);
        if (count[static_cast<size_t>(e)] > 0) {
          ASSERT_EQ(w.mode >= 0, g.expert_in(e, m)) << "macro " << m;
        }
        if (w.mode < 0) continue;
        ++pieces;
        ASSERT_EQ(w.row0, next_row) << "macro " << m << ": pieces must be contiguous";
        ASSERT_EQ(w.row0 % 64, 0) << "the wgrad kind reads k-blocks of 64 rows from row0";
        next_row += w.count;
        covered += w.count;
        ASSERT_EQ((w.mode & gemm::kWgradAccumulate) != 0, m > w.first_macro) << "macro " << m;
        ASSERT_EQ((w.mode & gemm::kWgradStoreAcc) != 0, m < w.last_macro) << "macro " << m;
        finals += (w.mode & gemm::kWgradFinal) != 0;
        if ((w.mode & gemm::kWgradFinal) != 0) {
          ASSERT_EQ(m, w.last_macro);
        }
        if (m < w.last_macro) {
          ASSERT_EQ(w.row0 + w.count, (m + 1) * R) << "a carried piece ends at its macrobatch";
        }
      }
      ASSERT_EQ(covered, count[static_cast<size_t>(e)]) << "every real row in one piece";
      ASSERT_EQ(finals, 1) << "one piece writes the gradient";
      if (count[static_cast<size_t>(e)] == 0) {
        ASSERT_EQ(pieces, 1) << "an expert without rows: one piece of zeros";
      }
    }
  }
}

// A timeout record in words: the host's sentence names the role, the block, the counter (its
// direction, array and index) or the slot, and the expected and observed values.
TEST(WaitSites, TheHostDecodesEveryRecord) {
  auto record = [](WaitSite site, int64_t block, int64_t detail, int64_t expected, int64_t observed) {
    return std::vector<int64_t>{1, static_cast<int64_t>(site), block, detail, expected, observed, 0};
  };
  auto says = [](const std::vector<int64_t>& r) { return fused::describe_timeout(r.data()); };
  const int64_t d = counter_wait_detail(kBackwardDirection, static_cast<int32_t>(CounterArray::kDgradDownDone), 7);
  EXPECT_EQ(counter_wait_direction(d), kBackwardDirection);
  EXPECT_EQ(counter_wait_array(d), static_cast<int32_t>(CounterArray::kDgradDownDone));
  EXPECT_EQ(counter_wait_index(d), 7);
  std::string s = says(record(WaitSite::kTaskCounter, 12, d, 6, 4));
  EXPECT_NE(s.find("block 12, producer, before a task's loads"), std::string::npos) << s;
  EXPECT_NE(s.find("backward counter dgrad_down_done[7] >= 6, observed 4"), std::string::npos) << s;
  s = says(record(WaitSite::kGatherCounter, 3,
                  counter_wait_detail(kForwardDirection, static_cast<int32_t>(fused::CounterArray::kDownDone), 40), 11,
                  2));
  EXPECT_NE(s.find("gather warp, before a row block's gather: waiting for forward counter dn_done[40] >= 11, observed 2"),
            std::string::npos)
      << s;
  s = says(record(WaitSite::kTaskSlotFull, 5, 1, 0, -1));
  EXPECT_NE(s.find("block 5, consumer 1: waiting for the producer's next task (mbarrier phase 0)"), std::string::npos)
      << s;
  s = says(record(WaitSite::kGridBarrier, 9, 1, 264, 263));
  EXPECT_NE(s.find("every block to arrive (EP: the second arrival), 264 arrivals, observed 263"), std::string::npos) << s;
  for (int site = static_cast<int>(WaitSite::kStageEmpty); site <= static_cast<int>(WaitSite::kLastWaitSite); ++site) {
    s = says(record(static_cast<WaitSite>(site), 0, 0, 0, -1));
    EXPECT_EQ(s.find("wait site"), std::string::npos) << "site " << site << " has no sentence: " << s;
  }
}

}  // namespace
}  // namespace mok::cuda::fused::bwd
