"""A CPU forward and backward of a small layer (shared expert, a masked route) through whichever
`mok` is importable.  Run as a script by tests/python/test_packaging.py inside an installed
environment:  python package_smoke.py PREFIX OUT.pt  checks that mok comes from PREFIX and saves
the outputs, which the test compares bitwise with the same call through the source tree."""
import sys

import torch

import mok
from mok import functional as F


def make_inputs():
    g = torch.Generator().manual_seed(1234)
    T, H, I, E, k, Is = 24, 64, 32, 8, 2, 32
    bf = torch.bfloat16
    x = torch.randn(T, H, generator=g).to(bf)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    ids[3, 1] = -1
    tw = torch.rand(T, k, generator=g)
    w = dict(w_gate=torch.randn(E, I, H, generator=g).mul(0.1).to(bf),
             w_up=torch.randn(E, I, H, generator=g).mul(0.1).to(bf),
             w_down=torch.randn(E, H, I, generator=g).mul(0.1).to(bf),
             ws_gate=torch.randn(Is, H, generator=g).mul(0.1).to(bf),
             ws_up=torch.randn(Is, H, generator=g).mul(0.1).to(bf),
             ws_down=torch.randn(H, Is, generator=g).mul(0.1).to(bf))
    dy = torch.randn(T, H, generator=g).to(bf)
    return x, ids, tw, w, dy


def run():
    """Outputs of the forward and the backward, by name."""
    x, ids, tw, w, dy = make_inputs()
    y, ctx = F.forward(x, ids, tw, **w)
    grads = F.backward(ctx, dy)
    return dict(y=y, dx=grads.dx, d_topk_weights=grads.d_topk_weights, w_gate=grads.w_gate,
                w_up=grads.w_up, w_down=grads.w_down, ws_gate=grads.ws_gate, ws_up=grads.ws_up,
                ws_down=grads.ws_down)


if __name__ == "__main__":
    prefix, out = sys.argv[1], sys.argv[2]
    assert mok.__file__.startswith(prefix), f"mok imported from {mok.__file__}, not from {prefix}"
    assert mok._lib.lib._name.startswith(prefix), f"libmok loaded from {mok._lib.lib._name}"
    torch.save(dict(run(), version=mok.__version__), out)
    print("installed mok", mok.__version__, "from", mok.__file__)
