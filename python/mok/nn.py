"""mok.nn.MoE: a drop-in MoE layer (EP = 1) with autograd through mok's ops."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import _lib, ops
from .functional import MoKConfig


class MoE(nn.Module):
    """Routed SwiGLU experts (w_gate, w_up [E, I, H], w_down [E, H, I]), an optional shared
    expert (ws_gate, ws_up [I_s, H], ws_down [H, I_s]) and an optional fp32 softmax top-k
    router. forward(x [..., H]) -> y [..., H]; gradients reach x, the weights, and the
    routing weights (so the router trains)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, topk: int, shared_intermediate: int = 0,
                 *, router: bool = True, norm_topk_prob: bool = True, config: Optional[MoKConfig] = None,
                 device=None, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.hidden, self.intermediate, self.num_experts, self.topk = hidden, intermediate, num_experts, topk
        self.shared_intermediate = shared_intermediate
        self.norm_topk_prob = norm_topk_prob
        self.config = config
        factory = dict(device=device, dtype=dtype)
        self.w_gate = nn.Parameter(torch.empty(num_experts, intermediate, hidden, **factory))
        self.w_up = nn.Parameter(torch.empty(num_experts, intermediate, hidden, **factory))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate, **factory))
        if shared_intermediate > 0:
            self.ws_gate = nn.Parameter(torch.empty(shared_intermediate, hidden, **factory))
            self.ws_up = nn.Parameter(torch.empty(shared_intermediate, hidden, **factory))
            self.ws_down = nn.Parameter(torch.empty(hidden, shared_intermediate, **factory))
        else:
            self.register_parameter("ws_gate", None)
            self.register_parameter("ws_up", None)
            self.register_parameter("ws_down", None)
        # The router computes fp32 logits, so it keeps fp32 weights.
        self.router = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=torch.float32) if router else None
        self.reset_parameters()

    @property
    def config(self) -> MoKConfig:
        return self._config

    @config.setter
    def config(self, config: Optional[MoKConfig]) -> None:
        # The op arguments are derived once here, so that forward stays traceable.
        if config is not None and not isinstance(config, MoKConfig):
            raise TypeError(f"config must be a mok MoKConfig or None, got {type(config).__name__}")
        self._config = config or MoKConfig()
        self._op_config = ops.config_args(self._config)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Each projection like nn.Linear: uniform in +-1/sqrt(fan_in)."""
        for w in (self.w_gate, self.w_up, self.ws_gate, self.ws_up):
            if w is not None:
                w.uniform_(-1.0 / math.sqrt(self.hidden), 1.0 / math.sqrt(self.hidden))
        self.w_down.uniform_(-1.0 / math.sqrt(self.intermediate), 1.0 / math.sqrt(self.intermediate))
        if self.ws_down is not None:
            bound = 1.0 / math.sqrt(self.shared_intermediate)
            self.ws_down.uniform_(-bound, bound)
        if self.router is not None:
            self.router.reset_parameters()

    def route(self, x: torch.Tensor):
        """(topk_ids [T, k] int64, topk_weights [T, k] fp32) from the router, x [T, H]."""
        if self.router is None:
            raise ValueError("this MoE has no router: pass topk_ids and topk_weights to forward")
        probs = torch.softmax(self.router(x.float()), dim=-1)
        topk_weights, topk_ids = probs.topk(self.topk, dim=-1)
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_ids, topk_weights

    def forward(self, x: torch.Tensor, topk_ids: Optional[torch.Tensor] = None,
                topk_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._check_input(x, "x", self.hidden, "hidden", _lib.BF16)
        shape = x.shape
        x2 = x.reshape(-1, self.hidden).contiguous()
        # Route, or take the caller's routing.
        if topk_ids is None:
            if topk_weights is not None:
                raise ValueError("topk_weights given without topk_ids")
            topk_ids, topk_weights = self.route(x2)
        elif topk_weights is None:
            raise ValueError("topk_ids given without topk_weights")
        else:
            self._check_input(topk_ids, "topk_ids", self.topk, "topk", _lib.IDS)
            # any floating dtype: forward takes them as float32
            self._check_input(topk_weights, "topk_weights", self.topk, "topk", None)
        topk_ids = topk_ids.reshape(-1, self.topk).contiguous()
        topk_weights = topk_weights.reshape(-1, self.topk).float().contiguous()
        weights = (self.w_gate, self.w_up, self.w_down, self.ws_gate, self.ws_up, self.ws_down)
        training = torch.is_grad_enabled() and x2.is_cuda and (
            x2.requires_grad or topk_weights.requires_grad or any(w is not None and w.requires_grad for w in weights))
        if training:
            # CUDA training forward: the pre-activations kept for the backward (not recomputed)
            y, _, _ = ops.forward_saving(x2, topk_ids, topk_weights, *weights, **self._op_config)
        else:
            y = ops.forward(x2, topk_ids, topk_weights, *weights, **self._op_config)
        return y.reshape(shape)

    def _check_input(self, t, name: str, last: int, what: str, dtypes) -> None:
        # A tensor [..., last] of one of dtypes on the weights' device
        _lib.expect_tensor(t, name, dtypes)
        if t.dim() == 0 or t.shape[-1] != last:
            raise ValueError(f"{name} must have shape [..., {what} = {last}], got {list(t.shape)}")
        if t.device != self.w_gate.device:
            raise ValueError(f"{name} must be on {self.w_gate.device} (the device of this MoE's weights), got "
                             f"{t.device}")

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, intermediate={self.intermediate}, num_experts={self.num_experts}, "
                f"topk={self.topk}, shared_intermediate={self.shared_intermediate}, "
                f"norm_topk_prob={self.norm_topk_prob}")
