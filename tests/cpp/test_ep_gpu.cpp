// The EP >= 2 forward: P ranks as "virtual ranks" on one GPU (P regions on one device, each
// rank on its own stream with SMs / P blocks: the whole protocol in one process), and real
// EP = 2 over two GPUs with peer access when the machine has them.  Every rank's y must be
// bitwise the EP = 1 forward of the same tokens with all experts local (placement
// invariance); runs repeat bitwise; a rank that never arrives is a timeout error naming the
// peer, not a hang.  Skips cleanly without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>

#include "common/symmetric.hpp"
#include "mok/mok.h"
#include "mok/mok.hpp"
#include "gpu_util.hpp"
#include "test_util.hpp"

namespace mok::test {
namespace {

using mok::tensor_view;

struct Shape {
  int64_t H = 512, I = 256, Is = 0, E = 16, k = 4;
};

// One rank's inputs (host) and, per device, the layer's global weights.
struct RankData {
  int64_t T;
  std::vector<bf16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> w;
};

struct Weights {
  std::vector<bf16_t> wg, wu, wd, sg, su, sd;
};

Weights make_weights(std::mt19937_64& rng, const Shape& s) {
  const float sh = 1.f / std::sqrt(static_cast<float>(s.H)), si = 1.f / std::sqrt(static_cast<float>(s.I));
  Weights w;
  w.wg = random_bf16(rng, static_cast<size_t>(s.E * s.I * s.H), sh);
  w.wu = random_bf16(rng, static_cast<size_t>(s.E * s.I * s.H), sh);
  w.wd = random_bf16(rng, static_cast<size_t>(s.E * s.H * s.I), si);
  const int64_t Is = std::max<int64_t>(s.Is, 1);
  w.sg = random_bf16(rng, static_cast<size_t>(Is * s.H), sh);
  w.su = random_bf16(rng, static_cast<size_t>(Is * s.H), sh);
  w.sd = random_bf16(rng, static_cast<size_t>(s.H * Is), 1.f / std::sqrt(static_cast<float>(Is)));
  return w;
}

RankData make_rank(std::mt19937_64& rng, const Shape& s, int64_t T, int64_t E_l, Routing r) {
  RankData d{T, random_bf16(rng, static_cast<size_t>(T * s.H), 1.f), {}, random_f32(rng, static_cast<size_t>(T * s.k), -0.2f, 1.f)};
  d.ids = to_int32(make_ids(rng, T, static_cast<int>(s.k), s.E, E_l, r));
  return d;
}

struct DeviceWeights {
  DeviceBuffer wg, wu, wd, sg, su, sd;
  explicit DeviceWeights(const Weights& w) : wg(w.wg), wu(w.wu), wd(w.wd), sg(w.sg), su(w.su), sd(w.sd) {}
};

mokConfig_t config_for(const Shape& s, int64_t max_tokens, int64_t P, int64_t rank, int device) {
  mokConfig_t c = MOK_CONFIG_INITIALIZER;
  c.hidden = s.H;
  c.intermediate = s.I;
  c.shared_intermediate = s.Is;
  c.num_experts = s.E;
  c.topk = s.k;
  c.ep_size = P;
  c.ep_rank = rank;
  c.max_tokens = std::max<int64_t>(max_tokens, 1);
  c.device = device;
  c.timeout_s = 20;
  return c;
}

// A rank's device inputs and output, weights as views of the local slice.
struct RankCall {
  DeviceBuffer x, ids, w, y;
  mokForwardArgs_t a{};
  RankCall(const Shape& s, const RankData& d, const DeviceWeights& dw, int64_t first_expert, int64_t E_l, int device)
      : x(d.x), ids(d.ids), w(d.w), y(static_cast<size_t>(d.T * s.H) * 2) {
    const int64_t T = d.T;
    a.x = tensor_view(x.ptr, mokBFloat16, {T, s.H}, device);
    a.topk_ids = tensor_view(ids.ptr, mokInt32, {T, s.k}, device);
    a.topk_weights = tensor_view(w.ptr, mokFloat32, {T, s.k}, device);
    auto* wg = static_cast<uint16_t*>(dw.wg.ptr) + first_expert * s.I * s.H;
    auto* wu = static_cast<uint16_t*>(dw.wu.ptr) + first_expert * s.I * s.H;
    auto* wd = static_cast<uint16_t*>(dw.wd.ptr) + first_expert * s.H * s.I;
    a.weights.w_gate = tensor_view(wg, mokBFloat16, {E_l, s.I, s.H}, device);
    a.weights.w_up = tensor_view(wu, mokBFloat16, {E_l, s.I, s.H}, device);
    a.weights.w_down = tensor_view(wd, mokBFloat16, {E_l, s.H, s.I}, device);
    if (s.Is > 0) {
      a.weights.ws_gate = tensor_view(dw.sg.ptr, mokBFloat16, {s.Is, s.H}, device);
      a.weights.ws_up = tensor_view(dw.su.ptr, mokBFloat16, {s.Is, s.H}, device);
      a.weights.ws_down = tensor_view(dw.sd.ptr, mokBFloat16, {s.H, s.Is}, device);
    }
    a.y = tensor_view(y.ptr, mokBFloat16, {T, s.H}, device);
  }
};

// EP = 1 forward of one rank's tokens with every expert local.
std::vector<bf16_t> ep1_forward(const Shape& s, const RankData& d, const DeviceWeights& dw, int64_t max_tokens) {
  mokConfig_t c = config_for(s, max_tokens, 1, 0, 0);
  mokWorkspace_t ws;
  EXPECT_EQ(mokWorkspaceCreate(&c, &ws), mokSuccess) << mokGetLastError();
  RankCall call(s, d, dw, 0, s.E, 0);
  EXPECT_EQ(mokForward(ws, &call.a, nullptr), mokSuccess) << mokGetLastError();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(mokWorkspaceCheckErrors(ws, 1), mokSuccess) << mokGetLastError();
  mokWorkspaceDestroy(ws);
  return call.y.get<bf16_t>();
}

// The group: regions (one allocation per device), workspaces, streams.
struct Group {
  int64_t P;
  std::vector<int> devices;  // device of each rank
  std::vector<void*> regions;
  std::vector<void*> allocations;
  std::vector<mokWorkspace_t> ws;
  std::vector<cudaStream_t> streams;
  size_t bytes = 0;

  Group(const Shape& s, int64_t max_tokens, int64_t P_, std::vector<int> devs, int64_t minibatch = 0,
        int64_t macrobatch = 0, double timeout_s = 20)
      : P(P_), devices(std::move(devs)) {
    mokConfig_t c0 = config_for(s, max_tokens, P, 0, devices[0]);
    EXPECT_EQ(mokSymmetricBytes(&c0, &bytes), mokSuccess) << mokGetLastError();
    const bool virtual_ranks = devices[0] == devices.back();
    if (virtual_ranks) {
      void* base = nullptr;
      EXPECT_EQ(cudaSetDevice(devices[0]), cudaSuccess);
      EXPECT_EQ(cudaMalloc(&base, bytes * static_cast<size_t>(P)), cudaSuccess);
      EXPECT_EQ(cudaMemset(base, 0, bytes * static_cast<size_t>(P)), cudaSuccess);
      allocations.push_back(base);
      for (int64_t r = 0; r < P; ++r) regions.push_back(static_cast<uint8_t*>(base) + r * bytes);
    } else {
      for (int64_t r = 0; r < P; ++r) {
        void* p = nullptr;
        EXPECT_EQ(cudaSetDevice(devices[r]), cudaSuccess);
        EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
        EXPECT_EQ(cudaMemset(p, 0, bytes), cudaSuccess);
        allocations.push_back(p);
        regions.push_back(p);
      }
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
    int sms = 0;
    EXPECT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, devices[0]), cudaSuccess);
    for (int64_t r = 0; r < P; ++r) {
      mokConfig_t c = config_for(s, max_tokens, P, r, devices[r]);
      if (virtual_ranks) c.num_blocks = sms / P;
      if (minibatch) c.minibatch_size = minibatch;
      if (macrobatch) c.macrobatch_size = macrobatch;
      c.timeout_s = timeout_s;
      mokWorkspace_t w = nullptr;
      EXPECT_EQ(mokWorkspaceCreateSymmetric(&c, regions.data(), P, &w), mokSuccess) << mokGetLastError();
      ws.push_back(w);
      cudaStream_t st;
      EXPECT_EQ(cudaSetDevice(devices[r]), cudaSuccess);
      EXPECT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
      streams.push_back(st);
    }
    cudaSetDevice(devices[0]);
  }
  ~Group() {
    for (auto w : ws) mokWorkspaceDestroy(w);
    for (auto st : streams) cudaStreamDestroy(st);
    for (auto p : allocations) cudaFree(p);
    cudaSetDevice(devices[0]);
  }
  // One call of every rank (ranks in `which`), each on its own stream; waits for all.
  // grouped: all ranks through mokForwardGroup (phase by phase); otherwise one mokForward per
  // rank, each rank's whole call issued before the next rank's.
  void run(std::vector<std::unique_ptr<RankCall>>& calls, const std::vector<int64_t>& which, bool grouped = true) {
    for (int64_t r : which) {
      cudaSetDevice(devices[r]);
      EXPECT_EQ(cudaMemsetAsync(calls[r]->y.ptr, 0xFF, calls[r]->y.bytes, streams[r]), cudaSuccess);
    }
    if (grouped && static_cast<int64_t>(which.size()) == P) {
      std::vector<mokForwardArgs_t> args;
      std::vector<void*> st;
      for (int64_t r = 0; r < P; ++r) {
        args.push_back(calls[r]->a);
        st.push_back(streams[r]);
      }
      EXPECT_EQ(mokForwardGroup(ws.data(), args.data(), P, st.data()), mokSuccess) << mokGetLastError();
    } else {
      for (int64_t r : which) {
        cudaSetDevice(devices[r]);
        EXPECT_EQ(mokForward(ws[r], &calls[r]->a, streams[r]), mokSuccess) << "rank " << r << ": " << mokGetLastError();
      }
    }
    for (int64_t r : which) {
      cudaSetDevice(devices[r]);
      EXPECT_EQ(cudaStreamSynchronize(streams[r]), cudaSuccess);
    }
    cudaSetDevice(devices[0]);
  }
};

struct Case {
  Shape s;
  int64_t P;
  std::vector<int64_t> T;  // per rank
  Routing routing;
  int64_t minibatch = 0, macrobatch = 0;
  int reps = 3;
  bool grouped = true;  // mokForwardGroup, or one mokForward per rank
};

void check_group(const Case& cs, std::vector<int> devices, uint64_t seed) {
  const Shape& s = cs.s;
  const int64_t P = cs.P, E_l = s.E / P;
  SCOPED_TRACE("seed=" + std::to_string(seed) + " P=" + std::to_string(P) + " routing=" + routing_name(cs.routing) +
               " devices=" + std::to_string(devices[0]) + ".." + std::to_string(devices.back()));
  std::mt19937_64 rng(seed);
  const Weights w = make_weights(rng, s);
  std::vector<RankData> data;
  int64_t max_tokens = 1;
  for (int64_t r = 0; r < P; ++r) {
    data.push_back(make_rank(rng, s, cs.T[r], E_l, cs.routing));
    max_tokens = std::max(max_tokens, cs.T[r]);
  }
  // EP = 1 on device 0, all experts local: the bits every rank must reproduce
  cudaSetDevice(devices[0]);
  const DeviceWeights dw0(w);
  std::vector<std::vector<bf16_t>> want;
  for (int64_t r = 0; r < P; ++r) want.push_back(ep1_forward(s, data[r], dw0, max_tokens));

  Group g(s, max_tokens, P, devices, cs.minibatch, cs.macrobatch);
  std::vector<std::unique_ptr<DeviceWeights>> dws;  // weights on each rank's device
  std::vector<std::unique_ptr<RankCall>> calls;
  std::vector<int64_t> all;
  for (int64_t r = 0; r < P; ++r) {
    cudaSetDevice(devices[r]);
    dws.push_back(std::make_unique<DeviceWeights>(w));
    calls.push_back(std::make_unique<RankCall>(s, data[r], *dws.back(), r * E_l, E_l, devices[r]));
    all.push_back(r);
  }
  cudaSetDevice(devices[0]);
  for (int rep = 0; rep < cs.reps; ++rep) {
    g.run(calls, all, cs.grouped);
    for (int64_t r = 0; r < P; ++r) {
      EXPECT_EQ(mokWorkspaceCheckErrors(g.ws[r], 1), mokSuccess) << "rank " << r << ": " << mokGetLastError();
      const auto got = calls[r]->y.get<bf16_t>();
      ASSERT_EQ(got.size(), want[r].size());
      int64_t bad = 0, first = -1;
      for (size_t i = 0; i < got.size(); ++i)
        if (got[i] != want[r][i]) {
          if (first < 0) first = static_cast<int64_t>(i);
          ++bad;
        }
      ASSERT_EQ(bad, 0) << "rep " << rep << " rank " << r << ": " << bad << " elements differ from EP=1, first at token "
                        << (first >= 0 ? first / s.H : -1) << " col " << (first >= 0 ? first % s.H : -1);
    }
  }
  std::printf("EP=%ld %s T=[%ld..] devices %d..%d: %d runs, every rank bitwise equal to EP=1\n", (long)P,
              routing_name(cs.routing), (long)cs.T[0], devices[0], devices.back(), cs.reps);
}

std::vector<int> same_device(int64_t P) { return std::vector<int>(static_cast<size_t>(P), 0); }

TEST(EpGpu, VirtualRanksMatchEp1) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = fresh_seed();
  Shape s;
  for (int64_t P : {2, 4, 8}) {
    check_group(Case{s, P, std::vector<int64_t>(static_cast<size_t>(P), 300), Routing::kUniform}, same_device(P), seed);
  }
}

TEST(EpGpu, VirtualRanksSkew) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = fresh_seed();
  Shape s;
  s.Is = 128;
  const std::vector<int64_t> mixed{300, 0, 517, 129};  // one rank with T = 0, T per rank different
  for (Routing r : {Routing::kOneExpert, Routing::kOneRank, Routing::kMasked, Routing::kZipf})
    check_group(Case{s, 4, mixed, r}, same_device(4), seed);
  // Ring smaller than the routed rows: it wraps
  check_group(Case{s, 4, mixed, Routing::kUniform, 128, 256}, same_device(4), seed);
}

TEST(EpGpu, VirtualRanksRunToRun) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Shape s;
  Case cs{s, 4, {200, 333, 64, 250}, Routing::kUniform};
  cs.reps = 100;
  cs.grouped = false;  // one mokForward per rank (this test's streams have queues of their own)
  check_group(cs, same_device(4), fresh_seed());
}

// The small case compute-sanitizer runs (memcheck, racecheck): virtual EP = 4, one call.
TEST(EpGpu, SanitizerSmall) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Shape s;
  s.H = 256;
  s.I = 128;
  s.Is = 128;
  s.E = 8;
  s.k = 2;
  Case cs{s, 4, {64, 0, 130, 17}, Routing::kUniform};
  cs.reps = 1;
  check_group(cs, same_device(4), fresh_seed());
}

// ---- the backward -------------------------------------------------------------------------
// A rank's backward buffers: dy in, dx, d topk_weights and the weight gradients out (poisoned).
struct RankBackward {
  DeviceBuffer dy, dx, dtw, gg, gu, gd, sg, su, sd;
  mokBackwardArgs_t a{};
  RankBackward(const Shape& s, const RankCall& call, const std::vector<bf16_t>& dy_host, int64_t E_l, int device)
      : dy(dy_host), dx(dy_host.size() * 2), dtw(static_cast<size_t>(call.a.x.shape[0] * s.k) * 4),
        gg(static_cast<size_t>(E_l * s.I * s.H) * 2), gu(static_cast<size_t>(E_l * s.I * s.H) * 2),
        gd(static_cast<size_t>(E_l * s.H * s.I) * 2), sg(static_cast<size_t>(std::max<int64_t>(s.Is, 1) * s.H) * 2),
        su(static_cast<size_t>(std::max<int64_t>(s.Is, 1) * s.H) * 2),
        sd(static_cast<size_t>(std::max<int64_t>(s.Is, 1) * s.H) * 2) {
    const int64_t T = call.a.x.shape[0];
    a.fwd = call.a;
    a.dy = tensor_view(dy.ptr, mokBFloat16, {T, s.H}, device);
    a.dx = tensor_view(dx.ptr, mokBFloat16, {T, s.H}, device);
    a.d_topk_weights = tensor_view(dtw.ptr, mokFloat32, {T, s.k}, device);
    a.grads.w_gate = tensor_view(gg.ptr, mokBFloat16, {E_l, s.I, s.H}, device);
    a.grads.w_up = tensor_view(gu.ptr, mokBFloat16, {E_l, s.I, s.H}, device);
    a.grads.w_down = tensor_view(gd.ptr, mokBFloat16, {E_l, s.H, s.I}, device);
    if (s.Is > 0) {
      a.grads.ws_gate = tensor_view(sg.ptr, mokBFloat16, {s.Is, s.H}, device);
      a.grads.ws_up = tensor_view(su.ptr, mokBFloat16, {s.Is, s.H}, device);
      a.grads.ws_down = tensor_view(sd.ptr, mokBFloat16, {s.H, s.Is}, device);
    }
  }
};

// EP = P backward through mokBackwardGroup (the fused kernel by default), rank r on
// devices[r] (all on one device: virtual ranks): each rank's dx and d topk_weights bitwise
// equal to the EP = 1 backward of its own tokens alone on devices[0] (a token's gradients
// depend on its rows only), and every output of every rank (dx, d topk_weights, the routed and
// shared weight gradients) the same bits in each of `reps` runs.  The small case is what
// compute-sanitizer runs (memcheck, racecheck) in tools/gpu_check.sh.
void check_group_backward(const Shape& s, int64_t P, const std::vector<int64_t>& T, int reps, uint64_t seed,
                          std::vector<int> devices = {}, Routing routing = Routing::kUniform) {
  if (devices.empty()) devices = same_device(P);
  SCOPED_TRACE("seed=" + std::to_string(seed) + " backward P=" + std::to_string(P) + " routing=" +
               routing_name(routing) + " devices=" + std::to_string(devices[0]) + ".." +
               std::to_string(devices.back()));
  const int64_t E_l = s.E / P;
  std::mt19937_64 rng(seed);
  const Weights w = make_weights(rng, s);
  std::vector<RankData> data;
  std::vector<std::vector<bf16_t>> dys;
  int64_t max_tokens = 1;
  for (int64_t r = 0; r < P; ++r) {
    data.push_back(make_rank(rng, s, T[r], E_l, routing));
    dys.push_back(random_bf16(rng, static_cast<size_t>(T[r] * s.H), 0.5f));
    max_tokens = std::max(max_tokens, T[r]);
  }
  // EP = 1 on devices[0], all experts local, one rank's tokens at a time
  cudaSetDevice(devices[0]);
  std::vector<std::vector<bf16_t>> want_dx;
  std::vector<std::vector<float>> want_dtw;
  {
    const DeviceWeights dw0(w);
    for (int64_t r = 0; r < P; ++r) {
      mokConfig_t c = config_for(s, max_tokens, 1, 0, devices[0]);
      mokWorkspace_t ws;
      ASSERT_EQ(mokWorkspaceCreate(&c, &ws), mokSuccess) << mokGetLastError();
      RankCall call(s, data[r], dw0, 0, s.E, devices[0]);
      RankBackward bw(s, call, dys[r], s.E, devices[0]);
      ASSERT_EQ(mokBackward(ws, &bw.a, nullptr), mokSuccess) << mokGetLastError();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(mokWorkspaceCheckErrors(ws, 1), mokSuccess) << mokGetLastError();
      want_dx.push_back(bw.dx.get<bf16_t>());
      want_dtw.push_back(bw.dtw.get<float>());
      mokWorkspaceDestroy(ws);
    }
  }
  Group g(s, max_tokens, P, devices);
  std::vector<std::unique_ptr<DeviceWeights>> dws;  // weights on each rank's device
  std::vector<std::unique_ptr<RankCall>> calls;
  std::vector<std::unique_ptr<RankBackward>> bws;
  for (int64_t r = 0; r < P; ++r) {
    cudaSetDevice(devices[r]);
    dws.push_back(std::make_unique<DeviceWeights>(w));
    calls.push_back(std::make_unique<RankCall>(s, data[r], *dws.back(), r * E_l, E_l, devices[r]));
    bws.push_back(std::make_unique<RankBackward>(s, *calls.back(), dys[r], E_l, devices[r]));
  }
  // Every output buffer of a rank, for the run-to-run check
  auto outputs = [](RankBackward& b) {
    return std::vector<DeviceBuffer*>{&b.dx, &b.dtw, &b.gg, &b.gu, &b.gd, &b.sg, &b.su, &b.sd};
  };
  std::vector<std::vector<std::vector<uint8_t>>> first(static_cast<size_t>(P));
  for (int rep = 0; rep < reps; ++rep) {
    std::vector<mokBackwardArgs_t> args;
    std::vector<void*> st;
    for (int64_t r = 0; r < P; ++r) {
      cudaSetDevice(devices[r]);
      for (DeviceBuffer* b : outputs(*bws[r])) EXPECT_EQ(cudaMemset(b->ptr, 0xFF, b->bytes), cudaSuccess);
      args.push_back(bws[r]->a);
      st.push_back(g.streams[r]);
    }
    for (int64_t r = 0; r < P; ++r) {
      cudaSetDevice(devices[r]);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the poison landed before any rank starts
    }
    cudaSetDevice(devices[0]);
    ASSERT_EQ(mokBackwardGroup(g.ws.data(), args.data(), nullptr, P, st.data()), mokSuccess) << mokGetLastError();
    for (int64_t r = 0; r < P; ++r) {
      cudaSetDevice(devices[r]);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
    cudaSetDevice(devices[0]);
    for (int64_t r = 0; r < P; ++r) {
      ASSERT_EQ(mokWorkspaceCheckErrors(g.ws[r], 1), mokSuccess) << "rank " << r << ": " << mokGetLastError();
      const auto dx = bws[r]->dx.get<bf16_t>();
      const auto dtw = bws[r]->dtw.get<float>();
      int64_t bad = 0;
      for (size_t i = 0; i < dx.size(); ++i) bad += dx[i] != want_dx[r][i];
      ASSERT_EQ(bad, 0) << "rep " << rep << " rank " << r << ": dx elements differ from EP = 1";
      ASSERT_EQ(std::memcmp(dtw.data(), want_dtw[r].data(), dtw.size() * 4), 0)
          << "rep " << rep << " rank " << r << ": d topk_weights differ from EP = 1";
      const auto outs = outputs(*bws[r]);
      for (size_t o = 0; o < outs.size(); ++o) {
        const auto bytes = outs[o]->get<uint8_t>();
        if (rep == 0) {
          first[r].push_back(bytes);
        } else {
          ASSERT_TRUE(bytes == first[r][o]) << "rep " << rep << " rank " << r << ": output " << o
                                            << " (dx, dtw, w_gate, w_up, w_down, ws_gate, ws_up, ws_down) "
                                               "differs from the first run";
        }
      }
    }
  }
  std::printf("backward EP=%ld %s T=[%ld..] devices %d..%d: %d runs, dx and d topk_weights of every rank bitwise "
              "equal to EP=1, every output the same bits in every run\n",
              (long)P, routing_name(routing), (long)T[0], devices[0], devices.back(), reps);
}

TEST(EpGpu, BackwardVirtualRanksMatchEp1) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Shape s;
  s.Is = 256;
  const uint64_t seed = fresh_seed();
  check_group_backward(s, 2, {300, 200}, 3, seed);
  check_group_backward(s, 4, {300, 0, 517, 129}, 3, seed);
  check_group_backward(s, 8, std::vector<int64_t>(8, 130), 2, seed);
  check_group_backward(s, 4, {300, 0, 517, 129}, 2, seed, {}, Routing::kZipf);
}

// The small backward compute-sanitizer runs: virtual EP = 4, one call.
TEST(EpGpu, SanitizerSmallBackward) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Shape s;
  s.H = 256;
  s.I = 256;
  s.Is = 256;
  s.E = 8;
  s.k = 2;
  check_group_backward(s, 4, {64, 0, 130, 17}, 1, fresh_seed());
}

// Rank 1 of a 2-rank group (rank r on devices[r]) never calls: rank 0's forward, or its
// backward, comes back on its own with a timeout error that names the rank, the peer and the
// wait.
void check_missing_rank(std::vector<int> devices, bool backward) {
  SCOPED_TRACE(std::string(backward ? "backward" : "forward") + " devices=" + std::to_string(devices[0]) + "," +
               std::to_string(devices[1]));
  Shape s;
  std::mt19937_64 rng(fresh_seed());
  const Weights w = make_weights(rng, s);
  const RankData d = make_rank(rng, s, 100, s.E / 2, Routing::kUniform);
  Group g(s, 100, 2, devices, 0, 0, /*timeout_s=*/0.5);
  std::vector<std::unique_ptr<DeviceWeights>> dws;
  std::vector<std::unique_ptr<RankCall>> calls;
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(devices[r]);
    dws.push_back(std::make_unique<DeviceWeights>(w));
    calls.push_back(std::make_unique<RankCall>(s, d, *dws.back(), r * (s.E / 2), s.E / 2, devices[r]));
  }
  cudaSetDevice(devices[0]);
  if (!backward) {
    g.run(calls, {0});  // rank 1 never calls
  } else {
    const std::vector<bf16_t> dy = random_bf16(rng, static_cast<size_t>(100 * s.H), 0.5f);
    RankBackward bw(s, *calls[0], dy, s.E / 2, devices[0]);
    ASSERT_EQ(mokBackward(g.ws[0], &bw.a, g.streams[0]), mokSuccess) << mokGetLastError();
    ASSERT_EQ(cudaStreamSynchronize(g.streams[0]), cudaSuccess);
  }
  EXPECT_EQ(mokWorkspaceCheckErrors(g.ws[0], 1), mokTimeout);
  const std::string msg = mokGetLastError();
  EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("peer 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("barrier"), std::string::npos) << msg;
  std::printf("%s timeout message: %s\n", backward ? "backward" : "forward", msg.c_str());
}

TEST(EpGpu, MissingRankTimesOut) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  check_missing_rank(same_device(2), false);
}

TEST(EpGpu, BackwardMissingRankTimesOut) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  check_missing_rank(same_device(2), true);
}

// A bad id on one rank is masked on the device and reported by every rank (each rank's plan
// build validates the whole group's routing), naming the rank, token and j; no hang.
TEST(EpGpu, InvalidIdReportedOnEveryRank) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Shape s;
  const int64_t P = 4, E_l = s.E / P;
  std::mt19937_64 rng(fresh_seed());
  const Weights w = make_weights(rng, s);
  const DeviceWeights dw(w);
  std::vector<RankData> data;
  for (int64_t r = 0; r < P; ++r) data.push_back(make_rank(rng, s, 100, E_l, Routing::kUniform));
  data[2].ids[static_cast<size_t>(7 * s.k + 1)] = static_cast<int32_t>(s.E + 5);  // rank 2, token 7, j = 1
  Group g(s, 100, P, same_device(P));
  std::vector<std::unique_ptr<RankCall>> calls;
  std::vector<int64_t> all;
  for (int64_t r = 0; r < P; ++r) {
    calls.push_back(std::make_unique<RankCall>(s, data[r], dw, r * E_l, E_l, 0));
    all.push_back(r);
  }
  g.run(calls, all);
  for (int64_t r = 0; r < P; ++r) {
    EXPECT_EQ(mokWorkspaceCheckErrors(g.ws[r], 1), mokDeviceInvalidRoute) << "rank " << r;
    const std::string msg = mokGetLastError();
    EXPECT_NE(msg.find("topk_ids of rank 2 [7, 1] = " + std::to_string(s.E + 5)), std::string::npos) << msg;
  }
}

// Ranks created with different configurations: every rank reports the peer whose region has
// another byte map, before writing anything into it; the call does not run (no timeout wait).
TEST(EpGpu, ConfigMismatchIsReportedNotWritten) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Shape s;
  std::mt19937_64 rng(fresh_seed());
  const Weights w = make_weights(rng, s);
  const DeviceWeights dw(w);
  const RankData d = make_rank(rng, s, 100, s.E / 2, Routing::kUniform);
  mokConfig_t c0 = config_for(s, 100, 2, 0, 0), c1 = config_for(s, 200, 2, 1, 0);  // max_tokens differ
  c0.num_blocks = c1.num_blocks = 16;
  size_t b0 = 0, b1 = 0;
  ASSERT_EQ(mokSymmetricBytes(&c0, &b0), mokSuccess);
  ASSERT_EQ(mokSymmetricBytes(&c1, &b1), mokSuccess);
  const size_t bytes = std::max(b0, b1);
  DeviceBuffer regions_mem(2 * bytes, 0);
  void* regions[2] = {regions_mem.ptr, static_cast<uint8_t*>(regions_mem.ptr) + bytes};
  mokWorkspace_t ws[2] = {nullptr, nullptr};
  ASSERT_EQ(mokWorkspaceCreateSymmetric(&c0, regions, 2, &ws[0]), mokSuccess) << mokGetLastError();
  ASSERT_EQ(mokWorkspaceCreateSymmetric(&c1, regions, 2, &ws[1]), mokSuccess) << mokGetLastError();
  RankCall r0(s, d, dw, 0, s.E / 2, 0), r1(s, d, dw, s.E / 2, s.E / 2, 0);
  // What rank 0 would write into rank 1's region lies before x in rank 0's byte map (header,
  // flags, tokens, routing); rank 1 itself writes nothing there when the call stops.
  const size_t watched = static_cast<size_t>(mok::sym_layout(2, 100, s.k, s.H).x);
  const std::vector<uint8_t> before = [&] {
    std::vector<uint8_t> h(watched);
    cudaMemcpy(h.data(), regions[1], watched, cudaMemcpyDeviceToHost);
    return h;
  }();
  mokForwardArgs_t args[2] = {r0.a, r1.a};
  cudaStream_t st[2];
  for (auto& x : st) ASSERT_EQ(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking), cudaSuccess);
  void* streams[2] = {st[0], st[1]};
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(mokForwardGroup(ws, args, 2, streams), mokSuccess) << mokGetLastError();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, 5.0) << "a mismatch must stop the call, not wait for the deadline";
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(mokWorkspaceCheckErrors(ws[r], 1), mokInvalidUsage) << "rank " << r;
    const std::string msg = mokGetLastError();
    EXPECT_NE(msg.find("peer " + std::to_string(1 - r)), std::string::npos) << msg;
    EXPECT_NE(msg.find("another configuration"), std::string::npos) << msg;
  }
  std::vector<uint8_t> after(watched);
  cudaMemcpy(after.data(), regions[1], watched, cudaMemcpyDeviceToHost);
  EXPECT_TRUE(std::equal(before.begin(), before.end(), after.begin())) << "rank 0 wrote into a mismatched region";
  for (auto& x : st) cudaStreamDestroy(x);
  for (auto& x : ws) mokWorkspaceDestroy(x);
}

// Real EP over every visible GPU (2 on an x2 machine, 4 or 8 where lent), peer access in one
// process: every rank's bits equal EP = 1.
TEST(EpGpu, AllGpusMatchEp1) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) GTEST_SKIP() << "fewer than two CUDA devices";
  const int P = n >= 8 ? 8 : (n >= 4 ? 4 : 2);  // E = 16 experts: P must divide it
  for (int d = 0; d < P; ++d)
    for (int e = 0; e < P; ++e) {
      if (d == e) continue;
      int can = 0;
      cudaDeviceCanAccessPeer(&can, d, e);
      if (!can) GTEST_SKIP() << "no peer access from device " << d << " to " << e;
      cudaSetDevice(d);
      const cudaError_t err = cudaDeviceEnablePeerAccess(e, 0);
      ASSERT_TRUE(err == cudaSuccess || err == cudaErrorPeerAccessAlreadyEnabled) << cudaGetErrorString(err);
      cudaGetLastError();
    }
  cudaSetDevice(0);
  Shape s;
  s.Is = 128;
  const uint64_t seed = fresh_seed();
  std::vector<int> devices;
  std::vector<int64_t> T, T_skew;
  const int64_t counts[] = {300, 517, 129, 384, 64, 290, 200, 311};
  for (int d = 0; d < P; ++d) {
    devices.push_back(d);
    T.push_back(counts[d]);
    T_skew.push_back(d == 1 ? 0 : counts[d]);  // one rank with T = 0
  }
  Case cs{s, P, T, Routing::kUniform};
  cs.reps = 20;
  check_group(cs, devices, seed);
  check_group(Case{s, P, T_skew, Routing::kZipf}, devices, seed);
  check_group(Case{s, P, T, Routing::kMasked, 128, 256}, devices, seed);  // the ring wraps
  // The backward over the same devices: uneven T, zipf with a rank of no tokens, 100 runs
  Shape sb;
  sb.Is = 256;
  check_group_backward(sb, P, T, 3, seed, devices, Routing::kUniform);
  check_group_backward(sb, P, T_skew, 3, seed, devices, Routing::kZipf);
  check_group_backward(sb, P, T, 100, seed, devices, Routing::kMasked);
  // A missing rank, forward and backward, over two devices
  check_missing_rank({0, 1}, false);
  check_missing_rank({0, 1}, true);
}

}  // namespace
}  // namespace mok::test
