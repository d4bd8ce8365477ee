// One home for the definitions that cross host and device: limits, the row-record
// encoding of the plan, the device error record.  Compiled by g++ and nvcc alike.
#pragma once

#include <cstdint>

#include "mok/mok.h"

#if defined(__CUDACC__)
#define MOK_HD __host__ __device__ __forceinline__
#else
#define MOK_HD inline
#endif

namespace mok {

// ceil(a / b) for a >= 0, b > 0: the one home of the rounding (plan row blocks, tile counts)
MOK_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Limits.  The row record packs (rank, token, j) into 32 bits; these widths are the
// contract between the plan builder and every kernel that decodes it.
inline constexpr int kRankBits = 6;
inline constexpr int kSlotBits = 5;   // j, the route index within a token
inline constexpr int kTokenBits = 21;
static_assert(kRankBits + kSlotBits + kTokenBits == 32, "row record must be one 32-bit word");

inline constexpr int kMaxRanks = 1 << kRankBits;             // P <= 64
inline constexpr int kMaxTopK = 1 << kSlotBits;              // k <= 32
inline constexpr int64_t kMaxTokens = (1 << kTokenBits) - 1; // T_max < 2^21 - 1 (all-ones = padding)

// Row record: bits [0, 21) token, [21, 26) j, [26, 32) source rank.
// All ones marks a padding row (zero-filled, never combined).
inline constexpr uint32_t kPadRow = 0xFFFFFFFFu;

static_assert(kTokenBits == MOK_ROW_TOKEN_BITS && kSlotBits == MOK_ROW_SLOT_BITS && kRankBits == MOK_ROW_RANK_BITS,
              "row record widths differ from the public header");
static_assert(kPadRow == MOK_PAD_ROW, "padding row differs from the public header");

MOK_HD uint32_t encode_row(int rank, int64_t token, int j) {
  return (static_cast<uint32_t>(rank) << (kTokenBits + kSlotBits)) |
         (static_cast<uint32_t>(j) << kTokenBits) | static_cast<uint32_t>(token);
}
MOK_HD int row_rank(uint32_t r) { return static_cast<int>(r >> (kTokenBits + kSlotBits)); }
MOK_HD int row_slot(uint32_t r) { return static_cast<int>((r >> kTokenBits) & ((1u << kSlotBits) - 1)); }
MOK_HD int64_t row_token(uint32_t r) { return static_cast<int64_t>(r & ((1u << kTokenBits) - 1)); }
MOK_HD bool row_is_pad(uint32_t r) { return r == kPadRow; }

// What validation can say about one route id.
enum class RouteCheck : int32_t {
  kOk = mokRouteOk,                  // a real route
  kMasked = mokRouteMasked,          // -1: no selection
  kOutOfRange = mokRouteOutOfRange,  // id < -1 or id >= E
  kDuplicate = mokRouteDuplicate,    // the same id at an earlier j of the same token
};

// Device error record, 4 x int64 in the workspace (or the plan arguments):
//   [0] key of the first bad route: (rank << 40) | (token << 8) | j; INT64_MAX when none
//   [1] the bad id, [2] RouteCheck, [3] reserved (timeouts use their own record)
inline constexpr int kErrorWords = 4;
inline constexpr int64_t kNoError = MOK_NO_ERROR_KEY;
MOK_HD int64_t error_key(int rank, int64_t token, int j) {
  return (static_cast<int64_t>(rank) << 40) | (token << 8) | static_cast<int64_t>(j);
}
MOK_HD int error_key_rank(int64_t key) { return static_cast<int>(key >> 40); }
MOK_HD int64_t error_key_token(int64_t key) { return (key >> 8) & ((1ll << 32) - 1); }
MOK_HD int error_key_slot(int64_t key) { return static_cast<int>(key & 0xFF); }

// Where a device wait passed its deadline: the site word of a kernel's timeout record
// ([flag, site, block, detail, expected, observed, rank]; gemm::report_timeout).  The site
// names the role and what it waited for, `detail` which one; the host turns the record into a
// sentence (cuda/fused/wait_sites.hpp, describe_timeout).
enum class WaitSite : int32_t {
  kStageEmpty = 1,        // a GEMM producer: both consumers free stage `detail`
  kStageFull = 2,         // a GEMM consumer: TMA fills stage `detail`
  kTaskCounter = 3,       // the fused producer, before a task's loads: counter_wait_detail
  kStartBarrier = 4,      // EP: peer `detail` reaches the call's start (routing exchange)
  kEndBarrier = 5,        // EP: peer `detail`'s pushes landed (end barrier)
  kConfigMismatch = 6,    // EP: peer `detail`'s region was created with another configuration
  kGatherCounter = 7,     // a gather warp (comm, or EP = 1's), before a row block's gather: counter_wait_detail
  kTaskSlotFree = 8,      // the fused producer: consumers and signaler took hand-off slot `detail`
  kTaskSlotFull = 9,      // fused consumer `detail` (0, 1): the producer's next task
  kSignalerTaskFull = 10, // the fused signaler: the producer's task in hand-off slot `detail`
  kDoneSlotFree = 11,     // a fused consumer: the signaler took done slot `detail`
  kDoneSlotFull = 12,     // the fused signaler: both consumers finished the tile of done slot `detail`
  kRowCopy = 13,          // comm warp `detail`: one x or dy row's bulk load into its staging row
  kGridBarrier = 14,      // the end phase: every block arrived (`detail`: the round, 1 = EP's second)
  kPingPongTurn = 15,     // ping-pong GEMM consumer `detail`: the other finished its tile's K loop
  kMmaTurn = 16,          // promoted (fp8) GEMM consumer `detail`: the other issued its part's MMAs
  kLastWaitSite = kMmaTurn,
};

// The detail of a counter wait: the direction, its counter array (cuda/fused/schedule.cuh,
// schedule_bwd.cuh: CounterArray) and the index in it.
inline constexpr int kForwardDirection = 0, kBackwardDirection = 1;
MOK_HD int64_t counter_wait_detail(int direction, int32_t array, int32_t index) {
  return (static_cast<int64_t>(direction) << 48) | (static_cast<int64_t>(array) << 32) | static_cast<uint32_t>(index);
}
MOK_HD int counter_wait_direction(int64_t detail) { return static_cast<int>(detail >> 48); }
MOK_HD int32_t counter_wait_array(int64_t detail) { return static_cast<int32_t>((detail >> 32) & 0xFFFF); }
MOK_HD int32_t counter_wait_index(int64_t detail) { return static_cast<int32_t>(detail & 0xFFFFFFFF); }

}  // namespace mok
