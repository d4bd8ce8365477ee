"""mok's functional layer (mirrors MoK's): config, workspaces, schedule, forward, backward.

CPU tensors run the C++ reference backend. CUDA tensors run the CUDA backend where it is
built; a path that is not built raises NotImplementedError.

EP >= 2 on CUDA runs over symmetric memory, one region per rank (docs/design.md, "EP >= 2"):
get_workspace(..., group=) allocates it with PyTorch symmetric memory (one process per GPU);
create_virtual_group puts P ranks in this process on one GPU, each on its own stream.

This module holds forward, backward and recompute_forward_context, and is the public face of
the modules below it, whose every name it re-exports:
  config.py     MoKConfig, LayerDims, Workspace, the output allocator (config.poison_outputs:
                every output starts as NaN, for tests; MOK_POISON_OUTPUTS=1)
  workspace.py  create_workspace, get_workspace and its cache
  symmetric.py  PyTorch symmetric memory for EP >= 2 across processes
  schedule.py   Schedule, build_schedule, plan_capacity
  args.py       ForwardContext, Gradients, the C call arguments
  emulated.py   the EP group emulated on the CPU (forward_emulated, backward_emulated)
  virtual.py    VirtualGroup, the EP group on one GPU
"""
from __future__ import annotations

from ctypes import byref
from typing import Mapping, Optional, Tuple

import torch

from . import _lib
from .args import (ROUTED_NAMES, WEIGHT_NAMES, ForwardContext, Gradients, _backward_args,  # noqa: F401
                   _check_main_grads, _forward_args, _grad_buffers, _saved_args, _saved_buffers, _shape_of,
                   _weights_dict)
from .config import (MACROBATCH_ALL_ROWS, LayerDims, MoKConfig, Workspace, _alloc, _c_config,  # noqa: F401
                     _canonical_device, _check_regions)
from .emulated import (RankInputs, _emulated_config, _rank_context, _rank_inputs, backward_emulated,  # noqa: F401
                       forward_emulated)
from .schedule import (NO_ERROR, PAD_ROW, ROUTE_CHECK_NAMES, SLOT_BITS, TOKEN_BITS, Schedule,  # noqa: F401
                       _ids_list, build_schedule, build_schedule_tensors, plan_capacity)
from .symmetric import (MULTICAST_OFF_ENV, _barrier, _rendezvous, _symm_mem_module, _symmetric_region,  # noqa: F401
                        _symmetric_workspace, multicast_off_env, symmetric_bytes)
from .virtual import _REGION_ALIGN, VirtualGroup, _warn_connections, create_virtual_group  # noqa: F401
from .workspace import (_cache, _cache_lock, _dims, _group_size_rank, _new_workspace,  # noqa: F401
                        clear_workspace_cache, create_workspace, get_workspace)


# ---------------------------------------------------------------------------------------
# Forward and backward (one rank; EP >= 2 through a symmetric workspace, every rank calls)


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
    # x decides the device: a tensor on a cpu or cuda device, before any workspace is made
    _shape_of(x, "x", 2)
    _lib.device_index(x.device, "x")
    if workspace is None:
        return _auto_workspace(x, topk_ids, weights, config)
    if not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a mok Workspace (create_workspace, get_workspace) or None, got "
                        f"{type(workspace).__name__}")
    if config is not None and config != workspace.config:
        raise ValueError(f"config {config} differs from the workspace's {workspace.config}; pass one of them")
    if _canonical_device(x.device) != workspace.device:
        raise ValueError(f"x is on {x.device} but the workspace was built for {workspace.device}: x must be on "
                         f"{workspace.device}")
    return workspace


def recompute_forward_context(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None,
                              ws_down=None, *, workspace: Optional[Workspace] = None,
                              config: Optional[MoKConfig] = None) -> ForwardContext:
    """The context forward would return, without computing y (activation checkpointing)."""
    return _context(x, topk_ids, topk_weights, _weights_dict(w_gate, w_up, w_down, ws_gate, ws_up, ws_down),
                    workspace, config, for_backward=True)


def _context(x, topk_ids, topk_weights, weights, workspace, config, for_backward: bool) -> ForwardContext:
    """The forward's context; fp8_block on CUDA: the weights' e4m3 copies, with the backward's
    transposed ones when a backward will follow (quantised in the same pass, not again there)."""
    ws = _resolve_workspace(workspace, config, x, topk_ids, weights)
    return ForwardContext(x, topk_ids, topk_weights, weights, ws,
                          fp8=_fp8_weights(ws, weights, x, transposed=for_backward))


def _fp8_weights(ws: Workspace, weights, x, transposed: bool = False):
    """precision fp8_block on CUDA: the weights' e4m3 copies, quantised once and kept on the
    workspace for as long as the weights' version counters say they are unchanged (an in-place
    optimizer step advances them); None otherwise (the CPU reference quantises itself).
    transposed: the backward's transposed copies too (a forward alone makes none)."""
    config = ws.config or MoKConfig()
    if config.precision != "fp8_block" or x.device.type != "cuda":
        return None
    from .quantized import quantize_weights
    cached = getattr(ws, "_fp8_weights", None)
    lacks_qt = cached is not None and transposed and cached.weights["w_gate"].qt is None
    if cached is None or cached.pow2 != bool(config.fp8_pow2_scales) or not cached.current(**weights) or lacks_qt:
        cached = quantize_weights(**weights, pow2=bool(config.fp8_pow2_scales), transposed=transposed)
        ws._fp8_weights = cached
    return cached


def forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None, *,
            workspace: Optional[Workspace] = None, config: Optional[MoKConfig] = None,
            save_for_backward: bool = True) -> Tuple[torch.Tensor, ForwardContext]:
    """y [T, H] bf16 of one rank's MoE layer, and the context for backward.

    On CUDA, save_for_backward (default) keeps the gate/up pre-activations in the context
    (ctx.saved: 2I bf16 per plan row, and 2I_s per token for the shared expert), so that
    backward reads them instead of recomputing them: one gate/up GEMM less, the same bits.
    False: nothing is kept and backward recomputes them (as after recompute_forward_context)."""
    ctx = _context(x, topk_ids, topk_weights, _weights_dict(w_gate, w_up, w_down, ws_gate, ws_up, ws_down),
                   workspace, config, for_backward=save_for_backward)
    num_tokens, hidden = _shape_of(x, "x", 2)
    y = _alloc((num_tokens, hidden), torch.bfloat16, x.device)
    views = _lib.Views()
    args = _forward_args(views, ctx, y)
    stream = _lib.stream_of(_lib.device_index(x.device))
    if save_for_backward and x.device.type == "cuda":
        ctx.saved = _saved_buffers(ctx)
        saved = _saved_args(views, ctx.saved)
        _lib.check(_lib.symbol("mokForwardSave")(ctx.workspace.handle, byref(args), byref(saved), stream))
    else:
        _lib.check(_lib.lib.mokForward(ctx.workspace.handle, byref(args), stream))
    return y, ctx


def backward(ctx: ForwardContext, dy: torch.Tensor,
             main_grads: Optional[Mapping[str, torch.Tensor]] = None,
             grads_out: Optional[Mapping[str, torch.Tensor]] = None) -> Gradients:
    """Gradients of one rank's layer given dy [T, H] bf16. `main_grads` (name -> fp32 tensor
    shaped like the weight) are accumulated into: main_grad += fp32 gradient. `grads_out`
    (name -> bf16 tensor shaped like the weight, any strides the weights may have, e.g. the
    two halves of one fused gate_up gradient): written in place instead of new tensors."""
    if not isinstance(ctx, ForwardContext):
        raise TypeError(f"ctx must be the ForwardContext that forward (or recompute_forward_context) returned, got "
                        f"{type(ctx).__name__}")
    main_grads = _check_main_grads(main_grads)
    if ctx.fp8 is not None:  # the transposed copies the fp8 backward reads (same bits as the forward's q)
        ctx.fp8 = _fp8_weights(ctx.workspace, ctx.weights, ctx.x, transposed=True)
    dx, d_topk_weights, grads = _grad_buffers(ctx.x, ctx.topk_ids, ctx.weights,
                                              given=_check_main_grads(grads_out, "grads_out", "bfloat16"))
    views = _lib.Views()
    args = _backward_args(views, ctx, dy, dx, d_topk_weights, grads, main_grads)
    stream = _lib.stream_of(_lib.device_index(ctx.x.device))
    if ctx.saved is not None:
        saved = _saved_args(views, ctx.saved)
        _lib.check(_lib.symbol("mokBackwardSaved")(ctx.workspace.handle, byref(args), byref(saved), stream))
    else:
        _lib.check(_lib.lib.mokBackward(ctx.workspace.handle, byref(args), stream))
    return Gradients(dx, d_topk_weights, **grads)
