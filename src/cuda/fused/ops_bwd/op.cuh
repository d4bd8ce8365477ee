// What a task op of the fused backward declares: one file per GEMM kind in this folder (each
// with its routed and its shared-expert op), their list beside the kinds (../schedule_bwd.cuh).  The roles (../roles/) run
// every op through that list.
//
//   kKind                        the TaskKind it runs
//   kOps                         its operand orientation (gemm::Operands) with row-major weights:
//                                the producer's loads and the consumers' MMA step
//   waits(unit, macro, g, c, out)    what a tile waits on before its loads (host and device:
//                                the producer, and the host protocol model of
//                                tests/cpp/test_schedule_bwd.cpp); returns the count
//   signals(unit, macro, g, c, out)  the counters a finished tile adds 1 to (host and device)
//   prepare(p, t)                fills what the task's tile needs beyond (kind, unit, n, macro)
//                                (wgrad: its piece), in the producer's decode
//   k_blocks(p, g, c, t)         its K loop, in k-blocks of BLOCK_K (wgrad: the rows of the task's
//                                piece, 0 for a tile of zeros)
//   kOpsFor<kTransposed>         its orientation under the policy's routed weights (the routed
//                                ops that read weights: the other one when they are transposed)
//   load<Pol>(maps, p, g, c, t)  the tile's operands (fused::Load, ../load.cuh) for the producer
//   epilogue(acc, consumer, p, g, c, t)   what a consumer warpgroup does with its accumulator
//   kRingEpilogue                false (OpBase), or true for an op whose epilogue reads more
//                                stages after its K loop (the dgrad-down ops' h), which it declares
//                                instead of epilogue:
//     produce_epilogue(s, stage, maps, p, t, wait)   the producer's loads of those stages
//     epilogue_ring(acc, consumer, p, g, c, t, ring)  the epilogue that reads and releases them
//                                (ring: EpilogueRing, forward_params.cuh); false on a timed-out wait
// The device members exist only in CUDA code (the host test sees the descriptions alone) and
// take the kernel's policy (../policy.cuh) as their first template argument.
#pragma once

#include "cuda/fused/schedule_bwd.cuh"
#include "cuda/gemm/config.hpp"

#if defined(__CUDACC__)
#include "cuda/comm/transport.cuh"
#include "cuda/fused/backward_params.cuh"
#include "cuda/fused/load.cuh"
#endif

namespace mok::cuda::fused::bwd {


namespace ops {
// What every op shares: its kind and orientation (kTransposedOpsV: under the transposed policy,
// for the routed ops that read weights as stored), and nothing to prepare (the wgrad ops find
// their piece).
template <TaskKind kKindV, gemm::Operands kOpsV, gemm::Operands kTransposedOpsV = kOpsV>
struct OpBase {
  static constexpr TaskKind kKind = kKindV;
  static constexpr gemm::Operands kOps = kOpsV;
  // The orientation under a policy's routed weights (policy.cuh)
  template <bool kTransposed>
  static constexpr gemm::Operands kOpsFor = kTransposed ? kTransposedOpsV : kOps;
  static constexpr bool kRingEpilogue = false;  // the epilogue reads no stage (dgrad.cuh's do)
#if defined(__CUDACC__)
  __device__ __forceinline__ static void prepare(const BackwardParams&, Task&) {}
#endif
};
}  // namespace ops

}  // namespace mok::cuda::fused::bwd
