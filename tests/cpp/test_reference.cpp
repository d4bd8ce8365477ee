// The CPU reference against hand-written double-precision loops, and its bitwise contracts:
// EP=P emulation equals EP=1 per token, thread-count and batch invariance, main_grad.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "ref/reference.hpp"
#include "test_util.hpp"

namespace mok::test {
namespace {

// Everything one emulated EP group needs; rank r owns experts [r*E_l, (r+1)*E_l).
struct Problem {
  ref::LayerDims d;
  std::vector<int64_t> tokens;
  std::vector<std::vector<bf16_t>> x, dy, w_gate, w_up, w_down, ws_gate, ws_up, ws_down;
  std::vector<std::vector<int64_t>> ids;
  std::vector<std::vector<float>> weights;

  std::vector<ref::RankInputs> inputs() const {
    std::vector<ref::RankInputs> in(static_cast<size_t>(d.ep_size));
    for (size_t r = 0; r < in.size(); ++r) {
      in[r].num_tokens = tokens[r];
      in[r].x = x[r].data();
      in[r].topk_ids = ids[r].data();
      in[r].ids_are_int64 = true;
      in[r].topk_weights = weights[r].data();
      in[r].w_gate = w_gate[r].data();
      in[r].w_up = w_up[r].data();
      in[r].w_down = w_down[r].data();
      if (d.shared_intermediate > 0) {
        in[r].ws_gate = ws_gate[r].data();
        in[r].ws_up = ws_up[r].data();
        in[r].ws_down = ws_down[r].data();
      }
    }
    return in;
  }
};

Problem make_problem(uint64_t seed, int64_t P, int64_t H, int64_t I, int64_t Is, int64_t E_l, int64_t k,
                     std::vector<int64_t> tokens, Routing routing) {
  std::mt19937_64 rng(seed);
  Problem p;
  p.d = ref::LayerDims{H, I, Is, E_l * P, k, P};
  p.tokens = tokens;
  const float wscale = 1.0f / std::sqrt(static_cast<float>(H));
  for (int64_t r = 0; r < P; ++r) {
    const size_t T = static_cast<size_t>(tokens[static_cast<size_t>(r)]);
    p.x.push_back(random_bf16(rng, T * H, 1.0f));
    p.dy.push_back(random_bf16(rng, T * H, 1.0f));
    p.ids.push_back(make_ids(rng, static_cast<int64_t>(T), static_cast<int>(k), E_l * P, E_l, routing));
    p.weights.push_back(random_f32(rng, T * k, -0.5f, 1.0f));
    p.w_gate.push_back(random_bf16(rng, static_cast<size_t>(E_l * I * H), wscale));
    p.w_up.push_back(random_bf16(rng, static_cast<size_t>(E_l * I * H), wscale));
    p.w_down.push_back(random_bf16(rng, static_cast<size_t>(E_l * H * I), 1.0f / std::sqrt(static_cast<float>(I))));
  }
  // The shared expert is replicated: every rank holds the same weights.
  const auto sg = random_bf16(rng, static_cast<size_t>(Is * H), wscale);
  const auto su = random_bf16(rng, static_cast<size_t>(Is * H), wscale);
  const auto sd = random_bf16(rng, static_cast<size_t>(H * Is), 1.0f / std::sqrt(static_cast<float>(std::max<int64_t>(Is, 1))));
  p.ws_gate.assign(static_cast<size_t>(P), sg);
  p.ws_up.assign(static_cast<size_t>(P), su);
  p.ws_down.assign(static_cast<size_t>(P), sd);
  return p;
}

// The same tokens and experts at EP=1: tokens concatenated in rank order, experts stacked.
Problem merged(const Problem& p) {
  Problem m;
  m.d = p.d;
  m.d.ep_size = 1;
  int64_t T = 0;
  for (auto t : p.tokens) T += t;
  m.tokens = {T};
  auto cat = [](const std::vector<std::vector<bf16_t>>& parts) {
    std::vector<bf16_t> out;
    for (const auto& v : parts) out.insert(out.end(), v.begin(), v.end());
    return std::vector<std::vector<bf16_t>>{out};
  };
  m.x = cat(p.x);
  m.dy = cat(p.dy);
  m.w_gate = cat(p.w_gate);
  m.w_up = cat(p.w_up);
  m.w_down = cat(p.w_down);
  m.ws_gate = {p.ws_gate[0]};
  m.ws_up = {p.ws_up[0]};
  m.ws_down = {p.ws_down[0]};
  m.ids.resize(1);
  m.weights.resize(1);
  for (size_t r = 0; r < p.ids.size(); ++r) {
    m.ids[0].insert(m.ids[0].end(), p.ids[r].begin(), p.ids[r].end());
    m.weights[0].insert(m.weights[0].end(), p.weights[r].begin(), p.weights[r].end());
  }
  return m;
}

struct Outputs {
  std::vector<std::vector<bf16_t>> y, dx, dw_gate, dw_up, dw_down, dws_gate, dws_up, dws_down;
  std::vector<std::vector<float>> dtopk;
};

Outputs run(const Problem& p, int threads, bool with_backward = true) {
  Outputs o;
  const auto in = p.inputs();
  const int64_t H = p.d.hidden, I = p.d.intermediate, Is = p.d.shared_intermediate, El = p.d.local_experts();
  std::vector<bf16_t*> ys;
  std::vector<const bf16_t*> dys;
  std::vector<ref::RankGrads> g(in.size());
  for (size_t r = 0; r < in.size(); ++r) {
    const size_t T = static_cast<size_t>(p.tokens[r]);
    o.y.emplace_back(T * H, float_to_bf16(NAN));  // poisoned
    o.dx.emplace_back(T * H, float_to_bf16(NAN));
    o.dtopk.emplace_back(T * p.d.topk, NAN);
    o.dw_gate.emplace_back(El * I * H, float_to_bf16(NAN));
    o.dw_up.emplace_back(El * I * H, float_to_bf16(NAN));
    o.dw_down.emplace_back(El * H * I, float_to_bf16(NAN));
    o.dws_gate.emplace_back(Is * H, float_to_bf16(NAN));
    o.dws_up.emplace_back(Is * H, float_to_bf16(NAN));
    o.dws_down.emplace_back(H * Is, float_to_bf16(NAN));
  }
  for (size_t r = 0; r < in.size(); ++r) {
    ys.push_back(o.y[r].data());
    dys.push_back(p.dy[r].data());
    g[r].dx = o.dx[r].data();
    g[r].d_topk_weights = o.dtopk[r].data();
    g[r].dw_gate = o.dw_gate[r].data();
    g[r].dw_up = o.dw_up[r].data();
    g[r].dw_down = o.dw_down[r].data();
    if (Is > 0) {
      g[r].dws_gate = o.dws_gate[r].data();
      g[r].dws_up = o.dws_up[r].data();
      g[r].dws_down = o.dws_down[r].data();
    }
  }
  ref::forward(p.d, in, ys, threads);
  if (with_backward) ref::backward(p.d, in, dys, g, threads);
  return o;
}

double b2d(bf16_t v) { return static_cast<double>(bf16_to_float(v)); }
double bf16_round(double v) { return b2d(float_to_bf16(static_cast<float>(v))); }
double silu_d(double g) { return g / (1.0 + std::exp(-g)); }

// Hand-written loops in double, rounding to bf16 only where contracts §1 puts a stored bf16
// (the intermediate a and each expert output row in forward).
struct Naive {
  std::vector<double> y, dx, dtopk, dw_gate, dw_up, dw_down, dws_gate, dws_up, dws_down;
};

Naive naive_ep1(const Problem& p) {
  const int64_t H = p.d.hidden, I = p.d.intermediate, Is = p.d.shared_intermediate, k = p.d.topk;
  const int64_t E = p.d.num_experts, T = p.tokens[0];
  Naive n;
  n.y.assign(T * H, 0);
  n.dx.assign(T * H, 0);
  n.dtopk.assign(T * k, 0);
  n.dw_gate.assign(E * I * H, 0);
  n.dw_up.assign(E * I * H, 0);
  n.dw_down.assign(E * H * I, 0);
  n.dws_gate.assign(Is * H, 0);
  n.dws_up.assign(Is * H, 0);
  n.dws_down.assign(H * Is, 0);
  // One expert applied to token t with router weight w; accumulates everything.
  auto apply = [&](int64_t t, const bf16_t* wg, const bf16_t* wu, const bf16_t* wd, int64_t inter, double w,
                   double* dtopk, double* gwg, double* gwu, double* gwd) {
    std::vector<double> g(inter), u(inter), a(inter), da(inter, 0.0);
    for (int64_t i = 0; i < inter; ++i) {
      g[i] = u[i] = 0;
      for (int64_t h = 0; h < H; ++h) {
        g[i] += b2d(p.x[0][t * H + h]) * b2d(wg[i * H + h]);
        u[i] += b2d(p.x[0][t * H + h]) * b2d(wu[i * H + h]);
      }
      a[i] = bf16_round(silu_d(g[i]) * u[i]);
    }
    for (int64_t h = 0; h < H; ++h) {
      double o = 0;
      for (int64_t i = 0; i < inter; ++i) o += a[i] * b2d(wd[h * inter + i]);
      n.y[t * H + h] += w * bf16_round(o);
      const double dyh = b2d(p.dy[0][t * H + h]);
      for (int64_t i = 0; i < inter; ++i) {
        da[i] += dyh * b2d(wd[h * inter + i]);
        gwd[h * inter + i] += dyh * w * a[i];
      }
    }
    double dw = 0;
    for (int64_t i = 0; i < inter; ++i) {
      dw += da[i] * a[i];
      const double sg = 1.0 / (1.0 + std::exp(-g[i]));
      const double dg = w * da[i] * u[i] * sg * (1.0 + g[i] * (1.0 - sg));
      const double du = w * da[i] * silu_d(g[i]);
      for (int64_t h = 0; h < H; ++h) {
        n.dx[t * H + h] += dg * b2d(wg[i * H + h]) + du * b2d(wu[i * H + h]);
        gwg[i * H + h] += dg * b2d(p.x[0][t * H + h]);
        gwu[i * H + h] += du * b2d(p.x[0][t * H + h]);
      }
    }
    if (dtopk) *dtopk = dw;
  };
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = p.ids[0][t * k + j];
      if (e < 0) continue;
      apply(t, &p.w_gate[0][e * I * H], &p.w_up[0][e * I * H], &p.w_down[0][e * H * I], I,
            p.weights[0][t * k + j], &n.dtopk[t * k + j], &n.dw_gate[e * I * H], &n.dw_up[e * I * H],
            &n.dw_down[e * H * I]);
    }
    if (Is > 0)
      apply(t, p.ws_gate[0].data(), p.ws_up[0].data(), p.ws_down[0].data(), Is, 1.0, nullptr, n.dws_gate.data(),
            n.dws_up.data(), n.dws_down.data());
  }
  return n;
}

template <typename T>
double to_d(T v) {
  if constexpr (std::is_same_v<T, bf16_t>) return b2d(v); else return static_cast<double>(v);
}

// Relative Frobenius error; also fails on any NaN where the oracle is finite.
template <typename T>
void expect_close(const std::vector<T>& got, const std::vector<double>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double num = 0, den = 0, max_abs = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = to_d(got[i]);
    ASSERT_FALSE(std::isnan(g)) << what << "[" << i << "] is NaN (unwritten?)";
    num += (g - want[i]) * (g - want[i]);
    den += want[i] * want[i];
    max_abs = std::max(max_abs, std::fabs(g - want[i]));
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  EXPECT_LT(rel, tol) << what << ": relative Frobenius error " << rel << ", max-abs " << max_abs;
}

template <typename T>
bool bits_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

TEST(Reference, DotFixedOrder) {
  // Lane 0 holds 1e8 and 1 (fp32 loses the 1), lane 1 holds -1e8: the lane order gives 0,
  // where a left-to-right sum would give 1.  The order is part of the contract.
  std::vector<float> a(16, 0.f), b(16, 1.f);
  a[0] = 1e8f;
  a[1] = -1e8f;
  a[8] = 1.f;
  EXPECT_EQ(ref::dot_fixed(a.data(), b.data(), 16), 0.f);
  float left_to_right = 0.f;
  for (int i = 0; i < 16; ++i) left_to_right = left_to_right + a[i] * b[i];
  EXPECT_EQ(left_to_right, 1.f);
}

TEST(Reference, MatchesHandWrittenLoops) {
  struct Shape { int64_t H, I, Is, E, k, T; Routing routing; };
  const Shape shapes[] = {{32, 16, 0, 4, 2, 17, Routing::kUniform}, {48, 24, 16, 6, 1, 9, Routing::kZipf},
                          {64, 32, 32, 8, 3, 33, Routing::kMasked}, {40, 8, 0, 3, 3, 0, Routing::kUniform},
                          {24, 16, 8, 5, 2, 12, Routing::kOneExpert}};
  for (const auto& s : shapes) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("seed=" + std::to_string(seed) + " H=" + std::to_string(s.H) + " I=" + std::to_string(s.I) +
                 " Is=" + std::to_string(s.Is) + " k=" + std::to_string(s.k) + " T=" + std::to_string(s.T));
    const Problem p = make_problem(seed, 1, s.H, s.I, s.Is, s.E, s.k, {s.T}, s.routing);
    const Outputs o = run(p, 2);
    const Naive n = naive_ep1(p);
    expect_close(o.y[0], n.y, 5e-3, "y");
    expect_close(o.dx[0], n.dx, 1e-2, "dx");
    expect_close(o.dtopk[0], n.dtopk, 1e-2, "d_topk_weights");
    expect_close(o.dw_gate[0], n.dw_gate, 1e-2, "dw_gate");
    expect_close(o.dw_up[0], n.dw_up, 1e-2, "dw_up");
    expect_close(o.dw_down[0], n.dw_down, 1e-2, "dw_down");
    if (s.Is > 0) {
      expect_close(o.dws_gate[0], n.dws_gate, 1e-2, "dws_gate");
      expect_close(o.dws_up[0], n.dws_up, 1e-2, "dws_up");
      expect_close(o.dws_down[0], n.dws_down, 1e-2, "dws_down");
    }
  }
}

// d topk_weights must be exact for w = 0 and w < 0 (MoK divides by w; we do not).
TEST(Reference, RouterGradientForZeroAndNegativeWeights) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  Problem p = make_problem(seed, 1, 32, 16, 0, 4, 2, {10}, Routing::kUniform);
  for (size_t i = 0; i < p.weights[0].size(); ++i) p.weights[0][i] = (i % 3 == 0) ? 0.f : (i % 3 == 1 ? -0.75f : 0.5f);
  const Outputs o = run(p, 1);
  const Naive n = naive_ep1(p);
  for (size_t i = 0; i < n.dtopk.size(); i += 3) ASSERT_NE(n.dtopk[i], 0.0) << "test needs non-zero gradients";
  expect_close(o.dtopk[0], n.dtopk, 1e-2, "d_topk_weights with w in {0, -0.75, 0.5}");
}

TEST(Reference, EmulatedEpEqualsEp1PerTokenBitwise) {
  for (int64_t P : {2, 3, 4}) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("seed=" + std::to_string(seed) + " P=" + std::to_string(P));
    std::mt19937_64 rng(seed);
    std::vector<int64_t> tokens;
    for (int64_t r = 0; r < P; ++r) tokens.push_back(r == 1 ? 0 : 1 + static_cast<int64_t>(rng() % 20));
    const Problem p = make_problem(rng(), P, 32, 16, P == 3 ? 0 : 16, 2, 3, tokens, Routing::kMasked);
    const Outputs ep = run(p, 2);
    const Outputs one = run(merged(p), 2);
    const int64_t H = p.d.hidden, k = p.d.topk;
    int64_t base = 0;
    for (int64_t r = 0; r < P; ++r) {
      const size_t T = static_cast<size_t>(p.tokens[static_cast<size_t>(r)]);
      EXPECT_EQ(0, std::memcmp(ep.y[r].data(), one.y[0].data() + base * H, T * H * 2)) << "y of rank " << r;
      EXPECT_EQ(0, std::memcmp(ep.dx[r].data(), one.dx[0].data() + base * H, T * H * 2)) << "dx of rank " << r;
      EXPECT_EQ(0, std::memcmp(ep.dtopk[r].data(), one.dtopk[0].data() + base * k, T * k * 4)) << "dtopk of rank " << r;
      base += static_cast<int64_t>(T);
    }
    // Routed weight gradients: rank r's experts are the merged run's experts [r*E_l, ...).
    const size_t per = ep.dw_gate[0].size();
    for (int64_t r = 0; r < P; ++r) {
      EXPECT_EQ(0, std::memcmp(ep.dw_gate[r].data(), one.dw_gate[0].data() + r * per, per * 2)) << "dw_gate " << r;
      EXPECT_EQ(0, std::memcmp(ep.dw_up[r].data(), one.dw_up[0].data() + r * per, per * 2)) << "dw_up " << r;
      EXPECT_EQ(0, std::memcmp(ep.dw_down[r].data(), one.dw_down[0].data() + r * per, per * 2)) << "dw_down " << r;
    }
  }
}

TEST(Reference, ThreadCountAndRunToRunInvariance) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  const Problem p = make_problem(seed, 2, 48, 32, 16, 3, 2, {37, 21}, Routing::kZipf);
  const Outputs a = run(p, 1), b = run(p, 3), c = run(p, 3);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_TRUE(bits_equal(a.y[r], b.y[r]) && bits_equal(b.y[r], c.y[r]));
    EXPECT_TRUE(bits_equal(a.dx[r], b.dx[r]) && bits_equal(b.dx[r], c.dx[r]));
    EXPECT_TRUE(bits_equal(a.dtopk[r], b.dtopk[r]));
    EXPECT_TRUE(bits_equal(a.dw_gate[r], b.dw_gate[r]) && bits_equal(a.dw_down[r], b.dw_down[r]));
    EXPECT_TRUE(bits_equal(a.dws_up[r], b.dws_up[r]));
  }
}

TEST(Reference, BatchInvariance) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  const Problem p = make_problem(seed, 1, 32, 16, 16, 4, 2, {24}, Routing::kUniform);
  Problem q = make_problem(seed + 1, 1, 32, 16, 16, 4, 2, {24}, Routing::kUniform);
  // q keeps p's weights and its tokens 5..9, with different other tokens.
  q.w_gate = p.w_gate; q.w_up = p.w_up; q.w_down = p.w_down;
  q.ws_gate = p.ws_gate; q.ws_up = p.ws_up; q.ws_down = p.ws_down;
  const int64_t H = 32, k = 2;
  for (int64_t t = 5; t < 10; ++t) {
    std::copy_n(&p.x[0][t * H], H, &q.x[0][(t + 7) * H]);
    std::copy_n(&p.dy[0][t * H], H, &q.dy[0][(t + 7) * H]);
    std::copy_n(&p.ids[0][t * k], k, &q.ids[0][(t + 7) * k]);
    std::copy_n(&p.weights[0][t * k], k, &q.weights[0][(t + 7) * k]);
  }
  const Outputs a = run(p, 2), b = run(q, 2);
  for (int64_t t = 5; t < 10; ++t) {
    EXPECT_EQ(0, std::memcmp(&a.y[0][t * H], &b.y[0][(t + 7) * H], H * 2)) << "y of token " << t;
    EXPECT_EQ(0, std::memcmp(&a.dx[0][t * H], &b.dx[0][(t + 7) * H], H * 2)) << "dx of token " << t;
    EXPECT_EQ(0, std::memcmp(&a.dtopk[0][t * k], &b.dtopk[0][(t + 7) * k], k * 4)) << "dtopk of token " << t;
  }
}

TEST(Reference, MainGradAccumulates) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Problem p = make_problem(rng(), 1, 32, 16, 8, 3, 2, {11}, Routing::kUniform);
  const auto in = p.inputs();
  const int64_t n = p.d.local_experts() * 16 * 32;
  std::vector<bf16_t> dx(11 * 32), g1(n), g2(n), g3(n), s1(8 * 32), s2(8 * 32), s3(32 * 8);
  std::vector<float> dtopk(22);
  std::vector<float> zero_gate(n, 0.f), zero_sdown(32 * 8, 0.f);
  std::vector<float> main_gate = random_f32(rng, n, -1, 1), main_sdown = random_f32(rng, 32 * 8, -1, 1);
  const std::vector<float> before_gate = main_gate, before_sdown = main_sdown;
  ref::RankGrads g{dx.data(), dtopk.data(), g1.data(), g2.data(), g3.data(), s1.data(), s2.data(), s3.data(),
                   zero_gate.data(), nullptr, nullptr, nullptr, nullptr, zero_sdown.data(), {}, {}};
  ref::backward(p.d, in, {p.dy[0].data()}, {g}, 2);  // zero main_grad: receives the fp32 gradient itself
  g.main_gate = main_gate.data();
  g.main_s_down = main_sdown.data();
  ref::backward(p.d, in, {p.dy[0].data()}, {g}, 2);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(main_gate[i], before_gate[i] + zero_gate[i]) << i;
  for (size_t i = 0; i < main_sdown.size(); ++i) ASSERT_EQ(main_sdown[i], before_sdown[i] + zero_sdown[i]) << i;
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(g1[i], float_to_bf16(zero_gate[i])) << "bf16 grad is the rounded fp32 one";
}

// fp8_block's rounding (docs/precision.md): every e4m3 value maps to itself, a point halfway
// between two neighbours to the one with an even mantissa, anything past 448 to 448, the sign kept.
TEST(Reference, E4m3RoundingIsNearestEvenSaturating) {
  std::vector<float> values;  // the non-negative e4m3 values, ascending
  for (int m = 0; m < 8; ++m) values.push_back(std::ldexp(static_cast<float>(m) / 8.0f, -6));  // subnormals
  for (int e = -6; e <= 8; ++e)
    for (int m = 0; m < 8; ++m)
      if (!(e == 8 && m == 7)) values.push_back(std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e));  // 480: not in e4m3fn
  ASSERT_EQ(values.back(), 448.0f);
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(ref::e4m3_round(values[i]), values[i]);
    EXPECT_EQ(ref::e4m3_round(-values[i]), -values[i]);
    if (i + 1 == values.size()) break;
    const float lo = values[i], hi = values[i + 1], mid = (lo + hi) / 2;
    const bool lo_even = i % 2 == 0;  // mantissas alternate even, odd along the ascending list
    EXPECT_EQ(ref::e4m3_round(mid), lo_even ? lo : hi) << "halfway between " << lo << " and " << hi;
    EXPECT_EQ(ref::e4m3_round(std::nextafter(mid, lo)), lo);
    EXPECT_EQ(ref::e4m3_round(std::nextafter(mid, hi)), hi);
  }
  EXPECT_EQ(ref::e4m3_round(463.9f), 448.0f);
  EXPECT_EQ(ref::e4m3_round(1e6f), 448.0f);
  EXPECT_EQ(ref::e4m3_round(-1e6f), -448.0f);
  // a block's scale maps its largest value to 448
  std::vector<float> v = {0.5f, -3.0f, 1.25f, 0.0f}, q(4);
  EXPECT_EQ(ref::quantize_block(v.data(), q.data(), 4), 3.0f / 448.0f);
  EXPECT_EQ(q[1], -448.0f);
  std::vector<float> zeros(4, 0.0f);
  EXPECT_EQ(ref::quantize_block(zeros.data(), q.data(), 4), 1.0f);
}

}  // namespace
}  // namespace mok::test
