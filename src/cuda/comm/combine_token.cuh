// The comm role's last step in the fused forward: the fixed-order combine of one token by one
// warp (routes in ascending j, shared expert last, one rounding), after the end barrier.
#pragma once

#include "cuda/comm/combine.cuh"
#include "cuda/fused/forward_params.cuh"

namespace mok::cuda::fused {

// ---- fixed-order combine of one token by one warp -------------------------------------------
__device__ __forceinline__ void combine_token(const ForwardParams& p, int64_t t) {
  const int64_t row_vecs = p.hidden / 8;
  const int k = p.topk;
  const uint4* shared_out = reinterpret_cast<const uint4*>(p.shared_out);
  combine_token_warp(reinterpret_cast<const uint4*>(p.slots) + t * k * row_vecs, row_vecs, k, p.topk_weights + t * k,
                     p.shared_inter > 0 ? shared_out + t * row_vecs : nullptr,
                     reinterpret_cast<uint4*>(p.y) + t * row_vecs, [&](int j) {
                       int64_t id;
                       return plan::check_route(p.routing, p.group.rank, t, j, &id) == RouteCheck::kOk;
                     });
}

}  // namespace mok::cuda::fused
