"""Standalone grouped-GEMM benchmark: mok's engine vs torch._grouped_mm on the expert shapes
of docs/benchmarks.md (gate/up: K=H, N=2I with the SwiGLU fused; down: K=I, N=H), same run,
same inputs, CUDA events, median of repeated runs, outputs checked against torch.

    python3 bench/bench_gemm.py [--shapes dsv3,qwen3|all] [--reps 20] [--out DIR]
"""
import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "python")]
from bench.harness import median_ms  # noqa: E402
from mok import ops  # noqa: E402

# name: (H, I, E_l, rows per expert = T*k/E_l with uniform routing)
SHAPES = {
    "dsv3": (7168, 2048, 16, 2048),
    "dsv3-t2k": (7168, 2048, 16, 1024),
    "qwen3": (4096, 1536, 32, 1024),
    "qwen35": (4096, 1024, 16, 2560),
    "glm5": (6144, 2048, 16, 2048),
    "dsv4pro": (7168, 3072, 12, 2048),
}


def mok_grouped_gemm(a, b0, b1, block_expert, out, swiglu):
    ops.grouped_mm(a, b0, block_expert, b1 if swiglu else None, out=out)


def rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def bench_shape(name, reps):
    H, I, E, rows = SHAPES[name]
    M = E * rows
    dev = "cuda"
    x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
    w_gate = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16) / H**0.5
    w_up = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16) / H**0.5
    w_down = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) / I**0.5
    block_expert = torch.arange(E, device=dev, dtype=torch.int32).repeat_interleave(rows // 128)
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * rows
    w_gu = torch.cat([w_gate, w_up], dim=1)  # [E, 2I, H]
    act = torch.empty(M, I, device=dev, dtype=torch.bfloat16)
    out = torch.empty(M, H, device=dev, dtype=torch.bfloat16)

    # Correctness on these inputs
    mok_grouped_gemm(x, w_gate, w_up, block_expert, act, True)
    gu = torch._grouped_mm(x, w_gu.transpose(1, 2), offs=offs)
    ref_act = torch.nn.functional.silu(gu[:, :I].float()) * gu[:, I:].float()
    err_gu = rel_err(act, ref_act)
    mok_grouped_gemm(act, w_down, None, block_expert, out, False)
    ref_out = torch._grouped_mm(act, w_down.transpose(1, 2), offs=offs)
    err_dn = rel_err(out, ref_out)

    # Timing, same run
    t_mok_gu = median_ms(lambda: mok_grouped_gemm(x, w_gate, w_up, block_expert, act, True), reps)
    t_torch_gu = median_ms(lambda: torch._grouped_mm(x, w_gu.transpose(1, 2), offs=offs), reps)
    t_mok_dn = median_ms(lambda: mok_grouped_gemm(act, w_down, None, block_expert, out, False), reps)
    t_torch_dn = median_ms(lambda: torch._grouped_mm(act, w_down.transpose(1, 2), offs=offs), reps)
    f_gu, f_dn = 2 * M * H * 2 * I, 2 * M * I * H
    r = {
        "shape": name, "M": M, "H": H, "I": I, "E": E,
        "gate_up": {"mok_ms": t_mok_gu, "torch_ms": t_torch_gu, "mok_tflops": f_gu / t_mok_gu / 1e9,
                    "torch_tflops": f_gu / t_torch_gu / 1e9, "rel_err": err_gu},
        "down": {"mok_ms": t_mok_dn, "torch_ms": t_torch_dn, "mok_tflops": f_dn / t_mok_dn / 1e9,
                 "torch_tflops": f_dn / t_torch_dn / 1e9, "rel_err": err_dn},
    }
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gemm: no CUDA device; nothing to measure")
        return
    names = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    results = []
    for n in names:
        results.append(bench_shape(n, args.reps))
        torch.cuda.empty_cache()
    print(f"{'shape':10} {'GEMM':8} {'mok ms':>8} {'torch ms':>9} {'mok TF/s':>9} {'torch TF/s':>10} {'ratio':>6} {'rel err':>9}")
    for r in results:
        for g in ("gate_up", "down"):
            d = r[g]
            print(f"{r['shape']:10} {g:8} {d['mok_ms']:8.3f} {d['torch_ms']:9.3f} {d['mok_tflops']:9.1f} "
                  f"{d['torch_tflops']:10.1f} {d['torch_ms'] / d['mok_ms']:6.2f} {d['rel_err']:9.2e}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_gemm.json"), "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
