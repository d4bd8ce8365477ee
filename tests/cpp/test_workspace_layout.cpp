// The CUDA workspace's byte map (common/workspace_layout.hpp) on the host: offsets ascending,
// aligned and disjoint; sizes equal to the formulas computed by hand; the backward's entries
// added by with_backward and nothing else; the description lists every entry.
#include <gtest/gtest.h>

#include <string>
#include <type_traits>
#include <vector>

#include "common/workspace_layout.hpp"
#include "cuda/fused/schedule_bwd.cuh"
#include "runtime/layer.hpp"

namespace mok {
namespace {

mokConfig_t config(int64_t H, int64_t I, int64_t Is, int64_t E, int64_t k, int64_t T, int64_t P = 1,
                   int64_t rank = 0) {
  mokConfig_t c = MOK_CONFIG_INITIALIZER;
  c.hidden = H;
  c.intermediate = I;
  c.shared_intermediate = Is;
  c.num_experts = E;
  c.topk = k;
  c.max_tokens = T;
  c.ep_size = P;
  c.ep_rank = rank;
  c.device = 0;        // a CUDA workspace's description; nothing here touches a GPU
  c.num_blocks = 132;  // the grid the minibatch rule reads: an H100 / H200's, on any machine
  const mokConfig_t n = normalize_config(&c);
  check_config(n);
  return n;
}

WorkspaceLayout layout(const mokConfig_t& c, bool with_backward) {
  WorkspaceOptions o;
  o.with_backward = with_backward;
  return workspace_layout(c, o);
}

// Offsets ascending, aligned, disjoint; the total is the last end rounded to 1 KB; aliases
// have their target's bytes.
void check_geometry(const WorkspaceLayout& L) {
  int64_t end = 0;
  for (int i = 0; i < kNumWsBuffers; ++i) {
    const WsBuffer id = static_cast<WsBuffer>(i);
    const WsEntry& e = L[id];
    SCOPED_TRACE(ws_name(id));
    if (e.place == WsPlace::kAbsent) continue;
    EXPECT_GE(e.count, 0);
    EXPECT_EQ(e.bytes, e.count * ws_element_bytes(id));
    EXPECT_NE(std::string(e.formula), "");
    if (e.place == WsPlace::kBlock) {
      EXPECT_TRUE(e.align == kWsAlign || e.align == kWsTmaAlign) << e.align;
      EXPECT_EQ(e.offset % e.align, 0) << e.offset;
      EXPECT_GE(e.offset, end) << "overlaps the entry before";
      EXPECT_LT(e.offset - end, e.align) << "a gap larger than the alignment";
      end = e.offset + e.bytes;
    } else if (e.place == WsPlace::kAlias) {
      const WsEntry& t = L[e.alias];
      EXPECT_TRUE(t.place == WsPlace::kBlock || t.place == WsPlace::kSymmetric) << ws_name(e.alias);
      EXPECT_EQ(e.bytes, t.bytes);
      EXPECT_EQ(e.offset, t.offset);
    } else if (e.place == WsPlace::kSymmetric) {
      if (e.offset >= 0) {
        EXPECT_EQ(e.offset % kWsTmaAlign, 0);
      }
    }
  }
  EXPECT_EQ(L.end, end);
  EXPECT_EQ(L.total_bytes(), (end + 1023) / 1024 * 1024);
}

void check_backward_adds_exactly_its_entries(const mokConfig_t& c) {
  const WorkspaceLayout F = layout(c, false), B = layout(c, true);
  int added = 0;
  for (int i = 0; i < kNumWsBuffers; ++i) {
    const WsBuffer id = static_cast<WsBuffer>(i);
    SCOPED_TRACE(ws_name(id));
    if (ws_is_backward(id)) {
      EXPECT_FALSE(F.present(id)) << "a backward entry in the forward's layout";
      added += B.present(id);
    } else {
      // The forward's entries stay where they were
      EXPECT_EQ(F[id].place, B[id].place);
      EXPECT_EQ(F[id].offset, B[id].offset);
      EXPECT_EQ(F[id].bytes, B[id].bytes);
    }
  }
  EXPECT_GT(added, 0);
  EXPECT_GE(B.total_bytes(), F.total_bytes());
}

TEST(WorkspaceLayout, Dsv3SizesAreTheFormulas) {
  // dsv3: H = 7168, I = 2048, E = 16, k = 8, T = 4096, EP = 1
  const mokConfig_t c = config(7168, 2048, 0, 16, 8, 4096);
  // The minibatch rule: ceil(2 * 132 / min(2048/128, 7168/256)) = 17 row blocks; the ring 8 of them
  ASSERT_EQ(c.minibatch_size, 2176);
  ASSERT_EQ(c.macrobatch_size, 17408);
  const WorkspaceLayout L = layout(c, true);
  // max_rows = 4096*8 + 16*127 = 34800, rounded down to 128
  EXPECT_EQ(L.max_rows, 34688);
  EXPECT_EQ(L.max_blocks, 271);
  EXPECT_EQ(L.ring_rows, 17408);
  EXPECT_EQ(L.n_macro, 2);
  EXPECT_EQ(L.n_acc, 1);  // min(E_l = 16, n_macro - 1 = 1)
  EXPECT_EQ(L.i_chunks, 16);  // I = 2048 in chunks of 128
  const auto bytes = [&](WsBuffer b) { return L[b].bytes; };
  EXPECT_EQ(bytes(WsBuffer::kRows), 34688 * 4);
  EXPECT_EQ(bytes(WsBuffer::kExpertCount), 16 * 4);
  EXPECT_EQ(bytes(WsBuffer::kExpertOffset), 17 * 4);
  EXPECT_EQ(bytes(WsBuffer::kBlockExpert), 271 * 4);
  EXPECT_EQ(bytes(WsBuffer::kRing), int64_t{17408} * 7168 * 2);
  EXPECT_EQ(bytes(WsBuffer::kAct), int64_t{17408} * 2048 * 2);
  EXPECT_EQ(bytes(WsBuffer::kCounters), (2 + 4 * 271) * 4);
  EXPECT_EQ(bytes(WsBuffer::kSlots), int64_t{4096} * 8 * 7168 * 2);
  EXPECT_EQ(bytes(WsBuffer::kErrors), 11 * 8);
  EXPECT_EQ(bytes(WsBuffer::kHostErrors), 11 * 8);
  EXPECT_EQ(bytes(WsBuffer::kUnfusedRing), int64_t{34688} * 7168 * 2);
  EXPECT_EQ(bytes(WsBuffer::kUnfusedAct), int64_t{34688} * 2048 * 2);
  EXPECT_EQ(bytes(WsBuffer::kPlanScratch), 16 * 16 * 4);  // P * ceil(4096/256) * E_l
  // The CUDA backward as launches: every plan row resident, one allocation at its first call
  for (WsBuffer b : {WsBuffer::kUbXRows, WsBuffer::kUbDyRows})
    EXPECT_EQ(bytes(b), int64_t{34688} * 7168 * 2) << ws_name(b);
  EXPECT_EQ(bytes(WsBuffer::kUbH), int64_t{34688} * 2 * 2048 * 2);
  EXPECT_EQ(bytes(WsBuffer::kUbDh), int64_t{34688} * 2 * 2048 * 2);
  EXPECT_EQ(bytes(WsBuffer::kUbWa), int64_t{34688} * 2048 * 2);
  EXPECT_EQ(bytes(WsBuffer::kUbRowWeight), int64_t{34688} * 4);
  EXPECT_EQ(bytes(WsBuffer::kUbDtwPartials), int64_t{34688} * 16 * 4);
  EXPECT_EQ(bytes(WsBuffer::kUbOnes), 4096 * 4);
  EXPECT_EQ(bytes(WsBuffer::kUbTables), (2 * (2 + 4 * 16) + 4) * 4);  // n_macro = 2
  EXPECT_EQ(bytes(WsBuffer::kUbAccGateUp), int64_t{1} * 2 * 2048 * 7168 * 4);  // n_acc = 1
  EXPECT_EQ(bytes(WsBuffer::kUbAccDown), int64_t{1} * 7168 * 2048 * 4);
  for (WsBuffer b : {WsBuffer::kUbXRows, WsBuffer::kUbH, WsBuffer::kUbTables, WsBuffer::kUbAccDown})
    EXPECT_EQ(L[b].place, WsPlace::kSeparate) << ws_name(b);
  for (WsBuffer b : {WsBuffer::kUbDxRows, WsBuffer::kUbSharedH, WsBuffer::kUbSharedDh, WsBuffer::kUbSharedA})
    EXPECT_FALSE(L.present(b)) << ws_name(b) << ": EP = 1, no shared expert";
  for (WsBuffer b : {WsBuffer::kRegionsDev, WsBuffer::kEpSeq, WsBuffer::kSharedBlock, WsBuffer::kSharedAct,
                     WsBuffer::kSharedOut, WsBuffer::kTrace, WsBuffer::kBwdSharedH, WsBuffer::kBwdSharedDh,
                     WsBuffer::kBwdSharedA, WsBuffer::kBwdSharedDx, WsBuffer::kBwdSymDy, WsBuffer::kBwdSymDtw})
    EXPECT_FALSE(L.present(b)) << ws_name(b);
  // Backward
  EXPECT_EQ(bytes(WsBuffer::kBwdDyRing), int64_t{17408} * 7168 * 2);
  EXPECT_EQ(bytes(WsBuffer::kBwdH), int64_t{17408} * 2 * 2048 * 2);
  EXPECT_EQ(bytes(WsBuffer::kBwdDh), int64_t{17408} * 2 * 2048 * 2);
  EXPECT_EQ(bytes(WsBuffer::kBwdDtwPartials), int64_t{34688} * 16 * 4);
  EXPECT_EQ(bytes(WsBuffer::kBwdWgradAcc), int64_t{1} * 3 * 2048 * 7168 * 4);  // 168 MiB, not E_l's 2.6 GiB
  EXPECT_EQ(bytes(WsBuffer::kBwdCounters), (2 + 6 * 271) * 4);
  EXPECT_EQ(L[WsBuffer::kBwdXRing].alias, WsBuffer::kRing);
  EXPECT_EQ(L[WsBuffer::kBwdWa].alias, WsBuffer::kAct);
  EXPECT_EQ(L[WsBuffer::kBwdDxSlots].alias, WsBuffer::kSlots);
  // Zeroed at creation: exactly what create_workspace zeroed before the layout
  for (int i = 0; i < kNumWsBuffers; ++i)
    EXPECT_EQ(L.entry[i].zero_at_creation, static_cast<WsBuffer>(i) == WsBuffer::kErrors) << L.entry[i].formula;
  check_geometry(L);
  check_geometry(layout(c, false));
  check_backward_adds_exactly_its_entries(c);
  // The forward's block: every buffer the kernels use, in one allocation
  const WorkspaceLayout F = layout(c, false);
  int64_t sum = 0;
  for (WsBuffer b : {WsBuffer::kRows, WsBuffer::kExpertCount, WsBuffer::kExpertOffset, WsBuffer::kBlockExpert,
                     WsBuffer::kRing, WsBuffer::kAct, WsBuffer::kCounters, WsBuffer::kSlots, WsBuffer::kErrors}) {
    EXPECT_EQ(F[b].place, WsPlace::kBlock) << ws_name(b);
    sum += F[b].bytes;
  }
  EXPECT_GE(F.total_bytes(), sum);
  EXPECT_LT(F.total_bytes(), sum + 9 * 1024);
}

TEST(WorkspaceLayout, SharedExpertSizesAreTheFormulas) {
  // H = 2048, I = 768, I_s = 2048, E = 64, k = 8, T = 8192
  const mokConfig_t c = config(2048, 768, 2048, 64, 8, 8192);
  const WorkspaceLayout L = layout(c, true);
  EXPECT_EQ(L.max_rows, 73600);  // 8192*8 + 64*127 = 73664, rounded down to 128
  EXPECT_EQ(L.max_blocks, 575);
  EXPECT_EQ(L.ring_rows, 16896);  // 44 blocks (min(768/128, 2048/256) = 6 tiles per block) x 3
  EXPECT_EQ(L.shared_blocks, 64);
  EXPECT_EQ(L.n_macro, 5);
  EXPECT_EQ(L.n_acc, 4);
  EXPECT_EQ(L.i_chunks, 6);  // I = 768 in chunks of 128
  EXPECT_EQ(L[WsBuffer::kSharedBlock].bytes, 64 * 4);
  EXPECT_TRUE(L[WsBuffer::kSharedBlock].zero_at_creation);
  EXPECT_EQ(L[WsBuffer::kSharedAct].bytes, int64_t{8192} * 2048 * 2);
  EXPECT_EQ(L[WsBuffer::kSharedOut].bytes, int64_t{8192} * 2048 * 2);
  EXPECT_EQ(L[WsBuffer::kBwdSharedH].bytes, int64_t{8192} * 2 * 2048 * 2);
  EXPECT_EQ(L[WsBuffer::kBwdSharedDh].bytes, int64_t{8192} * 2 * 2048 * 2);
  EXPECT_EQ(L[WsBuffer::kBwdSharedDx].alias, WsBuffer::kSharedOut);
  EXPECT_EQ(L[WsBuffer::kBwdSharedA].alias, WsBuffer::kSharedAct);
  EXPECT_EQ(L[WsBuffer::kBwdWgradAcc].bytes, int64_t{4} * 3 * 768 * 2048 * 4);
  EXPECT_EQ(L[WsBuffer::kBwdDtwPartials].bytes, int64_t{73600} * 6 * 4);
  check_geometry(L);
  check_backward_adds_exactly_its_entries(c);
}

// The fused backward's counter words are its schedule's counter layout (schedule_bwd.cuh:
// counter_offset, from which the host sets the arrays' offsets) over the workspace's sizes: an
// array added to the schedule fails here until the workspace reserves its words.
TEST(WorkspaceLayout, CounterWordsAreTheSchedulesLayout) {
  namespace fb = cuda::fused::bwd;
  for (const mokConfig_t& c : {config(7168, 2048, 0, 256, 8, 4096, 16), config(2048, 768, 2048, 64, 8, 8192),
                               config(1024, 512, 0, 8, 2, 1024), config(64, 64, 64, 8, 4, 96)}) {
    const WorkspaceLayout L = layout(c, true);
    const fb::CounterSizes s{L.max_blocks, L.El * L.n_macro, L.shared_blocks};
    EXPECT_EQ(fb::counter_offset(fb::CounterArray::kNumArrays, s), L[WsBuffer::kUbCounters].count)
        << "E_l " << L.El << ", macrobatches " << L.n_macro << ", row blocks " << L.max_blocks;
    // Disjoint arrays in the order of the enum, after the header
    EXPECT_EQ(fb::counter_offset(fb::CounterArray::kDyReady, s), fb::kCounterHeaderWords);
    for (int a = 1; a <= static_cast<int>(fb::CounterArray::kNumArrays); ++a)
      EXPECT_EQ(fb::counter_offset(static_cast<fb::CounterArray>(a), s),
                fb::counter_offset(static_cast<fb::CounterArray>(a - 1), s) +
                    fb::counter_words(static_cast<fb::CounterArray>(a - 1), s));
  }
}

TEST(WorkspaceLayout, OneMacrobatchNeedsNoWeightGradientAccumulator) {
  const mokConfig_t c = config(1024, 512, 0, 8, 2, 1024);  // max_rows <= 16384
  const WorkspaceLayout L = layout(c, true);
  EXPECT_EQ(L.n_macro, 1);
  EXPECT_EQ(L.n_acc, 0);
  EXPECT_EQ(L[WsBuffer::kBwdWgradAcc].bytes, 0);
  // n_acc is bounded by E_l as well: a tiny ring over few experts
  mokConfig_t small = MOK_CONFIG_INITIALIZER;
  small.hidden = 256, small.intermediate = 128, small.num_experts = 2, small.topk = 2, small.max_tokens = 4096;
  small.minibatch_size = 128, small.macrobatch_size = 128, small.device = 0;
  const WorkspaceLayout S = layout(normalize_config(&small), true);
  EXPECT_EQ(S.n_macro, 65);  // 4096*2 + 2*127 = 8446 -> 8448 rows / 128
  EXPECT_EQ(S.n_acc, 2);
  EXPECT_EQ(S[WsBuffer::kBwdWgradAcc].bytes, int64_t{2} * 3 * 128 * 256 * 4);
}

TEST(WorkspaceLayout, SymmetricEntriesAtEp2) {
  const mokConfig_t c = config(7168, 2048, 0, 16, 8, 4096, 2, 1);
  const WorkspaceLayout L = layout(c, true);
  const SymLayout sym = sym_layout(2, 4096, 8, 7168);
  EXPECT_EQ(L[WsBuffer::kSlots].place, WsPlace::kSymmetric);
  EXPECT_EQ(L[WsBuffer::kSlots].offset, sym.slots);
  EXPECT_EQ(L[WsBuffer::kRegionsDev].bytes, 2 * 8);
  EXPECT_EQ(L[WsBuffer::kEpSeq].bytes, 8);
  EXPECT_TRUE(L[WsBuffer::kEpSeq].zero_at_creation);
  EXPECT_EQ(L[WsBuffer::kBwdSymDy].place, WsPlace::kSymmetric);
  EXPECT_EQ(L[WsBuffer::kBwdSymDy].offset, -1);  // a SymLayout field the backward adds
  EXPECT_EQ(L[WsBuffer::kBwdSymDtw].bytes, int64_t{4096} * 8 * 4);
  EXPECT_EQ(L[WsBuffer::kBwdDxSlots].alias, WsBuffer::kSlots);
  // Accessors: block entries from the base, symmetric ones from the own region
  // Addresses only, never dereferenced
  uint8_t* base = reinterpret_cast<uint8_t*>(uintptr_t{1} << 30);
  uint8_t* region = reinterpret_cast<uint8_t*>(uintptr_t{1} << 40);
  static_assert(std::is_same_v<decltype(L.get<WsBuffer::kRows>(nullptr)), uint32_t*>);
  static_assert(std::is_same_v<decltype(L.get<WsBuffer::kRegionsDev>(nullptr)), uint8_t**>);
  static_assert(std::is_same_v<decltype(L.get<WsBuffer::kBwdWgradAcc>(nullptr)), float*>);
  EXPECT_EQ(L.address(WsBuffer::kRing, base), base + L[WsBuffer::kRing].offset);
  EXPECT_EQ(L.address(WsBuffer::kBwdXRing, base), L.address(WsBuffer::kRing, base));
  EXPECT_EQ(L.address(WsBuffer::kSlots, base, region), region + sym.slots);
  EXPECT_EQ(L.address(WsBuffer::kBwdDxSlots, base, region), region + sym.slots);
  EXPECT_EQ(L.address(WsBuffer::kBwdSymDy, base, region), nullptr);
  EXPECT_EQ(L.address(WsBuffer::kUnfusedRing, base, region), nullptr);
  EXPECT_EQ(L.address(WsBuffer::kSharedAct, base, region), nullptr);
  check_geometry(L);
  check_backward_adds_exactly_its_entries(c);
}

TEST(WorkspaceLayout, GeometryOverManyShapes) {
  for (int64_t P : {1, 2, 4, 8})
    for (int64_t Is : {0, 128, 1536})
      for (int64_t T : {1, 300, 4096, 32768}) {
        const mokConfig_t c = config(2048, 768, Is, 64, 8, T, P, P - 1);
        SCOPED_TRACE("P=" + std::to_string(P) + " Is=" + std::to_string(Is) + " T=" + std::to_string(T));
        check_geometry(layout(c, false));
        check_geometry(layout(c, true));
        check_backward_adds_exactly_its_entries(c);
        const WorkspaceLayout L = layout(c, true);
        EXPECT_LE(L.n_acc, L.El);
        EXPECT_LE(L.n_acc, L.n_macro - 1);
      }
}

TEST(WorkspaceLayout, TraceIsSeparateAndSizedBySms) {
  const mokConfig_t c = config(7168, 2048, 0, 16, 8, 4096);
  WorkspaceOptions o;
  o.num_sms = 132;
  o.trace_cap = kWsTraceCap;
  const WorkspaceLayout L = workspace_layout(c, o);
  EXPECT_EQ(L[WsBuffer::kTrace].place, WsPlace::kSeparate);
  EXPECT_EQ(L[WsBuffer::kTrace].bytes, int64_t{132} * MOK_TRACE_RECORDERS * 4096 * sizeof(mokTraceEvent_t));
  EXPECT_EQ(L.total_bytes(), layout(c, false).total_bytes());
}

TEST(WorkspaceLayout, DescriptionListsEveryEntry) {
  for (const mokConfig_t& c : {config(7168, 2048, 0, 16, 8, 4096), config(2048, 768, 2048, 64, 8, 8192),
                               config(7168, 2048, 1024, 16, 8, 4096, 2, 1)}) {
    const std::string text = describe_buffers(c);
    SCOPED_TRACE(text);
    const WorkspaceLayout F = layout(c, false), B = layout(c, true);
    for (int i = 0; i < kNumWsBuffers; ++i) {
      const WsBuffer id = static_cast<WsBuffer>(i);
      if (!B.present(id)) continue;
      const std::string name = ws_name(id);
      EXPECT_NE(text.find(" " + name + " "), std::string::npos) << name;
      EXPECT_NE(text.find(B[id].formula), std::string::npos) << name;
      if (B[id].place == WsPlace::kBlock) {
        // its offset in the layout that holds it
        const WorkspaceLayout& H = ws_is_backward(id) ? B : F;
        EXPECT_NE(text.find("@" + std::to_string(H[id].offset) + " "), std::string::npos) << name;
        EXPECT_NE(text.find(" = " + std::to_string(H[id].bytes) + " B"), std::string::npos) << name;
      }
    }
    EXPECT_NE(text.find("forward total      = " + std::to_string(F.total_bytes()) + " B"), std::string::npos);
    EXPECT_NE(text.find("total with backward = " + std::to_string(B.total_bytes()) + " B"), std::string::npos);
    // Lines that other tests look for
    EXPECT_NE(text.find("plan.rows"), std::string::npos);
    EXPECT_NE(text.find("P*T_max*min(k,E_l) + E_l*(block_m-1)"), std::string::npos);
    EXPECT_NE(text.find("minibatch_size     = " + std::to_string(c.minibatch_size) + " rows"), std::string::npos);
    EXPECT_NE(text.find("ring"), std::string::npos);
    if (c.ep_size > 1) {
      EXPECT_NE(text.find("symmetric region (per rank"), std::string::npos);
    }
  }
  // The CPU backend's description is unchanged: no device block
  mokConfig_t cpu = config(64, 32, 16, 8, 2, 128);
  cpu.device = MOK_DEVICE_CPU;
  const std::string text = describe_buffers(cpu);
  EXPECT_NE(text.find("backend: CPU reference"), std::string::npos);
  EXPECT_EQ(text.find("device block"), std::string::npos);
}

}  // namespace
}  // namespace mok
