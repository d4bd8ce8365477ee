"""What a forward or backward call hands the C side: ForwardContext (the forward inputs and
the workspace), Gradients, and the mokForwardArgs / mokBackwardArgs built from them. Shared by
mok.functional (one rank), emulated.py and virtual.py (the EP group in one process).

mok.functional re-exports all of it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from . import _lib
from .config import Workspace, _alloc
from .schedule import plan_capacity


WEIGHT_NAMES = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")
ROUTED_NAMES = WEIGHT_NAMES[:3]


@dataclasses.dataclass
class ForwardContext:
    """What backward needs: the forward inputs and the workspace, and on CUDA what a training
    forward saved (`saved`: h [max_rows, 2I] and the shared expert's shared_h [T, 2I_s], the
    gate/up pre-activations the backward reads instead of recomputing; None: recomputed)."""

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    weights: Dict[str, Optional[torch.Tensor]]
    workspace: Workspace
    saved: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None
    # precision fp8_block on CUDA: the weights' e4m3 copies the layer reads (mok.quantize_weights,
    # kept on the workspace while the weights' versions say they are current)
    fp8: Optional[Any] = None


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


def _rank_tag(ep_size: int, rank: int) -> str:
    """What the C side puts before an argument's name in an EP group of one process."""
    return f"rank {rank}: " if ep_size > 1 else ""


def _forward_args(views: _lib.Views, ctx: ForwardContext, y: Optional[torch.Tensor],
                  tag: str = "") -> _lib.mokForwardArgs:
    # tag: "rank r: " in an EP group of one process, as the C side's messages say it
    args = _lib.mokForwardArgs(x=views(ctx.x, tag + "x", _lib.BF16),
                               topk_ids=views(ctx.topk_ids, tag + "topk_ids", _lib.IDS),
                               topk_weights=views(ctx.topk_weights, tag + "topk_weights", _lib.FP32),
                               weights=views.weights(ctx.weights, tag, _lib.BF16), y=views(y, tag + "y", _lib.BF16))
    if ctx.fp8 is not None:
        from .quantized import fp8_views
        args.fp8 = fp8_views(views, ctx.fp8.weights, tag)
    return args


def _grad_like(w: torch.Tensor, dtype) -> torch.Tensor:
    """A gradient buffer shaped like weight w, in w's orientation: column-major matrices for a
    column-major (transposed) w, whose gradient CUDA writes transposed too."""
    if w.dim() >= 2 and w.shape[-2] > 1 and w.shape[-1] > 1 and w.stride(-2) == 1 and w.stride(-1) != 1:
        return _alloc(tuple(w.shape[:-2]) + (w.shape[-1], w.shape[-2]), dtype, w.device).transpose(-1, -2)
    return _alloc(tuple(w.shape), dtype, w.device)


def _grad_buffers(x, topk_ids, weights, out_dtype=torch.bfloat16, given: Optional[Mapping[str, torch.Tensor]] = None):
    """dx, d_topk_weights and the weight gradients (those in `given` are the caller's; the others
    in their weight's orientation)."""
    num_tokens, hidden = _shape_of(x, "x", 2)
    _, topk = _shape_of(topk_ids, "topk_ids", 2)
    given = given or {}
    grads = {name: (None if w is None else given[name] if name in given else _grad_like(w, out_dtype))
             for name, w in weights.items()}
    dx = _alloc((num_tokens, hidden), torch.bfloat16, x.device)
    d_topk_weights = _alloc((num_tokens, topk), torch.float32, x.device)
    return dx, d_topk_weights, grads


def _check_main_grads(main_grads: Optional[Mapping[str, torch.Tensor]], what: str = "main_grads",
                      dtype: str = "float32") -> Dict[str, torch.Tensor]:
    """The mapping weight name -> tensor of backward's main_grads (or grads_out)."""
    if main_grads is not None and not isinstance(main_grads, Mapping):
        raise TypeError(f"{what} must be a mapping weight name -> {dtype} tensor, or None, got "
                        f"{type(main_grads).__name__}")
    main_grads = dict(main_grads or {})
    unknown = set(main_grads) - set(WEIGHT_NAMES)
    if unknown:
        raise ValueError(f"{what} has unknown names {sorted(unknown)}; expected some of {WEIGHT_NAMES}")
    return main_grads


def _saved_buffers(ctx: ForwardContext) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The pre-activation buffers a training forward on CUDA writes (mokSaved_t)."""
    d = ctx.workspace.dims
    max_rows, _, _ = plan_capacity(d.num_experts, d.topk, d.max_tokens, d.ep_size, ctx.workspace.config)
    h = torch.empty((max_rows, 2 * d.intermediate), dtype=torch.bfloat16, device=ctx.x.device)
    shared_h = None
    if d.shared_intermediate > 0:
        shared_h = torch.empty((ctx.x.shape[0], 2 * d.shared_intermediate), dtype=torch.bfloat16, device=ctx.x.device)
    return h, shared_h


def _saved_args(views: _lib.Views, saved) -> _lib.mokSaved:
    h, shared_h = saved
    return _lib.mokSaved(h=views(h, "saved h", _lib.BF16), shared_h=views(shared_h, "saved shared_h", _lib.BF16))


def _backward_args(views: _lib.Views, ctx: ForwardContext, dy, dx, d_topk_weights, grads, main_grads,
                   tag: str = ""):
    return _lib.mokBackwardArgs(fwd=_forward_args(views, ctx, None, tag), dy=views(dy, tag + "dy", _lib.BF16),
                                dx=views(dx, tag + "dx", _lib.BF16),
                                d_topk_weights=views(d_topk_weights, tag + "d_topk_weights", _lib.FP32),
                                grads=views.weights(grads, tag + "grad of ", _lib.BF16),
                                main_grads=views.weights(main_grads, tag + "main_grad of ", _lib.FP32))
