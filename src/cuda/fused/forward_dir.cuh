// The fused forward as a direction of the task engine: the types and the few functions the
// generic role loops (roles/) need from a direction.  A direction bundles
//   Params, Maps, Shared, Geometry, Counts, Task   its kernel's parameter, tensor-map, shared-
//                                                  memory, geometry, tile-count and task types
//   kDone                        the task kind that ends the role loops (DirBase)
//   kClaimAhead                  the producer claims the next task under this one's loads
//                                (produce then takes a hook, called once the first k-block is issued)
//   task_counter(p)              the global task claim counter (DirBase)
//   decode(sh, p, task)          task index -> Task (the direction's schedule builder)
//   visit(kind, f)               f(Op{}) for the op of `kind` (DirBase, over its op list)
//   waits(task, g, c, out)       what a task waits on (DirBase: the ops' descriptions; the host
//                                model of its schedule test reads the same)
//   wait_all(p, waits, n, wait)  the counters' waits (DirBase, at the direction's counter_of)
//   Load, load(maps, p, g, c, task), produce(...)   what a task's tile loads and the producer
//                                loop that loads it
//   epilogue(acc, consumer, p, g, c, task, ring)   what a consumer does with a task's
//                                accumulator (DirBase: the op's epilogue, or its epilogue_ring);
//                                false on a timed-out wait
//   produce_epilogue(s, stage, maps, p, task, wait)   the stages an op's epilogue reads, loaded
//                                after its k-blocks (DirBase; none but for kRingEpilogue ops)
//   k_blocks(p, g, c, task)      the task's K loop, in k-blocks (DirBase)
//   consume(...)                 the consumers' MMA loop for a task of k_blocks k-blocks
//   signal_targets(p), signal(targets, task, g, c)   the counters a finished tile adds 1 to
//                                (DirBase: the ops' signals at the direction's counter_of)
// and the hooks of the kernel entry (megakernel.cuh: run_megakernel), defined beside the
// direction's gathers and end phase in its kernel file:
//   kProducerRegs, kConsumerRegs setmaxnreg's split of the register file
//   GeometryStore, CountsStore, Setup, setup(sh, p, geometry_store, counts_store)
//                                the call's geometry and tile counts, set up at entry where
//                                the direction keeps them (the kernel's locals, or its shared
//                                storage: the stores are then empty), and the task table and
//                                role barriers (thread 0); Setup: the g and counts the roles
//                                read, and what the gathers need.  Ends with a block barrier.
//   start_gather(sh, p, s, wait) every block's gather of the first row blocks; returns the
//                                phase it leaves the warp's staging barrier at
//   comm_gather(sh, p, s, wait, phase)   a comm block's gather of the rest (EP >= 2); false on
//                                a compute block (nothing gathered)
//   gather_warps(p, s, wait, index)   at EP = 1 (no comm blocks), gather warp `index` (0, 1) of
//                                the block's producer warpgroup: its share of the rest (DirBase:
//                                the direction's local_gather)
//   finish(sh, p, wait)          the consumer threads' end phase (grid barrier, reductions)
// The backward (fused/schedule_bwd.cuh, its ops) is the second direction.
#pragma once

#include "cuda/fused/direction.cuh"
#include "cuda/fused/forward_params.cuh"
#include "cuda/fused/ops/ops.cuh"
#include "cuda/fused/policy.cuh"

namespace mok::cuda::fused {

// The forward's types (direction.cuh: DirTypes) under policy Pol
template <class Pol>
using ForwardTypes =
    DirTypes<TaskKind, ForwardParams, MapsWith<typename Pol::ScaleMaps>, FusedSharedT<typename Pol::Stages>, Geometry,
             TaskCounts, TaskInfo, Load, CounterArray, kMaxSignals, kForwardDirection, Pol>;

template <class Pol>
struct ForwardDir : DirBase<ForwardTypes<Pol>> {
  using Base = DirBase<ForwardTypes<Pol>>;
  using Shared = FusedSharedT<typename Pol::Stages>;
  using Params = ForwardParams;
  using Task = TaskInfo;
  static_assert(kFusedSmemBytes<Pol> <= 227 * 1024, "fused shared storage exceeds 227 KB");

  static constexpr bool kClaimAhead = false;  // the producer claims a task after the last one's loads
  static constexpr int kProducerRegs = Pol::Tile::kProducerRegs, kConsumerRegs = Pol::Tile::kConsumerRegs;

  // ---- the kernel entry (forward_kernel.cuh) ----
  // The geometry and tile counts in the kernel's locals (registers); the gathers' counters and
  // whether the block is a comm block (decided at entry)
  using GeometryStore = Geometry;
  using CountsStore = TaskCounts;
  struct Setup {
    const Geometry& g;
    const TaskCounts& counts;
    int32_t* gather_ready;
    bool comm;  // a comm block
  };
  __device__ __forceinline__ static Setup setup(Shared& sh, const Params& p, Geometry& g, TaskCounts& counts);
  __device__ __forceinline__ static uint32_t start_gather(Shared& sh, const Params& p, const Setup& s,
                                                          const gemm::WaitContext& wait);
  __device__ __forceinline__ static bool comm_gather(Shared& sh, const Params& p, const Setup& s,
                                                     const gemm::WaitContext& wait, uint32_t phase);
  __device__ __forceinline__ static void finish(Shared& sh, const Params& p, const gemm::WaitContext& wait);

  // ---- the role loops (roles/): what DirBase does not ----
  __device__ __forceinline__ static Task decode(const Shared& sh, const Params&, int32_t task) {
    return decode_task(sh, task);
  }
  __device__ __forceinline__ static Task done() { return TaskInfo{Base::kDone, 0, 0, 0}; }
  __device__ __forceinline__ static Load load(const MapsWith<typename Pol::ScaleMaps>& maps, const Params& p,
                                              const Geometry& g, const TaskCounts& c, const Task& info) {
    Load load{};
    Base::visit(info.kind, [&, info](auto op) { load = decltype(op)::template load<Pol>(maps, p, g, c, info); });
    return load;
  }
  __device__ __forceinline__ static bool produce(typename Pol::Stages& s, typename Pol::Stage& stage, const Load& load,
                                                 const gemm::WaitContext& wait) {
    // NOTES: row-major weights: every op K-major, its halves apart (the plain tile loop; through
    // produce_load the forward kept the Load's other fields on the stack: 16 bytes more spills)
    if constexpr (Pol::Precision::kBlockScaled)  // the k-block's scales beside its operands
      return gemm::produce_tile(s, stage, gemm::TileLoad{load.a, load.b0, load.b1, load.a_row, load.b_row, load.b_aux,
                                                         load.num_k_blocks, load.sa, load.sb0, load.sb1, 1},
                                wait);
    else if constexpr (!Pol::kTransposed)
      return gemm::produce_tile(s, stage, gemm::TileLoad{load.a, load.b0, load.b1, load.a_row, load.b_row, load.b_aux,
                                                         load.num_k_blocks},
                                wait);
    else
      return produce_load(s, stage, load, wait, [] {});
  }
  // Every op K-major, but the routed ones with transposed weights (N-major)
  __device__ __forceinline__ static bool consume(typename Pol::Stages& s, typename Pol::Stage& stage, const Task& t,
                                                 int32_t k_blocks, int consumer, float (&acc)[Pol::Tile::kAccRegs],
                                                 const gemm::WaitContext& wait) {
    // Block-scaled: each k-block's MMAs into a partial, promoted with the stage's scales
    if constexpr (Pol::Precision::kBlockScaled)
      return gemm::consume_tile_block_scaled(s, stage, k_blocks, consumer, acc, wait);
    if constexpr (Pol::kTransposed) {
      const bool n_major = Base::visit(t.kind, [](auto op) {
        return decltype(op)::template kOpsFor<true> == gemm::Operands::kBNMajor;
      });
      if (n_major) return gemm::consume_tile<gemm::Operands::kBNMajor>(s, stage, k_blocks, consumer, acc, wait);
    }
    return gemm::consume_tile(s, stage, k_blocks, consumer, acc, wait);
  }
  // Ping-pong tiles (roles/consumers.cuh; row-major weights: every op K-major): every slab of
  // the tile, after_waits() once its stage waits have passed
  template <class AfterWaits>
  __device__ __forceinline__ static bool consume_slabs(typename Pol::Stages& s, typename Pol::Stage& stage,
                                                       const Task&, int32_t k_blocks, int consumer,
                                                       float (&acc)[Pol::Tile::kSlabs][Pol::Tile::kAccRegs],
                                                       const gemm::WaitContext& wait, AfterWaits after_waits) {
    static_assert(!Pol::kTransposed, "ping-pong forward tiles: row-major weights, K-major operands");
    return gemm::consume_tile<gemm::Operands::kKMajor>(s, stage, k_blocks, consumer, acc, wait, after_waits);
  }
};

}  // namespace mok::cuda::fused
