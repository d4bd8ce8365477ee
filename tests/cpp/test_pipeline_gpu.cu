// The stage ring (gemm::Pipeline) alone: a producer and consumer warps that pass numbered
// values through kStages slots and only have to finish with every value seen once, in order.
// The two sides run at uneven paces (nanosleep on some steps), so the ring runs full and runs
// dry and its phases flip thousands of times; a side that stops early makes the other report
// a timeout at its deadline instead of hanging.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/gemm/pipeline.cuh"
#include "gpu_util.hpp"

namespace mok::test {
namespace {

constexpr int kConsumerWarps = 3;

// result[w]: the sum of what consumer warp w read; result[kConsumerWarps + w]: values out of
// order or wrong.  The producer writes `produce` values, the consumers read `consume` each.
template <int kStages>
__global__ void pipeline_kernel(int produce, int consume, int64_t* result, int64_t* timeout_record,
                                uint64_t timeout_ns) {
  __shared__ gemm::Pipeline<kStages> pipe;
  __shared__ int32_t slot[kStages];  // (kStages): the data of each slot
  const gemm::WaitContext wait{ptx::globaltimer_ns() + timeout_ns, timeout_record};
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  if (threadIdx.x == 0) {
    pipe.init(1, kConsumerWarps);
    ptx::fence_mbar_init();
  }
  __syncthreads();
  typename gemm::Pipeline<kStages>::State state;
  if (warp == 0) {
    // Producer: one thread fills each slot, then arrives on its full barrier
    if (lane != 0) return;
    for (int i = 0; i < produce; ++i) {
      if (!pipe.producer_acquire(state, wait)) return;
      slot[state.index] = 7 * i + 1;
      ptx::mbar_arrive(pipe.full_barrier(state));
      state.advance();
      if (i % 7 == 0) __nanosleep(200);
    }
    return;
  }
  // Consumer warps: every lane waits (warp-uniform), lane 0 releases
  const int w = warp - 1;
  int64_t sum = 0, wrong = 0;
  for (int i = 0; i < consume; ++i) {
    if (!pipe.consumer_wait(state, wait)) break;
    const int32_t v = slot[state.index];
    sum += v;
    wrong += v != 7 * i + 1;
    __syncwarp();
    if (lane == 0) pipe.consumer_release(state.index);
    state.advance();
    if (w == 1 && i % 5 == 0) __nanosleep(300);
  }
  if (lane == 0) {
    result[w] = sum;
    result[kConsumerWarps + w] = wrong;
  }
}

struct RingRun {
  std::vector<int64_t> result, timeout;
};

template <int kStages>
RingRun run(int produce, int consume, double timeout_s) {
  int64_t* d_result = nullptr;
  int64_t* d_timeout = nullptr;
  EXPECT_EQ(cudaMalloc(&d_result, 2 * kConsumerWarps * sizeof(int64_t)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_timeout, 8 * sizeof(int64_t)), cudaSuccess);
  EXPECT_EQ(cudaMemset(d_result, 0xFF, 2 * kConsumerWarps * sizeof(int64_t)), cudaSuccess);
  EXPECT_EQ(cudaMemset(d_timeout, 0, 8 * sizeof(int64_t)), cudaSuccess);
  pipeline_kernel<kStages><<<1, 32 * (1 + kConsumerWarps)>>>(produce, consume, d_result, d_timeout,
                                                              static_cast<uint64_t>(timeout_s * 1e9));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  RingRun r{std::vector<int64_t>(2 * kConsumerWarps), std::vector<int64_t>(8)};
  EXPECT_EQ(cudaMemcpy(r.result.data(), d_result, r.result.size() * sizeof(int64_t), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(cudaMemcpy(r.timeout.data(), d_timeout, r.timeout.size() * sizeof(int64_t), cudaMemcpyDeviceToHost),
            cudaSuccess);
  cudaFree(d_result);
  cudaFree(d_timeout);
  return r;
}

template <int kStages>
void check_finishes(int n) {
  SCOPED_TRACE("stages=" + std::to_string(kStages) + " n=" + std::to_string(n));
  const RingRun r = run<kStages>(n, n, 20.0);
  EXPECT_EQ(r.timeout[0], 0) << "a wait timed out (site " << r.timeout[1] << ")";
  const int64_t want = 7 * int64_t{n} * (n - 1) / 2 + n;
  for (int w = 0; w < kConsumerWarps; ++w) {
    EXPECT_EQ(r.result[static_cast<size_t>(w)], want) << "consumer " << w;
    EXPECT_EQ(r.result[static_cast<size_t>(kConsumerWarps + w)], 0) << "consumer " << w << " read values out of order";
  }
}

TEST(PipelineGpu, DummyProducerAndConsumersFinish) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  check_finishes<1>(1000);
  check_finishes<2>(5000);
  check_finishes<4>(20000);
  check_finishes<6>(20001);
}

// The producer stops after 10 values: the consumers' 11th wait ends at the deadline with a
// timeout record naming the consumer's wait, and the kernel returns.
TEST(PipelineGpu, AProducerThatStopsMakesConsumersTimeOutNotHang) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const RingRun r = run<4>(10, 1000, 0.2);
  EXPECT_EQ(r.timeout[0], 1) << "no timeout recorded";
  EXPECT_EQ(r.timeout[1], static_cast<int64_t>(WaitSite::kStageFull));
  for (int w = 0; w < kConsumerWarps; ++w) EXPECT_EQ(r.result[static_cast<size_t>(w)], 7 * 45 + 10) << "consumer " << w;
}

}  // namespace
}  // namespace mok::test
