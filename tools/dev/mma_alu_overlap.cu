// Does one warpgroup's fp32 ALU work slow the other warpgroup's fp8 wgmma on the same SM?
// (session 28: the fp8 wgrad kind's promotion, an FMUL and an FFMA an element, did not overlap
// its MMAs in any schedule tried).  Warpgroup 0 issues m64n128k32 e4m3 parts (four MMAs, commit,
// wait) `iters` times and reports cycles a part (or, with mma = 0, spins as long without
// MMAs); the operands are random e4m3 (the tensor cores run zeros faster); warpgroup 1 meanwhile:
//   mode 0 nothing, 1 the same MMA parts, 2 FFMA over 64 registers, 3 FMUL + FFMA (the wgrad
//   promotion's arithmetic), 4 LDS.64 + FMUL + FFMA (its shape), 5 IADD (the integer pipe),
//   6 IADD3 + FFMA (the promotion with power-of-two scales, their product an exponent sum),
//   7 VIADD.16 + FFMA (the same sum as a halfword add)
// and reports its ALU instructions a cycle.  Build and run (sm_90a):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc tools/dev/mma_alu_overlap.cu -o /tmp/mao -lcuda
//   /tmp/mao
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda/ptx/ptx.cuh"
#include "cuda/ptx/wgmma.cuh"

using namespace mok;

__device__ __forceinline__ float2 ld_shared_v2(const float* p) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(ptx::smem_u32(p)) : "memory");
  return v;
}

__global__ void __launch_bounds__(256, 1) overlap_kernel(int mode, int mma, int iters, long long* cycles, float* sink,
                                                        const uint4* fill) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  __shared__ volatile int done;
  __shared__ long long t_wg0;
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) done = 0;
  for (int i = threadIdx.x; i < 65536 / 16; i += blockDim.x) reinterpret_cast<uint4*>(smem)[i] = fill[i];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) reinterpret_cast<float*>(smem + 65536)[i] = 1.0f + i * 1e-3f;
  __syncthreads();
  const uint64_t da = ptx::desc_kmajor_sw128(smem), db = ptx::desc_kmajor_sw128(smem + 16384);
  float part[64];
  for (int i = 0; i < 64; ++i) part[i] = 0.0f;
  if (wg == 0 || mode == 1) {
    const long long t0 = clock64();
    if (!mma && wg == 0) {
      while (clock64() - t0 < 250ll * iters) {
      }
    }
    for (int it = 0; it < (mma || wg == 1 ? iters : 0); ++it) {
      ptx::wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) ptx::mma_e4m3<128>(part, da + 2 * k, db + 2 * k, k != 0);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
      ptx::fence_regs(part);
    }
    const long long t1 = clock64();
    if (wg == 0) {
      if (threadIdx.x == 0) {
        done = 1;
        t_wg0 = t1 - t0;
      }
    }
    float s = 0.0f;
    for (int i = 0; i < 64; ++i) s += part[i];
    if (s == 1.2345f) sink[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x == 0) cycles[blockIdx.x * 2] = t_wg0;
    return;
  }
  if (mode == 0) {
    __syncthreads();
    return;
  }
  // Warpgroup 1: ALU work until warpgroup 0 is done; ops counted per thread
  float acc[64];
  for (int i = 0; i < 64; ++i) {
    acc[i] = 1.0f + threadIdx.x * 1e-3f + i;
    part[i] = 0.5f + i * 1e-3f;
  }
  const float* sb = reinterpret_cast<const float*>(smem + 65536) + (threadIdx.x % 4) * 2;
  long long ops = 0;
  int ia[64];
  for (int i = 0; i < 64; ++i) ia[i] = 0x3F800000 + ((i + threadIdx.x) & 7);
  const long long t0 = clock64();
  while (!done) {
#pragma unroll 1
    for (int r = 0; r < 8; ++r) {
      if (mode == 2) {
#pragma unroll
        for (int j = 0; j < 64; ++j) acc[j] = fmaf(part[j], 1.0001f, acc[j]);
        ops += 64;
      } else if (mode == 3) {
#pragma unroll
        for (int j = 0; j < 64; ++j) acc[j] = fmaf(part[j], acc[(j + 1) & 63] * 0.999f, acc[j]);
        ops += 128;
      } else if (mode == 4) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const float2 v = ld_shared_v2(sb + 8 * j);
          const float sa0 = part[j], sa1 = part[j + 16];
          acc[4 * j + 0] = fmaf(part[4 * j + 0], sa0 * v.x, acc[4 * j + 0]);
          acc[4 * j + 1] = fmaf(part[4 * j + 1], sa0 * v.y, acc[4 * j + 1]);
          acc[4 * j + 2] = fmaf(part[4 * j + 2], sa1 * v.x, acc[4 * j + 2]);
          acc[4 * j + 3] = fmaf(part[4 * j + 3], sa1 * v.y, acc[4 * j + 3]);
        }
        ops += 144;
      } else if (mode == 5) {
#pragma unroll
        for (int j = 0; j < 64; ++j) ia[j] += ia[(j + 3) & 63];
        ops += 64;
      } else if (mode == 7) {
#pragma unroll
        for (int j = 0; j < 64; ++j) {
          const unsigned sbits = __vadd2(static_cast<unsigned>(ia[j]), static_cast<unsigned>(ia[(j + 1) & 63]));
          acc[j] = fmaf(part[j], __uint_as_float(sbits), acc[j]);
          ia[j] ^= j << 16;
        }
        ops += 192;
      } else {
#pragma unroll
        for (int j = 0; j < 64; ++j) {
          const int sbits = ia[j] + ia[(j + 1) & 63] - 0x3F800000;
          acc[j] = fmaf(part[j], __int_as_float(sbits), acc[j]);
          ia[j] ^= j;
        }
        ops += 192;
      }
    }
  }
  const long long t1 = clock64();
  float s = 0.0f;
  for (int i = 0; i < 64; ++i) s += acc[i] + static_cast<float>(ia[i]);
  if (s == 1.2345f) sink[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 128) cycles[blockIdx.x * 2 + 1] = static_cast<long long>(1000.0 * ops / (t1 - t0));  // ops/kcycle a thread
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int smem = 80 * 1024 + 1024, iters = 4000;
  cudaFuncSetAttribute(overlap_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  long long* cycles;
  float* sink;
  uint4* fill;
  cudaMalloc(&cycles, sizeof(long long) * 2 * sms);
  cudaMalloc(&sink, 4096);
  cudaMalloc(&fill, 65536);
  {  // random e4m3 of moderate size: sign, exponent 4..10 of 15, any mantissa (no NaN)
    std::vector<uint8_t> h(65536);
    uint32_t x = 12345;
    for (auto& b : h) {
      x = x * 1664525u + 1013904223u;
      b = static_cast<uint8_t>(((x >> 24) & 0x80) | ((4 + (x >> 8) % 7) << 3) | ((x >> 16) & 7));
    }
    cudaMemcpy(fill, h.data(), 65536, cudaMemcpyHostToDevice);
  }
  const char* names[] = {"idle", "MMA parts", "FFMA", "FMUL+FFMA", "LDS.64+FMUL+FFMA", "IADD", "IADD3+FFMA+LOP", "VIADD.16+FFMA+LOP"};
  for (int rep = 0; rep < 4; ++rep) {
    const int mma = rep % 2 == 0;
    for (int mode = 0; mode < 8; ++mode) {
      if (!mma && mode == 1) continue;
      cudaMemset(cycles, 0, sizeof(long long) * 2 * sms);
      overlap_kernel<<<sms, 256, smem>>>(mode, mma, iters, cycles, sink, fill);
      const cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) {
        std::printf("mode %d: %s\n", mode, cudaGetErrorString(e));
        return 1;
      }
      std::vector<long long> h(2 * sms);
      cudaMemcpy(h.data(), cycles, sizeof(long long) * 2 * sms, cudaMemcpyDeviceToHost);
      double c = 0, o = 0;
      for (int b = 0; b < sms; ++b) {
        c += h[2 * b];
        o += h[2 * b + 1];
      }
      // A part is m64n128k128 e4m3: 2.10 MFLOP, 256 cycles at 8192 dense fp8 FLOP a cycle an SM
      std::printf("rep %d  WG0 %-5s WG1 %-18s  WG0: %6.1f cycles a part (256 at 8192 FLOP a cycle)   WG1: %6.1f ALU ops a kcycle a thread\n",
                  rep, mma ? "MMA" : "spin", names[mode], c / sms / iters, o / sms);
    }
  }
  return 0;
}
