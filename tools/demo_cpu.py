"""The main job on a machine without a GPU: a small MoE layer on mok's CPU reference
backend, forward and backward through mok.nn.MoE, checked against an independent float64
PyTorch computation of the same math (the oracle of the test suite), and run twice to
show bitwise determinism."""
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "tests", "python")]
import mok  # noqa: E402
from oracle import make_routing, make_weights, make_x, reference  # noqa: E402


def rel(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item(), (got - want).abs().max().item()


def main():
    H, I, I_s, E, k, T = 256, 128, 128, 8, 2, 256
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    weights = make_weights(gen, H, I, E, I_s)
    x = make_x(gen, T, H)
    ids, tw = make_routing(gen, T, E, k)
    dy = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    print(f"mok {mok.__version__}: CPU reference backend, H={H} I={I} I_s={I_s} E={E} k={k} T={T}")

    def run():
        y, ctx = mok.functional.forward(x, ids, tw, **weights)
        grads = mok.functional.backward(ctx, dy)
        return y, grads

    t0 = time.perf_counter()
    y, grads = run()
    t1 = time.perf_counter()
    y2, grads2 = run()
    ref_y, ref_grads = reference(x, ids, tw, weights, dy)
    rows = [("y", y, ref_y), ("dx", grads.dx, ref_grads["dx"]),
            ("d_topk_weights", grads.d_topk_weights, ref_grads["d_topk_weights"])]
    rows += [(f"d {n}", getattr(grads, n), ref_grads[n]) for n in ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")]
    ok = True
    print(f"{'output':16} {'rel Frobenius':>14} {'max-abs':>10}  vs float64 oracle")
    for name, got, want in rows:
        r, m = rel(got, want)
        ok &= r < 1e-2
        print(f"{name:16} {r:14.3e} {m:10.3e}  {'ok' if r < 1e-2 else 'FAIL'}")
    same = torch.equal(y, y2) and torch.equal(grads.dx, grads2.dx) and torch.equal(grads.w_down, grads2.w_down)
    ok &= same
    print(f"run twice: {'bitwise identical' if same else 'DIFFERENT'}; forward+backward {1e3 * (t1 - t0):.1f} ms")
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
