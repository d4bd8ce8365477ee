"""Runs chosen backward GEMM kinds once each on an expert shape, for a profiler to attach:

    ncu --section SpeedOfLight --section WarpStateStats -k regex:grouped python3 tools/profile_kinds.py dsv3 \\
        --kinds dgrad_down,dgrad_down_swiglu

Inputs as in tools/sustained.py --gemm (uniform routing, T·k/E rows per expert); one warm-up
call of each kind, then one profiled call each (ncu's --launch-skip 1 --launch-count ... picks
them)."""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from mok import ops  # noqa: E402
from sustained import SHAPES  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="dsv3")
    ap.add_argument("--kinds", default="dgrad_down,dgrad_down_swiglu")
    args = ap.parse_args()
    H, I, k, E, T = SHAPES[args.shape]
    dev = torch.device("cuda")
    rows = T * k // E // 128 * 128
    M = rows * E
    g = torch.Generator(device=dev).manual_seed(0)
    bf = dict(device=dev, dtype=torch.bfloat16)
    dy = torch.randn(M, H, device=dev, generator=g).bfloat16()
    wd = (torch.randn(E, H, I, device=dev, generator=g) / I ** 0.5).bfloat16()
    h = torch.randn(M, 2 * I, device=dev, generator=g).bfloat16()
    rw = torch.rand(M, device=dev, generator=g)
    block_expert = torch.arange(E, device=dev, dtype=torch.int32).repeat_interleave(rows // 128)
    da, dh, wa = torch.empty(M, I, **bf), torch.empty(M, 2 * I, **bf), torch.empty(M, I, **bf)
    parts = torch.empty(M, I // 128, device=dev, dtype=torch.float32)
    # The wgrad kinds (K-grouped over each expert's rows): dW_down = dyᵀ·a, [dW_gate; dW_up] = [dg|du]ᵀ·x
    act = torch.randn(M, I, device=dev, generator=g).bfloat16()
    x = torch.randn(M, H, device=dev, generator=g).bfloat16()
    ex_off = torch.arange(E + 1, device=dev, dtype=torch.int32) * rows
    ex_cnt = torch.full((E,), rows, device=dev, dtype=torch.int32)
    gwd, gwgu = torch.empty(E, H, I, **bf), torch.empty(E, 2 * I, H, **bf)
    run = {
        "dgrad_down": lambda: ops.grouped_mm(dy, wd, block_expert, out=da, kind="dgrad_down"),
        "dgrad_down_swiglu": lambda: ops.grouped_mm(dy, wd, block_expert, out=dh, kind="dgrad_down_swiglu", h=h,
                                                    row_weight=rw, wa=wa, dtw_partials=parts),
        "dgrad_down_swiglu_dh_only": lambda: ops.grouped_mm(dy, wd, block_expert, out=dh, kind="dgrad_down_swiglu",
                                                            h=h, row_weight=rw),
        "wgrad_down": lambda: ops.grouped_wgrad(dy, act, ex_off, ex_cnt, out=gwd),
        "wgrad_gate_up": lambda: ops.grouped_wgrad(h, x, ex_off, ex_cnt, out=gwgu),
        # torch's kernels for the same products (torch._grouped_mm, 2-D x 2-D with offsets)
        "torch_wgrad_down": lambda: torch._grouped_mm(dy.t(), act, offs=ex_off[1:]),
        "torch_wgrad_gate_up": lambda: torch._grouped_mm(h.t(), x, offs=ex_off[1:]),
    }
    kinds = args.kinds.split(",")
    for name in kinds:
        run[name]()
    torch.cuda.synchronize()
    for name in kinds:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        run[name]()
        e.record()
        torch.cuda.synchronize()
        print(f"{args.shape} {name}: {s.elapsed_time(e):.3f} ms (M = {M}, H = {H}, I = {I})")


if __name__ == "__main__":
    main()
