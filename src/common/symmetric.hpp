// Byte map of an EP rank's symmetric region (the same on every rank; docs/design.md).
// Host and device code alike; offsets are 1 KB aligned.
//
//   header       1 KB                [0] = fingerprint of the creating rank's configuration
//   flags_start  kMaxRanks x int64   [s] = sequence number of rank s's last started call
//   flags_end    kMaxRanks x int64   [s] = sequence number of rank s's last call whose pushes landed
//   tokens       kMaxRanks x int64   [s] = T_s of rank s's current call
//   routing      P x T_max x k x int64   [s] = rank s's topk_ids of the current call
//   x            T_max x H x bf16    this rank's x of the current call (peers pull from it);
//                                    fp8_block's forward: x quantised per token instead, its e4m3
//                                    rows (T_max x H) then their scales at x8_scales ([H/128,
//                                    T_max rounded up to 4] f32, k-block-major), half the bytes
//   slots        T_max x k x H x bf16  one output row per route of this rank's tokens (peers push;
//                                    the backward: the dx row of each route)
//   dy           T_max x H x bf16    this rank's dy of the current backward (peers pull)
//   weights      T_max x k x f32     this rank's topk_weights of the current backward (peers read)
//   dtw          T_max x k x f32     d topk_weights of each route of this rank's tokens (peers push)
#pragma once

#include <cstdint>

#include "common/defs.hpp"

namespace mok {

struct SymLayout {
  int64_t header = 0, flags_start = 0, flags_end = 0, tokens = 0, routing = 0, x = 0, slots = 0, bytes = 0;
  int64_t x8_scales = 0;  // fp8_block's forward: the scales of the e4m3 rows at x (inside x's bytes)
  int64_t dy = 0, weights = 0, dtw = 0;  // the backward's
  int64_t routing_rank_stride = 0;  // bytes between routing[s] and routing[s + 1]
};

MOK_HD int64_t sym_align(int64_t v) { return (v + 1023) / 1024 * 1024; }

MOK_HD SymLayout sym_layout(int64_t num_ranks, int64_t max_tokens, int64_t topk, int64_t hidden) {
  SymLayout l;
  int64_t at = 0;
  l.header = at;
  at = sym_align(at + 8);
  l.flags_start = at;
  at = sym_align(at + kMaxRanks * 8);
  l.flags_end = at;
  at = sym_align(at + kMaxRanks * 8);
  l.tokens = at;
  at = sym_align(at + kMaxRanks * 8);
  l.routing = at;
  l.routing_rank_stride = sym_align(max_tokens * topk * 8);
  at += num_ranks * l.routing_rank_stride;
  l.x = at;
  // (H % 128 == 0 under fp8_block: T_max·H + (H/128)·align4(T_max)·4 <= 2·T_max·H bytes)
  l.x8_scales = at + max_tokens * hidden;
  at = sym_align(at + max_tokens * hidden * 2);
  l.slots = at;
  at = sym_align(at + max_tokens * topk * hidden * 2);
  l.dy = at;
  at = sym_align(at + max_tokens * hidden * 2);
  l.weights = at;
  at = sym_align(at + max_tokens * topk * 4);
  l.dtw = at;
  at = sym_align(at + max_tokens * topk * 4);
  l.bytes = at;
  return l;
}

// Fingerprint of what must agree across the ranks of a group (the byte map and the layer):
// written into a region's header at creation, compared before a call touches a peer's region.
MOK_HD uint64_t sym_fingerprint(const int64_t* fields, int n) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the 8-byte fields
  for (int i = 0; i < n; ++i)
    for (int b = 0; b < 8; ++b) {
      h ^= (static_cast<uint64_t>(fields[i]) >> (8 * b)) & 0xFFu;
      h *= 0x100000001b3ull;
    }
  return h | 1ull;  // never 0 (an unwritten header)
}

}  // namespace mok
