// The consumer roles of a fused kernel (warpgroups 1 and 2 of a compute block), generic over
// the direction (forward_dir.cuh).
#pragma once

#include "cuda/fused/forward_params.cuh"

namespace mok::cuda::fused {

// ---- consumers: MMAs and epilogues of the producer's tasks -------------------------------------
// A consumer warpgroup's two hand-off rings: it takes tasks from the producer (tasks ring) and
// hands finished tiles to the signaler (done ring).  Its barrier is its own named barrier of 128
// threads.
template <class Dir>
struct ConsumerHandoffs {
  typename Dir::Shared& sh;
  const int consumer;
  const uint32_t bar_id = static_cast<uint32_t>(NamedBarrier::kConsumer0) + consumer;
  const bool leader = threadIdx.x % kWarpgroupThreads == 0;
  const int warp_in_group = __shfl_sync(0xffffffffu, (threadIdx.x / 32) % 4, 0);
  gemm::PipelineState<2> handoff, done_state;

  // The next task into `info`; false on a timed-out wait.  NOTES: task fields through shuffles,
  // so every branch on them is warp-uniform for ptxas.
  __device__ __forceinline__ bool take(typename Dir::Task& info, const gemm::WaitContext& wait) {
    if (!sh.rings.tasks.consumer_wait(handoff, wait, WaitSite::kTaskSlotFull, consumer)) return false;
    info = sh.tasks[handoff.index];
    info.kind = __shfl_sync(0xffffffffu, info.kind, 0);
    info.block = __shfl_sync(0xffffffffu, info.block, 0);
    info.n_block = __shfl_sync(0xffffffffu, info.n_block, 0);
    ptx::named_barrier_sync(bar_id, kWarpgroupThreads);
    if (leader) sh.rings.tasks.consumer_release(handoff.index);
    handoff.advance();
    return true;
  }
  // The finished tile to the signaler (the warpgroup's stores ordered before the arrive); false
  // on a timed-out wait
  __device__ __forceinline__ bool hand_done(const gemm::WaitContext& wait) {
    ptx::fence_proxy_async_global();
    ptx::named_barrier_sync(bar_id, kWarpgroupThreads);
    if (warp_in_group == 0) {
      if (!sh.rings.done.template producer_acquire<true>(done_state, wait, WaitSite::kDoneSlotFree, done_state.index))
        return false;
      if (leader) sh.rings.done.producer_commit(done_state);
    }
    done_state.advance();
    return true;
  }
  // The op's epilogue of one slab (an epilogue that reads stages takes the stage ring; NOTES: its
  // result through a shuffle, so that ptxas knows the branch is warp-uniform: C7518 otherwise)
  template <int kRegs>
  __device__ __forceinline__ bool epilogue(const float (&acc)[kRegs], int slab, const typename Dir::MapsT& maps,
                                           const typename Dir::Params& p, const typename Dir::GeometryT& g,
                                           const typename Dir::Counts& counts, const typename Dir::Task& info,
                                           typename Dir::Stage& stage, const gemm::WaitContext& wait) {
    const bool ok = Dir::epilogue(acc, slab, p, g, counts, info,
                                  EpilogueRing<typename Dir::Stages, typename Dir::MapsT>{sh.stages, stage, wait, bar_id, maps});
    return __shfl_sync(0xffffffffu, ok, 0);
  }
};

// Cooperative tiles (the policy's Tile::kPingPong false): both warpgroups take every task, 64 rows
// of its tile each.  NOTES: each warpgroup takes tasks and hands its half of a tile on by itself
// (the hand-off barriers count one arrival per warpgroup), so that the two drift apart by up to
// the stage ring and one's epilogue runs under the other's MMAs.
template <class Dir>
__device__ __forceinline__ void consume_tasks_cooperative(typename Dir::Shared& sh, const typename Dir::MapsT& maps,
                                                          const typename Dir::Params& p,
                                                          const typename Dir::GeometryT& g,
                                                          const typename Dir::Counts& counts, int consumer,
                                                          const gemm::WaitContext& wait) {
  ConsumerHandoffs<Dir> rings{sh, consumer};
  typename Dir::Stage stage;
  float acc[Dir::Tile::kAccRegs];
  for (;;) {
    typename Dir::Task info;
    if (!rings.take(info, wait) || info.kind == Dir::kDone) break;
    // The op's K loop and epilogue
    const int32_t k_blocks = Dir::k_blocks(p, g, counts, info);
    if (!Dir::consume(sh.stages, stage, info, k_blocks, consumer, acc, wait)) break;
    if (!rings.epilogue(acc, consumer, maps, p, g, counts, info, stage, wait) || !rings.hand_done(wait)) break;
  }
  // The warpgroup's last TMA stores (epilogues that store through the stage ring) complete before
  // the end phase (and the kernel's end)
  if (rings.leader) ptx::bulk_wait<0>();
}

// Ping-pong tiles: the warpgroups own the tasks in turn (consumer c the tasks c, c + 2, ... of the
// block's sequence), every row of each (Tile::kSlabs slabs of 64), so that one's epilogue runs
// under the other's K loop.  Both still take every task from the hand-off ring, in order: the
// other's tile's stages pass by (the producer fills them in task order), and only the owner
// hands the finished tile to the signaler (the done ring counts one arrival; with two slots and
// tasks alternating, each warpgroup's tiles use one slot).  The turn barriers of the stage ring
// (gemm::StageStorageT::turn) keep a warpgroup from waiting on its next tile's stages before the
// other has passed every stage wait of the tile between: an mbarrier's parity cannot tell phase
// p from p + 2.  No op of a ping-pong direction reads stages in its epilogue (kRingEpilogue).
template <class Dir>
__device__ __forceinline__ void consume_tasks_ping_pong(typename Dir::Shared& sh, const typename Dir::MapsT& maps,
                                                        const typename Dir::Params& p,
                                                        const typename Dir::GeometryT& g,
                                                        const typename Dir::Counts& counts, int consumer,
                                                        const gemm::WaitContext& wait) {
  using Tile = typename Dir::Tile;
  ConsumerHandoffs<Dir> rings{sh, consumer};
  typename Dir::Stage stage;
  float acc[Tile::kSlabs][Tile::kAccRegs];
  gemm::PingPongTurns turns;  // over the block's tasks
  for (;;) {
    typename Dir::Task info;
    if (!rings.take(info, wait) || info.kind == Dir::kDone) break;
    const int32_t k_blocks = __shfl_sync(0xffffffffu, Dir::k_blocks(p, g, counts, info), 0);
    if (!turns.owns(consumer)) {
      // The other warpgroup's tile: its stages pass by, and its done slot
      stage.advance(k_blocks);
      rings.done_state.advance();
      continue;
    }
    if (!turns.wait(sh.stages, consumer, wait)) break;
    const auto pass_turn = [&] { gemm::PingPongTurns::pass(sh.stages, consumer); };
    if (!Dir::consume_slabs(sh.stages, stage, info, k_blocks, consumer, acc, wait, pass_turn)) break;
    bool ok = true;
#pragma unroll
    for (int j = 0; j < Tile::kSlabs; ++j) ok = ok && rings.epilogue(acc[j], j, maps, p, g, counts, info, stage, wait);
    if (!ok || !rings.hand_done(wait)) break;
  }
}

// The consumer warpgroups' role: the policy's tile schedule picks the loop
template <class Dir>
__device__ __forceinline__ void consume_tasks(typename Dir::Shared& sh, const typename Dir::MapsT& maps,
                                              const typename Dir::Params& p,
                                              const typename Dir::GeometryT& g, const typename Dir::Counts& counts,
                                              int consumer, const gemm::WaitContext& wait) {
  if constexpr (Dir::Tile::kPingPong)
    consume_tasks_ping_pong<Dir>(sh, maps, p, g, counts, consumer, wait);
  else
    consume_tasks_cooperative<Dir>(sh, maps, p, g, counts, consumer, wait);
}

}  // namespace mok::cuda::fused
