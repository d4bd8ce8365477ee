// The CUDA workspace's byte map as code: every buffer a workspace owns or uses, its size as a
// formula over the resolved configuration, and its place.  create_workspace (cuda/forward.cu)
// allocates the block and sets its pointers from this table; Workspace.describe()
// (runtime/layer.cpp, describe_buffers) prints the same table.  Host and device code alike,
// no CUDA runtime calls.  docs/design.md, "Workspace byte map (CUDA)", gives the reasons.
//
// Places:
//   block      one device allocation of total_bytes(); offsets 256 B aligned, 1 KB for the
//              TMA operands and bulk-copy targets (the block base is 1 KB aligned)
//   alias      the bytes of another entry that is dead by the time this one is written
//   symmetric  this rank's symmetric region at EP >= 2 (common/symmetric.hpp, SymLayout);
//              offset -1: a field the backward adds to SymLayout
//   separate   its own allocation: pinned host memory, the lazily allocated unfused path,
//              the optional trace ring, the plan build's per-call scratch
//   absent     not in this configuration (no shared expert, EP = 1, backward off)
//
// Names in the formulas (derived sizes, computed below):
//   max_rows    = P*T_max*min(k,E_l) + E_l*(block_m-1), rounded down to block_m   (plan capacity, §3)
//   max_blocks  = max_rows / block_m
//   ring_rows   = min(macrobatch_size, max_rows)                                (the token ring)
//   shared_blocks = ceil(T_max / block_m)
//   n_macro     = ceil(max_rows / macrobatch_size)   macrobatches of a worst-case plan
//   n_acc       = min(E_l, n_macro - 1)              experts whose rows can span > 1 macrobatch
//   i_chunks    = ceil(I / 128)                      128-channel chunks of I: the dgrad-down epilogue's
//                                                    router-gradient partials (gemm::kDtwChunk)
#pragma once

#include <cstdint>

#include "common/defs.hpp"
#include "common/symmetric.hpp"
#include "mok/mok.h"
#include "plan/plan.hpp"

namespace mok {

// X(id, name, element type, type name, backward).  The order is the order in the block: the
// forward's buffers first, then the backward's, so with_backward leaves every forward offset
// where it was.
#define MOK_WORKSPACE_BUFFERS(X)                                   \
  X(kRows, "plan.rows", uint32_t, "u32", false)                    \
  X(kExpertCount, "plan.expert_count", int32_t, "i32", false)      \
  X(kExpertOffset, "plan.expert_offset", int32_t, "i32", false)    \
  X(kBlockExpert, "plan.block_expert", int32_t, "i32", false)      \
  X(kRing, "ring", uint16_t, "bf16", false)                        \
  X(kAct, "act", uint16_t, "bf16", false)                          \
  X(kCounters, "counters", int32_t, "i32", false)                  \
  X(kRegionsDev, "regions_dev", uint8_t*, "ptr", false)            \
  X(kEpSeq, "ep_seq", int64_t, "i64", false)                       \
  X(kSlots, "slots", uint16_t, "bf16", false)                      \
  X(kSharedBlock, "shared_block", int32_t, "i32", false)           \
  X(kSharedAct, "shared_act", uint16_t, "bf16", false)             \
  X(kSharedOut, "shared_out", uint16_t, "bf16", false)             \
  X(kErrors, "errors", int64_t, "i64", false)                      \
  X(kHostErrors, "host_errors", int64_t, "i64", false)             \
  X(kUnfusedRing, "unfused.ring", uint16_t, "bf16", false)         \
  X(kUnfusedAct, "unfused.act", uint16_t, "bf16", false)           \
  X(kFp8Buffers, "fp8.buffers", uint8_t, "u8", false)              \
  X(kTrace, "trace", mokTraceEvent_t, "event", false)              \
  X(kPlanScratch, "plan.scratch", int32_t, "i32", false)           \
  X(kUbXRows, "unfused_bwd.x_rows", uint16_t, "bf16", false)       \
  X(kUbDyRows, "unfused_bwd.dy_rows", uint16_t, "bf16", false)     \
  X(kUbH, "unfused_bwd.h", uint16_t, "bf16", false)                \
  X(kUbDh, "unfused_bwd.dh", uint16_t, "bf16", false)              \
  X(kUbWa, "unfused_bwd.wa", uint16_t, "bf16", false)              \
  X(kUbDxRows, "unfused_bwd.dx_rows", uint16_t, "bf16", false)     \
  X(kUbRowWeight, "unfused_bwd.row_weight", float, "f32", false)   \
  X(kUbDtwPartials, "unfused_bwd.dtw_partials", float, "f32", false) \
  X(kUbSharedH, "unfused_bwd.shared_h", uint16_t, "bf16", false)   \
  X(kUbSharedDh, "unfused_bwd.shared_dh", uint16_t, "bf16", false) \
  X(kUbSharedA, "unfused_bwd.shared_a", uint16_t, "bf16", false)   \
  X(kUbOnes, "unfused_bwd.ones", float, "f32", false)              \
  X(kUbTables, "unfused_bwd.tables", int32_t, "i32", false)        \
  X(kUbAccGateUp, "unfused_bwd.acc_gu", float, "f32", false)       \
  X(kUbAccDown, "unfused_bwd.acc_dn", float, "f32", false)         \
  X(kUbCounters, "fused_bwd.counters", int32_t, "i32", false)      \
  X(kBwdDyRing, "bwd.dy_ring", uint16_t, "bf16", true)             \
  X(kBwdXRing, "bwd.x_ring", uint16_t, "bf16", true)               \
  X(kBwdH, "bwd.h", uint16_t, "bf16", true)                        \
  X(kBwdDh, "bwd.dh", uint16_t, "bf16", true)                      \
  X(kBwdWa, "bwd.wa", uint16_t, "bf16", true)                      \
  X(kBwdDtwPartials, "bwd.dtw_partials", float, "f32", true)       \
  X(kBwdWgradAcc, "bwd.wgrad_acc", float, "f32", true)             \
  X(kBwdSharedH, "bwd.shared_h", uint16_t, "bf16", true)           \
  X(kBwdSharedDh, "bwd.shared_dh", uint16_t, "bf16", true)         \
  X(kBwdSharedA, "bwd.shared_a", uint16_t, "bf16", true)           \
  X(kBwdSharedDx, "bwd.shared_dx", uint16_t, "bf16", true)         \
  X(kBwdDxSlots, "bwd.dx_slots", uint16_t, "bf16", true)           \
  X(kBwdCounters, "bwd.counters", int32_t, "i32", true)            \
  X(kBwdSymDy, "bwd.sym_dy", uint16_t, "bf16", true)               \
  X(kBwdSymDtw, "bwd.sym_dtw", float, "f32", true)

// fp8_block's CUDA forward buffers (one allocation, cuda/forward.cu): the ring and act rows in
// e4m3 [max_rows, H], [max_rows, I] with their scales [H/128, max_rows], [I/128, max_rows], and
// the shared expert's x and act [T_max, H], [T_max, I_s] with scales [../128, T4] (T4: T_max
// rounded up to 4, so that a scale row is 16-byte aligned); each part 1 KB aligned.
struct Fp8BufferParts {
  int64_t ring, ring_scales, act, act_scales, x, x_scales, shared_act, shared_act_scales, total;
};
MOK_HD int64_t fp8_t4(int64_t t_max) { return (t_max + 3) / 4 * 4; }
// Consecutive parts of one allocation, each 1 KB aligned: part(bytes) returns its offset
struct PartAllocator {
  int64_t at = 0;
  MOK_HD int64_t operator()(int64_t bytes) {
    const int64_t offset = at;
    at += (bytes + 1023) / 1024 * 1024;
    return offset;
  }
};
MOK_HD Fp8BufferParts fp8_buffer_parts(int64_t max_rows, int64_t H, int64_t I, int64_t T, int64_t Is) {
  const int64_t t4 = fp8_t4(T);
  Fp8BufferParts p{};
  PartAllocator part;
  p.ring = part(max_rows * H);
  p.ring_scales = part(H / 128 * max_rows * 4);
  p.act = part(max_rows * I);
  p.act_scales = part(I / 128 * max_rows * 4);
  p.x = part(T * H);
  p.x_scales = part(H / 128 * t4 * 4);
  p.shared_act = part(T * Is);
  p.shared_act_scales = part(Is / 128 * t4 * 4);
  p.total = part.at;
  return p;
}
// fp8_block's backward (the launches of backward_fp8, EP = 1): a token's rows quantised once
// (tok [T, H] e4m3, scales [H/128, T4]: dy, and x for a replay), per plan row (R = max_rows)
// dy (or x) in e4m3 with its scales, dh = [dg | du] in e4m3 with its scales, and the wgrad
// operands transposed (K-major) in e4m3 with their scales per channel and 128 rows: x [H, R],
// w·dy [H, R], a [I, R], dg [I, R], du [I, R].  The shared expert's (I_s > 0) over the T_max
// tokens (T128: rounded up to 128): dh_s [T, 2I_s] e4m3 with its scales [2I_s/128, T4], and its
// wgrad operands x [H, T128], dy [H, T128], a_s, dg_s, du_s [I_s, T128] with their scales.
struct Fp8BwdParts {
  int64_t tok, tok_scales, dy, dy_scales, dh, dh_scales, xt, xt_scales, wdyt, wdyt_scales, at, at_scales, dgt,
      dgt_scales, dut, dut_scales;
  int64_t sdh, sdh_scales, sxt, sxt_scales, sdyt, sdyt_scales, sat, sat_scales, sdgt, sdgt_scales, sdut, sdut_scales;
  int64_t total;
};
// A wgrad operand's transposed e4m3 copy [cols, rows] and its scales [rows/128, cols] fp32
MOK_HD void fp8_transposed_part(PartAllocator& part, int64_t rows, int64_t cols, int64_t* q, int64_t* scales) {
  *q = part(cols * rows);
  *scales = part(rows / 128 * cols * 4);
}
MOK_HD Fp8BwdParts fp8_bwd_parts(int64_t R, int64_t H, int64_t I, int64_t T, int64_t Is = 0) {
  Fp8BwdParts p{};
  PartAllocator part;
  p.tok = part(T * H);
  p.tok_scales = part(H / 128 * fp8_t4(T) * 4);
  p.dy = part(R * H);
  p.dy_scales = part(H / 128 * R * 4);
  p.dh = part(R * 2 * I);
  p.dh_scales = part(2 * I / 128 * R * 4);
  fp8_transposed_part(part, R, H, &p.xt, &p.xt_scales);
  fp8_transposed_part(part, R, H, &p.wdyt, &p.wdyt_scales);
  fp8_transposed_part(part, R, I, &p.at, &p.at_scales);
  fp8_transposed_part(part, R, I, &p.dgt, &p.dgt_scales);
  fp8_transposed_part(part, R, I, &p.dut, &p.dut_scales);
  const int64_t t128 = Is > 0 ? (T + 127) / 128 * 128 : 0, t4 = Is > 0 ? fp8_t4(T) : 0;
  p.sdh = part(T * 2 * Is);
  p.sdh_scales = part(2 * Is / 128 * t4 * 4);
  fp8_transposed_part(part, t128, H, &p.sxt, &p.sxt_scales);
  fp8_transposed_part(part, t128, H, &p.sdyt, &p.sdyt_scales);
  fp8_transposed_part(part, t128, Is, &p.sat, &p.sat_scales);
  fp8_transposed_part(part, t128, Is, &p.sdgt, &p.sdgt_scales);
  fp8_transposed_part(part, t128, Is, &p.sdut, &p.sdut_scales);
  p.total = part.at;
  return p;
}
MOK_HD int64_t fp8_buffer_bytes(int64_t max_rows, int64_t H, int64_t I, int64_t T, int64_t Is) {
  return fp8_buffer_parts(max_rows, H, I, T, Is).total;
}

enum class WsBuffer : int32_t {
#define MOK_WS_ENUM(id, name, T, tname, bwd) id,
  MOK_WORKSPACE_BUFFERS(MOK_WS_ENUM)
#undef MOK_WS_ENUM
  kCount
};
inline constexpr int kNumWsBuffers = static_cast<int>(WsBuffer::kCount);

// The element type of each buffer: layout.get<WsBuffer::kRows>(base) is a uint32_t*.
template <WsBuffer B>
struct WsElement;
#define MOK_WS_TYPE(id, name, T, tname, bwd) \
  template <>                                \
  struct WsElement<WsBuffer::id> {           \
    using type = T;                          \
  };
MOK_WORKSPACE_BUFFERS(MOK_WS_TYPE)
#undef MOK_WS_TYPE

MOK_HD const char* ws_name(WsBuffer b) {
  switch (b) {
#define MOK_WS_NAME(id, name, T, tname, bwd) \
  case WsBuffer::id: return name;
    MOK_WORKSPACE_BUFFERS(MOK_WS_NAME)
#undef MOK_WS_NAME
    default: return "?";
  }
}
MOK_HD const char* ws_type_name(WsBuffer b) {
  switch (b) {
#define MOK_WS_TNAME(id, name, T, tname, bwd) \
  case WsBuffer::id: return tname;
    MOK_WORKSPACE_BUFFERS(MOK_WS_TNAME)
#undef MOK_WS_TNAME
    default: return "?";
  }
}
MOK_HD int32_t ws_element_bytes(WsBuffer b) {
  switch (b) {
#define MOK_WS_SIZE(id, name, T, tname, bwd) \
  case WsBuffer::id: return static_cast<int32_t>(sizeof(T));
    MOK_WORKSPACE_BUFFERS(MOK_WS_SIZE)
#undef MOK_WS_SIZE
    default: return 0;
  }
}
MOK_HD bool ws_is_backward(WsBuffer b) {
  switch (b) {
#define MOK_WS_BWD(id, name, T, tname, bwd) \
  case WsBuffer::id: return bwd;
    MOK_WORKSPACE_BUFFERS(MOK_WS_BWD)
#undef MOK_WS_BWD
    default: return false;
  }
}

enum class WsPlace : int32_t { kAbsent = 0, kBlock, kAlias, kSymmetric, kSeparate };

MOK_HD const char* ws_place_name(WsPlace p) {
  switch (p) {
    case WsPlace::kBlock: return "block";
    case WsPlace::kAlias: return "alias";
    case WsPlace::kSymmetric: return "symmetric";
    case WsPlace::kSeparate: return "separate";
    default: return "absent";
  }
}

inline constexpr int64_t kWsAlign = 256;      // every offset in the block (cudaMalloc's own alignment)
inline constexpr int64_t kWsTmaAlign = 1024;  // TMA operands, bulk-copy targets, the block base
inline constexpr int32_t kWsErrorWords = 11;  // route error [0, 4) + timeout record [4, 11) (gemm::kTimeoutWords = 7)
inline constexpr int32_t kWsTraceCap = 4096;  // trace events per recorder (MOK_TRACE=1)
inline constexpr int32_t kWsCounterArrays = 4;   // gather_ready, gu_done, dn_done, sgu_done (fused/forward_kernel.cuh)
inline constexpr int32_t kWsCounterHeader = 2;   // task_next, blocks_done
inline constexpr int32_t kWsBwdCounterArrays = 6;  // provisional (the backward kernel fixes it): dy_ready, x_ready,
                                                   // h_ready, dh_ready, dx_done, wgrad_done [max_blocks]
inline constexpr int32_t kWsDtwChunk = 128;  // channels of I per <da, a> partial (gemm::kDtwChunk)
inline constexpr int32_t kWsPlanChunk = 256;   // tokens per chunk of the device plan build (plan_build.cu)

MOK_HD int64_t ws_align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

struct WsEntry {
  WsPlace place = WsPlace::kAbsent;
  int64_t offset = -1;        // from the block base (block, alias) or the region base (symmetric)
  int64_t count = 0;          // elements = f[0]*f[1]*f[2]*f[3] + add
  int64_t bytes = 0;          // count x element bytes
  int64_t add = 0;
  int64_t f[4] = {1, 1, 1, 1};
  int32_t nf = 0;             // factors that the formula names (for printing the numbers)
  int64_t align = 0;
  WsBuffer alias = WsBuffer::kCount;  // the entry whose bytes an alias reuses
  bool zero_at_creation = false;      // memset once by create_workspace
  const char* formula = "";           // the count, in the names above
  const char* note = "";              // what it holds; for separate and symmetric entries, where it lives
};

struct WorkspaceOptions {
  bool with_backward = false;  // lay out the backward's buffers too (no kernel uses them yet)
  int32_t num_sms = 0;         // sizes the trace ring; 0: not known (describe before creation)
  int32_t trace_cap = 0;       // events per recorder of the trace ring; 0: no trace (MOK_TRACE unset)
};

struct WorkspaceLayout {
  // Dimensions and derived sizes, the names of the formulas
  int64_t H = 0, I = 0, Is = 0, El = 0, k = 0, P = 0, T_max = 0, block_m = 0, macrobatch = 0;
  int64_t max_rows = 0, max_blocks = 0, ring_rows = 0, shared_blocks = 0, n_macro = 0, n_acc = 0, i_chunks = 0;
  WorkspaceOptions options;
  SymLayout sym;                   // EP >= 2
  int64_t end = 0;                 // end of the last block entry
  WsEntry entry[kNumWsBuffers];

  MOK_HD const WsEntry& operator[](WsBuffer b) const { return entry[static_cast<int>(b)]; }
  MOK_HD bool present(WsBuffer b) const { return (*this)[b].place != WsPlace::kAbsent; }
  // Bytes of the one device allocation (offsets from a 1 KB aligned base).
  MOK_HD int64_t total_bytes() const { return ws_align_up(end, kWsTmaAlign); }

  // Address of a buffer: block and alias entries from `block` (the 1 KB aligned base),
  // symmetric ones from `region` (this rank's region); nullptr for separate, absent, or a
  // planned symmetric field.
  MOK_HD uint8_t* address(WsBuffer b, uint8_t* block, uint8_t* region = nullptr) const {
    const WsEntry* e = &(*this)[b];
    for (int hop = 0; e->place == WsPlace::kAlias && hop < kNumWsBuffers; ++hop) e = &(*this)[e->alias];
    if (e->place == WsPlace::kBlock) return block ? block + e->offset : nullptr;
    if (e->place == WsPlace::kSymmetric && e->offset >= 0) return region ? region + e->offset : nullptr;
    return nullptr;
  }
  template <WsBuffer B>
  MOK_HD typename WsElement<B>::type* get(uint8_t* block, uint8_t* region = nullptr) const {
    return reinterpret_cast<typename WsElement<B>::type*>(address(B, block, region));
  }

  // Builders (workspace_layout() below): count = f0*f1*f2*f3 + add, of which the formula
  // names `nf` factors (the others are 1).
  MOK_HD WsEntry& put(WsBuffer b, WsPlace place, const char* formula, const char* note, int64_t add, int32_t nf,
                      int64_t f0 = 1, int64_t f1 = 1, int64_t f2 = 1, int64_t f3 = 1) {
    WsEntry& e = entry[static_cast<int>(b)];
    e = WsEntry{};
    e.place = place;
    e.add = add;
    e.f[0] = f0;
    e.f[1] = f1;
    e.f[2] = f2;
    e.f[3] = f3;
    e.nf = nf;
    e.count = f0 * f1 * f2 * f3 + add;
    e.bytes = e.count * ws_element_bytes(b);
    e.formula = formula;
    e.note = note;
    return e;
  }
  // The next entry of the block, at the end rounded up to `align`.
  MOK_HD WsEntry& block(WsBuffer b, int64_t align, const char* formula, const char* note, int64_t add, int32_t nf,
                        int64_t f0 = 1, int64_t f1 = 1, int64_t f2 = 1, int64_t f3 = 1) {
    WsEntry& e = put(b, WsPlace::kBlock, formula, note, add, nf, f0, f1, f2, f3);
    e.align = align;
    e.offset = ws_align_up(end, align);
    end = e.offset + e.bytes;
    return e;
  }
  // An entry over the bytes of `of` (same formula and size).
  MOK_HD WsEntry& alias(WsBuffer b, WsBuffer of, const char* note) {
    const WsEntry t = (*this)[of];
    WsEntry& e = put(b, WsPlace::kAlias, t.formula, note, t.add, t.nf, t.f[0], t.f[1], t.f[2], t.f[3]);
    e.alias = of;
    e.offset = t.offset;
    e.align = t.align;
    return e;
  }
};

// The layout of a resolved configuration (normalize_config: minibatch and macrobatch sizes
// filled in).  The sizes are those the workspace allocated buffer by buffer before the layout
// existed (every forward count is >= 1; a backward count can be 0: wgrad_acc when n_acc = 0).
MOK_HD WorkspaceLayout workspace_layout(const mokConfig_t& c, WorkspaceOptions o = WorkspaceOptions{}) {
  WorkspaceLayout L;
  L.options = o;
  const plan::PlanDims d = plan::plan_dims_of(c);
  L.H = c.hidden;
  L.I = c.intermediate;
  L.Is = c.shared_intermediate;
  L.El = d.local_experts();
  L.k = c.topk;
  L.P = c.ep_size;
  L.T_max = c.max_tokens;
  L.block_m = c.block_m;
  L.macrobatch = c.macrobatch_size;
  L.max_rows = plan::max_rows(d);
  L.max_blocks = plan::max_blocks(d);
  L.ring_rows = plan::min64(c.macrobatch_size, L.max_rows);
  L.shared_blocks = plan::ceil_div(c.max_tokens, c.block_m);
  L.n_macro = c.macrobatch_size > 0 ? plan::ceil_div(L.max_rows, c.macrobatch_size) : 1;
  L.n_acc = plan::min64(L.El, L.n_macro - 1);
  L.i_chunks = plan::ceil_div(c.intermediate, kWsDtwChunk);
  const bool ep = c.ep_size > 1, shared = c.shared_intermediate > 0, bwd = o.with_backward;
  if (ep) L.sym = sym_layout(c.ep_size, c.max_tokens, c.topk, c.hidden);
  const int64_t H = L.H, I = L.I, Is = L.Is, T = L.T_max, R = L.ring_rows;

  // ---- forward: the plan, the ring, the counters ------------------------------------------
  L.block(WsBuffer::kRows, kWsAlign, "max_rows", "row records (rank, token, j) per local expert, padded to block_m",
          0, 1, L.max_rows);
  L.block(WsBuffer::kExpertCount, kWsAlign, "E_l", "rows per local expert", 0, 1, L.El);
  L.block(WsBuffer::kExpertOffset, kWsAlign, "E_l + 1", "first row of each local expert", 1, 1, L.El);
  L.block(WsBuffer::kBlockExpert, kWsAlign, "max_blocks", "expert of each row block, -1 past the end", 0, 1,
          L.max_blocks);
  L.block(WsBuffer::kRing, kWsTmaAlign, "ring_rows*H", "routed rows of x gathered per macrobatch (gate/up A, TMA)", 0,
          2, R, H);
  L.block(WsBuffer::kAct, kWsTmaAlign, "ring_rows*I", "silu(g)*u of the ring's rows (down A, TMA)", 0, 2, R, I);
  L.block(WsBuffer::kCounters, kWsAlign, "4*max_blocks + 2",
          "task_next, blocks_done; gather_ready, gu_done, dn_done, sgu_done [max_blocks]; zeroed per launch",
          kWsCounterHeader, 2, kWsCounterArrays, L.max_blocks);
  if (ep) {
    L.block(WsBuffer::kRegionsDev, kWsAlign, "P", "the group's region pointers, as this process sees them", 0, 1, L.P);
    L.block(WsBuffer::kEpSeq, kWsAlign, "1", "sequence number of the last call", 1, 0, 0).zero_at_creation = true;
    WsEntry& s = L.put(WsBuffer::kSlots, WsPlace::kSymmetric, "T_max*k*H",
                       "one output row per route, slot token*k + j, in this rank's region (peers push)", 0, 3, T, L.k,
                       H);
    s.offset = L.sym.slots;
    s.align = kWsTmaAlign;
  } else {
    L.block(WsBuffer::kSlots, kWsTmaAlign, "T_max*k*H", "one output row per route, slot token*k + j", 0, 3, T, L.k, H);
  }
  if (shared) {
    L.block(WsBuffer::kSharedBlock, kWsAlign, "shared_blocks", "zeros: every block of the shared expert is expert 0",
            0, 1, L.shared_blocks)
        .zero_at_creation = true;
    L.block(WsBuffer::kSharedAct, kWsTmaAlign, "T_max*I_s", "the shared expert's silu(g)*u (shared down A, TMA)", 0, 2,
            T, Is);
    L.block(WsBuffer::kSharedOut, kWsTmaAlign, "T_max*H", "the shared expert's output rows (combine)", 0, 2, T, H);
  }
  L.block(WsBuffer::kErrors, kWsAlign, "11", "route error [0,4) + timeout record [4,11)", kWsErrorWords, 0, 0)
      .zero_at_creation = true;

  // ---- forward: separate allocations ---------------------------------------------------------
  L.put(WsBuffer::kHostErrors, WsPlace::kSeparate, "11", "pinned host memory (cudaMallocHost): errors of the last call",
        kWsErrorWords, 0, 0);
  L.put(WsBuffer::kUnfusedRing, WsPlace::kSeparate, "max_rows*H", "at the first MOK_FORWARD_PATH=unfused call", 0, 2,
        L.max_rows, H);
  L.put(WsBuffer::kUnfusedAct, WsPlace::kSeparate, "max_rows*I", "at the first MOK_FORWARD_PATH=unfused call", 0, 2,
        L.max_rows, I);
  if (c.precision == mokPrecisionFP8Block)
    L.put(WsBuffer::kFp8Buffers, WsPlace::kSeparate, "(max_rows*(H+I) + T4*(H+I_s))*(1 + 4/128), 1 KB each",
          "at the first fp8_block forward on CUDA: ring, act, x, shared act in e4m3 and their fp32 scales "
          "(T4 = T_max rounded up to 4)",
          fp8_buffer_bytes(L.max_rows, H, I, T, Is), 0);
  if (o.trace_cap > 0)
    L.put(WsBuffer::kTrace, WsPlace::kSeparate, "num_sms*MOK_TRACE_RECORDERS*trace_cap", "MOK_TRACE=1 at creation: the timing ring", 0, 3,
          o.num_sms, MOK_TRACE_RECORDERS, o.trace_cap);
  L.put(WsBuffer::kPlanScratch, WsPlace::kSeparate, "P*ceil(T_max/256)*E_l",
        "per plan build, stream-ordered (cudaMallocAsync, cudaFreeAsync)", 0, 3, L.P, plan::ceil_div(T, kWsPlanChunk),
        L.El);
  // The CUDA backward as launches (cuda/backward.cu): one allocation at a workspace's first
  // backward, every plan row resident (no ring), in this order, each 1 KB aligned
  {
    const char* kAt = "at the first CUDA backward call (one allocation, the unfused backward)";
    const int64_t R_all = L.max_rows;
    L.put(WsBuffer::kUbXRows, WsPlace::kSeparate, "max_rows*H", kAt, 0, 2, R_all, H);
    L.put(WsBuffer::kUbDyRows, WsPlace::kSeparate, "max_rows*H", kAt, 0, 2, R_all, H);
    L.put(WsBuffer::kUbH, WsPlace::kSeparate, "max_rows*2*I", "g|u of every plan row (unless the forward saved it)", 0, 3,
          R_all, 2, I);
    L.put(WsBuffer::kUbDh, WsPlace::kSeparate, "max_rows*2*I", kAt, 0, 3, R_all, 2, I);
    L.put(WsBuffer::kUbWa, WsPlace::kSeparate, "max_rows*I", kAt, 0, 2, R_all, I);
    if (ep)
      L.put(WsBuffer::kUbDxRows, WsPlace::kSeparate, "max_rows*H", "EP >= 2: dx rows before their push home", 0, 2,
            R_all, H);
    L.put(WsBuffer::kUbRowWeight, WsPlace::kSeparate, "max_rows", kAt, 0, 1, R_all);
    L.put(WsBuffer::kUbDtwPartials, WsPlace::kSeparate, "max_rows*i_chunks", kAt, 0, 2, R_all, L.i_chunks);
    if (shared) {
      L.put(WsBuffer::kUbSharedH, WsPlace::kSeparate, "T_max*2*I_s", kAt, 0, 3, T, 2, Is);
      L.put(WsBuffer::kUbSharedDh, WsPlace::kSeparate, "T_max*2*I_s", kAt, 0, 3, T, 2, Is);
      L.put(WsBuffer::kUbSharedA, WsPlace::kSeparate, "T_max*I_s", kAt, 0, 2, T, Is);
    }
    L.put(WsBuffer::kUbOnes, WsPlace::kSeparate, "max(T_max, k)", "1.0f: the shared expert's row weights, dx's sum",
          0, 1, plan::max64(T, L.k));
    L.put(WsBuffer::kUbTables, WsPlace::kSeparate, "n_macro*(2 + 4*E_l) + 4",
          "per macrobatch: expert range, row offset, count, mode, fp32 slot of every expert; the shared expert's", 4, 2,
          L.n_macro, 2 + 4 * L.El);
    L.put(WsBuffer::kUbAccGateUp, WsPlace::kSeparate, "n_acc*2*I*H",
          "fp32 [dW_gate; dW_up] of the experts whose rows span macrobatches", 0, 4, L.n_acc, 2, I, H);
    L.put(WsBuffer::kUbAccDown, WsPlace::kSeparate, "n_acc*H*I", "fp32 dW_down of the same experts", 0, 3, L.n_acc, H,
          I);
    // The fused backward's dependency counters (cuda/fused/schedule_bwd.cuh, CounterArray):
    // task claim and grid barrier, 5 per row block, 2 per (expert, macrobatch), 2 per shared
    // token block and its total; zeroed per launch
    L.put(WsBuffer::kUbCounters, WsPlace::kSeparate, "2 + 5*max_blocks + 2*E_l*n_macro + 2*(shared_blocks + 1)",
          "zeroed per fused backward launch (the same allocation)", 2, 1,
          5 * L.max_blocks + 2 * L.El * L.n_macro + 2 * (L.shared_blocks + 1));
  }
  if (!bwd) return L;

  // ---- backward (docs/contracts.md §4a; laid out, no kernel uses them yet) -------------------
  // Per macrobatch, in the ring's rows: x (the ring itself: macrobatch 0 left by the forward,
  // the others re-gathered, the replay), dy, h = [g | u], dh = [dg | du], w*a (over act).
  L.block(WsBuffer::kBwdDyRing, kWsTmaAlign, "ring_rows*H", "dy rows per macrobatch (dgrad-down A, wgrad-down operand)",
          0, 2, R, H);
  L.alias(WsBuffer::kBwdXRing, WsBuffer::kRing, "x rows: macrobatch 0 left by the forward, the others re-gathered");
  L.block(WsBuffer::kBwdH, kWsTmaAlign, "ring_rows*2*I",
          "g|u of the ring's rows: the forward's for macrobatch 0, the replay's for the others", 0, 3, R, 2, I);
  L.block(WsBuffer::kBwdDh, kWsTmaAlign, "ring_rows*2*I", "dg|du rows (dgrad gate/up A, K = 2I; wgrad gate/up operand)",
          0, 3, R, 2, I);
  L.alias(WsBuffer::kBwdWa, WsBuffer::kAct, "w*a rows from the dgrad-down epilogue (it reads h): wgrad-down operand");
  L.block(WsBuffer::kBwdDtwPartials, kWsAlign, "max_rows*i_chunks",
          "<da, a> per plan row and 128 channels of I, summed in ascending chunk order (no float atomics)", 0, 2,
          L.max_rows, L.i_chunks);
  L.block(WsBuffer::kBwdWgradAcc, kWsTmaAlign, "n_acc*3*I*H",
          "fp32 dW_gate|dW_up|dW_down of each expert whose rows span more than one macrobatch", 0, 4, L.n_acc, 3, I, H);
  if (shared) {
    L.block(WsBuffer::kBwdSharedH, kWsTmaAlign, "T_max*2*I_s", "the shared expert's g|u", 0, 3, T, 2, Is);
    L.block(WsBuffer::kBwdSharedDh, kWsTmaAlign, "T_max*2*I_s", "the shared expert's dg|du", 0, 3, T, 2, Is);
    L.alias(WsBuffer::kBwdSharedA, WsBuffer::kSharedAct, "the shared expert's a, left by the forward: wgrad of ws_down");
    L.alias(WsBuffer::kBwdSharedDx, WsBuffer::kSharedOut, "the shared expert's dx rows (its output rows are dead)");
  }
  L.alias(WsBuffer::kBwdDxSlots, WsBuffer::kSlots,
          "dx row per route, slot token*k + j of the home rank (the route outputs are dead after the combine)");
  L.block(WsBuffer::kBwdCounters, kWsAlign, "6*max_blocks + 2",
          "provisional (the backward kernel fixes the arrays); zeroed per launch", kWsCounterHeader, 2,
          kWsBwdCounterArrays, L.max_blocks);
  if (ep) {
    L.put(WsBuffer::kBwdSymDy, WsPlace::kSymmetric, "T_max*H",
          "this rank's dy, pulled by the experts' owners: a SymLayout field to add", 0, 2, T, H);
    L.put(WsBuffer::kBwdSymDtw, WsPlace::kSymmetric, "T_max*k",
          "d topk_weights pushed home by the experts' owners (one writer each): a SymLayout field to add", 0, 2, T,
          L.k);
  }
  return L;
}

}  // namespace mok
