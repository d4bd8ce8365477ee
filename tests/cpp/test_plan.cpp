// Property tests of the host-built plan: every routed (rank, token, j) exactly once, in
// canonical order, in its expert's segment; masked and invalid routes never; padding rows
// marked; capacities hold under skew.
#include <gtest/gtest.h>

#include <map>
#include <tuple>

#include "test_util.hpp"

namespace mok::test {
namespace {

struct Case {
  int P;
  int64_t E_l;
  int k;
  int block_m;
  Routing routing;
  bool ids64;
  std::vector<int64_t> tokens;  // per rank
};

std::string describe(const Case& c, uint64_t seed) {
  std::string s = "seed=" + std::to_string(seed) + " P=" + std::to_string(c.P) + " E_l=" + std::to_string(c.E_l) +
                  " k=" + std::to_string(c.k) + " block_m=" + std::to_string(c.block_m) + " routing=" +
                  routing_name(c.routing) + (c.ids64 ? " int64" : " int32") + " T=[";
  for (auto t : c.tokens) s += std::to_string(t) + ",";
  return s + "]";
}

// Builds every rank's plan for `c` and checks the properties.
void check_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(describe(c, seed));
  std::mt19937_64 rng(seed);
  const int64_t E = c.E_l * c.P;
  std::vector<std::vector<int64_t>> ids64(static_cast<size_t>(c.P));
  std::vector<std::vector<int32_t>> ids32(static_cast<size_t>(c.P));
  plan::RoutingView v;
  v.num_ranks = c.P;
  v.topk = c.k;
  v.num_experts = E;
  v.ids_are_int64 = c.ids64;
  int64_t t_max = 0;
  for (int s = 0; s < c.P; ++s) {
    ids64[static_cast<size_t>(s)] = make_ids(rng, c.tokens[static_cast<size_t>(s)], c.k, E, c.E_l, c.routing);
    ids32[static_cast<size_t>(s)] = to_int32(ids64[static_cast<size_t>(s)]);
    v.ids[s] = c.ids64 ? static_cast<const void*>(ids64[static_cast<size_t>(s)].data())
                       : static_cast<const void*>(ids32[static_cast<size_t>(s)].data());
    v.num_tokens[s] = c.tokens[static_cast<size_t>(s)];
    t_max = std::max(t_max, c.tokens[static_cast<size_t>(s)]);
  }
  // Expected: each routed (s, t, j) once, at the rank owning its expert.
  std::map<std::tuple<int, int64_t, int>, int64_t> expected;  // -> global expert
  for (int s = 0; s < c.P; ++s)
    for (int64_t t = 0; t < c.tokens[static_cast<size_t>(s)]; ++t)
      for (int j = 0; j < c.k; ++j) {
        const int64_t id = ids64[static_cast<size_t>(s)][static_cast<size_t>(t * c.k + j)];
        if (id >= 0) expected[{s, t, j}] = id;
      }
  std::map<std::tuple<int, int64_t, int>, int64_t> seen;
  for (int r = 0; r < c.P; ++r) {
    plan::PlanDims d;
    d.num_ranks = c.P;
    d.rank = r;
    d.num_experts = E;
    d.topk = c.k;
    d.block_m = c.block_m;
    d.max_tokens = t_max;
    d.minibatch_size = c.block_m;
    d.macrobatch_size = 4 * c.block_m;
    ASSERT_EQ(plan::check_plan_dims(d), "");
    HostPlan p = build_host(d, v);
    EXPECT_FALSE(p.error.any());
    const int64_t total = p.expert_offset[static_cast<size_t>(c.E_l)];
    ASSERT_LE(total, plan::max_rows(d)) << "capacity exceeded";
    ASSERT_EQ(total % c.block_m, 0);
    for (int64_t e = 0; e < c.E_l; ++e) {
      const int64_t off = p.expert_offset[static_cast<size_t>(e)], cnt = p.expert_count[static_cast<size_t>(e)];
      const int64_t next = p.expert_offset[static_cast<size_t>(e + 1)];
      ASSERT_EQ(next - off, plan::padded_rows(cnt, c.block_m)) << "expert " << e;
      ASSERT_EQ(off % c.block_m, 0);
      for (int64_t i = off; i < off + cnt; ++i) {
        const uint32_t rec = p.rows[static_cast<size_t>(i)];
        ASSERT_FALSE(row_is_pad(rec));
        const auto key = std::make_tuple(row_rank(rec), row_token(rec), row_slot(rec));
        ASSERT_EQ(seen.count(key), 0u) << "route seen twice";
        seen[key] = d.first_expert() + e;
        if (i > off) {  // strictly canonical order
          const uint32_t prev = p.rows[static_cast<size_t>(i - 1)];
          ASSERT_LT(std::make_tuple(row_rank(prev), row_token(prev), row_slot(prev)), key);
        }
      }
      for (int64_t i = off + cnt; i < next; ++i) ASSERT_TRUE(row_is_pad(p.rows[static_cast<size_t>(i)]));
      for (int64_t b = off / c.block_m; b < next / c.block_m; ++b)
        ASSERT_EQ(p.block_expert[static_cast<size_t>(b)], e) << "block " << b;
    }
    for (size_t i = static_cast<size_t>(total); i < p.rows.size(); ++i) ASSERT_TRUE(row_is_pad(p.rows[i]));
    for (size_t b = static_cast<size_t>(total / c.block_m); b < p.block_expert.size(); ++b)
      ASSERT_EQ(p.block_expert[b], -1);
  }
  EXPECT_EQ(seen, expected) << "plans must hold exactly the routed routes, each at its expert";
}

TEST(Plan, RandomProperties) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Routing routings[] = {Routing::kUniform, Routing::kZipf, Routing::kOneExpert, Routing::kOneRank,
                              Routing::kMasked};
  const int block_ms[] = {1, 4, 16, 128};
  for (int iter = 0; iter < 60; ++iter) {
    Case c;
    c.P = 1 + static_cast<int>(rng() % 8);
    c.E_l = 1 + static_cast<int64_t>(rng() % 8);
    c.k = 1 + static_cast<int>(rng() % std::min<int64_t>(8, c.E_l * c.P));
    c.block_m = block_ms[rng() % 4];
    c.routing = routings[iter % 5];
    if (c.routing == Routing::kOneRank && c.k > c.E_l) c.routing = Routing::kUniform;
    c.ids64 = rng() % 2;
    for (int s = 0; s < c.P; ++s) c.tokens.push_back(rng() % 4 == 0 ? 0 : static_cast<int64_t>(rng() % 300));
    check_case(c, rng());
  }
}

TEST(Plan, SkewAllTokensToOneExpert) {
  check_case(Case{1, 4, 1, 128, Routing::kOneExpert, false, {1000}}, fresh_seed());
  check_case(Case{4, 2, 3, 16, Routing::kOneExpert, true, {300, 0, 77, 129}}, fresh_seed());
}

TEST(Plan, SkewAllTokensToOneRank) {
  check_case(Case{8, 4, 4, 128, Routing::kOneRank, false, {257, 256, 255, 1, 0, 0, 513, 3}}, fresh_seed());
}

TEST(Plan, EmptyRanksAndEmptyBatch) {
  check_case(Case{3, 2, 2, 8, Routing::kUniform, false, {0, 0, 0}}, fresh_seed());
  check_case(Case{3, 2, 2, 8, Routing::kMasked, false, {0, 50, 0}}, fresh_seed());
}

// Worst case for padding: every expert's count is 1 mod block_m, all of it on one rank.
TEST(Plan, CapacityIsWorstCase) {
  const int P = 2, k = 2, block_m = 128;
  const int64_t E_l = 4, T = 129;
  plan::PlanDims d;
  d.num_ranks = P;
  d.rank = 0;
  d.num_experts = E_l * P;
  d.topk = k;
  d.block_m = block_m;
  d.max_tokens = T;
  d.minibatch_size = block_m;
  d.macrobatch_size = block_m;
  // Every token of both ranks picks experts (t % E_l, (t+1) % E_l): all routes land on rank 0.
  std::vector<int32_t> ids(static_cast<size_t>(T * k));
  for (int64_t t = 0; t < T; ++t) {
    ids[static_cast<size_t>(t * k)] = static_cast<int32_t>(t % E_l);
    ids[static_cast<size_t>(t * k + 1)] = static_cast<int32_t>((t + 1) % E_l);
  }
  plan::RoutingView v;
  v.num_ranks = P;
  v.topk = k;
  v.num_experts = d.num_experts;
  for (int s = 0; s < P; ++s) {
    v.ids[s] = ids.data();
    v.num_tokens[s] = T;
  }
  HostPlan p = build_host(d, v);
  const int64_t total = p.expert_offset[static_cast<size_t>(E_l)];
  int64_t routed = 0;
  for (auto cnt : p.expert_count) routed += cnt;
  EXPECT_EQ(routed, P * T * k);
  EXPECT_LE(total, plan::max_rows(d));
  EXPECT_EQ(plan::max_rows(d), ((P * T * k + E_l * (block_m - 1)) / block_m) * block_m);
}

TEST(Plan, InvalidRoutesAreMaskedAndTheFirstIsReported) {
  const int k = 3;
  const int64_t E = 8;
  std::vector<int64_t> ids = {0, 1, 2,  3, 3, 4,  9, 1, -2,  5, 6, 7};  // dup at (1,1), out of range at (2,0)
  plan::RoutingView v;
  v.num_ranks = 1;
  v.topk = k;
  v.num_experts = E;
  v.ids_are_int64 = 1;
  v.ids[0] = ids.data();
  v.num_tokens[0] = 4;
  plan::PlanDims d;
  d.num_experts = E;
  d.topk = k;
  d.block_m = 4;
  d.max_tokens = 4;
  d.minibatch_size = 4;
  d.macrobatch_size = 8;
  HostPlan p = build_host(d, v);
  ASSERT_TRUE(p.error.any());
  EXPECT_EQ(p.error.key, error_key(0, 1, 1));
  EXPECT_EQ(p.error.id, 3);
  EXPECT_EQ(p.error.kind, RouteCheck::kDuplicate);
  int64_t routed = 0;
  for (auto cnt : p.expert_count) routed += cnt;
  EXPECT_EQ(routed, 12 - 3) << "the duplicate and the two out-of-range routes are masked";
  EXPECT_EQ(p.expert_count[3], 1) << "expert 3 once: the duplicate is the later j";
}

TEST(Plan, RowRecordRoundTrip) {
  for (int r : {0, 1, 37, kMaxRanks - 1})
    for (int j : {0, 5, kMaxTopK - 1})
      for (int64_t t : {int64_t{0}, int64_t{12345}, kMaxTokens - 1}) {
        const uint32_t rec = encode_row(r, t, j);
        EXPECT_EQ(row_rank(rec), r);
        EXPECT_EQ(row_slot(rec), j);
        EXPECT_EQ(row_token(rec), t);
        EXPECT_FALSE(row_is_pad(rec));
      }
}

TEST(Plan, DimsAreChecked) {
  plan::PlanDims d;
  d.num_experts = 8;
  d.topk = 2;
  d.max_tokens = 16;
  d.minibatch_size = 128;
  d.macrobatch_size = 256;
  EXPECT_EQ(plan::check_plan_dims(d), "");
  auto bad = d;
  bad.num_ranks = 3;
  EXPECT_NE(plan::check_plan_dims(bad).find("multiple of ep_size"), std::string::npos);
  bad = d;
  bad.minibatch_size = 100;
  EXPECT_NE(plan::check_plan_dims(bad).find("minibatch_size"), std::string::npos);
  bad = d;
  bad.macrobatch_size = 200;
  EXPECT_NE(plan::check_plan_dims(bad).find("macrobatch_size"), std::string::npos);
  bad = d;
  bad.topk = 40;
  EXPECT_NE(plan::check_plan_dims(bad).find("topk"), std::string::npos);
}

// minibatch_size / macrobatch_size = 0: chosen from the shape (two full waves of the grid per
// expert GEMM of a minibatch), within the task table's limit.
TEST(Plan, BatchSizesChosenForAnyTokenCount) {
  auto resolved = [](int32_t P, int64_t T, int32_t k, int64_t E, int64_t mini, int64_t macro,
                     plan::BatchRule rule = plan::BatchRule{16, 132}) {
    plan::PlanDims d;
    d.num_ranks = P;
    d.max_tokens = T;
    d.topk = k;
    d.num_experts = E;
    d.minibatch_size = mini;
    d.macrobatch_size = macro;
    plan::resolve_batch_sizes(d, rule);
    EXPECT_EQ(plan::check_plan_dims(d), "") << "P=" << P << " T=" << T << " k=" << k << " E=" << E;
    EXPECT_LE(plan::num_minibatches(plan::max_rows(d), d.minibatch_size), plan::kMaxMinibatches);
    EXPECT_EQ(d.macrobatch_size % d.minibatch_size, 0);
    return std::make_pair(d.minibatch_size, d.macrobatch_size);
  };
  using P2 = std::pair<int64_t, int64_t>;
  // dsv3 at EP = 1 (gate/up 16 tiles per row block, down 28; 132 SMs): ceil(264 / 16) = 17 blocks
  EXPECT_EQ(resolved(1, 4096, 8, 16, 0, 0), P2(2176, 17408));
  // qwen3 (gate/up 12, down 16): 22 blocks; the ring 6 of them
  EXPECT_EQ(resolved(1, 4096, 8, 32, 0, 0, {12, 132}), P2(2816, 16896));
  // fg30b: T = 32768, k = 4, E = 64 (139,136 rows; gate/up 8 tiles): 33 blocks, 33 minibatches
  EXPECT_EQ(resolved(1, 32768, 4, 64, 0, 0, {8, 132}), P2(4224, 16896));
  // The rule is the smallest number of blocks with two full waves, for any grid
  for (int64_t tiles : {1, 3, 16, 28, 300})
    for (int64_t grid : {1, 33, 66, 114, 132}) {
      const int64_t mb = resolved(1, 4096, 8, 16, 0, 0, {tiles, grid}).first;
      EXPECT_EQ(mb % 128, 0);
      EXPECT_GE(mb / 128 * tiles, 2 * grid) << tiles << " tiles, grid " << grid;
      EXPECT_LT((mb / 128 - 1) * tiles, 2 * grid) << tiles << " tiles, grid " << grid;
    }
  // EP = 8, T = 32768, k = 8, E = 256: 2,101,120 rows need 4112-row minibatches (511 at most)
  EXPECT_EQ(resolved(8, 32768, 8, 256, 0, 0), P2(4224, 16896));
  // A 67M-row plan (P = 64, k = 32) still gets a minibatch count within the table
  resolved(64, 32768, 32, 2048, 0, 0);
  // Explicit knobs stay; a given ring gets a minibatch that divides it
  EXPECT_EQ(resolved(1, 4096, 8, 16, 512, 0), P2(512, 16384));
  EXPECT_EQ(resolved(1, 4096, 8, 16, 1024, 0), P2(1024, 16384));
  EXPECT_EQ(resolved(1, 4096, 8, 16, 0, 512), P2(512, 512));
  EXPECT_EQ(resolved(1, 4096, 8, 16, 0, 3 * 128), P2(384, 384));
  EXPECT_EQ(resolved(1, 4096, 8, 16, 256, 512), P2(256, 512));
  EXPECT_EQ(resolved(1, 4096, 8, 16, 0, 4352), P2(2176, 4352));
  EXPECT_EQ(resolved(1, 16, 2, 8, 0, 0), P2(2176, 17408));
}

TEST(Plan, MinibatchGeometry) {
  EXPECT_EQ(plan::num_minibatches(0, 256), 0);
  EXPECT_EQ(plan::num_minibatches(256, 256), 1);
  EXPECT_EQ(plan::num_minibatches(257, 256), 2);
  EXPECT_EQ(plan::num_macrobatches(3000, 1024), 3);
  EXPECT_EQ(plan::ring_slot(1500, 1024), 476);
}

// The start gather's runs (plan::row_run): the workers' runs tile [0, rows) in order, each row
// once, no run longer than ceil(rows / workers); rows_in splits a run over row blocks exactly.
TEST(Plan, RowRunsTileTheRowsInOrder) {
  for (int64_t rows : {0, 1, 127, 128, 4224, 4352, 100000})
    for (int64_t workers : {1, 3, 12, 1584}) {
      int64_t next = 0;
      std::map<int64_t, int64_t> per_block;
      for (int64_t w = 0; w < workers; ++w) {
        const plan::RowRun r = plan::row_run(rows, w, workers);
        ASSERT_LE(r.begin, r.end);
        if (r.begin == r.end) continue;
        ASSERT_EQ(r.begin, next) << "rows " << rows << " workers " << workers << " worker " << w;
        ASSERT_LE(r.end - r.begin, plan::ceil_div(rows, workers));
        next = r.end;
        int64_t sum = 0;
        for (int64_t b = r.begin / 128; b * 128 < r.end; ++b) {
          sum += r.rows_in(b, 128);
          per_block[b] += r.rows_in(b, 128);
        }
        ASSERT_EQ(sum, r.end - r.begin);
        ASSERT_EQ(r.rows_in(r.end / 128 + 1, 128), 0);
      }
      ASSERT_EQ(next, rows);
      for (const auto& [b, n] : per_block) ASSERT_EQ(n, std::min<int64_t>(128, rows - b * 128)) << "block " << b;
    }
}

}  // namespace
}  // namespace mok::test
