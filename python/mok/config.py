"""MoKConfig (the runtime knobs), LayerDims (the dimensions), the mokConfig they make, and
Workspace, the C handle; with the output allocator every call uses (poison_outputs).

The bottom of mok's functional layer: it imports only _lib. mok.functional re-exports all of it.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
from ctypes import byref
from typing import Any, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _lib


# Debugging aid: fill every output with NaN (or a junk integer) before the C side writes it,
# so that an element it fails to write shows up.  Tests turn it on.
poison_outputs = os.environ.get("MOK_POISON_OUTPUTS", "0") not in ("", "0")


def _alloc(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not poison_outputs:
        return torch.empty(shape, dtype=dtype, device=device)
    fill = float("nan") if dtype.is_floating_point else -559038737  # 0xDEADBEEF as int32
    return torch.full(shape, fill, dtype=dtype, device=device)


# The knob defaults: libmok's MOK_CONFIG_INITIALIZER (mok.h), read once through
# mokGetDefaultConfig. MoKConfig, mok.ops and the benchmarks take them from here; write no
# literal default elsewhere.
DEFAULTS = _lib.config_defaults()
# macrobatch_size = MACROBATCH_ALL_ROWS (mok.h's MOK_MACROBATCH_ALL_ROWS): the ring holds every
# row of a worst-case plan, one macrobatch (the training configuration docs/perf.md measured
# fastest; its ring costs macrobatch_size * (H + I) * 2 bytes)
MACROBATCH_ALL_ROWS = -1
PRECISION_NAMES = {code: name for name, code in _lib.PRECISIONS.items()}


@dataclasses.dataclass(frozen=True)
class MoKConfig:
    """Runtime knobs of a mok layer (the dimensions come from the workspace); each defaults
    to libmok's (DEFAULTS, from mokGetDefaultConfig).

    num_blocks: grid of the persistent CUDA kernels; 0 = one block per SM (a VirtualGroup
    turns 0 into SMs // P, so that the P ranks' kernels are resident at once).
    fwd_num_comm_sms, bwd_num_comm_sms (0: the forward's): EP >= 2, the blocks of each fused
    kernel that pull rows from the peers before they compute; at EP = 1 no block is set aside
    (the producer warpgroups' gather warps copy the rows).
    macrobatch_size: rows of the ring; 0 = chosen by mok; MACROBATCH_ALL_ROWS = every row of a
    worst-case plan (recommended for training: no expert's weight gradient split into pieces).
    precision: "bf16" (default) or "fp8_block" (docs/precision.md); fp8_pow2_scales: its scales
    powers of two (UE8M0) instead of max |v| / 448 in fp32."""

    fwd_num_comm_sms: int = DEFAULTS["fwd_num_comm_sms"]
    bwd_num_comm_sms: int = DEFAULTS["bwd_num_comm_sms"]
    minibatch_size: int = DEFAULTS["minibatch_size"]
    macrobatch_size: int = DEFAULTS["macrobatch_size"]
    block_m: int = DEFAULTS["block_m"]
    schedule_capacity_multiplier: float = DEFAULTS["schedule_capacity_multiplier"]
    precision: str = PRECISION_NAMES[DEFAULTS["precision"]]
    timeout_s: float = DEFAULTS["timeout_s"]
    num_threads: int = DEFAULTS["num_threads"]
    num_blocks: int = DEFAULTS["num_blocks"]
    fp8_pow2_scales: bool = bool(DEFAULTS["fp8_pow2_scales"])

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


def _config_or_default(config: Optional[MoKConfig]) -> MoKConfig:
    """config, MoKConfig() for None; TypeError for anything else."""
    if config is None:
        return MoKConfig()
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config must be a mok MoKConfig or None, got {type(config).__name__}")
    return config


def _c_config(dims: LayerDims, config: Optional[MoKConfig], device: int) -> _lib.mokConfig:
    config = _config_or_default(config)
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
    c.fp8_pow2_scales = 1 if config.fp8_pow2_scales else 0
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


def _canonical_device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
