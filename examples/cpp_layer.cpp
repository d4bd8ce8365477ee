// A small MoE layer through the public C++ API (include/mok/mok.hpp): forward and backward
// on the CPU reference backend, then a bad id rejected before anything runs.  Prints the
// workspace description and checksums; exits non-zero on any error.
//
//   build/examples/cpp_layer
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "mok/mok.hpp"

namespace {

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

std::vector<bf16> random_bf16(std::mt19937& rng, size_t n, float scale) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<bf16> v(n);
  for (auto& x : v) x = to_bf16(dist(rng));
  return v;
}

double checksum(const std::vector<bf16>& v) {
  double s = 0;
  for (auto x : v) s += std::fabs(from_bf16(x));
  return s;
}

}  // namespace

int main() {
  // Layer: H=256, I=128, E=8 routed experts (top-2), a shared expert of I_s=128, T=64 tokens.
  const int64_t H = 256, I = 128, Is = 128, E = 8, k = 2, T = 64;
  std::mt19937 rng(7);
  auto x = random_bf16(rng, T * H, 1.f);
  auto wg = random_bf16(rng, E * I * H, 0.0625f), wu = random_bf16(rng, E * I * H, 0.0625f);
  auto wd = random_bf16(rng, E * H * I, 0.088f);
  auto sg = random_bf16(rng, Is * H, 0.0625f), su = random_bf16(rng, Is * H, 0.0625f);
  auto sd = random_bf16(rng, H * Is, 0.088f);
  std::vector<int32_t> ids(T * k);
  std::vector<float> weights(T * k);
  for (int64_t t = 0; t < T; ++t) {
    // Two distinct experts per token
    ids[t * k] = static_cast<int32_t>(t % E);
    ids[t * k + 1] = static_cast<int32_t>((t * 3 + 1) % E == t % E ? (t + 1) % E : (t * 3 + 1) % E);
    weights[t * k] = 0.7f;
    weights[t * k + 1] = 0.3f;
  }
  ids[5 * k + 1] = -1;  // a masked route

  mokConfig_t config = mok::default_config();
  config.hidden = H;
  config.intermediate = I;
  config.shared_intermediate = Is;
  config.num_experts = E;
  config.topk = k;
  config.max_tokens = T;

  try {
    mok::Workspace ws(config);
    std::printf("%s", ws.describe().c_str());

    std::vector<bf16> y(T * H);
    mokForwardArgs_t fwd{};
    fwd.x = mok::tensor_view(x.data(), mokBFloat16, {T, H});
    fwd.topk_ids = mok::tensor_view(ids.data(), mokInt32, {T, k});
    fwd.topk_weights = mok::tensor_view(weights.data(), mokFloat32, {T, k});
    fwd.weights.w_gate = mok::tensor_view(wg.data(), mokBFloat16, {E, I, H});
    fwd.weights.w_up = mok::tensor_view(wu.data(), mokBFloat16, {E, I, H});
    fwd.weights.w_down = mok::tensor_view(wd.data(), mokBFloat16, {E, H, I});
    fwd.weights.ws_gate = mok::tensor_view(sg.data(), mokBFloat16, {Is, H});
    fwd.weights.ws_up = mok::tensor_view(su.data(), mokBFloat16, {Is, H});
    fwd.weights.ws_down = mok::tensor_view(sd.data(), mokBFloat16, {H, Is});
    fwd.y = mok::tensor_view(y.data(), mokBFloat16, {T, H});
    ws.forward(fwd);

    std::vector<bf16> dy = random_bf16(rng, T * H, 1.f), dx(T * H), dwg(wg.size()), dwu(wu.size()), dwd(wd.size()),
                      dsg(sg.size()), dsu(su.size()), dsd(sd.size());
    std::vector<float> dw(T * k);
    mokBackwardArgs_t bwd{};
    bwd.fwd = fwd;
    bwd.dy = mok::tensor_view(dy.data(), mokBFloat16, {T, H});
    bwd.dx = mok::tensor_view(dx.data(), mokBFloat16, {T, H});
    bwd.d_topk_weights = mok::tensor_view(dw.data(), mokFloat32, {T, k});
    bwd.grads.w_gate = mok::tensor_view(dwg.data(), mokBFloat16, {E, I, H});
    bwd.grads.w_up = mok::tensor_view(dwu.data(), mokBFloat16, {E, I, H});
    bwd.grads.w_down = mok::tensor_view(dwd.data(), mokBFloat16, {E, H, I});
    bwd.grads.ws_gate = mok::tensor_view(dsg.data(), mokBFloat16, {Is, H});
    bwd.grads.ws_up = mok::tensor_view(dsu.data(), mokBFloat16, {Is, H});
    bwd.grads.ws_down = mok::tensor_view(dsd.data(), mokBFloat16, {H, Is});
    ws.backward(bwd);

    std::printf("sum|y| = %.4f  sum|dx| = %.4f  sum|dW_down| = %.4f  d_topk_weights[5,1] (masked) = %g\n",
                checksum(y), checksum(dx), checksum(dwd), dw[5 * k + 1]);

    // A bad id is an error naming the tensor, index and value, before anything runs.
    ids[3 * k] = static_cast<int32_t>(E);
    try {
      ws.forward(fwd);
      std::printf("expected an error for a bad id\n");
      return 1;
    } catch (const mok::ApiError& e) {
      std::printf("rejected as expected: %s\n", e.what());
    }
  } catch (const mok::ApiError& e) {
    std::printf("mok error: %s\n", e.what());
    return 1;
  }
  return 0;
}
