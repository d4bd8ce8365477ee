// The C ABI: every entry point validates, runs, and turns exceptions into a result code
// plus the thread's last-error string.
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "common/parallel.hpp"
#include "cuda/cuda_api.hpp"
#include "mok/mok.h"
#include "plan/plan.hpp"
#include "ref/reference.hpp"
#include "common/symmetric.hpp"
#include "runtime/errors.hpp"
#include "runtime/layer.hpp"
#include "runtime/tensor.hpp"

struct mokWorkspace {
  mok::Workspace impl;
};

namespace {

thread_local std::string g_last_error;

template <typename Fn>
mokResult_t guarded(const char* where, Fn&& fn) {
  try {
    fn();
    g_last_error.clear();
    return mokSuccess;
  } catch (const mok::Error& e) {
    g_last_error = std::string(where) + ": " + e.what();
    return e.code();
  } catch (const std::bad_alloc&) {
    g_last_error = std::string(where) + ": out of host memory";
    return mokOutOfMemory;
  } catch (const std::exception& e) {
    g_last_error = std::string(where) + ": internal error: " + e.what();
    return mokInternalError;
  }
}

mok::Workspace& workspace_of(mokWorkspace_t ws) {
  if (ws == nullptr) MOK_FAIL(mokInvalidUsage, "workspace is NULL");
  return ws->impl;
}

void reject_cuda_layer(int32_t device, const char* what) {
  if (device >= 0)
    MOK_FAIL(mokNotSupported, "tensors are on " << mok::device_str(device) << ": the CUDA " << what
                                                << " is not built yet in this version of mok; use CPU tensors "
                                                   "(reference backend)");
}

// The checks of a forward on the workspace's GPU, before anything is launched.
mok::ref::RankInputs check_forward_cuda(mok::Workspace& ws, const mokForwardArgs_t* args, const std::string& tag,
                                        bool need_y = true) {
  const mokConfig_t& c = ws.config;
  MOK_CHECK_ARG(args != nullptr, tag << "forward args is NULL");
  if (!mok::cuda::built()) MOK_FAIL(mokNotSupported, "this libmok was built without its CUDA part (no nvcc)");
  MOK_CHECK_ARG(ws.device != nullptr, tag << "x is on " << mok::device_str(args->x.device)
                                          << " but the workspace was created for the CPU (config.device = -1)");
  const std::string why = mok::cuda::unsupported_shape(c);
  if (!why.empty()) MOK_FAIL(mokNotSupported, tag << why);
  return mok::check_forward_args(c, *args, static_cast<int32_t>(c.device), tag, need_y);
}

// The saved pre-activations of a training forward (mokSaved_t), checked against the workspace.
mok::cuda::Saved check_saved(const mok::Workspace& ws, const mokSaved_t* saved, int64_t num_tokens) {
  MOK_CHECK_ARG(saved != nullptr, "saved is NULL");
  const mokConfig_t& c = ws.config;
  const int32_t dev = static_cast<int32_t>(c.device);
  const int64_t max_rows = mok::plan::max_rows(mok::plan_dims(c));
  mok::check_tensor(saved->h, "saved h", {mokBFloat16}, {max_rows, 2 * c.intermediate}, dev);
  mok::cuda::Saved s;
  s.h = saved->h.data;
  if (c.shared_intermediate > 0) {
    mok::check_tensor(saved->shared_h, "saved shared_h", {mokBFloat16}, {num_tokens, 2 * c.shared_intermediate}, dev);
    s.shared_h = saved->shared_h.data;
  }
  return s;
}

// Forward on the workspace's GPU: checks, then launches with no host synchronisation.
void run_forward_cuda(mok::Workspace& ws, const mokForwardArgs_t* args, void* stream, const mokSaved_t* saved = nullptr) {
  const mok::ref::RankInputs in = check_forward_cuda(ws, args, std::string());
  const mok::cuda::Saved s = saved ? check_saved(ws, saved, in.num_tokens) : mok::cuda::Saved{};
  mok::cuda::forward(*ws.device, ws.config, in, args->y.data, stream, s);
}

// Backward on the workspace's GPU (saved: the forward's pre-activations, or null).
void run_backward_cuda(mok::Workspace& ws, const mokBackwardArgs_t* args, void* stream, const mokSaved_t* saved) {
  const mok::ref::RankInputs in = check_forward_cuda(ws, &args->fwd, std::string(), false);
  const mok::ref::RankGrads grads =
      mok::check_backward_args(ws.config, *args, static_cast<int32_t>(ws.config.device), std::string());
  const mok::cuda::Saved s = saved ? check_saved(ws, saved, in.num_tokens) : mok::cuda::Saved{};
  mok::cuda::backward(*ws.device, ws.config, in, grads, args->dy.data, stream, s);
}

mok::plan::RoutingView routing_from(const mokConfig_t& c, const std::vector<mok::ref::RankInputs>& ranks) {
  mok::plan::RoutingView v;
  v.num_ranks = static_cast<int32_t>(ranks.size());
  v.topk = static_cast<int32_t>(c.topk);
  v.num_experts = c.num_experts;
  v.ids_are_int64 = ranks.empty() ? 0 : ranks[0].ids_are_int64;
  for (size_t s = 0; s < ranks.size(); ++s) {
    MOK_CHECK_ARG(ranks[s].ids_are_int64 == ranks[0].ids_are_int64,
                  "rank " << s << ": topk_ids dtype differs from rank 0's; use one dtype across the group");
    v.ids[s] = ranks[s].topk_ids;
    v.num_tokens[s] = ranks[s].num_tokens;
  }
  return v;
}

std::string rank_tag(int64_t P, int64_t r) { return P > 1 ? "rank " + std::to_string(r) + ": " : std::string(); }

// Shared by the EP=1 and the emulated entry points: validate every rank, then run.
void run_forward(const mokConfig_t& c, const mokForwardArgs_t* args, int64_t P, const char* what) {
  MOK_CHECK_ARG(args != nullptr, what << " args is NULL");
  std::vector<mok::ref::RankInputs> ranks;
  std::vector<mok::bf16_t*> ys;
  for (int64_t r = 0; r < P; ++r) {
    reject_cuda_layer(args[r].x.device, P > 1 ? "emulated EP group" : "forward");
    ranks.push_back(mok::check_forward_args(c, args[r], MOK_DEVICE_CPU, rank_tag(P, r), true));
    ys.push_back(static_cast<mok::bf16_t*>(args[r].y.data));
  }
  const auto v = routing_from(c, ranks);
  for (int64_t r = 0; r < P; ++r) mok::check_ids_host(v, static_cast<int>(r), rank_tag(P, r));
  mok::ref::forward(mok::layer_dims(c), ranks, ys, mok::resolve_num_threads(c.num_threads));
}

void run_backward(const mokConfig_t& c, const mokBackwardArgs_t* args, int64_t P, const char* what) {
  MOK_CHECK_ARG(args != nullptr, what << " args is NULL");
  std::vector<mok::ref::RankInputs> ranks;
  std::vector<const mok::bf16_t*> dys;
  std::vector<mok::ref::RankGrads> grads;
  for (int64_t r = 0; r < P; ++r) {
    reject_cuda_layer(args[r].fwd.x.device, P > 1 ? "emulated EP group" : "backward");
    ranks.push_back(mok::check_forward_args(c, args[r].fwd, MOK_DEVICE_CPU, rank_tag(P, r), false));
    grads.push_back(mok::check_backward_args(c, args[r], MOK_DEVICE_CPU, rank_tag(P, r)));
    dys.push_back(static_cast<const mok::bf16_t*>(args[r].dy.data));
  }
  const auto v = routing_from(c, ranks);
  for (int64_t r = 0; r < P; ++r) mok::check_ids_host(v, static_cast<int>(r), rank_tag(P, r));
  mok::ref::backward(mok::layer_dims(c), ranks, dys, grads, mok::resolve_num_threads(c.num_threads));
}

mokConfig_t emulated_config(const mokConfig_t* config, int64_t ep_size) {
  mokConfig_t c = mok::normalize_config(config);
  MOK_CHECK_ARG(ep_size == c.ep_size, "ep_size argument " << ep_size << " differs from config.ep_size " << c.ep_size);
  c.ep_rank = 0;
  c.device = MOK_DEVICE_CPU;
  mok::check_config(c);
  return c;
}

}  // namespace

namespace {
// The wgrad kinds' outputs (mokGroupedWgrad, mokGroupedWgradBlockScaled): out bf16, acc and
// main_grad fp32, each [E, Mo, No] where given, and something to write
template <class Args>
void check_wgrad_outputs(const Args& args, int64_t E, int64_t Mo, int64_t No, int32_t dev) {
  const bool has_out = args.out.data != nullptr, has_acc = args.acc.data != nullptr,
             has_mg = args.main_grad.data != nullptr;
  if (has_out) mok::check_tensor(args.out, "out", {mokBFloat16}, {E, Mo, No}, dev);
  if (has_acc) mok::check_tensor(args.acc, "acc", {mokFloat32}, {E, Mo, No}, dev);
  if (has_mg) mok::check_tensor(args.main_grad, "main_grad", {mokFloat32}, {E, Mo, No}, dev);
  MOK_CHECK_ARG(!(args.accumulate || args.store_acc) || has_acc, "accumulate / store_acc need acc");
  MOK_CHECK_ARG(has_out || has_mg || args.store_acc, "nothing to write: give out, main_grad or store_acc with acc");
}
}  // namespace

extern "C" {

const char* mokGetErrorString(mokResult_t result) {
  switch (result) {
    case mokSuccess: return "no error";
    case mokInvalidArgument: return "invalid argument";
    case mokInvalidUsage: return "invalid usage";
    case mokNotSupported: return "not supported";
    case mokCudaError: return "CUDA error";
    case mokTimeout: return "device-side wait timed out";
    case mokDeviceInvalidRoute: return "device-side validation found an invalid route";
    case mokOutOfMemory: return "out of memory";
    case mokInternalError: return "internal error";
    default: return "unknown result code";
  }
}

const char* mokGetLastError(void) { return g_last_error.c_str(); }
int mokGetVersion(void) { return MOK_VERSION_CODE; }

mokResult_t mokGetDefaultConfig(mokConfig_t* config) {
  return guarded("mokGetDefaultConfig", [&] {
    if (config == nullptr) MOK_FAIL(mokInvalidUsage, "config out-pointer is NULL");
    *config = MOK_CONFIG_INITIALIZER;
  });
}
int mokHasCuda(void) { return mok::cuda::built() ? 1 : 0; }

mokResult_t mokWorkspaceCreate(const mokConfig_t* config, mokWorkspace_t* workspace) {
  return guarded("mokWorkspaceCreate", [&] {
    if (workspace == nullptr) MOK_FAIL(mokInvalidUsage, "workspace out-pointer is NULL");
    *workspace = nullptr;
    mokConfig_t c = mok::normalize_config(config);
    mok::check_config(c);
    auto* ws = new mokWorkspace{mok::Workspace{c, mok::describe_buffers(c), nullptr}};
    if (c.device >= 0) {
      try {
        ws->impl.device = mok::cuda::create_workspace(c);
      } catch (...) {
        delete ws;
        throw;
      }
      ws->impl.description += "  device buffers: " + std::to_string(mok::cuda::workspace_bytes(ws->impl.device)) +
                              " B on " + mok::device_str(static_cast<int32_t>(c.device)) + "\n";
    }
    *workspace = ws;
  });
}

mokResult_t mokCheckSupport(const mokConfig_t* config, int32_t flags) {
  return guarded("mokCheckSupport", [&] {
    MOK_CHECK_ARG((flags & ~(MOK_SUPPORT_BACKWARD | MOK_SUPPORT_TRANSPOSED)) == 0,
                  "flags = " << flags << ": MOK_SUPPORT_BACKWARD (1) and MOK_SUPPORT_TRANSPOSED (2) only");
    const mokConfig_t c = mok::normalize_config(config);
    mok::check_config(c);
    if (c.device < 0) return;  // the CPU backend takes every valid layer, in either orientation
    if (!mok::cuda::built()) MOK_FAIL(mokNotSupported, "this libmok was built without its CUDA part (no nvcc)");
    // The backward takes every shape the forward takes; transposed weights, what the fused kernels take
    std::string why = mok::cuda::unsupported_shape(c);
    if (why.empty() && (flags & MOK_SUPPORT_TRANSPOSED) != 0)
      why = mok::cuda::unsupported_transposed(c, (flags & MOK_SUPPORT_BACKWARD) != 0);
    if (!why.empty()) MOK_FAIL(mokNotSupported, why);
  });
}

mokResult_t mokSymmetricBytes(const mokConfig_t* config, size_t* bytes) {
  return guarded("mokSymmetricBytes", [&] {
    if (bytes == nullptr) MOK_FAIL(mokInvalidUsage, "bytes out-pointer is NULL");
    const mokConfig_t c = mok::normalize_config(config);
    mok::check_config(c);
    *bytes = static_cast<size_t>(mok::sym_layout(c.ep_size, c.max_tokens, c.topk, c.hidden).bytes);
  });
}

mokResult_t mokWorkspaceCreateSymmetric(const mokConfig_t* config, void* const* regions, int64_t num_regions,
                                        mokWorkspace_t* workspace) {
  return guarded("mokWorkspaceCreateSymmetric", [&] {
    if (workspace == nullptr) MOK_FAIL(mokInvalidUsage, "workspace out-pointer is NULL");
    *workspace = nullptr;
    const mokConfig_t c = mok::normalize_config(config);
    mok::check_config(c);
    MOK_CHECK_ARG(c.device >= 0, "config.device = " << c.device << ": symmetric workspaces live on a CUDA device");
    MOK_CHECK_ARG(regions != nullptr && num_regions == c.ep_size,
                  "regions: " << num_regions << " given for config.ep_size = " << c.ep_size
                              << " (one per rank of the group, own at config.ep_rank)");
    if (!mok::cuda::built()) MOK_FAIL(mokNotSupported, "this libmok was built without its CUDA part (no nvcc)");
    const std::string why = mok::cuda::unsupported_shape(c);
    if (!why.empty()) MOK_FAIL(mokNotSupported, why);
    auto* ws = new mokWorkspace{mok::Workspace{c, mok::describe_buffers(c), nullptr}};
    try {
      ws->impl.device = mok::cuda::create_workspace(c, regions);
    } catch (...) {
      delete ws;
      throw;
    }
    ws->impl.description += "  device buffers: " + std::to_string(mok::cuda::workspace_bytes(ws->impl.device)) +
                            " B on " + mok::device_str(static_cast<int32_t>(c.device)) + " (+ the symmetric region)\n";
    *workspace = ws;
  });
}

mokResult_t mokWorkspaceDestroy(mokWorkspace_t workspace) {
  return guarded("mokWorkspaceDestroy", [&] {
    if (workspace) mok::cuda::destroy_workspace(workspace->impl.device);
    delete workspace;
  });
}

mokResult_t mokWorkspaceDescribe(mokWorkspace_t workspace, char* buffer, size_t buffer_size, size_t* needed) {
  return guarded("mokWorkspaceDescribe", [&] {
    const std::string& d = workspace_of(workspace).description;
    if (needed) *needed = d.size() + 1;
    if (buffer == nullptr && needed != nullptr) return;
    MOK_CHECK_ARG(buffer != nullptr && buffer_size > d.size(),
                  "buffer of " << buffer_size << " bytes is too small; " << d.size() + 1 << " needed");
    std::memcpy(buffer, d.c_str(), d.size() + 1);
  });
}

mokResult_t mokWorkspaceGetConfig(mokWorkspace_t workspace, mokConfig_t* config) {
  return guarded("mokWorkspaceGetConfig", [&] {
    MOK_CHECK_ARG(config != nullptr, "config out-pointer is NULL");
    *config = workspace_of(workspace).config;
  });
}

mokResult_t mokWorkspaceCheckErrors(mokWorkspace_t workspace, int wait) {
  return guarded("mokWorkspaceCheckErrors", [&] {
    mok::Workspace& ws = workspace_of(workspace);
    if (ws.device) mok::cuda::check_errors(*ws.device, static_cast<int>(ws.config.ep_rank), wait != 0);
  });
}

mokResult_t mokWorkspaceReadTrace(mokWorkspace_t workspace, void* buffer, size_t buffer_size, size_t* needed,
                                  int64_t* events_per_recorder) {
  return guarded("mokWorkspaceReadTrace", [&] {
    mok::Workspace& ws = workspace_of(workspace);
    if (ws.device == nullptr) {
      if (needed) *needed = 0;
      if (events_per_recorder) *events_per_recorder = 0;
      return;
    }
    const size_t bytes = mok::cuda::read_trace(*ws.device, nullptr, 0, events_per_recorder);
    if (needed) *needed = bytes;
    if (buffer != nullptr) mok::cuda::read_trace(*ws.device, buffer, buffer_size, nullptr);
  });
}

mokResult_t mokGroupedGemm(const mokGroupedGemmArgs_t* args, void* stream) {
  return guarded("mokGroupedGemm", [&] {
    MOK_CHECK_ARG(args != nullptr, "args is NULL");
    const int64_t kind = args->kind;
    MOK_CHECK_ARG(kind >= mokGemmDown && kind <= mokGemmGateUpPreact,
                  "kind = " << kind
                            << " is not a mokGemmKind_t (0 down, 1 gate/up, 2 dgrad down, 3 dgrad gate/up, "
                               "4 dgrad down SwiGLU, 5 gate/up pre-activations)");
    // Every check below runs on the views alone, before the CPU is rejected: shapes, dtypes and
    // the kind's inputs are reported the same way wherever the tensors live.
    const int32_t dev = args->a.device;
    MOK_CHECK_ARG(args->a.ndim == 2 && args->b0.ndim == 3, "a must be [M, K] and b0 [E, *, *]");
    const int64_t M = args->a.shape[0], K = args->a.shape[1], E = args->b0.shape[0];
    const bool swiglu_bwd = kind == mokGemmDgradDownSwiGLU;
    const bool dgrad = kind == mokGemmDgradDown || kind == mokGemmDgradGateUp || swiglu_bwd;
    // Forward kinds: b [E, N, K]; dgrad kinds: b as stored, [E, K, N] (gate/up: [E, K/2, N] each)
    const int64_t N = dgrad ? args->b0.shape[2] : args->b0.shape[1];
    const int64_t b_k = kind == mokGemmDgradGateUp ? K / 2 : K;
    const int64_t blocks = (M + 127) / 128;
    mok::check_tensor(args->a, "a", {mokBFloat16}, {M, K}, dev);
    const std::vector<int64_t> b_shape = dgrad ? std::vector<int64_t>{E, b_k, N} : std::vector<int64_t>{E, N, K};
    mok::check_tensor(args->b0, "b0", {mokBFloat16}, b_shape, dev);
    const bool preact = kind == mokGemmGateUpPreact;
    const bool two_b = kind == mokGemmGateUp || kind == mokGemmDgradGateUp || preact;
    if (two_b) mok::check_tensor(args->b1, "b1", {mokBFloat16}, b_shape, dev);
    mok::check_tensor(args->block_expert, "block_expert", {mokInt32}, {blocks}, dev);
    MOK_CHECK_ARG(N % 64 == 0, (swiglu_bwd ? "I = b0.shape[2] = " : "N = ") << N << " must be a multiple of 64");
    if (swiglu_bwd) {
      // out is dh = [dg | du]; the epilogue's inputs are required, its other outputs optional
      MOK_CHECK_ARG(mok::present(args->h), "kind 4 (dgrad down SwiGLU) needs h: [M, 2I] = ["
                                               << M << ", " << 2 * N << "] bfloat16, the saved [g | u] of each row");
      MOK_CHECK_ARG(mok::present(args->row_weight),
                    "kind 4 (dgrad down SwiGLU) needs row_weight: [M] = [" << M << "] float32, the route weight of each row "
                                                                              "(0 for padding rows)");
      mok::check_tensor(args->out, "out (dh)", {mokBFloat16}, {M, 2 * N}, dev);
      mok::check_tensor(args->h, "h", {mokBFloat16}, {M, 2 * N}, dev);
      mok::check_tensor(args->row_weight, "row_weight", {mokFloat32}, {M}, dev);
      if (mok::present(args->wa)) mok::check_tensor(args->wa, "wa", {mokBFloat16}, {M, N}, dev);
      if (mok::present(args->dtw_partials))
        mok::check_tensor(args->dtw_partials, "dtw_partials", {mokFloat32}, {M, (N + 127) / 128}, dev);
    } else {
      mok::check_tensor(args->out, preact ? "out (h)" : "out", {mokBFloat16}, {M, preact ? 2 * N : N}, dev);
    }
    MOK_CHECK_ARG(K % 64 == 0 && (kind != mokGemmDgradGateUp || K % 128 == 0),
                  "K = " << K << " must be a multiple of " << (kind == mokGemmDgradGateUp ? 128 : 64));
    MOK_CHECK_ARG(dev >= 0, "a is on the CPU; mokGroupedGemm runs on CUDA tensors");
    mok::cuda::GroupedGemmCall call{args->a.data, M, K, args->b0.data, two_b ? args->b1.data : args->b0.data, E, N,
                                    static_cast<const int32_t*>(args->block_expert.data), static_cast<int32_t>(blocks),
                                    args->out.data, static_cast<int32_t>(kind), static_cast<int32_t>(args->num_blocks)};
    if (swiglu_bwd) {
      call.h = args->h.data;
      call.row_weight = static_cast<const float*>(args->row_weight.data);
      call.wa = args->wa.data;
      call.dtw_partials = static_cast<float*>(args->dtw_partials.data);
    }
    mok::cuda::grouped_gemm(call, stream);
  });
}

namespace {
// mokGroupedGemmBlockScaled's dgrad down with the SwiGLU backward (fp8_block): a = dy [M, H]
// e4m3, b0 = W_down's transposed copy [E, I, H] with W_down's scales (b_transposed), out = dh
// [M, 2I] e4m3 with its scales in scales->out [2I/128, M]; h [M, 2I] bf16, row_weight [M] fp32,
// wa (here: a = silu(g)·u, bf16 [M, I]) and dtw_partials [M, I/128] optional.
void block_scaled_swiglu_bwd(const mokGroupedGemmArgs_t* args, const mokGemmBlockScales_t* scales, void* stream) {
  const int32_t dev = args->a.device;
  MOK_CHECK_ARG(args->a.ndim == 2 && args->b0.ndim == 3, "a must be [M, H] (dy) and b0 [E, I, H] (W_down transposed)");
  const int64_t M = args->a.shape[0], H = args->a.shape[1], E = args->b0.shape[0], I = args->b0.shape[1];
  MOK_CHECK_ARG(H > 0 && H % 128 == 0 && I > 0 && I % 128 == 0,
                "H = " << H << " and I = " << I << " must be positive multiples of 128 (the scales' blocks)");
  MOK_CHECK_ARG(M > 0 && M % 4 == 0, "M = " << M << " must be a positive multiple of 4 (a_scales rows, 16-byte aligned)");
  MOK_CHECK_ARG(scales->b_transposed != 0,
                "the fp8 dgrad-down kind reads W_down's transposed copy: b_transposed must be 1 (b0 = qt [E, I, H], "
                "b0_scales W_down's [E, H/128, I/128])");
  mok::check_tensor(args->a, "a (dy)", {mokFloat8E4M3}, {M, H}, dev);
  mok::check_tensor(args->b0, "b0 (W_down transposed)", {mokFloat8E4M3}, {E, I, H}, dev);
  mok::check_tensor(args->block_expert, "block_expert", {mokInt32}, {(M + 127) / 128}, dev);
  mok::check_tensor(args->out, "out (dh)", {mokFloat8E4M3}, {M, 2 * I}, dev);
  MOK_CHECK_ARG(mok::present(scales->out), "scales->out (dh's scales, [2I/128, M] float32) is required");
  mok::check_tensor(scales->out, "out_scales (dh's)", {mokFloat32}, {2 * I / 128, M}, dev);
  mok::check_tensor(scales->a, "a_scales", {mokFloat32}, {H / 128, M}, dev);
  mok::check_tensor(scales->b0, "b0_scales (b_transposed)", {mokFloat32}, {E, H / 128, I / 128}, dev);
  mok::check_tensor(args->h, "h", {mokBFloat16}, {M, 2 * I}, dev);
  mok::check_tensor(args->row_weight, "row_weight", {mokFloat32}, {M}, dev);
  if (mok::present(args->wa)) mok::check_tensor(args->wa, "wa (a)", {mokBFloat16}, {M, I}, dev);
  if (mok::present(args->dtw_partials))
    mok::check_tensor(args->dtw_partials, "dtw_partials", {mokFloat32}, {M, I / 128}, dev);
  MOK_CHECK_ARG(dev >= 0, "a is on the CPU; mokGroupedGemmBlockScaled runs on CUDA tensors");
  mok::cuda::GroupedGemmCall call{args->a.data, M, H, args->b0.data, args->b0.data, E, I,
                                  static_cast<const int32_t*>(args->block_expert.data),
                                  static_cast<int32_t>((M + 127) / 128), args->out.data,
                                  static_cast<int32_t>(mokGemmDgradDownSwiGLU), static_cast<int32_t>(args->num_blocks)};
  call.h = args->h.data;
  call.row_weight = static_cast<const float*>(args->row_weight.data);
  call.wa = mok::present(args->wa) ? args->wa.data : nullptr;
  call.dtw_partials = mok::present(args->dtw_partials) ? static_cast<float*>(args->dtw_partials.data) : nullptr;
  call.a_scales = static_cast<const float*>(scales->a.data);
  call.b0_scales = static_cast<const float*>(scales->b0.data);
  call.b1_scales = call.b0_scales;
  call.b_scales_transposed = true;
  call.out_scales = static_cast<float*>(scales->out.data);
  call.out_scales_pow2 = scales->out_pow2 != 0;
  mok::cuda::grouped_gemm(call, stream);
}

// mokGroupedGemmBlockScaled's dgrad gate/up (fp8_block's): a = dh [M, 2I] e4m3, b0 / b1 = W_gate's
// and W_up's transposed copies [E, H, I] with their own scales (b_transposed), out = dx rows [M,
// H] bf16: the gate k-blocks from b0, then the up ones from b1.
void block_scaled_dgrad_gate_up(const mokGroupedGemmArgs_t* args, const mokGemmBlockScales_t* scales, void* stream) {
  const int32_t dev = args->a.device;
  MOK_CHECK_ARG(args->a.ndim == 2 && args->b0.ndim == 3,
                "a must be [M, 2I] (dh) and b0, b1 [E, H, I] (W_gate, W_up transposed)");
  const int64_t M = args->a.shape[0], K = args->a.shape[1], E = args->b0.shape[0], H = args->b0.shape[1],
                I = args->b0.shape[2];
  MOK_CHECK_ARG(H > 0 && H % 128 == 0 && I > 0 && I % 128 == 0 && K == 2 * I,
                "a is [" << M << ", " << K << "] and b0 [" << E << ", " << H << ", " << I
                         << "]: K = 2I, and H, I positive multiples of 128");
  MOK_CHECK_ARG(M > 0 && M % 4 == 0, "M = " << M << " must be a positive multiple of 4 (a_scales rows, 16-byte aligned)");
  MOK_CHECK_ARG(scales->b_transposed != 0,
                "the fp8 dgrad gate/up kind reads the weights' transposed copies: b_transposed must be 1 (b0_scales "
                "W_gate's, b1_scales W_up's, [E, I/128, H/128])");
  mok::check_tensor(args->a, "a (dh)", {mokFloat8E4M3}, {M, K}, dev);
  mok::check_tensor(args->b0, "b0 (W_gate transposed)", {mokFloat8E4M3}, {E, H, I}, dev);
  mok::check_tensor(args->b1, "b1 (W_up transposed)", {mokFloat8E4M3}, {E, H, I}, dev);
  mok::check_tensor(args->block_expert, "block_expert", {mokInt32}, {(M + 127) / 128}, dev);
  mok::check_tensor(args->out, "out (dx rows)", {mokBFloat16}, {M, H}, dev);
  MOK_CHECK_ARG(!mok::present(scales->out), "scales->out is for an e4m3 out; dgrad gate/up writes bf16");
  mok::check_tensor(scales->a, "a_scales", {mokFloat32}, {K / 128, M}, dev);
  mok::check_tensor(scales->b0, "b0_scales (b_transposed)", {mokFloat32}, {E, I / 128, H / 128}, dev);
  mok::check_tensor(scales->b1, "b1_scales (b_transposed)", {mokFloat32}, {E, I / 128, H / 128}, dev);
  MOK_CHECK_ARG(dev >= 0, "a is on the CPU; mokGroupedGemmBlockScaled runs on CUDA tensors");
  mok::cuda::GroupedGemmCall call{args->a.data, M, K, args->b0.data, args->b1.data, E, H,
                                  static_cast<const int32_t*>(args->block_expert.data),
                                  static_cast<int32_t>((M + 127) / 128), args->out.data,
                                  static_cast<int32_t>(mokGemmDgradGateUp), static_cast<int32_t>(args->num_blocks)};
  call.a_scales = static_cast<const float*>(scales->a.data);
  call.b0_scales = static_cast<const float*>(scales->b0.data);
  call.b1_scales = static_cast<const float*>(scales->b1.data);
  call.b_scales_transposed = true;
  mok::cuda::grouped_gemm(call, stream);
}
}  // namespace

mokResult_t mokGroupedGemmBlockScaled(const mokGroupedGemmArgs_t* args, const mokGemmBlockScales_t* scales,
                                      void* stream) {
  return guarded("mokGroupedGemmBlockScaled", [&] {
    MOK_CHECK_ARG(args != nullptr && scales != nullptr, "args or scales is NULL");
    const int64_t kind = args->kind;
    MOK_CHECK_ARG(kind == mokGemmDown || kind == mokGemmGateUp || kind == mokGemmGateUpPreact ||
                      kind == mokGemmDgradDownSwiGLU || kind == mokGemmDgradGateUp,
                  "kind = " << kind << ": the block-scaled fp8 kinds are 0 (down), 1 (gate/up), 3 (dgrad gate/up), 4 "
                                       "(dgrad down with the SwiGLU backward) and 5 (gate/up pre-activations)");
    if (kind == mokGemmDgradDownSwiGLU) return block_scaled_swiglu_bwd(args, scales, stream);
    if (kind == mokGemmDgradGateUp) return block_scaled_dgrad_gate_up(args, scales, stream);
    const int32_t dev = args->a.device;
    MOK_CHECK_ARG(args->a.ndim == 2 && args->b0.ndim == 3, "a must be [M, K] and b0 [E, N, K]");
    const int64_t M = args->a.shape[0], K = args->a.shape[1], E = args->b0.shape[0], N = args->b0.shape[1];
    const int64_t blocks = (M + 127) / 128, k_blocks = K / 128, n_blocks = (N + 127) / 128;
    MOK_CHECK_ARG(K > 0 && K % 128 == 0, "K = " << K << " must be a positive multiple of 128 (the scales' blocks)");
    MOK_CHECK_ARG(N > 0 && N % 64 == 0, "N = " << N << " must be a positive multiple of 64");
    MOK_CHECK_ARG(M > 0 && M % 4 == 0, "M = " << M << " must be a positive multiple of 4 (a_scales rows, 16-byte aligned)");
    mok::check_tensor(args->a, "a", {mokFloat8E4M3}, {M, K}, dev);
    mok::check_tensor(args->b0, "b0", {mokFloat8E4M3}, {E, N, K}, dev);
    const bool two_b = kind != mokGemmDown;
    if (two_b) mok::check_tensor(args->b1, "b1", {mokFloat8E4M3}, {E, N, K}, dev);
    mok::check_tensor(args->block_expert, "block_expert", {mokInt32}, {blocks}, dev);
    const bool preact = kind == mokGemmGateUpPreact;
    // gate/up may write a quantised for the down kind: e4m3 out and its scales
    const bool quantized_out = kind == mokGemmGateUp && args->out.dtype == mokFloat8E4M3;
    if (quantized_out) {
      MOK_CHECK_ARG(N % 128 == 0, "N = " << N << " must be a multiple of 128 for an e4m3 out (a scale per 128 channels)");
      MOK_CHECK_ARG(mok::present(scales->out), "an e4m3 out needs scales->out: [N/128, M] = [" << N / 128 << ", " << M
                                                                                              << "] float32");
      mok::check_tensor(args->out, "out", {mokFloat8E4M3}, {M, N}, dev);
      mok::check_tensor(scales->out, "out_scales", {mokFloat32}, {N / 128, M}, dev);
    } else {
      MOK_CHECK_ARG(!mok::present(scales->out), "scales->out is for an e4m3 out of the gate/up kind only");
      mok::check_tensor(args->out, preact ? "out (h)" : "out", {mokBFloat16}, {M, preact ? 2 * N : N}, dev);
    }
    mok::check_tensor(scales->a, "a_scales", {mokFloat32}, {k_blocks, M}, dev);
    const bool bt = scales->b_transposed != 0;
    const std::vector<int64_t> b_scales_shape = bt ? std::vector<int64_t>{E, k_blocks, n_blocks}
                                                   : std::vector<int64_t>{E, n_blocks, k_blocks};
    mok::check_tensor(scales->b0, bt ? "b0_scales (b_transposed)" : "b0_scales", {mokFloat32}, b_scales_shape, dev);
    if (two_b)
      mok::check_tensor(scales->b1, bt ? "b1_scales (b_transposed)" : "b1_scales", {mokFloat32}, b_scales_shape, dev);
    MOK_CHECK_ARG(dev >= 0, "a is on the CPU; mokGroupedGemmBlockScaled runs on CUDA tensors");
    mok::cuda::GroupedGemmCall call{args->a.data, M, K, args->b0.data, two_b ? args->b1.data : args->b0.data, E, N,
                                    static_cast<const int32_t*>(args->block_expert.data), static_cast<int32_t>(blocks),
                                    args->out.data, static_cast<int32_t>(kind), static_cast<int32_t>(args->num_blocks)};
    call.a_scales = static_cast<const float*>(scales->a.data);
    call.b0_scales = static_cast<const float*>(scales->b0.data);
    call.b1_scales = static_cast<const float*>((two_b ? scales->b1 : scales->b0).data);
    call.b_scales_transposed = bt;
    if (quantized_out) {
      call.out_scales = static_cast<float*>(scales->out.data);
      call.out_scales_pow2 = scales->out_pow2 != 0;
    }
    mok::cuda::grouped_gemm(call, stream);
  });
}

mokResult_t mokQuantizeRowsE4m3(const mokTensor_t* x, const mokTensor_t* q, const mokTensor_t* scales, int32_t pow2,
                                void* stream) {
  return guarded("mokQuantizeRowsE4m3", [&] {
    MOK_CHECK_ARG(x != nullptr && q != nullptr && scales != nullptr, "x, q or scales is NULL");
    MOK_CHECK_ARG(x->ndim == 2, "x must be [M, K]");
    const int64_t M = x->shape[0], K = x->shape[1];
    const int32_t dev = x->device;
    MOK_CHECK_ARG(K > 0 && K % 128 == 0, "K = " << K << " must be a positive multiple of 128 (a scale per 128)");
    mok::check_tensor(*x, "x", {mokBFloat16}, {M, K}, dev);
    mok::check_tensor(*q, "q", {mokFloat8E4M3}, {M, K}, dev);
    mok::check_tensor(*scales, "scales", {mokFloat32}, {K / 128, M}, dev);
    MOK_CHECK_ARG(dev >= 0, "x is on the CPU; mokQuantizeRowsE4m3 runs on CUDA tensors (mok.fp8.quantize_rows on the CPU)");
    mok::cuda::quantize_rows(x->data, q->data, static_cast<float*>(scales->data), M, K, pow2 != 0, stream);
  });
}

namespace {
// One weight's quantisation, every view checked: w [num, rows, cols] bf16 (num 0: one [rows,
// cols] matrix; read in place) into scales and whichever of q, qt are present.  Names: `w_name`
// for w, `prefix` + "q" / "qt" / "scales" for the copies.
mok::cuda::QuantizeBlocksCall checked_blocks_call(const mokTensor_t& w, const mokTensor_t* q, const mokTensor_t* qt,
                                                  const mokTensor_t& scales, const std::string& w_name,
                                                  const std::string& prefix, int64_t num, int64_t rows, int64_t cols,
                                                  int32_t pow2) {
  MOK_CHECK_ARG(rows > 0 && cols > 0 && rows % 128 == 0 && cols % 128 == 0,
                w_name << " is [" << rows << ", " << cols << "] per matrix: fp8_block needs positive multiples of 128 "
                                                              "(whole 128 x 128 blocks)");
  const auto shape = [&](int64_t a, int64_t b) {
    return num > 0 ? std::vector<int64_t>{num, a, b} : std::vector<int64_t>{a, b};
  };
  const int32_t dev = w.device;
  const mok::ref::MatrixStrides strides = mok::check_matrices(w, w_name, {mokBFloat16}, shape(rows, cols), dev);
  const bool has_q = q != nullptr && mok::present(*q), has_qt = qt != nullptr && mok::present(*qt);
  MOK_CHECK_ARG(has_q || has_qt, prefix << "q and " << prefix << "qt both absent: nothing to quantise into");
  if (has_q) mok::check_tensor(*q, prefix + "q", {mokFloat8E4M3}, shape(rows, cols), dev);
  if (has_qt) mok::check_tensor(*qt, prefix + "qt", {mokFloat8E4M3}, shape(cols, rows), dev);
  mok::check_tensor(scales, prefix + "scales", {mokFloat32}, shape(rows / 128, cols / 128), dev);
  MOK_CHECK_ARG(dev >= 0, w_name << " is on the CPU; the fp8 weight quantiser runs on CUDA tensors (on the CPU: "
                                    "mok.fp8.quantize_blocks, and the reference quantises the weights itself)");
  return mok::cuda::QuantizeBlocksCall{w.data, num > 0 ? num : 1, rows, cols, strides, has_q ? q->data : nullptr,
                                       has_qt ? qt->data : nullptr, static_cast<float*>(scales.data), pow2 != 0};
}
}  // namespace

mokResult_t mokQuantizeWeights(const mokConfig_t* config, const mokWeights_t* weights, const mokFp8Weights_t* fp8,
                               int32_t pow2, void* stream) {
  return guarded("mokQuantizeWeights", [&] {
    MOK_CHECK_ARG(weights != nullptr && fp8 != nullptr, "weights or fp8 is NULL");
    const mokConfig_t c = mok::normalize_config(config);  // the dimensions; the views are checked below
    MOK_CHECK_ARG(c.ep_size >= 1 && c.num_experts % c.ep_size == 0,
                  "config.num_experts = " << c.num_experts << " is not a multiple of ep_size = " << c.ep_size);
    const int64_t El = c.num_experts / c.ep_size, H = c.hidden, I = c.intermediate, Is = c.shared_intermediate;
    struct One {
      const mokTensor_t& w;
      const mokFp8Weight_t& f;
      const char* name;
      int64_t num, rows, cols;  // num 0: a single matrix
    };
    const One all[] = {{weights->w_gate, fp8->w_gate, "w_gate", El, I, H},
                       {weights->w_up, fp8->w_up, "w_up", El, I, H},
                       {weights->w_down, fp8->w_down, "w_down", El, H, I},
                       {weights->ws_gate, fp8->ws_gate, "ws_gate", 0, Is, H},
                       {weights->ws_up, fp8->ws_up, "ws_up", 0, Is, H},
                       {weights->ws_down, fp8->ws_down, "ws_down", 0, H, Is}};
    std::vector<mok::cuda::QuantizeBlocksCall> calls;
    for (const One& o : all) {
      if (!mok::present(o.f.scales)) {
        MOK_CHECK_ARG(!mok::present(o.f.q) && !mok::present(o.f.qt),
                      "fp8." << o.name << ": q or qt given without scales");
        continue;
      }
      calls.push_back(checked_blocks_call(o.w, &o.f.q, &o.f.qt, o.f.scales, std::string("weights.") + o.name,
                                          std::string("fp8.") + o.name + ".", o.num, o.rows, o.cols, pow2));
    }
    // Every view checked before the first launch
    for (const auto& call : calls) mok::cuda::quantize_blocks(call, stream);
  });
}

mokResult_t mokQuantizeBlocksE4m3(const mokTensor_t* w, const mokTensor_t* q, const mokTensor_t* qt,
                                  const mokTensor_t* scales, int32_t pow2, void* stream) {
  return guarded("mokQuantizeBlocksE4m3", [&] {
    MOK_CHECK_ARG(w != nullptr && scales != nullptr, "w or scales is NULL");
    MOK_CHECK_ARG(w->ndim == 2 || w->ndim == 3, "w must be [E, R, C] or [R, C]");
    const int64_t num = w->ndim == 3 ? w->shape[0] : 0;
    mok::cuda::quantize_blocks(checked_blocks_call(*w, q, qt, *scales, "w", "", num, w->shape[w->ndim - 2],
                                                   w->shape[w->ndim - 1], pow2),
                               stream);
  });
}

mokResult_t mokGroupedWgrad(const mokGroupedWgradArgs_t* args, void* stream) {
  return guarded("mokGroupedWgrad", [&] {
    MOK_CHECK_ARG(args != nullptr, "args is NULL");
    const int32_t dev = args->a.device;
    MOK_CHECK_ARG(dev >= 0, "a is on the CPU; mokGroupedWgrad runs on CUDA tensors");
    MOK_CHECK_ARG(args->a.ndim == 2 && args->b.ndim == 2, "a must be [R, Mo] and b [R, No]");
    MOK_CHECK_ARG(args->expert_count.ndim == 1, "expert_count must be [E]");
    const int64_t R = args->a.shape[0], Mo = args->a.shape[1], No = args->b.shape[1], E = args->expert_count.shape[0];
    mok::check_tensor(args->a, "a", {mokBFloat16}, {R, Mo}, dev);
    mok::check_tensor(args->b, "b", {mokBFloat16}, {R, No}, dev);
    mok::check_tensor(args->expert_offset, "expert_offset", {mokInt32}, {E + 1}, dev);
    mok::check_tensor(args->expert_count, "expert_count", {mokInt32}, {E}, dev);
    check_wgrad_outputs(*args, E, Mo, No, dev);
    MOK_CHECK_ARG(Mo > 0 && Mo % 64 == 0, "Mo = a.shape[1] = " << Mo << " must be a positive multiple of 64");
    MOK_CHECK_ARG(No > 0 && No % 64 == 0, "No = b.shape[1] = " << No << " must be a positive multiple of 64");
    mok::cuda::grouped_wgrad(
        mok::cuda::GroupedWgradCall{args->a.data, args->b.data, R, Mo, No, E,
                                    static_cast<const int32_t*>(args->expert_offset.data),
                                    static_cast<const int32_t*>(args->expert_count.data), args->out.data,
                                    static_cast<float*>(args->acc.data), static_cast<float*>(args->main_grad.data),
                                    args->accumulate != 0, args->store_acc != 0,
                                    static_cast<int32_t>(args->num_blocks)},
        stream);
  });
}

mokResult_t mokGroupedWgradBlockScaled(const mokGroupedWgradBlockScaledArgs_t* args, void* stream) {
  return guarded("mokGroupedWgradBlockScaled", [&] {
    MOK_CHECK_ARG(args != nullptr, "args is NULL");
    const int32_t dev = args->a.device;
    MOK_CHECK_ARG(args->a.ndim == 2 && args->b.ndim == 2, "a must be [Mo, R] and b [No, R] (transposed operands)");
    MOK_CHECK_ARG(args->expert_count.ndim == 1, "expert_count must be [E]");
    const int64_t Mo = args->a.shape[0], R = args->a.shape[1], No = args->b.shape[0], E = args->expert_count.shape[0];
    MOK_CHECK_ARG(Mo > 0 && Mo % 128 == 0, "Mo = a.shape[0] = " << Mo << " must be a positive multiple of 128");
    MOK_CHECK_ARG(No > 0 && No % 128 == 0, "No = b.shape[0] = " << No << " must be a positive multiple of 128");
    MOK_CHECK_ARG(R % 128 == 0, "R = a.shape[1] = " << R << " rows must be a multiple of 128 (k-blocks of 128 rows)");
    mok::check_tensor(args->a, "a", {mokFloat8E4M3}, {Mo, R}, dev);
    mok::check_tensor(args->b, "b", {mokFloat8E4M3}, {No, R}, dev);
    mok::check_tensor(args->a_scales, "a_scales", {mokFloat32}, {R / 128, Mo}, dev);
    mok::check_tensor(args->b_scales, "b_scales", {mokFloat32}, {R / 128, No}, dev);
    mok::check_tensor(args->expert_offset, "expert_offset", {mokInt32}, {E + 1}, dev);
    mok::check_tensor(args->expert_count, "expert_count", {mokInt32}, {E}, dev);
    check_wgrad_outputs(*args, E, Mo, No, dev);
    MOK_CHECK_ARG(dev >= 0, "a is on the CPU; mokGroupedWgradBlockScaled runs on CUDA tensors");
    mok::cuda::grouped_wgrad_fp8(
        mok::cuda::GroupedWgradFp8Call{args->a.data, args->b.data, static_cast<const float*>(args->a_scales.data),
                                       static_cast<const float*>(args->b_scales.data), R, Mo, No, E,
                                       static_cast<const int32_t*>(args->expert_offset.data),
                                       static_cast<const int32_t*>(args->expert_count.data), args->out.data,
                                       static_cast<float*>(args->acc.data), static_cast<float*>(args->main_grad.data),
                                       args->accumulate != 0, args->store_acc != 0,
                                       static_cast<int32_t>(args->num_blocks)},
        stream);
  });
}

mokResult_t mokQuantizeColsE4m3(const mokTensor_t* v, const mokTensor_t* qt, const mokTensor_t* scales, int32_t pow2,
                                void* stream) {
  return guarded("mokQuantizeColsE4m3", [&] {
    MOK_CHECK_ARG(v != nullptr && qt != nullptr && scales != nullptr, "v, qt or scales is NULL");
    MOK_CHECK_ARG(v->ndim == 2, "v must be [R, C]");
    const int64_t R = v->shape[0], C = v->shape[1];
    const int32_t dev = v->device;
    MOK_CHECK_ARG(R > 0 && C > 0 && R % 128 == 0 && C % 128 == 0,
                  "v is [" << R << ", " << C << "]: both must be positive multiples of 128 (scales per 128 rows)");
    mok::check_tensor(*v, "v", {mokBFloat16}, {R, C}, dev);
    mok::check_tensor(*qt, "qt", {mokFloat8E4M3}, {C, R}, dev);
    mok::check_tensor(*scales, "scales", {mokFloat32}, {R / 128, C}, dev);
    MOK_CHECK_ARG(dev >= 0, "v is on the CPU; mokQuantizeColsE4m3 runs on CUDA tensors (mok.fp8.quantize_cols on the CPU)");
    mok::cuda::quantize_cols(v->data, R, C, qt->data, static_cast<float*>(scales->data), pow2 != 0, stream);
  });
}

mokResult_t mokPlanGetCapacity(const mokConfig_t* config, mokPlanCapacity_t* capacity) {
  return guarded("mokPlanGetCapacity", [&] {
    MOK_CHECK_ARG(capacity != nullptr, "capacity out-pointer is NULL");
    const mokConfig_t c = mok::normalize_config(config);
    const std::string why = mok::plan::check_plan_dims(mok::plan_dims(c));
    MOK_CHECK_ARG(why.empty(), "config: " << why);
    const auto d = mok::plan_dims(c);
    *capacity = mokPlanCapacity_t{mok::plan::max_rows(d), mok::plan::max_blocks(d), d.local_experts()};
  });
}

mokResult_t mokPlanBuild(const mokConfig_t* config, const mokPlanArgs_t* args, void* stream) {
  return guarded("mokPlanBuild", [&] {
    const mokConfig_t c = mok::normalize_config(config);
    const auto d = mok::plan_dims(c);
    const std::string why = mok::plan::check_plan_dims(d);
    MOK_CHECK_ARG(why.empty(), "config: " << why);
    MOK_CHECK_ARG(args != nullptr && args->topk_ids != nullptr, "plan args or args->topk_ids is NULL");
    MOK_CHECK_ARG(args->num_ranks == c.ep_size,
                  "plan args hold " << args->num_ranks << " ranks' topk_ids, config.ep_size = " << c.ep_size);
    const int32_t device = args->topk_ids[0].device;
    mok::plan::RoutingView v;
    v.num_ranks = d.num_ranks;
    v.topk = d.topk;
    v.num_experts = d.num_experts;
    v.ids_are_int64 = args->topk_ids[0].dtype == mokInt64;
    for (int s = 0; s < d.num_ranks; ++s) {
      const mokTensor_t& ids = args->topk_ids[s];
      const std::string who = "rank " + std::to_string(s) + " topk_ids";
      const int64_t T = mok::leading_dim(ids, who);
      MOK_CHECK_ARG(T <= c.max_tokens, who << " has " << T << " tokens > max_tokens = " << c.max_tokens);
      mok::check_tensor(ids, who, {v.ids_are_int64 ? int32_t{mokInt64} : int32_t{mokInt32}}, {T, c.topk}, device);
      v.ids[s] = ids.data;
      v.num_tokens[s] = T;
    }
    const int64_t El = d.local_experts();
    mok::check_tensor(args->rows, "plan rows", {mokInt32}, {mok::plan::max_rows(d)}, device);
    mok::check_tensor(args->expert_count, "plan expert_count", {mokInt32}, {El}, device);
    mok::check_tensor(args->expert_offset, "plan expert_offset", {mokInt32}, {El + 1}, device);
    mok::check_tensor(args->block_expert, "plan block_expert", {mokInt32}, {mok::plan::max_blocks(d)}, device);
    mok::check_tensor(args->error, "plan error", {mokInt64}, {mok::kErrorWords}, device);
    const mok::plan::PlanView out{static_cast<uint32_t*>(args->rows.data), static_cast<int32_t*>(args->expert_count.data),
                                  static_cast<int32_t*>(args->expert_offset.data),
                                  static_cast<int32_t*>(args->block_expert.data)};
    auto* err = static_cast<int64_t*>(args->error.data);
    if (device >= 0) {
      mok::cuda::build_plan(d, v, out, err, device, stream);
      return;
    }
    for (int s = 0; s < d.num_ranks; ++s) mok::check_ids_host(v, s, "rank " + std::to_string(s) + ": ");
    mok::plan::RouteError e;
    mok::plan::build_plan_host(d, v, out, &e);
    err[0] = e.key;
    err[1] = e.id;
    err[2] = static_cast<int64_t>(e.kind);
    err[3] = 0;
  });
}

mokResult_t mokForward(mokWorkspace_t workspace, const mokForwardArgs_t* args, void* stream) {
  return guarded("mokForward", [&] {
    mok::Workspace& ws = workspace_of(workspace);
    if (args != nullptr && args->x.device >= 0) {
      run_forward_cuda(ws, args, stream);
      return;
    }
    MOK_CHECK_ARG(ws.config.device < 0, "x is on the cpu but the workspace was created for "
                                            << mok::device_str(static_cast<int32_t>(ws.config.device)));
    MOK_CHECK_ARG(ws.config.ep_size == 1,
                  "the workspace has ep_size = " << ws.config.ep_size
                                                 << "; EP > 1 on the CPU runs through mokForwardEmulated");
    run_forward(ws.config, args, 1, "mokForward");
  });
}

mokResult_t mokBackward(mokWorkspace_t workspace, const mokBackwardArgs_t* args, void* stream) {
  return guarded("mokBackward", [&] {
    mok::Workspace& ws = workspace_of(workspace);
    if (args != nullptr && args->fwd.x.device >= 0) {
      run_backward_cuda(ws, args, stream, nullptr);  // every check before any launch
      return;
    }
    MOK_CHECK_ARG(args == nullptr || args->fwd.x.device >= 0 || ws.config.device < 0,
                  "x is on the cpu but the workspace was created for "
                      << mok::device_str(static_cast<int32_t>(ws.config.device)));
    MOK_CHECK_ARG(ws.config.ep_size == 1,
                  "the workspace has ep_size = " << ws.config.ep_size
                                                 << "; EP > 1 on the CPU runs through mokBackwardEmulated");
    run_backward(ws.config, args, 1, "mokBackward");
  });
}

mokResult_t mokForwardSave(mokWorkspace_t workspace, const mokForwardArgs_t* args, const mokSaved_t* saved,
                           void* stream) {
  return guarded("mokForwardSave", [&] {
    mok::Workspace& ws = workspace_of(workspace);
    MOK_CHECK_ARG(args != nullptr && args->x.device >= 0 && ws.config.device >= 0,
                  "mokForwardSave runs on CUDA tensors with a CUDA workspace (the CPU backend saves nothing: "
                  "use mokForward)");
    run_forward_cuda(ws, args, stream, saved);
  });
}

mokResult_t mokBackwardSaved(mokWorkspace_t workspace, const mokBackwardArgs_t* args, const mokSaved_t* saved,
                             void* stream) {
  return guarded("mokBackwardSaved", [&] {
    mok::Workspace& ws = workspace_of(workspace);
    MOK_CHECK_ARG(args != nullptr && args->fwd.x.device >= 0 && ws.config.device >= 0,
                  "mokBackwardSaved runs on CUDA tensors with a CUDA workspace (use mokBackward on the CPU)");
    run_backward_cuda(ws, args, stream, saved);
  });
}

namespace {
// Entry r of a group issued from one process: rank r of a group of num_ranks.
mok::Workspace& group_rank(const mokWorkspace_t* workspaces, int64_t r, int64_t num_ranks, const std::string& tag) {
  mok::Workspace& ws = workspace_of(workspaces[r]);
  MOK_CHECK_ARG(ws.config.ep_rank == r && ws.config.ep_size == num_ranks,
                tag << "workspace of rank " << ws.config.ep_rank << " of " << ws.config.ep_size
                    << "; entry r must be rank r of a group of num_ranks");
  return ws;
}
}  // namespace

mokResult_t mokForwardGroup(const mokWorkspace_t* workspaces, const mokForwardArgs_t* args, int64_t num_ranks,
                            void* const* streams) {
  return guarded("mokForwardGroup", [&] {
    MOK_CHECK_ARG(workspaces != nullptr && args != nullptr && streams != nullptr && num_ranks >= 1,
                  "mokForwardGroup: workspaces, args and streams must hold num_ranks = " << num_ranks << " entries");
    // Every rank checked before any is issued: a rank that fails later would leave its peers
    // waiting until timeout_s.
    std::vector<mok::ref::RankInputs> in;
    for (int64_t r = 0; r < num_ranks; ++r) {
      const std::string tag = "rank " + std::to_string(r) + ": ";
      in.push_back(check_forward_cuda(group_rank(workspaces, r, num_ranks, tag), &args[r], tag));
    }
    for (auto phase : {mok::cuda::ForwardPhase::kStart, mok::cuda::ForwardPhase::kPlan,
                       mok::cuda::ForwardPhase::kLayer})
      for (int64_t r = 0; r < num_ranks; ++r)
        mok::cuda::forward_phase(*workspace_of(workspaces[r]).device, workspace_of(workspaces[r]).config,
                                 in[static_cast<size_t>(r)], args[r].y.data, streams[r], phase);
  });
}

mokResult_t mokBackwardGroup(const mokWorkspace_t* workspaces, const mokBackwardArgs_t* args, const mokSaved_t* saved,
                             int64_t num_ranks, void* const* streams) {
  return guarded("mokBackwardGroup", [&] {
    MOK_CHECK_ARG(workspaces != nullptr && args != nullptr && streams != nullptr && num_ranks >= 1,
                  "mokBackwardGroup: workspaces, args and streams must hold num_ranks = " << num_ranks << " entries");
    std::vector<mok::ref::RankInputs> in;
    std::vector<mok::ref::RankGrads> grads;
    std::vector<mok::cuda::Saved> sv;
    for (int64_t r = 0; r < num_ranks; ++r) {
      const std::string tag = "rank " + std::to_string(r) + ": ";
      mok::Workspace& ws = group_rank(workspaces, r, num_ranks, tag);
      in.push_back(check_forward_cuda(ws, &args[r].fwd, tag, false));
      grads.push_back(mok::check_backward_args(ws.config, args[r], static_cast<int32_t>(ws.config.device), tag));
      sv.push_back(saved ? check_saved(ws, &saved[r], in.back().num_tokens) : mok::cuda::Saved{});
    }
    // Every rank's buffers before any rank is issued (cuda_api.hpp, prepare_backward)
    for (int64_t r = 0; r < num_ranks; ++r)
      mok::cuda::prepare_backward(*workspace_of(workspaces[r]).device, workspace_of(workspaces[r]).config);
    for (auto phase : {mok::cuda::ForwardPhase::kStart, mok::cuda::ForwardPhase::kPlan,
                       mok::cuda::ForwardPhase::kLayer})
      for (int64_t r = 0; r < num_ranks; ++r) {
        const size_t i = static_cast<size_t>(r);
        mok::cuda::backward_phase(*workspace_of(workspaces[r]).device, workspace_of(workspaces[r]).config, in[i],
                                  grads[i], args[r].dy.data, streams[r], phase, sv[i]);
      }
  });
}

mokResult_t mokForwardEmulated(const mokConfig_t* config, const mokForwardArgs_t* args, int64_t ep_size) {
  return guarded("mokForwardEmulated", [&] { run_forward(emulated_config(config, ep_size), args, ep_size, "mokForwardEmulated"); });
}

mokResult_t mokBackwardEmulated(const mokConfig_t* config, const mokBackwardArgs_t* args, int64_t ep_size) {
  return guarded("mokBackwardEmulated",
                 [&] { run_backward(emulated_config(config, ep_size), args, ep_size, "mokBackwardEmulated"); });
}

}  // extern "C"
