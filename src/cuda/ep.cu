// EP >= 2, the start of a call: the routing exchange and the start barrier.
//
//   1. x of this call into this rank's region (peers pull from it), stream-ordered copy
//      (fp8_block's forward: quantised per token into it instead);
//   2. ep_exchange_kernel: this rank's T and topk_ids (as int64) into routing[rank] and
//      tokens[rank] of every region of the group (unicast stores, no multicast);
//   3. ep_start_kernel: bumps the call's sequence number q, publishes q in every region's
//      flags_start[rank], waits until this region's flags_start[s] >= q for every s.
// The plan build then reads the routing of all P ranks from this rank's own region.
//
// Why the flags are enough (no slot is reused too early): a rank starts call q+1 only after
// its own call q finished, whose end barrier saw every peer's last push of call q; a peer
// pushes only rows it pulled, and pulls after its start barrier of call q.  So when a rank
// overwrites its x / routing for q+1, no peer still reads those of q; a peer's pushes of q+1
// come after its start barrier of q+1, which needs this rank's flag q+1 (stream order puts
// this rank's combine of q before it).
#include <cuda_runtime.h>

#include "cuda/cuda_check.hpp"
#include "cuda/comm/ep.cuh"
#include "cuda/ep.hpp"
#include "cuda/forward.hpp"
#include "cuda/gemm/launch.hpp"
#include "runtime/errors.hpp"

namespace mok::cuda {
namespace {

__global__ void ep_exchange_kernel(ep::Group g, const void* ids, int ids_are_int64, int64_t num_tokens, int topk,
                                   int64_t* timeout_record) {
  // First, every peer's region must have this rank's byte map: a peer created with another
  // configuration would be written at wrong offsets.  Compared by every block before it
  // writes; block 0 records the first mismatch, and the call stops at the start kernel.
  __shared__ int mismatch;
  if (threadIdx.x == 0) {
    mismatch = -1;
    for (int s = 0; s < g.size && mismatch < 0; ++s) {
      const uint64_t fp = *reinterpret_cast<const volatile uint64_t*>(ep::region(g, s) + g.layout.header);
      if (fp != g.fingerprint) {
        mismatch = s;
        if (blockIdx.x == 0 && timeout_record &&
            atomicCAS(reinterpret_cast<unsigned long long*>(timeout_record), 0ull, 1ull) == 0ull) {
          timeout_record[1] = static_cast<int64_t>(gemm::WaitSite::kConfigMismatch);
          timeout_record[2] = 0;
          timeout_record[3] = s;
          timeout_record[4] = static_cast<int64_t>(g.fingerprint);
          timeout_record[5] = static_cast<int64_t>(fp);
          __threadfence();
        }
      }
    }
  }
  __syncthreads();
  if (mismatch >= 0) return;
  const int64_t n = num_tokens * topk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t id = ids_are_int64 ? static_cast<const int64_t*>(ids)[i]
                                     : static_cast<int64_t>(static_cast<const int32_t*>(ids)[i]);
    for (int s = 0; s < g.size; ++s)
      reinterpret_cast<int64_t*>(ep::region(g, s) + g.layout.routing + g.rank * g.layout.routing_rank_stride)[i] = id;
  }
  if (blockIdx.x == 0 && threadIdx.x < g.size)
    reinterpret_cast<int64_t*>(ep::region(g, threadIdx.x) + g.layout.tokens)[g.rank] = num_tokens;
  // Kernel boundary then the start kernel's system-scope fence and release publish these.
  __threadfence_system();
}

__global__ void ep_start_kernel(ep::Group g, int64_t* seq_word, int64_t* timeout_record, uint64_t timeout_ns) {
  __shared__ int64_t seq;
  if (threadIdx.x == 0) {
    seq = *seq_word + 1;
    *seq_word = seq;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  // A configuration mismatch (ep_exchange_kernel) stops the call here: nothing is published.
  if (*reinterpret_cast<volatile int64_t*>(timeout_record) != 0) return;
  const gemm::WaitContext wait{ptx::globaltimer_ns() + timeout_ns, timeout_record};
  ep::publish<false>(g, seq);
  ep::wait_group<false>(g, seq, wait);
}

}  // namespace

ep::Group ep_group(const DeviceWorkspace& ws) {
  ep::Group g;
  g.regions = ws.regions_dev;
  g.layout = ws.sym;
  g.rank = ws.ep_rank;
  g.size = ws.ep_size;
  g.seq = ws.ep_seq;
  g.fingerprint = ws.fingerprint;
  return g;
}

uint64_t ep_fingerprint(const mokConfig_t& c) {
  const int64_t fields[] = {4 /* byte-map version */, c.ep_size, c.max_tokens, c.topk, c.hidden, c.intermediate,
                            c.shared_intermediate, c.num_experts, c.block_m, c.precision};
  return sym_fingerprint(fields, static_cast<int>(sizeof(fields) / sizeof(fields[0])));
}

void ep_start(DeviceWorkspace& ws, const mokConfig_t& c, const ref::RankInputs& in, int64_t* timeout_record,
              cudaStream_t stream, const void* dy) {
  const int64_t T = in.num_tokens, H = c.hidden, k = c.topk;
  const ep::Group g = ep_group(ws);
  uint8_t* own = ws.regions[ws.ep_rank];
  if (T > 0 && c.precision == mokPrecisionFP8Block && dy == nullptr) {
    // fp8_block's forward: x quantised per token into the region (e4m3 rows, their scales at
    // x8_scales), which the peers' gathers pull as they are: half the bf16 bytes
    gemm::launch_quantize_rows(in.x, own + ws.sym.x, reinterpret_cast<float*>(own + ws.sym.x8_scales), T, H,
                               c.fp8_pow2_scales != 0, stream, fp8_t4(c.max_tokens));
  } else if (T > 0) {
    MOK_CUDA_CHECK(cudaMemcpyAsync(own + ws.sym.x, in.x, static_cast<size_t>(T * H * 2), cudaMemcpyDeviceToDevice,
                                   stream));
  }
  if (dy != nullptr && T > 0) {
    // The backward: dy and the weights for the experts' owners, d topk_weights zeroed (masked
    // routes get no push) -- all before the start barrier that lets the peers in
    MOK_CUDA_CHECK(cudaMemcpyAsync(own + ws.sym.dy, dy, static_cast<size_t>(T * H * 2), cudaMemcpyDeviceToDevice,
                                   stream));
    MOK_CUDA_CHECK(cudaMemcpyAsync(own + ws.sym.weights, in.topk_weights, static_cast<size_t>(T * k * 4),
                                   cudaMemcpyDeviceToDevice, stream));
    MOK_CUDA_CHECK(cudaMemsetAsync(own + ws.sym.dtw, 0, static_cast<size_t>(T * k * 4), stream));
  }
  const int64_t n = T * k;
  const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(plan::ceil_div(n, 256), 64)));
  ep_exchange_kernel<<<blocks, 256, 0, stream>>>(g, in.topk_ids, in.ids_are_int64, T, static_cast<int>(k),
                                                 timeout_record);
  MOK_CUDA_CHECK(cudaGetLastError());
  ep_start_kernel<<<1, 32, 0, stream>>>(g, ws.ep_seq, timeout_record, static_cast<uint64_t>(c.timeout_s * 1e9));
  MOK_CUDA_CHECK(cudaGetLastError());
}

namespace {
// The end barrier of a call issued as separate launches (the backward): this rank's pushes
// (earlier launches on the stream) are published, then every rank's are waited for.
__global__ void ep_end_kernel(ep::Group g, int64_t* timeout_record, uint64_t timeout_ns) {
  if (threadIdx.x != 0) return;
  if (*reinterpret_cast<volatile int64_t*>(timeout_record) != 0) return;  // an earlier wait expired
  const gemm::WaitContext wait{ptx::globaltimer_ns() + timeout_ns, timeout_record};
  const int64_t seq = *g.seq;
  __threadfence_system();
  ep::publish<true>(g, seq);
  ep::wait_group<true>(g, seq, wait);
}
}  // namespace

void ep_end(DeviceWorkspace& ws, const mokConfig_t& c, int64_t* timeout_record, cudaStream_t stream) {
  ep_end_kernel<<<1, 32, 0, stream>>>(ep_group(ws), timeout_record, static_cast<uint64_t>(c.timeout_s * 1e9));
  MOK_CUDA_CHECK(cudaGetLastError());
}

void ep_load_kernels() {
  cudaFuncAttributes a;
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, ep_exchange_kernel));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, ep_start_kernel));
  MOK_CUDA_CHECK(cudaFuncGetAttributes(&a, ep_end_kernel));
}

plan::RoutingView ep_routing(const DeviceWorkspace& ws, const mokConfig_t& c) {
  plan::RoutingView v;
  v.num_ranks = ws.ep_size;
  v.topk = static_cast<int32_t>(c.topk);
  v.num_experts = c.num_experts;
  v.ids_are_int64 = 1;
  uint8_t* own = ws.regions[ws.ep_rank];
  for (int s = 0; s < ws.ep_size; ++s) {
    v.ids[s] = own + ws.sym.routing + s * ws.sym.routing_rank_stride;
    v.num_tokens[s] = c.max_tokens;
  }
  v.tokens_dev = reinterpret_cast<const int64_t*>(own + ws.sym.tokens);
  return v;
}

}  // namespace mok::cuda
