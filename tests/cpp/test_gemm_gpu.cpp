// The grouped-GEMM engine alone (TMA + mbarrier pipeline + wgmma tiles) against a double
// reference on the host, and the EP=1 CUDA forward against the CPU reference backend.
// Skips cleanly without a GPU.
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>

#include "mok/mok.h"
#include "mok/mok.hpp"
#include "cuda/gemm/launch.hpp"
#include "gpu_util.hpp"
#include "test_util.hpp"

namespace mok::test {
namespace {

using mok::tensor_view;

double silu(double g) { return g / (1.0 + std::exp(-g)); }

struct ErrStats {
  double rel = 0, max_abs = 0;
  int64_t nan = 0;
};

// Compares got (bf16) with want (double) over the rows where `row_ok`.
template <typename RowOk>
ErrStats compare_rows(const std::vector<bf16_t>& got, const std::vector<double>& want, int64_t rows, int64_t cols,
                      RowOk row_ok) {
  ErrStats s;
  double num = 0, den = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (!row_ok(r)) continue;
    for (int64_t c = 0; c < cols; ++c) {
      const double g = bf16_to_float(got[r * cols + c]), w = want[r * cols + c];
      if (std::isnan(g)) ++s.nan;
      num += (g - w) * (g - w);
      den += w * w;
      s.max_abs = std::max(s.max_abs, std::fabs(g - w));
    }
  }
  s.rel = std::sqrt(num / std::max(den, 1e-300));
  return s;
}

const char* kind_name(int kind) {
  switch (kind) {
    case mokGemmDown: return "store";
    case mokGemmGateUp: return "swiglu";
    case mokGemmDgradDown: return "dgrad-down";
    default: return "dgrad-gate/up";
  }
}

// One grouped GEMM through the C ABI vs a double reference.  Forward kinds: b0, b1 [E, N, K];
// dgrad kinds: the weights as stored, b0 [E, K, N] (down) or b0, b1 [E, K/2, N] (gate/up).
// The engine's tile choices the tests walk, as a tile_n value: 256 (128 x 256, what the C ABI
// launches), 128 (128 x 128, both consumer warpgroups on each tile) and kPingPong128 (128 x 128,
// each warpgroup on whole tiles in turn: TileConfigPingPong).
constexpr int32_t kPingPong128 = -128;
constexpr int32_t kAbiTile = 0;  // the C ABI's launch (the kind's tile)
gemm::GroupedGemmArgs engine_tile(const gemm::GroupedGemmArgs& g, int32_t tile_n) {
  gemm::GroupedGemmArgs t = gemm::with_tile_n(g, tile_n < 0 ? -tile_n : tile_n);
  t.ping_pong = tile_n == kPingPong128;
  return t;
}
std::string tile_name(int32_t tile_n) {
  if (tile_n == kAbiTile) return "C ABI";
  return tile_n == kPingPong128 ? "128x128 ping-pong" : "128x" + std::to_string(tile_n);
}

// The engine's own launch of a kind in tiles of N = tile_n (the C ABI launches 128 x 256).
mokResult_t launch_engine(const mokGroupedGemmArgs_t& args, int64_t K, int64_t N, int32_t tile_n) {
  const int64_t M = args.a.shape[0], E = args.b0.shape[0];
  const auto* blk = static_cast<const int32_t*>(args.block_expert.data);
  const int32_t blocks = static_cast<int32_t>((M + 127) / 128);
  gemm::GroupedGemmArgs g;
  switch (args.kind) {
    case mokGemmGateUp: g = gemm::gate_up_args(args.a.data, M, K, args.b0.data, args.b1.data, E, N, blk, blocks, args.out.data); break;
    case mokGemmDown: g = gemm::down_args(args.a.data, M, K, args.b0.data, E, N, blk, blocks, args.out.data); break;
    case mokGemmDgradDown: g = gemm::dgrad_down_args(args.a.data, M, K, args.b0.data, E, N, blk, blocks, args.out.data); break;
    default:
      g = gemm::dgrad_gate_up_args(args.a.data, M, K / 2, args.b0.data, args.b1.data, E, N, blk, blocks, args.out.data);
  }
  g.num_blocks = static_cast<int32_t>(args.num_blocks);
  try {
    gemm::launch_grouped_gemm(engine_tile(g, tile_n), nullptr);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
    return mokInternalError;
  }
  return mokSuccess;
}

void check_grouped_gemm(uint64_t seed, int64_t E, int64_t K, int64_t N, std::vector<int32_t> block_expert, int kind,
                        int64_t num_blocks, int32_t tile_n = 256) {
  SCOPED_TRACE("seed=" + std::to_string(seed) + " E=" + std::to_string(E) + " K=" + std::to_string(K) +
               " N=" + std::to_string(N) + " " + kind_name(kind) + " grid=" + std::to_string(num_blocks) +
               " tile " + tile_name(tile_n));
  auto run = [&](const mokGroupedGemmArgs_t& a) {
    return tile_n == 256 ? mokGroupedGemm(&a, nullptr) : launch_engine(a, K, N, tile_n);
  };
  const bool swiglu = kind == mokGemmGateUp;
  const bool dgrad = kind == mokGemmDgradDown || kind == mokGemmDgradGateUp;
  const int64_t b_k = kind == mokGemmDgradGateUp ? K / 2 : K;  // K rows of one b tensor
  std::mt19937_64 rng(seed);
  const int64_t M = static_cast<int64_t>(block_expert.size()) * 128;
  const auto a = random_bf16(rng, static_cast<size_t>(M * K), 1.0f);
  const auto b0 = random_bf16(rng, static_cast<size_t>(E * N * b_k), 1.0f / std::sqrt(static_cast<float>(K)));
  const auto b1 = random_bf16(rng, static_cast<size_t>(E * N * b_k), 1.0f / std::sqrt(static_cast<float>(K)));
  DeviceBuffer da(a), db0(b0), db1(b1), dblk(block_expert), dout(static_cast<size_t>(M * N) * 2);
  mokGroupedGemmArgs_t args{};
  const std::vector<int64_t> b_shape = dgrad ? std::vector<int64_t>{E, b_k, N} : std::vector<int64_t>{E, N, K};
  args.a = tensor_view(da.ptr, mokBFloat16, {M, K}, 0);
  args.b0 = tensor_view(db0.ptr, mokBFloat16, b_shape, 0);
  args.b1 = tensor_view(db1.ptr, mokBFloat16, b_shape, 0);
  args.block_expert = tensor_view(dblk.ptr, mokInt32, {M / 128}, 0);
  args.out = tensor_view(dout.ptr, mokBFloat16, {M, N}, 0);
  args.kind = kind;
  args.num_blocks = num_blocks;
  ASSERT_EQ(run(args), mokSuccess) << mokGetLastError();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto out = dout.get<bf16_t>();
  // B(e, k, n) of the kind, as the reference reads it
  auto b_at = [&](int64_t e, int64_t kk, int64_t n, bool second) -> double {
    const auto& b = second ? b1 : b0;
    if (kind == mokGemmDgradDown) return bf16_to_float(b0[static_cast<size_t>((e * K + kk) * N + n)]);
    if (kind == mokGemmDgradGateUp) {
      const bool up = kk >= b_k;
      const auto& w = up ? b1 : b0;
      return bf16_to_float(w[static_cast<size_t>((e * b_k + (up ? kk - b_k : kk)) * N + n)]);
    }
    return bf16_to_float(b[static_cast<size_t>((e * N + n) * K + kk)]);
  };
  // Reference in double; rows of blocks at or past the first -1 are never written.
  int64_t live_blocks = 0;
  while (live_blocks < static_cast<int64_t>(block_expert.size()) && block_expert[static_cast<size_t>(live_blocks)] >= 0)
    ++live_blocks;
  std::vector<double> want(static_cast<size_t>(M * N), 0.0);
  for (int64_t r = 0; r < live_blocks * 128; ++r) {
    const int64_t e = block_expert[static_cast<size_t>(r / 128)];
    for (int64_t n = 0; n < N; ++n) {
      double g = 0, u = 0;
      for (int64_t kk = 0; kk < K; ++kk) {
        const double x = bf16_to_float(a[static_cast<size_t>(r * K + kk)]);
        g += x * b_at(e, kk, n, false);
        if (swiglu) u += x * b_at(e, kk, n, true);
      }
      want[static_cast<size_t>(r * N + n)] = swiglu ? silu(g) * u : g;
    }
  }
  const ErrStats s = compare_rows(out, want, M, N, [&](int64_t r) { return r < live_blocks * 128; });
  EXPECT_EQ(s.nan, 0) << "unwritten (NaN-poisoned) outputs";
  EXPECT_LT(s.rel, 1e-2) << "relative Frobenius " << s.rel << ", max-abs " << s.max_abs;
  for (int64_t r = live_blocks * 128; r < M; ++r)
    for (int64_t n = 0; n < N; ++n)
      ASSERT_TRUE(std::isnan(bf16_to_float(out[static_cast<size_t>(r * N + n)]))) << "row " << r << " past the end was written";
  // The same call again: bitwise the same output
  DeviceBuffer dout2(static_cast<size_t>(M * N) * 2);
  args.out = tensor_view(dout2.ptr, mokBFloat16, {M, N}, 0);
  ASSERT_EQ(run(args), mokSuccess) << mokGetLastError();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto again = dout2.get<bf16_t>();
  for (int64_t i = 0; i < live_blocks * 128 * N; ++i)
    ASSERT_EQ(again[static_cast<size_t>(i)], out[static_cast<size_t>(i)]) << "run twice: element " << i << " differs";
  std::printf("grouped GEMM %s (tile %s) E=%ld K=%ld N=%ld blocks=%zu: rel %.3e max-abs %.3e\n", kind_name(kind),
              tile_name(tile_n).c_str(), static_cast<long>(E), static_cast<long>(K), static_cast<long>(N), block_expert.size(), s.rel,
              s.max_abs);
}

TEST(GemmGpu, StoreTiles) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  check_grouped_gemm(fresh_seed(), 1, 64, 256, {0}, mokGemmDown, 0);
  check_grouped_gemm(fresh_seed(), 3, 192, 512, {0, 0, 1, 2, 2, -1}, mokGemmDown, 0);
  check_grouped_gemm(fresh_seed(), 2, 1024, 768, {1, 0, 0, 1, -1, -1}, mokGemmDown, 0);
}

TEST(GemmGpu, SwiGLUTiles) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  check_grouped_gemm(fresh_seed(), 2, 256, 128, {0, 1}, mokGemmGateUp, 0);
  check_grouped_gemm(fresh_seed(), 3, 512, 384, {2, 0, 1, 1, -1}, mokGemmGateUp, 0);
}

// The dgrad kinds: the weights read as stored (N-major B through the wgmma transpose bit).
// Experts without blocks (expert 1 of 3 below), a lone block, K split across w_gate / w_up,
// grids smaller than the tile count.
TEST(GemmGpu, DgradDownTiles) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  check_grouped_gemm(fresh_seed(), 1, 64, 256, {0}, mokGemmDgradDown, 0);
  check_grouped_gemm(fresh_seed(), 3, 512, 512, {0, 0, 2, 2, -1}, mokGemmDgradDown, 0);
  check_grouped_gemm(fresh_seed(), 2, 1024, 768, {1, 0, 0, 1, -1, -1}, mokGemmDgradDown, 3);
}

TEST(GemmGpu, DgradGateUpTiles) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  check_grouped_gemm(fresh_seed(), 1, 128, 256, {0}, mokGemmDgradGateUp, 0);
  check_grouped_gemm(fresh_seed(), 3, 768, 512, {2, 0, 0, 2, -1}, mokGemmDgradGateUp, 0);
  check_grouped_gemm(fresh_seed(), 2, 1024, 1024, {0, 1, 1, 0, 1, -1}, mokGemmDgradGateUp, 2);
}

// The wgrad kind: out[e] = A[rows of e]ᵀ · B[rows of e], K = the expert's row count.  Experts
// with 0, 1, 130 and 256 rows at the plan's 128-padded offsets (padding rows zero); one call
// against float64 (bf16 out, fp32 main_grad += on a non-zero start), run twice bitwise, and
// the same rows split over two calls through the fp32 accumulator.
void check_wgrad(int64_t Mo = 256, int64_t No = 512) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed) + " Mo=" + std::to_string(Mo) + " No=" + std::to_string(No));
  std::mt19937_64 rng(seed);
  const std::vector<int32_t> count = {0, 1, 130, 256};
  const int64_t E = static_cast<int64_t>(count.size());
  std::vector<int32_t> offset(static_cast<size_t>(E + 1), 0);
  for (int64_t e = 0; e < E; ++e)
    offset[static_cast<size_t>(e + 1)] = offset[static_cast<size_t>(e)] + (count[static_cast<size_t>(e)] + 127) / 128 * 128;
  const int64_t R = offset.back();
  auto a = random_bf16(rng, static_cast<size_t>(R * Mo), 1.0f);
  auto b = random_bf16(rng, static_cast<size_t>(R * No), 1.0f);
  // Zero the padding rows: [offset + count, next offset)
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = offset[static_cast<size_t>(e)] + count[static_cast<size_t>(e)]; r < offset[static_cast<size_t>(e + 1)]; ++r) {
      std::fill(a.begin() + r * Mo, a.begin() + (r + 1) * Mo, bf16_t{0});
      std::fill(b.begin() + r * No, b.begin() + (r + 1) * No, bf16_t{0});
    }
  std::vector<double> want(static_cast<size_t>(E * Mo * No), 0.0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = offset[static_cast<size_t>(e)]; r < offset[static_cast<size_t>(e)] + count[static_cast<size_t>(e)]; ++r)
      for (int64_t m = 0; m < Mo; ++m) {
        const double x = bf16_to_float(a[static_cast<size_t>(r * Mo + m)]);
        for (int64_t n = 0; n < No; ++n)
          want[static_cast<size_t>((e * Mo + m) * No + n)] += x * bf16_to_float(b[static_cast<size_t>(r * No + n)]);
      }
  const size_t numel = static_cast<size_t>(E * Mo * No);
  std::vector<float> ones(numel, 1.0f);
  DeviceBuffer da(a), db(b), doff(offset), dcnt(count), dout(numel * 2), dmg(ones), dacc(numel * 4);
  auto args_for = [&](DeviceBuffer& cnt, void* out, void* acc, void* mg, int accumulate, int store) {
    mokGroupedWgradArgs_t w{};
    w.a = tensor_view(da.ptr, mokBFloat16, {R, Mo}, 0);
    w.b = tensor_view(db.ptr, mokBFloat16, {R, No}, 0);
    w.expert_offset = tensor_view(doff.ptr, mokInt32, {E + 1}, 0);
    w.expert_count = tensor_view(cnt.ptr, mokInt32, {E}, 0);
    if (out) w.out = tensor_view(out, mokBFloat16, {E, Mo, No}, 0);
    if (acc) w.acc = tensor_view(acc, mokFloat32, {E, Mo, No}, 0);
    if (mg) w.main_grad = tensor_view(mg, mokFloat32, {E, Mo, No}, 0);
    w.accumulate = accumulate;
    w.store_acc = store;
    return w;
  };
  // One call: bf16 out and main_grad += (main_grad starts at 1)
  mokGroupedWgradArgs_t w = args_for(dcnt, dout.ptr, nullptr, dmg.ptr, 0, 0);
  ASSERT_EQ(mokGroupedWgrad(&w, nullptr), mokSuccess) << mokGetLastError();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto out = dout.get<bf16_t>();
  const auto mg = dmg.get<float>();
  double num = 0, den = 0, mg_err = 0;
  for (size_t i = 0; i < numel; ++i) {
    const double g = bf16_to_float(out[i]);
    ASSERT_FALSE(std::isnan(g)) << "element " << i << " unwritten";
    num += (g - want[i]) * (g - want[i]);
    den += want[i] * want[i];
    mg_err = std::max(mg_err, std::fabs(static_cast<double>(mg[i]) - 1.0 - want[i]) / (1.0 + std::fabs(want[i])));
  }
  EXPECT_LT(std::sqrt(num / den), 1e-2) << "bf16 out vs float64";
  EXPECT_LT(mg_err, 1e-4) << "fp32 main_grad += vs float64";
  for (int64_t i = 0; i < Mo * No; ++i) ASSERT_EQ(bf16_to_float(out[static_cast<size_t>(i)]), 0.0f) << "expert 0 has no rows";
  // Run twice: the same bits
  DeviceBuffer dout2(numel * 2);
  w = args_for(dcnt, dout2.ptr, nullptr, nullptr, 0, 0);
  ASSERT_EQ(mokGroupedWgrad(&w, nullptr), mokSuccess) << mokGetLastError();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(dout2.get<bf16_t>(), out) << "not bitwise reproducible";
  // Two calls through the fp32 accumulator: the first 64 rows of each expert, then all rows
  // minus those (rows are selected by count and a zeroed copy), total against float64.
  std::vector<int32_t> first(count.size());
  for (size_t e = 0; e < count.size(); ++e) first[e] = std::min<int32_t>(count[e], 64);
  DeviceBuffer dfirst(first), dout3(numel * 2);
  w = args_for(dfirst, nullptr, dacc.ptr, nullptr, 0, 1);
  ASSERT_EQ(mokGroupedWgrad(&w, nullptr), mokSuccess) << mokGetLastError();
  // Second call: B rows of the first part zeroed, so the sum adds only the remaining rows
  auto b_rest = b;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = offset[static_cast<size_t>(e)]; r < offset[static_cast<size_t>(e)] + first[static_cast<size_t>(e)]; ++r)
      std::fill(b_rest.begin() + r * No, b_rest.begin() + (r + 1) * No, bf16_t{0});
  DeviceBuffer db_rest(b_rest);
  w = args_for(dcnt, dout3.ptr, dacc.ptr, nullptr, 1, 1);
  w.b = tensor_view(db_rest.ptr, mokBFloat16, {R, No}, 0);
  ASSERT_EQ(mokGroupedWgrad(&w, nullptr), mokSuccess) << mokGetLastError();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto acc = dacc.get<float>();
  double acc_err = 0;
  for (size_t i = 0; i < numel; ++i)
    acc_err = std::max(acc_err, std::fabs(static_cast<double>(acc[i]) - want[i]) / (1.0 + std::fabs(want[i])));
  EXPECT_LT(acc_err, 1e-4) << "two calls through the fp32 accumulator vs float64";
  std::printf("grouped wgrad E=%ld Mo=%ld No=%ld counts 0/1/130/256: rel %.3e, main_grad %.3e, two-call acc %.3e\n",
              static_cast<long>(E), static_cast<long>(Mo), static_cast<long>(No), std::sqrt(num / den), mg_err, acc_err);
}

TEST(GemmGpu, WgradTiles) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  check_wgrad();
}

// The fp8 seam: e4m3 operands through the engine's e4m3 MMA policy (MmaE4m3, TileConfigE4m3:
// 128 x 128 tiles, 128-element k-blocks, one-byte TMA maps), no scales.  Operands are
// multiples of 1/4 in [-4, 4] (exact in e4m3), so every product and the fp32 sum over K are
// exact and out must be bf16(the float64 sum) bit for bit; a -1 block stays unwritten; twice
// bitwise.
// count e4m3 operands, multiples of 1/4 in [-4, 4] (exact in e4m3, and so is any sum of their
// products over a k-block), as bytes and as their values
template <typename V>
void fill_e4m3_quarters(std::mt19937_64& rng, size_t count, std::vector<uint8_t>* bytes, std::vector<V>* values) {
  std::uniform_int_distribution<int> quarter(-16, 16);
  bytes->resize(count);
  values->resize(count);
  for (size_t i = 0; i < count; ++i) {
    const __nv_fp8_e4m3 v(static_cast<float>(quarter(rng)) * 0.25f);
    (*bytes)[i] = v.__x;
    (*values)[i] = static_cast<V>(static_cast<float>(v));
  }
}

// g launched into out1 and then out2 (e4m3 operands: operand_bytes = 1); both outputs, read back
std::pair<std::vector<bf16_t>, std::vector<bf16_t>> launch_e4m3_twice(gemm::GroupedGemmArgs g, DeviceBuffer& out1,
                                                                      DeviceBuffer& out2) {
  g.operand_bytes = 1;
  for (DeviceBuffer* out : {&out1, &out2}) {
    g.out = out->ptr;
    try {
      gemm::launch_grouped_gemm(g, nullptr);
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {out1.get<bf16_t>(), out2.get<bf16_t>()};
}

TEST(GemmGpu, E4m3OperandsThroughTheMmaPolicy) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t E = 2, K = 384, N = 256;
  const std::vector<int32_t> blk = {1, 0, 1, -1};
  const int64_t M = static_cast<int64_t>(blk.size()) * 128;
  std::mt19937_64 rng(fresh_seed());
  std::vector<uint8_t> a, b;
  std::vector<double> av, bv;
  fill_e4m3_quarters(rng, static_cast<size_t>(M * K), &a, &av);
  fill_e4m3_quarters(rng, static_cast<size_t>(E * N * K), &b, &bv);
  DeviceBuffer da(a), db(b), dblk(blk), dout(static_cast<size_t>(M * N) * 2), dout2(static_cast<size_t>(M * N) * 2);
  const auto [got, again] = launch_e4m3_twice(
      gemm::with_tile_n(gemm::down_args(da.ptr, M, K, db.ptr, E, N, static_cast<const int32_t*>(dblk.ptr), 4, nullptr),
                        128),
      dout, dout2);
  int64_t wrong = 0;
  for (int64_t r = 0; r < M; ++r) {
    const int e = blk[static_cast<size_t>(r / 128)];
    for (int64_t n = 0; n < N; ++n) {
      const bf16_t o = got[static_cast<size_t>(r * N + n)];
      if (e < 0) {
        wrong += o != 0xFFFF;
        continue;
      }
      double want = 0;
      for (int64_t k = 0; k < K; ++k)
        want += av[static_cast<size_t>(r * K + k)] * bv[static_cast<size_t>((e * N + n) * K + k)];
      wrong += o != float_to_bf16(static_cast<float>(want));
    }
  }
  EXPECT_EQ(wrong, 0) << "elements differing from bf16(the exact sum) (or written in the -1 block)";
  EXPECT_EQ(got, again) << "not bitwise reproducible";
}

// The block-scaled fp8 kinds (PrecisionE4m3Block, DeepSeek-V3's recipe): A scaled per row and
// 128 of K, B per 128 x 128 block, the k-block's e4m3 sum promoted into fp32 once per k-block.
// Operands are multiples of 1/4 in [-4, 4] (each k-block's e4m3 sum exact, as above) and the
// scales arbitrary fp32, so out must equal, bit for bit, the recipe computed on the host in
// fp32: acc = fma(partial, float(sa · sb), acc) per k-block from acc = 0, then bf16.  The down
// kind (one B block a tile) and the gate/up kind without the SwiGLU (two B halves from two
// scale tensors: h = [g | u]); a -1 block stays unwritten; twice bitwise.
void check_e4m3_block_scaled(bool gate_up) {
  // down: N = H out of K = I; gate/up: I = N out of K = H (384: a partial last 256-wide tile)
  const int64_t E = 3, K = 512, N = 384;
  const std::vector<int32_t> blk = {2, 0, 1, -1, 2};
  const int64_t M = static_cast<int64_t>(blk.size()) * 128, KB = K / 128, NB = (N + 127) / 128;
  std::mt19937_64 rng(fresh_seed());
  std::uniform_real_distribution<float> scale(0.25f, 4.0f);
  auto fill = [&](size_t count, std::vector<uint8_t>* bytes, std::vector<float>* values) {
    fill_e4m3_quarters(rng, count, bytes, values);
  };
  auto scales = [&](size_t count) {
    std::vector<float> v(count);
    for (auto& x : v) x = scale(rng);
    return v;
  };
  std::vector<uint8_t> a, b0, b1;
  std::vector<float> av, b0v, b1v;
  fill(static_cast<size_t>(M * K), &a, &av);
  fill(static_cast<size_t>(E * N * K), &b0, &b0v);
  fill(static_cast<size_t>(E * N * K), &b1, &b1v);
  const std::vector<float> sa = scales(static_cast<size_t>(KB * M)), sb0 = scales(static_cast<size_t>(E * NB * KB)),
                           sb1 = gate_up ? scales(static_cast<size_t>(E * NB * KB)) : sb0;
  const int64_t out_cols = gate_up ? 2 * N : N;
  // The scales' buffers end in NaN: a scale read past K's k-blocks shows in out
  const auto nan_tailed = [](std::vector<float> v) {
    v.resize(v.size() + 256, std::numeric_limits<float>::quiet_NaN());
    return v;
  };
  DeviceBuffer da(a), db0(b0), db1(gate_up ? b1 : b0), dblk(blk), dsa(nan_tailed(sa)), dsb0(nan_tailed(sb0)),
      dsb1(nan_tailed(sb1));
  DeviceBuffer dout(static_cast<size_t>(M * out_cols) * 2), dout2(static_cast<size_t>(M * out_cols) * 2);
  const auto* be = static_cast<const int32_t*>(dblk.ptr);
  const int32_t mb = static_cast<int32_t>(blk.size());
  gemm::GroupedGemmArgs g = gate_up ? gemm::gate_up_preact_args(da.ptr, M, K, db0.ptr, db1.ptr, E, N, be, mb, nullptr)
                                    : gemm::down_args(da.ptr, M, K, db0.ptr, E, N, be, mb, nullptr);
  g = gemm::with_tile_n(g, 256);  // the block-scaled kinds' 128 x 256 tiles
  g.a_scales = static_cast<const float*>(dsa.ptr);
  g.b0_scales = static_cast<const float*>(dsb0.ptr);
  g.b1_scales = static_cast<const float*>(dsb1.ptr);
  const auto [got, again] = launch_e4m3_twice(g, dout, dout2);
  // The recipe on the host, in fp32 (row r of A against row n of expert e's B, of b or its scales)
  auto recipe = [&](int64_t r, int e, int64_t n, const std::vector<float>& bv, const std::vector<float>& sb) {
    float acc = 0.0f;
    for (int64_t kb = 0; kb < KB; ++kb) {
      double part = 0;  // exact (and so the device's k-block sum)
      for (int64_t k = kb * 128; k < kb * 128 + 128; ++k)
        part += static_cast<double>(av[static_cast<size_t>(r * K + k)]) * bv[static_cast<size_t>((e * N + n) * K + k)];
      const float s = sa[static_cast<size_t>(kb * M + r)] * sb[static_cast<size_t>((e * NB + n / 128) * KB + kb)];
      acc = std::fma(static_cast<float>(part), s, acc);
    }
    return acc;
  };
  int64_t wrong = 0, checked = 0;
  for (int64_t r = 0; r < M; ++r) {
    const int e = blk[static_cast<size_t>(r / 128)];
    for (int64_t c = 0; c < out_cols; ++c) {
      const bf16_t o = got[static_cast<size_t>(r * out_cols + c)];
      if (e < 0) {
        wrong += o != 0xFFFF;
        continue;
      }
      const bool up = gate_up && c >= N;
      const float want = recipe(r, e, up ? c - N : c, up ? b1v : b0v, up ? sb1 : sb0);
      wrong += o != float_to_bf16(want);
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
  EXPECT_EQ(wrong, 0) << "elements differing from the block-scaled recipe in fp32 (or written in the -1 block)";
  EXPECT_EQ(got, again) << "not bitwise reproducible";
}

TEST(GemmGpu, E4m3BlockScaledDown) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  check_e4m3_block_scaled(false);
}

TEST(GemmGpu, E4m3BlockScaledGateUp) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  check_e4m3_block_scaled(true);
}

// The gate/up kind writing a in e4m3 for the down kind (Epilogue::kSwiGLUE4m3, 128 x 256 tiles):
// against the recipe on the host (g and u bit for bit as above; silu with the host's exp, so a
// within a few ulp): each (row, 128 channels) block's scale is its max |a| / 448, its largest
// value lands on 448 exactly, every value on a / scale rounded to e4m3; the -1 block's rows keep
// their poison; twice bitwise.
TEST(GemmGpu, E4m3BlockScaledGateUpQuantisesA) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t E = 2, K = 384, N = 384;  // I = N: three scale blocks, one partial 256-wide tile pair
  const std::vector<int32_t> blk = {1, -1, 0, 1};
  const int64_t M = static_cast<int64_t>(blk.size()) * 128, KB = K / 128, NB = N / 128;
  std::mt19937_64 rng(fresh_seed());
  std::uniform_real_distribution<float> scale(0.25f, 4.0f);
  std::vector<uint8_t> a, b0, b1;
  std::vector<float> av, b0v, b1v;
  fill_e4m3_quarters(rng, static_cast<size_t>(M * K), &a, &av);
  fill_e4m3_quarters(rng, static_cast<size_t>(E * N * K), &b0, &b0v);
  fill_e4m3_quarters(rng, static_cast<size_t>(E * N * K), &b1, &b1v);
  auto scales = [&](size_t count) {
    std::vector<float> v(count);
    for (auto& x : v) x = scale(rng) / 64.0f;  // |a| around 1: e4m3's normal range
    return v;
  };
  const std::vector<float> sa = scales(static_cast<size_t>(KB * M)), sb0 = scales(static_cast<size_t>(E * NB * KB)),
                           sb1 = scales(static_cast<size_t>(E * NB * KB));
  DeviceBuffer da(a), db0(b0), db1(b1), dblk(blk), dsa(sa), dsb0(sb0), dsb1(sb1);
  DeviceBuffer dq(static_cast<size_t>(M * N)), dq2(static_cast<size_t>(M * N)), ds(static_cast<size_t>(NB * M) * 4),
      ds2(static_cast<size_t>(NB * M) * 4);
  std::vector<std::vector<uint8_t>> q;
  std::vector<std::vector<float>> sc;
  for (auto [out, out_s] : {std::pair{&dq, &ds}, std::pair{&dq2, &ds2}}) {
    gemm::GroupedGemmArgs g = gemm::with_tile_n(
        gemm::gate_up_args(da.ptr, M, K, db0.ptr, db1.ptr, E, N, static_cast<const int32_t*>(dblk.ptr),
                           static_cast<int32_t>(blk.size()), out->ptr),
        256);
    g.operand_bytes = 1;
    g.epilogue = static_cast<int32_t>(gemm::Epilogue::kSwiGLUE4m3);
    g.a_scales = static_cast<const float*>(dsa.ptr);
    g.b0_scales = static_cast<const float*>(dsb0.ptr);
    g.b1_scales = static_cast<const float*>(dsb1.ptr);
    g.out_scales = static_cast<float*>(out_s->ptr);
    try {
      gemm::launch_grouped_gemm(g, nullptr);
    } catch (const std::exception& e) {
      FAIL() << e.what();
    }
    CUDA_OK(cudaDeviceSynchronize());
    q.push_back(out->get<uint8_t>());
    sc.push_back(out_s->get<float>());
  }
  EXPECT_EQ(q[0], q[1]) << "not bitwise reproducible";
  // (bitwise: the -1 block's scales stay the poison, a NaN)
  EXPECT_EQ(0, std::memcmp(sc[0].data(), sc[1].data(), sc[0].size() * sizeof(float))) << "not bitwise reproducible";
  auto recipe = [&](int64_t r, int e, int64_t n, const std::vector<float>& bv, const std::vector<float>& sb) {
    float acc = 0.0f;
    for (int64_t kb = 0; kb < KB; ++kb) {
      double part = 0;
      for (int64_t k = kb * 128; k < kb * 128 + 128; ++k)
        part += static_cast<double>(av[static_cast<size_t>(r * K + k)]) * bv[static_cast<size_t>((e * N + n) * K + k)];
      acc = std::fma(static_cast<float>(part), sa[static_cast<size_t>(kb * M + r)] *
                                                   sb[static_cast<size_t>((e * NB + n / 128) * KB + kb)], acc);
    }
    return acc;
  };
  int64_t bad_scale = 0, bad_value = 0, bad_max = 0, written = 0, blocks = 0;
  for (int64_t r = 0; r < M; ++r) {
    const int e = blk[static_cast<size_t>(r / 128)];
    for (int64_t nb = 0; nb < NB; ++nb) {
      if (e < 0) {
        for (int64_t c = nb * 128; c < nb * 128 + 128; ++c) written += q[0][static_cast<size_t>(r * N + c)] != 0xFF;
        continue;
      }
      std::vector<double> want(128);
      double amax = 0;
      for (int64_t c = 0; c < 128; ++c) {
        const double g = recipe(r, e, nb * 128 + c, b0v, sb0), u = recipe(r, e, nb * 128 + c, b1v, sb1);
        want[static_cast<size_t>(c)] = g / (1.0 + std::exp(-g)) * u;
        amax = std::max(amax, std::abs(want[static_cast<size_t>(c)]));
      }
      const float s = sc[0][static_cast<size_t>(nb * M + r)];
      ++blocks;
      bad_scale += !(std::abs(s - amax / 448.0) <= 1e-5 * amax / 448.0 + 1e-30);
      float qmax = 0;
      for (int64_t c = 0; c < 128; ++c) {
        __nv_fp8_e4m3 v;
        v.__x = q[0][static_cast<size_t>(r * N + nb * 128 + c)];
        const float qv = static_cast<float>(v);
        qmax = std::max(qmax, std::abs(qv));
        const double w = want[static_cast<size_t>(c)];
        bad_value += !(std::abs(qv * static_cast<double>(s) - w) <= std::abs(w) * 0.07 + s * 0.002);
      }
      bad_max += amax > 0 && qmax != 448.0f;
    }
  }
  EXPECT_GT(blocks, 0);
  EXPECT_EQ(bad_scale, 0) << "scales not max |a| / 448";
  EXPECT_EQ(bad_value, 0) << "values not a / scale in e4m3";
  EXPECT_EQ(bad_max, 0) << "blocks whose largest value is not 448";
  EXPECT_EQ(written, 0) << "bytes of the -1 block written";
}

// Block scales are all three or none, and A's rows a multiple of 4 (its scales' TMA rows)
// fp8_block's SwiGLU backward as a pass of its own (the dgrad-down kind storing da in fp32,
// Epilogue::kStoreF32, then gemm::launch_swiglu_bwd_fp8) against the kind's SwiGLU-backward
// epilogue followed by the three column quantisers, as the layer's backward ran them: dh in
// e4m3 and its row scales, the router-gradient partials, a, dg and du quantised per column and
// 128 rows, bit for bit.  Routed: rows of weight 0 and zero h (padding), negative weights, a
// block past the rows in use left untouched; shared: rows past T (valid_rows) as zeros, the
// row scales at ld = T rounded up to 4, weight 1.  fp32 and power-of-two scales.
void check_swiglu_pass(bool pow2, bool shared) {
  const int64_t H = 384, I = 256, E = shared ? 1 : 2;
  const std::vector<int32_t> blk = shared ? std::vector<int32_t>{0, 0} : std::vector<int32_t>{1, 0, 1, -1};
  const int64_t M = static_cast<int64_t>(blk.size()) * 128, KB = H / 128, NB = I / 128;
  const int64_t live = shared ? M : 3 * 128, T = shared ? 200 : M, ld = shared ? (T + 3) / 4 * 4 : M;
  std::mt19937_64 rng(fresh_seed());
  std::uniform_real_distribution<float> scale(0.25f, 4.0f), weight(-1.0f, 1.0f);
  std::vector<uint8_t> a, b;
  std::vector<float> av, bv;
  fill_e4m3_quarters(rng, static_cast<size_t>(M * H), &a, &av);
  fill_e4m3_quarters(rng, static_cast<size_t>(E * I * H), &b, &bv);
  std::vector<float> sa(static_cast<size_t>(KB * M)), sb(static_cast<size_t>(E * KB * NB));
  for (auto& x : sa) x = scale(rng);
  for (auto& x : sb) x = scale(rng);
  std::vector<bf16_t> h = random_bf16(rng, static_cast<size_t>(M * 2 * I), 3.0f);
  std::vector<float> rw(static_cast<size_t>(M), 1.0f);
  if (!shared)
    for (int64_t r = 0; r < M; ++r) {
      rw[static_cast<size_t>(r)] = r % 7 == 3 ? 0.0f : weight(rng);
      if (r % 7 == 3)  // a padding row: weight 0, h 0
        std::fill(h.begin() + r * 2 * I, h.begin() + (r + 1) * 2 * I, bf16_t{0});
    }
  const std::vector<int32_t> live_rows = {static_cast<int32_t>(live)};
  DeviceBuffer da_(a), db(b), dblk(blk), dsa(sa), dsb(sb), dh_(h), drw(rw), dlive(live_rows);
  const auto* be = static_cast<const int32_t*>(dblk.ptr);
  const int32_t mb = static_cast<int32_t>(blk.size());
  const size_t q_bytes = static_cast<size_t>(M * 2 * I), s_bytes = static_cast<size_t>(2 * I / 128 * ld) * 4;
  const size_t p_bytes = static_cast<size_t>(M * I / 128) * 4, t_bytes = static_cast<size_t>(I * M);
  const size_t ts_bytes = static_cast<size_t>(M / 128 * I) * 4;
  struct Outs {
    DeviceBuffer q, s, part, at, ats, dgt, dgts, dut, duts;
  };
  auto outs = [&] {
    return Outs{DeviceBuffer(q_bytes), DeviceBuffer(s_bytes), DeviceBuffer(p_bytes),  DeviceBuffer(t_bytes),
                DeviceBuffer(ts_bytes), DeviceBuffer(t_bytes), DeviceBuffer(ts_bytes), DeviceBuffer(t_bytes),
                DeviceBuffer(ts_bytes)};
  };
  Outs old = outs(), now = outs();
  const int32_t* live_ptr = shared ? nullptr : static_cast<const int32_t*>(dlive.ptr);
  auto scaled = [&](gemm::GroupedGemmArgs g) {
    g.a_scales = static_cast<const float*>(dsa.ptr);
    g.a_scales_ld = M;
    g.b0_scales = g.b1_scales = static_cast<const float*>(dsb.ptr);
    g.b_scales_transposed = true;
    g.operand_bytes = 1;
    return g;
  };
  // The kind's epilogue, then the column passes over its bf16 dh and a
  DeviceBuffer dh_bf16(static_cast<size_t>(M * 2 * I) * 2), a_bf16(static_cast<size_t>(M * I) * 2);
  gemm::launch_grouped_gemm(
      scaled(gemm::dgrad_down_swiglu_e4m3_args(da_.ptr, T, H, db.ptr, E, I, be, mb, dh_.ptr,
                                               static_cast<const float*>(drw.ptr), old.q.ptr,
                                               static_cast<float*>(old.s.ptr), ld, pow2, dh_bf16.ptr, a_bf16.ptr,
                                               shared ? nullptr : static_cast<float*>(old.part.ptr))),
      nullptr);
  const int64_t valid = shared ? T : -1;
  const auto* dhb = static_cast<const bf16_t*>(dh_bf16.ptr);
  gemm::launch_quantize_cols(a_bf16.ptr, I, M, I, old.at.ptr, static_cast<float*>(old.ats.ptr), pow2, nullptr, nullptr,
                             nullptr, live_ptr, valid);
  gemm::launch_quantize_cols(dhb, 2 * I, M, I, old.dgt.ptr, static_cast<float*>(old.dgts.ptr), pow2, nullptr, nullptr,
                             nullptr, live_ptr, valid);
  gemm::launch_quantize_cols(dhb + I, 2 * I, M, I, old.dut.ptr, static_cast<float*>(old.duts.ptr), pow2, nullptr,
                             nullptr, nullptr, live_ptr, valid);
  // da in fp32, then the pass
  DeviceBuffer da32(static_cast<size_t>(M * I) * 4);
  gemm::GroupedGemmArgs d = gemm::down_args(da_.ptr, T, H, db.ptr, E, I, be, mb, da32.ptr);
  d.epilogue = static_cast<int32_t>(gemm::Epilogue::kStoreF32);
  gemm::launch_grouped_gemm(scaled(d), nullptr);
  gemm::SwiGLUBwdFp8Args sp;
  sp.da = static_cast<const float*>(da32.ptr);
  sp.h = dh_.ptr;
  sp.row_weight = shared ? nullptr : static_cast<const float*>(drw.ptr);
  sp.rows = M;
  sp.inter = I;
  sp.valid_rows = valid;
  sp.live_rows = live_ptr;
  sp.dh_q = now.q.ptr;
  sp.dh_scales = static_cast<float*>(now.s.ptr);
  sp.scales_ld = ld;
  sp.dtw_partials = shared ? nullptr : static_cast<float*>(now.part.ptr);
  sp.at = now.at.ptr;
  sp.at_scales = static_cast<float*>(now.ats.ptr);
  sp.dgt = now.dgt.ptr;
  sp.dgt_scales = static_cast<float*>(now.dgts.ptr);
  sp.dut = now.dut.ptr;
  sp.dut_scales = static_cast<float*>(now.duts.ptr);
  sp.pow2 = pow2;
  gemm::launch_swiglu_bwd_fp8(sp, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  const char* names[] = {"dh e4m3", "dh scales", "router partials", "a cols", "a col scales", "dg cols",
                         "dg col scales", "du cols", "du col scales"};
  const DeviceBuffer* o[] = {&old.q, &old.s, &old.part, &old.at, &old.ats, &old.dgt, &old.dgts, &old.dut, &old.duts};
  const DeviceBuffer* n[] = {&now.q, &now.s, &now.part, &now.at, &now.ats, &now.dgt, &now.dgts, &now.dut, &now.duts};
  for (int i = 0; i < 9; ++i) {
    const std::vector<uint8_t> want = o[i]->get<uint8_t>(), got = n[i]->get<uint8_t>();
    int64_t differ = 0, written = 0;
    for (size_t j = 0; j < want.size(); ++j) {
      differ += want[j] != got[j];
      written += want[j] != 0xFF;
    }
    EXPECT_EQ(differ, 0) << names[i] << ": bytes differing from the kind's epilogue and the column passes";
    if (!(shared && i == 2)) EXPECT_GT(written, 0) << names[i] << ": nothing written";  // (shared: no partials)
  }
}

TEST(GemmGpu, E4m3SwiGLUBackwardPassIsTheEpilogueAndColumnPasses) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (bool shared : {false, true})
    for (bool pow2 : {false, true}) {
      SCOPED_TRACE(std::string(shared ? "shared" : "routed") + (pow2 ? ", pow2" : ", fp32 scales"));
      check_swiglu_pass(pow2, shared);
    }
}

TEST(GemmGpu, E4m3BlockScalesChecked) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::vector<int32_t> blk = {0};
  DeviceBuffer da(std::vector<uint8_t>(128 * 128)), db(std::vector<uint8_t>(128 * 128)), dblk(blk),
      ds(std::vector<float>(128)), dout(static_cast<size_t>(128 * 128) * 2);
  gemm::GroupedGemmArgs g = gemm::with_tile_n(
      gemm::down_args(da.ptr, 128, 128, db.ptr, 1, 128, static_cast<const int32_t*>(dblk.ptr), 1, dout.ptr), 128);
  g.operand_bytes = 1;
  g.a_scales = static_cast<const float*>(ds.ptr);
  try {
    gemm::launch_grouped_gemm(g, nullptr);
    FAIL() << "a_scales without b0_scales / b1_scales was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("b0_scales"), std::string::npos) << e.what();
  }
}

// The engine at its second tile shape, 128 x 128 (six stages; the dgrad-down epilogue and
// the fp8 path use it): every kind against float64, run twice bitwise.
TEST(GemmGpu, TileShape128x128EveryKind) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  check_grouped_gemm(fresh_seed(), 3, 192, 512, {0, 0, 1, 2, 2, -1}, mokGemmDown, 0, 128);
  check_grouped_gemm(fresh_seed(), 3, 512, 384, {2, 0, 1, 1, -1}, mokGemmGateUp, 0, 128);
  check_grouped_gemm(fresh_seed(), 3, 512, 512, {0, 0, 2, 2, -1}, mokGemmDgradDown, 0, 128);
  check_grouped_gemm(fresh_seed(), 2, 1024, 768, {0, 1, 1, 0, 1, -1}, mokGemmDgradGateUp, 3, 128);
}

// The 128 x 128 ping-pong schedule (each consumer warpgroup owns whole tiles in turn, stages
// released by one warpgroup): every kind; small grids and -1 blocks at the end, so the two
// warpgroups' turns and the stages each skips wrap the ring many times.
TEST(GemmGpu, PingPongEveryKind) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  check_grouped_gemm(fresh_seed(), 3, 192, 512, {0, 0, 1, 2, 2, -1}, mokGemmDown, 0, kPingPong128);
  check_grouped_gemm(fresh_seed(), 3, 512, 384, {2, 0, 1, 1, -1}, mokGemmGateUp, 0, kPingPong128);
  check_grouped_gemm(fresh_seed(), 3, 512, 512, {0, 0, 2, 2, 1, -1, -1}, mokGemmDgradDown, 3, kPingPong128);
  check_grouped_gemm(fresh_seed(), 2, 1024, 768, {0, 1, 1, 0, 1, -1}, mokGemmDgradGateUp, 3, kPingPong128);
  check_grouped_gemm(fresh_seed(), 2, 2048, 512, {0, 1, 1, 0, 1, 0, 0, 1}, mokGemmDown, 1, kPingPong128);
  check_grouped_gemm(fresh_seed(), 2, 640, 256, {0, 1, 1, 0, 1, 0, 0, 1}, mokGemmGateUp, 2, kPingPong128);
}

// Dimensions that are multiples of 64 but not of the tile: the last tile of N (and of the
// wgrad's Mo and No) is partial; its columns past N are neither written nor read (the outputs
// start as NaN, each row against float64, bitwise twice).
TEST(GemmGpu, PartialTilesEveryKind) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (int32_t tile_n : {256, 128, kPingPong128}) {
    check_grouped_gemm(fresh_seed(), 3, 192, 320, {0, 0, 1, 2, 2, -1}, mokGemmDown, 0, tile_n);
    check_grouped_gemm(fresh_seed(), 2, 320, 192, {1, 0, 1, -1}, mokGemmGateUp, 0, tile_n);
    check_grouped_gemm(fresh_seed(), 3, 192, 320, {0, 0, 2, 2, -1}, mokGemmDgradDown, 0, tile_n);
    check_grouped_gemm(fresh_seed(), 2, 384, 320, {0, 1, 1, 0, -1}, mokGemmDgradGateUp, 3, tile_n);
  }
  check_wgrad(320, 192);
  check_wgrad(64, 64);
}

// ---- the dgrad-down SwiGLU-backward kind (mokGemmDgradDownSwiGLU, gemm/epilogue_bwd.cuh) -----

// Rows of one expert, laid out as the plan lays them out: `rows` routed rows, then padding
// rows up to the next multiple of 128.
struct Segment {
  int32_t expert, rows;
};

// One call's inputs: the segments' blocks, then `trailing` blocks of -1, M = 128·blocks − cut
// (the last block cut short when cut > 0).  Padding rows have dy = 0, h = 0, w = 0, as the
// plan's padding rows do; rows of -1 blocks hold random data the kernel must not touch.
struct SwiGLUBwdInputs {
  int64_t E = 0, H = 0, I = 0, M = 0;
  std::vector<int32_t> block_expert;
  std::vector<int8_t> row_kind;  // 1 routed, 0 padding, -1 in a -1 block
  std::vector<bf16_t> dy, w_down, h;
  std::vector<float> row_weight;
};

SwiGLUBwdInputs make_swiglu_bwd_inputs(uint64_t seed, int64_t E, int64_t H, int64_t I, const std::vector<Segment>& segs,
                                       int trailing, int64_t cut) {
  std::mt19937_64 rng(seed);
  SwiGLUBwdInputs in;
  in.E = E, in.H = H, in.I = I;
  for (const Segment& s : segs) {
    const int blocks = (s.rows + 127) / 128;
    for (int b = 0; b < blocks; ++b) in.block_expert.push_back(s.expert);
    for (int r = 0; r < blocks * 128; ++r) in.row_kind.push_back(r < s.rows ? 1 : 0);
  }
  for (int b = 0; b < trailing; ++b) {
    in.block_expert.push_back(-1);
    for (int r = 0; r < 128; ++r) in.row_kind.push_back(-1);
  }
  in.M = static_cast<int64_t>(in.block_expert.size()) * 128 - cut;
  in.row_kind.resize(static_cast<size_t>(in.M));
  in.dy = random_bf16(rng, static_cast<size_t>(in.M * H), 1.0f);
  in.w_down = random_bf16(rng, static_cast<size_t>(E * H * I), 1.0f / std::sqrt(static_cast<float>(H)));
  in.h = random_bf16(rng, static_cast<size_t>(in.M * 2 * I), 1.0f);
  // big: |g| up to 92, past -87.3 where 1 + e^-g >= 2^126 (the epilogue's sigmoid is 0 there)
  // and past -88.7 where e^-g overflows
  std::uniform_real_distribution<float> wdist(-0.5f, 1.0f), big(3.0f, 46.0f);
  in.row_weight.resize(static_cast<size_t>(in.M));
  int64_t routed = 0;
  for (int64_t r = 0; r < in.M; ++r) {
    const int8_t k = in.row_kind[static_cast<size_t>(r)];
    float& w = in.row_weight[static_cast<size_t>(r)];
    w = wdist(rng);
    if (k == 1 && routed++ % 13 == 5) w = 0.0f;  // a real route of weight 0: dh = 0, partials exact
    bf16_t* hr = &in.h[static_cast<size_t>(r * 2 * I)];
    for (int64_t i = 0; i < I; ++i) {
      float g = 2.0f * bf16_to_float(hr[i]);
      if (rng() % 61 == 0) g = (rng() % 2 ? 1.0f : -1.0f) * big(rng);  // sigmoid saturated
      hr[i] = float_to_bf16(g);
    }
    if (k == 0) {
      w = 0.0f;
      std::fill(in.dy.begin() + r * H, in.dy.begin() + (r + 1) * H, bf16_t{0});
      std::fill(hr, hr + 2 * I, bf16_t{0});
    }
  }
  return in;
}

struct SwiGLUBwdOutputs {
  std::vector<bf16_t> dh, wa;  // [M, 2I], [M, I]
  std::vector<float> part;     // [M, ceil(I / 128)]
};

// One call: tile_n 0 through the C ABI (the kind's tile: 128 x 128 ping-pong, with_kind_tile),
// else the engine's own launch at that tile (engine_tile).  Outputs start as 0xFF bytes (NaN); without
// `optional`, wa and the partials are not passed (and come back all 0xFF).
::testing::AssertionResult run_swiglu_bwd(const SwiGLUBwdInputs& in, int32_t tile_n, int64_t num_blocks, bool optional,
                                          SwiGLUBwdOutputs* out) {
  const int64_t M = in.M, H = in.H, I = in.I, E = in.E, C = (I + 127) / 128;
  DeviceBuffer ddy(in.dy), dw(in.w_down), dhin(in.h), drw(in.row_weight), dblk(in.block_expert);
  DeviceBuffer ddh(static_cast<size_t>(M * 2 * I) * 2), dwa(static_cast<size_t>(M * I) * 2),
      dpart(static_cast<size_t>(M * C) * 4);
  const int32_t blocks = static_cast<int32_t>(in.block_expert.size());
  if (tile_n == kAbiTile) {
    mokGroupedGemmArgs_t a{};
    a.a = tensor_view(ddy.ptr, mokBFloat16, {M, H}, 0);
    a.b0 = tensor_view(dw.ptr, mokBFloat16, {E, H, I}, 0);
    a.block_expert = tensor_view(dblk.ptr, mokInt32, {blocks}, 0);
    a.out = tensor_view(ddh.ptr, mokBFloat16, {M, 2 * I}, 0);
    a.kind = mokGemmDgradDownSwiGLU;
    a.num_blocks = num_blocks;
    a.h = tensor_view(dhin.ptr, mokBFloat16, {M, 2 * I}, 0);
    a.row_weight = tensor_view(drw.ptr, mokFloat32, {M}, 0);
    if (optional) {
      a.wa = tensor_view(dwa.ptr, mokBFloat16, {M, I}, 0);
      a.dtw_partials = tensor_view(dpart.ptr, mokFloat32, {M, C}, 0);
    }
    if (mokGroupedGemm(&a, nullptr) != mokSuccess)
      return ::testing::AssertionFailure() << "mokGroupedGemm: " << mokGetLastError();
  } else {
    gemm::GroupedGemmArgs g = gemm::dgrad_down_swiglu_args(
        ddy.ptr, M, H, dw.ptr, E, I, static_cast<const int32_t*>(dblk.ptr), blocks, dhin.ptr,
        static_cast<const float*>(drw.ptr), ddh.ptr, optional ? dwa.ptr : nullptr,
        optional ? static_cast<float*>(dpart.ptr) : nullptr);
    g.num_blocks = static_cast<int32_t>(num_blocks);
    try {
      gemm::launch_grouped_gemm(engine_tile(g, tile_n), nullptr);
    } catch (const std::exception& e) {
      return ::testing::AssertionFailure() << "engine launch at tile " << tile_name(tile_n) << ": " << e.what();
    }
  }
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) return ::testing::AssertionFailure() << "kernel: " << cudaGetErrorString(err);
  out->dh = ddh.get<bf16_t>();
  out->wa = dwa.get<bf16_t>();
  out->part = dpart.get<float>();
  return ::testing::AssertionSuccess();
}

// The float64 reference: da = dy · W_down[e] in double; then the epilogue's formulas in double
// on the bf16 g, u as stored, with a = bf16(silu(g)·u) (the one rounding the kernel keeps
// inside its formulas).  Where silu(g)·u lies so close to a bf16 rounding midpoint that fp32
// and double may round it differently, `a_amb` is one ulp of a (else 0): the tolerances of
// wa and of the partials take that one-ulp choice into account and nothing else.
struct SwiGLUBwdWant {
  std::vector<double> dg, du, wa, wa_amb;   // [M, I]
  std::vector<double> part, part_abs, part_amb;  // [M, ceil(I / 128)]: Σ da·a, Σ |da·a|, Σ |da|·a_amb
  std::vector<double> da;                   // [M, I], for the messages
};

// One bf16 ulp at v when v lies within 1e-5 (relative) of a midpoint between two bf16
// neighbours (where an fp32 computation of v may round to the other one), else 0.
double bf16_rounding_ambiguity(double v) {
  const bf16_t b = float_to_bf16(static_cast<float>(v));
  const double a = bf16_to_float(b);
  // The neighbours one bf16 step away on either side (bit patterns ±1, sign-magnitude)
  auto step = [&](bool up) {
    const bool neg = (b & 0x8000) != 0;
    const uint16_t mag = b & 0x7FFF;
    if (mag == 0) return static_cast<double>(bf16_to_float(static_cast<bf16_t>(up ? 0x0001 : 0x8001)));
    const bool away = up != neg;  // away from zero
    return static_cast<double>(bf16_to_float(static_cast<bf16_t>((b & 0x8000) | (away ? mag + 1 : mag - 1))));
  };
  const double hi = step(true), lo = step(false);
  const double window = 1e-5 * std::fabs(v) + 1e-38;
  const bool near = std::fabs(v - (a + hi) / 2) <= window || std::fabs(v - (a + lo) / 2) <= window;
  return near ? std::max(hi - a, a - lo) : 0.0;
}

SwiGLUBwdWant swiglu_bwd_reference(const SwiGLUBwdInputs& in) {
  const int64_t M = in.M, H = in.H, I = in.I, C = (I + 127) / 128;
  SwiGLUBwdWant w;
  for (auto* v : {&w.dg, &w.du, &w.wa, &w.wa_amb, &w.da}) v->assign(static_cast<size_t>(M * I), 0.0);
  for (auto* v : {&w.part, &w.part_abs, &w.part_amb}) v->assign(static_cast<size_t>(M * C), 0.0);
  std::vector<double> da(static_cast<size_t>(I));
  for (int64_t r = 0; r < M; ++r) {
    if (in.row_kind[static_cast<size_t>(r)] < 0) continue;
    const int64_t e = in.block_expert[static_cast<size_t>(r / 128)];
    std::fill(da.begin(), da.end(), 0.0);
    for (int64_t k = 0; k < H; ++k) {
      const double d = bf16_to_float(in.dy[static_cast<size_t>(r * H + k)]);
      if (d == 0.0) continue;
      const bf16_t* wrow = &in.w_down[static_cast<size_t>((e * H + k) * I)];
      for (int64_t i = 0; i < I; ++i) da[static_cast<size_t>(i)] += d * bf16_to_float(wrow[i]);
    }
    const double wt = in.row_weight[static_cast<size_t>(r)];
    for (int64_t i = 0; i < I; ++i) {
      const double g = bf16_to_float(in.h[static_cast<size_t>(r * 2 * I + i)]);
      const double u = bf16_to_float(in.h[static_cast<size_t>(r * 2 * I + I + i)]);
      const double d = da[static_cast<size_t>(i)];
      const double sg = 1.0 / (1.0 + std::exp(-g)), sl = g * sg;
      const double av = sl * u;
      const double a = bf16_to_float(float_to_bf16(static_cast<float>(av)));
      const double amb = bf16_rounding_ambiguity(av);
      const double dsilu = sg * (1.0 + g * (1.0 - sg));
      const size_t x = static_cast<size_t>(r * I + i), c = static_cast<size_t>(r * C + i / 128);
      w.da[x] = d;
      w.dg[x] = wt * d * u * dsilu;
      w.du[x] = wt * d * sl;
      w.wa[x] = wt * a;
      w.wa_amb[x] = std::fabs(wt) * amb;
      w.part[c] += d * a;
      w.part_abs[c] += std::fabs(d * a);
      w.part_amb[c] += std::fabs(d) * amb;
    }
  }
  return w;
}

// Up to five failures, with what a reader needs to see which formula or column is wrong.
struct Failures {
  int64_t count = 0;
  std::string shown;
  template <typename Describe>
  void add(Describe describe) {
    if (count++ < 5) shown += "\n    " + describe();
  }
};

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.6g", v);
  return b;
}

// Checks one call's outputs against the reference.  Tolerances (per element):
//   dg, du: |got − want| ≤ |want|/128 + 1e-3·rms(want): the bf16 rounding (≤ |want|/256) and
//     fp32 noise; a missing w, a wrong column, g and u swapped or silu' wrong fail by far more.
//   wa: |got − want| ≤ |want|/128 + |w|·(one ulp of a where its rounding is ambiguous).
//   partials: |got − want| ≤ 1e-4·Σ|da·a| + Σ|da|·(one ulp of a where ambiguous) + 1e-7: fp32
//     sums of 128 products; a missing, repeated or misplaced channel or chunk fails.
// Padding rows: dh and wa exactly ±0, partials exactly 0.  Rows of -1 blocks: unwritten (0xFF).
void check_swiglu_bwd_outputs(const SwiGLUBwdInputs& in, const SwiGLUBwdWant& want, const SwiGLUBwdOutputs& got,
                              bool optional, const std::string& what) {
  const int64_t M = in.M, I = in.I, C = (I + 127) / 128;
  double rms_g = 0, rms_u = 0, num_g = 0, num_u = 0;
  int64_t n = 0;
  for (int64_t r = 0; r < M; ++r) {
    if (in.row_kind[static_cast<size_t>(r)] < 0) continue;
    for (int64_t i = 0; i < I; ++i) {
      const size_t x = static_cast<size_t>(r * I + i);
      rms_g += want.dg[x] * want.dg[x];
      rms_u += want.du[x] * want.du[x];
      ++n;
    }
  }
  rms_g = std::sqrt(rms_g / std::max<int64_t>(n, 1));
  rms_u = std::sqrt(rms_u / std::max<int64_t>(n, 1));
  Failures dh_fail, wa_fail, part_fail, pad_fail, unwritten;
  for (int64_t r = 0; r < M; ++r) {
    const int8_t kind = in.row_kind[static_cast<size_t>(r)];
    const std::string row_s = "row " + std::to_string(r) + " (expert " +
                              std::to_string(in.block_expert[static_cast<size_t>(r / 128)]) + ", w " +
                              num(in.row_weight[static_cast<size_t>(r)]) + ")";
    for (int64_t i = 0; i < I; ++i) {
      const size_t x = static_cast<size_t>(r * I + i);
      const bf16_t gdg = got.dh[static_cast<size_t>(r * 2 * I + i)], gdu = got.dh[static_cast<size_t>(r * 2 * I + I + i)];
      const bf16_t gwa = got.wa[x];
      if (kind < 0) {
        if (gdg != 0xFFFF || gdu != 0xFFFF || (optional && gwa != 0xFFFF))
          unwritten.add([&] { return row_s + " of a -1 block, channel " + std::to_string(i) + " was written"; });
        continue;
      }
      if (kind == 0) {
        if ((gdg & 0x7FFF) != 0 || (gdu & 0x7FFF) != 0 || (optional && (gwa & 0x7FFF) != 0))
          pad_fail.add([&] {
            return "padding " + row_s + " channel " + std::to_string(i) + ": dg " + num(bf16_to_float(gdg)) + " du " +
                   num(bf16_to_float(gdu)) + " wa " + num(bf16_to_float(gwa)) + " (want 0)";
          });
        continue;
      }
      const double dg = bf16_to_float(gdg), du = bf16_to_float(gdu);
      const double tg = std::fabs(want.dg[x]) / 128 + 1e-3 * rms_g, tu = std::fabs(want.du[x]) / 128 + 1e-3 * rms_u;
      if (!(std::fabs(dg - want.dg[x]) <= tg) || !(std::fabs(du - want.du[x]) <= tu))
        dh_fail.add([&] {
          return row_s + " channel " + std::to_string(i) + ": dg " + num(dg) + " want " + num(want.dg[x]) + ", du " +
                 num(du) + " want " + num(want.du[x]) + " (g " +
                 num(bf16_to_float(in.h[static_cast<size_t>(r * 2 * I + i)])) + ", u " +
                 num(bf16_to_float(in.h[static_cast<size_t>(r * 2 * I + I + i)])) + ", da " + num(want.da[x]) + ")";
        });
      num_g += (dg - want.dg[x]) * (dg - want.dg[x]);
      num_u += (du - want.du[x]) * (du - want.du[x]);
      if (optional) {
        const double wa = bf16_to_float(gwa);
        if (!(std::fabs(wa - want.wa[x]) <= std::fabs(want.wa[x]) / 128 + want.wa_amb[x] + 1e-30))
          wa_fail.add([&] { return row_s + " channel " + std::to_string(i) + ": wa " + num(wa) + " want " + num(want.wa[x]); });
      }
    }
    if (!optional) continue;
    for (int64_t c = 0; c < C; ++c) {
      const size_t x = static_cast<size_t>(r * C + c);
      uint32_t bits;
      std::memcpy(&bits, &got.part[x], 4);
      if (kind < 0) {
        if (bits != 0xFFFFFFFFu) unwritten.add([&] { return row_s + " of a -1 block: partial " + std::to_string(c) + " written"; });
        continue;
      }
      if (kind == 0) {
        if (got.part[x] != 0.0f)
          pad_fail.add([&] { return "padding " + row_s + ": partial " + std::to_string(c) + " = " + num(got.part[x]); });
        continue;
      }
      const double tol = 1e-4 * want.part_abs[x] + want.part_amb[x] + 1e-7;
      if (!(std::fabs(got.part[x] - want.part[x]) <= tol))
        part_fail.add([&] {
          return row_s + " chunk " + std::to_string(c) + " (channels " + std::to_string(128 * c) + ".." +
                 std::to_string(128 * c + 127) + "): partial " + num(got.part[x]) + " want " + num(want.part[x]) +
                 " (tolerance " + num(tol) + ")";
        });
    }
  }
  if (!optional) {
    // Not passed: nothing written
    for (size_t x = 0; x < got.wa.size(); ++x)
      if (got.wa[x] != 0xFFFF) unwritten.add([&] { return "wa was written without being passed (element " + std::to_string(x) + ")"; });
    for (size_t x = 0; x < got.part.size(); ++x) {
      uint32_t bits;
      std::memcpy(&bits, &got.part[x], 4);
      if (bits != 0xFFFFFFFFu)
        unwritten.add([&] { return "dtw_partials written without being passed (element " + std::to_string(x) + ")"; });
    }
  }
  EXPECT_EQ(dh_fail.count, 0) << what << ": dh = [dg | du] outside the tolerance at " << dh_fail.count
                              << " elements:" << dh_fail.shown;
  EXPECT_EQ(wa_fail.count, 0) << what << ": wa = bf16(w·a) outside the tolerance at " << wa_fail.count
                              << " elements:" << wa_fail.shown;
  EXPECT_EQ(part_fail.count, 0) << what << ": dtw_partials outside the tolerance at " << part_fail.count
                                << " (row, chunk)s:" << part_fail.shown;
  EXPECT_EQ(pad_fail.count, 0) << what << ": padding rows (w = 0, h = 0, dy = 0) must give zeros; "
                               << pad_fail.count << " did not:" << pad_fail.shown;
  EXPECT_EQ(unwritten.count, 0) << what << ": values that must stay unwritten (0xFF poison) were written at "
                                << unwritten.count << " places:" << unwritten.shown;
  std::printf("dgrad-down SwiGLU %s: dg rel %.3e, du rel %.3e over %ld elements\n", what.c_str(),
              std::sqrt(num_g / std::max(rms_g * rms_g * n, 1e-300)), std::sqrt(num_u / std::max(rms_u * rms_u * n, 1e-300)),
              static_cast<long>(n));
}

bool bitwise_equal(const SwiGLUBwdOutputs& a, const SwiGLUBwdOutputs& b, std::string* where) {
  auto first_diff = [](const auto& x, const auto& y) -> int64_t {
    for (size_t i = 0; i < x.size(); ++i)
      if (std::memcmp(&x[i], &y[i], sizeof(x[i])) != 0) return static_cast<int64_t>(i);
    return -1;
  };
  const int64_t dh = first_diff(a.dh, b.dh), wa = first_diff(a.wa, b.wa), part = first_diff(a.part, b.part);
  *where = "first differing element: dh " + std::to_string(dh) + ", wa " + std::to_string(wa) + ", dtw_partials " +
           std::to_string(part) + " (-1: equal)";
  return dh < 0 && wa < 0 && part < 0;
}

struct SwiGLUBwdCase {
  const char* name;
  int64_t E, H, I;
  std::vector<Segment> segs;
  int trailing;
  int64_t cut;
  int64_t num_blocks;
};

// Experts with 0 rows (no blocks), 1 row, 130 rows (a second block of 2), full blocks; padding
// rows; -1 blocks at the end; M cut inside the last block; grids smaller than the tile count
// (several tiles per block); I = 384 (not a multiple of 256: 128 x 128 tiles only).
std::vector<SwiGLUBwdCase> swiglu_bwd_cases() {
  return {
      {"E=4 H=512 I=512, experts 2:1 1:130 3:256 (0: none), one -1 block", 4, 512, 512, {{2, 1}, {1, 130}, {3, 256}}, 1, 0, 0},
      {"E=3 H=256 I=256, M cut 58 rows into the last block, grid 3", 3, 256, 256, {{0, 200}, {2, 128}}, 0, 58, 3},
      {"E=2 H=1024 I=768, one expert of 300 rows, two -1 blocks, grid 2", 2, 1024, 768, {{1, 300}}, 2, 0, 2},
  };
}

TEST(GemmGpu, DgradDownSwiGLUEpilogue) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const SwiGLUBwdCase& c : swiglu_bwd_cases()) {
    const uint64_t seed = fresh_seed();
    const SwiGLUBwdInputs in = make_swiglu_bwd_inputs(seed, c.E, c.H, c.I, c.segs, c.trailing, c.cut);
    const SwiGLUBwdWant want = swiglu_bwd_reference(in);
    for (int32_t tile_n : {kAbiTile, 256, 128, kPingPong128})
      for (bool optional : {true, false}) {
        const std::string what = std::string(c.name) + ", tile " + tile_name(tile_n) +
                                 (optional ? "" : ", without wa and partials") + ", seed " + std::to_string(seed);
        SCOPED_TRACE(what);
        SwiGLUBwdOutputs out, again;
        ASSERT_TRUE(run_swiglu_bwd(in, tile_n, c.num_blocks, optional, &out));
        check_swiglu_bwd_outputs(in, want, out, optional, what);
        ASSERT_TRUE(run_swiglu_bwd(in, tile_n, c.num_blocks, optional, &again));
        std::string where;
        EXPECT_TRUE(bitwise_equal(out, again, &where)) << what << ": run twice, not bitwise equal; " << where;
      }
  }
}

// I not a multiple of the tile: I = 384 (a partial last tile at 128 x 256) and I = 320 (a
// partial last tile at both shapes, and a last 128-channel chunk of 64 channels), through the
// C ABI (128 x 256) and the engine at 128 x 128.
TEST(GemmGpu, DgradDownSwiGLUPartialTiles) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (int64_t I : {384, 320}) {
    const uint64_t seed = fresh_seed();
    const SwiGLUBwdInputs in = make_swiglu_bwd_inputs(seed, 2, 192, I, {{1, 77}, {0, 300}}, 2, 0);
    const SwiGLUBwdWant want = swiglu_bwd_reference(in);
    for (int32_t tile_n : {kAbiTile, 256, 128, kPingPong128}) {
      const std::string what = "E=2 H=192 I=" + std::to_string(I) + " experts 1:77 0:300, tile " +
                               tile_name(tile_n) + ", seed " + std::to_string(seed);
      SCOPED_TRACE(what);
      SwiGLUBwdOutputs out, again;
      ASSERT_TRUE(run_swiglu_bwd(in, tile_n, 0, true, &out));
      check_swiglu_bwd_outputs(in, want, out, true, what);
      ASSERT_TRUE(run_swiglu_bwd(in, tile_n, 0, true, &again));
      std::string where;
      EXPECT_TRUE(bitwise_equal(out, again, &where)) << what << ": run twice, not bitwise equal; " << where;
    }
  }
}

// The partials are defined per 128 channels with one summation order for both tile shapes, so
// given the same da bits they are the same bits at 128 x 256 and 128 x 128; dh and wa are
// element-wise functions of da, h and w.  The two shapes run the same K loop (same stages,
// four k16 wgmmas per stage in the same order, one accumulator chain per element); they differ
// only in the wgmma's N (n256 vs n128).  That every output element's k16 reduction inside the
// tensor core does not depend on N is what this test asserts, and what it cannot know
// beforehand: if it fails, the message says whether the plain dgrad-down kind's bf16 da also
// differs between the shapes (then the hardware sums differently per N and the shape
// independence holds only to rounding, as DgradDownSwiGLUEpilogue checks), or not (then look at
// the epilogue's chunk order).
TEST(GemmGpu, DgradDownSwiGLUTileShapesAgreeBitwise) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const SwiGLUBwdCase& c : swiglu_bwd_cases()) {
    const uint64_t seed = fresh_seed();
    const std::string what = std::string(c.name) + ", seed " + std::to_string(seed);
    SCOPED_TRACE(what);
    const SwiGLUBwdInputs in = make_swiglu_bwd_inputs(seed, c.E, c.H, c.I, c.segs, c.trailing, c.cut);
    SwiGLUBwdOutputs t256, t128, tpp, tabi;
    ASSERT_TRUE(run_swiglu_bwd(in, 256, c.num_blocks, true, &t256));
    ASSERT_TRUE(run_swiglu_bwd(in, 128, c.num_blocks, true, &t128));
    ASSERT_TRUE(run_swiglu_bwd(in, kPingPong128, c.num_blocks, true, &tpp));
    ASSERT_TRUE(run_swiglu_bwd(in, kAbiTile, c.num_blocks, true, &tabi));
    std::string where;
    // The schedule (which warpgroup runs a tile, in which order) never changes an element's sums
    EXPECT_TRUE(bitwise_equal(t128, tpp, &where)) << what << ": 128x128 cooperative and ping-pong differ; " << where;
    EXPECT_TRUE(bitwise_equal(tpp, tabi, &where)) << what << ": the C ABI's launch and ping-pong differ; " << where;
    if (bitwise_equal(t256, t128, &where)) continue;
    // Diagnose: the plain dgrad-down kind (bf16 da) at both shapes
    const int64_t M = in.M, H = in.H, I = in.I;
    DeviceBuffer ddy(in.dy), dw(in.w_down), dblk(in.block_expert), d256(static_cast<size_t>(M * I) * 2),
        d128(static_cast<size_t>(M * I) * 2);
    const int32_t blocks = static_cast<int32_t>(in.block_expert.size());
    int64_t da_diff = -1;
    try {
      for (int32_t tile_n : {256, 128}) {
        gemm::GroupedGemmArgs g = gemm::dgrad_down_args(ddy.ptr, M, H, dw.ptr, in.E, I,
                                                        static_cast<const int32_t*>(dblk.ptr), blocks,
                                                        tile_n == 256 ? d256.ptr : d128.ptr);
        gemm::launch_grouped_gemm(gemm::with_tile_n(g, tile_n), nullptr);
      }
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto a = d256.get<bf16_t>(), b = d128.get<bf16_t>();
      da_diff = 0;
      for (size_t i = 0; i < a.size(); ++i) da_diff += a[i] != b[i];
    } catch (const std::exception& e) {
      ADD_FAILURE() << "diagnostic dgrad-down launch: " << e.what();
    }
    ADD_FAILURE() << what << ": 128x256 and 128x128 tiles give different bits; " << where << ". Diagnostic: the plain "
                  << "dgrad-down kind's bf16 da differs at " << da_diff << " elements between the shapes"
                  << (da_diff > 0 ? " -> the wgmma's fp32 sums depend on N: the partials agree only to rounding"
                                  : da_diff == 0 ? " -> da's bf16 agree: suspect the epilogue's per-shape order (or fp32 "
                                                   "da bits that differ below bf16)"
                                                 : "");
  }
}

// A pipeline whose only job is to finish: many tiles over a tiny grid wrap the stage ring
// many times (phases flip hundreds of times per block).
TEST(GemmGpu, PipelineFinishesWithFewBlocks) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  check_grouped_gemm(fresh_seed(), 2, 2048, 512, {0, 1, 1, 0, 1, 0, 0, 1}, mokGemmDown, 3);
  check_grouped_gemm(fresh_seed(), 2, 640, 256, {0, 1, 1, 0, 1, 0, 0, 1}, mokGemmGateUp, 1);
}

// ---- the EP=1 forward through the C ABI vs the CPU reference --------------------------------

struct Layer {
  int64_t H, I, Is, E, k, T;
  std::vector<bf16_t> x, wg, wu, wd, sg, su, sd;
  std::vector<int32_t> ids;
  std::vector<float> w;
};

Layer make_layer(uint64_t seed, int64_t H, int64_t I, int64_t Is, int64_t E, int64_t k, int64_t T, Routing routing) {
  std::mt19937_64 rng(seed);
  Layer l{H, I, Is, E, k, T, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  l.x = random_bf16(rng, static_cast<size_t>(T * H), 1.f);
  const float sh = 1.f / std::sqrt(static_cast<float>(H)), si = 1.f / std::sqrt(static_cast<float>(I));
  l.wg = random_bf16(rng, static_cast<size_t>(E * I * H), sh);
  l.wu = random_bf16(rng, static_cast<size_t>(E * I * H), sh);
  l.wd = random_bf16(rng, static_cast<size_t>(E * H * I), si);
  l.sg = random_bf16(rng, static_cast<size_t>(Is * H), sh);
  l.su = random_bf16(rng, static_cast<size_t>(Is * H), sh);
  l.sd = random_bf16(rng, static_cast<size_t>(H * std::max<int64_t>(Is, 1)), 1.f / std::sqrt(static_cast<float>(std::max<int64_t>(Is, 1))));
  l.ids = to_int32(make_ids(rng, T, static_cast<int>(k), E, E, routing));
  l.w = random_f32(rng, static_cast<size_t>(T * k), -0.2f, 1.f);
  return l;
}

mokConfig_t layer_config(const Layer& l, int32_t device) {
  mokConfig_t c = MOK_CONFIG_INITIALIZER;
  c.hidden = l.H;
  c.intermediate = l.I;
  c.shared_intermediate = l.Is;
  c.num_experts = l.E;
  c.topk = l.k;
  c.max_tokens = std::max<int64_t>(l.T, 1);
  c.device = device;
  c.timeout_s = 10;
  return c;
}

// Runs the layer on the CPU reference.
std::vector<bf16_t> cpu_forward(Layer& l) {
  mokConfig_t c = layer_config(l, MOK_DEVICE_CPU);
  mokWorkspace_t ws;
  EXPECT_EQ(mokWorkspaceCreate(&c, &ws), mokSuccess) << mokGetLastError();
  std::vector<bf16_t> y(static_cast<size_t>(l.T * l.H));
  mokForwardArgs_t a{};
  a.x = tensor_view(l.x.data(), mokBFloat16, {l.T, l.H}, -1);
  a.topk_ids = tensor_view(l.ids.data(), mokInt32, {l.T, l.k}, -1);
  a.topk_weights = tensor_view(l.w.data(), mokFloat32, {l.T, l.k}, -1);
  a.weights.w_gate = tensor_view(l.wg.data(), mokBFloat16, {l.E, l.I, l.H}, -1);
  a.weights.w_up = tensor_view(l.wu.data(), mokBFloat16, {l.E, l.I, l.H}, -1);
  a.weights.w_down = tensor_view(l.wd.data(), mokBFloat16, {l.E, l.H, l.I}, -1);
  if (l.Is > 0) {
    a.weights.ws_gate = tensor_view(l.sg.data(), mokBFloat16, {l.Is, l.H}, -1);
    a.weights.ws_up = tensor_view(l.su.data(), mokBFloat16, {l.Is, l.H}, -1);
    a.weights.ws_down = tensor_view(l.sd.data(), mokBFloat16, {l.H, l.Is}, -1);
  }
  a.y = tensor_view(y.data(), mokBFloat16, {l.T, l.H}, -1);
  EXPECT_EQ(mokForward(ws, &a, nullptr), mokSuccess) << mokGetLastError();
  mokWorkspaceDestroy(ws);
  return y;
}

// The same layer on the GPU; `runs` forwards, each into a freshly poisoned y.
struct GpuLayer {
  Layer& l;
  mokWorkspace_t ws = nullptr;
  DeviceBuffer x, ids, w, wg, wu, wd, sg, su, sd, y;
  mokForwardArgs_t a{};
  explicit GpuLayer(Layer& layer, int64_t minibatch = 0, int64_t macrobatch = 0, int64_t num_blocks = 0)
      : l(layer), x(l.x), ids(l.ids), w(l.w), wg(l.wg), wu(l.wu), wd(l.wd), sg(l.sg), su(l.su), sd(l.sd),
        y(static_cast<size_t>(l.T * l.H) * 2) {
    mokConfig_t c = layer_config(l, 0);
    if (minibatch) c.minibatch_size = minibatch;
    if (macrobatch) c.macrobatch_size = macrobatch;
    if (num_blocks) c.num_blocks = num_blocks;
    EXPECT_EQ(mokWorkspaceCreate(&c, &ws), mokSuccess) << mokGetLastError();
    a.x = tensor_view(x.ptr, mokBFloat16, {l.T, l.H}, 0);
    a.topk_ids = tensor_view(ids.ptr, mokInt32, {l.T, l.k}, 0);
    a.topk_weights = tensor_view(w.ptr, mokFloat32, {l.T, l.k}, 0);
    a.weights.w_gate = tensor_view(wg.ptr, mokBFloat16, {l.E, l.I, l.H}, 0);
    a.weights.w_up = tensor_view(wu.ptr, mokBFloat16, {l.E, l.I, l.H}, 0);
    a.weights.w_down = tensor_view(wd.ptr, mokBFloat16, {l.E, l.H, l.I}, 0);
    if (l.Is > 0) {
      a.weights.ws_gate = tensor_view(sg.ptr, mokBFloat16, {l.Is, l.H}, 0);
      a.weights.ws_up = tensor_view(su.ptr, mokBFloat16, {l.Is, l.H}, 0);
      a.weights.ws_down = tensor_view(sd.ptr, mokBFloat16, {l.H, l.Is}, 0);
    }
    a.y = tensor_view(y.ptr, mokBFloat16, {l.T, l.H}, 0);
  }
  ~GpuLayer() { mokWorkspaceDestroy(ws); }
  std::vector<bf16_t> run() {
    EXPECT_EQ(cudaMemset(y.ptr, 0xFF, y.bytes), cudaSuccess);
    EXPECT_EQ(mokForward(ws, &a, nullptr), mokSuccess) << mokGetLastError();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(mokWorkspaceCheckErrors(ws, 1), mokSuccess) << mokGetLastError();
    return y.get<bf16_t>();
  }
};

void check_forward(uint64_t seed, int64_t H, int64_t I, int64_t Is, int64_t E, int64_t k, int64_t T, Routing routing,
                   bool mask_all = false) {
  SCOPED_TRACE("seed=" + std::to_string(seed) + " H=" + std::to_string(H) + " I=" + std::to_string(I) + " Is=" +
               std::to_string(Is) + " E=" + std::to_string(E) + " k=" + std::to_string(k) + " T=" + std::to_string(T) +
               " routing=" + routing_name(routing));
  Layer l = make_layer(seed, H, I, Is, E, k, T, routing);
  if (mask_all) std::fill(l.ids.begin(), l.ids.end(), -1);
  const auto want = cpu_forward(l);
  GpuLayer g(l);
  const auto got = g.run();
  std::vector<double> wantd(want.size());
  for (size_t i = 0; i < want.size(); ++i) wantd[i] = bf16_to_float(want[i]);
  const ErrStats s = compare_rows(got, wantd, T, H, [](int64_t) { return true; });
  EXPECT_EQ(s.nan, 0) << "NaN in y (unwritten rows?)";
  EXPECT_LT(s.rel, 1e-2) << "y vs CPU reference: relative Frobenius " << s.rel << ", max-abs " << s.max_abs;
  std::printf("forward H=%ld I=%ld Is=%ld E=%ld k=%ld T=%ld %s: rel %.3e max-abs %.3e\n", (long)H, (long)I, (long)Is,
              (long)E, (long)k, (long)T, routing_name(routing), s.rel, s.max_abs);
  // Run to run: 100 runs bitwise identical.
  for (int rep = 0; rep < 100; ++rep)
    ASSERT_EQ(0, std::memcmp(got.data(), g.run().data(), got.size() * 2)) << "run " << rep;
}

TEST(ForwardGpu, MatchesCpuReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  check_forward(fresh_seed(), 256, 128, 0, 8, 2, 300, Routing::kUniform);
  check_forward(fresh_seed(), 512, 256, 128, 16, 4, 257, Routing::kZipf);
  check_forward(fresh_seed(), 256, 384, 0, 4, 4, 129, Routing::kOneExpert);   // every token on experts 0..3
  check_forward(fresh_seed(), 256, 128, 128, 8, 3, 200, Routing::kMasked);    // -1 routes, all-masked tokens
  check_forward(fresh_seed(), 768, 256, 0, 32, 8, 64, Routing::kUniform);     // experts with 0 rows
  check_forward(fresh_seed(), 256, 128, 128, 8, 1, 1, Routing::kUniform);     // T = 1, k = 1
  check_forward(fresh_seed(), 256, 128, 128, 8, 2, 77, Routing::kUniform, true);  // every route masked: y = shared
  check_forward(fresh_seed(), 256, 128, 0, 8, 2, 77, Routing::kUniform, true);    // every route masked: y = 0
}

// The fused megakernel against the unfused launches built from the same tiles and the same
// reduction order (MOK_FORWARD_PATH=unfused): identical bits.  Also identical bits with the
// ring wrapping many times (small macrobatches), and on grids of 1 to every SM (the gather
// warps' share of the rows).
TEST(ForwardGpu, FusedEqualsUnfusedAndRingWrapping) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  struct Shape { int64_t H, I, Is, E, k, T; Routing r; };
  const Shape shapes[] = {{512, 256, 128, 16, 4, 700, Routing::kUniform}, {256, 128, 0, 8, 2, 1000, Routing::kZipf},
                          {768, 384, 256, 4, 4, 333, Routing::kOneExpert}, {256, 256, 128, 8, 3, 517, Routing::kMasked}};
  for (const auto& sh : shapes) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("seed=" + std::to_string(seed) + " H=" + std::to_string(sh.H) + " T=" + std::to_string(sh.T) + " " +
                 routing_name(sh.r));
    Layer l = make_layer(seed, sh.H, sh.I, sh.Is, sh.E, sh.k, sh.T, sh.r);
    std::vector<bf16_t> fused;
    {
      GpuLayer g(l);
      fused = g.run();
      setenv("MOK_FORWARD_PATH", "unfused", 1);
      const auto unfused = g.run();
      unsetenv("MOK_FORWARD_PATH");
      ASSERT_EQ(0, std::memcmp(fused.data(), unfused.data(), fused.size() * 2)) << "fused vs unfused";
    }
    // The start gather of every block (the default one minibatch, none, or three minibatches,
    // clamped to the ring's first pass), then the gather warps of a grid of `blocks` (0: one per SM)
    for (const char* start : {"1", "0", "3"}) {
      setenv("MOK_FORWARD_START_GATHER", start, 1);
      for (auto [mini, macro, blocks] : {std::tuple<int64_t, int64_t, int64_t>{128, 256, 1}, {256, 512, 4},
                                          {128, 128, 2}, {1024, 16384, 0}, {512, 512, 3}}) {
        GpuLayer g(l, mini, macro, blocks);
        const auto y = g.run();
        ASSERT_EQ(0, std::memcmp(fused.data(), y.data(), fused.size() * 2))
            << "start gather " << start << " minibatch " << mini << " macrobatch " << macro << " blocks " << blocks;
      }
    }
    unsetenv("MOK_FORWARD_START_GATHER");
  }
}

TEST(ForwardGpu, BatchInvariance) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  Layer a = make_layer(seed, 512, 256, 128, 8, 2, 400, Routing::kUniform);
  Layer b = make_layer(seed + 1, 512, 256, 128, 8, 2, 400, Routing::kZipf);
  b.wg = a.wg; b.wu = a.wu; b.wd = a.wd; b.sg = a.sg; b.su = a.su; b.sd = a.sd;
  // b holds a's tokens 10..59 at 300..349; every other token differs.
  for (int64_t t = 10; t < 60; ++t) {
    std::copy_n(&a.x[t * 512], 512, &b.x[(t + 290) * 512]);
    std::copy_n(&a.ids[t * 2], 2, &b.ids[(t + 290) * 2]);
    std::copy_n(&a.w[t * 2], 2, &b.w[(t + 290) * 2]);
  }
  GpuLayer ga(a), gb(b);
  const auto ya = ga.run(), yb = gb.run();
  for (int64_t t = 10; t < 60; ++t)
    ASSERT_EQ(0, std::memcmp(&ya[t * 512], &yb[(t + 290) * 512], 1024)) << "token " << t;
}

TEST(ForwardGpu, DeviceValidationReportsBadIds) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Layer l = make_layer(fresh_seed(), 256, 128, 0, 8, 2, 50, Routing::kUniform);
  l.ids[17 * 2 + 1] = 99;
  GpuLayer g(l);
  EXPECT_EQ(cudaMemset(g.y.ptr, 0xFF, g.y.bytes), cudaSuccess);
  ASSERT_EQ(mokForward(g.ws, &g.a, nullptr), mokSuccess) << "no host-side id check for device tensors (no sync)";
  EXPECT_EQ(mokWorkspaceCheckErrors(g.ws, 1), mokDeviceInvalidRoute);
  const std::string msg = mokGetLastError();
  EXPECT_NE(msg.find("[17, 1] = 99"), std::string::npos) << msg;
  // The bad route was masked: the other tokens are still right, and the workspace runs on.
  l.ids[17 * 2 + 1] = -1;
  const auto want = cpu_forward(l);
  const auto got = g.y.get<bf16_t>();
  std::vector<double> wantd(want.size());
  for (size_t i = 0; i < want.size(); ++i) wantd[i] = bf16_to_float(want[i]);
  const ErrStats s = compare_rows(got, wantd, 50, 256, [](int64_t) { return true; });
  EXPECT_LT(s.rel, 1e-2) << s.rel;
  EXPECT_EQ(s.nan, 0);
}

}  // namespace
}  // namespace mok::test
