// Device build of the routing plan, bit for bit the plan of build_plan_host.
//
// Tokens are cut into chunks of kChunkTokens per source rank, so chunk c covers rank
// c / chunks_per_rank, tokens [(c % chunks_per_rank) * kChunkTokens, ...).  Walking chunks
// in index order walks tokens in canonical (rank, token) order.  Four launches, all
// stream-ordered and graph-capturable, none reading a count on the host:
//   1. count:   per chunk, a bitmask of the tokens routed to each local expert; popcounts
//               give counts[chunk][e].  Bad routes are masked and the lowest key recorded.
//   2. offsets: per expert, a scan over chunks (chunk bases) and the padded expert offsets.
//   3. scatter: each route's position = expert offset + chunk base + rank within the chunk
//               (popcount of the bitmask below the token).  Positions are computed, never
//               claimed with atomics, so the plan is deterministic.
//   4. fill:    padding rows, block -> expert map, and the error record's id and kind.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/cuda_api.hpp"
#include "cuda/cuda_check.hpp"
#include "runtime/errors.hpp"

namespace mok::cuda {
namespace {

constexpr int kChunkTokens = 256;              // tokens per chunk, one per thread
constexpr int kMaskWords = kChunkTokens / 32;  // 32-bit words of one expert's chunk bitmask
constexpr int kOffsetsThreads = 1024;
constexpr unsigned long long kNoKey = ~0ull;


struct ChunkGeom {
  int64_t chunks_per_rank;
  int64_t num_chunks;
};

// Bitmask of this chunk's tokens per local expert: (E_l, kMaskWords) in shared memory.
// Returns through *s / *token the token this thread owns.
__device__ void build_chunk_masks(const plan::PlanDims& d, const plan::RoutingView& v, ChunkGeom g,
                                  uint32_t* masks, unsigned long long* first_bad, int* s_out,
                                  int64_t* token_out) {
  const int64_t num_local = d.local_experts();
  for (int64_t i = threadIdx.x; i < num_local * kMaskWords; i += blockDim.x) masks[i] = 0;
  __syncthreads();
  const int s = static_cast<int>(blockIdx.x / g.chunks_per_rank);
  const int64_t t = (blockIdx.x % g.chunks_per_rank) * kChunkTokens + threadIdx.x;
  *s_out = s;
  *token_out = t;
  if (t < plan::tokens_of(v, s)) {
    for (int j = 0; j < v.topk; ++j) {
      int64_t id;
      const RouteCheck check = plan::check_route(v, s, t, j, &id);
      if (check == RouteCheck::kOutOfRange || check == RouteCheck::kDuplicate) {
        if (first_bad) atomicMin(first_bad, static_cast<unsigned long long>(error_key(s, t, j)));
        continue;
      }
      if (check != RouteCheck::kOk) continue;
      const int32_t e = plan::local_expert_of(id, d);
      if (e >= 0) atomicOr(&masks[e * kMaskWords + threadIdx.x / 32], 1u << (threadIdx.x % 32));
    }
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kChunkTokens) plan_count_kernel(plan::PlanDims d, plan::RoutingView v,
                                                                  ChunkGeom g, int32_t* counts,
                                                                  unsigned long long* first_bad) {
  extern __shared__ uint32_t masks[];  // (E_l, kMaskWords)
  int s;
  int64_t t;
  build_chunk_masks(d, v, g, masks, first_bad, &s, &t);
  const int64_t num_local = d.local_experts();
  for (int64_t e = threadIdx.x; e < num_local; e += blockDim.x) {
    int32_t n = 0;
    for (int w = 0; w < kMaskWords; ++w) n += __popc(masks[e * kMaskWords + w]);
    counts[blockIdx.x * num_local + e] = n;
  }
}

// One block.  counts[chunk][e] becomes the chunk's base within expert e's segment.
__global__ void __launch_bounds__(kOffsetsThreads) plan_offsets_kernel(plan::PlanDims d, ChunkGeom g,
                                                                       int32_t* counts, plan::PlanView out) {
  const int64_t num_local = d.local_experts();
  for (int64_t e = threadIdx.x; e < num_local; e += blockDim.x) {
    int32_t running = 0;
    for (int64_t c = 0; c < g.num_chunks; ++c) {
      const int32_t n = counts[c * num_local + e];
      counts[c * num_local + e] = running;
      running += n;
    }
    out.expert_count[e] = running;
  }
  __syncthreads();
  // NOTES: E_l is at most a few hundred; a serial scan costs less than a block scan's syncs.
  if (threadIdx.x == 0) {
    int64_t offset = 0;
    for (int64_t e = 0; e < num_local; ++e) {
      out.expert_offset[e] = static_cast<int32_t>(offset);
      offset += plan::padded_rows(out.expert_count[e], d.block_m);
    }
    out.expert_offset[num_local] = static_cast<int32_t>(offset);
  }
}

__global__ void __launch_bounds__(kChunkTokens) plan_scatter_kernel(plan::PlanDims d, plan::RoutingView v,
                                                                    ChunkGeom g, const int32_t* chunk_base,
                                                                    plan::PlanView out) {
  extern __shared__ uint32_t masks[];  // (E_l, kMaskWords)
  int s;
  int64_t t;
  build_chunk_masks(d, v, g, masks, nullptr, &s, &t);
  if (t >= plan::tokens_of(v, s)) return;
  const int64_t num_local = d.local_experts();
  const int word = threadIdx.x / 32;
  const uint32_t below = (1u << (threadIdx.x % 32)) - 1u;
  for (int j = 0; j < v.topk; ++j) {
    int64_t id;
    if (plan::check_route(v, s, t, j, &id) != RouteCheck::kOk) continue;
    const int32_t e = plan::local_expert_of(id, d);
    if (e < 0) continue;
    int32_t rank_in_chunk = __popc(masks[e * kMaskWords + word] & below);
    for (int w = 0; w < word; ++w) rank_in_chunk += __popc(masks[e * kMaskWords + w]);
    const int64_t pos = out.expert_offset[e] + chunk_base[blockIdx.x * num_local + e] + rank_in_chunk;
    out.rows[pos] = encode_row(s, t, j);
  }
}

__device__ int32_t expert_of_row(const plan::PlanView& out, int64_t num_local, int64_t row) {
  // Last expert whose offset is <= row (segments of empty experts have zero length).
  int64_t lo = 0, hi = num_local - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (out.expert_offset[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return static_cast<int32_t>(lo);
}

__global__ void plan_fill_kernel(plan::PlanDims d, plan::RoutingView v, plan::PlanView out,
                                 int64_t* error_record) {
  const int64_t num_local = d.local_experts();
  const int64_t total = out.expert_offset[num_local];
  const int64_t rows_cap = plan::max_rows(d), blocks_cap = plan::max_blocks(d);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < rows_cap; i += stride) {
    if (i >= total) {
      out.rows[i] = kPadRow;
      continue;
    }
    const int32_t e = expert_of_row(out, num_local, i);
    if (i - out.expert_offset[e] >= out.expert_count[e]) out.rows[i] = kPadRow;
  }
  for (int64_t b = first; b < blocks_cap; b += stride)
    out.block_expert[b] = b * d.block_m < total ? expert_of_row(out, num_local, b * d.block_m) : -1;
  // Finish the error record: the key's id and kind (ids are constant for the call).
  if (first == 0 && error_record) {
    const unsigned long long key = static_cast<unsigned long long>(error_record[0]);
    if (key == kNoKey) {
      error_record[0] = kNoError;
      error_record[1] = 0;
      error_record[2] = static_cast<int64_t>(RouteCheck::kOk);
    } else {
      const int64_t k = static_cast<int64_t>(key);
      int64_t id;
      const RouteCheck check = plan::check_route(v, error_key_rank(k), error_key_token(k), error_key_slot(k), &id);
      error_record[1] = id;
      error_record[2] = static_cast<int64_t>(check);
    }
    error_record[3] = 0;
  }
}

}  // namespace

bool built() { return true; }

int sm_count(int device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: leave no error behind for the caller's next check
    return 0;
  }
  return sms;
}

void build_plan(const plan::PlanDims& d, const plan::RoutingView& v, const plan::PlanView& out,
                int64_t* error_record, int device, void* stream_ptr) {
  const DeviceGuard guard(device);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t num_local = d.local_experts();
  ChunkGeom g;
  g.chunks_per_rank = plan::ceil_div(d.max_tokens, kChunkTokens);
  g.num_chunks = g.chunks_per_rank * d.num_ranks;
  const size_t mask_bytes = static_cast<size_t>(num_local) * kMaskWords * sizeof(uint32_t);
  MOK_CHECK_ARG(mask_bytes <= 200 * 1024, "plan build: " << num_local << " local experts need " << mask_bytes
                                                          << " B of shared memory; at most 200 KB");
  if (mask_bytes > 48 * 1024) {
    MOK_CUDA_CHECK(cudaFuncSetAttribute(plan_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(mask_bytes)));
    MOK_CUDA_CHECK(cudaFuncSetAttribute(plan_scatter_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(mask_bytes)));
  }
  // Count scratch, stream-ordered so the build stays capturable.
  int32_t* counts = nullptr;
  const size_t counts_bytes = static_cast<size_t>(std::max<int64_t>(g.num_chunks * num_local, 1)) * sizeof(int32_t);
  MOK_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&counts), counts_bytes, stream));
  if (error_record) MOK_CUDA_CHECK(cudaMemsetAsync(error_record, 0xFF, sizeof(int64_t), stream));
  auto* key = reinterpret_cast<unsigned long long*>(error_record);
  if (g.num_chunks > 0) {
    plan_count_kernel<<<static_cast<unsigned>(g.num_chunks), kChunkTokens, mask_bytes, stream>>>(d, v, g, counts, key);
    MOK_CUDA_CHECK(cudaGetLastError());
  }
  plan_offsets_kernel<<<1, kOffsetsThreads, 0, stream>>>(d, g, counts, out);
  MOK_CUDA_CHECK(cudaGetLastError());
  if (g.num_chunks > 0) {
    plan_scatter_kernel<<<static_cast<unsigned>(g.num_chunks), kChunkTokens, mask_bytes, stream>>>(d, v, g, counts,
                                                                                                   out);
    MOK_CUDA_CHECK(cudaGetLastError());
  }
  const int64_t fill_blocks = std::min<int64_t>(std::max<int64_t>(plan::ceil_div(plan::max_rows(d), 256), 1), 1024);
  plan_fill_kernel<<<static_cast<unsigned>(fill_blocks), 256, 0, stream>>>(d, v, out, error_record);
  MOK_CUDA_CHECK(cudaGetLastError());
  MOK_CUDA_CHECK(cudaFreeAsync(counts, stream));
}

void load_plan_kernels() {
  cudaFuncAttributes a;
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, plan_count_kernel));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, plan_offsets_kernel));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, plan_scatter_kernel));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, plan_fill_kernel));
}

}  // namespace mok::cuda
