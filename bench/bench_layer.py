#!/usr/bin/env python3
"""MoE layer benchmark (docs/benchmarks.md): per shape and routing, the torch EP=1 pipeline
(forward in each gate/up × combine variant, and forward+backward of the fastest), the experts-only grouped
GEMMs, the dense-rate floor, and mok where it is built. Prints a table, writes
DIR/bench_layer.json (every figure) and DIR/bench_layer.png (mok against the best torch baseline of
each shape, forward and forward+backward: bench/plot.py).

  python3 bench/bench_layer.py --shapes all --routing uniform,zipf --out out/bench
  python3 bench/bench_layer.py --device cpu --tiny      # CPU smoke test of every code path
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import baselines as bl  # noqa: E402
from bench import harness as hz  # noqa: E402
from bench import plot as lp  # noqa: E402
from bench import shapes as sh  # noqa: E402

VARIANTS = ("fused/gather", "split/gather", "fused/index_add", "split/index_add")
RTOL = 1e-2  # relative Frobenius error allowed against float64 (docs/contracts.md §9)
# fp8 rows (--fp8): the recipe's own e4m3 rounding (docs/precision.md: about 6e-2 on dsv3's
# output against bf16, about 0.12 on the router gradient of a small layer), checked against
# float64 with this much room: a broken kernel lands near 1
RTOL_FP8 = 0.2


# ---------------------------------------------------------------------------------------
# One shape × routing: weights and rotating input sets


class LayerCase:
    """Weights of one shape on the device and its input sets (made on demand, cached)."""

    def __init__(self, shape: sh.Shape, routing: str, device: torch.device, seed: int, drop: float) -> None:
        self.shape, self.routing, self.device, self.seed, self.drop = shape, routing, device, seed, drop
        s = shape
        gen = torch.Generator(device).manual_seed(seed)

        def randn(*size, scale):
            w = torch.randn(*size, device=device, dtype=torch.bfloat16, generator=gen)
            return w.mul_(scale).requires_grad_()

        # Routed weights (mok layout), scaled so activations stay O(1); fused gate/up copy
        self.w_gate = randn(s.E_l, s.I, s.H, scale=s.H ** -0.5)
        self.w_up = randn(s.E_l, s.I, s.H, scale=s.H ** -0.5)
        self.w_down = randn(s.E_l, s.H, s.I, scale=s.I ** -0.5)
        self.w_gateup = torch.cat([self.w_gate, self.w_up], dim=1).detach().requires_grad_()
        # Shared expert (I_s = I when on)
        self.shared = self.shared_fused = None
        if s.I_s:
            ws_gate = randn(s.I_s, s.H, scale=s.H ** -0.5)
            ws_up = randn(s.I_s, s.H, scale=s.H ** -0.5)
            ws_down = randn(s.H, s.I_s, scale=s.I_s ** -0.5)
            self.shared = (ws_gate, ws_up, ws_down)
            self.shared_fused = (torch.cat([ws_gate, ws_up], dim=0).detach().requires_grad_(), ws_down)
        self._sets: Dict[int, Dict[str, torch.Tensor]] = {}
        self._refs: Dict[tuple, Dict[str, torch.Tensor]] = {}

    def inputs(self, i: int, *, with_dy: bool = False) -> Dict[str, torch.Tensor]:
        """Input set i: x, topk_ids, topk_weights (and dy): leaves that require grad."""
        if i not in self._sets:
            s, set_seed = self.shape, self.seed * 1000 + i + 1
            ids, weights = sh.make_routing(self.routing, s.T, s.E_l, s.k, seed=set_seed, device=self.device,
                                           drop=self.drop)
            gen = torch.Generator(self.device).manual_seed(set_seed)
            x = torch.randn(s.T, s.H, device=self.device, dtype=torch.bfloat16, generator=gen)
            dy = torch.randn(s.T, s.H, device=self.device, dtype=torch.bfloat16, generator=gen)
            self._sets[i] = dict(x=x.requires_grad_(), topk_ids=ids, topk_weights=weights.requires_grad_(), dy=dy)
        full = self._sets[i]
        return full if with_dy else {k: v for k, v in full.items() if k != "dy"}

    def check_tokens(self, count: int) -> torch.Tensor:
        """Tokens checked against float64: first, last and random ones (fixed by the seed)."""
        T = self.shape.T
        gen = torch.Generator().manual_seed(self.seed + 7)
        picks = torch.randint(0, T, (max(0, count - 2),), generator=gen).tolist()
        return torch.tensor(sorted({0, T - 1, *picks}), device=self.device)

    def reference(self, inputs: Dict[str, torch.Tensor], tokens: torch.Tensor, grads: bool):
        """float64 outputs on the token slice (cached per input set)."""
        key = (inputs["x"].data_ptr(), grads)
        if key not in self._refs:
            self._refs[key] = bl.reference_tokens(
                inputs["x"], inputs["topk_ids"], inputs["topk_weights"], self.w_gate, self.w_up, self.w_down,
                self.shared, tokens=tokens, dy=inputs["dy"] if grads else None)
        return self._refs[key]

    def valid_routes(self) -> int:
        """Selected routes (id ≠ -1) of input set 0."""
        return int((self.inputs(0)["topk_ids"] >= 0).sum().item())


def make_check(case: LayerCase, tokens: torch.Tensor, *, grads: bool, rtol: float = RTOL):
    """Correctness callback: y (and dx, d topk_weights) of the token slice against float64."""

    def check(inputs, out):
        y, g = (out[0], out[1]) if grads else (out, None)
        ref = case.reference(inputs, tokens, grads)
        parts = {"y": bl.compare(y.index_select(0, tokens), ref["y"])}
        if grads:
            parts["dx"] = bl.compare(g[0].index_select(0, tokens), ref["dx"])
            parts["d_topk_weights"] = bl.compare(g[1].index_select(0, tokens), ref["d_topk_weights"])
        worst = max(p["rel_fro"] for p in parts.values())
        return {"ok": worst < rtol, "rel_fro": worst, "tokens": tokens.numel(), "rtol": rtol, **parts}

    return check


# ---------------------------------------------------------------------------------------
# Benchmarks of one case


def torch_call(case: LayerCase, variant: str):
    """(forward function of one input set, its differentiable leaves) for a torch variant."""
    gateup, combine = variant.split("/")
    fused = gateup == "fused"
    shared = case.shared_fused if fused else case.shared
    weights = [case.w_gateup, case.w_down] if fused else [case.w_gate, case.w_up, case.w_down]
    weights += list(shared or ())

    def forward(inp):
        return bl.torch_ep1_forward(inp["x"], inp["topk_ids"], inp["topk_weights"], case.w_gate, case.w_up,
                                    case.w_down, shared, w_gateup=case.w_gateup if fused else None,
                                    combine=combine)

    return forward, weights


def sync_free(fn, inputs) -> str:
    """'none' when fn(inputs) runs without a host synchronisation, else the first one."""
    if not torch.cuda.is_available() or not inputs["x"].is_cuda:
        return "n/a (cpu)"
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode")
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn(inputs)
            verdict = "none"
        except RuntimeError as exc:
            verdict = str(exc).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return verdict


def bench_case(h: hz.Harness, case: LayerCase, args, mok_state: Dict[str, str]) -> Dict[str, Any]:
    """Run every benchmark of one shape × routing; returns its ratios and notes."""
    s = case.shape
    group = f"{s.name}/{case.routing}" + ("+shared" if s.I_s else "")
    rows = case.valid_routes()
    fwd_flops = hz.moe_flops(s.T, s.k, s.H, s.I, s.I_s, routed_rows=rows)
    fb_flops = hz.moe_flops(s.T, s.k, s.H, s.I, s.I_s, direction="fwdbwd", routed_rows=rows)
    fwd_bytes = hz.moe_bytes(s.T, s.k, s.H, s.I, s.E_l, s.I_s)
    fb_bytes = hz.moe_bytes(s.T, s.k, s.H, s.I, s.E_l, s.I_s, direction="fwdbwd")
    tokens = case.check_tokens(args.check_tokens)
    notes: Dict[str, Any] = {"load": sh.expert_load(case.inputs(0)["topk_ids"], s.E_l)}

    def setup_fwd(i):
        return case.inputs(i)

    def setup_fb(i):
        return case.inputs(i, with_dy=True)

    # Torch EP=1 forward, every gate/up × combine variant
    for variant in args.variants:
        forward, _ = torch_call(case, variant)

        def run_fwd(inp, forward=forward):
            with torch.no_grad():
                return forward(inp)

        h.run(hz.Benchmark(f"torch ep1 fwd {variant}", setup_fwd, run_fwd, flops=fwd_flops, bytes=fwd_bytes,
                           check=make_check(case, tokens, grads=False), group=group, panel="fwd",
                           meta={"variant": variant, "deterministic": variant.endswith("gather")}))

    # Torch EP=1 forward+backward (autograd), every variant
    if not args.fwd_only:
        for variant in args.variants:
            forward, weights = torch_call(case, variant)

            def run_fb(inp, forward=forward, weights=weights):
                y = forward(inp)
                return y, torch.autograd.grad(y, [inp["x"], inp["topk_weights"]] + weights, inp["dy"])

            h.run(hz.Benchmark(f"torch ep1 fwd+bwd {variant}", setup_fb, run_fb, flops=fb_flops,
                               bytes=fb_bytes, check=make_check(case, tokens, grads=True), group=group,
                               panel="fwd+bwd", meta={"variant": variant}))

    # Fastest correct variants; no host sync inside them
    best = {d: best_variant(h, group, f"torch ep1 {d} ", args.variants) for d in ("fwd", "fwd+bwd")}
    bwd_flops = fb_flops - fwd_flops
    if not args.fwd_only and best["fwd+bwd"] is not None:
        # Torch's backward alone: autograd on the fastest variant's kept graph
        forward, weights = torch_call(case, best["fwd+bwd"])

        def setup_bwd(i, forward=forward):
            inp = dict(case.inputs(i, with_dy=True))
            with torch.enable_grad():
                inp["y"] = forward(inp)
            return inp

        def run_bwd(inp, weights=weights):
            return inp["y"], torch.autograd.grad(inp["y"], [inp["x"], inp["topk_weights"]] + weights, inp["dy"],
                                                 retain_graph=True)

        h.run(hz.Benchmark(f"torch ep1 bwd {best['fwd+bwd']}", setup_bwd, run_bwd, flops=bwd_flops,
                           bytes=fb_bytes - fwd_bytes, check=make_check(case, tokens, grads=True), group=group,
                           panel="bwd", meta={"variant": best["fwd+bwd"]}))
    notes["torch_best_variant"] = best
    if case.device.type == "cuda":
        for d, variant in best.items():
            if variant is not None and (d == "fwd" or not args.fwd_only):
                forward, weights = torch_call(case, variant)
                if d == "fwd":
                    notes["torch_fwd_host_sync"] = sync_free(forward, case.inputs(0))
                else:
                    notes["torch_fwdbwd_host_sync"] = sync_free(
                        lambda inp: torch.autograd.grad(forward(inp), [inp["x"], inp["topk_weights"]] + weights,
                                                        inp["dy"]), case.inputs(0, with_dy=True))

    # Experts only: the two grouped GEMMs on pre-gathered rows (alone, then with SwiGLU)
    def setup_experts(i):
        inp = case.inputs(i)
        _, token, offs, _ = bl.route_plan(inp["topk_ids"], s.E_l)
        a = inp["x"].detach().index_select(0, token)
        gen = torch.Generator(case.device).manual_seed(case.seed * 1000 + i + 500)
        h_rows = torch.randn(a.shape[0], s.I, device=case.device, dtype=a.dtype, generator=gen)
        return dict(a=a, offs=offs, h=h_rows)

    ex_flops = hz.moe_flops(s.T, s.k, s.H, s.I, routed_rows=rows)
    n_rows = s.T * s.k
    ex_bytes = 3.0 * s.E_l * s.I * s.H * 2 + n_rows * (2 * s.H + 3 * s.I) * 2
    with torch.no_grad():
        h.run(hz.Benchmark("experts only (grouped GEMMs)", setup_experts,
                           lambda d: bl.experts_only(d["a"], d["offs"], case.w_gateup, case.w_down, d["h"]),
                           flops=ex_flops, bytes=ex_bytes, group=group, panel="fwd"))
        h.run(hz.Benchmark("experts only + SwiGLU", setup_experts,
                           lambda d: bl.experts_only(d["a"], d["offs"], case.w_gateup, case.w_down),
                           flops=ex_flops, bytes=ex_bytes, group=group, panel="fwd"))

    # Experts only, backward: the four grouped GEMMs (dgrad and wgrad of both) on pre-gathered rows
    if not args.fwd_only:
        def setup_experts_bwd(i):
            inp = case.inputs(i, with_dy=True)
            _, token, offs, _ = bl.route_plan(inp["topk_ids"], s.E_l)
            gen = torch.Generator(case.device).manual_seed(case.seed * 1000 + i + 700)
            x_rows = inp["x"].detach().index_select(0, token)
            dy_rows = inp["dy"].index_select(0, token)
            dgu = torch.randn(x_rows.shape[0], 2 * s.I, device=case.device, dtype=x_rows.dtype, generator=gen)
            act = torch.randn(x_rows.shape[0], s.I, device=case.device, dtype=x_rows.dtype, generator=gen)
            return dict(x_rows=x_rows, dy_rows=dy_rows, dgu=dgu, act=act, offs=offs)

        with torch.no_grad():
            h.run(hz.Benchmark("experts only bwd (grouped GEMMs)", setup_experts_bwd,
                               lambda d: bl.experts_only_backward(d["dy_rows"], d["dgu"], d["x_rows"], d["act"],
                                                                  d["offs"], case.w_gateup, case.w_down),
                               flops=2 * ex_flops, bytes=2 * ex_bytes, group=group, panel="bwd"))

    # Dense-rate floors
    if h.ceiling_tflops:
        h.model("dense-rate floor fwd", bl.dense_floor_ms(fwd_flops, h.ceiling_tflops), group=group, panel="fwd",
                flops=fwd_flops, note=f"at {h.ceiling_tflops:.4g} TFLOP/s")
        if not args.fwd_only:
            h.model("dense-rate floor fwd+bwd", bl.dense_floor_ms(fb_flops, h.ceiling_tflops), group=group,
                    panel="fwd+bwd", flops=fb_flops, note=f"at {h.ceiling_tflops:.4g} TFLOP/s")
            # Twice the forward's FLOPs (the replay of h not counted: the training forward saves it)
            h.model("dense-rate floor bwd", bl.dense_floor_ms(bwd_flops, h.ceiling_tflops), group=group,
                    panel="bwd", flops=bwd_flops, note=f"at {h.ceiling_tflops:.4g} TFLOP/s, h saved")

    # mok, where it is built
    bench_mok(h, case, args, mok_state, group, tokens, setup_fwd, setup_fb,
              (fwd_flops, fwd_bytes, fb_flops, fb_bytes))
    return {"group": group, **notes, "ratios": ratios(h, group, best),
            "best_baseline": lp.best_baselines(h.results, group)}


def best_variant(h: hz.Harness, group: str, prefix: str, variants: List[str]) -> Optional[str]:
    """The variant with the lowest median among the timed ones whose check passed."""
    timed = {}
    for v in variants:
        r = h.find(prefix + v, group)
        if r is not None and r.get("check", {}).get("ok", True):
            timed[v] = r["ms"]
    return min(timed, key=timed.get) if timed else None


def bench_mok(h: hz.Harness, case: LayerCase, args, mok_state, group, tokens, setup_fwd, setup_fb, models):
    """mok forward (and forward+backward) through mok.functional; records why not otherwise."""
    fwd_flops, fwd_bytes, fb_flops, fb_bytes = models
    mok = mok_state.get("module")
    if mok is None:
        h.skip("mok fwd", mok_state["status"], group=group, panel="fwd", status="not available")
        return
    # NOTES: a mok error may be a device timeout (config.timeout_s per call); after one, the
    # remaining cases skip mok so that one fault cannot eat the whole run
    if "failed_in" in mok_state:
        h.skip("mok fwd", f"skipped after an error in {mok_state['failed_in']}", group=group, panel="fwd")
        return
    weights = (case.w_gate, case.w_up, case.w_down)

    def run_fwd(inp):
        with torch.no_grad():
            return bl.mok_forward(mok, inp["x"].detach(), inp["topk_ids"], inp["topk_weights"].detach(),
                                  *(w.detach() for w in weights), _detach(case.shared))

    r = h.run(hz.Benchmark("mok fwd", setup_fwd, run_fwd, flops=fwd_flops, bytes=fwd_bytes,
                           check=make_check(case, tokens, grads=False), group=group, panel="fwd"))
    mok_state["fwd"] = _mok_status(r)
    if r["status"] == "error":
        mok_state["failed_in"] = group
    if r["status"] != "ok" or args.fwd_only:
        return

    def run_fb(inp):
        with torch.no_grad():
            y, g = bl.mok_forward_backward(mok, inp["x"].detach(), inp["topk_ids"], inp["topk_weights"].detach(),
                                           *(w.detach() for w in weights), inp["dy"], _detach(case.shared))
        return y, (g.dx, g.d_topk_weights)

    r = h.run(hz.Benchmark("mok fwd+bwd", setup_fb, run_fb, flops=fb_flops, bytes=fb_bytes,
                           check=make_check(case, tokens, grads=True), group=group, panel="fwd+bwd"))
    mok_state["fwd+bwd"] = _mok_status(r)
    if r["status"] == "error":
        mok_state["failed_in"] = group
        return

    # The backward alone, on the training forward's context (its saved h)
    def setup_bwd(i):
        inp = dict(setup_fb(i))
        with torch.no_grad():
            ws = tuple(_detach(case.shared)) if case.shared is not None else (None, None, None)
            inp["y"], inp["ctx"] = mok.functional.forward(inp["x"].detach(), inp["topk_ids"],
                                                          inp["topk_weights"].detach(),
                                                          *(w.detach() for w in weights), *ws)
        return inp

    def run_bwd(inp):
        with torch.no_grad():
            g = mok.functional.backward(inp["ctx"], inp["dy"])
        return inp["y"], (g.dx, g.d_topk_weights)

    r = h.run(hz.Benchmark("mok bwd", setup_bwd, run_bwd, flops=fb_flops - fwd_flops, bytes=fb_bytes - fwd_bytes,
                           check=make_check(case, tokens, grads=True), group=group, panel="bwd"))
    mok_state["bwd"] = _mok_status(r)
    if r["status"] == "error":
        mok_state["failed_in"] = group
    if args.fp8:
        bench_fp8(h, case, args, mok_state, group, tokens, setup_fwd, setup_fb, models)


def bench_fp8(h: hz.Harness, case: LayerCase, args, mok_state, group, tokens, setup_fwd, setup_fb, models):
    """--fp8: mok in precision fp8_block (forward, forward + backward; its weights quantised once
    and cached, as a training step between optimizer steps), and torch's fp8 forward pipeline
    (rowwise torch._scaled_grouped_mm, its weights quantised once too), beside the bf16 rows."""
    fwd_flops, fwd_bytes, fb_flops, fb_bytes = models
    mok = mok_state["module"]
    s = case.shape
    if s.H % 128 or s.I % 128 or s.I_s % 128:
        why = f"fp8_block's scale blocks need H, I and I_s multiples of 128 (H = {s.H}, I = {s.I}, I_s = {s.I_s})"
        for name in ("mok fp8_block fwd", "torch fp8 fwd (rowwise)"):
            h.skip(name, why, group=group, panel="fwd")
        return
    cfg = mok.functional.MoKConfig(precision="fp8_block")
    weights = tuple(w.detach() for w in (case.w_gate, case.w_up, case.w_down))

    def run_fwd(inp):
        with torch.no_grad():
            return bl.mok_forward(mok, inp["x"].detach(), inp["topk_ids"], inp["topk_weights"].detach(), *weights,
                                  _detach(case.shared), config=cfg)

    r = h.run(hz.Benchmark("mok fp8_block fwd", setup_fwd, run_fwd, flops=fwd_flops, bytes=fwd_bytes,
                           check=make_check(case, tokens, grads=False, rtol=RTOL_FP8), group=group, panel="fwd"))
    mok_state["fp8 fwd"] = _mok_status(r)
    if r["status"] == "ok" and not args.fwd_only:
        def run_fb(inp):
            with torch.no_grad():
                y, g = bl.mok_forward_backward(mok, inp["x"].detach(), inp["topk_ids"], inp["topk_weights"].detach(),
                                               *weights, inp["dy"], _detach(case.shared), config=cfg)
            return y, (g.dx, g.d_topk_weights)

        r = h.run(hz.Benchmark("mok fp8_block fwd+bwd", setup_fb, run_fb, flops=fb_flops, bytes=fb_bytes,
                               check=make_check(case, tokens, grads=True, rtol=RTOL_FP8), group=group,
                               panel="fwd+bwd"))
        mok_state["fp8 fwd+bwd"] = _mok_status(r)
    if not hasattr(torch, "_scaled_grouped_mm") or case.device.type != "cuda":
        h.skip("torch fp8 fwd (rowwise)", "torch._scaled_grouped_mm runs on CUDA only", group=group, panel="fwd")
        return
    fp8_weights = bl.torch_fp8_weights(*weights)

    def run_torch(inp):
        with torch.no_grad():
            return bl.torch_fp8_forward(inp["x"].detach(), inp["topk_ids"], inp["topk_weights"].detach(), fp8_weights,
                                        _detach(case.shared))

    h.run(hz.Benchmark("torch fp8 fwd (rowwise)", setup_fwd, run_torch, flops=fwd_flops, bytes=fwd_bytes,
                       check=make_check(case, tokens, grads=False, rtol=RTOL_FP8), group=group, panel="fwd"))


def _mok_status(record: Dict[str, Any]) -> str:
    status = record["status"]
    return f"error: {record.get('error', '')}" if status == "error" else status


def _detach(shared):
    return None if shared is None else tuple(t.detach() for t in shared)


def ratios(h: hz.Harness, group: str, best: Dict[str, Optional[str]]) -> Dict[str, Optional[float]]:
    """Ratios of figures of this run (None where a figure is missing)."""
    def ms(name):
        r = h.find(name, group)
        return None if r is None else r["ms"]

    def div(a, b):
        return a / b if a is not None and b else None

    fwd = ms(f"torch ep1 fwd {best['fwd']}")
    fb = ms(f"torch ep1 fwd+bwd {best['fwd+bwd']}")
    fwd_same = ms(f"torch ep1 fwd {best['fwd+bwd']}")
    experts, floor = ms("experts only (grouped GEMMs)"), ms("dense-rate floor fwd")
    mok_fwd, mok_fb = ms("mok fwd"), ms("mok fwd+bwd")
    bwd = ms(f"torch ep1 bwd {best['fwd+bwd']}")
    mok_bwd, experts_bwd, floor_bwd = ms("mok bwd"), ms("experts only bwd (grouped GEMMs)"), ms("dense-rate floor bwd")
    fp8_fwd, fp8_fb, torch_fp8 = ms("mok fp8_block fwd"), ms("mok fp8_block fwd+bwd"), ms("torch fp8 fwd (rowwise)")
    return {"torch_fwd_ms": fwd, "torch_fwdbwd_ms": fb,
            "torch_bwd_ms": None if fb is None or fwd_same is None else fb - fwd_same,
            "experts_only_ms": experts, "floor_fwd_ms": floor,
            "torch_fwd_over_experts": div(fwd, experts), "torch_fwd_over_floor": div(fwd, floor),
            "experts_over_floor": div(experts, floor),
            "mok_fwd_ms": mok_fwd, "speedup_mok_fwd_vs_torch": div(fwd, mok_fwd),
            "mok_fwd_over_floor": div(mok_fwd, floor), "mok_fwdbwd_ms": mok_fb,
            "speedup_mok_fwdbwd_vs_torch": div(fb, mok_fb),
            "torch_bwd_alone_ms": bwd, "experts_only_bwd_ms": experts_bwd, "floor_bwd_ms": floor_bwd,
            "mok_bwd_ms": mok_bwd, "speedup_mok_bwd_vs_torch": div(bwd, mok_bwd),
            "mok_bwd_over_experts": div(mok_bwd, experts_bwd), "mok_bwd_over_floor": div(mok_bwd, floor_bwd),
            # --fp8: mok's fp8_block against its bf16 and against torch's fp8 forward, this run
            "mok_fp8_fwd_ms": fp8_fwd, "mok_fp8_fwdbwd_ms": fp8_fb, "torch_fp8_fwd_ms": torch_fp8,
            "speedup_mok_fp8_fwd_vs_mok_bf16": div(mok_fwd, fp8_fwd),
            "speedup_mok_fp8_fwdbwd_vs_mok_bf16": div(mok_fb, fp8_fb),
            "speedup_mok_fp8_fwd_vs_torch_fp8": div(torch_fp8, fp8_fwd)}


def ratio_table(cases: List[Dict[str, Any]]) -> str:
    """The per-case summary: torch vs experts-only vs floor vs mok."""
    cols = [("torch_fwd_ms", "torch fwd"), ("torch_fwdbwd_ms", "fwd+bwd"), ("torch_bwd_ms", "bwd"),
            ("experts_only_ms", "experts"), ("floor_fwd_ms", "floor"), ("torch_fwd_over_experts", "t/exp"),
            ("torch_fwd_over_floor", "t/floor"), ("experts_over_floor", "exp/floor"), ("mok_fwd_ms", "mok fwd"),
            ("speedup_mok_fwd_vs_torch", "t/mok"), ("mok_fwdbwd_ms", "mok f+b"), ("speedup_mok_fwdbwd_vs_torch", "t/mok f+b"),
            ("mok_bwd_ms", "mok bwd"), ("speedup_mok_bwd_vs_torch", "t/mok bwd"), ("mok_bwd_over_experts", "mok/exp bwd")]
    lines = ["group".ljust(22) + "  ".join(c[1].rjust(9) for c in cols) + "  torch variant fwd, fwd+bwd"]
    for c in cases:
        r = c["ratios"]
        cells = ["-" if r.get(key) is None else f"{r[key]:.3f}" for key, _ in cols]
        lines.append(c["group"][:22].ljust(22) + "  ".join(x.rjust(9) for x in cells)
                     + "  " + ", ".join(v or "-" for v in c["torch_best_variant"].values()))
    # --fp8: mok's fp8_block against its bf16 and torch's fp8 forward (the same run)
    fp8 = [("mok_fp8_fwd_ms", "fp8 fwd"), ("speedup_mok_fp8_fwd_vs_mok_bf16", "bf16/fp8"),
           ("mok_fp8_fwdbwd_ms", "fp8 f+b"), ("speedup_mok_fp8_fwdbwd_vs_mok_bf16", "bf16/fp8 f+b"),
           ("torch_fp8_fwd_ms", "torch fp8"), ("speedup_mok_fp8_fwd_vs_torch_fp8", "tfp8/fp8")]
    if any(c["ratios"].get("mok_fp8_fwd_ms") is not None for c in cases):
        lines += ["", "group".ljust(22) + "  ".join(c[1].rjust(12) for c in fp8)]
        for c in cases:
            r = c["ratios"]
            cells = ["-" if r.get(key) is None else f"{r[key]:.3f}" for key, _ in fp8]
            lines.append(c["group"][:22].ljust(22) + "  ".join(x.rjust(12) for x in cells))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="all", help="comma-separated shape names (docs/benchmarks.md), or 'all'")
    p.add_argument("--routing", default="uniform,zipf", help="comma-separated: uniform, zipf")
    p.add_argument("--shared", type=int, choices=(0, 1), default=0, help="shared expert with I_s = I")
    p.add_argument("--reps", type=int, default=20, help="timed runs per figure (median)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs first")
    p.add_argument("--out", default="out/bench", help="directory for bench_layer.json and .png")
    p.add_argument("--fwd-only", action="store_true", help="skip forward+backward")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="torch forward variants, gate/up (fused|split) / combine (gather|index_add)")
    p.add_argument("--ceiling-tflops", type=float, help="dense bf16 rate (default: measured 8192^3 matmul)")
    p.add_argument("--ceiling-gbps", type=float, help="HBM copy rate (default: measured 1 GiB copy)")
    p.add_argument("--graphs", action="store_true", help="time CUDA-graph replays")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drop", type=float, default=0.0, help="fraction of routes set to -1")
    p.add_argument("--check-tokens", type=int, default=8, help="tokens checked against float64")
    p.add_argument("--no-mok", action="store_true", help="do not run mok")
    p.add_argument("--fp8", action="store_true",
                   help="also mok in precision fp8_block and torch's rowwise fp8 forward (ratios in the JSON)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny shape only (CPU smoke test)")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"variant {v!r}; expected some of {', '.join(VARIANTS)}")
    args.routings = [r.strip() for r in args.routing.split(",") if r.strip()]
    for r in args.routings:
        if r not in sh.ROUTINGS:
            p.error(f"routing {r!r}; expected some of {', '.join(sh.ROUTINGS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # No GPU: nothing to measure here (the CPU demo lives elsewhere)
    device, status = hz.bench_device("bench_layer", args.device, args.tiny, "--tiny",
                                     "the docs/benchmarks.md shapes are GPU-sized")
    if device is None:
        return status
    shape_list = [sh.TINY] if args.tiny else sh.parse_shapes(args.shapes)
    shape_list = [s.with_shared(bool(args.shared)) for s in shape_list]
    os.makedirs(args.out, exist_ok=True)
    h = hz.Harness(device, reps=args.reps, warmup=args.warmup, graphs=args.graphs,
                   ceiling_tflops=args.ceiling_tflops, ceiling_gbps=args.ceiling_gbps)
    print(f"bench_layer: {hz.device_name(device)}, torch {torch.__version__}, grouped GEMM: "
          f"{bl.grouped_mm_backend(device)}, reps {args.reps}, L2 {h.l2 >> 20} MiB, graphs {args.graphs}")

    # Ceilings: measured unless given
    ceilings: Dict[str, Any] = {}
    if args.ceiling_tflops is None:
        r = hz.matmul_ceiling(h, 256 if args.tiny else 8192)
        h.ceiling_tflops = r.get("tflops")
        ceilings["tflops_measured"] = r.get("tflops")
    if args.ceiling_gbps is None:
        r = hz.copy_ceiling(h, (64 << 20) if args.tiny else (1 << 30))
        h.ceiling_gbps = r.get("gbps")
        ceilings["gbps_measured"] = r.get("gbps")

    # mok: importable? (its CUDA kernels may not be built: recorded per call)
    mok_module, reason = (None, "disabled (--no-mok)") if args.no_mok else bl.import_mok()
    mok_state: Dict[str, Any] = {"module": mok_module, "status": reason or "importable"}
    if mok_module is None:
        mok_state.update({"fwd": reason, "fwd+bwd": reason})

    # Every shape × routing, freeing between them
    cases = []
    for shape in shape_list:
        for routing in args.routings:
            case = LayerCase(shape, routing, device, args.seed, args.drop)
            cases.append(bench_case(h, case, args, mok_state))
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()

    # Summary, JSON and chart
    print()
    print(ratio_table(cases))
    out_json = os.path.join(args.out, "bench_layer.json")
    h.write_json(out_json, {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"), "ceilings": ceilings, "deep_ep": bl.deep_ep_available(),
        "grouped_mm": bl.grouped_mm_backend(device), "shapes": [_shape_dict(s) for s in shape_list],
        "mok": mok_summary(mok_state), "cases": cases})
    png = os.path.join(args.out, "bench_layer.png")
    with open(out_json) as f:  # the picture is drawn from the JSON (python3 bench/plot.py JSON redraws it)
        why_not = lp.plot_layer(json.load(f), png)
    print(f"\nwrote {out_json}" + (f" and {png}" if why_not is None else f"; no chart: {why_not}"))
    failed = h.failed_checks()
    if failed:
        print("CORRECTNESS FAILED: " + ", ".join(f"{r['group']} {r['name']}" for r in failed))
        return 1
    return 0


def mok_summary(state: Dict[str, Any]) -> Dict[str, str]:
    """{"status": "ok" | "not built" | "not importable (...)" | "error: ...", "fwd": …, "fwd+bwd": …}
    (status: the forward's, the last case's where cases differ)."""
    fwd = state.get("fwd", "not run")
    return {"status": state["status"] if state["module"] is None else fwd, "fwd": fwd,
            "fwd+bwd": state.get("fwd+bwd", "not run")}


def _shape_dict(s: sh.Shape) -> Dict[str, Any]:
    return {"name": s.name, "H": s.H, "I": s.I, "k": s.k, "E_l": s.E_l, "T": s.T, "I_s": s.I_s}


if __name__ == "__main__":
    sys.exit(main())
