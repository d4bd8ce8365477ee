"""Float64 oracle of the MoE layer (docs/contracts.md §1), independent of mok, plus input makers
and comparison helpers for the tests.

y[t] = sum_j w[t,j] * expert_{id(t,j)}(x[t]) + shared(x[t]),
expert_e(v) = w_down_e (silu(w_gate_e v) * (w_up_e v)); gradients by torch.autograd.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Dict, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench/
from bench import shapes as _bench_shapes  # noqa: E402

WEIGHTS = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")
GRADS = ("dx", "d_topk_weights") + WEIGHTS


def make_weights(gen, hidden, intermediate, num_experts, shared_intermediate=0) -> Dict[str, Optional[torch.Tensor]]:
    """bf16 weights scaled like nn.Linear (outputs of order 1)."""
    def rand(*shape, fan_in):
        return (torch.randn(*shape, generator=gen) / math.sqrt(fan_in)).to(torch.bfloat16)

    w = dict(w_gate=rand(num_experts, intermediate, hidden, fan_in=hidden),
             w_up=rand(num_experts, intermediate, hidden, fan_in=hidden),
             w_down=rand(num_experts, hidden, intermediate, fan_in=intermediate),
             ws_gate=None, ws_up=None, ws_down=None)
    if shared_intermediate > 0:
        w.update(ws_gate=rand(shared_intermediate, hidden, fan_in=hidden),
                 ws_up=rand(shared_intermediate, hidden, fan_in=hidden),
                 ws_down=rand(hidden, shared_intermediate, fan_in=shared_intermediate))
    return w


def make_routing(gen, num_tokens, num_experts, topk, ids_dtype=torch.int32, masked=0.15):
    """Distinct ids per token with some -1 (token 0 fully masked when T > 2), and routing
    weights of both signs with some exact zeros."""
    ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :topk]
    ids[torch.rand(num_tokens, topk, generator=gen) < masked] = -1
    if num_tokens > 2:
        ids[0] = -1
    weights = torch.randn(num_tokens, topk, generator=gen)
    weights[torch.rand(num_tokens, topk, generator=gen) < 0.15] = 0.0
    return ids.to(ids_dtype).contiguous(), weights.contiguous()


def make_x(gen, num_tokens, hidden) -> torch.Tensor:
    return torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)


def _swiglu(v, gate, up, down):
    return (torch.nn.functional.silu(v @ gate.T) * (v @ up.T)) @ down.T


def reference(x, topk_ids, topk_weights, weights, dy):
    """(y, grads) in float64: grads has dx, d_topk_weights and one entry per present weight."""
    f64 = {name: (w.double().requires_grad_() if w is not None else None) for name, w in weights.items()}
    x64 = x.double().requires_grad_()
    tw64 = topk_weights.double().requires_grad_()
    ids = topk_ids.long()
    y = x64 * 0.0  # keeps the graph connected when no route is taken
    for e in range(f64["w_gate"].shape[0]):
        tok, j = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            out = _swiglu(x64[tok], f64["w_gate"][e], f64["w_up"][e], f64["w_down"][e])
            y = y.index_add(0, tok, tw64[tok, j].unsqueeze(1) * out)
    if f64["ws_gate"] is not None:
        y = y + _swiglu(x64, f64["ws_gate"], f64["ws_up"], f64["ws_down"])
    inputs = {"dx": x64, "d_topk_weights": tw64, **{n: w for n, w in f64.items() if w is not None}}
    grads = torch.autograd.grad((y * dy.double()).sum(), list(inputs.values()), allow_unused=True)
    out = {name: (torch.zeros_like(t) if g is None else g) for (name, t), g in zip(inputs.items(), grads)}
    return y.detach(), out


def route_term_norms(x, topk_ids, weights, dy) -> torch.Tensor:
    """[T, k] float64: the l2 norm of the terms of each route's d topk_weights dot product,
    sum_i da_i * a_i (da = w_down^T dy, a = silu(g) * u), 0 for masked routes.

    A single dot product can cancel far below its terms, and bf16 rounding errs relative to
    the terms: this is the floor of the reference norm for d topk_weights (see assert_close).
    """
    ids = topk_ids.long()
    x64, dy64 = x.double(), dy.double()
    norms = torch.zeros(ids.shape, dtype=torch.float64, device=x.device)
    for e in range(weights["w_gate"].shape[0]):
        tok, j = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            v = x64[tok]
            a = torch.nn.functional.silu(v @ weights["w_gate"][e].double().T) * (v @ weights["w_up"][e].double().T)
            da = dy64[tok] @ weights["w_down"][e].double()
            norms[tok, j] = (da * a).norm(dim=1)
    return norms


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float = 1e-2,
                 floor: Optional[torch.Tensor] = None) -> None:
    """Relative Frobenius error under tol, and no NaN where the oracle is finite.  With
    `floor`, the reference norm is taken as max(||ref||, ||floor||)."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} vs oracle {tuple(ref.shape)}"
    got64 = got.double()
    unwritten = torch.isnan(got64) & torch.isfinite(ref)
    assert not unwritten.any(), f"{name}: {int(unwritten.sum())} NaN elements where the oracle is finite"
    diff = got64 - ref
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    ref_norm = ref.norm().item()
    if floor is not None:
        ref_norm = max(ref_norm, floor.norm().item())
    if ref_norm == 0.0:
        assert max_abs == 0.0, f"{name}: oracle is zero, max-abs error {max_abs:.3e}"
        return
    rel = diff.norm().item() / ref_norm
    assert rel < tol, f"{name}: relative Frobenius error {rel:.3e} >= {tol} (max-abs {max_abs:.3e})"


def assert_grads_bitwise(tag: str, a, b, names=GRADS) -> None:
    """The gradients of two backward results (mok.functional's Grads) equal bit for bit; a
    gradient absent (None) in one is absent in the other."""
    for name in names:
        ga, gb = getattr(a, name), getattr(b, name)
        if ga is None:
            assert gb is None, f"{tag}: {name} present in one result only"
            continue
        view = torch.int16 if ga.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(ga.view(view), gb.view(view)), f"{tag}: {name} differs bitwise"


# The BENCH.md shapes (bench/shapes.py, the one table): H, I, k, E, T
BENCH_SHAPES = {name: s.layer for name, s in _bench_shapes.SHAPES.items()}


def bench_shape_layer(gen, name, dev="cuda"):
    """(x, topk_ids, topk_weights, weights) of a BENCH.md shape at full size on `dev`: softmax
    top-k routing renormalised, weights scaled by 1/sqrt(fan-in)."""
    H, I, k, E, T = BENCH_SHAPES[name]
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
    logits = torch.randn(T, E, generator=gen)
    tw, ids = logits.softmax(-1).topk(k, dim=-1)
    ids, tw = ids.int().to(dev), (tw / tw.sum(-1, keepdim=True)).to(dev)
    w = {"w_gate": (torch.randn(E, I, H, device=dev) / H ** 0.5).bfloat16(),
         "w_up": (torch.randn(E, I, H, device=dev) / H ** 0.5).bfloat16(),
         "w_down": (torch.randn(E, H, I, device=dev) / I ** 0.5).bfloat16()}
    return x, ids, tw, w
