"""Every model's expert shape on the CUDA layer: the released models' H, I and I_s (bench/shapes.py
MODELS), most of them multiples of 64 that are not multiples of the 128 x 256 tiles, forward and
backward against a float64 oracle on the GPU; the fused kernels bitwise equal to the unfused
launches, and run twice bitwise.  E and T are scaled down; H, I and I_s are the models'.  Outputs
start as NaN (conftest: poison_outputs), so a column a partial tile failed to write shows up."""
import pytest
import torch

import mok
from mok import functional as F
from oracle import WEIGHTS, assert_close, assert_grads_bitwise, make_routing, reference, route_term_norms

from bench.shapes import MODELS

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not mok.has_cuda(), reason="libmok was built without its CUDA part"),
]

def _model_layer(name, num_tokens=320, seed=0):
    """(x, ids, tw, weights, dy) on the GPU: the model's H, I and I_s, at most 8 experts (4 for
    Mixtral's 14336-wide experts), T = 320 (not a multiple of 128), k as the model's up to E."""
    s = MODELS[name]
    E = 4 if s.I > 8192 else min(s.E_l, 8)
    k = min(s.k, E)
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, fan_in):
        return (torch.randn(*shape, generator=gen, device="cuda") / fan_in ** 0.5).to(torch.bfloat16)

    H, I, Is = s.H, s.I, s.I_s
    w = dict(w_gate=rand(E, I, H, fan_in=H), w_up=rand(E, I, H, fan_in=H), w_down=rand(E, H, I, fan_in=I),
             ws_gate=None, ws_up=None, ws_down=None)
    if Is > 0:
        w.update(ws_gate=rand(Is, H, fan_in=H), ws_up=rand(Is, H, fan_in=H), ws_down=rand(H, Is, fan_in=Is))
    ids, tw = make_routing(torch.Generator().manual_seed(seed), num_tokens, E, k, masked=0.1)
    x = torch.randn(num_tokens, H, generator=gen, device="cuda").to(torch.bfloat16)
    dy = (torch.randn(num_tokens, H, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    return x, ids.cuda(), tw.cuda(), w, dy


@pytest.mark.parametrize("name", list(MODELS))
def test_model_shape_forward_and_backward_match_float64(name, monkeypatch):
    x, ids, tw, w, dy = _model_layer(name)
    y, ctx = F.forward(x, ids, tw, **w)  # the training forward: keeps h = [g | u]
    g = F.backward(ctx, dy)
    y_ref, ref = reference(x, ids, tw, w, dy)
    assert_close(f"{name}: y", y, y_ref)
    assert_close(f"{name}: dx", g.dx, ref["dx"])
    assert_close(f"{name}: d_topk_weights", g.d_topk_weights, ref["d_topk_weights"],
                 floor=route_term_norms(x, ids, w, dy))
    assert torch.all(g.d_topk_weights[ids.long() == -1] == 0), f"{name}: masked routes need d topk_weights = 0"
    for n in WEIGHTS:
        if w[n] is not None:
            assert_close(f"{name}: grad {n}", getattr(g, n), ref[n])
    # The replay (no saved h) gives the same bits; so does a second run
    g_replay = F.backward(F.recompute_forward_context(x, ids, tw, **w), dy)
    assert_grads_bitwise(f"{name}: replayed vs saved h", g, g_replay)
    y2, ctx2 = F.forward(x, ids, tw, **w)
    assert torch.equal(y2, y), f"{name}: forward run twice differs"
    assert_grads_bitwise(f"{name}: run twice", g, F.backward(ctx2, dy))
    del ctx2
    # The fused kernels against the unfused launches (the bitwise oracle of the fused path)
    monkeypatch.setenv("MOK_FORWARD_PATH", "unfused")
    monkeypatch.setenv("MOK_BACKWARD_PATH", "unfused")
    y_u, ctx_u = F.forward(x, ids, tw, **w)
    assert torch.equal(y_u, y), f"{name}: fused forward differs from the unfused launches"
    assert_grads_bitwise(f"{name}: fused vs unfused backward", g, F.backward(ctx_u, dy))


def test_a_shape_off_the_64_grid_is_named_before_launch():
    E, H, I, T = 4, 2016, 1024, 64  # H = 31.5 x 64
    z = dict(device="cuda", dtype=torch.bfloat16)
    ids, tw = make_routing(torch.Generator().manual_seed(0), T, E, 2)
    with pytest.raises(NotImplementedError, match="hidden = 2016 must be a multiple of 64"):
        F.forward(torch.zeros(T, H, **z), ids.cuda(), tw.cuda(), w_gate=torch.zeros(E, I, H, **z),
                  w_up=torch.zeros(E, I, H, **z), w_down=torch.zeros(E, H, I, **z))
