// CPU reference backend: the oracle of every test and the CPU fallback.
//
// It computes the layer of docs/contracts.md §1 with the roundings every mok backend uses
// (docs/design.md, "Numerics"):
//   g, u   = x·w_gateᵀ, x·w_upᵀ              fp32 accumulation
//   a      = bf16(silu(g) ⊙ u)                the intermediate, stored once in bf16
//   o      = bf16(a·w_downᵀ)                  one routed (or shared) output row
//   y[t]   = bf16(Σ_j↑ w[t,j]·o(t,j) + o_shared(t))   fp32, ascending j, shared last
// and the backward:
//   h      = [bf16(g) | bf16(u)]              the saved pre-activations, rounded as the GPU stores them
//   sg     = 1/(1 + exp(-g)), sl = g·sg, a = bf16(sl·u), silu' = sg·(1 + g·(1 − sg))   (g, u from h)
//   da     = dy·w_down                        fp32 (unweighted)
//   dw[t,j]= Σ_i da[i]·a[i]                   exact for every weight, 0 and negatives too
//   dg     = bf16((w·da)·u·silu'),  du = bf16((w·da)·sl)
//   dx     = bf16(Σ_j↑ bf16(dg·w_gate + du·w_up) + bf16(shared part))
//   dW_down += dy ⊗ bf16(w·a),  dW_gate += dg ⊗ x,  dW_up += du ⊗ x   (fp32, rows in plan order)
// Every dot product sums in a fixed 8-lane order; no result depends on the thread count.
//
// The EP group is emulated in-process: rank r's plan pulls rows from every source rank,
// pushes each output row to its home slot token*k+j, and each home rank reduces its slots
// in ascending j.  A token's bits therefore do not depend on P, on the rank holding it, or
// on the other tokens.
#pragma once

#include <cstdint>
#include <vector>

#include "common/bf16.hpp"

namespace mok::ref {

struct LayerDims {
  int64_t hidden = 0;               // H
  int64_t intermediate = 0;         // I
  int64_t shared_intermediate = 0;  // I_s (0 = none)
  int64_t num_experts = 0;          // E over the group
  int64_t topk = 0;                 // k
  int64_t ep_size = 1;              // P
  // precision fp8_block (docs/precision.md): the forward's GEMMs on e4m3 values with block
  // scales, quantised here from the bf16 inputs (H, I, I_s multiples of 128)
  bool fp8_block = false;
  bool fp8_pow2 = false;  // fp8_block's scales powers of two (UE8M0)
  int64_t local_experts() const { return num_experts / ep_size; }
};

// e4m3 (OCP fp8 "fn": no infinities, largest ±448) nearest to v, ties to even, saturating
float e4m3_round(float v);
// One block of n values quantised as mok.fp8 does it: s = max |v| / 448 (1 for zeros; pow2:
// its power-of-two ceiling) and q[i] = e4m3_round(v[i] / s); returns s.
float quantize_block(const float* v, float* q, int64_t n, bool pow2 = false);

// Where element (r, c) of matrix e of a stack of [rows, cols] matrices lies:
// e·expert + r·row + c·col elements from the base (0 = contiguous for expert and row).
//   row-major:    col == 1, row >= cols (the default: a contiguous stack);
//   column-major: row == 1, col >= rows (the transposed layouts frameworks store).
// Every layout frameworks store is such a view: HF's fused gate_up_proj [E, 2I, H] gives
// w_gate = [:, :I] and w_up = [:, I:] (row-major, expert stride 2I·H, row stride H);
// interleaved gate/up rows give row stride 2H; HF's transposed gate_up_proj [E, H, 2I] gives
// w_gate = gate_up_proj.transpose(1, 2)[:, :I] (column-major, row 1, col 2I, expert 2I·H).
struct MatrixStrides {
  int64_t expert = 0;
  int64_t row = 0;
  int64_t col = 1;
  bool col_major() const { return col != 1; }
  int64_t row_or(int64_t cols) const { return row > 0 ? row : cols; }
  // A column-major matrix spans cols·col elements; a row-major one rows·row.
  int64_t expert_or(int64_t rows, int64_t cols) const {
    return expert > 0 ? expert : col_major() ? cols * col : rows * row_or(cols);
  }
  // Offset of element (r, c) within one matrix.
  int64_t at(int64_t r, int64_t c, int64_t cols) const { return r * row_or(cols) + c * col; }
};
struct WeightStrides {
  MatrixStrides w_gate, w_up, w_down, ws_gate, ws_up, ws_down;
};

// One rank's inputs.  x, topk_ids, topk_weights are contiguous row-major; the weights are
// read through `strides` (row- or column-major each).
struct RankInputs {
  int64_t num_tokens = 0;                   // T of this rank
  const bf16_t* x = nullptr;                // [T, H]
  const void* topk_ids = nullptr;           // [T, k] int32 or int64
  bool ids_are_int64 = false;
  const float* topk_weights = nullptr;      // [T, k]
  const bf16_t* w_gate = nullptr;           // [E_l, I, H]
  const bf16_t* w_up = nullptr;             // [E_l, I, H]
  const bf16_t* w_down = nullptr;           // [E_l, H, I]
  const bf16_t* ws_gate = nullptr;          // [I_s, H] or null
  const bf16_t* ws_up = nullptr;            // [I_s, H] or null
  const bf16_t* ws_down = nullptr;          // [H, I_s] or null
  WeightStrides strides;                    // of the six weights
  // fp8_block on CUDA: the weights' e4m3 copies (mokFp8Weights_t), in the order w_gate, w_up,
  // w_down, ws_gate, ws_up, ws_down: q [.., R, C] e4m3, its block scales [.., R/128, C/128]
  // fp32, and the transpose qt when given (null: absent).  The CPU reference quantises the bf16
  // weights itself and reads none of these.
  const void* fp8_q[6] = {};
  const void* fp8_qt[6] = {};
  const float* fp8_scales[6] = {};
};

// One rank's weight gradients: bf16 outputs, and optional fp32 main_grad accumulators.
struct RankGrads {
  bf16_t* dx = nullptr;                     // [T, H]
  float* d_topk_weights = nullptr;          // [T, k]
  bf16_t* dw_gate = nullptr;                // [E_l, I, H]
  bf16_t* dw_up = nullptr;
  bf16_t* dw_down = nullptr;                // [E_l, H, I]
  bf16_t* dws_gate = nullptr;               // shared, or null
  bf16_t* dws_up = nullptr;
  bf16_t* dws_down = nullptr;
  float* main_gate = nullptr;               // optional fp32 main_grad (+=)
  float* main_up = nullptr;
  float* main_down = nullptr;
  float* main_s_gate = nullptr;
  float* main_s_up = nullptr;
  float* main_s_down = nullptr;
  WeightStrides grad_strides;               // of dw_* / dws_*
  WeightStrides main_strides;               // of main_*
};

// y[r] [T_r, H] for every rank r.
void forward(const LayerDims& dims, const std::vector<RankInputs>& ranks,
             const std::vector<bf16_t*>& y, int num_threads);

// dy[r] [T_r, H]; gradients into grads[r].
void backward(const LayerDims& dims, const std::vector<RankInputs>& ranks,
              const std::vector<const bf16_t*>& dy, const std::vector<RankGrads>& grads,
              int num_threads);

// Fixed-order dot product: 8 lanes, lane l sums elements l, l+8, ... in order, then
// ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)).  Exposed for tests.
float dot_fixed(const float* a, const float* b, int64_t n);

}  // namespace mok::ref
