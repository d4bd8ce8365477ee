#include "runtime/layer.hpp"

#include <algorithm>
#include <cstring>
#include <iomanip>
#include <sstream>

#include "common/symmetric.hpp"
#include "common/workspace_layout.hpp"
#include "cuda/cuda_api.hpp"
#include "runtime/env.hpp"
#include "runtime/errors.hpp"
#include "runtime/tensor.hpp"

namespace mok {

plan::BatchRule batch_rule(const mokConfig_t& c) {
  plan::BatchRule r;
  const int64_t gate_up = (c.intermediate + 127) / 128, down = (c.hidden + 255) / 256;
  r.gemm_tiles_per_block = std::max<int64_t>(1, std::min(gate_up, down));
  // The fused kernel's grid: config.num_blocks, else the device's SM count
  r.grid = c.num_blocks > 0 ? c.num_blocks : c.device >= 0 ? cuda::sm_count(static_cast<int>(c.device)) : 0;
  if (r.grid <= 0) r.grid = plan::kNominalGrid;
  return r;
}

mokConfig_t normalize_config(const mokConfig_t* config) {
  if (config == nullptr) MOK_FAIL(mokInvalidUsage, "config is NULL");
  mokConfig_t out = MOK_CONFIG_INITIALIZER;
  MOK_CHECK_ARG(config->size >= 2 * sizeof(uint64_t) && config->version >= 1,
                "config.size = " << config->size << ", config.version = " << config->version
                                 << ": start from MOK_CONFIG_INITIALIZER");
  const size_t n = std::min<size_t>(config->size, sizeof(mokConfig_t));
  std::memcpy(&out, config, n);
  out.size = sizeof(mokConfig_t);
  out.version = MOK_CONFIG_VERSION;
  // minibatch_size / macrobatch_size = 0: chosen from the shape (plan::resolve_batch_sizes);
  // every entry point sees the resolved values, and mokWorkspaceGetConfig returns them.
  plan::PlanDims d = plan_dims(out);
  plan::resolve_batch_sizes(d, batch_rule(out));
  out.minibatch_size = d.minibatch_size;
  out.macrobatch_size = d.macrobatch_size;
  return out;
}

plan::PlanDims plan_dims(const mokConfig_t& c) { return plan::plan_dims_of(c); }

ref::LayerDims layer_dims(const mokConfig_t& c) {
  ref::LayerDims d;
  d.hidden = c.hidden;
  d.intermediate = c.intermediate;
  d.shared_intermediate = c.shared_intermediate;
  d.num_experts = c.num_experts;
  d.topk = c.topk;
  d.ep_size = c.ep_size;
  d.fp8_block = c.precision == mokPrecisionFP8Block;
  d.fp8_pow2 = d.fp8_block && c.fp8_pow2_scales != 0;
  return d;
}

void check_config(const mokConfig_t& c) {
  MOK_CHECK_ARG(c.hidden > 0, "config.hidden = " << c.hidden << " must be positive");
  MOK_CHECK_ARG(c.intermediate > 0, "config.intermediate = " << c.intermediate << " must be positive");
  MOK_CHECK_ARG(c.shared_intermediate >= 0,
                "config.shared_intermediate = " << c.shared_intermediate << " must be >= 0 (0 = none)");
  MOK_CHECK_ARG(c.ep_size >= 1 && c.ep_size <= kMaxRanks && c.ep_rank >= 0 && c.ep_rank < c.ep_size,
                "config.ep_size = " << c.ep_size << ", ep_rank = " << c.ep_rank);
  MOK_CHECK_ARG(c.precision == mokPrecisionBF16 || c.precision == mokPrecisionFP8Block,
                "config.precision = " << c.precision << ": bf16 (0) and fp8_block (2) are implemented, not mxfp8 (1)");
  if (c.precision == mokPrecisionFP8Block) {
    MOK_CHECK_ARG(c.hidden % 128 == 0 && c.intermediate % 128 == 0 && c.shared_intermediate % 128 == 0,
                  "config.precision = fp8_block (2): hidden = " << c.hidden << ", intermediate = " << c.intermediate
                                                                << " and shared_intermediate = " << c.shared_intermediate
                                                                << " must be multiples of 128 (the scales' blocks)");
  }
  MOK_CHECK_ARG(c.fp8_pow2_scales == 0 || c.fp8_pow2_scales == 1,
                "config.fp8_pow2_scales = " << c.fp8_pow2_scales << " must be 0 (fp32 scales) or 1 (powers of two)");
  MOK_CHECK_ARG(c.fp8_pow2_scales == 0 || c.precision == mokPrecisionFP8Block,
                "config.fp8_pow2_scales = 1 is an option of precision fp8_block (2), not of precision " << c.precision);
  MOK_CHECK_ARG(c.timeout_s > 0, "config.timeout_s = " << c.timeout_s << " must be positive");
  MOK_CHECK_ARG(c.fwd_num_comm_sms >= 0 && c.bwd_num_comm_sms >= 0, "num_comm_sms must be >= 0");
  MOK_CHECK_ARG(c.num_blocks >= 0, "config.num_blocks = " << c.num_blocks << " must be >= 0 (0 = one block per SM)");
  MOK_CHECK_ARG(c.schedule_capacity_multiplier > 0, "schedule_capacity_multiplier must be positive");
  const std::string why = plan::check_plan_dims(plan_dims(c));
  MOK_CHECK_ARG(why.empty(), "config: " << why);
  MOK_CHECK_ARG(plan::max_rows(plan_dims(c)) < (int64_t{1} << 31),
                "config: the plan of " << plan::max_rows(plan_dims(c))
                                       << " rows does not fit 32-bit offsets; lower max_tokens");
}

namespace {

// "formula = the numbers = count x element bytes = bytes B" of one layout entry.
std::string describe_entry(const WorkspaceLayout& L, WsBuffer id) {
  const WsEntry& e = L[id];
  std::ostringstream os, numbers;
  for (int i = 0; i < e.nf; ++i) numbers << (i ? "*" : "") << e.f[i];
  if (e.nf == 0) numbers << e.add;
  else if (e.add != 0) numbers << " + " << e.add;
  os << std::left << std::setw(18) << ws_name(id) << " " << std::setw(5) << ws_type_name(id) << " " << e.formula;
  if (id == WsBuffer::kTrace && L.options.num_sms == 0) {
    os << " x " << ws_element_bytes(id) << " B (num_sms: at creation)";
  } else {
    if (numbers.str() != e.formula) os << " = " << numbers.str();
    if (numbers.str() != std::to_string(e.count)) os << " = " << e.count;
    os << " x " << ws_element_bytes(id) << " B = " << e.bytes << " B";
  }
  if (e.place == WsPlace::kAlias) os << ", the bytes of " << ws_name(e.alias);
  if (e.note[0] != '\0') os << "  # " << e.note;
  return os.str();
}

// The entries of one place (and direction), one a line; block entries with their offsets.
void describe_entries(std::ostringstream& os, const WorkspaceLayout& L, bool backward, WsPlace place) {
  for (int i = 0; i < kNumWsBuffers; ++i) {
    const WsBuffer id = static_cast<WsBuffer>(i);
    const WsEntry& e = L[id];
    if (e.place != place || ws_is_backward(id) != backward) continue;
    // An alias shows where its target lives
    const WsPlace where = place == WsPlace::kAlias ? L[e.alias].place : place;
    os << "    ";
    if (where == WsPlace::kBlock)
      os << std::left << std::setw(13) << "@" + std::to_string(e.offset) << " ";
    else if (where == WsPlace::kSymmetric)
      os << std::left << std::setw(13) << (e.offset >= 0 ? "sym@" + std::to_string(e.offset) : "sym(planned)") << " ";
    os << describe_entry(L, id) << "\n";
  }
}

}  // namespace

std::string describe_buffers(const mokConfig_t& c) {
  const plan::PlanDims d = plan_dims(c);
  const int64_t El = d.local_experts(), rows = plan::max_rows(d), blocks = plan::max_blocks(d);
  std::ostringstream os;
  os << "mok workspace: H=" << c.hidden << " I=" << c.intermediate << " I_s=" << c.shared_intermediate
     << " E=" << c.num_experts << " k=" << c.topk << " P=" << c.ep_size << " rank=" << c.ep_rank
     << " T_max=" << c.max_tokens << " block_m=" << c.block_m << " on " << device_str(static_cast<int32_t>(c.device))
     << "\n"
     << "  plan.rows          = P*T_max*min(k,E_l) + E_l*(block_m-1), rounded down to block_m\n"
     << "                     = " << c.ep_size << "*" << c.max_tokens << "*" << std::min<int64_t>(c.topk, El) << " + "
     << El << "*" << (c.block_m - 1) << " -> " << rows << " rows x 4 B = " << rows * 4 << " B\n";
  const std::string batches = [&] {
    std::ostringstream b;
    b << "  minibatch_size     = " << c.minibatch_size << " rows, macrobatch_size = " << c.macrobatch_size
      << " rows (0 in the config: chosen by mok; at most " << plan::kMaxMinibatches << " minibatches per call)\n";
    return b.str();
  }();
  const auto describe_symmetric = [&] {
    if (c.ep_size <= 1) return;
    const SymLayout l = sym_layout(c.ep_size, c.max_tokens, c.topk, c.hidden);
    os << "  symmetric region (per rank, same map on every rank; mokSymmetricBytes) = " << l.bytes << " B:\n"
       << "    flags_start, flags_end, tokens = 3 x 64 x 8 B (1 KB aligned each)\n"
       << "    routing = P*align1K(T_max*k*8) = " << c.ep_size << "*" << l.routing_rank_stride << " B\n"
       << "    x       = T_max*H*2 = " << c.max_tokens * c.hidden * 2
       << " B (fp8_block's forward: x quantised per token, T_max*H e4m3 then [H/128, T_max] f32 scales)\n"
       << "    slots   = T_max*k*H*2 = " << c.max_tokens * c.topk * c.hidden * 2 << " B (backward: dx rows)\n"
       << "    dy      = T_max*H*2 = " << c.max_tokens * c.hidden * 2 << " B (backward)\n"
       << "    weights, dtw = 2 x T_max*k*4 = " << 2 * c.max_tokens * c.topk * 4 << " B (backward)\n";
  };
  if (c.device < 0) {
    // The CPU reference allocates per call; the GPU's ring is shown for comparison.
    os << "  plan.block_expert  = rows/block_m = " << blocks << " x 4 B = " << blocks * 4 << " B\n"
       << "  plan.expert_count  = E_l = " << El << " x 4 B; expert_offset = E_l+1 x 4 B\n"
       << batches << "  ring               = macrobatch_size*H*2 B = " << c.macrobatch_size << "*" << c.hidden
       << "*2 = " << c.macrobatch_size * c.hidden * 2 << " B (GPU backend)\n"
       << "  error record       = 4 x 8 B\n";
    describe_symmetric();
    os << "  backend: CPU reference (buffers are allocated per call)\n";
    return os.str();
  }

  // CUDA: the workspace's layout (common/workspace_layout.hpp), the one create_workspace
  // allocates; the backward's entries from the layout with_backward.
  WorkspaceOptions options;
  options.trace_cap = env::get_int(env::kTrace) != 0 ? kWsTraceCap : 0;
  const WorkspaceLayout L = workspace_layout(c, options);
  options.with_backward = true;
  const WorkspaceLayout B = workspace_layout(c, options);
  os << batches << "  sizes: max_rows = " << L.max_rows << ", max_blocks = max_rows/block_m = " << L.max_blocks
     << ", ring_rows = min(macrobatch_size, max_rows) = " << L.ring_rows << ",\n"
     << "         shared_blocks = ceil(T_max/block_m) = " << L.shared_blocks
     << ", n_macro = ceil(max_rows/macrobatch_size) = " << L.n_macro << ", n_acc = min(E_l, n_macro-1) = " << L.n_acc
     << ", i_chunks = ceil(I/128) = " << L.i_chunks << "\n"
     << "  device block: one allocation; offsets from a 1 KB aligned base, " << kWsAlign << " B aligned, "
     << kWsTmaAlign << " B for TMA operands and bulk-copy targets:\n";
  describe_entries(os, L, false, WsPlace::kBlock);
  os << "  forward total      = " << L.total_bytes() << " B\n";
  os << "  separate allocations:\n";
  describe_entries(os, L, false, WsPlace::kSeparate);
  if (c.ep_size > 1) {
    os << "  in this rank's symmetric region:\n";
    describe_entries(os, L, false, WsPlace::kSymmetric);
  }
  os << "  the fused backward's (laid out with_backward; not allocated yet: planned, docs/design.md):\n";
  describe_entries(os, B, true, WsPlace::kBlock);
  describe_entries(os, B, true, WsPlace::kAlias);
  describe_entries(os, B, true, WsPlace::kSymmetric);
  os << "  total with backward = " << B.total_bytes() << " B (+" << B.total_bytes() - L.total_bytes() << " B)\n";
  describe_symmetric();
  return os.str();
}

void check_ids_host(const plan::RoutingView& v, int s, const std::string& tag) {
  for (int64_t t = 0; t < v.num_tokens[s]; ++t)
    for (int j = 0; j < v.topk; ++j) {
      int64_t id = 0;
      switch (plan::check_route(v, s, t, j, &id)) {
        case RouteCheck::kOutOfRange:
          MOK_FAIL(mokInvalidArgument, tag << "topk_ids[" << t << ", " << j << "] = " << id
                                           << " is outside [-1, " << v.num_experts << ")");
        case RouteCheck::kDuplicate: {
          int first = 0;
          while (plan::load_id(v, s, t, first) != id) ++first;
          MOK_FAIL(mokInvalidArgument, tag << "topk_ids[" << t << ", " << j << "] = " << id << " duplicates topk_ids["
                                           << t << ", " << first << "]: a token selects an expert at most once");
        }
        default: break;
      }
    }
}

namespace {

const char* orientation(const ref::MatrixStrides& s) { return s.col_major() ? "column-major" : "row-major"; }

// The six weights (or their gradients, main_grads) in place; returns their strides.
ref::WeightStrides check_weights(const mokConfig_t& c, const mokWeights_t& w, int32_t device, const std::string& who,
                                 std::initializer_list<int32_t> dtypes, bool require_routed) {
  const int64_t El = c.num_experts / c.ep_size, H = c.hidden, I = c.intermediate, Is = c.shared_intermediate;
  ref::WeightStrides s;
  auto check = [&](const mokTensor_t& t, const char* name, std::vector<int64_t> shape, ref::MatrixStrides* out) {
    if (require_routed || present(t)) *out = check_matrices(t, who + name, dtypes, shape, device);
  };
  check(w.w_gate, "w_gate", {El, I, H}, &s.w_gate);
  check(w.w_up, "w_up", {El, I, H}, &s.w_up);
  check(w.w_down, "w_down", {El, H, I}, &s.w_down);
  if (Is > 0) {
    check(w.ws_gate, "ws_gate", {Is, H}, &s.ws_gate);
    check(w.ws_up, "ws_up", {Is, H}, &s.ws_up);
    check(w.ws_down, "ws_down", {H, Is}, &s.ws_down);
  } else {
    MOK_CHECK_ARG(!present(w.ws_gate) && !present(w.ws_up) && !present(w.ws_down),
                  who << "ws_gate/ws_up/ws_down given but config.shared_intermediate = 0");
  }
  // Gate and up are read (and their gradients written) through one row index per tile
  auto same = [&](const ref::MatrixStrides& a, const ref::MatrixStrides& b, const mokTensor_t& ta,
                  const mokTensor_t& tb, const char* na, const char* nb) {
    if (!present(ta) || !present(tb)) return;
    MOK_CHECK_ARG(a.expert == b.expert && a.row == b.row && a.col == b.col,
                  who << nb << " has strides " << shape_str(tb.strides, tb.ndim) << " but " << who << na << " has "
                      << shape_str(ta.strides, ta.ndim) << ": mok reads gate and up through one row index, so they "
                      << "must share strides (e.g. both halves of one fused [E, 2I, H] tensor, or of one transposed "
                      << "[E, H, 2I] tensor's .transpose(1, 2) view)");
  };
  same(s.w_gate, s.w_up, w.w_gate, w.w_up, "w_gate", "w_up");
  same(s.ws_gate, s.ws_up, w.ws_gate, w.ws_up, "ws_gate", "ws_up");
  if (device < 0) return s;  // the CPU reference reads both orientations everywhere

  // The CUDA rules, each on the views as given
  struct Named {
    const mokTensor_t& t;
    const ref::MatrixStrides& s;
    const char* name;
  };
  auto describe = [&](const Named& m) {
    return who + m.name + " is " + orientation(m.s) + " (strides " + shape_str(m.t.strides, m.t.ndim) + ")";
  };
  const Named shared[] = {{w.ws_gate, s.ws_gate, "ws_gate"}, {w.ws_up, s.ws_up, "ws_up"},
                          {w.ws_down, s.ws_down, "ws_down"}};
  for (const Named& m : shared)
    MOK_CHECK_ARG(!present(m.t) || !m.s.col_major(),
                  describe(m) << ": on CUDA the shared expert's weights must be row-major");
  // One orientation for the routed weights: the kernels are instantiated per orientation
  const Named routed[] = {{w.w_gate, s.w_gate, "w_gate"}, {w.w_up, s.w_up, "w_up"}, {w.w_down, s.w_down, "w_down"}};
  const Named* first = nullptr;
  for (const Named& m : routed) {
    if (!present(m.t)) continue;
    if (first == nullptr) first = &m;
    MOK_CHECK_ARG(m.s.col_major() == first->s.col_major(),
                  describe(*first) << " but " << describe(m) << ": on CUDA w_gate, w_up and w_down must be all "
                                   << "row-major or all column-major (the kernels are instantiated per orientation)");
  }
  return s;
}

}  // namespace

ref::RankInputs check_forward_args(const mokConfig_t& c, const mokForwardArgs_t& a, int32_t device,
                                   const std::string& tag, bool check_y) {
  const int64_t H = c.hidden, k = c.topk;
  const int64_t T = leading_dim(a.x, tag + "x");
  MOK_CHECK_ARG(T <= c.max_tokens, tag << "x has " << T << " tokens but the workspace was built for max_tokens = "
                                       << c.max_tokens);
  check_tensor(a.x, tag + "x", {mokBFloat16}, {T, H}, device);
  check_tensor(a.topk_ids, tag + "topk_ids", {mokInt32, mokInt64}, {T, k}, device);
  check_tensor(a.topk_weights, tag + "topk_weights", {mokFloat32}, {T, k}, device);
  if (check_y) check_tensor(a.y, tag + "y", {mokBFloat16}, {T, H}, device);
  const ref::WeightStrides strides = check_weights(c, a.weights, device, tag, {mokBFloat16}, true);
  ref::RankInputs in;
  in.strides = strides;
  in.num_tokens = T;
  in.x = static_cast<const bf16_t*>(a.x.data);
  in.topk_ids = a.topk_ids.data;
  in.ids_are_int64 = a.topk_ids.dtype == mokInt64;
  in.topk_weights = static_cast<const float*>(a.topk_weights.data);
  in.w_gate = static_cast<const bf16_t*>(a.weights.w_gate.data);
  in.w_up = static_cast<const bf16_t*>(a.weights.w_up.data);
  in.w_down = static_cast<const bf16_t*>(a.weights.w_down.data);
  in.ws_gate = static_cast<const bf16_t*>(a.weights.ws_gate.data);
  in.ws_up = static_cast<const bf16_t*>(a.weights.ws_up.data);
  in.ws_down = static_cast<const bf16_t*>(a.weights.ws_down.data);
  if (device >= 0 && c.precision == mokPrecisionFP8Block) {
    // The e4m3 copies the CUDA layer reads (mokQuantizeWeights), q and scales of each weight
    const int64_t El = c.num_experts / c.ep_size, I = c.intermediate, Is = c.shared_intermediate;
    struct One {
      const mokFp8Weight_t& f;
      const char* name;
      std::vector<int64_t> q, s;
    };
    const One all[] = {{a.fp8.w_gate, "w_gate", {El, I, H}, {El, I / 128, H / 128}},
                       {a.fp8.w_up, "w_up", {El, I, H}, {El, I / 128, H / 128}},
                       {a.fp8.w_down, "w_down", {El, H, I}, {El, H / 128, I / 128}},
                       {a.fp8.ws_gate, "ws_gate", {Is, H}, {Is / 128, H / 128}},
                       {a.fp8.ws_up, "ws_up", {Is, H}, {Is / 128, H / 128}},
                       {a.fp8.ws_down, "ws_down", {H, Is}, {H / 128, Is / 128}}};
    for (int i = 0; i < 6; ++i) {
      const One& o = all[i];
      const std::string who = tag + "fp8." + o.name;
      if (i >= 3 && Is == 0) {
        MOK_CHECK_ARG(!present(o.f.q) && !present(o.f.scales), who << " given but config.shared_intermediate = 0");
        continue;
      }
      MOK_CHECK_ARG(present(o.f.q) && present(o.f.scales),
                    who << ": precision fp8_block on CUDA reads the weights' e4m3 copies (q and scales, from "
                           "mokQuantizeWeights / mok.quantize_weights); absent");
      check_tensor(o.f.q, who + ".q", {mokFloat8E4M3}, o.q, device);
      check_tensor(o.f.scales, who + ".scales", {mokFloat32}, o.s, device);
      if (present(o.f.qt)) {
        std::vector<int64_t> t = o.q;
        std::swap(t[t.size() - 1], t[t.size() - 2]);
        check_tensor(o.f.qt, who + ".qt", {mokFloat8E4M3}, t, device);
        in.fp8_qt[i] = o.f.qt.data;
      }
      in.fp8_q[i] = o.f.q.data;
      in.fp8_scales[i] = static_cast<const float*>(o.f.scales.data);
    }
  }
  return in;
}

ref::RankGrads check_backward_args(const mokConfig_t& c, const mokBackwardArgs_t& a, int32_t device,
                                   const std::string& tag) {
  if (device >= 0 && c.precision == mokPrecisionFP8Block) {
    // fp8_block's CUDA backward (launches): the weights' transposed copies (the shared expert's
    // too); named before any launch
    const struct {
      const char* name;
      const mokFp8Weight_t& w;
    } copies[] = {{"w_gate", a.fwd.fp8.w_gate},   {"w_up", a.fwd.fp8.w_up},   {"w_down", a.fwd.fp8.w_down},
                  {"ws_gate", a.fwd.fp8.ws_gate}, {"ws_up", a.fwd.fp8.ws_up}, {"ws_down", a.fwd.fp8.ws_down}};
    for (int i = 0; i < (c.shared_intermediate > 0 ? 6 : 3); ++i) {
      const auto& w = copies[i];
      MOK_CHECK_ARG(present(w.w.qt), tag << "fp8." << w.name
                                         << ".qt: precision fp8_block's CUDA backward reads the weights' transposed "
                                            "e4m3 copies (mok.quantize_weights with transposed=True); absent");
    }
  }
  const int64_t T = a.fwd.x.shape[0], H = c.hidden, k = c.topk;
  check_tensor(a.dy, tag + "dy", {mokBFloat16}, {T, H}, device);
  check_tensor(a.dx, tag + "dx", {mokBFloat16}, {T, H}, device);
  check_tensor(a.d_topk_weights, tag + "d_topk_weights", {mokFloat32}, {T, k}, device);
  ref::RankGrads g;
  g.grad_strides = check_weights(c, a.grads, device, tag + "grad of ", {mokBFloat16}, true);
  g.main_strides = check_weights(c, a.main_grads, device, tag + "main_grad of ", {mokFloat32}, false);
  if (device >= 0) {
    // On CUDA the fused backward writes the routed gradients in their weights' orientation (its
    // transposed policy computes them transposed)
    const bool transposed = check_weights(c, a.fwd.weights, device, tag, {mokBFloat16}, true).w_gate.col_major();
    auto name = [](bool col_major) { return col_major ? "column-major (transposed)" : "row-major"; };
    const struct {
      const char* what;
      const mokTensor_t& t;
      const ref::MatrixStrides& s;
    } grads[] = {{"grad of w_gate", a.grads.w_gate, g.grad_strides.w_gate},
                 {"grad of w_up", a.grads.w_up, g.grad_strides.w_up},
                 {"grad of w_down", a.grads.w_down, g.grad_strides.w_down},
                 {"main_grad of w_gate", a.main_grads.w_gate, g.main_strides.w_gate},
                 {"main_grad of w_up", a.main_grads.w_up, g.main_strides.w_up},
                 {"main_grad of w_down", a.main_grads.w_down, g.main_strides.w_down}};
    for (const auto& m : grads)
      MOK_CHECK_ARG(!present(m.t) || m.s.col_major() == transposed,
                    tag << m.what << " is " << name(m.s.col_major()) << " (strides " << shape_str(m.t.strides, m.t.ndim)
                        << ") but the routed weights are " << name(transposed)
                        << ": on CUDA the routed experts' gradients are written in their weights' orientation");
  }
  g.dx = static_cast<bf16_t*>(a.dx.data);
  g.d_topk_weights = static_cast<float*>(a.d_topk_weights.data);
  g.dw_gate = static_cast<bf16_t*>(a.grads.w_gate.data);
  g.dw_up = static_cast<bf16_t*>(a.grads.w_up.data);
  g.dw_down = static_cast<bf16_t*>(a.grads.w_down.data);
  g.dws_gate = static_cast<bf16_t*>(a.grads.ws_gate.data);
  g.dws_up = static_cast<bf16_t*>(a.grads.ws_up.data);
  g.dws_down = static_cast<bf16_t*>(a.grads.ws_down.data);
  g.main_gate = static_cast<float*>(a.main_grads.w_gate.data);
  g.main_up = static_cast<float*>(a.main_grads.w_up.data);
  g.main_down = static_cast<float*>(a.main_grads.w_down.data);
  g.main_s_gate = static_cast<float*>(a.main_grads.ws_gate.data);
  g.main_s_up = static_cast<float*>(a.main_grads.ws_up.data);
  g.main_s_down = static_cast<float*>(a.main_grads.ws_down.data);
  return g;
}

}  // namespace mok
