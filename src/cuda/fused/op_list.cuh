// The op list of a fused kernel's direction and what reads it: visit_op (a task kind -> its
// op), task_waits and task_signals (the descriptions the producer, the signaler and the host
// protocol models share).  Both directions' ops declare the same members (ops/op.cuh,
// ops_bwd/op.cuh); a direction lists its ops once, in the order of their kinds:
//   template <> struct OpsOf<TaskKind> { using type = OpList<TaskKind, ops::A, ops::B, ...>; };
#pragma once

#include <cstdint>

#include "common/defs.hpp"

namespace mok::cuda::fused {

// A counter wait "array[index] >= expected" and a finished tile's "array[index] += 1", over a
// direction's counter arrays.
template <class Array>
struct CounterWait {
  Array array;
  int32_t index;
  int32_t expected;
};
template <class Array>
struct CounterSignal {
  Array array;
  int32_t index;
};

template <int kI, class Op, class... Rest>
struct OpAt {
  using type = typename OpAt<kI - 1, Rest...>::type;
};
template <class Op, class... Rest>
struct OpAt<0, Op, Rest...> {
  using type = Op;
};

template <class Kind, class... Ops>
struct OpList {
  static constexpr int kCount = static_cast<int>(sizeof...(Ops));
  static_assert(kCount >= 1 && kCount <= 16, "visit's switch has 16 cases");
  template <int kI>
  using At = typename OpAt<kI < kCount ? kI : 0, Ops...>::type;
  // Op i is the op of kind i
  static constexpr bool in_order() {
    int i = 0;
    bool ok = true;
    ((ok = ok && static_cast<int>(Ops::kKind) == i++), ...);
    return ok;
  }
  static_assert(in_order(), "an op list holds the ops in the order of their kinds 0, 1, ...");

  // f(Op{}) for the op of `kind`; otherwise() for any other value (kDone).
  // NOTES: one switch, inlined into each role: the role's code over the ops is the branch on
  // the kind its per-kind code was.  Role lambdas take the role's locals by copy (references
  // only to parameters and outputs): a local captured by reference has its address taken, and
  // the PTX moves its registers differently.
  template <class F, class Otherwise>
  MOK_HD static decltype(auto) visit(Kind kind, F&& f, Otherwise&& otherwise) {
#define MOK_OP_CASE(i)                 \
  case i:                              \
    if constexpr (i < kCount)          \
      return f(At<i>{});               \
    else                               \
      return otherwise();
    switch (static_cast<int>(kind)) {
      MOK_OP_CASE(0) MOK_OP_CASE(1) MOK_OP_CASE(2) MOK_OP_CASE(3) MOK_OP_CASE(4) MOK_OP_CASE(5) MOK_OP_CASE(6)
      MOK_OP_CASE(7) MOK_OP_CASE(8) MOK_OP_CASE(9) MOK_OP_CASE(10) MOK_OP_CASE(11) MOK_OP_CASE(12) MOK_OP_CASE(13)
      MOK_OP_CASE(14) MOK_OP_CASE(15)
      default: return otherwise();
    }
#undef MOK_OP_CASE
  }
};

// The op list of a direction, by its TaskKind (each direction's ops.cuh specialises it).
template <class Kind>
struct OpsOf;

template <class Kind, class F, class Otherwise>
MOK_HD decltype(auto) visit_op(Kind kind, F&& f, Otherwise&& otherwise) {
  return OpsOf<Kind>::type::visit(kind, f, otherwise);
}
// The same where `kind` is an op: the roles leave at kDone before they dispatch.
template <class Kind, class F>
MOK_HD decltype(auto) visit_op(Kind kind, F&& f) {
  using First = typename OpsOf<Kind>::type::template At<0>;
  return visit_op(kind, f, []() -> decltype(f(First{})) { __builtin_unreachable(); });
}

// What a tile of `kind` waits on before its loads (`unit`: its row block, token block or
// expert; `macro`: a backward wgrad tile's macrobatch): its op's waits, the one description of
// the dependencies.  Returns the count (0 for kDone).
template <class Kind, class G, class C, class W>
MOK_HD int task_waits(Kind kind, int32_t unit, int32_t macro, const G& g, const C& c, W* out) {
  return visit_op(kind, [=](auto op) { return decltype(op)::waits(unit, macro, g, c, out); }, [] { return 0; });
}
// The counters a finished tile of `kind` adds 1 to: its op's signals.  Returns the count.
template <class Kind, class G, class C, class S>
MOK_HD int task_signals(Kind kind, int32_t unit, int32_t macro, const G& g, const C& c, S* out) {
  return visit_op(kind, [=](auto op) { return decltype(op)::signals(unit, macro, g, c, out); }, [] { return 0; });
}

}  // namespace mok::cuda::fused
