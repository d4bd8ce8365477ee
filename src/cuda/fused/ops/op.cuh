// What a task op of the fused forward declares: one file per TaskKind in this folder, their
// list beside the kinds (../schedule.cuh).  The roles (../roles/) run every op through that list
// and know no kind but kDone (the end of the list).  The members are the backward's
// (ops_bwd/op.cuh), with the forward's types:
//
//   kKind, kOps                      its TaskKind and operand orientation (OpBase: K-major)
//   kOpsFor<kTransposed>             its orientation under the policy's routed weights (OpBase: kOps)
//   waits(unit, macro, g, c, out)    what a tile of row block `unit` waits on before its loads;
//                                    returns the count (host and device: the producer, and the
//                                    host protocol model of tests/cpp/test_schedule.cpp); macro: 0
//   signals(unit, macro, g, c, out)  the counters a finished tile adds 1 to (host and device)
//   k_blocks(p, g, c, t)             its K loop, in k-blocks of BLOCK_K: the producer's loads and
//                                    the consumers' MMAs
//   load<Pol>(maps, p, g, c, t)      the tile's operands (fused::Load, ../load.cuh) for the producer
//   epilogue(acc, consumer, p, g, c, t)   what a consumer warpgroup does with its accumulator
//   kRingEpilogue                    false: no forward epilogue reads stages (ops_bwd/op.cuh)
// t is the task (row block, N block).  The device members exist only in CUDA code (the host
// test sees the schedule side alone) and take the kernel's policy (../policy.cuh) as their first
// template argument.
#pragma once

#include "cuda/fused/schedule.cuh"

#if defined(__CUDACC__)
#include "cuda/comm/transport.cuh"
#include "cuda/fused/forward_params.cuh"
#include "cuda/fused/load.cuh"
#include "cuda/gemm/tile.cuh"
#endif

namespace mok::cuda::fused::ops {
#if defined(__CUDACC__)
// The 128 x 128 block scales of a weight stack [E, rows, K] (e4m3, scales [E, ceil(rows / 128),
// k_blocks]) for the 128 rows from `row` of expert e: k-block kb's at [kb].  A half past the
// expert's rows (a partial last tile) reads its last block: its products are never stored.
__device__ __forceinline__ const float* block_scales(const float* scales, int32_t e, int32_t row, int32_t rows,
                                                     int32_t k_blocks) {
  const int32_t nb = (rows + 127) / 128;
  return scales + (int64_t{e} * nb + min(row / 128, nb - 1)) * k_blocks;
}
#endif
// What every forward op shares: its kind, K-major operands (kTransposedOpsV: its orientation
// under the transposed policy, for the routed ops that read weights as stored), and one signal
// at most (its row block in `kSignalsV`'s array; kNone: nothing waits on its tiles).
template <TaskKind kKindV, CounterArray kSignalsV, gemm::Operands kTransposedOpsV = gemm::Operands::kKMajor>
struct OpBase {
  static constexpr TaskKind kKind = kKindV;
  static constexpr gemm::Operands kOps = gemm::Operands::kKMajor;
  // The orientation under a policy's routed weights (policy.cuh)
  template <bool kTransposed>
  static constexpr gemm::Operands kOpsFor = kTransposed ? kTransposedOpsV : kOps;
  static constexpr bool kRingEpilogue = false;
  MOK_HD static int signals(int32_t unit, int32_t, const Geometry&, const TaskCounts&, Signal* out) {
    if constexpr (kSignalsV == CounterArray::kNone) {
      return 0;
    } else {
      out[0] = Signal{kSignalsV, unit};
      return 1;
    }
  }
};
}  // namespace mok::cuda::fused::ops
