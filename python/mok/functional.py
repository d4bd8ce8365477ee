"""mok's functional layer (mirrors MoK's): config, workspaces, schedule, forward, backward.

CPU tensors run the C++ reference backend. CUDA tensors run the CUDA backend where it is
built; a path that is not built raises NotImplementedError.

EP >= 2 on CUDA runs over symmetric memory, one region per rank (docs/design.md, "EP >= 2"):
get_workspace(..., group=) allocates it with PyTorch symmetric memory (one process per GPU);
create_virtual_group puts P ranks in this process on one GPU, each on its own stream.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
import warnings
from ctypes import byref
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

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
    """Runtime knobs of a mok layer (the dimensions come from the workspace).

    num_blocks: grid of the persistent CUDA kernels; 0 = one block per SM (a VirtualGroup
    turns 0 into SMs // P, so that the P ranks' kernels are resident at once)."""

    fwd_num_comm_sms: int = 8
    bwd_num_comm_sms: int = 8
    minibatch_size: int = 1024
    macrobatch_size: int = 16384
    block_m: int = 128
    schedule_capacity_multiplier: float = 1.0
    precision: str = "bf16"
    timeout_s: float = 60.0
    num_threads: int = 0
    num_blocks: int = 0

    def __post_init__(self) -> None:
        if int(self.num_blocks) < 0:
            raise ValueError(f"config.num_blocks = {self.num_blocks} must be >= 0 (0 = one block per SM)")


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
    c.num_blocks = config.num_blocks
    c.device = device
    return c


class Workspace:
    """A mok workspace: owns the C handle (destroyed on close() or garbage collection).

    With `regions` it is one rank of an EP >= 2 group over symmetric memory
    (mokWorkspaceCreateSymmetric): regions[s] is the address, in this process, of rank s's
    region of symmetric_bytes() bytes, s in [0, ep_size), regions[dims.ep_rank] this rank's own.
    Every region must be zero-filled, and every rank's workspace created, before any rank's
    first call. `owner` is whatever keeps that memory alive (a tensor, a symmetric-memory
    handle); the workspace holds it until close(). Closing frees nothing the peers may still
    read only if every rank is done with its calls (synchronise and barrier first)."""

    def __init__(self, dims: LayerDims, config: MoKConfig, device: torch.device, *,
                 regions: Optional[Sequence[int]] = None, owner: Any = None) -> None:
        self.dims = dims
        self.config = config
        self.device = torch.device(device)
        self._handle = ctypes.c_void_p()
        self.regions: Optional[Tuple[int, ...]] = None
        self._owner = owner
        c = _c_config(dims, config, _lib.device_index(self.device))
        if regions is None:
            _lib.check(_lib.lib.mokWorkspaceCreate(byref(c), byref(self._handle)))
            return
        # EP >= 2: one region per rank of the group
        self.regions = _check_regions(dims, self.device, regions)
        create = _lib.symbol("mokWorkspaceCreateSymmetric")
        addresses = (ctypes.c_void_p * len(self.regions))(*self.regions)
        _lib.check(create(byref(c), addresses, len(self.regions), byref(self._handle)))

    @classmethod
    def symmetric(cls, dims: LayerDims, config: MoKConfig, device: torch.device, regions: Sequence[int],
                  owner: Any = None) -> "Workspace":
        """One rank's workspace over the group's symmetric regions (see the class docstring)."""
        return cls(dims, config, device, regions=regions, owner=owner)

    @property
    def is_symmetric(self) -> bool:
        """True for an EP >= 2 workspace over symmetric memory."""
        return self.regions is not None

    @property
    def owner(self) -> Any:
        """What keeps the symmetric memory alive (None for a plain workspace)."""
        return self._owner

    @property
    def handle(self) -> ctypes.c_void_p:
        if not self._handle:
            raise RuntimeError("mok workspace is closed")
        return self._handle

    def close(self) -> None:
        if getattr(self, "_handle", None):
            _lib.check(_lib.lib.mokWorkspaceDestroy(self._handle))
            self._handle = ctypes.c_void_p()
        # The memory goes only after the handle that points into it
        self._owner = None

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
        kind = ", symmetric" if self.regions is not None else ""
        return f"Workspace({self.dims}, {self.config}, device={self.device}{kind})"


def _check_regions(dims: LayerDims, device: torch.device, regions: Sequence[int]) -> Tuple[int, ...]:
    if device.type != "cuda":
        raise ValueError(f"a workspace over symmetric regions runs on CUDA, not on {device} (the EP group on "
                         f"the CPU is forward_emulated)")
    out = tuple(int(r) for r in regions)
    if len(out) != dims.ep_size:
        raise ValueError(f"{len(out)} symmetric regions for ep_size = {dims.ep_size}; give one per rank")
    for s, address in enumerate(out):
        if address <= 0:
            raise ValueError(f"symmetric region of rank {s} has address {address:#x}")
    return out


def symmetric_bytes(dims: LayerDims, config: Optional[MoKConfig] = None,
                    device: Union[str, torch.device] = "cuda") -> int:
    """Bytes of one rank's symmetric region for these dimensions (mokSymmetricBytes)."""
    fn = _lib.symbol("mokSymmetricBytes")
    c = _c_config(dims, config, _lib.device_index(_canonical_device(device)))
    nbytes = ctypes.c_size_t(0)
    _lib.check(fn(byref(c), byref(nbytes)))
    return int(nbytes.value)


# NVLink multicast (NVLS) must stay off (DESIGN §3): NCCL's NVLS algorithms, PyTorch symmetric
# memory's multicast object and NVSHMEM's NVLS team. setdefault, so that a caller can still
# say otherwise; NCCL reads its variable when a communicator is created.
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def multicast_off_env() -> None:
    """Sets the MULTICAST_OFF_ENV defaults (call before the process group's first collective)."""
    for name, value in MULTICAST_OFF_ENV.items():
        os.environ.setdefault(name, value)


def _symm_mem_module():
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError as exc:
        raise NotImplementedError(f"mok EP >= 2 over a process group needs torch.distributed._symmetric_memory, "
                                  f"which PyTorch {torch.__version__} does not have") from exc
    missing = [name for name in ("empty", "rendezvous") if not hasattr(symm_mem, name)]
    if missing:
        raise NotImplementedError(f"torch.distributed._symmetric_memory of PyTorch {torch.__version__} has no "
                                  f"{', '.join(missing)}")
    return symm_mem


def _rendezvous(symm_mem, buffer: torch.Tensor, group):
    name = getattr(group, "group_name", None)
    # Older PyTorch needs the group enabled for symmetric memory first; newer ones deprecate that
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    is_enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
    if name is not None and enable is not None and (is_enabled is None or not is_enabled(name)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            enable(name)
    # rendezvous(tensor, group) on newer PyTorch, rendezvous(tensor, group_name) on older
    errors = []
    for arg in (group, name):
        if arg is None:
            continue
        try:
            return symm_mem.rendezvous(buffer, arg)
        except TypeError as exc:
            errors.append(f"{type(arg).__name__}: {exc}")
    raise RuntimeError("torch.distributed._symmetric_memory.rendezvous took neither the process group nor its "
                       "name: " + "; ".join(errors))


def _symmetric_region(nbytes: int, device: torch.device, group) -> Tuple[torch.Tensor, Any, List[int]]:
    """This rank's zeroed region from PyTorch symmetric memory (collective over `group`), its
    handle, and every rank's region address as this process maps it."""
    import torch.distributed as dist

    multicast_off_env()
    symm_mem = _symm_mem_module()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    with torch.cuda.device(device):
        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        buffer.zero_()
        handle = _rendezvous(symm_mem, buffer, group)
        ptrs = [int(p) for p in handle.buffer_ptrs]
        if len(ptrs) != world:
            raise RuntimeError(f"symmetric memory handle has {len(ptrs)} buffer pointers for a group of {world}")
        # NOTES: buffer_ptrs[s] is the base of rank s's symmetric allocation as mapped here; the
        # tensor may sit at an offset inside it (pooled allocations), so each rank's offset is
        # gathered rather than assumed equal
        offset = buffer.data_ptr() - ptrs[rank]
        size = getattr(handle, "buffer_size", None)
        if offset < 0 or (isinstance(size, int) and size > 0 and offset + nbytes > size):
            raise RuntimeError(f"symmetric buffer at {buffer.data_ptr():#x} lies outside the handle's allocation "
                               f"(base {ptrs[rank]:#x}, size {size})")
        offsets: List[Any] = [None] * world
        dist.all_gather_object(offsets, offset, group=group)
    return buffer, handle, [p + int(o) for p, o in zip(ptrs, offsets)]


def _barrier(group, device: torch.device) -> None:
    import torch.distributed as dist

    torch.cuda.synchronize(device)
    if dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def _symmetric_workspace(dims: LayerDims, config: MoKConfig, device: torch.device, group) -> Workspace:
    # Fail before any collective when the library has no symmetric path
    _lib.symbol("mokWorkspaceCreateSymmetric")
    nbytes = symmetric_bytes(dims, config, device)
    buffer, handle, regions = _symmetric_region(nbytes, device, group)
    ws = Workspace(dims, config, device, regions=regions, owner=(buffer, handle))
    # Every region zeroed and every workspace created before any rank's first call
    _barrier(group, device)
    return ws


def _new_workspace(dims: LayerDims, config: MoKConfig, device: torch.device, group) -> Workspace:
    if dims.ep_size > 1 and device.type == "cuda":
        if group is None:
            raise ValueError(f"an EP = {dims.ep_size} workspace on CUDA needs symmetric memory: pass group= (a "
                             f"torch.distributed process group of {dims.ep_size} ranks, one GPU each), or use "
                             f"create_virtual_group for {dims.ep_size} ranks on one GPU")
        return _symmetric_workspace(dims, config, device, group)
    return Workspace(dims, config, device)


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
    """A new workspace for these dimensions; with `group`, P and r come from the process group.

    P >= 2 on CUDA (with `group`) is collective: every rank of the group must call it with the
    same arguments; it allocates this rank's region with PyTorch symmetric memory, zeroes it,
    creates the workspace and ends with a barrier of the group. NVLink multicast stays off
    (MULTICAST_OFF_ENV defaults)."""
    dims = _dims(hidden, intermediate, num_experts, topk, max_tokens, shared_intermediate, ep_size, ep_rank, group)
    return _new_workspace(dims, config or MoKConfig(), _canonical_device(device), group)


_cache: Dict[tuple, Workspace] = {}
_cache_lock = threading.Lock()


def get_workspace(hidden: int, intermediate: int, num_experts: int, topk: int, max_tokens: int,
                  shared_intermediate: int = 0, ep_size: int = 1, ep_rank: int = 0,
                  device: Union[str, torch.device] = "cpu", config: Optional[MoKConfig] = None,
                  group=None) -> Workspace:
    """Like create_workspace, cached per (group, device, dims, config). With a group of P >= 2
    on CUDA the first call is collective (see create_workspace): every rank must make the same
    get_workspace calls in the same order."""
    dims = _dims(hidden, intermediate, num_experts, topk, max_tokens, shared_intermediate, ep_size, ep_rank, group)
    device = _canonical_device(device)
    config = config or MoKConfig()
    key = (group, str(device), dims, config)
    with _cache_lock:
        ws = _cache.get(key)
        if ws is None:
            ws = _cache[key] = _new_workspace(dims, config, device, group)
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
# Forward and backward (one rank; EP >= 2 through a symmetric workspace, every rank calls)


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


# ---------------------------------------------------------------------------------------
# Virtual ranks: the EP group in this process on one GPU (DESIGN §7)

# Each rank's region starts on its own 4 KiB boundary.
_REGION_ALIGN = 4096


class VirtualGroup:
    """P ranks of an EP group in this process on one GPU: one zeroed allocation of P regions,
    P workspaces (ep_rank = s) over them, each rank's calls on its own stream with
    config.num_blocks = SMs // P (unless the config sets it), so that all P persistent kernels
    are resident at once and the whole cross-rank protocol runs on one device.

    forward(ranks) issues every rank's call before anything waits (the ranks wait for each other
    on the device), with no host synchronisation, and is capturable in a CUDA graph. Calls are
    sequence-numbered: a rank issued alone (forward_rank) waits on the device until the others
    issue the same call, or until config.timeout_s (reported by check_errors).

    NOTES: the P kernels must run concurrently. forward() issues the ranks through
    mokForwardGroup, phase by phase across the ranks, so streams that share a hardware queue
    (more streams than CUDA_DEVICE_MAX_CONNECTIONS) cannot block each other; ranks issued one by
    one with forward_rank can, when that setting is below P."""

    def __init__(self, dims: LayerDims, config: Optional[MoKConfig] = None,
                 device: Union[str, torch.device] = "cuda") -> None:
        self.workspaces: List[Workspace] = []
        self.streams: List[torch.cuda.Stream] = []
        self.memory: Optional[torch.Tensor] = None
        device = _canonical_device(device)
        if device.type != "cuda":
            raise ValueError(f"virtual ranks run on a CUDA device, not on {device} (the EP group on the CPU is "
                             f"forward_emulated)")
        P = int(dims.ep_size)
        if P < 1:
            raise ValueError(f"ep_size = {P}: a virtual group needs at least one rank")
        if dims.num_experts % P != 0:
            raise ValueError(f"num_experts = {dims.num_experts} is not a multiple of ep_size = {P}")
        _warn_connections(P)
        # The grid of each rank: an equal share of the SMs
        config = config or MoKConfig()
        if config.num_blocks == 0:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            if sms < P:
                raise ValueError(f"{P} virtual ranks on {sms} SMs: each rank needs at least one block")
            config = dataclasses.replace(config, num_blocks=sms // P)
        self.dims = dims._replace(ep_rank=0)
        self.config = config
        self.device = device
        # P zeroed regions in one allocation, zero-fill landed before any rank's stream runs
        self.region_bytes = symmetric_bytes(self.dims, config, device)
        stride = -(-self.region_bytes // _REGION_ALIGN) * _REGION_ALIGN
        self.memory = torch.zeros(P * stride, dtype=torch.uint8, device=device)
        base = self.memory.data_ptr()
        self.regions = tuple(base + s * stride for s in range(P))
        torch.cuda.synchronize(device)
        # One workspace and one stream per rank
        try:
            for s in range(P):
                self.workspaces.append(Workspace(dims._replace(ep_rank=s), config, device, regions=self.regions,
                                                 owner=self.memory))
        except BaseException:
            self.close()
            raise
        self.streams = [torch.cuda.Stream(device=device) for _ in range(P)]

    @property
    def ep_size(self) -> int:
        return len(self.workspaces)

    def __len__(self) -> int:
        return self.ep_size

    def __enter__(self) -> "VirtualGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _precheck(self, rank: int, inputs: RankInputs) -> None:
        # What would make one rank's call fail after its peers were issued, checked first
        num_tokens, hidden = _shape_of(inputs.x, f"rank {rank} x", 2)
        if hidden != self.dims.hidden:
            raise ValueError(f"rank {rank} x has hidden size {hidden}; the group was built for {self.dims.hidden}")
        if num_tokens > self.dims.max_tokens:
            raise ValueError(f"rank {rank} x has {num_tokens} tokens; the group was built for max_tokens = "
                             f"{self.dims.max_tokens}")
        for name in ("x", "topk_ids", "topk_weights", "w_gate", "w_up", "w_down"):
            t = getattr(inputs, name)
            if not isinstance(t, torch.Tensor) or _canonical_device(t.device) != self.device:
                where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"rank {rank} {name} is on {where}; the group runs on {self.device}")
        local = _shape_of(inputs.w_gate, f"rank {rank} w_gate", 3)[0]
        if local * self.ep_size != self.dims.num_experts:
            raise ValueError(f"rank {rank} w_gate holds {local} experts; rank-local weights of this group hold "
                             f"num_experts / ep_size = {self.dims.num_experts // self.ep_size}")

    def _issue(self, rank_ids: Sequence[int], args: Sequence[_lib.mokForwardArgs]) -> None:
        current = torch.cuda.current_stream(self.device)
        streams = [self.streams[s] for s in rank_ids]
        # Fork: every rank's stream after the work already on the current stream
        for stream in streams:
            stream.wait_stream(current)
        issued: List[int] = []
        try:
            if list(rank_ids) == list(range(self.ep_size)):
                # Every rank at once: mokForwardGroup checks them all, then issues phase by phase
                # across the ranks, so that streams sharing a hardware queue cannot deadlock.
                handles = (ctypes.c_void_p * self.ep_size)(*[ws.handle.value for ws in self.workspaces])
                arg_array = (_lib.mokForwardArgs * self.ep_size)(*args)
                stream_ptrs = (ctypes.c_void_p * self.ep_size)(*[st.cuda_stream for st in streams])
                _lib.check(_lib.symbol("mokForwardGroup")(handles, arg_array, self.ep_size, stream_ptrs))
                return
            for s, stream, a in zip(rank_ids, streams, args):
                _lib.check(_lib.lib.mokForward(self.workspaces[s].handle, byref(a), stream.cuda_stream))
                issued.append(s)
        except Exception as exc:
            if issued:
                failed = rank_ids[len(issued)]
                raise type(exc)(f"virtual rank {failed}: {exc} (ranks {issued} were already issued and wait for it "
                                f"until timeout_s = {self.config.timeout_s})") from exc
            raise
        finally:
            # Join: the current stream continues after every rank's call
            for stream in streams:
                current.wait_stream(stream)

    def forward(self, ranks) -> List[torch.Tensor]:
        """y [T_r, H] of every rank, given a list of P RankInputs (or dicts of their fields):
        rank r's tokens, routing (global expert ids in [-1, E)) and local weights ([E/P, ...],
        experts r*E/P .. (r+1)*E/P - 1), optional shared weights. Ordered on the current stream."""
        ranks = _rank_inputs(ranks)
        if len(ranks) != self.ep_size:
            raise ValueError(f"{len(ranks)} rank inputs for a virtual group of {self.ep_size} ranks")
        for s, rank in enumerate(ranks):
            self._precheck(s, rank)
        views = _lib.Views()
        ys, args = [], []
        for rank in ranks:
            ys.append(_alloc((rank.x.shape[0], self.dims.hidden), torch.bfloat16, self.device))
            args.append(_forward_args(views, _rank_context(rank), ys[-1]))
        self._issue(list(range(self.ep_size)), args)
        return ys

    def forward_rank(self, rank: int, inputs) -> torch.Tensor:
        """Issues one rank's call alone, on its stream (ordered after the current stream, which
        then waits for it). Every other rank must issue the same call, or it times out."""
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"rank {rank} outside a virtual group of {self.ep_size} ranks")
        inputs = _rank_inputs([inputs])[0]
        self._precheck(rank, inputs)
        views = _lib.Views()
        y = _alloc((inputs.x.shape[0], self.dims.hidden), torch.bfloat16, self.device)
        self._issue([rank], [_forward_args(views, _rank_context(inputs), y)])
        return y

    def check_errors(self, wait: bool = True) -> None:
        """Workspace.check_errors over every rank; raises one error naming each rank that
        reported (RuntimeError when any is not a route error, e.g. a timeout)."""
        failures = []
        for s, ws in enumerate(self.workspaces):
            try:
                ws.check_errors(wait)
            except (ValueError, RuntimeError) as exc:
                failures.append((s, exc))
        if failures:
            message = "; ".join(f"virtual rank {s}: {exc}" for s, exc in failures)
            only_routes = all(isinstance(exc, ValueError) for _, exc in failures)
            raise (ValueError if only_routes else RuntimeError)(message)

    def close(self) -> None:
        """Destroys the workspaces, then frees the regions (after the device is idle)."""
        if self.memory is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)
        for ws in self.workspaces:
            ws.close()
        self.workspaces = []
        self.streams = []
        self.memory = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"VirtualGroup(ep_size={self.ep_size}, {self.dims}, {self.config}, device={self.device}, "
                f"region_bytes={getattr(self, 'region_bytes', None)})")


def _warn_connections(ep_size: int) -> None:
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if value is not None and value.isdigit() and int(value) < ep_size:
        warnings.warn(f"CUDA_DEVICE_MAX_CONNECTIONS={value} < {ep_size} virtual ranks: ranks issued one by one "
                      f"(forward_rank) whose streams share a hardware queue can wait for each other until "
                      f"timeout_s; forward() is not affected", RuntimeWarning, stacklevel=3)


def create_virtual_group(hidden: int, intermediate: int, num_experts: int, topk: int, max_tokens: int,
                         shared_intermediate: int = 0, *, ep_size: int, device: Union[str, torch.device] = "cuda",
                         config: Optional[MoKConfig] = None) -> VirtualGroup:
    """A VirtualGroup of `ep_size` ranks on one GPU; num_experts is E over the group and
    max_tokens the most tokens any rank passes in one call."""
    dims = LayerDims(int(hidden), int(intermediate), int(num_experts), int(topk), int(max_tokens),
                     int(shared_intermediate), int(ep_size), 0)
    return VirtualGroup(dims, config, device)
