// The policies a fused kernel is instantiated with, in both directions: the operand precision
// and the orientation of the routed experts' weights in memory.  A direction is a template over
// one (forward_dir.cuh, backward_dir.cuh); the host picks the instantiation per call.
//
//   Precision   gemm::PrecisionBf16, or PrecisionFp8Block below (gemm/tile.cuh: the operand
//               element, the MMA step, what a stage and the tensor maps hold besides the operands)
//   TileT       the tile shape (gemm/config.hpp: N, the consumers' schedule), of the precision's
//               operand bytes; its stage ring and the accumulator follow from it.  The backward's
//               is 128 x 256 cooperative (tile_sizes.cuh, the tile counts of its schedule); the
//               row-major forward's 128 x 192 ping-pong (ForwardPolicyBf16: each consumer
//               warpgroup owns whole tiles in turn, so one's epilogue runs under the other's K
//               loop; 3.6-5.5 % faster than cooperative 128 x 256 on plain tiles, docs/perf.md
//               session 21)
//   kTransposed false: the routed weights are row-major matrices as nn.Linear keeps them
//               (w_gate, w_up [E, I, H], w_down [E, H, I]: K contiguous in the forward);
//               true: column-major ones, i.e. stored [E, H, 2I] / [E, I, H] (Hugging Face's
//               is_transposed experts, Megatron's grouped weights), read in place: the ops
//               that read them load and multiply the other operand orientation (ops/, ops_bwd/)
// The shared expert's weights are nn.Linear modules: row-major in every instantiation.
#pragma once

#include <cuda_runtime.h>

#include "cuda/cuda_check.hpp"
#include "cuda/fused/tile_sizes.cuh"
#include "cuda/gemm/tile.cuh"

namespace mok::cuda::fused {

template <class PrecisionT, bool kTransposedV, class TileT = gemm::TileShape<kBlockM, kBlockN, PrecisionT::kElemBytes>>
struct Policy {
  using Precision = PrecisionT;
  using Tile = TileT;
  static constexpr int kTileN = Tile::kBlockN;      // columns of a store or scatter tile
  static constexpr int kTileHalfN = kTileN / 2;     // channels of a gate/up tile (its B halves' rows)
  using Stages = gemm::StageStorageT<Tile, Precision>;  // the stage ring
  using Stage = gemm::PipelineState<Tile::kStages>;     // a role's place in it
  using ScaleMaps = typename Precision::ScaleMaps;      // beside the direction's operand maps
  static constexpr bool kTransposed = kTransposedV;
  // NOTES: the schedules count tiles of the policy's N (kTileN) and row blocks of kBlockM; K is
  // the ops' (their k-blocks are the parameters', counted at the policy's Tile::kBlockK by the
  // host: ForwardParams::hidden_kb ...), so an fp8 tile's 128-byte k-blocks of 128 e4m3 are not
  // the bf16 tile's 64
  static_assert(Tile::kBlockM == kBlockM && Tile::kElemBytes == Precision::kElemBytes, "a tile of the plan's row blocks");
  static_assert(!Precision::kBlockScaled || (!kTransposedV && !Tile::kPingPong),
                "block-scaled policies: row-major (contiguous e4m3 copies of the) weights, cooperative tiles");
  // Transposed gate/up weights are loaded as two N-major halves from their own maps, each whole
  // boxes of kBoxCols columns (load.cuh)
  static_assert(!kTransposed || Tile::kBlockN % (2 * kBlockK) == 0, "transposed weights need tiles of whole-box halves");
};
using PolicyBf16 = Policy<gemm::PrecisionBf16, false>;
using PolicyBf16Transposed = Policy<gemm::PrecisionBf16, true>;
// The forward's: row-major weights in 128 x 192 ping-pong tiles; transposed ones (N-major B:
// a gate/up tile's halves are whole 64-column boxes) in the backward's 128 x 256
using ForwardPolicyBf16 = Policy<gemm::PrecisionBf16, false, gemm::TileConfigPingPong192>;
using ForwardPolicyBf16Transposed = PolicyBf16Transposed;
static_assert(sizeof(PolicyBf16::Stages) == sizeof(gemm::StageStorage), "bf16 stages hold no scales");

// fp8_block's forward (docs/precision.md): DeepSeek-V3's block scaling on the same engine.  The
// activations' scales (per row and 128 of K: [K / 128, rows] k-block-major) come by TMA, a box
// of BLOCK_M a k-block, from these maps beside the operand maps: the ring's rows (x gathered in
// e4m3), the act ring's (gate/up's SwiGLU epilogue quantises a), the rank's x quantised per
// token (the shared gate/up's A) and shared_act's.  The weights' 128 x 128 block scales come
// from the parameters (cp.async, gemm::produce_tile).
struct ForwardE4m3ScaleMaps {
  CUtensorMap ring_s, act_s, x_s, shared_act_s;
};
struct PrecisionFp8Block : gemm::PrecisionE4m3Block {
  using ScaleMaps = ForwardE4m3ScaleMaps;
};
// 128 x 256 cooperative tiles (a gate/up tile's 128 channels are one scale block of a, so its
// epilogue quantises whole blocks), the block-scaled kinds' of the launches (docs/perf.md
// session 25); row-major e4m3 copies of every weight (mok.quantize_weights' q)
using ForwardPolicyFp8 = Policy<PrecisionFp8Block, false, gemm::TileConfigE4m3Wide>;

// The host's launch of a fused kernel, instantiated for the routed weights' orientation:
// kernel_of(Pol{}) is the kernel of policy Pol, smem_of(Pol{}) its dynamic shared memory
// (forward.cu, backward.cu); args are its parameters.
template <class RowMajor = PolicyBf16, class Transposed = PolicyBf16Transposed, class KernelOf, class SmemOf,
          class... Args>
void launch_for_orientation(bool transposed, int grid, cudaStream_t stream, KernelOf kernel_of, SmemOf smem_of,
                            const Args&... args) {
  auto launch = [&](auto policy) {
    auto* const kernel = kernel_of(policy);
    const size_t smem = smem_of(policy);
    MOK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    kernel<<<grid, decltype(policy)::Tile::kThreads, smem, stream>>>(args...);
    MOK_CUDA_CHECK(cudaGetLastError());
  };
  if (transposed)
    launch(Transposed{});
  else
    launch(RowMajor{});
}

}  // namespace mok::cuda::fused
