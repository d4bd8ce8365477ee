// What both directions of the task engine share (forward_dir.cuh lists what a direction
// provides): the op-list plumbing the role loops call, written once over a direction's types
// (DirTypes).  A direction is `struct XDir : DirBase<DirTypes<...>>` plus what differs: its
// decode, its loads and their producer loop, its consumers' MMA step and the kernel entry's hooks.
#pragma once

#include "cuda/fused/forward_params.cuh"
#include "cuda/fused/op_list.cuh"

namespace mok::cuda::fused {

// A direction's types: its TaskKind, kernel parameters, tensor maps, shared storage, geometry,
// tile counts, task and tile-load types, counter arrays (waits and signals over them, at most
// kMaxSignals per tile), which direction its timeout records name (kForwardDirection or
// kBackwardDirection), and the policy it is instantiated with (policy.cuh: the precision, with
// the tile, its stage ring and accumulator; the routed weights' orientation).
template <class KindT, class ParamsT, class MapsT_, class SharedT, class GeometryT_, class CountsT, class TaskT,
          class LoadT, class CounterArrayT, int kMaxSignalsV, int kDirectionV, class PolicyT>
struct DirTypes {
  using Policy = PolicyT;
  using Tile = typename PolicyT::Tile;
  using Stages = typename PolicyT::Stages;
  using Stage = typename PolicyT::Stage;
  using Kind = KindT;
  using Params = ParamsT;
  using MapsT = MapsT_;
  using Shared = SharedT;
  using GeometryT = GeometryT_;
  using Counts = CountsT;
  using Task = TaskT;
  using Load = LoadT;
  using WaitT = CounterWait<CounterArrayT>;
  using Signal = CounterSignal<CounterArrayT>;
  static constexpr int kMaxSignals = kMaxSignalsV;
  static constexpr int kDirection = kDirectionV;
};

template <class Types>
struct DirBase : Types {
  using Kind = typename Types::Kind;
  using Params = typename Types::Params;
  using GeometryT = typename Types::GeometryT;
  using Counts = typename Types::Counts;
  using Task = typename Types::Task;
  using WaitT = typename Types::WaitT;
  using Signal = typename Types::Signal;
  static constexpr int32_t kDone = static_cast<int32_t>(Kind::kDone);

  // The global task claim counter
  __device__ __forceinline__ static int32_t* task_counter(const Params& p) {
    return &p.counters[static_cast<int>(Counter::kTaskNext)];
  }
  // f(Op{}) for the op of `kind` (the direction's op list)
  template <class F>
  __device__ __forceinline__ static decltype(auto) visit(int32_t kind, F&& f) {
    return visit_op(static_cast<Kind>(kind), f);
  }
  // What a task waits on: its op's waits (the host model of the direction's schedule test reads
  // the same)
  __device__ __forceinline__ static int waits(const Task& t, const GeometryT& g, const Counts& c, WaitT* out) {
    return task_waits(static_cast<Kind>(t.kind), t.block, t.macro, g, c, out);
  }
  // The counters' waits (the direction's counter_of)
  __device__ __forceinline__ static bool wait_all(const Params& p, const WaitT* waits, int n,
                                                  const gemm::WaitContext& wait) {
    return wait_counters<Types::kDirection>(p, waits, n, wait);
  }
  __device__ __forceinline__ static int32_t k_blocks(const Params& p, const GeometryT& g, const Counts& c,
                                                     const Task& t) {
    return visit(t.kind, [&](auto op) { return decltype(op)::k_blocks(p, g, c, t); });
  }
  // EP = 1's gather warp `index` of the block: its share of the rows after the start gather,
  // the direction's local_gather (comm/gather.cuh, backward_kernel.cuh; found by its Params)
  template <class SetupT>
  __device__ __forceinline__ static void gather_warps(const Params& p, const SetupT& s, const gemm::WaitContext& wait,
                                                      int index) {
    local_gather(p, s.g, s.counts, wait, int64_t{blockIdx.x} * kGatherWarps + index, int64_t{gridDim.x} * kGatherWarps);
  }
  // An op with kRingEpilogue reads stages after its K loop (its produce_epilogue loads them);
  // false on a timed-out wait
  template <class Ring>
  __device__ __forceinline__ static bool epilogue(const float (&acc)[Types::Tile::kAccRegs], int consumer,
                                                  const Params& p, const GeometryT& g, const Counts& c,
                                                  const Task& info, const Ring& ring) {
    return visit(info.kind, [&acc, consumer, &p, &g, &c, info, &ring](auto op) -> bool {
      if constexpr (decltype(op)::kRingEpilogue) {
        return decltype(op)::template epilogue_ring<typename Types::Policy>(acc, consumer, p, g, c, info, ring);
      } else {
        decltype(op)::template epilogue<typename Types::Policy>(acc, consumer, p, g, c, info);
        return true;
      }
    });
  }
  template <class MapsArg>
  __device__ __forceinline__ static bool produce_epilogue(typename Types::Stages& s, typename Types::Stage& stage,
                                                          const MapsArg& maps, const Params& p, const Task& info,
                                                          const gemm::WaitContext& wait) {
    return visit(info.kind, [&](auto op) -> bool {
      if constexpr (decltype(op)::kRingEpilogue)
        return decltype(op)::template produce_epilogue<typename Types::Policy>(s, stage, maps, p, info, wait);
      else return true;
    });
  }
  // The counters a finished tile adds 1 to: its op's signals, at the direction's counter_of
  struct SignalTargets {
    const Params* p;
  };
  __device__ __forceinline__ static SignalTargets signal_targets(const Params& p) { return SignalTargets{&p}; }
  __device__ __forceinline__ static void signal(const SignalTargets& targets, const Task& info, const GeometryT& g,
                                                const Counts& c) {
    Signal out[Types::kMaxSignals];
    const int n = task_signals(static_cast<Kind>(info.kind), info.block, info.macro, g, c, out);
    if (n == 0) return;
    __threadfence();
    for (int i = 0; i < n; ++i) signal_counter(counter_of(*targets.p, out[i].array, out[i].index), 1);
  }
};

}  // namespace mok::cuda::fused
