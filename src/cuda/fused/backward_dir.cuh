// The fused backward as the second direction of the task engine (forward_dir.cuh lists what a
// direction provides): its task list (schedule_bwd.cuh), its ops (ops_bwd/), and the three
// operand orientations of its tiles (with row-major weights K-major replay, N-major dgrad; the
// transposed policy swaps those two; MN-major wgrad).
#pragma once

#include "cuda/fused/backward_params.cuh"
#include "cuda/fused/direction.cuh"
#include "cuda/fused/ops_bwd/ops.cuh"
#include "cuda/fused/policy.cuh"

namespace mok::cuda::fused::bwd {

// The backward's types (direction.cuh: DirTypes) under policy Pol
template <class Pol>
using BackwardTypes =
    DirTypes<TaskKind, BackwardParams, MapsWith<typename Pol::ScaleMaps>, SharedT<typename Pol::Stages>, Geometry,
             TaskCounts, bwd::Task, Load, CounterArray, kMaxSignals, kBackwardDirection, Pol>;

template <class Pol>
struct BackwardDir : DirBase<BackwardTypes<Pol>> {
  using Base = DirBase<BackwardTypes<Pol>>;
  using Shared = SharedT<typename Pol::Stages>;
  using Params = BackwardParams;
  static_assert(kSmemBytes<Pol> <= 227 * 1024, "fused backward shared storage exceeds 227 KB");

  // Many short tiles (wgrad K = an expert's rows): the next task's claim and decode go under
  // this one's loads
  static constexpr bool kClaimAhead = true;
  // setmaxnreg's split: 64 / 216, room for the producer's tile coordinates across its nine ops'
  // loads.  At 40 / 232, the forward's split, it reloaded them from local memory between TMA
  // issues and the backward was up to 4 % slower (docs/perf.md session 13).
  static constexpr int kProducerRegs = 64, kConsumerRegs = 216;

  // ---- the kernel entry (backward_kernel.cuh) ----
  // NOTES: the geometry and tile counts are read from shared memory where used (not held in
  // registers beside the accumulator): no stores in the kernel's locals
  struct GeometryStore {};
  struct CountsStore {};
  struct Setup {
    const Geometry& g;
    const TaskCounts& counts;
  };
  __device__ __forceinline__ static Setup setup(Shared& sh, const Params& p, GeometryStore&, CountsStore&);
  __device__ __forceinline__ static uint32_t start_gather(Shared& sh, const Params& p, const Setup& s,
                                                          const gemm::WaitContext& wait);
  __device__ __forceinline__ static bool comm_gather(Shared& sh, const Params& p, const Setup& s,
                                                     const gemm::WaitContext& wait, uint32_t phase);
  __device__ __forceinline__ static void finish(Shared& sh, const Params& p, const gemm::WaitContext& wait);

  // ---- the role loops (roles/): what DirBase does not ----
  // The geometry and tile counts every role of the block reads (set up at kernel entry)
  __device__ __forceinline__ static Task decode(const Shared& sh, const Params& p, int32_t task);
  __device__ __forceinline__ static Task done() { return Task{Base::kDone, 0, 0, 0, 0, 0, 0, 0}; }
  __device__ __forceinline__ static Load load(const MapsWith<typename Pol::ScaleMaps>& maps, const Params& p,
                                              const Geometry& g, const TaskCounts& c, const Task& info) {
    return Base::visit(info.kind, [&, info](auto op) { return decltype(op)::template load<Pol>(maps, p, g, c, info); });
  }
  // The tile's loads (fused::produce_load); after_first() once the first k-block is issued
  template <class AfterFirst>
  __device__ __forceinline__ static bool produce(typename Pol::Stages& s, typename Pol::Stage& stage, const Load& l,
                                                 const gemm::WaitContext& wait, AfterFirst&& after_first) {
    return produce_load(s, stage, l, wait, after_first);
  }
  // A task of no k-blocks (a wgrad tile of zeros) takes no stage; its epilogue does not read acc.
  __device__ __forceinline__ static bool consume(typename Pol::Stages& s, typename Pol::Stage& stage, const Task& t,
                                                 int32_t k_blocks, int consumer, float (&acc)[Pol::Tile::kAccRegs],
                                                 const gemm::WaitContext& wait) {
    // NOTES: through a shuffle, so that ptxas knows the K loop's length is warp-uniform (C7518)
    k_blocks = __shfl_sync(0xffffffffu, k_blocks, 0);
    if (k_blocks == 0) return true;
    const int32_t ops = Base::visit(
        t.kind, [](auto op) { return static_cast<int32_t>(decltype(op)::template kOpsFor<Pol::kTransposed>); });
    if (ops == static_cast<int32_t>(gemm::Operands::kKMajor))
      return gemm::consume_tile<gemm::Operands::kKMajor>(s, stage, k_blocks, consumer, acc, wait);
    if (ops == static_cast<int32_t>(gemm::Operands::kBNMajor))
      return gemm::consume_tile<gemm::Operands::kBNMajor>(s, stage, k_blocks, consumer, acc, wait);
    return gemm::consume_tile<gemm::Operands::kMNMajor>(s, stage, k_blocks, consumer, acc, wait);
  }
};

template <class Pol>
__device__ __forceinline__ auto BackwardDir<Pol>::decode(const Shared& sh, const Params& p, int32_t task) -> Task {
  const TaskTile tile = decode_task(sh.segments, sh.num_segments, task, sh.geo, sh.counts);
  Task t{tile.kind, tile.unit, tile.n, tile.macro, 0, 0, 0, 0};
  Base::visit(t.kind, [&](auto op) { decltype(op)::prepare(p, t); });
  return t;
}

}  // namespace mok::cuda::fused::bwd
