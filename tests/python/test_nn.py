"""mok.nn.MoE: autograd against functional.backward, training, torch.compile."""
import pytest
import torch

import mok
from mok import functional as F
from oracle import WEIGHTS, make_routing, make_x


def _model(seed, shared, router=True, **kw):
    torch.manual_seed(seed)
    return mok.nn.MoE(64, 32, 8, 2, shared, router=router, **kw)


def _weights(model):
    return [getattr(model, n) for n in WEIGHTS]


@pytest.mark.parametrize("shared", [0, 16])
def test_autograd_matches_functional(seed, gen, shared):
    model = _model(seed, shared)
    x = make_x(gen, 24, 64).reshape(4, 6, 64).requires_grad_()
    dy = make_x(gen, 24, 64).reshape(4, 6, 64)
    y = model(x)
    y.backward(dy)
    assert y.shape == x.shape and y.dtype == torch.bfloat16

    # The same call through functional, with the router's routing.
    x2 = x.detach().reshape(24, 64)
    with torch.no_grad():
        ids, tw = model.route(x2)
    y_f, ctx = F.forward(x2, ids, tw, *_weights(model))
    g = F.backward(ctx, dy.reshape(24, 64))
    assert torch.equal(y.detach().reshape(24, 64), y_f)
    for n in WEIGHTS:
        p = getattr(model, n)
        if p is None:
            assert getattr(g, n) is None
        else:
            assert torch.equal(p.grad, getattr(g, n)), f"grad of {n}"
    # The router gets d topk_weights pulled back through softmax/top-k; x gets dx plus the
    # router's share.
    router_w = model.router.weight.detach().clone().requires_grad_()
    router_x = x2.clone().requires_grad_()
    probs = torch.softmax(router_x.float() @ router_w.t(), dim=-1)
    top, _ = probs.topk(2, dim=-1)
    (top / top.sum(-1, keepdim=True)).backward(g.d_topk_weights)
    assert torch.equal(model.router.weight.grad, router_w.grad)
    assert torch.equal(x.grad.reshape(24, 64), g.dx + router_x.grad)


def test_given_routing_and_no_router(seed, gen):
    model = _model(seed, 0, router=False)
    assert model.router is None
    x = make_x(gen, 10, 64)
    ids, tw = make_routing(gen, 10, 8, 2)
    tw.requires_grad_()
    y = model(x, ids, tw)
    y.float().sum().backward()
    assert tw.grad is not None and tw.grad.shape == tw.shape
    y_f, _ = F.forward(x, ids, tw.detach(), *_weights(model))
    assert torch.equal(y, y_f)
    with pytest.raises(ValueError, match="no router"):
        model(x)
    with pytest.raises(ValueError, match="without topk_weights"):
        model(x, ids)


def test_empty_batch(seed):
    model = _model(seed, 16)
    x = torch.zeros(0, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    y = model(x)
    y.sum().backward()
    assert y.shape == (0, 5, 64) and x.grad.shape == x.shape
    assert torch.all(model.w_gate.grad == 0) and torch.all(model.ws_gate.grad == 0)


def test_init_is_not_zero(seed):
    model = _model(seed, 16)
    for n in WEIGHTS:
        p = getattr(model, n)
        assert p.dtype == torch.bfloat16 and p.abs().max() > 0 and p.abs().max() <= 1.0 / 4 + 1e-3
    assert model.router.weight.dtype == torch.float32
    assert "num_experts=8" in repr(model)


def test_sgd_lowers_loss(seed, gen):
    model = _model(seed, 16)
    x = make_x(gen, 48, 64)
    target = make_x(gen, 48, 64).float() * 0.1
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = (model(x).float() - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], f"losses {losses}"


def test_compile_matches_eager(seed, gen):
    torch._dynamo.reset()
    eager = _model(seed, 16)
    compiled_model = _model(seed, 16)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    for T in (20, 33):
        x = make_x(gen, T, 64)
        dy = make_x(gen, T, 64)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = eager(xe), compiled(xc)
        assert torch.equal(ye, yc), f"T={T}: compiled y differs from eager"
        ye.backward(dy)
        yc.backward(dy)
        assert torch.equal(xe.grad, xc.grad)
        for (n, pe), pc in zip(eager.named_parameters(), compiled_model.parameters()):
            assert torch.equal(pe.grad, pc.grad), f"T={T}: grad of {n} differs"
        eager.zero_grad()
        compiled_model.zero_grad()
