"""Where the layer's time goes, kernel by kernel (torch.profiler's CUDA times), for the fp8_block
and bf16 layers on one shape: the forward (inference), and forward (saving h) + backward.

    python3 tools/dev/fp8_breakdown.py [shape] [--iters N]
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "python")]
from bench.shapes import SHAPES  # noqa: E402
from mok import functional as F  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="dsv3")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    H, I, k, E, T = SHAPES[args.shape].layer
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=g).bfloat16()
    dy = (torch.randn(T, H, device=dev, generator=g) * 0.1).bfloat16()
    tw, ids = torch.randn(T, E, device=dev, generator=g).softmax(-1).topk(k, dim=-1)
    ids = ids.int()
    wg = (torch.randn(E, I, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    wu = (torch.randn(E, I, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    wd = (torch.randn(E, H, I, device=dev, generator=g) / I ** 0.5).bfloat16()
    for prec in ("bf16", "fp8_block"):
        ws = F.create_workspace(H, I, E, k, max_tokens=T, device="cuda", config=F.MoKConfig(precision=prec))
        jobs = {
            "forward": lambda: F.forward(x, ids, tw, wg, wu, wd, workspace=ws, save_for_backward=False),
            "forward+backward": lambda: F.backward(
                F.forward(x, ids, tw, wg, wu, wd, workspace=ws, save_for_backward=True)[1], dy),
        }
        for name, fn in jobs.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iters):
                    fn()
                torch.cuda.synchronize()
            rows = []
            for ev in prof.key_averages():
                t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                if t > 0:
                    rows.append((t / args.iters / 1e3, ev.count / args.iters, ev.key))
            rows.sort(reverse=True)
            total = sum(r[0] for r in rows)
            print(f"{args.shape} {prec} {name}: {total:.3f} ms of kernels a call")
            for ms, n, key in rows[:14]:
                print(f"  {ms:8.3f} ms  x{n:4.1f}  {key[:110]}")


if __name__ == "__main__":
    main()
