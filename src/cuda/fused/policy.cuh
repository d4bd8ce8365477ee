// The policies a fused kernel is instantiated with, in both directions: the operand precision
// and the orientation of the routed experts' weights in memory.  A direction is a template over
// one (forward_dir.cuh, backward_dir.cuh); the host picks the instantiation per call.
//
//   Precision   gemm::PrecisionBf16 (gemm/tile.cuh: the operand element, the MMA step, what a
//               stage and the tensor maps hold besides the operands); the tile shape, its stage
//               ring and the accumulator follow from it
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

template <class PrecisionT, bool kTransposedV>
struct Policy {
  using Precision = PrecisionT;
  using Tile = gemm::TileShape<kBlockM, kBlockN, Precision::kElemBytes>;
  using Stages = gemm::StageStorageT<Tile, Precision>;  // the stage ring
  using Stage = gemm::PipelineState<Tile::kStages>;     // a role's place in it
  using ScaleMaps = typename Precision::ScaleMaps;      // beside the direction's operand maps
  static constexpr bool kTransposed = kTransposedV;
  // NOTES: the tile counts of the schedules (tile_sizes.cuh) are the bf16 tile's; a precision
  // with another K per k-block or tile takes them from here first
  static_assert(Tile::kBlockK == kBlockK, "the schedules' k-blocks are this precision's");
};
using PolicyBf16 = Policy<gemm::PrecisionBf16, false>;
using PolicyBf16Transposed = Policy<gemm::PrecisionBf16, true>;
static_assert(sizeof(PolicyBf16::Stages) == sizeof(gemm::StageStorage), "bf16 stages hold no scales");

// The host's launch of a fused kernel, instantiated for the routed weights' orientation:
// kernel_of(Pol{}) is the kernel of policy Pol, smem_of(Pol{}) its dynamic shared memory
// (forward.cu, backward.cu); args are its parameters.
template <class KernelOf, class SmemOf, class... Args>
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
    launch(PolicyBf16Transposed{});
  else
    launch(PolicyBf16{});
}

}  // namespace mok::cuda::fused
