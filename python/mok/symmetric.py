"""The PyTorch symmetric-memory provider of EP >= 2 across processes (one GPU each): the region
size (symmetric_bytes), NVLink multicast off (MULTICAST_OFF_ENV), the collective allocation
and rendezvous of every rank's region, and the workspace over them.

mok.functional re-exports all of it.
"""
from __future__ import annotations

import ctypes
import os
import warnings
from ctypes import byref
from typing import Any, List, Optional, Tuple, Union

import torch

from . import _lib
from .config import LayerDims, MoKConfig, Workspace, _c_config, _canonical_device


def symmetric_bytes(dims: LayerDims, config: Optional[MoKConfig] = None,
                    device: Union[str, torch.device] = "cuda") -> int:
    """Bytes of one rank's symmetric region for these dimensions (mokSymmetricBytes)."""
    fn = _lib.symbol("mokSymmetricBytes")
    c = _c_config(dims, config, _lib.device_index(_canonical_device(device)))
    nbytes = ctypes.c_size_t(0)
    _lib.check(fn(byref(c), byref(nbytes)))
    return int(nbytes.value)


# NVLink multicast (NVLS) must stay off (docs/contracts.md §3): NCCL's NVLS algorithms, PyTorch symmetric
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
