// The task table both fused directions build (schedule.cuh, schedule_bwd.cuh): a list of
// segments, each the tiles of one kind over a range of units (row blocks, token blocks or
// experts), numbered in order; built identically on every block and on the host.  What differs
// between the directions is the order of the segments (their build_segments) and the walk of
// the tiles inside one (their decode_task).
#pragma once

#include <cstdint>

#include "common/defs.hpp"

namespace mok::cuda::fused {

struct Segment {
  int32_t kind;        // the direction's TaskKind (or a kind of its own: the backward's kSegmentWgrad)
  int32_t first;       // the first unit
  int32_t count;       // units
  int32_t num_n;       // tiles per unit
  int32_t macro;       // the backward's wgrad segments: their macrobatch (-1: experts without rows); else 0
  int32_t first_task;  // index of the segment's first tile in the task list
};

// Appends segments to a table; empty ones (no units or no tiles) are left out.
struct SegmentWriter {
  Segment* seg;
  int n = 0;
  int32_t task = 0;  // the next segment's first task
  MOK_HD void push(int32_t kind, int32_t first, int32_t count, int32_t num_n, int32_t macro = 0) {
    if (count <= 0 || num_n <= 0) return;
    seg[n++] = Segment{kind, first, count, num_n, macro, task};
    task += count * num_n;
  }
};

// The segment that holds task `task` (binary search over first_task; num_segments >= 1).
MOK_HD const Segment& segment_of(const Segment* seg, int num_segments, int32_t task) {
  int lo = 0, hi = num_segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (seg[mid].first_task <= task) lo = mid; else hi = mid - 1;
  }
  return seg[lo];
}

}  // namespace mok::cuda::fused
