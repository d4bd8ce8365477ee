"""Workspaces by dimensions: create_workspace, and get_workspace with its cache (per group,
device, dims and config). EP >= 2 on CUDA over a process group goes through symmetric.py.

mok.functional re-exports all of it.
"""
from __future__ import annotations

import threading
from typing import Dict, Optional, Tuple, Union

import torch

from .config import LayerDims, MoKConfig, Workspace, _canonical_device, _config_or_default
from .symmetric import _symmetric_workspace


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
    return _new_workspace(dims, _config_or_default(config), _canonical_device(device), group)


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
    config = _config_or_default(config)
    key = (group, str(device), dims, config)
    with _cache_lock:
        ws = _cache.get(key)
        if ws is None:
            ws = _cache[key] = _new_workspace(dims, config, device, group)
        return ws


def clear_workspace_cache() -> None:
    with _cache_lock:
        _cache.clear()
