"""The wgrad gate/up kind's fixed cost per tile: mok (knob variants) and torch._grouped_mm timed
interleaved at several rows per expert R (K = R), same experts and output shape, sustained clock.
Per tile t(R) = fixed + R / 64 * per_k_block; the fit over R gives both, so the part of the gap to
torch that is per tile (epilogue, drain, restart) separates from the part that is per k-block.

    python3 tools/dev/wgrad_k_scan.py [qwen3|dsv3] [--rows 256,512,1024,2048]
        [--variants base,g4:MOK_TILE_N_GROUP=4]"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import sustained as su  # noqa: E402
from mok import ops  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="qwen3")
    ap.add_argument("--rows", default="256,512,1024,2048")
    ap.add_argument("--variants", default="base")
    ap.add_argument("--heat-s", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    H, I, k, E, T = su.SHAPES[args.shape]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    knobs = su.parse_variants(args.variants)
    row_list = [int(r) for r in args.rows.split(",")]
    variants, tiles, flops = {}, {}, {}
    for R in row_list:
        M = R * E
        dgu = (torch.randn(M, 2 * I, device=dev, generator=g) / (2 * I) ** 0.5).bfloat16()
        x = torch.randn(M, H, device=dev, generator=g).bfloat16()
        off = torch.arange(E + 1, device=dev, dtype=torch.int32) * R
        cnt = torch.full((E,), R, device=dev, dtype=torch.int32)
        out = torch.empty(E, 2 * I, H, device=dev, dtype=torch.bfloat16)
        for vname, env in knobs.items():
            variants[(vname, R)] = su.with_env(env, lambda a=dgu, b=x, o=off, c=cnt, y=out:
                                              ops.grouped_wgrad(a, b, o, c, out=y))
        variants[("torch", R)] = lambda a=dgu, b=x, o=off: torch._grouped_mm(a.t(), b, offs=o[1:])
        tiles[R] = E * (2 * I // 128) * (H // 256)
        flops[R] = 4 * M * H * I
    ms = su.interleaved(variants, args.heat_s, args.rounds)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{args.shape} wgrad gate/up, {E} experts, out [{2 * I}, {H}] each; interleaved, sustained")
    names = list(knobs) + ["torch"]
    for R in row_list:
        line = "  ".join(f"{n} {ms[(n, R)]:.3f} ms ({flops[R] / ms[(n, R)] / 1e9:.0f} TF/s)" for n in names)
        print(f"  R = {R:5}: {line}")
    # Least squares of the time per tile wave (tiles / SMs tiles per CTA) against k-blocks
    print("  per CTA tile: fixed µs + µs per k-block (fit over R)")
    for n in names:
        xs = [R / 64 for R in row_list]
        ys = [ms[(n, R)] * 1e3 / (tiles[R] / sms) for R in row_list]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x_ - mx) * (y_ - my) for x_, y_ in zip(xs, ys)) / sum((x_ - mx) ** 2 for x_ in xs)
        a = my - b * mx
        print(f"    {n:8} fixed {a:6.2f} µs   per k-block {b:.3f} µs   "
              + "  ".join(f"R={R}: {y:.2f}" for R, y in zip(row_list, ys)))


if __name__ == "__main__":
    main()
