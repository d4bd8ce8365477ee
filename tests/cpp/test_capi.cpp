// The C ABI: result codes, messages naming tensor/index/value, and a workspace that stays
// usable after a rejected call.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "mok/mok.h"
#include "mok/mok.hpp"
#include "test_util.hpp"

namespace mok::test {
namespace {

using mok::tensor_view;

// A small EP=1 layer with its host buffers.
struct Layer {
  static constexpr int64_t H = 32, I = 16, E = 4, k = 2, T = 8;
  mokConfig_t config = MOK_CONFIG_INITIALIZER;
  std::vector<bf16_t> x, y, wg, wu, wd;
  std::vector<int32_t> ids;
  std::vector<float> w;
  mokForwardArgs_t args{};

  explicit Layer(uint64_t seed) {
    std::mt19937_64 rng(seed);
    config.hidden = H;
    config.intermediate = I;
    config.num_experts = E;
    config.topk = k;
    config.max_tokens = T;
    config.block_m = 4;
    config.minibatch_size = 8;
    config.macrobatch_size = 16;
    x = random_bf16(rng, T * H, 1.f);
    y.assign(T * H, 0);
    wg = random_bf16(rng, E * I * H, 0.2f);
    wu = random_bf16(rng, E * I * H, 0.2f);
    wd = random_bf16(rng, E * H * I, 0.2f);
    ids = to_int32(make_ids(rng, T, k, E, E, Routing::kUniform));
    w = random_f32(rng, T * k, 0, 1);
    args.x = tensor_view(x.data(), mokBFloat16, {T, H});
    args.topk_ids = tensor_view(ids.data(), mokInt32, {T, k});
    args.topk_weights = tensor_view(w.data(), mokFloat32, {T, k});
    args.weights.w_gate = tensor_view(wg.data(), mokBFloat16, {E, I, H});
    args.weights.w_up = tensor_view(wu.data(), mokBFloat16, {E, I, H});
    args.weights.w_down = tensor_view(wd.data(), mokBFloat16, {E, H, I});
    args.y = tensor_view(y.data(), mokBFloat16, {T, H});
  }
};

class CApi : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(mokWorkspaceCreate(&layer.config, &ws), mokSuccess) << mokGetLastError(); }
  void TearDown() override { EXPECT_EQ(mokWorkspaceDestroy(ws), mokSuccess); }

  // Expects `args` to be rejected with `code` and a message containing every needle; then
  // checks that the workspace still runs the valid call.
  void expect_rejected(const mokForwardArgs_t& args, mokResult_t code, std::vector<std::string> needles) {
    EXPECT_EQ(mokForward(ws, &args, nullptr), code);
    const std::string msg = mokGetLastError();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message: " << msg << "\nmissing: " << n;
    std::fill(layer.y.begin(), layer.y.end(), float_to_bf16(NAN));
    ASSERT_EQ(mokForward(ws, &layer.args, nullptr), mokSuccess) << mokGetLastError();
    for (auto v : layer.y) ASSERT_FALSE(std::isnan(bf16_to_float(v))) << "valid call after a rejected one";
    EXPECT_STREQ(mokGetLastError(), "");
  }

  Layer layer{fresh_seed()};
  mokWorkspace_t ws = nullptr;
};

TEST_F(CApi, ForwardRunsAndIsDeterministic) {
  ASSERT_EQ(mokForward(ws, &layer.args, nullptr), mokSuccess) << mokGetLastError();
  const auto first = layer.y;
  std::fill(layer.y.begin(), layer.y.end(), float_to_bf16(NAN));
  ASSERT_EQ(mokForward(ws, &layer.args, nullptr), mokSuccess);
  EXPECT_EQ(0, std::memcmp(first.data(), layer.y.data(), first.size() * 2));
}

TEST_F(CApi, OutOfRangeIdNamesTensorIndexAndValue) {
  auto args = layer.args;
  auto ids = layer.ids;
  ids[5 * 2 + 1] = 4;
  args.topk_ids = tensor_view(ids.data(), mokInt32, {8, 2});
  expect_rejected(args, mokInvalidArgument, {"topk_ids[5, 1] = 4", "[-1, 4)"});
  ids[5 * 2 + 1] = -2;
  expect_rejected(args, mokInvalidArgument, {"topk_ids[5, 1] = -2"});
}

TEST_F(CApi, DuplicateIdIsRejected) {
  auto args = layer.args;
  auto ids = layer.ids;
  ids[3 * 2 + 1] = ids[3 * 2];
  args.topk_ids = tensor_view(ids.data(), mokInt32, {8, 2});
  expect_rejected(args, mokInvalidArgument, {"topk_ids[3, 1]", "duplicates topk_ids[3, 0]"});
}

TEST_F(CApi, ShapeDtypeDeviceStrideMismatches) {
  auto args = layer.args;
  args.x.dtype = mokFloat32;
  expect_rejected(args, mokInvalidArgument, {"x must be bfloat16, got float32"});
  args = layer.args;
  args.weights.w_gate = tensor_view(layer.wg.data(), mokBFloat16, {4, 8, 64});
  expect_rejected(args, mokInvalidArgument, {"w_gate has shape [4, 8, 64], expected [4, 16, 32]"});
  args = layer.args;
  args.topk_weights.device = 0;
  expect_rejected(args, mokInvalidArgument, {"topk_weights is on cuda:0, expected cpu"});
  args = layer.args;
  std::swap(args.x.strides[0], args.x.strides[1]);
  expect_rejected(args, mokInvalidArgument, {"x must be contiguous"});
  args = layer.args;
  args.weights.ws_gate = args.weights.w_gate;
  expect_rejected(args, mokInvalidArgument, {"shared_intermediate = 0"});
  args = layer.args;
  args.topk_ids.dtype = mokFloat32;
  expect_rejected(args, mokInvalidArgument, {"topk_ids must be int32 or int64"});
}

TEST_F(CApi, TooManyTokensForTheWorkspace) {
  std::vector<bf16_t> x(9 * 32), y(9 * 32);
  std::vector<int32_t> ids(18, 0);
  std::vector<float> w(18);
  auto args = layer.args;
  args.x = tensor_view(x.data(), mokBFloat16, {9, 32});
  args.topk_ids = tensor_view(ids.data(), mokInt32, {9, 2});
  args.topk_weights = tensor_view(w.data(), mokFloat32, {9, 2});
  args.y = tensor_view(y.data(), mokBFloat16, {9, 32});
  expect_rejected(args, mokInvalidArgument, {"9 tokens", "max_tokens = 8"});
}

TEST_F(CApi, CudaTensorsNeedACudaWorkspace) {
  auto args = layer.args;
  args.x.device = 0;
  const mokResult_t expected = mokHasCuda() ? mokInvalidArgument : mokNotSupported;
  expect_rejected(args, expected, {mokHasCuda() ? "workspace was created for the CPU" : "without its CUDA part"});
}

TEST_F(CApi, CudaBackwardNeedsACudaWorkspace) {
  std::vector<bf16_t> dy(8 * 32), dx(8 * 32), gg(4 * 16 * 32), gu(4 * 16 * 32), gd(4 * 32 * 16);
  std::vector<float> dw(16);
  mokBackwardArgs_t b{};
  b.fwd = layer.args;
  b.fwd.x.device = 0;
  b.dy = tensor_view(dy.data(), mokBFloat16, {8, 32});
  b.dx = tensor_view(dx.data(), mokBFloat16, {8, 32});
  b.d_topk_weights = tensor_view(dw.data(), mokFloat32, {8, 2});
  b.grads.w_gate = tensor_view(gg.data(), mokBFloat16, {4, 16, 32});
  b.grads.w_up = tensor_view(gu.data(), mokBFloat16, {4, 16, 32});
  b.grads.w_down = tensor_view(gd.data(), mokBFloat16, {4, 32, 16});
  EXPECT_EQ(mokBackward(ws, &b, nullptr), mokHasCuda() ? mokInvalidArgument : mokNotSupported);
  EXPECT_NE(std::string(mokGetLastError()).find(mokHasCuda() ? "workspace was created for the CPU" : "without its CUDA part"),
            std::string::npos)
      << mokGetLastError();
}

TEST_F(CApi, DescribePrintsTheCapacityFormula) {
  char buf[4096];
  size_t needed = 0;
  ASSERT_EQ(mokWorkspaceDescribe(ws, nullptr, 0, &needed), mokSuccess);
  ASSERT_GT(needed, 100u);
  ASSERT_LE(needed, sizeof(buf));
  ASSERT_EQ(mokWorkspaceDescribe(ws, buf, needed, nullptr), mokSuccess);
  EXPECT_EQ(std::strlen(buf) + 1, needed);
  EXPECT_NE(std::string(buf).find("P*T_max*min(k,E_l) + E_l*(block_m-1)"), std::string::npos) << buf;
  EXPECT_EQ(mokWorkspaceDescribe(ws, buf, 4, nullptr), mokInvalidArgument);
  EXPECT_EQ(mokWorkspaceDescribe(ws, nullptr, 0, nullptr), mokInvalidArgument);
}

TEST(CApiConfig, BadConfigsAreRejected) {
  mokWorkspace_t ws = nullptr;
  mokConfig_t c = MOK_CONFIG_INITIALIZER;
  EXPECT_EQ(mokWorkspaceCreate(&c, &ws), mokInvalidArgument);  // hidden = 0
  EXPECT_NE(std::string(mokGetLastError()).find("config.hidden"), std::string::npos) << mokGetLastError();
  c.hidden = 16;
  c.intermediate = 16;
  c.num_experts = 6;
  c.topk = 2;
  c.ep_size = 4;
  c.max_tokens = 8;
  EXPECT_EQ(mokWorkspaceCreate(&c, &ws), mokInvalidArgument);
  EXPECT_NE(std::string(mokGetLastError()).find("multiple of ep_size"), std::string::npos) << mokGetLastError();
  c.ep_size = 2;
  c.minibatch_size = 100;
  EXPECT_EQ(mokWorkspaceCreate(&c, &ws), mokInvalidArgument);
  c.minibatch_size = 128;
  c.macrobatch_size = 256;
  c.precision = mokPrecisionMXFP8;
  EXPECT_EQ(mokWorkspaceCreate(&c, &ws), mokInvalidArgument);
  EXPECT_NE(std::string(mokGetLastError()).find("precision"), std::string::npos);
  c.precision = mokPrecisionBF16;
  c.size = 0;
  EXPECT_EQ(mokWorkspaceCreate(&c, &ws), mokInvalidArgument);
  EXPECT_EQ(mokWorkspaceCreate(nullptr, &ws), mokInvalidUsage);
  EXPECT_EQ(mokForward(nullptr, nullptr, nullptr), mokInvalidUsage);
  EXPECT_STRNE(mokGetErrorString(mokTimeout), "unknown result code");
}

// mokCheckSupport's flags: on CUDA only the fused kernels read transposed routed weights; a
// config whose call would take the separate launches is named before any allocation (no device
// is needed: the check is the host's)
TEST(CApiConfig, CheckSupportNamesWhatTransposedWeightsNeed) {
  mokConfig_t c = MOK_CONFIG_INITIALIZER;
  c.hidden = 256;
  c.intermediate = 256;
  c.num_experts = 1024;
  c.topk = 2;
  c.max_tokens = 64;
  c.device = MOK_DEVICE_CPU;
  EXPECT_EQ(mokCheckSupport(&c, MOK_SUPPORT_BACKWARD | MOK_SUPPORT_TRANSPOSED), mokSuccess) << mokGetLastError();
  EXPECT_EQ(mokCheckSupport(&c, 4), mokInvalidArgument);
  EXPECT_NE(std::string(mokGetLastError()).find("flags = 4"), std::string::npos) << mokGetLastError();
  if (!mokHasCuda()) GTEST_SKIP() << "libmok without its CUDA part";
  c.device = 0;
  const int32_t both = MOK_SUPPORT_BACKWARD | MOK_SUPPORT_TRANSPOSED;
  auto refused = [&](int32_t flags, const char* why) {
    EXPECT_EQ(mokCheckSupport(&c, flags), mokNotSupported) << why;
    EXPECT_NE(std::string(mokGetLastError()).find(why), std::string::npos) << mokGetLastError();
  };
  auto taken = [&](int32_t flags) { EXPECT_EQ(mokCheckSupport(&c, flags), mokSuccess) << mokGetLastError(); };
  taken(MOK_SUPPORT_BACKWARD);    // row-major: the separate launches read it
  taken(MOK_SUPPORT_TRANSPOSED);  // the fused forward
  refused(both, "1024 local experts");
  refused(both, "row-major routed weights only");
  c.num_experts = 8;
  taken(both);
  c.num_blocks = 1;  // no comm block beside a compute block: the separate launches
  refused(both, "a grid of 1 block");
  c.num_blocks = 0;
  setenv("MOK_BACKWARD_PATH", "unfused", 1);
  refused(both, "MOK_BACKWARD_PATH=unfused");
  taken(MOK_SUPPORT_TRANSPOSED);
  unsetenv("MOK_BACKWARD_PATH");
  setenv("MOK_FORWARD_PATH", "unfused", 1);
  refused(MOK_SUPPORT_TRANSPOSED, "MOK_FORWARD_PATH=unfused");
  taken(0);
  unsetenv("MOK_FORWARD_PATH");
  taken(both);
}

TEST(CApiPlan, HostBuildMatchesCapacityAndRejectsBadIds) {
  mokConfig_t c = MOK_CONFIG_INITIALIZER;
  c.num_experts = 8;
  c.topk = 2;
  c.ep_size = 2;
  c.ep_rank = 1;
  c.max_tokens = 5;
  c.block_m = 4;
  c.minibatch_size = 4;
  c.macrobatch_size = 8;
  mokPlanCapacity_t cap{};
  ASSERT_EQ(mokPlanGetCapacity(&c, &cap), mokSuccess) << mokGetLastError();
  EXPECT_EQ(cap.num_local_experts, 4);
  EXPECT_EQ(cap.max_rows, ((2 * 5 * 2 + 4 * 3) / 4) * 4);
  std::vector<int32_t> ids0 = {4, 5, 0, 1, 6, -1, 7, 4, 2, 3}, ids1 = {5, 6, 7, 0};
  std::vector<int32_t> rows(static_cast<size_t>(cap.max_rows)), count(4), offset(5),
      blocks(static_cast<size_t>(cap.max_blocks));
  std::vector<int64_t> err(4);
  mokTensor_t ids[2] = {tensor_view(ids0.data(), mokInt32, {5, 2}), tensor_view(ids1.data(), mokInt32, {2, 2})};
  mokPlanArgs_t pa{2, ids, tensor_view(rows.data(), mokInt32, {cap.max_rows}), tensor_view(count.data(), mokInt32, {4}),
                   tensor_view(offset.data(), mokInt32, {5}), tensor_view(blocks.data(), mokInt32, {cap.max_blocks}),
                   tensor_view(err.data(), mokInt64, {4})};
  ASSERT_EQ(mokPlanBuild(&c, &pa, nullptr), mokSuccess) << mokGetLastError();
  EXPECT_EQ(count, (std::vector<int32_t>{2, 2, 2, 2}));  // experts 4..7 of rank 1
  EXPECT_EQ(offset, (std::vector<int32_t>{0, 4, 8, 12, 16}));
  EXPECT_EQ(static_cast<uint32_t>(rows[0]), encode_row(0, 0, 0));  // expert 4
  EXPECT_EQ(static_cast<uint32_t>(rows[1]), encode_row(0, 3, 1));
  EXPECT_EQ(static_cast<uint32_t>(rows[2]), kPadRow);
  EXPECT_EQ(static_cast<uint32_t>(rows[3]), kPadRow);
  EXPECT_EQ(static_cast<uint32_t>(rows[4]), encode_row(0, 0, 1));  // expert 5
  EXPECT_EQ(static_cast<uint32_t>(rows[5]), encode_row(1, 0, 0));
  EXPECT_EQ(blocks, (std::vector<int32_t>{0, 1, 2, 3, -1, -1, -1, -1}));
  EXPECT_EQ(err[0], kNoError);
  ids0[3] = 8;
  EXPECT_EQ(mokPlanBuild(&c, &pa, nullptr), mokInvalidArgument);
  EXPECT_NE(std::string(mokGetLastError()).find("rank 0: topk_ids[1, 1] = 8"), std::string::npos) << mokGetLastError();
}

TEST(CppApi, WorkspaceRaiiAndExceptions) {
  Layer layer(fresh_seed());
  mok::Workspace ws(layer.config);
  EXPECT_EQ(ws.config().hidden, Layer::H);
  EXPECT_NE(ws.describe().find("plan.rows"), std::string::npos);
  std::fill(layer.y.begin(), layer.y.end(), float_to_bf16(NAN));
  ws.forward(layer.args);
  const auto first = layer.y;
  for (auto v : first) ASSERT_FALSE(std::isnan(bf16_to_float(v)));
  mok::forward_emulated(layer.config, {layer.args});  // EP=1 emulated: the same bits
  EXPECT_EQ(0, std::memcmp(first.data(), layer.y.data(), first.size() * 2));
  auto bad = layer.args;
  bad.x.dtype = mokFloat32;
  try {
    ws.forward(bad);
    FAIL() << "expected mok::ApiError";
  } catch (const mok::ApiError& e) {
    EXPECT_EQ(e.code(), mokInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("x must be bfloat16"), std::string::npos) << e.what();
  }
  mokConfig_t c = mok::default_config();
  EXPECT_THROW(mok::Workspace{c}, mok::ApiError);
  mok::Workspace moved = std::move(ws);
  EXPECT_NE(moved.handle(), nullptr);
  EXPECT_EQ(ws.handle(), nullptr);
}

// mokGroupedGemm's checks run on the views before the CPU is rejected, so the dgrad-down
// SwiGLU kind's argument errors show on host memory too (nothing is launched).
static_assert(sizeof(mokGroupedGemmArgs_t) == 5 * sizeof(mokTensor_t) + 16 + 4 * sizeof(mokTensor_t) &&
                  offsetof(mokGroupedGemmArgs_t, h) == 5 * sizeof(mokTensor_t) + 16,
              "mokGroupedGemmArgs_t: the epilogue's tensors follow num_blocks (python/mok/_lib.py mirrors it)");

TEST(CApiGroupedGemm, DgradDownSwiGLUArgumentsAreChecked) {
  const int64_t M = 130, H = 64, I = 256, E = 2;
  std::vector<bf16_t> dy(M * H), w(E * H * I), h(M * 2 * I), dh(M * 2 * I), wa(M * I);
  std::vector<float> rw(M), part(M * I / 128);
  std::vector<int32_t> blocks = {0, 1};
  mokGroupedGemmArgs_t a{};
  a.a = tensor_view(dy.data(), mokBFloat16, {M, H});
  a.b0 = tensor_view(w.data(), mokBFloat16, {E, H, I});
  a.block_expert = tensor_view(blocks.data(), mokInt32, {2});
  a.out = tensor_view(dh.data(), mokBFloat16, {M, 2 * I});
  a.kind = mokGemmDgradDownSwiGLU;
  a.h = tensor_view(h.data(), mokBFloat16, {M, 2 * I});
  a.row_weight = tensor_view(rw.data(), mokFloat32, {M});
  a.wa = tensor_view(wa.data(), mokBFloat16, {M, I});
  a.dtw_partials = tensor_view(part.data(), mokFloat32, {M, I / 128});
  auto expect = [](const mokGroupedGemmArgs_t& args, const std::string& needle) {
    EXPECT_EQ(mokGroupedGemm(&args, nullptr), mokInvalidArgument) << needle;
    EXPECT_NE(std::string(mokGetLastError()).find(needle), std::string::npos)
        << "want \"" << needle << "\" in: " << mokGetLastError();
  };
  expect(a, "a is on the CPU; mokGroupedGemm runs on CUDA tensors");  // every view is right
  auto bad = a;
  bad.h = mokTensor_t{};
  expect(bad, "needs h: [M, 2I] = [130, 512] bfloat16");
  bad = a;
  bad.row_weight = mokTensor_t{};
  expect(bad, "needs row_weight: [M] = [130] float32");
  bad = a;
  bad.h = tensor_view(h.data(), mokBFloat16, {M, I});
  expect(bad, "h has shape [130, 256], expected [130, 512]");
  bad = a;
  bad.h.dtype = mokFloat32;
  expect(bad, "h must be bfloat16, got float32");
  bad = a;
  bad.row_weight.dtype = mokBFloat16;
  expect(bad, "row_weight must be float32, got bfloat16");
  bad = a;
  bad.out = tensor_view(dh.data(), mokBFloat16, {M, I});
  expect(bad, "out (dh) has shape [130, 256], expected [130, 512]");
  bad = a;
  bad.wa = tensor_view(wa.data(), mokBFloat16, {M, 2 * I});
  expect(bad, "wa has shape [130, 512], expected [130, 256]");
  bad = a;
  bad.dtw_partials = tensor_view(part.data(), mokFloat32, {M, 1});
  expect(bad, "dtw_partials has shape [130, 1], expected [130, 2]");
  bad = a;
  bad.b0 = tensor_view(w.data(), mokBFloat16, {E, H, 352});
  expect(bad, "I = b0.shape[2] = 352 must be a multiple of 64");
  // Optional outputs may be absent
  bad = a;
  bad.wa = mokTensor_t{};
  bad.dtw_partials = mokTensor_t{};
  expect(bad, "a is on the CPU");
  bad = a;
  bad.kind = 6;
  expect(bad, "kind = 6 is not a mokGemmKind_t");
}

// Column-major ("transposed") weights the CPU backend cannot follow are named before any work
// (tests/cpp/test_transposed.cpp runs the ones it can).
TEST_F(CApi, StridesNeitherRowNorColumnMajorAreNamed) {
  const int64_t E = Layer::E, I = Layer::I, H = Layer::H;
  std::vector<bf16_t> buf(E * H * 2 * I * 2, 0);
  auto args = layer.args;
  // The gate of an interleaved transposed gate_up [E, H, 2I]: stride 2 along I, 2I along H
  args.weights.w_gate = args.weights.w_up = strided_view(buf.data(), mokBFloat16, E, I, H, {2 * I * H, 2, 2 * I});
  expect_rejected(args, mokInvalidArgument,
                  {"w_gate has strides [1024, 2, 32] for shape [4, 16, 32]", "row-major", "column-major"});
  // Column-major with columns closer than one column's rows
  args = layer.args;
  args.weights.w_gate = args.weights.w_up = strided_view(buf.data(), mokBFloat16, E, I, H, {I * H, 1, I - 4});
  expect_rejected(args, mokInvalidArgument, {"w_gate is column-major with columns that overlap", "12 < 16 rows"});
  // Column-major matrices that overlap each other
  args = layer.args;
  args.weights.w_down = strided_view(buf.data(), mokBFloat16, E, H, I, {H * I - 1, 1, H});
  expect_rejected(args, mokInvalidArgument, {"w_down has matrices that overlap", "511", "512 elements"});
  // Gate column-major, up row-major: one row index cannot serve both
  args = layer.args;
  args.weights.w_gate = strided_view(buf.data(), mokBFloat16, E, I, H, {I * H, 1, I});
  expect_rejected(args, mokInvalidArgument, {"w_up has strides [512, 32, 1] but w_gate has [512, 1, 16]",
                                             "must share strides"});
}

TEST_F(CApi, TransposedGradientsOfGateAndUpShareStrides) {
  const int64_t E = Layer::E, I = Layer::I, H = Layer::H, T = Layer::T;
  std::vector<bf16_t> dy(T * H), dx(T * H), gg(E * I * H), gu(E * I * H), gd(E * H * I);
  std::vector<float> dtw(T * 2);
  mokBackwardArgs_t b{};
  b.fwd = layer.args;
  b.dy = tensor_view(dy.data(), mokBFloat16, {T, H});
  b.dx = tensor_view(dx.data(), mokBFloat16, {T, H});
  b.d_topk_weights = tensor_view(dtw.data(), mokFloat32, {T, 2});
  b.grads.w_gate = strided_view(gg.data(), mokBFloat16, E, I, H, {I * H, 1, I});
  b.grads.w_up = tensor_view(gu.data(), mokBFloat16, {E, I, H});
  b.grads.w_down = strided_view(gd.data(), mokBFloat16, E, H, I, {H * I, 1, H});
  EXPECT_EQ(mokBackward(ws, &b, nullptr), mokInvalidArgument);
  EXPECT_NE(std::string(mokGetLastError()).find("grad of w_up has strides [512, 32, 1] but grad of w_gate has "
                                                "[512, 1, 16]"),
            std::string::npos)
      << mokGetLastError();
  b.grads.w_up = strided_view(gu.data(), mokBFloat16, E, I, H, {I * H, 1, I});
  EXPECT_EQ(mokBackward(ws, &b, nullptr), mokSuccess) << mokGetLastError();
}

}  // namespace
}  // namespace mok::test
