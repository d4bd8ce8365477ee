"""The layer at the sustained clock: every variant timed interleaved, after the GPU has been
under load for a while, so all of them see the same (power-capped) clock.

    python3 tools/sustained.py [shape] [--heat-s 3] [--rounds 20]

Variants (EP=1, one GPU, no shared expert, uniform routing): dense bf16 mm 8192^3, the
torch EP=1 pipeline (bench/baselines.torch_ep1_forward), the experts-only grouped GEMMs, and
mok's fused forward. After --heat-s seconds of back-to-back calls of all of them, --rounds
rounds each time one call of every variant (CUDA events, no synchronisation in between);
medians are printed with the dense-rate floor at the sustained matmul rate. bench/ times
each variant after its own warm-up; this tool removes that thermal bias from the ratios."""
import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, ROOT)
from bench import baselines as bl  # noqa: E402
from mok import functional as F  # noqa: E402

SHAPES = {"dsv3": (7168, 2048, 8, 16, 4096), "qwen3": (4096, 1536, 8, 32, 4096), "glm5": (6144, 2048, 8, 16, 4096)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="dsv3")
    ap.add_argument("--heat-s", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    H, I, k, E, T = SHAPES[args.shape]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=g).bfloat16()
    tw, ids = torch.randn(T, E, device=dev, generator=g).softmax(-1).topk(k, dim=-1)
    ids = ids.int()
    wg = (torch.randn(E, I, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    wu = (torch.randn(E, I, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    wd = (torch.randn(E, H, I, device=dev, generator=g) / I ** 0.5).bfloat16()
    wgu = torch.cat([wg, wu], dim=1).contiguous()
    perm, token, offs, _ = bl.route_plan(ids, E)
    a_rows = x.index_select(0, token)
    h_rows = torch.randn(a_rows.shape[0], I, device=dev, generator=g).bfloat16()
    mm_a = torch.randn(8192, 8192, device=dev, generator=g).bfloat16()
    mm_b = torch.randn(8192, 8192, device=dev, generator=g).bfloat16()
    ws = F.create_workspace(H, I, E, k, max_tokens=T, device="cuda")
    variants = {
        "dense mm 8192^3": lambda: torch.mm(mm_a, mm_b),
        "torch EP=1 fwd": lambda: bl.torch_ep1_forward(x, ids, tw, wg, wu, wd, w_gateup=wgu),
        "experts only": lambda: bl.experts_only(a_rows, offs, wgu, wd, h_rows),
        "mok fused fwd": lambda: F.forward(x, ids, tw, wg, wu, wd, workspace=ws)[0],
    }
    with torch.no_grad():
        for fn in variants.values():
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < args.heat_s:
            for fn in variants.values():
                fn()
            torch.cuda.synchronize()
        events = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                events[name].append((s, e))
        torch.cuda.synchronize()
    ms = {name: sorted(s.elapsed_time(e) for s, e in ev)[len(ev) // 2] for name, ev in events.items()}
    mm_tflops = 2 * 8192 ** 3 / ms["dense mm 8192^3"] / 1e9
    flops = 6 * T * k * H * I
    floor = flops / (mm_tflops * 1e9)
    print(f"{args.shape}, sustained ({args.heat_s:.0f} s of load first, {args.rounds} interleaved rounds):")
    print(f"  dense mm rate {mm_tflops:.0f} TFLOP/s -> layer floor {floor:.3f} ms")
    for name in ("torch EP=1 fwd", "experts only", "mok fused fwd"):
        print(f"  {name:16} {ms[name]:.3f} ms  ({flops / ms[name] / 1e9:.0f} TFLOP/s, {ms[name] / floor:.2f}x floor)")
    print(f"  torch / mok {ms['torch EP=1 fwd'] / ms['mok fused fwd']:.3f}   "
          f"mok / experts {ms['mok fused fwd'] / ms['experts only']:.3f}")


if __name__ == "__main__":
    main()
