// The wgrad kind of the grouped-GEMM engine: K-grouped, both operands MN-major.
//
//   out[e][Mo, No] = Σ_{rows r of expert e} A[r, 0:Mo]ᵀ ⊗ B[r, 0:No]
//     dW_down[e]          = (w·dy)_rowsᵀ · a_rows        (A = w·dy rows [R, H], B = act rows [R, I])
//     [dW_gate; dW_up][e] = [dg | du]_rowsᵀ · x_rows    (A = [dg | du] rows [R, 2I], B = x rows [R, H])
//
// K is the expert's row count: rows [expert_offset[e], + expert_count[e]) of A and B, read
// through the same two tensor maps for every expert at row coordinates (no map per expert,
// no tensormap.replace racing loads in flight).  The K loop takes ceil(count / 64) k-blocks;
// the rows of the last k-block past the count are the plan's padding rows, which the caller
// keeps zero (the contract of mokGroupedWgrad).  An expert with no rows gets zeros.
//
// Mo and No are multiples of 64: the last tile of each may be partial (its rows or columns
// past the matrix are computed from TMA's zero fill or neighbouring columns and never
// stored).  With out_split, each part's rows are tiled on their own, so that no tile spans
// both parts.
//
// Tiles of any shape T (config.hpp): the standalone launch's 128 (Mo) x 192 (No) ping-pong, five
// stages of 40 KB, each consumer warpgroup owning whole tiles in turn; the fused backward's
// tiles are its policy's (128 x 192 ping-pong, or 128 x 256 cooperative with transposed
// weights).  A arrives as two 64 (Mo) x 64 (K) TMA boxes (slab j of the tile reads box j), B as
// N / 64 boxes of 64 (No) x 64 (K), both read through the wgmma transpose bits
// (mma_bf16_tatb).  Tiles (e, m, n) are
// walked expert-major, each expert's (m, n) grid in the N-grouped raster; every tile is owned
// by one block, so the fp32 read-add-write of `acc` and `main_grad` needs no atomics and is
// deterministic.
//
// With split_n (the fused backward's transposed weights: their gradients are stored [E, H, 2I],
// computed as x_rowsᵀ · [dg | du]), out_split splits the output columns instead: columns
// [0, out_split) go to out / main_grad, the rest to out1 / main_grad1, each part tiled on its
// own; the device functions take it as their kSplitN.
//
// Per expert (optional arrays, for a macrobatch loop whose experts are at different steps):
// expert_mode[e] < 0 skips the expert's tiles (nothing read or written), else its bits say
// what the tile does (kWgradAccumulate: total = acc + sum; kWgradStoreAcc: acc = total;
// kWgradFinal: out = bf16(total), main_grad += total); without the array every expert takes
// the call's accumulate / store_acc and is final.  acc_slot[e] is the expert's fp32 slot in
// acc (without it: e).  out_split > 0 splits the output rows: rows [0, out_split) of expert e
// go to out / main_grad [E, out_split, No], rows [out_split, Mo) to out1 / main_grad1
// [E, Mo - out_split, No] ([dW_gate; dW_up] into the two weights' gradients).
#pragma once

#include "cuda/gemm/tile.cuh"

namespace mok::gemm {

struct WgradParams {
  int32_t num_experts;
  int32_t num_m_blocks;        // parts · m_part_blocks (wgrad_tiling)
  int32_t num_n_blocks;        // ceil(No / 256)
  int32_t m_part_blocks;       // m-blocks per part: ceil(m_part / 128)
  int64_t m_part;              // rows per part: out_split, or Mo (one part)
  const int32_t* expert_offset;  // [E + 1] first row of each expert (a multiple of 64)
  const int32_t* expert_count;   // [E] rows of each expert
  __nv_bfloat16* out;          // [E, Mo, No] or null
  float* acc;                  // [E, Mo, No] fp32 or null
  float* main_grad;            // [E, Mo, No] fp32 or null: += the total
  int32_t accumulate;          // total = acc + this call's sum (acc read)
  int32_t store_acc;           // acc = total (acc written)
  int64_t mo, no;              // Mo, No: the output's row length is No
  int32_t n_group;
  uint64_t timeout_ns;
  int64_t* timeout_record;
  const int32_t* expert_range; // [2] or null: only experts [range[0], range[1]) (a macrobatch's)
  const int32_t* expert_mode;  // [E] or null (above)
  const int32_t* acc_slot;     // [E] or null
  int64_t out_split;           // 0: one output; else rows of out / main_grad per expert
  __nv_bfloat16* out1;         // [E, Mo - out_split, No] (out_split > 0)
  float* main_grad1;
  // The outputs in place (elements): row r of expert e's matrix of out / out1 at e·out_es +
  // r·out_rs, of main_grad / main_grad1 at e·mg_es + r·mg_rs (wgrad_layout: contiguous ones)
  int64_t out_es, out_rs, mg_es, mg_rs;
  // split_n: out_split splits the columns (No) into parts of n_part, n_part_blocks tiles each
  int32_t split_n;
  int32_t n_part_blocks;
  int64_t n_part;
};

// The parameters every wgrad launch shares (bf16 and fp8; the per-expert tables, split outputs
// and strides left unset, the tiling to wgrad_layout)
inline WgradParams wgrad_common_params(int64_t num_experts, const int32_t* expert_offset, const int32_t* expert_count,
                                       void* out, float* acc, float* main_grad, bool accumulate, bool store_acc,
                                       int64_t mo, int64_t no, int32_t n_group, uint64_t timeout_ns,
                                       int64_t* timeout_record) {
  WgradParams p{};
  p.num_experts = static_cast<int32_t>(num_experts);
  p.expert_offset = expert_offset;
  p.expert_count = expert_count;
  p.out = static_cast<__nv_bfloat16*>(out);
  p.acc = acc;
  p.main_grad = main_grad;
  p.accumulate = accumulate ? 1 : 0;
  p.store_acc = store_acc ? 1 : 0;
  p.mo = mo;
  p.no = no;
  p.n_group = n_group;
  p.timeout_ns = timeout_ns;
  p.timeout_record = timeout_record;
  return p;
}

// Fills p's tiling from mo, no and out_split, and the strides left 0 with the contiguous ones
// ([E, rows, No] per output, rows = out_split or Mo); split outputs of contiguous tensors need
// halves of one size.
template <class T = TileConfig>
inline void wgrad_layout(WgradParams& p) {
  const int parts = p.out_split > 0 ? 2 : 1;
  const int64_t part = p.out_split > 0 ? p.out_split : (p.split_n ? p.no : p.mo);
  const int64_t rows = p.split_n ? p.mo : part, cols = p.split_n ? part : p.no;  // of one output
  p.m_part = rows;
  p.m_part_blocks = tiles_of(rows, T::kBlockM);
  p.num_m_blocks = (p.split_n ? 1 : parts) * p.m_part_blocks;
  p.n_part = cols;
  p.n_part_blocks = tiles_of(cols, T::kBlockN);
  p.num_n_blocks = (p.split_n ? parts : 1) * p.n_part_blocks;
  if (p.out_rs == 0) p.out_rs = cols;
  if (p.out_es == 0) p.out_es = rows * p.out_rs;
  if (p.mg_rs == 0) p.mg_rs = cols;
  if (p.mg_es == 0) p.mg_es = rows * p.mg_rs;
}


struct WgradTile {
  int32_t expert, m_block, n_block, num_k_blocks, row0, mode;
};

// The first output row (of all Mo) of m-block m, and how many of its 128 rows exist; the first
// column (of all No) of n-block n, and how many of its 256 columns exist (kSplitN: split_n's
// parts; without it the columns are one part).
template <bool kSplitN = false, class T = TileConfig>
__device__ __forceinline__ int64_t wgrad_row0(const WgradParams& p, int32_t m) {
  if constexpr (kSplitN) return int64_t{m} * T::kBlockM;
  const int32_t part = m / p.m_part_blocks;
  return part * p.m_part + int64_t{m - part * p.m_part_blocks} * T::kBlockM;
}
template <bool kSplitN = false, class T = TileConfig>
__device__ __forceinline__ int32_t wgrad_valid_rows(const WgradParams& p, int32_t m) {
  const int64_t left = (kSplitN ? p.mo : (m / p.m_part_blocks + 1) * p.m_part) - wgrad_row0<kSplitN, T>(p, m);
  return left < T::kBlockM ? static_cast<int32_t>(left) : T::kBlockM;
}
template <bool kSplitN = false, class T = TileConfig>
__device__ __forceinline__ int64_t wgrad_col0(const WgradParams& p, int32_t n) {
  if constexpr (!kSplitN) return int64_t{n} * T::kBlockN;
  const int32_t part = n / p.n_part_blocks;
  return part * p.n_part + int64_t{n - part * p.n_part_blocks} * T::kBlockN;
}
template <bool kSplitN = false, class T = TileConfig>
__device__ __forceinline__ int64_t wgrad_valid_cols(const WgradParams& p, int32_t n) {
  return (kSplitN ? (n / p.n_part_blocks + 1) * p.n_part : p.no) - wgrad_col0<kSplitN, T>(p, n);
}

// The call's first expert and its tile count (experts [first, first + n) of expert_range).
__device__ __forceinline__ int wgrad_first_expert(const WgradParams& p) { return p.expert_range ? p.expert_range[0] : 0; }
__device__ __forceinline__ int wgrad_num_tiles(const WgradParams& p) {
  const int n = p.expert_range ? p.expert_range[1] - p.expert_range[0] : p.num_experts;
  return n * p.num_m_blocks * p.num_n_blocks;
}

// kTables: the per-expert arrays of the params are read (the backward's macrobatch loop);
// without them the kernel is the plain K-grouped GEMM of the C ABI (mode unused).
// The tile (m, n) of expert e.
template <bool kTables>
__device__ __forceinline__ WgradTile wgrad_tile_at(const WgradParams& p, int e, int m, int n) {
  int32_t mode = 0, count;
  if constexpr (kTables) {
    mode = p.expert_mode ? p.expert_mode[e]
                         : (p.accumulate ? kWgradAccumulate : 0) | (p.store_acc ? kWgradStoreAcc : 0) | kWgradFinal;
    count = mode < 0 ? 0 : p.expert_count[e];
  } else {
    count = p.expert_count[e];
  }
  return WgradTile{e, m, n, (count + TileConfig::kBlockK - 1) / TileConfig::kBlockK, p.expert_offset[e], mode};
}
template <bool kTables>
__device__ __forceinline__ WgradTile wgrad_tile(const WgradParams& p, int first_expert, int tile) {
  const int per_expert = p.num_m_blocks * p.num_n_blocks;
  const int e_local = tile / per_expert;
  const TileCoord tc = raster(tile - e_local * per_expert, p.num_m_blocks, p.num_n_blocks, p.n_group);
  return wgrad_tile_at<kTables>(p, first_expert + e_local, tc.m, tc.n);
}

// Producer: one stage per k-block, A's kBlockM / 64 boxes and B's kBlockN / 64 at the k-block's rows.
template <class T = TileConfig>
__device__ __forceinline__ bool produce_tile_wgrad(StageStorageT<T>& s, PipelineState<T::kStages>& stage,
                                                   const CUtensorMap* map_a, const CUtensorMap* map_b,
                                                   const WgradParams& p, const WgradTile& t, const WaitContext& wait) {
  using C = T;
  const int32_t a_col = static_cast<int32_t>(wgrad_row0<false, T>(p, t.m_block));
  return produce_stages(s, stage, t.num_k_blocks, wait, [&](int kb, int i, uint64_t* full) {
    const int32_t row = t.row0 + kb * C::kBlockK;
#pragma unroll
    for (int c = 0; c < C::kBlockM / 64; ++c)
      ptx::tma_load_2d(s.a[i] + c * kNChunkElems, map_a, full, a_col + c * 64, row);
#pragma unroll
    for (int c = 0; c < C::kBlockN / 64; ++c)
      ptx::tma_load_2d(s.b[i] + c * kNChunkElems, map_b, full, t.n_block * C::kBlockN + c * 64, row);
  });
}

// total = acc_in (accumulate) + this tile's sum; written as bf16 (out: 8-byte stores through
// lane-pair swaps, tile.cuh store_row), then as fp32 (store_acc) and added into main_grad, each where present.
// Every element is read and written by the thread that holds it in the fragment (as in
// tile.cuh: per n8 block, columns n8*8 + (lane%4)*2 + {0,1} of two rows), so acc is read for
// the bf16 total before it is overwritten.
// kZero: a tile of an expert with no rows (its sum is zero; the registers are not read).
// The tile's fp32 slot in acc and its output rows (kTables: per expert; else acc and the
// output indexed by the expert, one output tensor).
struct WgradTarget {
  bool accumulate, store_acc;
  int64_t slot;             // expert index in acc
  int64_t row_base;         // subtracted from the tile's rows in the output
  int64_t col_base;         // and from its columns (split_n's second part)
  __nv_bfloat16* out;       // null: no bf16 output for this tile
  float* main_grad;         // null: none
};
// The target of a tile of the per-expert tables' kind (its mode's bits, fp32 slot `slot`).
template <bool kSplitN = false>
__device__ __forceinline__ WgradTarget wgrad_target_at(const WgradParams& p, const WgradTile& t, int64_t slot) {
  const bool final_ = (t.mode & kWgradFinal) != 0;
  // All of a tile's rows (kSplitN: columns) are in one part (wgrad_layout)
  const bool second = p.out_split > 0 && (kSplitN ? t.n_block >= p.n_part_blocks : t.m_block >= p.m_part_blocks);
  const int64_t base = second ? p.out_split : 0;
  return WgradTarget{(t.mode & kWgradAccumulate) != 0, (t.mode & kWgradStoreAcc) != 0, slot, kSplitN ? 0 : base,
                     kSplitN ? base : 0, final_ ? (second ? p.out1 : p.out) : nullptr,
                     final_ ? (second ? p.main_grad1 : p.main_grad) : nullptr};
}
template <bool kTables>
__device__ __forceinline__ WgradTarget wgrad_target(const WgradParams& p, const WgradTile& t) {
  if constexpr (!kTables) {
    return WgradTarget{p.accumulate != 0, p.store_acc != 0, t.expert, 0, 0, p.out, p.main_grad};
  } else {
    return wgrad_target_at(p, t, p.acc_slot ? p.acc_slot[t.expert] : t.expert);
  }
}

// The epilogue of a tile into target w (p: its mo, no and acc).  kFast: a tile without fp32 in
// or out takes a loop of bf16 stores alone (the standalone launches: 2-5 % faster kinds, docs/
// perf.md session 14); the fused backward compiles without it (its wgrad tiles through the
// fast path made the whole kernel 1-2 % slower, measured 8 of 8 times, not understood).
// consumer: the 64-row slab of the tile the accumulator holds (T: the tile shape).
template <bool kZero, bool kTables, bool kFast = true, bool kSplitN = false, class T = TileConfig>
__device__ __forceinline__ void epilogue_wgrad_to(const float (&acc)[T::kAccRegs], int consumer,
                                                  const WgradParams& p, const WgradTile& t, const WgradTarget& w) {
  using C = T;
  const bool accumulate = w.accumulate, store_acc = w.store_acc;
  __nv_bfloat16* const out = w.out;
  float* const main_grad = w.main_grad;
  const int64_t tile_row0 = wgrad_row0<kSplitN, T>(p, t.m_block);
  const int32_t valid_rows = wgrad_valid_rows<kSplitN, T>(p, t.m_block);
  const int64_t col0 = wgrad_col0<kSplitN, T>(p, t.n_block);
  const int64_t cols = wgrad_valid_cols<kSplitN, T>(p, t.n_block);  // the tile's columns in its part
  const int64_t out_col0 = col0 - w.col_base;  // in its output
  if (kFast && !accumulate && !store_acc && !main_grad) {
    // The common tile (a final piece without fp32 in or out): bf16(sum) alone, without the
    // generic loop's per-element predicates (the same bits: total = the sum then too)
    if (!out) return;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = fragment_row(consumer, half);
      const int64_t row = tile_row0 + r;
      const int64_t out_row_off = int64_t{t.expert} * p.out_es + (row - w.row_base) * p.out_rs + out_col0;
      store_row<C::kBlockN / 8>(out + out_row_off, r < valid_rows, cols, [&](int n8) {
        return kZero ? 0u : pack_bf16x2(acc[n8 * 4 + half * 2], acc[n8 * 4 + half * 2 + 1]);
      });
    }
    return;
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = fragment_row(consumer, half);
    const bool row_ok = r < valid_rows;
    const int64_t row = tile_row0 + r;
    const int64_t acc_row_off = (w.slot * p.mo + row) * p.no + col0;
    const int64_t out_row_off = int64_t{t.expert} * p.out_es + (row - w.row_base) * p.out_rs + out_col0;
    const int64_t lane_col = (threadIdx.x % 4) * 2;  // this thread's first column
    const float* prior_row = accumulate ? p.acc + acc_row_off + lane_col : nullptr;
    // NOTES: rows and columns past the output are neither read nor written (acc has no slack)
    auto in = [&](int n8) { return row_ok && n8 * 8 < cols; };
    auto total = [&](int n8) {
      float2 v = kZero ? make_float2(0.0f, 0.0f) : make_float2(acc[n8 * 4 + half * 2], acc[n8 * 4 + half * 2 + 1]);
      if (accumulate && in(n8)) {
        const float2 prior = *reinterpret_cast<const float2*>(prior_row + n8 * 8);
        v.x = prior.x + v.x;
        v.y = prior.y + v.y;
      }
      return v;
    };
    // bf16 out: every lane takes part in the shuffles
    auto pair = [&](int n8) {
      const float2 v = total(n8);
      return pack_bf16x2(v.x, v.y);
    };
    if (out) store_row<C::kBlockN / 8>(out + out_row_off, row_ok, cols, pair);
    // fp32: the accumulator and main_grad
    if (store_acc || main_grad) {
      float* acc_row = p.acc ? p.acc + acc_row_off + lane_col : nullptr;
      float* mg_row =
          main_grad ? main_grad + int64_t{t.expert} * p.mg_es + (row - w.row_base) * p.mg_rs + out_col0 + lane_col : nullptr;
#pragma unroll
      for (int n8 = 0; n8 < C::kBlockN / 8; ++n8) {
        if (!in(n8)) continue;
        const float2 v = total(n8);
        if (store_acc) *reinterpret_cast<float2*>(acc_row + n8 * 8) = v;
        if (mg_row) {
          float2 m = *reinterpret_cast<const float2*>(mg_row + n8 * 8);
          m.x += v.x;
          m.y += v.y;
          *reinterpret_cast<float2*>(mg_row + n8 * 8) = m;
        }
      }
    }
  }
}

template <bool kZero, bool kTables, class T = TileConfig>
__device__ __forceinline__ void epilogue_wgrad(const float (&acc)[T::kAccRegs], int consumer,
                                               const WgradParams& p, const WgradTile& t) {
  epilogue_wgrad_to<kZero, kTables, true, false, T>(acc, consumer, p, t, wgrad_target<kTables>(p, t));
}

// The fused backward's TMA-store epilogue (ops_bwd/wgrad.cuh).  Whether tile t takes it: a whole tile (kSplitN: of its part), final,
// bf16 out only (no fp32 in or out)
template <bool kSplitN = false>
__device__ __forceinline__ bool wgrad_tile_storable(const WgradParams& p, const WgradTile& t, const WgradTarget& w) {
  return wgrad_valid_rows<kSplitN>(p, t.m_block) == TileConfig::kBlockM &&
         wgrad_valid_cols<kSplitN>(p, t.n_block) >= TileConfig::kBlockN && w.out != nullptr && !w.accumulate &&
         !w.store_acc && w.main_grad == nullptr;
}
// One consumer's 64 x 256 half of the tile, bf16, into buf as four 64 x 64 boxes in the
// 128-byte swizzle of a TMA map (swizzled_word): conflict-free 4-byte stores.  Then the warpgroup's first thread stores the boxes at (col, row) of `map`
// (an asynchronous bulk group; the caller waits for its reads before reusing buf).
template <int kRegs>
__device__ __forceinline__ void store_half_tma(const float (&acc)[kRegs], uint8_t* buf, const CUtensorMap* map,
                                               int32_t col, int32_t row, uint32_t wg_barrier) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = warp * 16 + lane / 4 + half * 8;  // row within the warpgroup's 64
#pragma unroll
    for (int n8 = 0; n8 < kRegs / 4; ++n8) {
      const int box = n8 / 8, chunk = n8 % 8;
      *reinterpret_cast<uint32_t*>(buf + box * 8192 + swizzled_word(r, chunk, lane % 4)) =
          pack_bf16x2(acc[n8 * 4 + half * 2], acc[n8 * 4 + half * 2 + 1]);
    }
  }
  ptx::fence_proxy_async_smem();
  ptx::named_barrier_sync(wg_barrier, 128);
  if (threadIdx.x % 128 == 0) {
#pragma unroll
    for (int box = 0; box < kRegs / 32; ++box) ptx::tma_store_2d(map, buf + box * 8192, col + box * 64, row);
    ptx::bulk_commit();
  }
}

// T: the tile shape (config.hpp; the launch's: 128 x 192 ping-pong); a ping-pong shape's
// consumers own the tiles in turn (grouped_gemm.cuh), every row of each.
template <bool kTables, class T>
__global__ void __launch_bounds__(T::kThreads, 1)
    grouped_wgrad_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                         const WgradParams p) {
  using C = T;
  extern __shared__ uint8_t smem_raw[];
  auto& s = *reinterpret_cast<StageStorageT<T>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  // 0 producer, 1 and 2 consumers
  const int role = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  const WaitContext wait{ptx::globaltimer_ns() + p.timeout_ns, p.timeout_record};
  const int num_tiles = kTables ? wgrad_num_tiles(p) : p.num_experts * p.num_m_blocks * p.num_n_blocks;
  const int e0 = kTables ? wgrad_first_expert(p) : 0;

  // Initialise barriers
  if (threadIdx.x == 0) {
    s.init_barriers();
    ptx::fence_mbar_init();
    ptx::prefetch_tensormap(&map_a);
    ptx::prefetch_tensormap(&map_b);
  }
  __syncthreads();

  if (role == 0) {
    ptx::setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x != 0) return;
    PipelineState<C::kStages> stage;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const WgradTile t = wgrad_tile<kTables>(p, e0, tile);
      if ((!kTables || t.mode >= 0) && !produce_tile_wgrad<T>(s, stage, &map_a, &map_b, p, t, wait)) return;
    }
    return;
  }

  // Consumers
  ptx::setmaxnreg_inc<C::kConsumerRegs>();
  const int consumer = role - 1;
  PipelineState<C::kStages> stage;
  float acc[C::kSlabs][C::kAccRegs];
  PingPongTurns turns;  // ping-pong: over this call's tiles
  // NOTES: each tile's fields (two dependent global loads) are read one tile ahead, so their
  // latency passes under the previous tile's MMAs instead of stalling both warpgroups.
  WgradTile t = static_cast<int>(blockIdx.x) < num_tiles ? wgrad_tile<kTables>(p, e0, blockIdx.x) : WgradTile{};
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int next = tile + static_cast<int>(gridDim.x);
    const WgradTile next_t = next < num_tiles ? wgrad_tile<kTables>(p, e0, next) : t;
    if (kTables && t.mode < 0) {  // not this call's: untouched
      t = next_t;
      continue;
    }
    if constexpr (C::kPingPong) {
      // The other warpgroup's tile: its stages pass by (the producer fills tiles in order)
      if (!turns.owns(consumer)) {
        stage.advance(t.num_k_blocks);
        t = next_t;
        continue;
      }
      if (!turns.wait(s, consumer, wait)) return;
    }
    const auto pass_turn = [&] {
      if constexpr (C::kPingPong) PingPongTurns::pass(s, consumer);
    };
    if (t.num_k_blocks == 0) {
      // An expert with no rows: its gradient is zero (plus what acc already holds); no stage
      // is waited on, so the turn passes on at once.  NOTES: zeroing the accumulator registers
      // here instead makes ptxas spill them.
      pass_turn();
#pragma unroll
      for (int j = 0; j < C::kSlabs; ++j)
        epilogue_wgrad<true, kTables, T>(acc[j], C::kPingPong ? j : consumer, p, t);
      t = next_t;
      continue;
    }
    if (!consume_tile<Operands::kMNMajor>(s, stage, t.num_k_blocks, consumer, acc, wait, pass_turn)) return;
#pragma unroll
    for (int j = 0; j < C::kSlabs; ++j) epilogue_wgrad<false, kTables, T>(acc[j], C::kPingPong ? j : consumer, p, t);
    t = next_t;
  }
}


}  // namespace mok::gemm
