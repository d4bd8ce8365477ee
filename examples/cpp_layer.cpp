// A small MoE layer through mok's public C++ API (include/mok/mok.hpp), checked against a
// float64 reference computed right here with plain loops:
//
//   1. forward and backward on the CPU reference backend;
//   2. y, dx, d_topk_weights and every weight gradient against the float64 reference
//      (relative Frobenius error < 1e-2; bf16 outputs are good to ~4e-3);
//   3. a second run gives the same bits (mok is deterministic);
//   4. a bad expert id is rejected, naming the tensor, index and value, before anything runs.
//
// Exits non-zero on any mismatch or error.  Uses only mok's public headers and the standard
// library, so it builds as an outside project against an installed mok:
//
//   find_package(mok)  +  target_link_libraries(my_app PRIVATE mok::mok)
//   build/examples/cpp_layer
//
// The layer runs on the CPU here.  The same calls run on a GPU when the tensors' data are
// CUDA device pointers and the views say so (mok::tensor_view(ptr, dtype, shape, device),
// config.device = the CUDA ordinal); allocating them takes the CUDA runtime (cudaMalloc,
// cudaMemcpy), which this example does not link.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "mok/mok.hpp"

namespace {

// ---- bf16 on the host: the upper half of an fp32, rounded to nearest even ------------------

using bf16 = uint16_t;

bf16 to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<bf16>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
float from_bf16(bf16 v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// Where mok stores a value in bf16, the reference rounds it the same way.
double round_bf16(double v) { return from_bf16(to_bf16(static_cast<float>(v))); }

std::vector<bf16> random_bf16(std::mt19937& rng, size_t n, float scale) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<bf16> v(n);
  for (auto& x : v) x = to_bf16(dist(rng));
  return v;
}

// ---- the layer's tensors --------------------------------------------------------------------

struct Dims {
  int64_t H, I, Is, E, k, T;  // hidden, expert / shared-expert intermediate, experts, top-k, tokens
};

// The six weights in mokWeights_t order; the same indices name their gradients.
enum Weight { kGate, kUp, kDown, kSharedGate, kSharedUp, kSharedDown, kNumWeights };
const char* const kWeightNames[kNumWeights] = {"w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down"};

std::vector<int64_t> weight_shape(const Dims& d, int w) {
  switch (w) {
    case kGate: case kUp: return {d.E, d.I, d.H};
    case kDown: return {d.E, d.H, d.I};
    case kSharedGate: case kSharedUp: return {d.Is, d.H};
    default: return {d.H, d.Is};
  }
}

struct Inputs {
  std::vector<bf16> x, dy;       // [T, H]
  std::vector<int32_t> ids;      // [T, k], -1 = no expert
  std::vector<float> weights;    // [T, k]
  std::vector<bf16> w[kNumWeights];
};

struct Outputs {
  std::vector<bf16> y, dx;        // [T, H]
  std::vector<float> d_weights;   // [T, k]
  std::vector<bf16> grad[kNumWeights];
};

mokWeights_t weight_views(std::vector<bf16> (&w)[kNumWeights], const Dims& d) {
  mokWeights_t views{};
  mokTensor_t* fields[kNumWeights] = {&views.w_gate,  &views.w_up,  &views.w_down,
                                      &views.ws_gate, &views.ws_up, &views.ws_down};
  for (int i = 0; i < kNumWeights; ++i) *fields[i] = mok::tensor_view(w[i].data(), mokBFloat16, weight_shape(d, i));
  return views;
}

// ---- mok: forward, then backward ------------------------------------------------------------

Outputs run_layer(const mok::Workspace& ws, Inputs& in, const Dims& d) {
  Outputs out;
  out.y.resize(d.T * d.H);
  out.dx.resize(d.T * d.H);
  out.d_weights.resize(d.T * d.k);
  for (int i = 0; i < kNumWeights; ++i) out.grad[i].resize(in.w[i].size());

  mokForwardArgs_t fwd{};
  fwd.x = mok::tensor_view(in.x.data(), mokBFloat16, {d.T, d.H});
  fwd.topk_ids = mok::tensor_view(in.ids.data(), mokInt32, {d.T, d.k});
  fwd.topk_weights = mok::tensor_view(in.weights.data(), mokFloat32, {d.T, d.k});
  fwd.weights = weight_views(in.w, d);
  fwd.y = mok::tensor_view(out.y.data(), mokBFloat16, {d.T, d.H});
  ws.forward(fwd);

  mokBackwardArgs_t bwd{};
  bwd.fwd = fwd;
  bwd.dy = mok::tensor_view(in.dy.data(), mokBFloat16, {d.T, d.H});
  bwd.dx = mok::tensor_view(out.dx.data(), mokBFloat16, {d.T, d.H});
  bwd.d_topk_weights = mok::tensor_view(out.d_weights.data(), mokFloat32, {d.T, d.k});
  bwd.grads = weight_views(out.grad, d);  // main_grads left absent: plain bf16 gradients
  ws.backward(bwd);
  return out;
}

// ---- the float64 reference (docs/design.md, "Numerics") -------------------------------------

struct Reference {
  std::vector<double> y, dx, d_weights, grad[kNumWeights];
};

// One SwiGLU expert (gate, up [n, H], down [H, n]) applied to token row x with weight w:
// adds w * o to y (o = bf16(a · downᵀ), a = bf16(silu(x · gateᵀ) ⊙ (x · upᵀ))) and, for the
// output gradient dy, the expert's share of dx, of its weight's gradient (*dw, if given) and
// of dgate, dup, ddown.
void expert_reference(const bf16* x, const bf16* dy, double w, const bf16* gate, const bf16* up, const bf16* down,
                      int64_t H, int64_t n, double* y, double* dx, double* dw, double* dgate, double* dup,
                      double* ddown) {
  std::vector<double> a(n), dg(n), du(n);
  for (int64_t i = 0; i < n; ++i) {
    double g = 0, u = 0, da = 0;
    for (int64_t h = 0; h < H; ++h) {
      g += from_bf16(x[h]) * from_bf16(gate[i * H + h]);
      u += from_bf16(x[h]) * from_bf16(up[i * H + h]);
      da += from_bf16(dy[h]) * from_bf16(down[h * n + i]);  // da = dy · down (unweighted)
    }
    const double sig = 1 / (1 + std::exp(-g)), silu = g * sig;
    a[i] = round_bf16(silu * u);
    if (dw) *dw += da * a[i];                                        // d w = Σ_i da_i a_i
    dg[i] = round_bf16(w * da * u * sig * (1 + g * (1 - sig)));    // silu'(g) = σ(1 + g(1 − σ))
    du[i] = round_bf16(w * da * silu);
  }
  for (int64_t h = 0; h < H; ++h) {
    double o = 0, rdx = 0;
    for (int64_t i = 0; i < n; ++i) {
      o += a[i] * from_bf16(down[h * n + i]);
      rdx += dg[i] * from_bf16(gate[i * H + h]) + du[i] * from_bf16(up[i * H + h]);
      ddown[h * n + i] += from_bf16(dy[h]) * round_bf16(w * a[i]);
      dgate[i * H + h] += dg[i] * from_bf16(x[h]);
      dup[i * H + h] += du[i] * from_bf16(x[h]);
    }
    y[h] += w * round_bf16(o);
    dx[h] += round_bf16(rdx);
  }
}

Reference reference(const Inputs& in, const Dims& d) {
  Reference ref;
  ref.y.assign(d.T * d.H, 0.0);
  ref.dx.assign(d.T * d.H, 0.0);
  ref.d_weights.assign(d.T * d.k, 0.0);  // masked routes keep 0
  for (int i = 0; i < kNumWeights; ++i) ref.grad[i].assign(in.w[i].size(), 0.0);
  const int64_t H = d.H, I = d.I;
  for (int64_t t = 0; t < d.T; ++t) {
    const bf16 *x = &in.x[t * H], *dy = &in.dy[t * H];
    double *y = &ref.y[t * H], *dx = &ref.dx[t * H];
    for (int64_t j = 0; j < d.k; ++j) {  // routed experts, ascending j
      const int64_t e = in.ids[t * d.k + j];
      if (e < 0) continue;
      expert_reference(x, dy, in.weights[t * d.k + j], &in.w[kGate][e * I * H], &in.w[kUp][e * I * H],
                       &in.w[kDown][e * H * I], H, I, y, dx, &ref.d_weights[t * d.k + j],
                       &ref.grad[kGate][e * I * H], &ref.grad[kUp][e * I * H], &ref.grad[kDown][e * H * I]);
    }
    if (d.Is > 0)  // the shared expert: weight 1 on every token
      expert_reference(x, dy, 1.0, in.w[kSharedGate].data(), in.w[kSharedUp].data(), in.w[kSharedDown].data(), H,
                       d.Is, y, dx, nullptr, ref.grad[kSharedGate].data(), ref.grad[kSharedUp].data(),
                       ref.grad[kSharedDown].data());
    for (int64_t h = 0; h < H; ++h) y[h] = round_bf16(y[h]);  // y is one bf16 rounding of the sum
  }
  return ref;
}

// ---- comparisons ----------------------------------------------------------------------------

double value(bf16 v) { return from_bf16(v); }
double value(float v) { return v; }

// ||got − ref|| / ||ref|| (Frobenius); NaN in got makes it NaN, which fails the check.
template <class T>
double rel_error(const std::vector<T>& got, const std::vector<double>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = value(got[i]) - ref[i];
    diff += e * e;
    norm += ref[i] * ref[i];
  }
  return std::sqrt(diff) / std::sqrt(norm);
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

}  // namespace

int main() {
  // Layer: H=256, I=128, E=8 routed experts (top-2), a shared expert of I_s=128, T=64 tokens
  // (shapes that the CUDA backend takes too: H, I and I_s multiples of 64).
  const Dims d{/*H*/ 256, /*I*/ 128, /*Is*/ 128, /*E*/ 8, /*k*/ 2, /*T*/ 64};
  std::mt19937 rng(7);
  Inputs in;
  in.x = random_bf16(rng, d.T * d.H, 1.f);
  in.dy = random_bf16(rng, d.T * d.H, 1.f);
  for (int i = 0; i < kNumWeights; ++i) {
    const auto shape = weight_shape(d, i);
    int64_t size = 1;
    for (int64_t n : shape) size *= n;
    // Scaled by 1/sqrt(fan_in) (the last dimension), so that outputs are of order 1.
    in.w[i] = random_bf16(rng, static_cast<size_t>(size), 1.f / std::sqrt(static_cast<float>(shape.back())));
  }
  in.ids.resize(d.T * d.k);
  in.weights.resize(d.T * d.k);
  for (int64_t t = 0; t < d.T; ++t) {
    // Two distinct experts per token, weights 0.7 and 0.3.
    const int32_t first = static_cast<int32_t>(t % d.E), second = static_cast<int32_t>((t * 3 + 1) % d.E);
    in.ids[t * d.k] = first;
    in.ids[t * d.k + 1] = second == first ? static_cast<int32_t>((t + 1) % d.E) : second;
    in.weights[t * d.k] = 0.7f;
    in.weights[t * d.k + 1] = 0.3f;
  }
  in.ids[5 * d.k + 1] = -1;  // a masked route: no expert, d_topk_weights 0

  // The config: dimensions set, every knob at its default.  max_tokens bounds T per call.
  mokConfig_t config = mok::default_config();
  config.hidden = d.H;
  config.intermediate = d.I;
  config.shared_intermediate = d.Is;
  config.num_experts = d.E;
  config.topk = d.k;
  config.max_tokens = d.T;

  bool ok = true;
  try {
    mok::Workspace ws(config);  // buffers sized once, reused by every call
    std::printf("mok %d.%d.%d, CPU reference backend\n%s", mok::version() / 10000, mok::version() / 100 % 100,
                mok::version() % 100, ws.describe().c_str());

    const Outputs out = run_layer(ws, in, d);
    const Reference ref = reference(in, d);

    // Every output against the float64 reference.
    std::printf("%-16s %s\n", "output", "rel. Frobenius error vs float64 (tolerance 1e-2)");
    auto report = [&ok](const char* name, double err) {
      const bool pass = err < 1e-2;  // false for NaN too
      ok &= pass;
      std::printf("%-16s %.3e  %s\n", name, err, pass ? "ok" : "MISMATCH");
    };
    report("y", rel_error(out.y, ref.y));
    report("dx", rel_error(out.dx, ref.dx));
    report("d_topk_weights", rel_error(out.d_weights, ref.d_weights));
    for (int i = 0; i < kNumWeights; ++i)
      report((std::string("d ") + kWeightNames[i]).c_str(), rel_error(out.grad[i], ref.grad[i]));
    const float masked = out.d_weights[5 * d.k + 1];
    std::printf("d_topk_weights of the masked route: %g (expected 0)\n", masked);
    ok &= masked == 0.f;

    // Deterministic: a second run of the same call gives the same bits.
    const Outputs again = run_layer(ws, in, d);
    bool same = same_bits(out.y, again.y) && same_bits(out.dx, again.dx) && same_bits(out.d_weights, again.d_weights);
    for (int i = 0; i < kNumWeights; ++i) same &= same_bits(out.grad[i], again.grad[i]);
    std::printf("second run: %s\n", same ? "bitwise identical" : "DIFFERENT");
    ok &= same;

    // A bad id is an error naming the tensor, index and value, before anything runs.
    in.ids[3 * d.k] = static_cast<int32_t>(d.E);
    try {
      run_layer(ws, in, d);
      std::printf("expected an error for a bad id\n");
      ok = false;
    } catch (const mok::ApiError& e) {
      std::printf("bad id rejected as expected: %s\n", e.what());
    }
  } catch (const mok::ApiError& e) {
    std::printf("mok error: %s\n", e.what());
    return 1;
  }
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
