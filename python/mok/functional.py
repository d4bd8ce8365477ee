"""mok's functional layer (mirrors MoK's): config, workspaces, schedule, forward, backward.

CPU tensors run the C++ reference backend. CUDA tensors run the CUDA backend where it is
built (the routing plan today); the layer kernels raise NotImplementedError until they are.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
from ctypes import byref
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import _lib

WEIGHT_NAMES = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")
ROUTED_NAMES = WEIGHT_NAMES[:3]

# Row record of the plan: bits [0, 21) token, [21, 26) j, [26, 32) source rank.
TOKEN_BITS = 21
SLOT_BITS = 5
PAD_ROW = -1  # 0xFFFFFFFF seen as int32
NO_ERROR = 0x7FFFFFFFFFFFFFFF
ROUTE_CHECK_NAMES = {2: "outside [-1, num_experts)", 3: "a duplicate within the token"}

# Debugging aid: fill every output with NaN (or a junk integer) before the C side writes it,
# so that an element it fails to write shows up.  Tests turn it on.
poison_outputs = os.environ.get("MOK_POISON_OUTPUTS", "0") not in ("", "0")


def _alloc(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not poison_outputs:
        return torch.empty(shape, dtype=dtype, device=device)
    fill = float("nan") if dtype.is_floating_point else -559038737  # 0xDEADBEEF as int32
    return torch.full(shape, fill, dtype=dtype, device=device)


@dataclasses.dataclass(frozen=True)
class MoKConfig:
    """Runtime knobs of a mok layer (the dimensions come from the workspace)."""

    fwd_num_comm_sms: int = 8
    bwd_num_comm_sms: int = 8
    minibatch_size: int = 1024
    macrobatch_size: int = 16384
    block_m: int = 128
    schedule_capacity_multiplier: float = 1.0
    precision: str = "bf16"
    timeout_s: float = 60.0
    num_threads: int = 0


class LayerDims(NamedTuple):
    """Dimensions a workspace is built for (per rank)."""

    hidden: int
    intermediate: int
    num_experts: int
    topk: int
    max_tokens: int
    shared_intermediate: int = 0
    ep_size: int = 1
    ep_rank: int = 0


def _c_config(dims: LayerDims, config: Optional[MoKConfig], device: int) -> _lib.mokConfig:
    config = config or MoKConfig()
    if config.precision not in _lib.PRECISIONS:
        raise ValueError(f"config.precision = {config.precision!r}; expected one of {sorted(_lib.PRECISIONS)}")
    c = _lib.default_config()
    for name in LayerDims._fields:
        setattr(c, name, int(getattr(dims, name)))
    for field in dataclasses.fields(MoKConfig):
        if field.name != "precision":
            setattr(c, field.name, getattr(config, field.name))
    c.precision = _lib.PRECISIONS[config.precision]
    c.device = device
    return c


class Workspace:
    """A mok workspace: owns the C handle (destroyed on close() or garbage collection)."""

    def __init__(self, dims: LayerDims, config: MoKConfig, device: torch.device) -> None:
        self.dims = dims
        self.config = config
        self.device = torch.device(device)
        self._handle = ctypes.c_void_p()
        c = _c_config(dims, config, _lib.device_index(self.device))
        _lib.check(_lib.lib.mokWorkspaceCreate(byref(c), byref(self._handle)))

    @property
    def handle(self) -> ctypes.c_void_p:
        if not self._handle:
            raise RuntimeError("mok workspace is closed")
        return self._handle

    def close(self) -> None:
        if getattr(self, "_handle", None):
            _lib.check(_lib.lib.mokWorkspaceDestroy(self._handle))
            self._handle = ctypes.c_void_p()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def describe(self) -> str:
        """The C side's description of the buffers and their size formulas."""
        needed = ctypes.c_size_t(0)
        _lib.check(_lib.lib.mokWorkspaceDescribe(self.handle, None, 0, byref(needed)))
        buffer = ctypes.create_string_buffer(needed.value)
        _lib.check(_lib.lib.mokWorkspaceDescribe(self.handle, buffer, needed.value, None))
        return buffer.value.decode()

    def check_errors(self, wait: bool = True) -> None:
        """Raises what device-side checks recorded in earlier calls: ValueError for a route the
        device masked (naming rank, token, j and id), RuntimeError for a wait past its deadline.
        wait=False looks only at copies that already landed (no synchronisation)."""
        _lib.check(_lib.lib.mokWorkspaceCheckErrors(self.handle, 1 if wait else 0))

    def read_trace(self) -> torch.Tensor:
        """The timing ring of the last fused call as int64 [N, 7] (begin_ns, end_ns, role,
        kind, block, detail, recording block), unused events dropped.  Needs MOK_TRACE=1 when
        the workspace was created (mok.h, mokTraceEvent_t)."""
        needed, cap = ctypes.c_size_t(0), ctypes.c_int64(0)
        _lib.check(_lib.lib.mokWorkspaceReadTrace(self.handle, None, 0, byref(needed), byref(cap)))
        if needed.value == 0:
            raise RuntimeError("this workspace records no trace: set MOK_TRACE=1 before creating it")
        raw = torch.empty(needed.value // 8, dtype=torch.int64)
        _lib.check(_lib.lib.mokWorkspaceReadTrace(self.handle, ctypes.c_void_p(raw.data_ptr()), needed.value,
                                                  None, None))
        ev = raw.view(-1, 4)
        recorder_block = torch.arange(ev.shape[0]) // (cap.value * _lib.TRACE_RECORDERS)
        out = torch.stack([ev[:, 0], ev[:, 1], ev[:, 2] & 0xFFFFFFFF, ev[:, 2] >> 32, (ev[:, 3] << 32) >> 32,
                           ev[:, 3] >> 32, recorder_block], dim=1)
        return out[ev[:, 0] != 0]

    def c_config(self) -> _lib.mokConfig:
        """The config the C side holds for this workspace."""
        c = _lib.default_config()
        _lib.check(_lib.lib.mokWorkspaceGetConfig(self.handle, byref(c)))
        return c

    def __repr__(self) -> str:
        return f"Workspace({self.dims}, {self.config}, device={self.device})"


def _group_size_rank(group, ep_size: int, ep_rank: int) -> Tuple[int, int]:
    if group is None:
        return ep_size, ep_rank
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def _dims(hidden, intermediate, num_experts, topk, max_tokens, shared_intermediate, ep_size, ep_rank, group):
    ep_size, ep_rank = _group_size_rank(group, ep_size, ep_rank)
    return LayerDims(int(hidden), int(intermediate), int(num_experts), int(topk), int(max_tokens),
                     int(shared_intermediate), int(ep_size), int(ep_rank))


def _canonical_device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def create_workspace(hidden: int, intermediate: int, num_experts: int, topk: int, max_tokens: int,
                     shared_intermediate: int = 0, ep_size: int = 1, ep_rank: int = 0,
                     device: Union[str, torch.device] = "cpu", config: Optional[MoKConfig] = None,
                     group=None) -> Workspace:
    """A new workspace for these dimensions; with `group`, P and r come from the process group."""
    dims = _dims(hidden, intermediate, num_experts, topk, max_tokens, shared_intermediate, ep_size, ep_rank, group)
    return Workspace(dims, config or MoKConfig(), _canonical_device(device))


_cache: Dict[tuple, Workspace] = {}
_cache_lock = threading.Lock()


def get_workspace(hidden: int, intermediate: int, num_experts: int, topk: int, max_tokens: int,
                  shared_intermediate: int = 0, ep_size: int = 1, ep_rank: int = 0,
                  device: Union[str, torch.device] = "cpu", config: Optional[MoKConfig] = None,
                  group=None) -> Workspace:
    """Like create_workspace, cached per (group, device, dims, config)."""
    dims = _dims(hidden, intermediate, num_experts, topk, max_tokens, shared_intermediate, ep_size, ep_rank, group)
    device = _canonical_device(device)
    config = config or MoKConfig()
    key = (group, str(device), dims, config)
    with _cache_lock:
        ws = _cache.get(key)
        if ws is None:
            ws = _cache[key] = Workspace(dims, config, device)
        return ws


def clear_workspace_cache() -> None:
    with _cache_lock:
        _cache.clear()


# ---------------------------------------------------------------------------------------
# Schedule (the routing plan)


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
    c = _c_config(dims, config, _lib.device_index(device))
    cap = _lib.mokPlanCapacity()
    _lib.check(_lib.lib.mokPlanGetCapacity(byref(c), byref(cap)))
    rows = _alloc((cap.max_rows,), torch.int32, device)
    expert_count = _alloc((cap.num_local_experts,), torch.int32, device)
    expert_offset = _alloc((cap.num_local_experts + 1,), torch.int32, device)
    block_expert = _alloc((cap.max_blocks,), torch.int32, device)
    error = _alloc((4,), torch.int64, device)
    # Build (device views: on the current stream, no synchronisation).
    views = _lib.Views()
    id_views = (_lib.mokTensor * len(ids))(*[views(t, f"rank {s} topk_ids") for s, t in enumerate(ids)])
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


# ---------------------------------------------------------------------------------------
# Forward and backward (one rank, EP = 1 in the call)


@dataclasses.dataclass
class ForwardContext:
    """What backward needs: the forward inputs and the workspace."""

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    weights: Dict[str, Optional[torch.Tensor]]
    workspace: Workspace


@dataclasses.dataclass
class Gradients:
    """Gradients of one backward call (shared-expert ones are None without a shared expert)."""

    dx: torch.Tensor
    d_topk_weights: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    ws_gate: Optional[torch.Tensor] = None
    ws_up: Optional[torch.Tensor] = None
    ws_down: Optional[torch.Tensor] = None


def _weights_dict(w_gate, w_up, w_down, ws_gate, ws_up, ws_down) -> Dict[str, Optional[torch.Tensor]]:
    return dict(w_gate=w_gate, w_up=w_up, w_down=w_down, ws_gate=ws_gate, ws_up=ws_up, ws_down=ws_down)


def _shape_of(t, name: str, ndim: int) -> Tuple[int, ...]:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {list(t.shape)}")
    return tuple(t.shape)


def token_bucket(num_tokens: int) -> int:
    """max_tokens of the automatic workspace: T rounded up to a power of two (at least 1)."""
    return 1 << max(int(num_tokens) - 1, 0).bit_length()


def _auto_workspace(x, topk_ids, weights, config) -> Workspace:
    num_tokens, _ = _shape_of(x, "x", 2)
    _, topk = _shape_of(topk_ids, "topk_ids", 2)
    num_experts, intermediate, hidden = _shape_of(weights["w_gate"], "w_gate", 3)
    shared = 0
    if weights["ws_gate"] is not None:
        shared = _shape_of(weights["ws_gate"], "ws_gate", 2)[0]
    return get_workspace(hidden, intermediate, num_experts, topk, token_bucket(num_tokens),
                         shared_intermediate=shared, device=x.device, config=config)


def _resolve_workspace(workspace, config, x, topk_ids, weights) -> Workspace:
    if workspace is None:
        return _auto_workspace(x, topk_ids, weights, config)
    if config is not None and config != workspace.config:
        raise ValueError(f"config {config} differs from the workspace's {workspace.config}; pass one of them")
    if _canonical_device(x.device) != workspace.device:
        raise ValueError(f"x is on {x.device} but the workspace was built for {workspace.device}")
    return workspace


def _forward_args(views: _lib.Views, ctx: ForwardContext, y: Optional[torch.Tensor]) -> _lib.mokForwardArgs:
    return _lib.mokForwardArgs(x=views(ctx.x, "x"), topk_ids=views(ctx.topk_ids, "topk_ids"),
                               topk_weights=views(ctx.topk_weights, "topk_weights"),
                               weights=views.weights(ctx.weights), y=views(y, "y"))


def recompute_forward_context(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None,
                              ws_down=None, *, workspace: Optional[Workspace] = None,
                              config: Optional[MoKConfig] = None) -> ForwardContext:
    """The context forward would return, without computing y (activation checkpointing)."""
    weights = _weights_dict(w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    ws = _resolve_workspace(workspace, config, x, topk_ids, weights)
    return ForwardContext(x, topk_ids, topk_weights, weights, ws)


def forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None, *,
            workspace: Optional[Workspace] = None,
            config: Optional[MoKConfig] = None) -> Tuple[torch.Tensor, ForwardContext]:
    """y [T, H] bf16 of one rank's MoE layer, and the context for backward."""
    ctx = recompute_forward_context(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                                    workspace=workspace, config=config)
    num_tokens, hidden = _shape_of(x, "x", 2)
    y = _alloc((num_tokens, hidden), torch.bfloat16, x.device)
    views = _lib.Views()
    args = _forward_args(views, ctx, y)
    _lib.check(_lib.lib.mokForward(ctx.workspace.handle, byref(args),
                                   _lib.stream_of(_lib.device_index(x.device))))
    return y, ctx


def _grad_buffers(x, topk_ids, weights, out_dtype=torch.bfloat16):
    num_tokens, hidden = _shape_of(x, "x", 2)
    _, topk = _shape_of(topk_ids, "topk_ids", 2)
    grads = {name: (None if w is None else _alloc(tuple(w.shape), out_dtype, w.device))
             for name, w in weights.items()}
    dx = _alloc((num_tokens, hidden), torch.bfloat16, x.device)
    d_topk_weights = _alloc((num_tokens, topk), torch.float32, x.device)
    return dx, d_topk_weights, grads


def _check_main_grads(main_grads: Optional[Mapping[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    main_grads = dict(main_grads or {})
    unknown = set(main_grads) - set(WEIGHT_NAMES)
    if unknown:
        raise ValueError(f"main_grads has unknown names {sorted(unknown)}; expected some of {WEIGHT_NAMES}")
    return main_grads


def _backward_args(views: _lib.Views, ctx: ForwardContext, dy, dx, d_topk_weights, grads, main_grads):
    return _lib.mokBackwardArgs(fwd=_forward_args(views, ctx, None), dy=views(dy, "dy"), dx=views(dx, "dx"),
                                d_topk_weights=views(d_topk_weights, "d_topk_weights"),
                                grads=views.weights(grads, "grad of "),
                                main_grads=views.weights(main_grads, "main_grad of "))


def backward(ctx: ForwardContext, dy: torch.Tensor,
             main_grads: Optional[Mapping[str, torch.Tensor]] = None) -> Gradients:
    """Gradients of one rank's layer given dy [T, H] bf16. `main_grads` (name -> fp32 tensor
    shaped like the weight) are accumulated into: main_grad += fp32 gradient."""
    main_grads = _check_main_grads(main_grads)
    dx, d_topk_weights, grads = _grad_buffers(ctx.x, ctx.topk_ids, ctx.weights)
    views = _lib.Views()
    args = _backward_args(views, ctx, dy, dx, d_topk_weights, grads, main_grads)
    _lib.check(_lib.lib.mokBackward(ctx.workspace.handle, byref(args),
                                    _lib.stream_of(_lib.device_index(ctx.x.device))))
    return Gradients(dx, d_topk_weights, **grads)


# ---------------------------------------------------------------------------------------
# The EP group emulated in one process (CPU reference)


@dataclasses.dataclass
class RankInputs:
    """One rank of an emulated EP group: its tokens, routing and local weights."""

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    ws_gate: Optional[torch.Tensor] = None
    ws_up: Optional[torch.Tensor] = None
    ws_down: Optional[torch.Tensor] = None


def _rank_inputs(ranks) -> List[RankInputs]:
    out = []
    for r in ranks:
        out.append(r if isinstance(r, RankInputs) else RankInputs(**dict(r)))
    if not out:
        raise ValueError("the emulated EP group needs at least one rank")
    return out


def _emulated_config(ranks: List[RankInputs], num_experts, config, shared_intermediate) -> _lib.mokConfig:
    first = ranks[0]
    _, intermediate, hidden = _shape_of(first.w_gate, "rank 0 w_gate", 3)
    _, topk = _shape_of(first.topk_ids, "rank 0 topk_ids", 2)
    if shared_intermediate is None:
        shared_intermediate = 0 if first.ws_gate is None else _shape_of(first.ws_gate, "rank 0 ws_gate", 2)[0]
    max_tokens = max(_shape_of(r.x, f"rank {s} x", 2)[0] for s, r in enumerate(ranks))
    dims = LayerDims(hidden, intermediate, num_experts, topk, max_tokens, shared_intermediate, len(ranks), 0)
    return _c_config(dims, config, _lib.DEVICE_CPU)


def _rank_context(rank: RankInputs) -> ForwardContext:
    weights = _weights_dict(rank.w_gate, rank.w_up, rank.w_down, rank.ws_gate, rank.ws_up, rank.ws_down)
    return ForwardContext(rank.x, rank.topk_ids, rank.topk_weights, weights, None)


def forward_emulated(ranks, *, num_experts: int, config: Optional[MoKConfig] = None,
                     shared_intermediate: Optional[int] = None) -> List[torch.Tensor]:
    """y of every rank of an EP group of P = len(ranks), emulated on the CPU reference.
    Rank r holds experts r*E/P .. (r+1)*E/P - 1. `shared_intermediate` defaults to
    rank 0's ws_gate rows (0 without a shared expert)."""
    ranks = _rank_inputs(ranks)
    c = _emulated_config(ranks, num_experts, config, shared_intermediate)
    views = _lib.Views()
    ys, args = [], (_lib.mokForwardArgs * len(ranks))()
    for s, rank in enumerate(ranks):
        num_tokens, hidden = _shape_of(rank.x, f"rank {s} x", 2)
        ys.append(_alloc((num_tokens, hidden), torch.bfloat16, rank.x.device))
        args[s] = _forward_args(views, _rank_context(rank), ys[-1])
    _lib.check(_lib.lib.mokForwardEmulated(byref(c), args, len(ranks)))
    return ys


def backward_emulated(ranks, dys: Sequence[torch.Tensor], *, num_experts: int,
                      config: Optional[MoKConfig] = None, shared_intermediate: Optional[int] = None,
                      main_grads: Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]] = None
                      ) -> List[Gradients]:
    """Gradients of every rank of an emulated EP group given each rank's dy."""
    ranks = _rank_inputs(ranks)
    if len(dys) != len(ranks):
        raise ValueError(f"{len(dys)} dy tensors for {len(ranks)} ranks")
    main_grads = list(main_grads) if main_grads is not None else [None] * len(ranks)
    if len(main_grads) != len(ranks):
        raise ValueError(f"{len(main_grads)} main_grads entries for {len(ranks)} ranks")
    c = _emulated_config(ranks, num_experts, config, shared_intermediate)
    views = _lib.Views()
    out, args = [], (_lib.mokBackwardArgs * len(ranks))()
    for s, rank in enumerate(ranks):
        ctx = _rank_context(rank)
        dx, d_topk_weights, grads = _grad_buffers(rank.x, rank.topk_ids, ctx.weights)
        args[s] = _backward_args(views, ctx, dys[s], dx, d_topk_weights, grads, _check_main_grads(main_grads[s]))
        out.append(Gradients(dx, d_topk_weights, **grads))
    _lib.check(_lib.lib.mokBackwardEmulated(byref(c), args, len(ranks)))
    return out
