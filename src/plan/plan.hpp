// The routing plan ("schedule table"): pure functions usable on host and device.
//
// For rank `rank` of an EP group of `num_ranks`, the plan lists, for each local expert
// e_l in [0, E_l), the routed rows (s, token, j) of every source rank s in canonical order
// (by s, then token, then j), padded to `block_m` rows.  Segments are laid end to end:
//
//   rows[expert_offset[e] .. expert_offset[e] + expert_count[e])   real rows of expert e
//   rows[expert_offset[e] + expert_count[e] .. expert_offset[e+1]) padding (kPadRow)
//   rows[expert_offset[E_l] .. max_rows)                            unused (kPadRow)
//   block_expert[b] = local expert of rows [b*block_m, (b+1)*block_m), -1 past the end
//
// Minibatch m = rows [m*minibatch_size, (m+1)*minibatch_size), the unit of overlap;
// macrobatch M = rows [M*macrobatch_size, ...), the size of the ring; a row lives in ring
// slot row % macrobatch_size.  Capacity is worst case by construction (docs/contracts.md §3): a token
// routes to each expert at most once, so an expert gets at most P*T_max rows and the rank
// at most P*T_max*min(k, E_l), plus at most block_m-1 padding rows per expert.
#pragma once

#include <cstdint>
#include <string>

#include "common/defs.hpp"

namespace mok::plan {

// The fused kernels' task table (shared memory) holds two segments per minibatch plus the
// shared expert's: at most kMaxMinibatches minibatches per call.
inline constexpr int64_t kMaxMinibatches = 511;
// minibatch_size = 0 / macrobatch_size = 0 ("chosen by mok", the defaults): the minibatch is
// the smallest whole number of row blocks that gives each of its expert grouped GEMMs (gate/up
// and down) at least two full waves of the kernel's grid (kWavesPerMinibatch), raised to the
// rows the task table needs (at most kMaxMinibatches minibatches); the ring is at least
// kAutoMacrobatchRows, a whole number of minibatches.
inline constexpr int64_t kWavesPerMinibatch = 2;
inline constexpr int64_t kAutoMacrobatchRows = 16384;
inline constexpr int64_t kMacrobatchAllRows = MOK_MACROBATCH_ALL_ROWS;
// The grid the rule assumes where the device is not known (host-memory configs): the SM
// count of an H100 / H200 SXM.
inline constexpr int64_t kNominalGrid = 132;

struct PlanDims {
  int32_t num_ranks = 1;      // P
  int32_t rank = 0;           // r, the expert-owning rank this plan is for
  int64_t num_experts = 0;    // E (all ranks)
  int32_t topk = 0;           // k
  int32_t block_m = MOK_DEFAULT_BLOCK_M;
  int64_t max_tokens = 0;     // T_max
  int64_t minibatch_size = 1024;  // resolved values (never 0 here; these for direct construction)
  int64_t macrobatch_size = kAutoMacrobatchRows;

  MOK_HD int64_t local_experts() const { return num_experts / num_ranks; }
  MOK_HD int64_t first_expert() const { return static_cast<int64_t>(rank) * local_experts(); }
};

// The plan dimensions of a (resolved) configuration; host and device.
MOK_HD PlanDims plan_dims_of(const mokConfig_t& c) {
  PlanDims d;
  d.num_ranks = static_cast<int32_t>(c.ep_size);
  d.rank = static_cast<int32_t>(c.ep_rank);
  d.num_experts = c.num_experts;
  d.topk = static_cast<int32_t>(c.topk);
  d.block_m = static_cast<int32_t>(c.block_m);
  d.max_tokens = c.max_tokens;
  d.minibatch_size = c.minibatch_size;
  d.macrobatch_size = c.macrobatch_size;
  return d;
}

MOK_HD int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
MOK_HD int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
using mok::ceil_div;
MOK_HD int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Worst-case number of row records (always a multiple of block_m).
MOK_HD int64_t max_rows(const PlanDims& d) {
  const int64_t routed = static_cast<int64_t>(d.num_ranks) * d.max_tokens *
                         min64(d.topk, d.local_experts());
  const int64_t bound = routed + d.local_experts() * (d.block_m - 1);
  return (bound / d.block_m) * d.block_m;
}
// What the minibatch rule needs beyond the plan: output tiles per row block of the smaller of
// the two expert GEMMs (gate/up: ceil(I / 128), down: ceil(H / 256) at the 128 x 256 tile) and
// the grid (blocks of the fused kernel).
struct BatchRule {
  int64_t gemm_tiles_per_block = 1;
  int64_t grid = kNominalGrid;
};

// Fills minibatch_size / macrobatch_size left at 0 ("chosen by mok"), and a macrobatch_size of
// kMacrobatchAllRows (MOK_MACROBATCH_ALL_ROWS: every row of a worst-case plan, rounded up to
// the minibatch, which is chosen as for an unknown ring); explicit values stay
// (check_plan_dims reports bad ones).  Needs a valid block_m.
inline void resolve_batch_sizes(PlanDims& d, const BatchRule& rule) {
  if (d.block_m < 1) return;
  const int64_t rows = max_rows(d) > d.block_m ? max_rows(d) : d.block_m;
  if (d.minibatch_size == 0) {
    const int64_t tiles = rule.gemm_tiles_per_block > 0 ? rule.gemm_tiles_per_block : 1;
    const int64_t grid = rule.grid > 0 ? rule.grid : kNominalGrid;
    int64_t mb = ceil_div(kWavesPerMinibatch * grid, tiles) * d.block_m;
    const int64_t needed = ceil_div(rows, kMaxMinibatches);
    if (needed > mb) mb = round_up(needed, d.block_m);
    if (d.macrobatch_size > 0) {
      // A given ring: the largest multiple of block_m up to mb that divides it.
      mb = min64(mb, d.macrobatch_size - d.macrobatch_size % d.block_m);
      while (mb > d.block_m && d.macrobatch_size % mb != 0) mb -= d.block_m;
    }
    d.minibatch_size = mb;
  }
  if (d.macrobatch_size == 0 && d.minibatch_size > 0)
    d.macrobatch_size = round_up(kAutoMacrobatchRows > d.minibatch_size ? kAutoMacrobatchRows : d.minibatch_size,
                                 d.minibatch_size);
  if (d.macrobatch_size == kMacrobatchAllRows && d.minibatch_size > 0) d.macrobatch_size = round_up(rows, d.minibatch_size);
}
MOK_HD int64_t max_blocks(const PlanDims& d) { return max_rows(d) / d.block_m; }

// Worker w of n takes the run of consecutive rows [begin, end) of [0, rows): ceil(rows / n)
// each, the last workers' runs possibly short or empty (the fused kernels' start gather: one
// run per warp of the grid).
struct RowRun {
  int64_t begin, end;
  // How many of its rows lie in row block b (block_rows rows each)
  MOK_HD int64_t rows_in(int64_t b, int64_t block_rows) const {
    const int64_t lo = begin > b * block_rows ? begin : b * block_rows;
    const int64_t hi = end < (b + 1) * block_rows ? end : (b + 1) * block_rows;
    return hi > lo ? hi - lo : 0;
  }
};
MOK_HD RowRun row_run(int64_t rows, int64_t worker, int64_t workers) {
  const int64_t per = ceil_div(rows, workers);
  const int64_t begin = min64(rows, worker * per);
  return RowRun{begin, min64(rows, begin + per)};
}
MOK_HD int64_t padded_rows(int64_t count, int32_t block_m) { return round_up(count, block_m); }

MOK_HD int64_t num_minibatches(int64_t total_rows, int64_t minibatch_size) {
  return ceil_div(total_rows, minibatch_size);
}
MOK_HD int64_t num_macrobatches(int64_t total_rows, int64_t macrobatch_size) {
  return ceil_div(total_rows, macrobatch_size);
}
MOK_HD int64_t ring_slot(int64_t row, int64_t macrobatch_size) { return row % macrobatch_size; }

// The gathered routing of the EP group: rank s's topk_ids, [T_s, k] row-major.
// num_tokens[s] is T_s; with tokens_dev (device memory, EP >= 2: the peers' counts arrive on
// the device) T_s = min(tokens_dev[s], num_tokens[s]), num_tokens then holding T_max.
struct RoutingView {
  const void* ids[kMaxRanks] = {};
  int64_t num_tokens[kMaxRanks] = {};
  const int64_t* tokens_dev = nullptr;
  int64_t num_experts = 0;
  int32_t num_ranks = 1;
  int32_t topk = 0;
  int32_t ids_are_int64 = 0;
};

MOK_HD int64_t tokens_of(const RoutingView& v, int s) {
  if (v.tokens_dev == nullptr) return v.num_tokens[s];
  const int64_t t = v.tokens_dev[s];
  return t < 0 ? 0 : (t < v.num_tokens[s] ? t : v.num_tokens[s]);
}

MOK_HD int64_t load_id(const RoutingView& v, int s, int64_t token, int j) {
  const int64_t i = token * v.topk + j;
  return v.ids_are_int64 ? static_cast<const int64_t*>(v.ids[s])[i]
                         : static_cast<int64_t>(static_cast<const int32_t*>(v.ids[s])[i]);
}

// Validation of one route.  A duplicate is the later occurrence of an id within a token.
MOK_HD RouteCheck check_route(const RoutingView& v, int s, int64_t token, int j, int64_t* id_out) {
  const int64_t id = load_id(v, s, token, j);
  *id_out = id;
  if (id == -1) return RouteCheck::kMasked;
  if (id < -1 || id >= v.num_experts) return RouteCheck::kOutOfRange;
  for (int jj = 0; jj < j; ++jj)
    if (load_id(v, s, token, jj) == id) return RouteCheck::kDuplicate;
  return RouteCheck::kOk;
}

// Local expert index of a checked id on this plan's rank, or -1.
MOK_HD int32_t local_expert_of(int64_t id, const PlanDims& d) {
  const int64_t e = id - d.first_expert();
  return (e >= 0 && e < d.local_experts()) ? static_cast<int32_t>(e) : -1;
}

// Output arrays of a plan (host or device memory, capacities from max_rows/max_blocks).
struct PlanView {
  uint32_t* rows = nullptr;          // [max_rows]
  int32_t* expert_count = nullptr;   // [E_l]
  int32_t* expert_offset = nullptr;  // [E_l + 1]
  int32_t* block_expert = nullptr;   // [max_blocks]
};

// The first bad route seen (lowest error_key), as the device records it.
struct RouteError {
  int64_t key = kNoError;
  int64_t id = 0;
  RouteCheck kind = RouteCheck::kOk;
  bool any() const { return key != kNoError; }
};

// Host builder: the same plan the device kernel builds, bit for bit.  Bad routes are masked
// (treated as -1) and the first one is returned in *error.
void build_plan_host(const PlanDims& dims, const RoutingView& routing, const PlanView& out,
                     RouteError* error);

// Checks dims against the limits; returns an empty string when fine, else the reason.
std::string check_plan_dims(const PlanDims& dims);

}  // namespace mok::plan
