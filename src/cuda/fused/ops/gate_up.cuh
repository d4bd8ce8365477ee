// Routed gate/up: ring rows · [w_gate; w_up][e]ᵀ -> SwiGLU -> the block's act rows in the ring.
#pragma once

#include "cuda/fused/ops/op.cuh"

namespace mok::cuda::fused::ops {

struct GateUp : OpBase<TaskKind::kGateUp, CounterArray::kGateUpDone, gemm::Operands::kBNMajor> {
  // Its rows gathered; the act rows it overwrites consumed by the previous occupant's down tiles
  MOK_HD static int waits(int32_t unit, int32_t, const Geometry& g, const TaskCounts& c, Wait* out) {
    out[0] = Wait{CounterArray::kGatherReady, unit, kBlockM};
    const int32_t prev = g.previous_occupant(unit);
    if (prev < 0) return 1;
    out[1] = Wait{CounterArray::kDownDone, prev, c.n_down};
    return 2;
  }
#if defined(__CUDACC__)
  __device__ __forceinline__ static int32_t k_blocks(const ForwardParams& p, const Geometry&, const TaskCounts&,
                                                     const TaskInfo&) {
    return p.hidden / kBlockK;
  }
  template <class Pol, class MapsArg>
  __device__ __forceinline__ static Load load(const MapsArg& maps, const ForwardParams& p, const Geometry& g,
                                                        const TaskCounts& c, const TaskInfo& t) {
    // The gate and up halves: rows of w_gate and w_up, or (transposed) their columns
    const int32_t e_row = p.block_expert[t.block] * p.gate_up_pitch, ch = t.n_block * kHalfN;
    return Load{static_cast<int32_t>(kOpsFor<Pol::kTransposed>), &maps.ring, &maps.w_gate, &maps.w_up,
                g.ring_row(t.block), Pol::kTransposed ? e_row : e_row + ch, Pol::kTransposed ? ch : 0, kHalvesApart,
                k_blocks(p, g, c, t), 0};
  }
  template <class Pol, int kRegs>
  __device__ __forceinline__ static void epilogue(const float (&acc)[kRegs], int consumer, const ForwardParams& p,
                                                  const Geometry& g, const TaskCounts&, const TaskInfo& t) {
    gemm::epilogue_swiglu(acc, consumer, p.act, p.inter, g.ring_row(t.block), int64_t{p.ring_blocks} * kBlockM,
                          int64_t{t.n_block} * kHalfN);
    // Training: the pre-activations too, at the block's plan rows (the backward's h)
    if (p.saved_h)
      gemm::epilogue_gate_up_preact(acc, consumer, p.saved_h, 2 * int64_t{p.inter}, int64_t{t.block} * kBlockM,
                                    int64_t{t.block + 1} * kBlockM, int64_t{t.n_block} * kHalfN);
  }
  // EXPERIMENT (p.gateup_tma, MOK_TMP_GATEUP_TMA=1): act (and h) through two stages of the ring
  // and TMA stores: the producer reserves the stages after the K loop (a plain arrival), each
  // consumer writes its 64 rows of act into its stage's A area (two 64 x 64 boxes) and of h into
  // its B area (four), in the maps' 128-byte swizzle, its leader stores them (act first, then h,
  // two bulk groups), waits for their reads, releases both stages and waits for act's writes
  // (the down tiles read act by TMA after this tile's signal); h completes before the end.
  static constexpr bool kRingEpilogue = true;
  template <class Pol, class Stages, class Stage, class MapsArg>
  __device__ __forceinline__ static bool produce_epilogue(Stages& s, Stage& stage, const MapsArg&,
                                                          const ForwardParams& p, const TaskInfo&,
                                                          const gemm::WaitContext& wait) {
    if (!p.gateup_tma) return true;
    for (int q = 0; q < 2; ++q) {
      if (!s.pipe.producer_acquire(stage, wait)) return false;
      ptx::mbar_arrive(s.pipe.full_barrier(stage));
      stage.advance();
    }
    return true;
  }
  template <class Pol, int kRegs, class Ring>
  __device__ __forceinline__ static bool epilogue_ring(const float (&acc)[kRegs], int consumer, const ForwardParams& p,
                                                       const Geometry& g, const TaskCounts& c, const TaskInfo& t,
                                                       const Ring& r) {
    if (!p.gateup_tma) {
      epilogue<Pol>(acc, consumer, p, g, c, t);
      return true;
    }
    constexpr int kHalfBlocks = kRegs / 8;  // n8 blocks of the gate half: 16
    auto second = r.stage;
    second.advance();
    if (!r.s.pipe.consumer_wait(r.stage, r.wait) || !r.s.pipe.consumer_wait(second, r.wait)) return false;
    const int index = consumer == 0 ? r.stage.index : second.index;
    uint8_t* const act_box = reinterpret_cast<uint8_t*>(r.s.a[index]);
    uint8_t* const h_box = reinterpret_cast<uint8_t*>(r.s.b[index]);
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4, q = lane % 4;
    auto put = [&](uint8_t* boxes, int n8, int rr, uint32_t v) {
      const int box = n8 / 8, chunk = n8 % 8;
      *reinterpret_cast<uint32_t*>(boxes + box * 8192 + rr * 128 + ((chunk ^ (rr % 8)) * 16) + q * 4) = v;
    };
    const bool save = p.saved_h != nullptr;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int rr = warp * 16 + lane / 4 + half * 8;
#pragma unroll
      for (int n8 = 0; n8 < kHalfBlocks; ++n8) {
        const float g0 = acc[n8 * 4 + half * 2], g1 = acc[n8 * 4 + half * 2 + 1];
        const float u0 = acc[(n8 + kHalfBlocks) * 4 + half * 2], u1 = acc[(n8 + kHalfBlocks) * 4 + half * 2 + 1];
        put(act_box, n8, rr, gemm::pack_bf16x2(gemm::silu(g0) * u0, gemm::silu(g1) * u1));
        if (save) {
          put(h_box, n8, rr, gemm::pack_bf16x2(g0, g1));
          put(h_box, n8 + kHalfBlocks, rr, gemm::pack_bf16x2(u0, u1));
        }
      }
    }
    ptx::fence_proxy_async_smem();
    ptx::named_barrier_sync(r.bar, 128);
    if (threadIdx.x % 128 == 0) {
      const int32_t ch0 = t.n_block * kHalfN, inter = p.inter;
      const int32_t act_row = g.ring_row(t.block) + consumer * 64, h_row = t.block * kBlockM + consumer * 64;
      for (int box = 0; box < kHalfBlocks / 8; ++box)
        if (ch0 + box * 64 < inter) ptx::tma_store_2d(&r.maps.act_st, act_box + box * 8192, ch0 + box * 64, act_row);
      ptx::bulk_commit();
      if (save) {
        for (int box = 0; box < kHalfBlocks / 8; ++box)
          if (ch0 + box * 64 < inter) {
            ptx::tma_store_2d(&r.maps.h_st, h_box + box * 8192, ch0 + box * 64, h_row);
            ptx::tma_store_2d(&r.maps.h_st, h_box + (box + kHalfBlocks / 8) * 8192, inter + ch0 + box * 64, h_row);
          }
        ptx::bulk_commit();
      }
      ptx::bulk_wait_read<0>();
      r.s.pipe.consumer_release(r.stage.index);
      r.s.pipe.consumer_release(second.index);
      if (save) ptx::bulk_wait<1>();  // act's group (the older) written; h's may still be in flight
      else ptx::bulk_wait<0>();
    }
    r.stage.advance();
    r.stage.advance();
    return true;
  }
#endif
};

}  // namespace mok::cuda::fused::ops
