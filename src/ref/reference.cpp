// CPU reference backend (see reference.hpp for the numerics).  Compiled with
// -ffp-contract=off: every multiply and add rounds as written, on every host.
#include "ref/reference.hpp"

#include <cmath>
#include <cstring>
#include <vector>

#include "common/parallel.hpp"
#include "plan/plan.hpp"

namespace mok::ref {
namespace {

constexpr int kLanes = 8;

// The one fixed summation order of the reference (see dot_fixed).
template <typename LoadA, typename LoadB>
float dot_lanes(LoadA a, LoadB b, int64_t n) {
  float acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = acc[l] + a(i + l) * b(i + l);
  for (int l = 0; i + l < n; ++l) acc[l] = acc[l] + a(i + l) * b(i + l);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

float dot_f_bf(const float* a, const bf16_t* b, int64_t n) {
  return dot_lanes([a](int64_t i) { return a[i]; }, [b](int64_t i) { return bf16_to_float(b[i]); },
                   n);
}

float silu(float g) { return g / (1.0f + std::exp(-g)); }
float sigmoid(float g) { return 1.0f / (1.0f + std::exp(-g)); }
float bf16_round(float v) { return bf16_to_float(float_to_bf16(v)); }

void to_float(const bf16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

constexpr int64_t kFp8Block = 128;  // fp8_block: the scales' blocks (1 x 128, 128 x 128)

// A [rows, cols] matrix quantised in 128 x 128 blocks (rows, cols multiples of 128): values
// q [rows, cols] and scales s [rows / 128, cols / 128]
struct BlockQuantized {
  std::vector<float> q, s;
  int64_t cols = 0;
  const float* row(int64_t r) const { return q.data() + r * cols; }
  float scale(int64_t r, int64_t kb) const { return s[static_cast<size_t>((r / kFp8Block) * (cols / kFp8Block) + kb)]; }
};
BlockQuantized quantize_matrix(const bf16_t* m, int64_t rows, int64_t cols, int64_t ld, bool pow2) {
  BlockQuantized out;
  out.cols = cols;
  out.q.resize(static_cast<size_t>(rows * cols));
  out.s.resize(static_cast<size_t>((rows / kFp8Block) * (cols / kFp8Block)));
  std::vector<float> block(static_cast<size_t>(kFp8Block * kFp8Block)), qb(block.size());
  for (int64_t rb = 0; rb < rows / kFp8Block; ++rb)
    for (int64_t cb = 0; cb < cols / kFp8Block; ++cb) {
      for (int64_t r = 0; r < kFp8Block; ++r)
        to_float(m + (rb * kFp8Block + r) * ld + cb * kFp8Block, &block[static_cast<size_t>(r * kFp8Block)], kFp8Block);
      out.s[static_cast<size_t>(rb * (cols / kFp8Block) + cb)] = quantize_block(block.data(), qb.data(), kFp8Block * kFp8Block, pow2);
      for (int64_t r = 0; r < kFp8Block; ++r)
        std::memcpy(&out.q[static_cast<size_t>((rb * kFp8Block + r) * cols + cb * kFp8Block)],
                    &qb[static_cast<size_t>(r * kFp8Block)], sizeof(float) * kFp8Block);
    }
  return out;
}

// Row vector v [n] (n % 128 == 0) quantised per 128: values q, scales s [n / 128]
void quantize_row(const float* v, int64_t n, float* q, float* s, bool pow2) {
  for (int64_t kb = 0; kb < n / kFp8Block; ++kb)
    s[kb] = quantize_block(v + kb * kFp8Block, q + kb * kFp8Block, kFp8Block, pow2);
}

// Σ over k-blocks of fma(the k-block's e4m3 dot product (fixed order, fp32), sa[kb] · sb, acc):
// one output of a block-scaled GEMM (row r of b's matrix)
float dot_block_scaled(const float* qa, const float* sa, const BlockQuantized& b, int64_t r, int64_t n) {
  float acc = 0.0f;
  const float* qb = b.row(r);
  for (int64_t kb = 0; kb < n / kFp8Block; ++kb) {
    const float part = dot_lanes([qa, kb](int64_t i) { return qa[kb * kFp8Block + i]; },
                                 [qb, kb](int64_t i) { return qb[kb * kFp8Block + i]; }, kFp8Block);
    acc = std::fma(part, sa[kb] * b.scale(r, kb), acc);
  }
  return acc;
}

// One expert's weights as row-major matrices: gate/up [I, H], down [H, I], rows *_ld elements
// apart (column-major weights are read through row-major copies in `packed`).
struct Expert {
  const bf16_t* gate;
  const bf16_t* up;
  const bf16_t* down;
  int64_t inter;
  int64_t gate_ld, up_ld, down_ld;
  std::vector<bf16_t> packed[3];
  // gate/up/down may point into packed: a move keeps its buffers, a copy would not
  Expert() = default;
  Expert(Expert&&) = default;
  Expert(const Expert&) = delete;
};

// Expert e of a stack of [rows, cols] matrices at `base` with strides s.
template <typename T>
T* matrix_of(T* base, const MatrixStrides& s, int64_t e, int64_t rows, int64_t cols) {
  return base ? base + e * s.expert_or(rows, cols) : nullptr;
}

// The rows of one [rows, cols] weight, each contiguous, *ld elements apart: the weight itself
// when it is row-major, else its row-major copy in `copy`.  Every dot product then reads the
// same values in the same order: a column-major weight gives the bits of its row-major copy.
const bf16_t* rows_of(const bf16_t* m, const MatrixStrides& s, int64_t rows, int64_t cols, std::vector<bf16_t>& copy,
                      int64_t* ld) {
  if (m == nullptr || !s.col_major()) {
    *ld = s.row_or(cols);
    return m;
  }
  copy.resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) copy[static_cast<size_t>(r * cols + c)] = m[s.at(r, c, cols)];
  *ld = cols;
  return copy.data();
}

// Expert e's weights (routed: e of the stacks; shared: the matrices themselves, e = 0).
Expert expert_of(const RankInputs& rk, const LayerDims& d, int64_t e, bool shared) {
  const int64_t H = d.hidden, I = shared ? d.shared_intermediate : d.intermediate;
  const WeightStrides& s = rk.strides;
  const MatrixStrides& sg = shared ? s.ws_gate : s.w_gate;
  const MatrixStrides& su = shared ? s.ws_up : s.w_up;
  const MatrixStrides& sd = shared ? s.ws_down : s.w_down;
  Expert ex;
  ex.inter = I;
  ex.gate = rows_of(matrix_of(shared ? rk.ws_gate : rk.w_gate, sg, e, I, H), sg, I, H, ex.packed[0], &ex.gate_ld);
  ex.up = rows_of(matrix_of(shared ? rk.ws_up : rk.w_up, su, e, I, H), su, I, H, ex.packed[1], &ex.up_ld);
  ex.down = rows_of(matrix_of(shared ? rk.ws_down : rk.w_down, sd, e, H, I), sd, H, I, ex.packed[2], &ex.down_ld);
  return ex;
}

// One row an expert processes: source rank, token, route j (-1 = shared expert), weight.
struct Row {
  int32_t rank;
  int32_t slot;
  int64_t token;
  float weight;
};

plan::RoutingView routing_of(const LayerDims& d, const std::vector<RankInputs>& ranks) {
  plan::RoutingView v;
  v.num_ranks = static_cast<int32_t>(ranks.size());
  v.topk = static_cast<int32_t>(d.topk);
  v.num_experts = d.num_experts;
  v.ids_are_int64 = ranks.empty() ? 0 : ranks[0].ids_are_int64;
  for (size_t s = 0; s < ranks.size(); ++s) {
    v.ids[s] = ranks[s].topk_ids;
    v.num_tokens[s] = ranks[s].num_tokens;
  }
  return v;
}

// Rows of each local expert of rank r, in plan order (the plan with block_m = 1: the
// reference needs no padding).
std::vector<std::vector<Row>> expert_rows(const LayerDims& d, const std::vector<RankInputs>& ranks,
                                          const plan::RoutingView& v, int r) {
  plan::PlanDims pd;
  pd.num_ranks = static_cast<int32_t>(d.ep_size);
  pd.rank = r;
  pd.num_experts = d.num_experts;
  pd.topk = static_cast<int32_t>(d.topk);
  pd.block_m = 1;
  int64_t t_max = 0;
  for (const auto& rk : ranks) t_max = std::max(t_max, rk.num_tokens);
  pd.max_tokens = t_max;
  pd.minibatch_size = 1;
  pd.macrobatch_size = 1;
  const int64_t num_local = d.local_experts();
  std::vector<uint32_t> rows(static_cast<size_t>(plan::max_rows(pd)));
  std::vector<int32_t> count(static_cast<size_t>(num_local)), offset(static_cast<size_t>(num_local + 1));
  std::vector<int32_t> block_expert(static_cast<size_t>(plan::max_blocks(pd)));
  plan::build_plan_host(pd, v, plan::PlanView{rows.data(), count.data(), offset.data(), block_expert.data()},
                        nullptr);
  std::vector<std::vector<Row>> out(static_cast<size_t>(num_local));
  for (int64_t e = 0; e < num_local; ++e) {
    for (int64_t i = offset[e]; i < offset[e] + count[e]; ++i) {
      const uint32_t rec = rows[static_cast<size_t>(i)];
      const int s = row_rank(rec), j = row_slot(rec);
      const int64_t t = row_token(rec);
      out[static_cast<size_t>(e)].push_back(
          Row{s, j, t, ranks[static_cast<size_t>(s)].topk_weights[t * d.topk + j]});
    }
  }
  return out;
}

std::vector<Row> shared_rows(const RankInputs& rk, int s) {
  std::vector<Row> rows(static_cast<size_t>(rk.num_tokens));
  for (int64_t t = 0; t < rk.num_tokens; ++t) rows[static_cast<size_t>(t)] = Row{s, -1, t, 1.0f};
  return rows;
}

// Forward of one expert over its rows; row i's output goes to dst(row).
template <typename Dst>
void expert_forward(const Expert& ex, const std::vector<Row>& rows, const std::vector<RankInputs>& ranks,
                    int64_t hidden, Dst dst, int num_threads) {
  const int64_t inter = ex.inter;
  parallel_for(static_cast<int64_t>(rows.size()), num_threads, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(static_cast<size_t>(hidden)), af(static_cast<size_t>(inter));
    for (int64_t ri = begin; ri < end; ++ri) {
      const Row& row = rows[static_cast<size_t>(ri)];
      to_float(ranks[static_cast<size_t>(row.rank)].x + row.token * hidden, xf.data(), hidden);
      for (int64_t i = 0; i < inter; ++i) {
        const float g = dot_f_bf(xf.data(), ex.gate + i * ex.gate_ld, hidden);
        const float u = dot_f_bf(xf.data(), ex.up + i * ex.up_ld, hidden);
        af[static_cast<size_t>(i)] = bf16_to_float(float_to_bf16(silu(g) * u));
      }
      bf16_t* out = dst(row);
      for (int64_t h = 0; h < hidden; ++h)
        out[h] = float_to_bf16(dot_f_bf(af.data(), ex.down + h * ex.down_ld, inter));
    }
  });
}

// The same in fp8_block (docs/precision.md): the row's x quantised per 128 of H, the weights
// per 128 x 128 block, g and u block-scaled, a = silu(g) · u in fp32 quantised per 128 of I,
// the output row block-scaled and rounded to bf16 once.
template <typename Dst>
void expert_forward_fp8(const Expert& ex, const std::vector<Row>& rows, const std::vector<RankInputs>& ranks,
                        int64_t hidden, bool pow2, Dst dst, int num_threads) {
  const int64_t inter = ex.inter;
  if (rows.empty()) return;
  const BlockQuantized gate = quantize_matrix(ex.gate, inter, hidden, ex.gate_ld, pow2),
                       up = quantize_matrix(ex.up, inter, hidden, ex.up_ld, pow2),
                       down = quantize_matrix(ex.down, hidden, inter, ex.down_ld, pow2);
  parallel_for(static_cast<int64_t>(rows.size()), num_threads, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(static_cast<size_t>(hidden)), qx(xf.size()), sx(static_cast<size_t>(hidden / kFp8Block));
    std::vector<float> af(static_cast<size_t>(inter)), qa(af.size()), sa(static_cast<size_t>(inter / kFp8Block));
    for (int64_t ri = begin; ri < end; ++ri) {
      const Row& row = rows[static_cast<size_t>(ri)];
      to_float(ranks[static_cast<size_t>(row.rank)].x + row.token * hidden, xf.data(), hidden);
      quantize_row(xf.data(), hidden, qx.data(), sx.data(), pow2);
      for (int64_t i = 0; i < inter; ++i) {
        const float g = dot_block_scaled(qx.data(), sx.data(), gate, i, hidden);
        const float u = dot_block_scaled(qx.data(), sx.data(), up, i, hidden);
        af[static_cast<size_t>(i)] = silu(g) * u;
      }
      quantize_row(af.data(), inter, qa.data(), sa.data(), pow2);
      bf16_t* out = dst(row);
      for (int64_t h = 0; h < hidden; ++h) out[h] = float_to_bf16(dot_block_scaled(qa.data(), sa.data(), down, h, inter));
    }
  });
}

// The expert's forward in the layer's precision
template <typename Dst>
void expert_forward_in(const LayerDims& d, const Expert& ex, const std::vector<Row>& rows,
                       const std::vector<RankInputs>& ranks, Dst dst, int num_threads) {
  if (d.fp8_block) expert_forward_fp8(ex, rows, ranks, d.hidden, d.fp8_pow2, dst, num_threads);
  else expert_forward(ex, rows, ranks, d.hidden, dst, num_threads);
}

bool route_ok(const plan::RoutingView& v, int s, int64_t t, int j) {
  int64_t id;
  return plan::check_route(v, s, t, j, &id) == RouteCheck::kOk;
}

// Transpose [rows, cols] bf16 (rows ld elements apart) -> [cols, rows].
std::vector<bf16_t> transpose(const bf16_t* src, int64_t rows, int64_t cols, int64_t ld) {
  std::vector<bf16_t> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[static_cast<size_t>(c * rows + r)] = src[r * ld + c];
  return out;
}

// Where one expert's weight gradients go: a bf16 matrix and an optional fp32 main_grad, each
// written in place through its own strides (row- or column-major).
struct GradOut {
  bf16_t* out;
  MatrixStrides out_s;
  float* main;  // optional (+=)
  MatrixStrides main_s;
};
struct ExpertGradOut {
  GradOut gate;  // [I, H]
  GradOut up;    // [I, H]
  GradOut down;  // [H, I]
};

// Expert e's gradient targets (shared: the matrices themselves, e = 0).
ExpertGradOut grad_out_of(const RankGrads& g, const LayerDims& d, int64_t e, bool shared) {
  const int64_t H = d.hidden, I = shared ? d.shared_intermediate : d.intermediate;
  const WeightStrides &gs = g.grad_strides, &ms = g.main_strides;
  auto at = [&](bf16_t* out, float* main, const MatrixStrides& so, const MatrixStrides& sm, int64_t rows,
                int64_t cols) {
    return GradOut{matrix_of(out, so, e, rows, cols), so, matrix_of(main, sm, e, rows, cols), sm};
  };
  if (shared)
    return ExpertGradOut{at(g.dws_gate, g.main_s_gate, gs.ws_gate, ms.ws_gate, I, H),
                         at(g.dws_up, g.main_s_up, gs.ws_up, ms.ws_up, I, H),
                         at(g.dws_down, g.main_s_down, gs.ws_down, ms.ws_down, H, I)};
  return ExpertGradOut{at(g.dw_gate, g.main_gate, gs.w_gate, ms.w_gate, I, H),
                       at(g.dw_up, g.main_up, gs.w_up, ms.w_up, I, H),
                       at(g.dw_down, g.main_down, gs.w_down, ms.w_down, H, I)};
}

// acc [rows, cols] into its target: out = bf16(acc), main += acc.
void store_grad(const std::vector<float>& acc, int64_t rows, int64_t cols, const GradOut& to) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = acc[static_cast<size_t>(r * cols + c)];
      to.out[to.out_s.at(r, c, cols)] = float_to_bf16(v);
      if (to.main) {
        float& m = to.main[to.main_s.at(r, c, cols)];
        m = m + v;
      }
    }
}

// Backward of one expert over its rows.  dx_dst(row) gets the row's dx contribution;
// dw_dst(row) (may return null) gets d topk_weight.
template <typename DxDst, typename DwDst>
void expert_backward(const Expert& ex, const std::vector<Row>& rows, const std::vector<RankInputs>& ranks,
                     const std::vector<const bf16_t*>& dy, int64_t hidden, DxDst dx_dst, DwDst dw_dst,
                     const ExpertGradOut& gout, int num_threads) {
  const int64_t inter = ex.inter, num_rows = static_cast<int64_t>(rows.size());
  const std::vector<bf16_t> down_t = transpose(ex.down, hidden, inter, ex.down_ld);  // [I, H]
  // [H, 2I]: row h = (w_gate[:, h], w_up[:, h]), the K of the gate/up dgrad.
  std::vector<bf16_t> gu_t(static_cast<size_t>(hidden * 2 * inter));
  for (int64_t i = 0; i < inter; ++i)
    for (int64_t h = 0; h < hidden; ++h) {
      gu_t[static_cast<size_t>(h * 2 * inter + i)] = ex.gate[i * ex.gate_ld + h];
      gu_t[static_cast<size_t>(h * 2 * inter + inter + i)] = ex.up[i * ex.up_ld + h];
    }
  // Per-row operands of the weight-gradient sums, as the GEMMs would read them (bf16).
  std::vector<float> xs(static_cast<size_t>(num_rows * hidden)), dys(static_cast<size_t>(num_rows * hidden));
  std::vector<float> aws(static_cast<size_t>(num_rows * inter)), dgs(static_cast<size_t>(num_rows * inter)),
      dus(static_cast<size_t>(num_rows * inter));

  parallel_for(num_rows, num_threads, [&](int64_t begin, int64_t end) {
    std::vector<float> gf(static_cast<size_t>(inter)), uf(static_cast<size_t>(inter)),
        daf(static_cast<size_t>(inter)), dguf(static_cast<size_t>(2 * inter));
    for (int64_t ri = begin; ri < end; ++ri) {
      const Row& row = rows[static_cast<size_t>(ri)];
      float* xf = &xs[static_cast<size_t>(ri * hidden)];
      float* dyf = &dys[static_cast<size_t>(ri * hidden)];
      to_float(ranks[static_cast<size_t>(row.rank)].x + row.token * hidden, xf, hidden);
      to_float(dy[static_cast<size_t>(row.rank)] + row.token * hidden, dyf, hidden);
      // Recompute gate/up (fp32, rounded to bf16 below); unweighted dgrad of down.
      float dw = 0.f;
      float dw_acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int64_t i = 0; i < inter; ++i) {
        gf[static_cast<size_t>(i)] = dot_f_bf(xf, ex.gate + i * ex.gate_ld, hidden);
        uf[static_cast<size_t>(i)] = dot_f_bf(xf, ex.up + i * ex.up_ld, hidden);
        daf[static_cast<size_t>(i)] = dot_f_bf(dyf, &down_t[static_cast<size_t>(i * hidden)], hidden);
      }
      // SwiGLU backward with the router-weight gradient fused in, from h = [g | u] rounded to
      // bf16 as the CUDA backward saves it (bwd.h): the expressions and their order are those
      // of the dgrad-down epilogue (src/cuda/gemm/epilogue_bwd.cuh), which uses __expf for exp.
      // `a` is recomputed from the rounded g, u (it can differ from the forward's a, which
      // rounds silu(g)·u of the fp32 g, u, in its last bf16 bit).
      for (int64_t i = 0; i < inter; ++i) {
        const float g = bf16_round(gf[static_cast<size_t>(i)]), u = bf16_round(uf[static_cast<size_t>(i)]);
        const float sg = sigmoid(g);
        const float sl = g * sg;
        const float a = bf16_round(sl * u);
        const float da = daf[static_cast<size_t>(i)];
        dw_acc[i % kLanes] = dw_acc[i % kLanes] + da * a;
        const float wda = row.weight * da;
        const float dsilu = sg * (1.0f + g * (1.0f - sg));
        const float dg = bf16_round((wda * u) * dsilu);
        const float du = bf16_round(wda * sl);
        dguf[static_cast<size_t>(i)] = dg;
        dguf[static_cast<size_t>(inter + i)] = du;
        dgs[static_cast<size_t>(ri * inter + i)] = dg;
        dus[static_cast<size_t>(ri * inter + i)] = du;
        aws[static_cast<size_t>(ri * inter + i)] = bf16_round(row.weight * a);
      }
      dw = ((dw_acc[0] + dw_acc[1]) + (dw_acc[2] + dw_acc[3])) +
           ((dw_acc[4] + dw_acc[5]) + (dw_acc[6] + dw_acc[7]));
      if (float* d = dw_dst(row)) *d = dw;
      // dgrad of gate/up: one K = 2I reduction.
      bf16_t* dx = dx_dst(row);
      for (int64_t h = 0; h < hidden; ++h)
        dx[h] = float_to_bf16(dot_f_bf(dguf.data(), &gu_t[static_cast<size_t>(h * 2 * inter)], 2 * inter));
    }
  });

  // Weight gradients: fp32 sums over the rows in plan order; threads split output rows.
  std::vector<float> acc_down(static_cast<size_t>(hidden * inter), 0.f);
  std::vector<float> acc_gate(static_cast<size_t>(inter * hidden), 0.f), acc_up(acc_gate.size(), 0.f);
  parallel_for(hidden, num_threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < num_rows; ++r)
      for (int64_t h = begin; h < end; ++h) {
        const float d = dys[static_cast<size_t>(r * hidden + h)];
        float* acc = &acc_down[static_cast<size_t>(h * inter)];
        const float* aw = &aws[static_cast<size_t>(r * inter)];
        for (int64_t i = 0; i < inter; ++i) acc[i] = acc[i] + d * aw[i];
      }
  });
  parallel_for(inter, num_threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < num_rows; ++r)
      for (int64_t i = begin; i < end; ++i) {
        const float dg = dgs[static_cast<size_t>(r * inter + i)];
        const float du = dus[static_cast<size_t>(r * inter + i)];
        float* ag = &acc_gate[static_cast<size_t>(i * hidden)];
        float* au = &acc_up[static_cast<size_t>(i * hidden)];
        const float* x = &xs[static_cast<size_t>(r * hidden)];
        for (int64_t h = 0; h < hidden; ++h) {
          ag[h] = ag[h] + dg * x[h];
          au[h] = au[h] + du * x[h];
        }
      }
  });
  store_grad(acc_gate, inter, hidden, gout.gate);
  store_grad(acc_up, inter, hidden, gout.up);
  store_grad(acc_down, hidden, inter, gout.down);
}

// The transpose of a block-quantised matrix: the same values and the same block scales,
// transposed (a 128 x 128 block's scale is its transpose's), what the dgrad GEMMs read
BlockQuantized transposed(const BlockQuantized& m, int64_t rows) {
  const int64_t cols = m.cols, rb = rows / kFp8Block, cb = cols / kFp8Block;
  BlockQuantized t;
  t.cols = rows;
  t.q.resize(m.q.size());
  t.s.resize(m.s.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t.q[static_cast<size_t>(c * rows + r)] = m.q[static_cast<size_t>(r * cols + c)];
  for (int64_t i = 0; i < rb; ++i)
    for (int64_t j = 0; j < cb; ++j) t.s[static_cast<size_t>(j * rb + i)] = m.s[static_cast<size_t>(i * cb + j)];
  return t;
}

// One weight gradient of fp8_block's wgrad, K = the expert's rows: out[m, n] = Σ over chunks c
// of 128 rows (plan order; the last may be partial: zeros) of fma(Σ over the chunk's rows of
// qa[m, r] · qb[n, r] (fixed order, fp32), sa[m, c] · sb[n, c], acc), with a [rows, M] and
// b [rows, N] quantised per column and chunk (per 128 tokens of one expert) from their fp32
// values.  Threads split m.
std::vector<float> wgrad_fp8(const std::vector<float>& a, int64_t M, const std::vector<float>& b, int64_t N,
                             int64_t rows, bool pow2, int num_threads) {
  const int64_t chunks = (rows + kFp8Block - 1) / kFp8Block;
  // Column-major quantised copies: [M][chunks * 128] values, [M][chunks] scales
  auto quantize_columns = [&](const std::vector<float>& v, int64_t cols, std::vector<float>* q, std::vector<float>* s) {
    q->assign(static_cast<size_t>(cols * chunks * kFp8Block), 0.f);
    s->assign(static_cast<size_t>(cols * chunks), 1.f);
    std::vector<float> col(static_cast<size_t>(kFp8Block));
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t ch = 0; ch < chunks; ++ch) {
        for (int64_t r = 0; r < kFp8Block; ++r) {
          const int64_t row = ch * kFp8Block + r;
          col[static_cast<size_t>(r)] = row < rows ? v[static_cast<size_t>(row * cols + c)] : 0.f;
        }
        (*s)[static_cast<size_t>(c * chunks + ch)] =
            quantize_block(col.data(), &(*q)[static_cast<size_t>((c * chunks + ch) * kFp8Block)], kFp8Block, pow2);
      }
  };
  std::vector<float> qa, sa, qb, sb;
  quantize_columns(a, M, &qa, &sa);
  quantize_columns(b, N, &qb, &sb);
  std::vector<float> out(static_cast<size_t>(M * N), 0.f);
  parallel_for(M, num_threads, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t n = 0; n < N; ++n) {
        float acc = 0.f;
        for (int64_t ch = 0; ch < chunks; ++ch) {
          const float* x = &qa[static_cast<size_t>((m * chunks + ch) * kFp8Block)];
          const float* y = &qb[static_cast<size_t>((n * chunks + ch) * kFp8Block)];
          const float part = dot_lanes([x](int64_t i) { return x[i]; }, [y](int64_t i) { return y[i]; }, kFp8Block);
          acc = std::fma(part, sa[static_cast<size_t>(m * chunks + ch)] * sb[static_cast<size_t>(n * chunks + ch)], acc);
        }
        out[static_cast<size_t>(m * N + n)] = acc;
      }
  });
  return out;
}

// fp8_block's backward of one expert over its rows (docs/precision.md), the forward's roundings
// replayed: per row, x per 128 of H, g and u block-scaled, h = bf16(g) | bf16(u) (what the
// forward saves); dy per 128 of H; da = dy · W_down block-scaled (W_down's transpose, the same
// block scales); the SwiGLU backward in fp32 from da and h; d topk_weight = Σ da · a_deq (a =
// silu(g)·u from h, quantised per 128 of I as the forward does, dequantised: the a the forward
// multiplied); dh = [dg | du] per 128 of 2I; dx = dh · [W_gate; W_up] block-scaled (K = 2I), bf16.
// Weight gradients over the expert's rows, 128 at a time (wgrad_fp8): dW_down from w·dy and a,
// dW_gate / dW_up from dg / du and x, each operand quantised per column from its value as the
// kernels keep it: x bf16 (as given), w·dy fp32 (w times the bf16 dy), a, dg and du rounded to
// bf16 first (the dgrad-down epilogue writes them in bf16; docs/precision.md).
template <typename DxDst, typename DwDst>
void expert_backward_fp8(const Expert& ex, const std::vector<Row>& rows, const std::vector<RankInputs>& ranks,
                         const std::vector<const bf16_t*>& dy, int64_t hidden, bool pow2, DxDst dx_dst, DwDst dw_dst,
                         const ExpertGradOut& gout, int num_threads) {
  const int64_t inter = ex.inter, num_rows = static_cast<int64_t>(rows.size());
  const BlockQuantized gate = quantize_matrix(ex.gate, inter, hidden, ex.gate_ld, pow2),
                       up = quantize_matrix(ex.up, inter, hidden, ex.up_ld, pow2),
                       down = quantize_matrix(ex.down, hidden, inter, ex.down_ld, pow2);
  const BlockQuantized down_t = transposed(down, hidden);                           // [I, H]
  const BlockQuantized gate_t = transposed(gate, inter), up_t = transposed(up, inter);  // [H, I] each
  // The wgrad operands, fp32, row-major [rows, cols]
  std::vector<float> xs(static_cast<size_t>(num_rows * hidden)), wdys(xs.size());
  std::vector<float> as(static_cast<size_t>(num_rows * inter)), dgs(as.size()), dus(as.size());
  parallel_for(num_rows, num_threads, [&](int64_t begin, int64_t end) {
    const int64_t kb_h = hidden / kFp8Block, kb_i = inter / kFp8Block;
    std::vector<float> qx(static_cast<size_t>(hidden)), sx(static_cast<size_t>(kb_h)), dyf(qx.size()), qdy(qx.size()),
        sdy(sx.size());
    std::vector<float> af(static_cast<size_t>(inter)), qa(af.size()), sa(static_cast<size_t>(kb_i));
    std::vector<float> dh(static_cast<size_t>(2 * inter)), qdh(dh.size()), sdh(static_cast<size_t>(2 * kb_i));
    for (int64_t ri = begin; ri < end; ++ri) {
      const Row& row = rows[static_cast<size_t>(ri)];
      float* xf = &xs[static_cast<size_t>(ri * hidden)];
      to_float(ranks[static_cast<size_t>(row.rank)].x + row.token * hidden, xf, hidden);
      to_float(dy[static_cast<size_t>(row.rank)] + row.token * hidden, dyf.data(), hidden);
      quantize_row(xf, hidden, qx.data(), sx.data(), pow2);
      quantize_row(dyf.data(), hidden, qdy.data(), sdy.data(), pow2);
      float dw_acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      std::vector<float> gs(static_cast<size_t>(inter)), us(gs.size()), das(gs.size()), sls(gs.size()), sgs(gs.size());
      for (int64_t i = 0; i < inter; ++i) {
        const float g = bf16_round(dot_block_scaled(qx.data(), sx.data(), gate, i, hidden));
        const float u = bf16_round(dot_block_scaled(qx.data(), sx.data(), up, i, hidden));
        const float sg = sigmoid(g);
        gs[static_cast<size_t>(i)] = g;
        us[static_cast<size_t>(i)] = u;
        sgs[static_cast<size_t>(i)] = sg;
        sls[static_cast<size_t>(i)] = g * sg;
        af[static_cast<size_t>(i)] = (g * sg) * u;
        das[static_cast<size_t>(i)] = dot_block_scaled(qdy.data(), sdy.data(), down_t, i, hidden);
      }
      quantize_row(af.data(), inter, qa.data(), sa.data(), pow2);
      for (int64_t i = 0; i < inter; ++i) {
        const size_t ii = static_cast<size_t>(i);
        const float a_deq = qa[ii] * sa[static_cast<size_t>(i / kFp8Block)];
        const float da = das[ii], g = gs[ii], u = us[ii], sg = sgs[ii], sl = sls[ii];
        dw_acc[i % kLanes] = dw_acc[i % kLanes] + da * a_deq;
        const float wda = row.weight * da;
        const float dsilu = sg * (1.0f + g * (1.0f - sg));
        dh[ii] = (wda * u) * dsilu;
        dh[static_cast<size_t>(inter) + ii] = wda * sl;
        // (the wgrad operands a, dg, du as the kernels keep them between their GEMMs: bf16)
        as[static_cast<size_t>(ri * inter) + ii] = bf16_round(af[ii]);
        dgs[static_cast<size_t>(ri * inter) + ii] = bf16_round(dh[ii]);
        dus[static_cast<size_t>(ri * inter) + ii] = bf16_round(dh[static_cast<size_t>(inter) + ii]);
      }
      for (int64_t h = 0; h < hidden; ++h) wdys[static_cast<size_t>(ri * hidden + h)] = row.weight * dyf[static_cast<size_t>(h)];
      if (float* d = dw_dst(row))
        *d = ((dw_acc[0] + dw_acc[1]) + (dw_acc[2] + dw_acc[3])) + ((dw_acc[4] + dw_acc[5]) + (dw_acc[6] + dw_acc[7]));
      // dgrad of gate/up, K = 2I: the gate k-blocks (W_gate's transpose), then the up ones
      quantize_row(dh.data(), 2 * inter, qdh.data(), sdh.data(), pow2);
      bf16_t* dx = dx_dst(row);
      for (int64_t h = 0; h < hidden; ++h) {
        const float g_part = dot_block_scaled(qdh.data(), sdh.data(), gate_t, h, inter);
        // continue the same accumulator over the up k-blocks: fma in k-block order from g_part
        float acc = g_part;
        const float* qb = up_t.row(h);
        for (int64_t kb = 0; kb < kb_i; ++kb) {
          const float* qa_up = qdh.data() + inter + kb * kFp8Block;
          const float part = dot_lanes([qa_up](int64_t i) { return qa_up[i]; },
                                       [qb, kb](int64_t i) { return qb[kb * kFp8Block + i]; }, kFp8Block);
          acc = std::fma(part, sdh[static_cast<size_t>(kb_i + kb)] * up_t.scale(h, kb), acc);
        }
        dx[h] = float_to_bf16(acc);
      }
    }
  });
  store_grad(wgrad_fp8(wdys, hidden, as, inter, num_rows, pow2, num_threads), hidden, inter, gout.down);
  store_grad(wgrad_fp8(dgs, inter, xs, hidden, num_rows, pow2, num_threads), inter, hidden, gout.gate);
  store_grad(wgrad_fp8(dus, inter, xs, hidden, num_rows, pow2, num_threads), inter, hidden, gout.up);
}

// The expert's backward in the layer's precision
template <typename DxDst, typename DwDst>
void expert_backward_in(const LayerDims& d, const Expert& ex, const std::vector<Row>& rows,
                        const std::vector<RankInputs>& ranks, const std::vector<const bf16_t*>& dy, DxDst dx_dst,
                        DwDst dw_dst, const ExpertGradOut& gout, int num_threads) {
  if (d.fp8_block)
    expert_backward_fp8(ex, rows, ranks, dy, d.hidden, d.fp8_pow2, dx_dst, dw_dst, gout, num_threads);
  else
    expert_backward(ex, rows, ranks, dy, d.hidden, dx_dst, dw_dst, gout, num_threads);
}

}  // namespace

float e4m3_round(float v) {
  if (std::isnan(v)) return v;
  const float a = std::fabs(v);
  if (a >= 448.0f) return std::copysign(448.0f, v);
  if (a == 0.0f) return v;
  int e = 0;
  std::frexp(a, &e);                                    // a in [2^(e-1), 2^e)
  const int binade = e - 1 < -6 ? -6 : e - 1;           // subnormals: 2^-6's spacing
  const float step = std::ldexp(1.0f, binade - 3);      // three mantissa bits
  const float q = std::nearbyint(a / step) * step;      // ties to even (the default rounding mode)
  return std::copysign(q < 448.0f ? q : 448.0f, v);
}

float quantize_block(const float* v, float* q, int64_t n, bool pow2) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(v[i]));
  float s = amax > 0.0f ? amax / 448.0f : 1.0f;
  if (pow2 && amax > 0.0f) {  // 2^ceil(log2 s): s = m · 2^e, m in [0.5, 1)
    int e = 0;
    const float m = std::frexp(s, &e);
    s = std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
  }
  for (int64_t i = 0; i < n; ++i) q[i] = e4m3_round(v[i] / s);
  return s;
}

float dot_fixed(const float* a, const float* b, int64_t n) {
  return dot_lanes([a](int64_t i) { return a[i]; }, [b](int64_t i) { return b[i]; }, n);
}

void forward(const LayerDims& d, const std::vector<RankInputs>& ranks, const std::vector<bf16_t*>& y,
             int num_threads) {
  const int64_t H = d.hidden, k = d.topk, P = d.ep_size;
  const plan::RoutingView v = routing_of(d, ranks);
  // Home slots: one bf16 row per route (token*k + j) and one per token for the shared expert.
  std::vector<std::vector<bf16_t>> slots(static_cast<size_t>(P)), shared(static_cast<size_t>(P));
  for (int64_t s = 0; s < P; ++s) {
    slots[static_cast<size_t>(s)].assign(static_cast<size_t>(ranks[s].num_tokens * k * H), 0);
    if (d.shared_intermediate > 0)
      shared[static_cast<size_t>(s)].assign(static_cast<size_t>(ranks[s].num_tokens * H), 0);
  }
  // Each expert-owning rank pulls its rows and pushes outputs home.
  for (int64_t r = 0; r < P; ++r) {
    const auto rows = expert_rows(d, ranks, v, static_cast<int>(r));
    for (int64_t e = 0; e < d.local_experts(); ++e) {
      const Expert ex = expert_of(ranks[static_cast<size_t>(r)], d, e, false);
      expert_forward_in(d, ex, rows[static_cast<size_t>(e)], ranks,
                        [&](const Row& row) {
                          return &slots[static_cast<size_t>(row.rank)][static_cast<size_t>((row.token * k + row.slot) * H)];
                        },
                        num_threads);
    }
  }
  for (int64_t s = 0; s < P; ++s) {
    if (d.shared_intermediate <= 0) break;
    const RankInputs& rk = ranks[static_cast<size_t>(s)];
    const Expert ex = expert_of(rk, d, 0, true);
    expert_forward_in(d, ex, shared_rows(rk, static_cast<int>(s)), ranks,
                      [&](const Row& row) { return &shared[static_cast<size_t>(s)][static_cast<size_t>(row.token * H)]; },
                      num_threads);
  }
  // Home reduction: ascending j, shared last, one rounding.
  for (int64_t s = 0; s < P; ++s) {
    const RankInputs& rk = ranks[static_cast<size_t>(s)];
    parallel_for(rk.num_tokens, num_threads, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(static_cast<size_t>(H));
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < k; ++j) {
          if (!route_ok(v, static_cast<int>(s), t, static_cast<int>(j))) continue;
          const float w = rk.topk_weights[t * k + j];
          const bf16_t* o = &slots[static_cast<size_t>(s)][static_cast<size_t>((t * k + j) * H)];
          for (int64_t h = 0; h < H; ++h) acc[static_cast<size_t>(h)] = acc[static_cast<size_t>(h)] + w * bf16_to_float(o[h]);
        }
        if (d.shared_intermediate > 0) {
          const bf16_t* o = &shared[static_cast<size_t>(s)][static_cast<size_t>(t * H)];
          for (int64_t h = 0; h < H; ++h) acc[static_cast<size_t>(h)] = acc[static_cast<size_t>(h)] + bf16_to_float(o[h]);
        }
        for (int64_t h = 0; h < H; ++h) y[static_cast<size_t>(s)][t * H + h] = float_to_bf16(acc[static_cast<size_t>(h)]);
      }
    });
  }
}

void backward(const LayerDims& d, const std::vector<RankInputs>& ranks, const std::vector<const bf16_t*>& dy,
              const std::vector<RankGrads>& grads, int num_threads) {
  const int64_t H = d.hidden, Is = d.shared_intermediate, k = d.topk, P = d.ep_size;
  const plan::RoutingView v = routing_of(d, ranks);
  std::vector<std::vector<bf16_t>> dx_slots(static_cast<size_t>(P)), dx_shared(static_cast<size_t>(P));
  for (int64_t s = 0; s < P; ++s) {
    dx_slots[static_cast<size_t>(s)].assign(static_cast<size_t>(ranks[s].num_tokens * k * H), 0);
    if (Is > 0) dx_shared[static_cast<size_t>(s)].assign(static_cast<size_t>(ranks[s].num_tokens * H), 0);
    // d topk_weights of masked routes are 0; real routes are overwritten below.
    std::fill(grads[s].d_topk_weights, grads[s].d_topk_weights + ranks[s].num_tokens * k, 0.f);
  }
  for (int64_t r = 0; r < P; ++r) {
    const auto rows = expert_rows(d, ranks, v, static_cast<int>(r));
    const RankInputs& owner = ranks[static_cast<size_t>(r)];
    const RankGrads& g = grads[static_cast<size_t>(r)];
    for (int64_t e = 0; e < d.local_experts(); ++e) {
      const Expert ex = expert_of(owner, d, e, false);
      const ExpertGradOut gout = grad_out_of(g, d, e, false);
      expert_backward_in(
          d, ex, rows[static_cast<size_t>(e)], ranks, dy,
          [&](const Row& row) {
            return &dx_slots[static_cast<size_t>(row.rank)][static_cast<size_t>((row.token * k + row.slot) * H)];
          },
          [&](const Row& row) { return &grads[static_cast<size_t>(row.rank)].d_topk_weights[row.token * k + row.slot]; },
          gout, num_threads);
    }
  }
  for (int64_t s = 0; s < P && Is > 0; ++s) {
    const RankInputs& rk = ranks[static_cast<size_t>(s)];
    const RankGrads& g = grads[static_cast<size_t>(s)];
    const Expert ex = expert_of(rk, d, 0, true);
    const ExpertGradOut gout = grad_out_of(g, d, 0, true);
    expert_backward_in(
        d, ex, shared_rows(rk, static_cast<int>(s)), ranks, dy,
        [&](const Row& row) { return &dx_shared[static_cast<size_t>(s)][static_cast<size_t>(row.token * H)]; },
        [](const Row&) -> float* { return nullptr; }, gout, num_threads);
  }
  for (int64_t s = 0; s < P; ++s) {
    const RankInputs& rk = ranks[static_cast<size_t>(s)];
    bf16_t* dx = grads[static_cast<size_t>(s)].dx;
    parallel_for(rk.num_tokens, num_threads, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(static_cast<size_t>(H));
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < k; ++j) {
          if (!route_ok(v, static_cast<int>(s), t, static_cast<int>(j))) continue;
          const bf16_t* o = &dx_slots[static_cast<size_t>(s)][static_cast<size_t>((t * k + j) * H)];
          for (int64_t h = 0; h < H; ++h) acc[static_cast<size_t>(h)] = acc[static_cast<size_t>(h)] + bf16_to_float(o[h]);
        }
        if (Is > 0) {
          const bf16_t* o = &dx_shared[static_cast<size_t>(s)][static_cast<size_t>(t * H)];
          for (int64_t h = 0; h < H; ++h) acc[static_cast<size_t>(h)] = acc[static_cast<size_t>(h)] + bf16_to_float(o[h]);
        }
        for (int64_t h = 0; h < H; ++h) dx[t * H + h] = float_to_bf16(acc[static_cast<size_t>(h)]);
      }
    });
  }
}

}  // namespace mok::ref
