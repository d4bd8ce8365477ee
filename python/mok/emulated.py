"""The EP group emulated in one process on the CPU reference: RankInputs, forward_emulated,
backward_emulated.

mok.functional re-exports all of it.
"""
from __future__ import annotations

import dataclasses
from ctypes import byref
from typing import List, Mapping, Optional, Sequence

import torch

from . import _lib
from .args import (ForwardContext, Gradients, _backward_args, _check_main_grads, _forward_args, _grad_buffers,
                   _rank_tag, _shape_of, _weights_dict)
from .config import LayerDims, MoKConfig, _alloc, _c_config


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
        args[s] = _forward_args(views, _rank_context(rank), ys[-1], _rank_tag(len(ranks), s))
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
        args[s] = _backward_args(views, ctx, dys[s], dx, d_topk_weights, grads, _check_main_grads(main_grads[s]),
                                 _rank_tag(len(ranks), s))
        out.append(Gradients(dx, d_topk_weights, **grads))
    _lib.check(_lib.lib.mokBackwardEmulated(byref(c), args, len(ranks)))
    return out
