// What a task op of the fused forward declares: one file per TaskKind in this folder, the list
// in ops.cuh.  The roles (../roles/) run every op through that list and know no kind but
// kDone (the end of the list).
//
//   kKind                       the TaskKind it runs
//   waits(block, g, c, out)     what a tile of row block `block` waits on before its loads;
//                               returns the count (host and device: the producer, and the
//                               host protocol model of tests/cpp/test_schedule.cpp)
//   kSignals                    the counter array a finished tile adds 1 to at [block]
//                               (CounterArray::kNone: nothing waits on its tiles)
//   k_blocks(p)                 its K loop, in k-blocks of BLOCK_K: the producer's loads and the
//                               consumers' MMAs
//   load(maps, p, g, t)         the tile's operands (gemm::TileLoad) for the producer
//   epilogue(acc, consumer, p, g, t)   what a consumer warpgroup does with its accumulator
// t is the task (row block, N block).  The device members exist only in CUDA code: the host
// test sees the schedule side alone.
#pragma once

#include "cuda/fused/schedule.cuh"

#if defined(__CUDACC__)
#include "cuda/comm/transport.cuh"
#include "cuda/fused/forward_params.cuh"
#include "cuda/gemm/tile.cuh"
#endif
