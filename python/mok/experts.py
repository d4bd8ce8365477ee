"""mok's layer on expert weights as frameworks store them, read in place.

Frameworks keep the routed experts' gate and up projections in one parameter,
gate_up_proj [E, 2I, H] (K-major rows: HF transformers' experts, among others), either
concatenated (gate rows 0..I-1, then up rows) or interleaved (gate row i at 2i, up at 2i+1),
and down_proj [E, H, I]; or transposed (HF's is_transposed=True, Megatron's legacy
GroupedMLP): gate_up_proj [E, H, 2I] (gate columns 0..I-1, then up) and down_proj [E, I, H].
mok reads each through views with the parameter's own strides (row-major matrices, or
column-major ones for the transposed layout), and the backward writes one fused gradient in
the parameter's layout: no per-call copy of any weight, no weight-sized buffer per step.

  experts(x, topk_ids, topk_weights, gate_up_proj, down_proj, interleaved=False, transposed=False,
          shared=None)
      y [T, H] bf16, differentiable in x, topk_weights and every weight (autograd, and the
      torch.library ops mok::experts_saving / mok::experts_backward for torch.compile);
  experts_separate(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared=None)
      the same with separate w_gate / w_up [E, I, H] (strided views welcome);
  split_gate_up(gate_up_proj, interleaved, transposed)   the two [E, I, H] views mok reads;
  unsupported_reason(...)                     why mok cannot run a layer here, or None.

Ids outside [0, E) (HF's expert-parallel sentinel E, or -1) are routes to no expert.
"""
from __future__ import annotations

import ctypes
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _lib
from . import functional as F
from .config import MoKConfig, _alloc

Shared = Optional[Sequence[Tensor]]


_INTERLEAVED_TRANSPOSED = (
    "interleaved=True with transposed=True: the gate would be every other column of gate_up_proj [E, H, 2I], "
    "a view with unit stride in no dimension, which the kernels' TMA boxes cannot read; store gate and up "
    "concatenated (gate columns 0..I-1, then up)")


def split_gate_up(gate_up_proj: Tensor, interleaved: bool = False, transposed: bool = False
                  ) -> Tuple[Tensor, Tensor]:
    """(w_gate, w_up) [E, I, H]: views of gate_up_proj (no copy), [E, 2I, H]; with transposed,
    [E, H, 2I] (gate columns 0..I-1, then up), whose views are column-major."""
    if transposed:
        if interleaved:
            raise ValueError(_INTERLEAVED_TRANSPOSED)
        if gate_up_proj.dim() != 3 or gate_up_proj.shape[2] % 2:
            raise ValueError(f"gate_up_proj must be [E, H, 2I] (transposed), got shape {list(gate_up_proj.shape)}")
        inter = gate_up_proj.shape[2] // 2
        columns = gate_up_proj.transpose(1, 2)
        return columns[:, :inter], columns[:, inter:]
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[1] % 2:
        raise ValueError(f"gate_up_proj must be [E, 2I, H], got shape {list(gate_up_proj.shape)}")
    if interleaved:
        return gate_up_proj[:, 0::2], gate_up_proj[:, 1::2]
    inter = gate_up_proj.shape[1] // 2
    return gate_up_proj[:, :inter], gate_up_proj[:, inter:]


def _down_view(down_proj: Tensor, transposed: bool) -> Tensor:
    """w_down [E, H, I] as mok reads it: down_proj itself, or the column-major view of a
    transposed down_proj [E, I, H]."""
    if not transposed:
        return down_proj
    if down_proj.dim() != 3:
        raise ValueError(f"down_proj must be [E, I, H] (transposed), got shape {list(down_proj.shape)}")
    return down_proj.transpose(1, 2)


def unsupported_reason(*, hidden: int, intermediate: int, num_experts: int, topk: int,
                       device: "torch.device | str", shared_intermediate: int = 0, backward: bool = True,
                       max_tokens: int = 1, config: Optional[MoKConfig] = None,
                       transposed: bool = False) -> Optional[str]:
    """None when this libmok runs that layer (and its backward, with backward=True) on
    `device`, with transposed (column-major) routed weights if `transposed`; else the sentence
    that names why (mokCheckSupport; on CUDA only the fused kernels read transposed weights,
    and it names a config whose call would take the separate launches). Allocates nothing."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        return f"mok runs on cpu and cuda devices, not {device.type}"
    dims = F.LayerDims(hidden, intermediate, num_experts, topk, max(1, max_tokens), shared_intermediate)
    try:
        # The device's kind is what matters (nothing is allocated): cuda:N or cuda alike
        index = _lib.DEVICE_CPU if device.type == "cpu" else (device.index or 0)
        c = F._c_config(dims, config, index)
        flags = (_lib.SUPPORT_BACKWARD if backward else 0) | (_lib.SUPPORT_TRANSPOSED if transposed else 0)
        result = _lib.symbol("mokCheckSupport")(ctypes.byref(c), flags)
    except (ValueError, NotImplementedError) as e:
        return str(e)
    if result != _lib.SUCCESS:
        return _lib.last_error() or _lib.error_string(result)
    return None


# ---------------------------------------------------------------------------------------
# The ops: the fused parameter in, its fused gradient out


def _knobs(config: Optional[MoKConfig]) -> List[float]:
    """A MoKConfig as the ops' one list argument (every field exact in a double)."""
    from .ops import config_args
    return [float(v) for v in config_args(config).values()]


def _config(knobs: Sequence[float]) -> MoKConfig:
    from .ops import _config as from_args
    ints = [int(v) for v in knobs]
    return from_args(*ints[:5], knobs[5], ints[6], knobs[7], *ints[8:])


def _weights(gate_up: Tensor, down: Tensor, interleaved: bool, transposed: bool, ws_gate, ws_up, ws_down):
    w_gate, w_up = split_gate_up(gate_up, interleaved, transposed)
    return w_gate, w_up, _down_view(down, transposed), ws_gate, ws_up, ws_down


@torch.library.custom_op("mok::experts_saving", mutates_args=())
def experts_saving(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up: Tensor, down: Tensor,
                   ws_gate: Optional[Tensor], ws_up: Optional[Tensor], ws_down: Optional[Tensor],
                   interleaved: bool, transposed: bool, knobs: List[float]) -> Tuple[Tensor, Tensor, Tensor]:
    """(y, h, shared_h): the training forward; h and shared_h are the pre-activations the
    CUDA backward reads (empty on the CPU, whose backward recomputes them)."""
    weights = _weights(gate_up, down, interleaved, transposed, ws_gate, ws_up, ws_down)
    y, ctx = F.forward(x, topk_ids, topk_weights, *weights, config=_config(knobs))
    h, shared_h = ctx.saved if ctx.saved is not None else (None, None)
    empty = x.new_empty((0,), dtype=torch.bfloat16)
    return y, h if h is not None else empty, shared_h if shared_h is not None else empty.clone()


@experts_saving.register_fake
def _(x, topk_ids, topk_weights, gate_up, down, ws_gate, ws_up, ws_down, interleaved, transposed, knobs):
    config = _config(knobs)
    T, E, k = int(x.shape[0]), int(gate_up.shape[0]), int(topk_ids.shape[1])
    inter = int(gate_up.shape[2 if transposed else 1]) // 2
    y = x.new_empty((T, x.shape[1]), dtype=torch.bfloat16)
    if x.device.type != "cuda":
        return y, x.new_empty((0,), dtype=torch.bfloat16), x.new_empty((0,), dtype=torch.bfloat16)
    max_rows, _, _ = F.plan_capacity(E, k, F.token_bucket(T), 1, config)
    shared = x.new_empty((T, 2 * ws_gate.shape[0]) if ws_gate is not None else (0,), dtype=torch.bfloat16)
    return y, x.new_empty((max_rows, 2 * inter), dtype=torch.bfloat16), shared


@torch.library.custom_op("mok::experts_backward", mutates_args=())
def experts_backward(dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up: Tensor, down: Tensor,
                     ws_gate: Optional[Tensor], ws_up: Optional[Tensor], ws_down: Optional[Tensor],
                     interleaved: bool, transposed: bool, knobs: List[float], h: Tensor, shared_h: Tensor
                     ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, d_topk_weights, d gate_up in gate_up's layout ([E, 2I, H], or [E, H, 2I]
    transposed), d down in down's, d ws_gate, d ws_up, d ws_down); the shared ones are empty
    without a shared expert."""
    weights = _weights(gate_up, down, interleaved, transposed, ws_gate, ws_up, ws_down)
    ctx = F.recompute_forward_context(x, topk_ids, topk_weights, *weights, config=_config(knobs))
    if h.numel() > 0:
        ctx.saved = (h, shared_h if ws_gate is not None else None)
    # One fused gradient shaped like gate_up (and one like down), written through the views the
    # weights are read through
    d_gate_up = _alloc(tuple(gate_up.shape), torch.bfloat16, gate_up.device)
    d_down = _alloc(tuple(down.shape), torch.bfloat16, down.device)
    d_gate, d_up = split_gate_up(d_gate_up, interleaved, transposed)
    g = F.backward(ctx, dy, grads_out={"w_gate": d_gate, "w_up": d_up, "w_down": _down_view(d_down, transposed)})
    absent = x.new_empty((0,), dtype=torch.bfloat16)
    shared = [t if t is not None else absent.clone() for t in (g.ws_gate, g.ws_up, g.ws_down)]
    return g.dx, g.d_topk_weights, d_gate_up, d_down, *shared


@experts_backward.register_fake
def _(dy, x, topk_ids, topk_weights, gate_up, down, ws_gate, ws_up, ws_down, interleaved, transposed, knobs, h,
      shared_h):
    def like(w):
        return x.new_empty((0,) if w is None else w.shape, dtype=torch.bfloat16)

    return (x.new_empty(x.shape, dtype=torch.bfloat16), topk_weights.new_empty(topk_ids.shape, dtype=torch.float32),
            like(gate_up), like(down), like(ws_gate), like(ws_up), like(ws_down))


def _setup(ctx, inputs, output) -> None:
    x, topk_ids, topk_weights, gate_up, down, ws_gate, ws_up, ws_down, interleaved, transposed, knobs = inputs
    _, h, shared_h = output
    ctx.save_for_backward(x, topk_ids, topk_weights, gate_up, down, ws_gate, ws_up, ws_down, h, shared_h)
    ctx.interleaved, ctx.transposed, ctx.knobs = interleaved, transposed, knobs
    ctx.mark_non_differentiable(h, shared_h)


def _backward(ctx, dy, _dh, _dsh):
    x, topk_ids, topk_weights, gate_up, down, ws_gate, ws_up, ws_down, h, shared_h = ctx.saved_tensors
    dx, dtw, d_gate_up, d_down, ds_gate, ds_up, ds_down = torch.ops.mok.experts_backward(
        dy.contiguous(), x, topk_ids, topk_weights, gate_up, down, ws_gate, ws_up, ws_down, ctx.interleaved,
        ctx.transposed, ctx.knobs, h, shared_h)
    shared = (ds_gate, ds_up, ds_down) if ws_gate is not None else (None, None, None)
    return dx, None, dtw, d_gate_up, d_down, *shared, None, None, None


experts_saving.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------------------------------
# The user's functions


def _routing(topk_ids: Tensor, topk_weights: Tensor, num_experts: int) -> Tuple[Tensor, Tensor]:
    """Ids outside [0, E) -> -1 (no route); the weights in fp32 (their gradient flows back in
    their own dtype through the cast)."""
    ids = torch.where((topk_ids >= 0) & (topk_ids < num_experts), topk_ids, topk_ids.new_full((), -1))
    return ids, topk_weights.to(torch.float32)


def _shared(shared: Shared) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    if shared is None:
        return None, None, None
    if len(shared) != 3:
        raise ValueError(f"shared must be (ws_gate [I_s, H], ws_up [I_s, H], ws_down [H, I_s]), got {len(shared)} "
                         f"tensors")
    return tuple(shared)


def experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor, *,
            interleaved: bool = False, transposed: bool = False, shared: Shared = None,
            config: Optional[MoKConfig] = None) -> Tensor:
    """y [T, H] bf16 = Σ_j w_j·down_e(bf16(silu(gate_e(x))·up_e(x))) (+ the shared expert's),
    with gate_up_proj [E, 2I, H] (interleaved: gate and up rows alternate) and down_proj
    [E, H, I] read in place; transposed: gate_up_proj [E, H, 2I] (gate columns, then up) and
    down_proj [E, I, H], read in place as column-major matrices.  Autograd gives one fused
    gradient for gate_up_proj, each gradient in its parameter's layout."""
    split_gate_up(gate_up_proj, interleaved, transposed)  # the layout's errors before any work
    ids, weights = _routing(topk_ids, topk_weights, gate_up_proj.shape[0])
    ws_gate, ws_up, ws_down = _shared(shared)
    if not _needs_grad(x, weights, gate_up_proj, down_proj, ws_gate, ws_up, ws_down):
        # Inference: the plain forward, nothing kept for a backward
        from .ops import config_args
        w_gate, w_up, w_down, *_ = _weights(gate_up_proj, down_proj, interleaved, transposed, None, None, None)
        return torch.ops.mok.forward(x.contiguous(), ids, weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                                     0, *config_args(config).values())
    y, _, _ = experts_saving(x.contiguous(), ids, weights, gate_up_proj, down_proj, ws_gate, ws_up, ws_down,
                             bool(interleaved), bool(transposed), _knobs(config))
    return y


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def experts_separate(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor,
                     w_down: Tensor, *, shared: Shared = None, config: Optional[MoKConfig] = None) -> Tensor:
    """experts() for separate w_gate, w_up [E, I, H] (views with shared strides welcome) and
    w_down [E, H, I]; their gradients arrive on each of them."""
    from .ops import config_args
    ids, weights = _routing(topk_ids, topk_weights, w_gate.shape[0])
    ws_gate, ws_up, ws_down = _shared(shared)
    args = (x.contiguous(), ids, weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, 0,
            *config_args(config).values())
    if x.device.type == "cuda" and _needs_grad(x, weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
        # the training forward keeps h for the backward
        return torch.ops.mok.forward_saving(*args)[0]
    return torch.ops.mok.forward(*args)
