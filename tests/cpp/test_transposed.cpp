// Column-major ("transposed") weights: the storage of HF's is_transposed experts,
// gate_up_proj [E, H, 2I] and down_proj [E, I, H], passed as the [E, I, H] and [E, H, I] views
// mok reads (column-major matrices: stride 1 along dimension 1).  On the CPU backend they give
// the bits of row-major copies; the CUDA rules on their orientation are checked on the host.
#include <gtest/gtest.h>

#include <array>
#include <cstring>

#include "mok/mok.h"
#include "runtime/errors.hpp"
#include "runtime/layer.hpp"
#include "test_util.hpp"

namespace mok::test {
namespace {

// The six weights (or gradients, main_grads) as row-major stacks: w_gate, w_up [E, I, H],
// w_down [E, H, I], ws_gate, ws_up [I_s, H], ws_down [H, I_s].
template <typename T>
using Six = std::array<std::vector<T>, 6>;

struct Dims {
  int64_t E, H, I, Is;
  // (num, rows, cols) of weight i; num 0: a single 2-D matrix
  std::array<int64_t, 3> of(int i) const {
    switch (i) {
      case 0: case 1: return {E, I, H};
      case 2: return {E, H, I};
      case 3: case 4: return {0, Is, H};
      default: return {0, H, Is};
    }
  }
  int64_t numel(int i) const { auto d = of(i); return std::max<int64_t>(d[0], 1) * d[1] * d[2]; }
};

// The same six stored transposed, as HF's is_transposed experts keep them: one gate_up buffer
// [E, H, 2I + kPad] (gate in columns 0..I-1, up in I..2I-1, kPad columns never read), down
// [E, I, H]; the shared expert's likewise, [H, 2I_s] and [I_s, H].  Every matrix mok reads is
// then column-major.
template <typename T>
struct TransposedStore {
  static constexpr int64_t kPad = 8;
  Dims d;
  std::vector<T> gate_up, down, s_gate_up, s_down;

  TransposedStore(Dims dims, T fill)
      : d(dims), gate_up(d.E * d.H * (2 * d.I + kPad), fill), down(d.E * d.I * d.H, fill),
        s_gate_up(d.H * 2 * d.Is, fill), s_down(d.Is * d.H, fill) {}
  Strided strides(int i) const {
    switch (i) {
      case 0: case 1: return {d.H * (2 * d.I + kPad), 1, 2 * d.I + kPad};
      case 2: return {d.I * d.H, 1, d.H};
      case 3: case 4: return {0, 1, 2 * d.Is};
      default: return {0, 1, d.H};
    }
  }
  T* base(int i) {
    switch (i) {
      case 0: return gate_up.data();
      case 1: return gate_up.data() + d.I;
      case 2: return down.data();
      case 3: return s_gate_up.data();
      case 4: return s_gate_up.data() + d.Is;
      default: return s_down.data();
    }
  }
  void put(const Six<T>& rm) {
    for (int i = 0; i < 6; ++i) {
      const auto [num, rows, cols] = d.of(i);
      for (int64_t e = 0; e < std::max<int64_t>(num, 1); ++e)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) base(i)[strides(i).at(e, r, c)] = rm[i][(e * rows + r) * cols + c];
    }
  }
  Six<T> get() {
    Six<T> rm;
    for (int i = 0; i < 6; ++i) {
      const auto [num, rows, cols] = d.of(i);
      for (int64_t e = 0; e < std::max<int64_t>(num, 1); ++e)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) rm[i].push_back(base(i)[strides(i).at(e, r, c)]);
    }
    return rm;
  }
  mokWeights_t views(mokDtype_t dtype, int32_t device = MOK_DEVICE_CPU) {
    mokTensor_t v[6];
    for (int i = 0; i < 6; ++i) {
      const auto [num, rows, cols] = d.of(i);
      v[i] = strided_view(base(i), dtype, num, rows, cols, strides(i), device);
    }
    return mokWeights_t{v[0], v[1], v[2], v[3], v[4], v[5]};
  }
};

template <typename T>
mokWeights_t contiguous_views(Six<T>& w, const Dims& d, mokDtype_t dtype) {
  mokTensor_t v[6];
  for (int i = 0; i < 6; ++i) {
    const auto [num, rows, cols] = d.of(i);
    v[i] = num > 0 ? host_view(w[i].data(), dtype, {num, rows, cols}) : host_view(w[i].data(), dtype, {rows, cols});
  }
  return mokWeights_t{v[0], v[1], v[2], v[3], v[4], v[5]};
}

// A layer with a shared expert, its inputs, and what one forward and backward give.
struct TransposedCase {
  Dims d{4, 32, 16, 8};
  static constexpr int64_t k = 2, T = 11;
  mokConfig_t config = MOK_CONFIG_INITIALIZER;
  std::vector<bf16_t> x, dy;
  std::vector<int32_t> ids;
  std::vector<float> tw;
  Six<bf16_t> w;
  Six<float> main_start;

  explicit TransposedCase(uint64_t seed) {
    std::mt19937_64 rng(seed);
    config.hidden = d.H;
    config.intermediate = d.I;
    config.shared_intermediate = d.Is;
    config.num_experts = d.E;
    config.topk = k;
    config.max_tokens = T;
    x = random_bf16(rng, T * d.H, 1.f);
    dy = random_bf16(rng, T * d.H, 1.f);
    ids = to_int32(make_ids(rng, T, k, d.E, d.E, Routing::kMasked));
    tw = random_f32(rng, T * k, -0.5f, 1.f);
    for (int i = 0; i < 6; ++i) {
      w[static_cast<size_t>(i)] = random_bf16(rng, d.numel(i), 0.2f);
      main_start[static_cast<size_t>(i)] = random_f32(rng, d.numel(i), -1.f, 1.f);
    }
  }

  struct Out {
    std::vector<bf16_t> y, dx;
    std::vector<float> dtw;
  };
  // One forward and backward with the given weight, gradient and main_grad views.
  Out run(mokWorkspace_t ws, const mokWeights_t& weights, const mokWeights_t& grads, const mokWeights_t& main) {
    Out o{std::vector<bf16_t>(T * d.H, float_to_bf16(NAN)), std::vector<bf16_t>(T * d.H, float_to_bf16(NAN)),
          std::vector<float>(T * k, NAN)};
    mokForwardArgs_t f{};
    f.x = host_view(x.data(), mokBFloat16, {T, d.H});
    f.topk_ids = host_view(ids.data(), mokInt32, {T, k});
    f.topk_weights = host_view(tw.data(), mokFloat32, {T, k});
    f.weights = weights;
    f.y = host_view(o.y.data(), mokBFloat16, {T, d.H});
    EXPECT_EQ(mokForward(ws, &f, nullptr), mokSuccess) << mokGetLastError();
    mokBackwardArgs_t b{};
    b.fwd = f;
    b.dy = host_view(dy.data(), mokBFloat16, {T, d.H});
    b.dx = host_view(o.dx.data(), mokBFloat16, {T, d.H});
    b.d_topk_weights = host_view(o.dtw.data(), mokFloat32, {T, k});
    b.grads = grads;
    b.main_grads = main;
    EXPECT_EQ(mokBackward(ws, &b, nullptr), mokSuccess) << mokGetLastError();
    return o;
  }
};

const char* const kWeightNames[6] = {"w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down"};

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Column-major weights, gradients and main_grads, read and written in place, give the bits
// of contiguous row-major copies of the same matrices: only the addressing differs.
TEST(TransposedWeights, CpuBackendGivesTheBitsOfRowMajorCopies) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  TransposedCase c(seed);
  mokWorkspace_t ws = nullptr;
  ASSERT_EQ(mokWorkspaceCreate(&c.config, &ws), mokSuccess) << mokGetLastError();

  // Row-major: contiguous weights, NaN gradients, main_grads from main_start
  Six<bf16_t> grads_rm;
  for (int i = 0; i < 6; ++i) grads_rm[i].assign(c.d.numel(i), float_to_bf16(NAN));
  Six<float> main_rm = c.main_start;
  const auto rm = c.run(ws, contiguous_views(c.w, c.d, mokBFloat16), contiguous_views(grads_rm, c.d, mokBFloat16),
                        contiguous_views(main_rm, c.d, mokFloat32));

  // Column-major: every weight, gradient and main_grad transposed in NaN-filled storage
  TransposedStore<bf16_t> w_cm(c.d, float_to_bf16(NAN)), grads_cm(c.d, float_to_bf16(NAN));
  TransposedStore<float> main_cm(c.d, NAN);
  w_cm.put(c.w);
  main_cm.put(c.main_start);
  const auto cm = c.run(ws, w_cm.views(mokBFloat16), grads_cm.views(mokBFloat16), main_cm.views(mokFloat32));

  for (auto v : rm.y) ASSERT_FALSE(std::isnan(bf16_to_float(v))) << "y unwritten";
  EXPECT_TRUE(same_bits(cm.y, rm.y)) << "y";
  EXPECT_TRUE(same_bits(cm.dx, rm.dx)) << "dx";
  EXPECT_TRUE(same_bits(cm.dtw, rm.dtw)) << "d_topk_weights";
  const Six<bf16_t> grads_back = grads_cm.get();
  const Six<float> main_back = main_cm.get();
  for (int i = 0; i < 6; ++i) {
    for (auto v : grads_rm[i]) ASSERT_FALSE(std::isnan(bf16_to_float(v))) << "grad of " << kWeightNames[i];
    EXPECT_TRUE(same_bits(grads_back[i], grads_rm[i])) << "grad of " << kWeightNames[i];
    EXPECT_TRUE(same_bits(main_back[i], main_rm[i])) << "main_grad of " << kWeightNames[i];
    EXPECT_FALSE(same_bits(main_rm[i], c.main_start[i])) << "main_grad of " << kWeightNames[i] << " unchanged";
  }
  // Nothing outside the views is written: gate_up's kPad spare columns stay NaN
  const int64_t ld = 2 * c.d.I + TransposedStore<bf16_t>::kPad;
  for (size_t j = 0; j < grads_cm.gate_up.size(); ++j)
    if (static_cast<int64_t>(j) % ld >= 2 * c.d.I) {
      ASSERT_TRUE(std::isnan(bf16_to_float(grads_cm.gate_up[j]))) << "grad gate_up spare column written at " << j;
      ASSERT_TRUE(std::isnan(main_cm.gate_up[j])) << "main_grad gate_up spare column written at " << j;
    }

  // Mixed: column-major weights with row-major gradients (and the reverse) give the same bits
  Six<bf16_t> grads_rm2;
  for (int i = 0; i < 6; ++i) grads_rm2[i].assign(c.d.numel(i), float_to_bf16(NAN));
  TransposedStore<bf16_t> grads_cm2(c.d, float_to_bf16(NAN));
  Six<float> main_rm2 = c.main_start;
  c.run(ws, w_cm.views(mokBFloat16), contiguous_views(grads_rm2, c.d, mokBFloat16),
        contiguous_views(main_rm2, c.d, mokFloat32));
  c.run(ws, contiguous_views(c.w, c.d, mokBFloat16), grads_cm2.views(mokBFloat16), mokWeights_t{});
  const Six<bf16_t> grads_back2 = grads_cm2.get();
  for (int i = 0; i < 6; ++i) {
    EXPECT_TRUE(same_bits(grads_rm2[i], grads_rm[i])) << "row-major grad of " << kWeightNames[i];
    EXPECT_TRUE(same_bits(main_rm2[i], main_rm[i])) << "row-major main_grad of " << kWeightNames[i];
    EXPECT_TRUE(same_bits(grads_back2[i], grads_rm[i])) << "column-major grad of " << kWeightNames[i];
  }
  EXPECT_EQ(mokWorkspaceDestroy(ws), mokSuccess);
}

// The CUDA rules on weight orientation are host checks (runtime/layer.cpp): run on views that
// claim device 0 and are never read, they need no GPU.
class CudaWeightRules : public ::testing::Test {
 protected:
  TransposedCase c{fresh_seed()};
  TransposedStore<bf16_t> cm{c.d, float_to_bf16(0.f)};
  std::vector<bf16_t> y = std::vector<bf16_t>(TransposedCase::T * 32);

  // Forward args on "cuda:0" with the given weights (row-major copies where null).
  mokForwardArgs_t args(const mokWeights_t& w) {
    mokForwardArgs_t f{};
    f.x = host_view(c.x.data(), mokBFloat16, {TransposedCase::T, c.d.H}, 0);
    f.topk_ids = host_view(c.ids.data(), mokInt32, {TransposedCase::T, TransposedCase::k}, 0);
    f.topk_weights = host_view(c.tw.data(), mokFloat32, {TransposedCase::T, TransposedCase::k}, 0);
    f.y = host_view(y.data(), mokBFloat16, {TransposedCase::T, c.d.H}, 0);
    f.weights = w;
    return f;
  }
  mokWeights_t row_major() {
    mokWeights_t w = contiguous_views(c.w, c.d, mokBFloat16);
    for (mokTensor_t* t : {&w.w_gate, &w.w_up, &w.w_down, &w.ws_gate, &w.ws_up, &w.ws_down}) t->device = 0;
    return w;
  }
  // The message check_forward_args throws ("" when it accepts).
  std::string rejection(const mokWeights_t& w) {
    try {
      check_forward_args(c.config, args(w), 0, "", true);
    } catch (const mok::Error& e) {
      EXPECT_EQ(e.code(), mokInvalidArgument);
      return e.what();
    }
    return "";
  }
};

TEST_F(CudaWeightRules, OneOrientationAndRowMajorSharedWeights) {
  for (auto* v : {c.x.data(), c.w[0].data(), cm.gate_up.data(), cm.down.data(), cm.s_gate_up.data()})
    ASSERT_EQ(reinterpret_cast<uintptr_t>(v) % 16, 0u) << "the test's buffers must be 16-byte aligned";
  EXPECT_EQ(rejection(row_major()), "");
  const mokWeights_t t = cm.views(mokBFloat16, 0);
  mokWeights_t w = row_major();
  w.w_gate = t.w_gate;
  w.w_up = t.w_up;
  EXPECT_NE(rejection(w).find("w_gate is column-major (strides [1280, 1, 40]) but w_down is row-major (strides "
                              "[512, 16, 1]): on CUDA w_gate, w_up and w_down must be all row-major or all "
                              "column-major"),
            std::string::npos)
      << rejection(w);
  w = row_major();
  w.ws_gate = t.ws_gate;
  w.ws_up = t.ws_up;
  EXPECT_NE(rejection(w).find("ws_gate is column-major (strides [1, 16]): on CUDA the shared expert's weights must "
                              "be row-major"),
            std::string::npos)
      << rejection(w);
  // TMA: the column stride in multiples of 16 bytes, the expert stride in column strides (the
  // views reach past cm.down's end, but no check reads them)
  w = t;
  w.ws_gate = row_major().ws_gate;
  w.ws_up = row_major().ws_up;
  w.ws_down = row_major().ws_down;
  const int64_t E = c.d.E, H = c.d.H, I = c.d.I;
  w.w_down = strided_view(cm.down.data(), mokBFloat16, E, H, I, {I * (H + 4), 1, H + 4}, 0);
  EXPECT_NE(rejection(w).find("w_down: column stride 36 (72 bytes) must be a multiple of 16 bytes"),
            std::string::npos)
      << rejection(w);
  w.w_down = strided_view(cm.down.data(), mokBFloat16, E, H, I, {I * H + 8, 1, H}, 0);
  EXPECT_NE(rejection(w).find("w_down: stride 520 along dimension 0 must be a multiple of the column stride 32"),
            std::string::npos)
      << rejection(w);
}

// On CUDA the fused backward writes the routed gradients in their weights' orientation: other
// gradients (or main_grads) are named before any launch, in both directions.
TEST_F(CudaWeightRules, RoutedGradientsFollowTheWeightsOrientation) {
  mokWeights_t col = cm.views(mokBFloat16, 0);
  col.ws_gate = row_major().ws_gate;
  col.ws_up = row_major().ws_up;
  col.ws_down = row_major().ws_down;
  EXPECT_EQ(rejection(col), "") << "column-major routed weights are read on CUDA";
  std::vector<bf16_t> dx(TransposedCase::T * c.d.H);
  std::vector<float> dtw(TransposedCase::T * TransposedCase::k);
  auto backward = [&](const mokWeights_t& weights, const mokWeights_t& grads) {
    mokBackwardArgs_t b{};
    b.fwd = args(weights);
    b.dy = host_view(c.dy.data(), mokBFloat16, {TransposedCase::T, c.d.H}, 0);
    b.dx = host_view(dx.data(), mokBFloat16, {TransposedCase::T, c.d.H}, 0);
    b.d_topk_weights = host_view(dtw.data(), mokFloat32, {TransposedCase::T, TransposedCase::k}, 0);
    b.grads = grads;
    try {
      check_backward_args(c.config, b, 0, "");
      return std::string();
    } catch (const mok::Error& e) {
      return std::string(e.what());
    }
  };
  EXPECT_EQ(backward(col, col), "");
  EXPECT_EQ(backward(row_major(), row_major()), "");
  const std::string row_weights = backward(row_major(), col);
  EXPECT_NE(row_weights.find("grad of w_gate is column-major (transposed)"), std::string::npos) << row_weights;
  EXPECT_NE(row_weights.find("routed weights are row-major: on CUDA the routed experts' gradients are written in "
                             "their weights' orientation"),
            std::string::npos)
      << row_weights;
  const std::string col_weights = backward(col, row_major());
  EXPECT_NE(col_weights.find("grad of w_gate is row-major"), std::string::npos) << col_weights;
}

}  // namespace
}  // namespace mok::test
