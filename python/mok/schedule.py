"""The routing plan (Schedule): its capacity (plan_capacity), its tensors
(build_schedule_tensors) and the Schedule object over them (build_schedule).

mok.functional re-exports all of it.
"""
from __future__ import annotations

from ctypes import byref
from typing import List, Optional, Tuple

import torch

from . import _lib
from .config import LayerDims, MoKConfig, _alloc, _c_config


# Row record of the plan: bits [0, 21) token, [21, 26) j, [26, 32) source rank.
TOKEN_BITS = 21
SLOT_BITS = 5
PAD_ROW = -1  # 0xFFFFFFFF seen as int32
NO_ERROR = 0x7FFFFFFFFFFFFFFF
ROUTE_CHECK_NAMES = {2: "outside [-1, num_experts)", 3: "a duplicate within the token"}


class Schedule:
    """The routing plan of one rank: rows of each local expert in canonical (rank, token, j)
    order, each expert's segment padded to block_m with PAD_ROW."""

    def __init__(self, rows, expert_count, expert_offset, block_expert, error, *, num_experts, ep_size,
                 ep_rank, topk, block_m):
        self.rows = rows                    # [max_rows] int32 view of uint32 records
        self.expert_count = expert_count    # [E_l] int32
        self.expert_offset = expert_offset  # [E_l + 1] int32
        self.block_expert = block_expert    # [max_blocks] int32, -1 past the end
        self.error = error                  # [4] int64: key, id, kind, reserved
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.topk = topk
        self.block_m = block_m

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def num_rows(self) -> int:
        """Routed rows (padding excluded)."""
        return int(self.expert_count.sum())

    @property
    def num_padded_rows(self) -> int:
        """Rows after padding each expert's segment to block_m (expert_offset[E_l])."""
        return int(self.expert_offset[-1])

    @staticmethod
    def decode_records(records: torch.Tensor) -> List[Tuple[int, int, int]]:
        """(rank, token, j) of each int32 row record."""
        r = records.to(torch.int64) & 0xFFFFFFFF
        token = r & ((1 << TOKEN_BITS) - 1)
        j = (r >> TOKEN_BITS) & ((1 << SLOT_BITS) - 1)
        rank = r >> (TOKEN_BITS + SLOT_BITS)
        return list(zip(rank.tolist(), token.tolist(), j.tolist()))

    def decode(self) -> List[List[Tuple[int, int, int]]]:
        """Per local expert, its routed rows as (rank, token, j), padding excluded."""
        rows = self.rows.cpu()
        count = self.expert_count.tolist()
        offset = self.expert_offset.tolist()
        return [self.decode_records(rows[offset[e]:offset[e] + count[e]]) for e in range(len(count))]

    def first_error(self) -> Optional[Tuple[int, int, int, int, int]]:
        """(rank, token, j, id, kind) of the first bad route, or None (synchronises)."""
        key, bad_id, kind, _ = self.error.tolist()
        if key == NO_ERROR:
            return None
        return key >> 40, (key >> 8) & 0xFFFFFFFF, key & 0xFF, bad_id, kind

    def check(self) -> None:
        """Synchronises and raises ValueError if device-side validation masked a bad route."""
        bad = self.first_error()
        if bad is not None:
            rank, token, j, bad_id, kind = bad
            raise ValueError(f"rank {rank}: topk_ids[{token}, {j}] = {bad_id} is "
                             f"{ROUTE_CHECK_NAMES.get(kind, f'invalid (kind {kind})')}; the route was masked")

    def __str__(self) -> str:
        first = self.ep_rank * self.num_local_experts
        lines = [f"mok schedule: rank {self.ep_rank}/{self.ep_size}, E={self.num_experts} "
                 f"(local {first}..{first + self.num_local_experts - 1}), k={self.topk}, "
                 f"block_m={self.block_m}, rows {self.num_rows} routed / {self.num_padded_rows} padded "
                 f"/ {self.rows.numel()} capacity",
                 f"{'expert':>8} {'count':>7} {'offset':>7} {'padded':>7}  rows (rank, token, j)"]
        offsets = self.expert_offset.tolist()
        for e, rows in enumerate(self.decode()):
            shown = " ".join(f"({r},{t},{j})" for r, t, j in rows[:8])
            more = f" ... +{len(rows) - 8}" if len(rows) > 8 else ""
            lines.append(f"{first + e:>8} {len(rows):>7} {offsets[e]:>7} {offsets[e + 1] - offsets[e]:>7}  "
                         f"{shown}{more}")
        bad = self.first_error()
        if bad is not None:
            lines.append(f"first bad route: rank {bad[0]} token {bad[1]} j {bad[2]} id {bad[3]}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Schedule(rank={self.ep_rank}, ep_size={self.ep_size}, num_experts={self.num_experts}, "
                f"rows={self.rows.numel()}, device={self.rows.device})")


def _ids_list(topk_ids) -> List[torch.Tensor]:
    ids = [topk_ids] if isinstance(topk_ids, torch.Tensor) else list(topk_ids)
    if not ids:
        raise ValueError("build_schedule: topk_ids is an empty list; give one tensor per rank")
    for s, t in enumerate(ids):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"rank {s} topk_ids must be a 2-D tensor [T, k], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    return ids


def plan_capacity(num_experts: int, topk: int, max_tokens: int, ep_size: int = 1,
                  config: Optional[MoKConfig] = None) -> Tuple[int, int, int]:
    """(max_rows, max_blocks, num_local_experts) of a plan (mokPlanGetCapacity)."""
    dims = LayerDims(0, 0, num_experts, topk, max_tokens, 0, ep_size, 0)
    c = _c_config(dims, config, _lib.DEVICE_CPU)
    cap = _lib.mokPlanCapacity()
    _lib.check(_lib.lib.mokPlanGetCapacity(byref(c), byref(cap)))
    return cap.max_rows, cap.max_blocks, cap.num_local_experts


def build_schedule_tensors(topk_ids, num_experts: int, *, ep_size: Optional[int] = None, ep_rank: int = 0,
                           max_tokens: Optional[int] = None, config: Optional[MoKConfig] = None):
    """The plan's tensors (rows, expert_count, expert_offset, block_expert, error)."""
    ids = _ids_list(topk_ids)
    ep_size = len(ids) if ep_size is None else ep_size
    topk = ids[0].shape[1]
    if max_tokens is None:
        max_tokens = max(t.shape[0] for t in ids)
    # Size the arrays from the C capacity formula, on the ids' device.
    dims = LayerDims(0, 0, num_experts, topk, max_tokens, 0, ep_size, ep_rank)
    device = ids[0].device
    c = _c_config(dims, config, _lib.device_index(device, "rank 0 topk_ids"))
    cap = _lib.mokPlanCapacity()
    _lib.check(_lib.lib.mokPlanGetCapacity(byref(c), byref(cap)))
    rows = _alloc((cap.max_rows,), torch.int32, device)
    expert_count = _alloc((cap.num_local_experts,), torch.int32, device)
    expert_offset = _alloc((cap.num_local_experts + 1,), torch.int32, device)
    block_expert = _alloc((cap.max_blocks,), torch.int32, device)
    error = _alloc((4,), torch.int64, device)
    # Build (device views: on the current stream, no synchronisation).
    views = _lib.Views()
    id_views = (_lib.mokTensor * len(ids))(*[views(t, f"rank {s} topk_ids", _lib.IDS) for s, t in enumerate(ids)])
    args = _lib.mokPlanArgs(
        num_ranks=len(ids), topk_ids=id_views, rows=views(rows), expert_count=views(expert_count),
        expert_offset=views(expert_offset), block_expert=views(block_expert), error=views(error))
    _lib.check(_lib.lib.mokPlanBuild(byref(c), byref(args), _lib.stream_of(_lib.device_index(device))))
    return rows, expert_count, expert_offset, block_expert, error


def build_schedule(topk_ids, num_experts: int, *, ep_size: Optional[int] = None, ep_rank: int = 0,
                   max_tokens: Optional[int] = None, config: Optional[MoKConfig] = None) -> Schedule:
    """The routing plan of rank `ep_rank` from the gathered routing (a tensor for P = 1, or a
    list of P tensors). Host ids with a bad route raise ValueError; device ids are masked and
    recorded in schedule.error (see Schedule.check)."""
    ids = _ids_list(topk_ids)
    tensors = build_schedule_tensors(ids, num_experts, ep_size=ep_size, ep_rank=ep_rank,
                                     max_tokens=max_tokens, config=config)
    return Schedule(*tensors, num_experts=num_experts, ep_size=len(ids) if ep_size is None else ep_size,
                    ep_rank=ep_rank, topk=ids[0].shape[1], block_m=(config or MoKConfig()).block_m)
