"""Standalone grouped-GEMM benchmark: mok's engine vs torch._grouped_mm on the expert shapes
of docs/benchmarks.md, same run, same inputs, CUDA events, median of repeated runs, outputs
checked against torch, and each rate as a fraction of the dense bf16 matmul rate measured in
the same run (8192^3 torch.mm).  Kinds:
  gate_up        x[M, H] · [W_gate; W_up][e]ᵀ with the SwiGLU fused   (torch: the same product, then SwiGLU not timed)
  down           a[M, I] · W_down[e]ᵀ
  dgrad_down     dy[M, H] · W_down[e]  (da; the weights as stored)    (torch: _grouped_mm on the untransposed view)
  dgrad_gate_up  [dg | du][M, 2I] · [W_gate; W_up][e]  (dx)
  wgrad_down     dy_rowsᵀ · a_rows per expert (K = its rows)   (torch: 2-D x 2-D _grouped_mm with offsets)
  wgrad_gate_up  [dg | du]_rowsᵀ · x_rows per expert

    python3 bench/bench_gemm.py [--shapes dsv3,qwen3|all] [--reps 20] [--out DIR]
"""
import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "python")]
from bench import shapes as sh  # noqa: E402
from bench.harness import median_ms  # noqa: E402
from mok import ops  # noqa: E402

# name: (H, I, E_l, rows per expert = T*k/E_l with uniform routing), from the shapes table
# (bench/shapes.py); the 32k-token fine-grained shapes are the layer benchmarks' only
SHAPES = {n: (s.H, s.I, s.E_l, s.rows_per_expert) for n, s in sh.SHAPES.items() if not n.startswith("fg")}


def mok_grouped_gemm(a, b0, b1, block_expert, out, swiglu):
    ops.grouped_mm(a, b0, block_expert, b1 if swiglu else None, out=out)


def dense_tflops(reps):
    """bf16 torch.mm 8192^3 in this run: the ceiling the fractions refer to."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = median_ms(lambda: torch.mm(a, b), reps)
    return 2 * 8192**3 / t / 1e9


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

    # dgrad: the weights as stored (no transposed copy on either side)
    dy = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
    dgu = torch.randn(M, 2 * I, device=dev, dtype=torch.bfloat16) / (2 * I) ** 0.5
    da = torch.empty(M, I, device=dev, dtype=torch.bfloat16)
    dx = torch.empty(M, H, device=dev, dtype=torch.bfloat16)
    run_dd = lambda: ops.grouped_mm(dy, w_down, block_expert, out=da, kind="dgrad_down")  # noqa: E731
    run_dgu = lambda: ops.grouped_mm(dgu, w_gate, block_expert, w_up, out=dx, kind="dgrad_gate_up")  # noqa: E731
    run_dd()
    err_dd = rel_err(da, torch._grouped_mm(dy, w_down, offs=offs))
    run_dgu()
    err_dgu = rel_err(dx, torch._grouped_mm(dgu, w_gu, offs=offs))
    t_mok_dd = median_ms(run_dd, reps)
    t_torch_dd = median_ms(lambda: torch._grouped_mm(dy, w_down, offs=offs), reps)
    t_mok_dgu = median_ms(run_dgu, reps)
    t_torch_dgu = median_ms(lambda: torch._grouped_mm(dgu, w_gu, offs=offs), reps)

    # wgrad (K-grouped, K = each expert's rows): dW_down[e] = dy_rowsᵀ · a_rows [H, I],
    # [dW_gate; dW_up][e] = [dg|du]_rowsᵀ · x_rows [2I, H]; torch: 2-D x 2-D _grouped_mm with offsets
    ex_off = torch.arange(E + 1, device=dev, dtype=torch.int32) * rows
    ex_cnt = torch.full((E,), rows, device=dev, dtype=torch.int32)
    wd = torch.empty(E, H, I, device=dev, dtype=torch.bfloat16)
    wgu = torch.empty(E, 2 * I, H, device=dev, dtype=torch.bfloat16)
    run_wd = lambda: ops.grouped_wgrad(dy, act, ex_off, ex_cnt, out=wd)  # noqa: E731
    run_wgu = lambda: ops.grouped_wgrad(dgu, x, ex_off, ex_cnt, out=wgu)  # noqa: E731
    torch_wd = lambda: torch._grouped_mm(dy.t(), act, offs=offs)  # noqa: E731
    torch_wgu = lambda: torch._grouped_mm(dgu.t(), x, offs=offs)  # noqa: E731
    run_wd()
    err_wd = rel_err(wd, torch_wd())
    run_wgu()
    err_wgu = rel_err(wgu, torch_wgu())
    t_mok_wd, t_torch_wd = median_ms(run_wd, reps), median_ms(torch_wd, reps)
    t_mok_wgu, t_torch_wgu = median_ms(run_wgu, reps), median_ms(torch_wgu, reps)

    f_gu, f_dn = 2 * M * H * 2 * I, 2 * M * I * H

    def rec(flops, t_mok, t_torch, err):
        return {"mok_ms": t_mok, "torch_ms": t_torch, "mok_tflops": flops / t_mok / 1e9,
                "torch_tflops": flops / t_torch / 1e9, "rel_err": err}

    return {
        "shape": name, "M": M, "H": H, "I": I, "E": E,
        "gate_up": rec(f_gu, t_mok_gu, t_torch_gu, err_gu),
        "down": rec(f_dn, t_mok_dn, t_torch_dn, err_dn),
        "dgrad_down": rec(f_dn, t_mok_dd, t_torch_dd, err_dd),
        "dgrad_gate_up": rec(f_gu, t_mok_dgu, t_torch_dgu, err_dgu),
        "wgrad_down": rec(f_dn, t_mok_wd, t_torch_wd, err_wd),
        "wgrad_gate_up": rec(f_gu, t_mok_wgu, t_torch_wgu, err_wgu),
    }


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
    dense = dense_tflops(args.reps)
    print(f"dense bf16 mm 8192^3 in this run: {dense:.0f} TFLOP/s")
    results = []
    for n in names:
        results.append(bench_shape(n, args.reps))
        torch.cuda.empty_cache()
    print(f"{'shape':10} {'GEMM':14} {'mok ms':>8} {'torch ms':>9} {'mok TF/s':>9} {'torch TF/s':>10} "
          f"{'mok/dense':>9} {'torch/mok':>9} {'rel err':>9}")
    for r in results:
        r["dense_tflops"] = dense
        for g in ("gate_up", "down", "dgrad_down", "dgrad_gate_up", "wgrad_down", "wgrad_gate_up"):
            d = r[g]
            print(f"{r['shape']:10} {g:14} {d['mok_ms']:8.3f} {d['torch_ms']:9.3f} {d['mok_tflops']:9.1f} "
                  f"{d['torch_tflops']:10.1f} {d['mok_tflops'] / dense:9.2f} {d['torch_ms'] / d['mok_ms']:9.2f} "
                  f"{d['rel_err']:9.2e}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_gemm.json"), "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
