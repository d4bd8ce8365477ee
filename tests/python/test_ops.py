"""The torch.library ops: direct calls, fake implementations, and opcheck."""
import pytest
import torch

import mok  # noqa: F401  (registers the ops)
from mok import functional as F
from mok import ops
from oracle import WEIGHTS, make_routing, make_weights, make_x


def _inputs(gen, T=19, shared=16, requires_grad=False):
    w = make_weights(gen, 64, 32, 8, shared)
    ids, tw = make_routing(gen, T, 8, 2, torch.int64)
    x = make_x(gen, T, 64)
    args = [x, ids, tw] + [w[n] for n in WEIGHTS]
    if requires_grad:
        for i, a in enumerate(args):
            if a is not None and a.is_floating_point():
                args[i] = a.clone().requires_grad_()
    return args


def test_forward_and_backward_ops_match_functional(gen):
    args = _inputs(gen)
    dy = make_x(gen, 19, 64)
    y = torch.ops.mok.forward(*args)
    y_f, ctx = F.forward(*args)
    assert torch.equal(y, y_f)
    out = torch.ops.mok.backward(dy, *args)
    g = F.backward(ctx, dy)
    for got, name in zip(out, ("dx", "d_topk_weights") + WEIGHTS):
        assert torch.equal(got, getattr(g, name)), name
    # Without a shared expert the shared gradients are empty tensors.
    args = _inputs(gen, shared=0)
    out = torch.ops.mok.backward(dy, *args)
    assert [t.numel() for t in out[5:]] == [0, 0, 0]


def test_explicit_max_tokens_and_config(gen):
    args = _inputs(gen)
    config = F.MoKConfig(minibatch_size=256, macrobatch_size=512, num_threads=1)
    y = torch.ops.mok.forward(*args, max_tokens=19, **ops.config_args(config))
    assert torch.equal(y, F.forward(*args)[0])
    assert F.get_workspace(64, 32, 8, 2, 19, shared_intermediate=16, config=config) is not None
    with pytest.raises(ValueError, match="max_tokens = 8"):
        torch.ops.mok.forward(*args, max_tokens=8)


def test_fake_shapes(gen):
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = _inputs(gen)
    real_ids = [real[1], real[1][:5]]
    with FakeTensorMode() as mode:
        fake = [None if a is None else mode.from_tensor(a) for a in real]
        y = torch.ops.mok.forward(*fake)
        grads = torch.ops.mok.backward(fake[0], *fake)
        ids = [mode.from_tensor(t) for t in real_ids]
        plan = torch.ops.mok.build_schedule(ids, 8, 1)
    assert y.shape == (19, 64) and y.dtype == torch.bfloat16
    assert [tuple(g.shape) for g in grads] == [(19, 64), (19, 2), (8, 32, 64), (8, 32, 64), (8, 64, 32),
                                               (16, 64), (16, 64), (64, 16)]
    real_plan = torch.ops.mok.build_schedule(real_ids, 8, 1)
    for f, r in zip(plan, real_plan):
        assert f.shape == r.shape and f.dtype == r.dtype


def test_build_schedule_op(gen):
    ids = [make_routing(gen, T, 8, 2)[0] for T in (7, 12)]
    rows, count, offset, block_expert, error = torch.ops.mok.build_schedule(ids, 8, 1, 16, 4, 8, 16)
    schedule = F.build_schedule(ids, 8, ep_rank=1, max_tokens=16,
                                config=F.MoKConfig(block_m=4, minibatch_size=8, macrobatch_size=16))
    for a, b in zip((rows, count, offset, block_expert, error), (schedule.rows, schedule.expert_count,
                                                                  schedule.expert_offset, schedule.block_expert,
                                                                  schedule.error)):
        assert torch.equal(a, b)


def test_opcheck_forward(gen):
    for shared in (0, 16):
        torch.library.opcheck(torch.ops.mok.forward.default, tuple(_inputs(gen, shared=shared, requires_grad=True)))


def test_opcheck_backward(gen):
    args = _inputs(gen)
    torch.library.opcheck(torch.ops.mok.backward.default, (make_x(gen, 19, 64), *args))


def test_opcheck_build_schedule(gen):
    ids = [make_routing(gen, T, 8, 2)[0] for T in (7, 12)]
    torch.library.opcheck(torch.ops.mok.build_schedule.default, (ids, 8, 1, 16))
