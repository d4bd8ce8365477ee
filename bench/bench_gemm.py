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

    python3 bench/bench_gemm.py [--shapes dsv3,qwen3|all] [--reps 20] [--out DIR] [--fp8]

--fp8: the same kinds in fp8_block (DeepSeek-V3's block-scaled recipe, docs/precision.md), each
rate as a fraction of the dense fp8 matmul rate of the same run (torch._scaled_mm 8192^3), and
against torch._scaled_grouped_mm with rowwise scales for the forward kinds where this torch has
it.  Operands quantised by mok's quantisers before timing (the layer quantises inside its
kernels): x, a, dy, dh per row; the weights per 128 x 128 block (their transposed copies for
dgrad); the wgrad operands per channel and 128 rows, transposed.
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


def dense_fp8_tflops(reps):
    """e4m3 torch._scaled_mm 8192^3 in this run (per-tensor scales): the fp8 ceiling."""
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    t = median_ms(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16), reps)
    return 2 * 8192**3 / t / 1e9


def bench_shape_fp8(name, reps):
    """The fp8 kinds on one shape: {kind: {mok_ms, mok_tflops, torch_ms (rowwise, forward kinds)}}."""
    import mok
    from mok import fp8
    H, I, E, rows = SHAPES[name]
    M = E * rows
    dev = "cuda"
    bf = dict(device=dev, dtype=torch.bfloat16)
    x, act = torch.randn(M, H, **bf), torch.randn(M, I, **bf)
    dy, dgu = torch.randn(M, H, **bf), torch.randn(M, 2 * I, **bf) / (2 * I) ** 0.5
    w_gate, w_up = [torch.randn(E, I, H, **bf) / H**0.5 for _ in range(2)]
    w_down = torch.randn(E, H, I, **bf) / I**0.5
    be = torch.arange(E, device=dev, dtype=torch.int32).repeat_interleave(rows // 128)
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * rows
    ex_off = torch.arange(E + 1, device=dev, dtype=torch.int32) * rows
    ex_cnt = torch.full((E,), rows, device=dev, dtype=torch.int32)
    fw = mok.quantize_weights(w_gate, w_up, w_down)
    (qx, sx), (qa, sa) = ops.quantize_rows_fp8(x), ops.quantize_rows_fp8(act)
    (qdy, sdy), (qdh, sdh) = ops.quantize_rows_fp8(dy), ops.quantize_rows_fp8(dgu)
    (qxt, sxt), (qat, sat) = ops.quantize_cols_fp8(x), ops.quantize_cols_fp8(act)
    (qdyt, sdyt), (qdht, sdht) = ops.quantize_cols_fp8(dy), ops.quantize_cols_fp8(dgu)
    g, u, d = fw["w_gate"], fw["w_up"], fw["w_down"]
    y_gu, y_dn = torch.empty(M, I, **bf), torch.empty(M, H, **bf)
    y_da, y_dx = torch.empty(M, I, **bf), torch.empty(M, H, **bf)
    dwd, dwgu = torch.empty(E, H, I, **bf), torch.empty(E, 2 * I, H, **bf)
    kinds = {
        "gate_up": (lambda: ops.grouped_mm_fp8(qx, sx, g.q, g.scales, be, u.q, u.scales, out=y_gu), 4 * M * H * I),
        "down": (lambda: ops.grouped_mm_fp8(qa, sa, d.q, d.scales, be, out=y_dn), 2 * M * H * I),
        "dgrad_down": (lambda: ops.grouped_mm_fp8(qdy, sdy, d.qt, d.scales, be, out=y_da, b_transposed=True),
                       2 * M * H * I),
        "dgrad_gate_up": (lambda: ops.dgrad_gate_up_fp8(qdh, sdh, g.qt, g.scales, u.qt, u.scales, be, out=y_dx),
                          4 * M * H * I),
        "wgrad_down": (lambda: ops.grouped_wgrad_fp8(qdyt, sdyt, qat, sat, ex_off, ex_cnt, out=dwd), 2 * M * H * I),
        "wgrad_gate_up": (lambda: ops.grouped_wgrad_fp8(qdht, sdht, qxt, sxt, ex_off, ex_cnt, out=dwgu),
                          4 * M * H * I),
    }
    # Against bf16 on the same inputs: the recipe's error (reported)
    errs = {}
    kinds["gate_up"][0]()
    gu16 = torch.empty(M, I, **bf)
    ops.grouped_mm(x, w_gate, be, w_up, out=gu16)
    errs["gate_up"] = rel_err(y_gu, gu16)
    kinds["wgrad_down"][0]()
    errs["wgrad_down"] = rel_err(dwd, torch._grouped_mm(dy.t(), act, offs=offs))
    torch_rowwise = {}
    if hasattr(torch, "_scaled_grouped_mm"):
        def rowwise(t):
            s = t.float().abs().amax(-1).clamp(min=1e-12) / fp8.E4M3_MAX
            return (t.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn), s
        (rx, rsx), (ra, rsa) = rowwise(x), rowwise(act)
        (rgu, rsgu), (rd, rsd) = rowwise(torch.cat([w_gate, w_up], 1)), rowwise(w_down)
        torch_rowwise = {
            "gate_up": lambda: torch._scaled_grouped_mm(rx, rgu.transpose(-2, -1), rsx, rsgu, offs=offs,
                                                        out_dtype=torch.bfloat16),
            "down": lambda: torch._scaled_grouped_mm(ra, rd.transpose(-2, -1), rsa, rsd, offs=offs,
                                                     out_dtype=torch.bfloat16)}
    out = {"shape": name, "M": M, "H": H, "I": I, "E": E}
    for kind, (fn, flops) in kinds.items():
        t = median_ms(fn, reps)
        rec = {"mok_ms": t, "mok_tflops": flops / t / 1e9, "rel_err_vs_bf16": errs.get(kind)}
        if kind in torch_rowwise:
            try:
                tt = median_ms(torch_rowwise[kind], reps)
                rec.update(torch_ms=tt, torch_tflops=flops / tt / 1e9)
            except RuntimeError as e:  # a torch without that fp8 path on this card: reported
                rec["torch_error"] = str(e)[:200]
        out[kind] = rec
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--fp8", action="store_true", help="the fp8_block kinds too, against the dense fp8 rate")
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
    fp8_results = []
    if args.fp8:
        dense8 = dense_fp8_tflops(args.reps)
        print(f"\ndense fp8 (e4m3) mm 8192^3 in this run: {dense8:.0f} TFLOP/s")
        print(f"{'shape':10} {'fp8 GEMM':14} {'mok ms':>8} {'mok TF/s':>9} {'mok/dense8':>10} {'torch rowwise ms':>16} "
              f"{'torch/mok':>9}")
        for n in names:
            r = bench_shape_fp8(n, args.reps)
            r["dense_fp8_tflops"] = dense8
            fp8_results.append(r)
            torch.cuda.empty_cache()
            for g in ("gate_up", "down", "dgrad_down", "dgrad_gate_up", "wgrad_down", "wgrad_gate_up"):
                d = r[g]
                tt, tm = d.get("torch_ms"), d["mok_ms"]
                t_col = f"{tt:.3f}" if tt else "-"
                ratio = f"{tt / tm:.2f}" if tt else "-"
                print(f"{n:10} {g:14} {tm:8.3f} {d['mok_tflops']:9.1f} {d['mok_tflops'] / dense8:10.2f} "
                      f"{t_col:>16} {ratio:>9}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_gemm.json"), "w") as f:
            json.dump({"bf16": results, "fp8": fp8_results} if args.fp8 else results, f, indent=2)


if __name__ == "__main__":
    main()
