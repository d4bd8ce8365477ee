"""Virtual ranks: the EP group in this process on one GPU (docs/contracts.md §7), VirtualGroup and
create_virtual_group.

mok.functional re-exports all of it.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import warnings
from ctypes import byref
from typing import Callable, List, Mapping, Optional, Sequence, Union

import torch

from . import _lib
from .args import (Gradients, _backward_args, _check_main_grads, _forward_args, _grad_buffers, _rank_tag,
                   _shape_of)
from .config import LayerDims, MoKConfig, Workspace, _alloc, _canonical_device, _config_or_default
from .emulated import RankInputs, _rank_context, _rank_inputs
from .symmetric import symmetric_bytes


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
        config = _config_or_default(config)
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

    def _context(self, rank: int, inputs: RankInputs, transposed: bool = False):
        """Rank `rank`'s forward context; precision fp8_block: its local weights' e4m3 copies (the
        backward's transposed ones too), kept on its workspace while the weights' versions say
        they are current, as mok.functional keeps them."""
        from .functional import _fp8_weights
        ctx = _rank_context(inputs)
        ctx.fp8 = _fp8_weights(self.workspaces[rank], ctx.weights, inputs.x, transposed=transposed)
        return ctx

    def _issue(self, rank_ids: Sequence[int], args: Sequence[_lib.mokForwardArgs]) -> None:
        def group_call(handles, streams):
            arg_array = (_lib.mokForwardArgs * self.ep_size)(*args)
            return _lib.symbol("mokForwardGroup")(handles, arg_array, self.ep_size, streams)

        self._issue_calls(rank_ids, group_call,
                          lambda s, a, stream: _lib.lib.mokForward(self.workspaces[s].handle, byref(a), stream), args)

    def _issue_calls(self, rank_ids: Sequence[int], group_call: Callable, rank_call: Callable, args) -> None:
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
                stream_ptrs = (ctypes.c_void_p * self.ep_size)(*[st.cuda_stream for st in streams])
                _lib.check(group_call(handles, stream_ptrs))
                return
            for s, stream, a in zip(rank_ids, streams, args):
                _lib.check(rank_call(s, a, stream.cuda_stream))
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
        for s, rank in enumerate(ranks):
            ys.append(_alloc((rank.x.shape[0], self.dims.hidden), torch.bfloat16, self.device))
            args.append(_forward_args(views, self._context(s, rank), ys[-1], _rank_tag(self.ep_size, s)))
        self._issue(list(range(self.ep_size)), args)
        return ys

    def backward(self, ranks, dys: Sequence[torch.Tensor],
                 main_grads: Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]] = None) -> List[Gradients]:
        """Gradients of every rank given the same P RankInputs as forward and each rank's dy
        [T_r, H] bf16 (mokBackwardGroup: every rank checked, then issued phase by phase; the
        pre-activations are recomputed).  Routed-expert gradients cover every row routed to the
        rank's experts; shared-expert ones the rank's own tokens.  Ordered on the current stream."""
        ranks = _rank_inputs(ranks)
        if len(ranks) != self.ep_size or len(dys) != self.ep_size:
            raise ValueError(f"{len(ranks)} rank inputs and {len(dys)} dy tensors for a virtual group of "
                             f"{self.ep_size} ranks")
        main_grads = list(main_grads) if main_grads is not None else [None] * self.ep_size
        if len(main_grads) != self.ep_size:
            raise ValueError(f"{len(main_grads)} main_grads entries for a virtual group of {self.ep_size} ranks")
        for s, rank in enumerate(ranks):
            self._precheck(s, rank)
        views = _lib.Views()
        out, args = [], []
        for s, rank in enumerate(ranks):
            ctx = self._context(s, rank, transposed=True)
            dx, d_topk_weights, grads = _grad_buffers(rank.x, rank.topk_ids, ctx.weights)
            args.append(_backward_args(views, ctx, dys[s], dx, d_topk_weights, grads,
                                       _check_main_grads(main_grads[s]), _rank_tag(self.ep_size, s)))
            out.append(Gradients(dx, d_topk_weights, **grads))

        def group_call(handles, streams):
            arg_array = (_lib.mokBackwardArgs * self.ep_size)(*args)
            return _lib.symbol("mokBackwardGroup")(handles, arg_array, None, self.ep_size, streams)

        self._issue_calls(list(range(self.ep_size)), group_call, None, args)
        return out

    def forward_rank(self, rank: int, inputs) -> torch.Tensor:
        """Issues one rank's call alone, on its stream (ordered after the current stream, which
        then waits for it). Every other rank must issue the same call, or it times out."""
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"rank {rank} outside a virtual group of {self.ep_size} ranks")
        inputs = _rank_inputs([inputs])[0]
        self._precheck(rank, inputs)
        views = _lib.Views()
        y = _alloc((inputs.x.shape[0], self.dims.hidden), torch.bfloat16, self.device)
        self._issue([rank], [_forward_args(views, self._context(rank, inputs), y, _rank_tag(self.ep_size, rank))])
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
