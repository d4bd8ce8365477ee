// Host build of the routing plan; src/cuda/plan_build.cu builds the same arrays on the GPU.
#include <algorithm>
#include <sstream>
#include <vector>

#include "plan/plan.hpp"

namespace mok::plan {

std::string check_plan_dims(const PlanDims& d) {
  std::ostringstream why;
  if (d.num_ranks < 1 || d.num_ranks > kMaxRanks)
    why << "ep_size = " << d.num_ranks << " must be in [1, " << kMaxRanks << "]";
  else if (d.rank < 0 || d.rank >= d.num_ranks)
    why << "ep_rank = " << d.rank << " must be in [0, ep_size = " << d.num_ranks << ")";
  else if (d.num_experts < 1 || d.num_experts % d.num_ranks != 0)
    why << "num_experts = " << d.num_experts << " must be a positive multiple of ep_size = "
        << d.num_ranks;
  else if (d.topk < 1 || d.topk > kMaxTopK)
    why << "topk = " << d.topk << " must be in [1, " << kMaxTopK << "]";
  else if (d.topk > d.num_experts)
    why << "topk = " << d.topk << " exceeds num_experts = " << d.num_experts;
  else if (d.max_tokens < 0 || d.max_tokens > kMaxTokens)
    why << "max_tokens = " << d.max_tokens << " must be in [0, " << kMaxTokens << "]";
  else if (d.block_m < 1 || d.block_m > 1024)
    why << "block_m = " << d.block_m << " must be in [1, 1024]";
  else if (d.minibatch_size < d.block_m || d.minibatch_size % d.block_m != 0)
    why << "minibatch_size = " << d.minibatch_size << " must be a positive multiple of block_m = "
        << d.block_m;
  else if (d.macrobatch_size < d.minibatch_size || d.macrobatch_size % d.minibatch_size != 0)
    why << "macrobatch_size = " << d.macrobatch_size
        << " must be a positive multiple of minibatch_size = " << d.minibatch_size;
  return why.str();
}

void build_plan_host(const PlanDims& d, const RoutingView& v, const PlanView& out,
                     RouteError* error) {
  const int64_t num_local = d.local_experts();
  RouteError first;
  // Bucket routes per local expert in canonical order (s, token, j): iterating in that
  // order and appending keeps each bucket sorted.
  std::vector<std::vector<uint32_t>> buckets(static_cast<size_t>(num_local));
  for (int s = 0; s < v.num_ranks; ++s) {
    for (int64_t t = 0; t < v.num_tokens[s]; ++t) {
      for (int j = 0; j < v.topk; ++j) {
        int64_t id = 0;
        const RouteCheck check = check_route(v, s, t, j, &id);
        if (check == RouteCheck::kOutOfRange || check == RouteCheck::kDuplicate) {
          const int64_t key = error_key(s, t, j);
          if (key < first.key) first = RouteError{key, id, check};
          continue;
        }
        if (check != RouteCheck::kOk) continue;
        const int32_t e = local_expert_of(id, d);
        if (e >= 0) buckets[static_cast<size_t>(e)].push_back(encode_row(s, t, j));
      }
    }
  }
  // Lay segments end to end, each padded to block_m.
  const int64_t capacity_rows = max_rows(d);
  const int64_t capacity_blocks = max_blocks(d);
  int64_t offset = 0;
  for (int64_t e = 0; e < num_local; ++e) {
    const auto& b = buckets[static_cast<size_t>(e)];
    const int64_t count = static_cast<int64_t>(b.size());
    const int64_t padded = padded_rows(count, d.block_m);
    out.expert_count[e] = static_cast<int32_t>(count);
    out.expert_offset[e] = static_cast<int32_t>(offset);
    std::copy(b.begin(), b.end(), out.rows + offset);
    std::fill(out.rows + offset + count, out.rows + offset + padded, kPadRow);
    for (int64_t blk = offset / d.block_m; blk < (offset + padded) / d.block_m; ++blk)
      out.block_expert[blk] = static_cast<int32_t>(e);
    offset += padded;
  }
  out.expert_offset[num_local] = static_cast<int32_t>(offset);
  std::fill(out.rows + offset, out.rows + capacity_rows, kPadRow);
  std::fill(out.block_expert + offset / d.block_m, out.block_expert + capacity_blocks, -1);
  if (error) *error = first;
}

}  // namespace mok::plan
