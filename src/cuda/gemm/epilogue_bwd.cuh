// The dgrad-down epilogue of the backward: SwiGLU backward and the router-weight gradient's
// partial sums, straight from the accumulator of da = dy · W_down[e] (docs/design.md, "The
// dgrad-down SwiGLU-backward epilogue"; docs/contracts.md §4a).
//
// Per row r of the tile (expert e, route weight w) and channel i of the tile's N range (N = I):
//   da       = acc                                   fp32, unweighted
//   g, u     = h[r, i], h[r, I + i]                  the saved bf16 pre-activations, as stored
//   sg       = 1 / (1 + __expf(-g))                  __frcp_rn: the correctly rounded reciprocal
//   sl       = g · sg                                silu(g)
//   a        = bf16(sl · u)                          as the forward's a (rounded), then used in fp32
//   dsilu    = sg · (1 + g · (1 − sg))
//   wda      = w · da
//   dh[r, i]       = dg = bf16((wda · u) · dsilu)
//   dh[r, I + i]   = du = bf16(wda · sl)
//   wa[r, i]       = bf16(w · a)                     (optional: the wgrad-down operand)
//   dtw_partials[r, c] = Σ_{i in chunk c} da · a     (optional), chunk c = channels [128c, 128c + 128)
//                                                    below I (I % 128 == 64: the last chunk has 64)
// Every operation is one rounding, in exactly this order: products and sums are written with
// __fmul_rn / __fadd_rn / __fsub_rn, which the compiler never contracts into an FMA, so the
// CPU reference (src/ref/reference.cpp, compiled with -ffp-contract=off) evaluates the same
// expressions; its only other difference is std::exp for __expf (and da's summation order).
//
// The partial of a (row, chunk): each thread of the row's quad holds 32 of the chunk's 128
// channels (columns n8*8 + (lane%4)*2 + {0, 1} of the chunk's 16 n8 blocks) and sums
// s = 0 + p(n8 0, col 0) + p(0, 1) + p(1, 0) + ... + p(15, 1) in that order (p = da · a, rounded);
// then the quad adds ((s_lane0 + s_lane1) + (s_lane2 + s_lane3)) with two xor-shuffles (IEEE
// addition is commutative, so every lane holds the same bits) and lane 0 stores it.  A chunk's
// 16 n8 blocks sit at the same place in the fragment whatever the tile's N (128 or 256: one or
// two chunks per tile), so this order, and the partials' bits given da's bits, do not depend on
// the tile shape.  No division by w: exact for w = 0 and w < 0.
//
// Rows: tile rows r < valid_rows are read and written; the others (past the tensors' end) are
// neither read nor written.  Channels: those below I, the same way (a partial last tile: its
// channels past I have da = 0 from TMA's zero fill and are skipped; a chunk's partial sums its
// channels below I in the same order).  A padding row of the plan is an ordinary row here: with w = 0 and
// h = 0 (the caller keeps them so) it gets dg = du = wa = ±0 and a partial of da · 0 = 0.
#pragma once

#include "cuda/gemm/quantize.cuh"
#include "cuda/gemm/tile.cuh"

namespace mok::gemm {

// Where the epilogue reads and writes (row-major, contiguous; 16-byte aligned rows).
struct SwiGLUBwdArgs {
  const __nv_bfloat16* h;  // [rows, 2I]: g at column i, u at column I + i
  __nv_bfloat16* dh;       // [rows, 2I]: dg at column i, du at column I + i
  __nv_bfloat16* wa;       // [rows, I] or null
  float* dtw_partials;     // [partial rows, ceil(I / 128)] or null
  int64_t inter;           // I (a multiple of 64)
  // The staged epilogue's (below): dh and wa as 64-row x 64-column TMA maps, through which dg, du
  // and wa leave the stage they were computed in (the register form takes none)
  const CUtensorMap* dh_map = nullptr;
  const CUtensorMap* wa_map = nullptr;
};

// The element math of the epilogue (see the header comment for the order of record).
struct SwiGLUBwdElem {
  float dg, du, wa, da_a;
};
__device__ __forceinline__ SwiGLUBwdElem swiglu_bwd_elem(float da, float g, float u, float w) {
  const float sg = __frcp_rn(__fadd_rn(1.0f, __expf(-g)));
  const float sl = __fmul_rn(g, sg);
  const float a = __bfloat162float(__float2bfloat16_rn(__fmul_rn(sl, u)));
  const float dsilu = __fmul_rn(sg, __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, sg))));
  const float wda = __fmul_rn(w, da);
  return SwiGLUBwdElem{__fmul_rn(__fmul_rn(wda, u), dsilu), __fmul_rn(wda, sl), __fmul_rn(w, a), __fmul_rn(da, a)};
}

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

// The block pair's math, its dg, du and wa pairs to store(b, dgp, dup, wap) (below)
template <class Da, class GWord, class UWord, class Store>
__device__ __forceinline__ float swiglu_bwd_block_pair_to(const SwiGLUBwdArgs& e, int b, Da da, GWord g_word,
                                                          UWord u_word, float w, float sum, int64_t cols, Store store) {
  uint32_t dgp[2], dup[2], wap[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int n8 = b + j;
    const uint32_t gw = g_word(n8), uw = u_word(n8);
    const SwiGLUBwdElem x0 = swiglu_bwd_elem(da(n8, 0), bf16_lo(gw), bf16_lo(uw), w);
    const SwiGLUBwdElem x1 = swiglu_bwd_elem(da(n8, 1), bf16_hi(gw), bf16_hi(uw), w);
    if (n8 * 8 < cols) {
      sum = __fadd_rn(sum, x0.da_a);
      sum = __fadd_rn(sum, x1.da_a);
    }
    dgp[j] = pack_bf16x2(x0.dg, x1.dg);
    dup[j] = pack_bf16x2(x0.du, x1.du);
    wap[j] = pack_bf16x2(x0.wa, x1.wa);
  }
  store(b, dgp, dup, wap);
  return sum;
}

// n8 blocks b and b + 1 of one fragment row, both forms of the epilogue below: the SwiGLU
// backward of the lane's column pair in each (da(n8, x) from the accumulator, g_word(n8) and
// u_word(n8) the pair's h words as stored), their ⟨da, a⟩ added to `sum` in order where the
// block is below `cols`, and dg, du (and wa where e.wa is set) out through the lane-pair 8-byte
// stores (row pointers at the blocks' chunk or pass); returns the sum
template <class Da, class GWord, class UWord>
__device__ __forceinline__ float swiglu_bwd_block_pair(const SwiGLUBwdArgs& e, int b, Da da, GWord g_word,
                                                       UWord u_word, float w, float sum, int64_t cols, bool valid,
                                                       __nv_bfloat16* dg_row, __nv_bfloat16* du_row,
                                                       __nv_bfloat16* wa_row) {
  return swiglu_bwd_block_pair_to(e, b, da, g_word, u_word, w, sum, cols,
                                  [&](int b0, const uint32_t (&dgp)[2], const uint32_t (&dup)[2], const uint32_t (&wap)[2]) {
                                    const bool write = valid && b0 * 8 < cols;
                                    store_block_pair_8b(dg_row + b0 * 8, dgp[0], dgp[1], write);
                                    store_block_pair_8b(du_row + b0 * 8, dup[0], dup[1], write);
                                    if (e.wa != nullptr) store_block_pair_8b(wa_row + b0 * 8, wap[0], wap[1], write);
                                  });
}

// One consumer's 64 rows of a dgrad-down tile: acc holds da of tile rows
// fragment_row(consumer, half) and channels ch0 + [0, BLOCK_N) (kRegs = BLOCK_N / 2).
//   row0       tile row 0's row in h, dh and wa
//   part_row0  tile row 0's row in dtw_partials (the fused kernel: plan rows, not ring rows)
//   valid_rows tile rows [0, valid_rows) exist
//   weight(r)  w of tile row r (called for valid rows only)
// Every lane runs every shuffle; only loads and stores are predicated.
template <int kRegs, typename Weight>
__device__ __forceinline__ void epilogue_dgrad_swiglu(const float (&acc)[kRegs], int consumer, const SwiGLUBwdArgs& e,
                                                      int64_t row0, int64_t part_row0, int valid_rows, int64_t ch0,
                                                      Weight weight) {
  constexpr int kBlocks = kRegs / 4;             // n8 blocks of the tile: 32 at N = 256, 16 at N = 128
  constexpr int kChunkBlocks = kDtwChunk / 8;    // n8 blocks per 128-channel chunk: 16
  constexpr int kChunks = kBlocks / kChunkBlocks;
  static_assert(kChunks >= 1 && kBlocks == kChunks * kChunkBlocks, "a tile holds whole 128-channel chunks");
  const int t = threadIdx.x & 3;
  const int64_t inter = e.inter, ld_h = 2 * inter, n_chunks = tiles_of(inter, kDtwChunk);
  // da of fragment element (n8 block n8_in_chunk of chunk c, register pair half, element x):
  // every index static, the runtime (half, c) picked with selects, so acc stays in registers
  auto da_of = [&](int c, int half, int n8_in_chunk, int x) {
    float v = acc[n8_in_chunk * 4 + x];
    float v_hi = acc[n8_in_chunk * 4 + 2 + x];
#pragma unroll
    for (int cc = 1; cc < kChunks; ++cc) {
      v = c == cc ? acc[(cc * kChunkBlocks + n8_in_chunk) * 4 + x] : v;
      v_hi = c == cc ? acc[(cc * kChunkBlocks + n8_in_chunk) * 4 + 2 + x] : v_hi;
    }
    return half ? v_hi : v;
  };
  // NOTES: one rolled loop over (half, chunk): unrolled, the epilogue was ~6,000 instructions
  // per tile of straight-line code, more than the instruction cache holds next to the main
  // loop (ncu: 28 % of warp cycles stalled on no_instruction, the kernel 1.9x the plain
  // dgrad-down's time); rolled, one (half, chunk) body is resident for all four passes.
  // h is read in the fragment's own layout (one 4-byte load per pair, all 32 of the chunk in
  // flight together) and dg / du / wa leave through lane-pair swaps (store_block_pair_8b):
  // 16-byte accesses through a quad transpose were 8-12 % slower (docs/perf.md session 13)
#pragma unroll 1
  for (int it = 0; it < 2 * kChunks; ++it) {
    const int half = it / kChunks, c = it % kChunks;
    const int r = fragment_row(consumer, half);
    const bool valid = r < valid_rows;
    const int64_t row = row0 + r;
    const float w = valid ? weight(r) : 0.0f;
    const int64_t col = ch0 + c * kDtwChunk;  // the chunk's first channel
    const int64_t chunk_cols = inter - col;   // its channels below I (<= 0: none; uniform)
    if (chunk_cols <= 0) continue;
    const __nv_bfloat16* g_row = e.h + row * ld_h + col;
    const __nv_bfloat16* u_row = g_row + inter;
    __nv_bfloat16* dg_row = e.dh + row * ld_h + col;
    __nv_bfloat16* du_row = dg_row + inter;
    __nv_bfloat16* wa_row = e.wa + row * inter + col;
    uint32_t gw[kChunkBlocks], uw[kChunkBlocks];
#pragma unroll
    for (int n8 = 0; n8 < kChunkBlocks; ++n8) {
      gw[n8] = ptx::ld_global_b32_pred(g_row + n8 * 8 + 2 * t, valid && n8 * 8 < chunk_cols);
      uw[n8] = ptx::ld_global_b32_pred(u_row + n8 * 8 + 2 * t, valid && n8 * 8 < chunk_cols);
    }
    float s = 0.0f;
#pragma unroll
    for (int b = 0; b < kChunkBlocks; b += 2)
      s = swiglu_bwd_block_pair(
          e, b, [&](int n8, int x) { return da_of(c, half, n8, x); }, [&](int n8) { return gw[n8]; },
          [&](int n8) { return uw[n8]; }, w, s, chunk_cols, valid, dg_row, du_row, wa_row);
    s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 1));
    s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 2));
    if (e.dtw_partials != nullptr && valid && t == 0)
      e.dtw_partials[(part_row0 + r) * n_chunks + ch0 / kDtwChunk + c] = s;
  }
}

// ---- fp8_block: the SwiGLU backward with dh quantised for the dgrad gate/up kind -------------
// The block-scaled dgrad-down kind's epilogue: acc holds da =
// dy · W_down[e] (e4m3 dy per row and 128 of H, W_down's transposed copy with its block scales)
// for 128 rows and BLOCK_N channels of I (I % 128 == 0: whole 128-channel chunks).  Per row r
// (weight w) and channel i, in fp32 as the CPU reference (src/ref expert_backward_fp8):
//   g, u = h[r, i], h[r, I + i]     sg = 1 / (1 + exp(-g))      sl = g · sg      a = sl · u
//   dsilu = sg · (1 + g · (1 − sg))  wda = w · da  dg = (wda · u) · dsilu  du = wda · sl
//   a_deq = e4m3(a / s_a) · s_a, s_a the chunk's max |a| / 448 (the a the forward multiplied)
//   dtw_partials[r, c] = Σ_{i in chunk c} da · a_deq
//   dh_q[r, i] = e4m3(dg / s_g), dh_q[r, I + i] = e4m3(du / s_u); s_g, s_u the chunk's max / 448
//                (pow2: the power-of-two ceiling) at dh_scales[c · ld + r] and [(I/128 + c) · ld + r]:
//                the dgrad gate/up kind's A (K = 2I) and its scales
//   dh[r, ·] = bf16(dg) | bf16(du), a_out[r, i] = bf16(a)   (optional: the wgrad operands)
// A chunk's 128 channels of a row are in the four lanes of its quad (16 n8 blocks, 2 columns
// each): three maxima by two xor-shuffles each, the partial likewise.  Rows below valid_rows.
// One element of it (the order of record above): g, u its pre-activations, w its route weight,
// da its unweighted gradient (the fast reciprocal in the sigmoid: no slow-path branch; 0 for g
// below about -88)
struct SwiGLUBwdE4m3Elem {
  float dg, du, a;
};
__device__ __forceinline__ SwiGLUBwdE4m3Elem swiglu_bwd_e4m3_elem(float g, float u, float w, float da) {
  const float sg = __fdividef(1.0f, __fadd_rn(1.0f, __expf(-g)));
  const float sl = __fmul_rn(g, sg);
  const float dsilu = __fmul_rn(sg, __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, sg))));
  const float wda = __fmul_rn(w, da);
  return SwiGLUBwdE4m3Elem{__fmul_rn(__fmul_rn(wda, u), dsilu), __fmul_rn(wda, sl), __fmul_rn(sl, u)};
}
// The max over a quad's four lanes (two xor-shuffles; every lane of the warp runs them)
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
// The router-gradient partial: sum + da0 · a_deq0 + da1 · a_deq1 in that order, a_deq the pair's
// e4m3 a (qa) times its scale s_a
__device__ __forceinline__ float dtw_add_pair(float sum, float da0, float da1, __nv_fp8x2_storage_t qa, float s_a) {
  const float2 a_deq = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(qa, __NV_E4M3)));
  sum = __fadd_rn(sum, __fmul_rn(da0, __fmul_rn(a_deq.x, s_a)));
  return __fadd_rn(sum, __fmul_rn(da1, __fmul_rn(a_deq.y, s_a)));
}
struct SwiGLUBwdE4m3Args {
  const __nv_bfloat16* h;   // [rows, 2I]
  uint8_t* dh_q;            // [rows, 2I] e4m3
  float* dh_scales;         // [2I / 128, scales_ld]
  int64_t scales_ld;
  bool pow2;
  __nv_bfloat16* dh;        // [rows, 2I] or null
  __nv_bfloat16* a_out;     // [rows, I] or null
  float* dtw_partials;      // [rows, I / 128] or null
  int64_t inter;
};
template <int kRegs, typename Weight>
__device__ __forceinline__ void epilogue_dgrad_swiglu_e4m3(const float (&acc)[kRegs], int consumer,
                                                           const SwiGLUBwdE4m3Args& e, int64_t row0, int valid_rows,
                                                           int64_t ch0, Weight weight) {
  constexpr int kBlocks = kRegs / 4, kChunkBlocks = 16, kChunks = kBlocks / kChunkBlocks;
  static_assert(kChunks >= 1 && kBlocks == kChunks * kChunkBlocks, "a tile holds whole 128-channel chunks");
  const int t = threadIdx.x & 3;
  const int64_t inter = e.inter, ld_h = 2 * inter, n_chunks = inter / 128;
  // NOTES: one rolled loop over (half, chunk), da picked from the accumulator with selects so
  // every acc index stays static, and h read again in each pass.  Unrolled (four bodies of two
  // passes each, 16,000 instructions, more than the instruction caches hold beside the K loop)
  // the kind ran at 0.27 of the dense fp8 rate (docs/perf.md session 26), as the bf16 kind did
  // unrolled (session 13); rolled with h's words kept across both passes, the K loop spilled 54
  // registers.  As written: 6,400 instructions, 3 local loads and 2 stores in the K loop.
#pragma unroll 1
  for (int it = 0; it < 2 * kChunks; ++it) {
    const int half = it / kChunks, c = it % kChunks;
    // da of (n8 block of the chunk, element x) for this iteration's (half, chunk)
    const auto da_of = [&](int n8, int x) {
      float v = acc[n8 * 4 + x];
#pragma unroll
      for (int j = 1; j < 2 * kChunks; ++j)
        v = it == j ? acc[((j % kChunks) * kChunkBlocks + n8) * 4 + (j / kChunks) * 2 + x] : v;
      return v;
    };
    const int r = fragment_row(consumer, half);
    const int64_t col = ch0 + c * 128;  // the chunk's first channel (I % 256 may be 128: none past I)
    const bool live = r < valid_rows && col < inter;
    const int64_t row = row0 + r;
    const float w = live ? weight(r) : 0.0f;
    const __nv_bfloat16* const h_row = e.h + row * ld_h + col + 2 * t;
    using Elem = SwiGLUBwdE4m3Elem;
    // (h read again in each pass: words kept across both passes spilled the K loop)
    auto elem_of = [&](uint32_t gw, uint32_t uw, int n8, int x) {
      return swiglu_bwd_e4m3_elem(x ? bf16_hi(gw) : bf16_lo(gw), x ? bf16_hi(uw) : bf16_lo(uw), w, da_of(n8, x));
    };
    float amax_g = 0.0f, amax_u = 0.0f, amax_a = 0.0f;
#pragma unroll
    for (int n8 = 0; n8 < kChunkBlocks; ++n8) {
      const uint32_t gw = ptx::ld_global_b32_pred(h_row + n8 * 8, live);
      const uint32_t uw = ptx::ld_global_b32_pred(h_row + inter + n8 * 8, live);
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const Elem v = elem_of(gw, uw, n8, x);
        amax_g = fmaxf(amax_g, fabsf(v.dg));
        amax_u = fmaxf(amax_u, fabsf(v.du));
        amax_a = fmaxf(amax_a, fabsf(v.a));
      }
    }
    const float s_g = e4m3_block_scale(quad_max(amax_g), e.pow2), s_u = e4m3_block_scale(quad_max(amax_u), e.pow2);
    const float s_a = e4m3_block_scale(quad_max(amax_a), e.pow2);
    const E4m3Divisor d_g = e4m3_divisor(s_g), d_u = e4m3_divisor(s_u), d_a = e4m3_divisor(s_a);
    uint8_t* const qg = e.dh_q + row * ld_h + col + 2 * t;
    float sum = 0.0f;  // <da, a_deq> over the lane's 32 channels in order, then the quad's four
#pragma unroll
    for (int n8 = 0; n8 < kChunkBlocks; ++n8) {
      const uint32_t gw = ptx::ld_global_b32_pred(h_row + n8 * 8, live);
      const uint32_t uw = ptx::ld_global_b32_pred(h_row + inter + n8 * 8, live);
      const Elem v0 = elem_of(gw, uw, n8, 0), v1 = elem_of(gw, uw, n8, 1);
      sum = dtw_add_pair(sum, da_of(n8, 0), da_of(n8, 1), e4m3x2(v0.a, v1.a, d_a), s_a);
      if (!live) continue;
      *reinterpret_cast<__nv_fp8x2_storage_t*>(qg + n8 * 8) = e4m3x2(v0.dg, v1.dg, d_g);
      *reinterpret_cast<__nv_fp8x2_storage_t*>(qg + inter + n8 * 8) = e4m3x2(v0.du, v1.du, d_u);
      if (e.dh != nullptr) {
        *reinterpret_cast<uint32_t*>(e.dh + row * ld_h + col + n8 * 8 + 2 * t) = pack_bf16x2(v0.dg, v1.dg);
        *reinterpret_cast<uint32_t*>(e.dh + row * ld_h + inter + col + n8 * 8 + 2 * t) = pack_bf16x2(v0.du, v1.du);
      }
      if (e.a_out != nullptr)
        *reinterpret_cast<uint32_t*>(e.a_out + row * inter + col + n8 * 8 + 2 * t) = pack_bf16x2(v0.a, v1.a);
    }
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 1));
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 2));
    if (live && t == 0) {
      e.dh_scales[(col / 128) * e.scales_ld + row] = s_g;
      e.dh_scales[(n_chunks + col / 128) * e.scales_ld + row] = s_u;
      if (e.dtw_partials != nullptr) e.dtw_partials[row * n_chunks + col / 128] = sum;
    }
  }
}

// ---- h through the stage ring (the fused backward's dgrad-down ops) ----------------------------
// The producer follows a dgrad-down tile's K loop with BLOCK_N / kHPassCols more stages, pass q
// holding g (in the stage's a) and u (in b) of the tile's BLOCK_M rows and channels
// ch0 + 64q .. +63, as TMA writes them: rows of 128 bytes, 16-byte chunks swizzled
// (chunk ^ row % 8).  The consumers read h from shared memory instead of global memory, so
// their epilogue waits for nothing the producer did not fetch under the K loop.
inline constexpr int kHPassCols = 64;
inline constexpr uint32_t kHPassBytes = 2u * 128 * kHPassCols * 2;  // g and u boxes, 128 rows

// Producer: the h passes of a tile (after its k-blocks); false on a timed-out wait.
template <class T, class P>
__device__ __forceinline__ bool produce_swiglu_h(StageStorageT<T, P>& s, PipelineState<T::kStages>& stage,
                                                 const CUtensorMap* map_h, int32_t row0, int32_t ch0, int32_t inter,
                                                 const WaitContext& wait) {
  static_assert(T::kBlockM == 128 && T::kBlockN % kHPassCols == 0, "an h pass is 128 rows x 64 channels");
  static_assert(sizeof(s.a[0]) >= kHPassBytes / 2 && sizeof(s.b[0]) >= kHPassBytes / 2, "a stage holds g and u");
  for (int q = 0; q < T::kBlockN / kHPassCols; ++q) {
    if (!s.pipe.producer_acquire(stage, wait)) return false;
    uint64_t* full = s.pipe.full_barrier(stage);
    ptx::mbar_arrive_expect_tx(full, kHPassBytes);
    ptx::tma_load_2d(s.a[stage.index], map_h, full, ch0 + q * kHPassCols, row0);
    ptx::tma_load_2d(s.b[stage.index], map_h, full, inter + ch0 + q * kHPassCols, row0);
    stage.advance();
  }
  return true;
}

// The 4-byte pair of row r's channels n8 * 8 + 2t, +1 of an h pass box (128-byte rows, swizzled)
__device__ __forceinline__ uint32_t h_pass_pair(const __nv_bfloat16* box, int r, int n8, int t) {
  return *reinterpret_cast<const uint32_t*>(reinterpret_cast<const uint8_t*>(box) + swizzled_word(r, n8, t));
}

// The epilogue of one consumer's 64 rows of a cooperative tile with h from the stage ring: the
// same values, roundings and partial-sum order as epilogue_dgrad_swiglu (header), in passes of
// 64 channels; a 128-channel chunk's partial of a row sums its first pass's 8 n8 blocks, then
// its second's.  wg_barrier: the named barrier of the consumer's warpgroup (128 threads).  False
// on a timed-out wait.
// Every pass's stage is waited for first (the producer fetched them under the K loop), then
// the passes are computed, stored through e.dh_map / e.wa_map (required) and released in order.
template <class T, class P, typename Weight>
__device__ __forceinline__ bool epilogue_dgrad_swiglu_staged(const float (&acc)[T::kAccRegs], int consumer,
                                                             StageStorageT<T, P>& s, PipelineState<T::kStages>& stage,
                                                             const WaitContext& wait, const SwiGLUBwdArgs& e,
                                                             int64_t row0, int64_t part_row0, int valid_rows,
                                                             int64_t ch0, Weight weight, uint32_t wg_barrier) {
  constexpr int kPasses = T::kBlockN / kHPassCols;
  constexpr int kPassBlocks = kHPassCols / 8;  // n8 blocks per pass: 8
  static_assert(!T::kPingPong, "a cooperative tile: both warpgroups release every stage");
  static_assert(kPasses <= T::kStages, "a tile's h passes fit in the stage ring at once");
  const int t = threadIdx.x & 3;
  const bool leader = threadIdx.x % 128 == 0;
  const int64_t inter = e.inter, n_chunks = tiles_of(inter, kDtwChunk);
  float part[2] = {0.0f, 0.0f};  // running partials of the current 128-channel chunk, per half
  float w[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = fragment_row(consumer, half);
    w[half] = r < valid_rows ? weight(r) : 0.0f;
  }
  PipelineState<T::kStages> ahead = stage;
#pragma unroll 1
  for (int q = 0; q < kPasses; ++q) {
    if (!s.pipe.consumer_wait(ahead, wait)) return false;
    ahead.advance();
  }
#pragma unroll 1
  for (int q = 0; q < kPasses; ++q) {
    const __nv_bfloat16* g_box = s.a[stage.index];
    const __nv_bfloat16* u_box = s.b[stage.index];
    const int64_t col = ch0 + q * kHPassCols;  // the pass's first channel
    const int64_t pass_cols = inter - col;     // its channels below I (<= 0: none; uniform)
    // da of fragment element (n8 block n8 of pass q, register pair half, element x), every
    // index static, the runtime pass picked with selects
    auto da_of = [&](int half, int n8, int x) {
      float v = acc[n8 * 4 + half * 2 + x];
#pragma unroll
      for (int qq = 1; qq < kPasses; ++qq) v = q == qq ? acc[(qq * kPassBlocks + n8) * 4 + half * 2 + x] : v;
      return v;
    };
    // dg over g and du over u in the stage, element by element by the lane that read it (no
    // hazard), wa in the stage's free half of b; then this consumer's 64 rows of each leave by
    // TMA stores, whose reads of the stage complete before it is released (rows past valid_rows,
    // past the rows in use or clipped by the map, leave too: nothing reads them)
    __nv_bfloat16* const g_out = const_cast<__nv_bfloat16*>(g_box);
    __nv_bfloat16* const u_out = const_cast<__nv_bfloat16*>(u_box);
    __nv_bfloat16* const wa_box = s.b[stage.index] + T::kBlockM * kHPassCols;
    if (pass_cols > 0) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = fragment_row(consumer, half);
        auto put = [&](__nv_bfloat16* box, int n8, uint32_t v) {
          *reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(box) + swizzled_word(r, n8, t)) = v;
        };
#pragma unroll
        for (int b = 0; b < kPassBlocks; b += 2)
          part[half] = swiglu_bwd_block_pair_to(
              e, b, [&](int n8, int x) { return da_of(half, n8, x); },
              [&](int n8) { return h_pass_pair(g_box, r, n8, t); }, [&](int n8) { return h_pass_pair(u_box, r, n8, t); },
              w[half], part[half], pass_cols,
              [&](int b0, const uint32_t (&dgp)[2], const uint32_t (&dup)[2], const uint32_t (&wap)[2]) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                  put(g_out, b0 + j, dgp[j]);
                  put(u_out, b0 + j, dup[j]);
                  put(wa_box, b0 + j, wap[j]);
                }
              });
      }
    }
    // The stage is read: release it (both warpgroups of the tile release each stage). Every
    // warp of the warpgroup read it, so all of them reach a barrier of the warpgroup before
    // its leader releases (unlike the K loop's wgmma reads, which the warpgroup's wgmma wait
    // covers); the fence orders the generic-proxy reads before the TMA that refills the stage.
    ptx::fence_proxy_async_smem();
    ptx::named_barrier_sync(wg_barrier, 128);
    if (leader && pass_cols > 0) {
      // This consumer's 64 rows: dg, du and wa boxes (8 KB each at its rows of the stage's boxes)
      const int32_t out_row = static_cast<int32_t>(row0) + consumer * 64, c0 = static_cast<int32_t>(col);
      const uint32_t half_off = static_cast<uint32_t>(consumer) * 64 * 128;
      ptx::tma_store_2d(e.dh_map, reinterpret_cast<const uint8_t*>(g_box) + half_off, c0, out_row);
      ptx::tma_store_2d(e.dh_map, reinterpret_cast<const uint8_t*>(u_box) + half_off, static_cast<int32_t>(inter) + c0,
                        out_row);
      if (e.wa != nullptr)
        ptx::tma_store_2d(e.wa_map, reinterpret_cast<const uint8_t*>(wa_box) + half_off, c0, out_row);
      ptx::bulk_commit();
      ptx::bulk_wait_read<0>();
    }
    if (leader) s.pipe.consumer_release(stage.index);
    stage.advance();
    // The end of a 128-channel chunk (its second pass, or its first when I ends there): the
    // quad's sum and the store, as epilogue_dgrad_swiglu (uniform: every lane shuffles)
    const bool chunk_end = pass_cols > 0 && ((q & 1) == 1 || pass_cols <= kHPassCols);
    if (chunk_end) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float sum = part[half];
        sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 1));
        sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 2));
        const int r = fragment_row(consumer, half);
        const int64_t chunk_first = ch0 + (q & ~1) * kHPassCols;
        if (e.dtw_partials != nullptr && r < valid_rows && t == 0 && chunk_first < inter)
          e.dtw_partials[(part_row0 + r) * n_chunks + chunk_first / kDtwChunk] = sum;
        part[half] = 0.0f;
      }
    }
  }
  // dh and wa are read by later tiles of the kernel, which wait on this tile's signal: the
  // stores' writes complete before the tile is handed on
  if (leader) ptx::bulk_wait<0>();
  return true;
}

}  // namespace mok::gemm
