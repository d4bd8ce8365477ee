"""Transposed (column-major) routed expert weights on CUDA: w_gate / w_up [E, I, H] and w_down
[E, H, I] stored as [E, H, I] / [E, I, H] (Hugging Face's is_transposed experts), read in place
by the fused kernels' transposed policy.  Against the same layer on row-major copies of the same
weights: y, dx and d topk_weights bit for bit (the same products in the same K order, only the
operands' layout differs), the weight gradients (written transposed) and main_grads too; and
against the float64 oracle.  Outputs start as NaN (conftest: poison_outputs)."""
import pytest
import torch

import mok
from mok import functional as F
from oracle import WEIGHTS, assert_close, make_routing, make_weights, make_x, reference, route_term_norms

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not mok.has_cuda(), reason="libmok was built without its CUDA part"),
]

ROUTED = ("w_gate", "w_up", "w_down")


def col_major(t: torch.Tensor) -> torch.Tensor:
    """The same values, stored transposed: a column-major view (stride 1 along dim -2)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _layer(gen, H, I, E, k, T, I_s, masked):
    w = make_weights(gen, H, I, E, I_s)
    ids, tw = make_routing(gen, T, E, k, masked=masked)
    cuda = {n: (t.cuda() if t is not None else None) for n, t in w.items()}
    transposed = {n: (col_major(t) if n in ROUTED else t) for n, t in cuda.items()}
    return make_x(gen, T, H), ids, tw, w, cuda, transposed, make_x(gen, T, H)


def _grads_like(weights, dtype, start=None):
    """Gradient buffers in each weight's own orientation (main_grads: from `start`)."""
    out = {}
    for n, t in weights.items():
        if t is None:
            continue
        buf = torch.empty(t.shape, dtype=dtype, device=t.device)
        if t.stride(-2) == 1 and t.stride(-1) != 1:
            buf = col_major(buf)
        buf.copy_(start[n] if start is not None else torch.zeros(t.shape, dtype=dtype))
        out[n] = buf
    return out


def _run(x, ids, tw, weights, dy, saved, config=None, start=None):
    args = (x.cuda(), ids.cuda(), tw.cuda())
    if saved:
        y, ctx = F.forward(*args, **weights, config=config)
    else:
        y = None
        ctx = F.recompute_forward_context(*args, **weights, config=config)
    grads_out = {n: t.fill_(float("nan")) for n, t in _grads_like(weights, torch.bfloat16).items()}
    mg = _grads_like(weights, torch.float32, start) if start is not None else None
    g = F.backward(ctx, dy.cuda(), main_grads=mg, grads_out=grads_out)
    return y, g, mg


@pytest.mark.parametrize("H,I,E,k,T,I_s,masked,ring", [
    (512, 256, 16, 4, 257, 256, 0.0, 0),    # shared expert (row-major beside transposed routed ones)
    (256, 320, 8, 2, 300, 0, 0.15, 0),      # I = 320: partial gate/up, down and wgrad tiles; masked routes
    (384, 192, 4, 1, 129, 128, 0.0, 0),     # k = 1, H and I not multiples of 128
    (256, 256, 4, 2, 700, 0, 0.05, 256),    # a ring of 256 rows: fp32 wgrad pieces across macrobatches
    (768, 256, 32, 8, 64, 0, 0.3, 0),       # experts with 0 rows and 1 row
])
@pytest.mark.parametrize("saved", [False, True])
def test_transposed_weights_equal_row_major_bitwise(gen, H, I, E, k, T, I_s, masked, ring, saved):
    x, ids, tw, w, rm, tr, dy = _layer(gen, H, I, E, k, T, I_s, masked)
    for n in ROUTED:
        assert tr[n].stride(-2) == 1 and torch.equal(tr[n], rm[n]), f"{n}: not a column-major copy"
    config = F.MoKConfig(minibatch_size=128, macrobatch_size=ring) if ring else None
    start = {n: torch.randn(t.shape, generator=gen) for n, t in w.items() if t is not None}
    y_rm, g_rm, mg_rm = _run(x, ids, tw, rm, dy, saved, config, start)
    y_tr, g_tr, mg_tr = _run(x, ids, tw, tr, dy, saved, config, start)
    if saved:
        assert torch.equal(y_rm, y_tr), "y: transposed weights differ from row-major ones"
    assert torch.equal(g_rm.dx, g_tr.dx), "dx differs"
    assert torch.equal(g_rm.d_topk_weights, g_tr.d_topk_weights), "d topk_weights differ"
    for n in WEIGHTS:
        if w[n] is None:
            continue
        a, b = getattr(g_rm, n), getattr(g_tr, n)
        if n in ROUTED:
            assert b.stride(-2) == 1, f"grad {n}: written in place, column-major"
        assert torch.equal(a, b), f"grad {n}: transposed weights' gradient differs from the row-major one's"
        assert torch.equal(mg_rm[n].view(torch.int32), mg_tr[n].view(torch.int32)), f"main_grad {n} differs"
    # Against float64
    _, ref = reference(x, ids, tw, w, dy)
    assert_close("transposed: dx", g_tr.dx.cpu(), ref["dx"])
    assert_close("transposed: d_topk_weights", g_tr.d_topk_weights.cpu(), ref["d_topk_weights"],
                 floor=route_term_norms(x, ids, w, dy))
    for n in WEIGHTS:
        if w[n] is not None:
            assert_close(f"transposed: grad {n}", getattr(g_tr, n).cpu(), ref[n])
    # Bitwise repeatable
    _, again, _ = _run(x, ids, tw, tr, dy, saved, config, start)
    for n in ("dx", "d_topk_weights") + tuple(n for n in WEIGHTS if w[n] is not None):
        assert torch.equal(getattr(again, n), getattr(g_tr, n)), f"{n}: not repeatable"


def test_transposed_forward_matches_oracle(gen):
    H, I, E, k, T = 512, 448, 8, 2, 333
    x, ids, tw, w, rm, tr, dy = _layer(gen, H, I, E, k, T, 0, 0.1)
    y_tr, _ = F.forward(x.cuda(), ids.cuda(), tw.cuda(), **tr, save_for_backward=False)
    y_rm, _ = F.forward(x.cuda(), ids.cuda(), tw.cuda(), **rm, save_for_backward=False)
    assert torch.equal(y_tr, y_rm)
    y_ref, _ = reference(x, ids, tw, w, dy)
    assert_close("transposed forward", y_tr.cpu(), y_ref)


def test_transposed_weights_refused_where_they_cannot_run(gen, monkeypatch):
    x, ids, tw, w, rm, tr, dy = _layer(gen, 256, 256, 8, 2, 100, 0, 0.0)
    args = (x.cuda(), ids.cuda(), tw.cuda())
    monkeypatch.setenv("MOK_FORWARD_PATH", "unfused")
    with pytest.raises(ValueError, match="MOK_FORWARD_PATH=unfused reads row-major routed weights only"):
        F.forward(*args, **tr)
    monkeypatch.setenv("MOK_FORWARD_PATH", "fused")
    monkeypatch.setenv("MOK_BACKWARD_PATH", "unfused")
    ctx = F.recompute_forward_context(*args, **tr)
    with pytest.raises(ValueError, match="only the fused backward reads"):
        F.backward(ctx, dy.cuda(), grads_out=_grads_like(tr, torch.bfloat16))
    monkeypatch.setenv("MOK_BACKWARD_PATH", "fused")
    # Row-major gradient buffers for transposed weights: named, before any launch
    ctx = F.recompute_forward_context(*args, **tr)
    with pytest.raises(ValueError, match="gradients are written in their weights' orientation"):
        F.backward(ctx, dy.cuda(), grads_out=_grads_like(rm, torch.bfloat16))
