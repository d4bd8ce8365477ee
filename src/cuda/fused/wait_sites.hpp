// The sentence of a timeout record (host): which role of which block waited for what, from the
// record's site (common/defs.hpp, WaitSite), detail, expected and observed words.
#pragma once

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "common/defs.hpp"
#include "cuda/fused/schedule.cuh"
#include "cuda/fused/schedule_bwd.cuh"

namespace mok::cuda::fused {

// Counter array `a` of a direction by name (the direction's kCounterArrayNames and CounterArray)
template <class Array, size_t kN>
inline const char* counter_array_name(const char* const (&names)[kN], int32_t a) {
  static_assert(kN == static_cast<size_t>(Array::kNumArrays), "one name per counter array");
  return a >= 0 && a < static_cast<int32_t>(kN) ? names[a] : "?";
}

// t: the record's words [flag, site, block, detail, expected, observed, rank].
inline std::string describe_timeout(const int64_t* t) {
  const auto site = static_cast<WaitSite>(t[1]);
  const int64_t block = t[2], detail = t[3], expected = t[4], observed = t[5];
  std::ostringstream s;
  s << "block " << block << ", ";
  switch (site) {
    case WaitSite::kStageEmpty:
      s << "producer: waiting for the consumers to free stage " << detail;
      break;
    case WaitSite::kStageFull:
      s << "consumer: waiting for TMA to fill stage " << detail;
      break;
    case WaitSite::kTaskCounter:
    case WaitSite::kGatherCounter: {
      const bool fwd = counter_wait_direction(detail) == kForwardDirection;
      const int32_t array = counter_wait_array(detail);
      s << (site == WaitSite::kTaskCounter ? "producer, before a task's loads" : "gather warp, before a row block's gather")
        << ": waiting for " << (fwd ? "forward" : "backward") << " counter "
        << (fwd ? counter_array_name<CounterArray>(kCounterArrayNames, array)
                : counter_array_name<bwd::CounterArray>(bwd::kCounterArrayNames, array))
        << "[" << counter_wait_index(detail)
        << "] >= " << expected;
      if (observed >= 0) s << ", observed " << observed;
      return s.str();
    }
    case WaitSite::kStartBarrier:
    case WaitSite::kEndBarrier:
      s << (site == WaitSite::kStartBarrier ? "start barrier (routing exchange)" : "end barrier (push combine)")
        << ": waiting for peer " << detail << " to reach call " << expected << ", observed " << observed
        << " (a peer that never called, called with another config, or failed earlier)";
      return s.str();
    case WaitSite::kConfigMismatch:
      s << "peer " << detail << "'s symmetric region was created with another configuration";
      return s.str();
    case WaitSite::kTaskSlotFree:
      s << "producer: waiting for the consumers and the signaler to take the task of hand-off slot " << detail;
      break;
    case WaitSite::kTaskSlotFull:
      s << "consumer " << detail << ": waiting for the producer's next task";
      break;
    case WaitSite::kSignalerTaskFull:
      s << "signaler: waiting for the producer's task in hand-off slot " << detail;
      break;
    case WaitSite::kDoneSlotFree:
      s << "consumer: waiting for the signaler to take done slot " << detail;
      break;
    case WaitSite::kDoneSlotFull:
      s << "signaler: waiting for both consumers to finish the tile of done slot " << detail;
      break;
    case WaitSite::kRowCopy:
      s << "comm warp " << detail << ": waiting for a row's bulk load into its staging row";
      break;
    case WaitSite::kPingPongTurn:
      s << "consumer " << detail << " (ping-pong): waiting for the other consumer to finish its tile's K loop";
      break;
    case WaitSite::kMmaTurn:
      s << "consumer " << detail << " (block-scaled): waiting for the other consumer to issue its part's MMAs";
      break;
    case WaitSite::kGridBarrier:
      s << "end phase: waiting for every block to arrive" << (detail > 0 ? " (EP: the second arrival)" : "")
        << ", " << expected << " arrivals";
      if (observed >= 0) s << ", observed " << observed;
      return s.str();
    default:
      s << "wait site " << t[1] << ", detail " << detail;
      break;
  }
  s << " (mbarrier phase " << expected << ")";
  return s.str();
}

}  // namespace mok::cuda::fused
