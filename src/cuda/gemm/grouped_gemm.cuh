// The grouped-GEMM engine: persistent, warp-specialised, TMA + wgmma (sm_90a).
//
//   C[rows of expert e, N] = A[rows, K] · B_e[N, K]ᵀ      (both operands K-major)
//
// Roles (one warpgroup each, 384 threads):
//   kProducer   one elected thread issues TMA loads into a kStages-deep ring of stages
//   kConsumer0  rows [0, 64) of the tile: wgmma m64n256k16, fp32 accumulators in registers
//   kConsumer1  rows [64, 128)
// Barriers (mbarrier, one pair per stage):
//   tile_full[s]   producer -> consumers: stage s holds A and B (TMA transaction bytes)
//   tile_empty[s]  consumers -> producer: both warpgroups finished reading stage s
//
// B arrives as two 128-row halves per stage, each from its own tensor map.  For gate/up the
// halves are w_gate and w_up rows of the same 128 intermediate channels, so one 256-wide
// accumulator holds matching gate (cols 0..127) and up (cols 128..255) values in the same
// thread and the SwiGLU runs in the epilogue with no weight re-layout.  For down both
// halves come from w_down (rows n*256 and n*256+128).
//
// Tiles (m_block, n_block) are walked m-major; block_expert[m] gives the expert, -1 past
// the last row block.  Each block takes tiles blockIdx.x, +gridDim.x, ... (deterministic).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "common/defs.hpp"
#include "cuda/gemm/config.hpp"
#include "cuda/gemm/pipeline.cuh"
#include "cuda/ptx/wgmma.cuh"

namespace mok::gemm {

enum class Role : int32_t { kProducer = 0, kConsumer0 = 1, kConsumer1 = 2 };

struct SharedStorage {
  alignas(1024) __nv_bfloat16 a[TileConfig::kStages][TileConfig::kBlockM * TileConfig::kBlockK];  // (BLOCK_M, BLOCK_K, kStages)
  alignas(1024) __nv_bfloat16 b[TileConfig::kStages][TileConfig::kBlockN * TileConfig::kBlockK];  // (BLOCK_N, BLOCK_K, kStages)
  uint64_t tile_full[TileConfig::kStages];
  uint64_t tile_empty[TileConfig::kStages];
};
inline constexpr size_t kGemmSmemBytes = sizeof(SharedStorage) + 1024;  // + alignment slack
static_assert(kGemmSmemBytes <= 227 * 1024, "shared storage exceeds the 227 KB a block can have");


struct GroupedGemmParams {
  int32_t num_n_blocks;      // output tiles along N
  int32_t num_k_blocks;      // K / BLOCK_K
  int32_t max_m_blocks;      // length of block_expert
  int32_t b_rows_per_expert; // rows of one expert in the B maps
  int32_t b_n_step;          // B rows per n_block (128 gate/up, 256 down)
  int32_t b_half_offset;     // row offset of the second half in its map (0 gate/up, 128 down)
  const int32_t* block_expert;
  Epilogue epilogue;
  __nv_bfloat16* out;
  int64_t out_ld;            // elements between output rows
  int64_t out_rows;          // rows of `out` that may be written (kStore/kSwiGLU)
  const uint32_t* plan_rows; // kScatter
  int32_t topk;              // kScatter
  uint64_t timeout_ns;       // deadline of every wait, from kernel entry
  int64_t* timeout_record;   // device [5], see WaitContext
};

namespace detail {

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

// Writes one consumer's 64 x 256 accumulator tile.
__device__ __forceinline__ void epilogue(const GroupedGemmParams& p, const float (&acc)[TileConfig::kAccRegs],
                                         int m_block, int n_block, int consumer) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int row_in_tile = consumer * 64 + warp * 16 + lane / 4;
  const int col_in_n8 = (lane % 4) * 2;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = static_cast<int64_t>(m_block) * TileConfig::kBlockM + row_in_tile + half * 8;
    if (p.epilogue == Epilogue::kSwiGLU) {
      if (row >= p.out_rows) continue;
      uint32_t* dst = reinterpret_cast<uint32_t*>(p.out + row * p.out_ld + n_block * 128 + col_in_n8);
#pragma unroll
      for (int n8 = 0; n8 < 16; ++n8) {
        const float g0 = acc[n8 * 4 + half * 2], g1 = acc[n8 * 4 + half * 2 + 1];
        const float u0 = acc[(n8 + 16) * 4 + half * 2], u1 = acc[(n8 + 16) * 4 + half * 2 + 1];
        dst[n8 * 4] = pack_bf16x2(silu(g0) * u0, silu(g1) * u1);
      }
    } else {
      int64_t out_row = row;
      if (p.epilogue == Epilogue::kScatter) {
        const uint32_t rec = p.plan_rows[row];
        if (row_is_pad(rec)) continue;
        out_row = row_token(rec) * p.topk + row_slot(rec);
      } else if (row >= p.out_rows) {
        continue;
      }
      uint32_t* dst = reinterpret_cast<uint32_t*>(p.out + out_row * p.out_ld + n_block * TileConfig::kBlockN + col_in_n8);
#pragma unroll
      for (int n8 = 0; n8 < 32; ++n8) dst[n8 * 4] = pack_bf16x2(acc[n8 * 4 + half * 2], acc[n8 * 4 + half * 2 + 1]);
    }
  }
}

}  // namespace detail

__global__ void __launch_bounds__(TileConfig::kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b0,
                        const __grid_constant__ CUtensorMap map_b1, const GroupedGemmParams p) {
  using C = TileConfig;
  extern __shared__ uint8_t smem_raw[];
  auto& s = *reinterpret_cast<SharedStorage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const Role role = static_cast<Role>(threadIdx.x / 128);
  const WaitContext wait{ptx::globaltimer_ns() + p.timeout_ns, p.timeout_record};
  const int num_tiles = p.max_m_blocks * p.num_n_blocks;

  // Initialise barriers
  if (threadIdx.x == 0) {
    for (int i = 0; i < C::kStages; ++i) {
      ptx::mbar_init(&s.tile_full[i], 1);
      ptx::mbar_init(&s.tile_empty[i], C::kConsumers);
    }
    ptx::fence_mbar_init();
    ptx::prefetch_tensormap(&map_a);
    ptx::prefetch_tensormap(&map_b0);
    ptx::prefetch_tensormap(&map_b1);
  }
  __syncthreads();

  if (role == Role::kProducer) {
    ptx::setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x != 0) return;
    PipelineState<C::kStages> stage;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const int m_block = tile / p.num_n_blocks, n_block = tile % p.num_n_blocks;
      const int expert = p.block_expert[m_block];
      if (expert < 0) break;
      const int b_row = expert * p.b_rows_per_expert + n_block * p.b_n_step;
      for (int kb = 0; kb < p.num_k_blocks; ++kb) {
        // Wait for empty slot
        if (!wait_barrier(&s.tile_empty[stage.index], stage.phase ^ 1u, wait, WaitSite::kProducerEmpty, stage.index))
          return;
        // Issue TMA for activations and both weight halves
        uint64_t* full = &s.tile_full[stage.index];
        ptx::mbar_arrive_expect_tx(full, C::kStageBytes);
        ptx::tma_load_2d(s.a[stage.index], &map_a, full, kb * C::kBlockK, m_block * C::kBlockM);
        ptx::tma_load_2d(s.b[stage.index], &map_b0, full, kb * C::kBlockK, b_row);
        ptx::tma_load_2d(s.b[stage.index] + (C::kBlockN / 2) * C::kBlockK, &map_b1, full, kb * C::kBlockK,
                         b_row + p.b_half_offset);
        stage.advance();
      }
    }
    return;
  }

  // Consumers
  ptx::setmaxnreg_inc<C::kConsumerRegs>();
  const int consumer = static_cast<int>(role) - 1;
  const bool leader = threadIdx.x % 128 == 0;
  PipelineState<C::kStages> stage;
  float acc[C::kAccRegs];
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int m_block = tile / p.num_n_blocks, n_block = tile % p.num_n_blocks;
    if (p.block_expert[m_block] < 0) break;
    int prev_index = 0;
    for (int kb = 0; kb < p.num_k_blocks; ++kb) {
      // Wait for the stage, then issue four k16 MMAs on it
      if (!wait_barrier(&s.tile_full[stage.index], stage.phase, wait, WaitSite::kConsumerFull, stage.index)) return;
      const uint64_t desc_a = ptx::desc_kmajor_sw128(s.a[stage.index] + consumer * 64 * C::kBlockK);
      const uint64_t desc_b = ptx::desc_kmajor_sw128(s.b[stage.index]);
      ptx::wgmma_fence();
#pragma unroll
      for (int k = 0; k < C::kBlockK / 16; ++k)
        ptx::mma_m64n256k16_bf16(acc, desc_a + 2 * k, desc_b + 2 * k, (kb | k) != 0);
      ptx::wgmma_commit();
      // NOTES: no register fence here: touching acc while a group is in flight makes ptxas
      // inject a wait (C7517) and serialise the MMAs.
      // Release the previous stage once its MMAs retired (one group stays in flight)
      if (kb > 0) {
        ptx::wgmma_wait<1>();
        if (leader) ptx::mbar_arrive(&s.tile_empty[prev_index]);
      }
      prev_index = stage.index;
      stage.advance();
    }
    ptx::wgmma_wait<0>();
    ptx::fence_regs(acc);
    if (leader) ptx::mbar_arrive(&s.tile_empty[prev_index]);
    // Epilogue straight from registers
    detail::epilogue(p, acc, m_block, n_block, consumer);
  }
}

}  // namespace mok::gemm
