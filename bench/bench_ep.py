#!/usr/bin/env python3
"""EP ≥ 2 MoE layer benchmark (docs/benchmarks.md): one process per GPU, P = number of GPUs.
Per shape and routing, in the same run: NCCL+PyTorch (forward, and forward+backward through autograd),
DeepEP+PyTorch (where `deep_ep` imports), the
experts-only grouped GEMMs on the rows each rank receives, the dense-rate floor, and mok (forward, and
forward+backward) over
PyTorch symmetric memory (mok.functional.get_workspace(group=...)); with --sweep, mok over
fwd_num_comm_sms × minibatch_size. Every figure is the slowest rank's median. Prints a table,
writes DIR/bench_ep.json and DIR/bench_ep.png.

  python3 bench/bench_ep.py --shapes dsv3,dsv3-t2k,qwen3 --routing uniform,zipf --out out/bench
  python3 bench/bench_ep.py --shapes dsv3 --routing uniform --sweep
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import baselines as bl  # noqa: E402
from bench import harness as hz  # noqa: E402
from bench import shapes as sh  # noqa: E402

RTOL = 1e-2  # relative Frobenius error allowed against float64 (docs/contracts.md §9)
SWEEP_COMM_SMS = (4, 8, 16)
SWEEP_MINIBATCH = (1024, 2048, 4096)  # 512 makes more than 127 minibatches at T_max = 4096, P = 2
# NVLink multicast stays off (docs/contracts.md §3); the same defaults as
# mok.functional.MULTICAST_OFF_ENV, set before NCCL creates a communicator and before any
# symmetric memory exists
ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
NVLINK_NOTE = ("NVLink GB/s of mok are averages over the whole call: bytes of the rows a rank pulls from "
               "other ranks (its experts' remote routes x H x 2 B) / that rank's median call time; the push "
               "moves the same bytes back. Not link-busy rates.")


# ---------------------------------------------------------------------------------------
# Collectives of the benchmark (every rank calls them in the same order)


def _dist():
    import torch.distributed as dist

    return dist


def gather_objects(obj: Any, group) -> List[Any]:
    """obj of every rank, in rank order."""
    dist = _dist()
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def agree(ok: bool, reason: str, group) -> Tuple[bool, str]:
    """(True, "") when every rank is ok, else (False, the first failing rank's reason)."""
    states = gather_objects((bool(ok), reason), group)
    for r, (rank_ok, why) in enumerate(states):
        if not rank_ok:
            return False, f"rank {r}: {why}"
    return True, ""


def barrier(group, device: torch.device) -> None:
    torch.cuda.synchronize(device)
    _dist().barrier(group=group, device_ids=[device.index])


class EPHarness(hz.Harness):
    """The harness with a barrier of the group wherever it synchronises, so that every timed
    section starts with all ranks lined up (warm-up -> barrier -> timed calls)."""

    def __init__(self, device, group, **kw) -> None:
        super().__init__(device, verbose=False, **kw)
        self.group = group

    def _sync(self) -> None:
        barrier(self.group, self.device)


def merge(record: Dict[str, Any], group, report: hz.Harness) -> Dict[str, Any]:
    """One result from every rank's record of the same benchmark: the slowest rank's median
    (its check, the worst rank's error), or the first rank that did not run it."""
    records = gather_objects(record, group)
    for r, rec in enumerate(records):
        if rec.get("status") != "ok":
            out = dict(rec)
            out["error"] = f"rank {r}: {rec.get('error', '')}"
            out["per_rank_status"] = [x.get("status") for x in records]
            return out
    slowest = max(range(len(records)), key=lambda r: records[r]["ms"])
    out = dict(records[slowest])
    out.update(slowest_rank=slowest, per_rank_ms=[x["ms"] for x in records],
               flops=sum(x.get("flops") or 0.0 for x in records) / len(records))
    out.update(report._rates(out["ms"], out["flops"], out.get("bytes") or 0.0))
    checks = [x.get("check") for x in records]
    if any(checks):
        rels = [c.get("rel_fro", math.inf) if c else math.inf for c in checks]
        out["check"] = {"ok": all(c is not None and c.get("ok") for c in checks), "rel_fro": max(rels),
                        "rtol": RTOL, "per_rank": checks}
        errors = [f"rank {r}: {c['error']}" for r, c in enumerate(checks) if c and "error" in c]
        if errors:
            out["check"]["error"] = "; ".join(errors)
    return out


# ---------------------------------------------------------------------------------------
# One shape × routing on one rank


class EPCase:
    """This rank's local experts of one shape, its input sets (made on demand, identical in
    shape on every rank), and per set what the group exchanged about it: rows per local expert,
    remote rows, and the float64 reference of the checked tokens."""

    def __init__(self, shape: sh.Shape, routing: str, rank: int, num_ranks: int, device: torch.device,
                 seed: int, drop: float, group, num_check: int) -> None:
        self.shape, self.routing, self.rank, self.num_ranks = shape, routing, rank, num_ranks
        self.device, self.seed, self.drop, self.group = device, seed, drop, group
        s = shape
        self.num_experts = s.E_l * num_ranks
        self.first_expert = rank * s.E_l
        gen = torch.Generator(device).manual_seed(seed * 1_000_003 + 7919 * rank + 1)

        def randn(*size, scale, generator=gen):
            return torch.randn(*size, device=device, dtype=torch.bfloat16, generator=generator).mul_(scale)

        # This rank's experts (mok layout) and a fused gate/up copy for the baselines
        self.w_gate = randn(s.E_l, s.I, s.H, scale=s.H ** -0.5)
        self.w_up = randn(s.E_l, s.I, s.H, scale=s.H ** -0.5)
        self.w_down = randn(s.E_l, s.H, s.I, scale=s.I ** -0.5)
        self.w_gateup = torch.cat([self.w_gate, self.w_up], dim=1)
        # Shared expert, replicated: the same on every rank
        self.shared = None
        if s.I_s:
            shared_gen = torch.Generator(device).manual_seed(seed * 1_000_003 + 5)
            self.shared = (randn(s.I_s, s.H, scale=s.H ** -0.5, generator=shared_gen),
                           randn(s.I_s, s.H, scale=s.H ** -0.5, generator=shared_gen),
                           randn(s.H, s.I_s, scale=s.I_s ** -0.5, generator=shared_gen))
        # Checked tokens: the same positions on every rank (first, last, random)
        picks = torch.randint(0, s.T, (max(0, num_check - 2),), generator=torch.Generator().manual_seed(seed + 7))
        self.tokens = torch.tensor(sorted({0, s.T - 1, *picks.tolist()}), device=device)
        self._sets: Dict[int, Dict[str, torch.Tensor]] = {}
        self._meta: Dict[int, Dict[str, Any]] = {}
        self._index: Dict[int, int] = {}

    # -- input sets -----------------------------------------------------------------------

    def inputs(self, i: int) -> Dict[str, torch.Tensor]:
        """Input set i of this rank (collective the first time: every rank makes set i together)."""
        if i not in self._sets:
            s = self.shape
            set_seed = (self.seed * 1000 + i + 1) * 1024 + self.rank
            ids, weights = sh.make_routing(self.routing, s.T, self.num_experts, s.k, seed=set_seed,
                                           device=self.device, drop=self.drop)
            gen = torch.Generator(self.device).manual_seed(set_seed)
            x = torch.randn(s.T, s.H, device=self.device, dtype=torch.bfloat16, generator=gen)
            self._sets[i] = dict(x=x, topk_ids=ids, topk_weights=weights)
            self._index[x.data_ptr()] = i
            self._meta[i] = self._exchange(self._sets[i])
        return self._sets[i]

    def inputs_with_dy(self, i: int) -> Dict[str, torch.Tensor]:
        """Input set i with dy [T, H] (the same x, topk_ids, topk_weights tensors: their checks
        find the set by x)."""
        inp = dict(self.inputs(i))
        gen = torch.Generator(self.device).manual_seed((self.seed * 1000 + i + 1) * 1024 + self.rank + 17)
        inp["dy"] = torch.randn(self.shape.T, self.shape.H, device=self.device, dtype=torch.bfloat16,
                                generator=gen).mul_(0.1)
        return inp

    def meta(self, i: int) -> Dict[str, Any]:
        self.inputs(i)
        return self._meta[i]

    def meta_of(self, inputs: Dict[str, torch.Tensor]) -> Dict[str, Any]:
        return self._meta[self._index[inputs["x"].data_ptr()]]

    @property
    def num_sets(self) -> int:
        return len(self._sets)

    def _exchange(self, inp: Dict[str, torch.Tensor]) -> Dict[str, Any]:
        dist, group = _dist(), self.group
        s, P, r = self.shape, self.num_ranks, self.rank
        lo, hi = self.first_expert, self.first_expert + s.E_l
        ids = inp["topk_ids"]
        # Every rank's routing: rows per local expert, and those from other ranks
        all_ids = [torch.empty_like(ids) for _ in range(P)]
        dist.all_gather(all_ids, ids, group=group)
        counts = torch.zeros(s.E_l, dtype=torch.int64, device=self.device)
        remote = 0
        for src, t in enumerate(all_ids):
            mine = t[(t >= lo) & (t < hi)].long() - lo
            c = torch.bincount(mine, minlength=s.E_l)
            counts += c
            if src != r:
                remote += int(c.sum())
        valid = int((ids >= 0).sum())
        sent = int(((ids >= 0) & ((ids < lo) | (ids >= hi))).sum())
        # float64 reference of the checked tokens of every rank: each rank adds its experts' terms
        tok = self.tokens
        xs = [torch.empty_like(inp["x"][tok]) for _ in range(P)]
        ws = [torch.empty_like(inp["topk_weights"][tok]) for _ in range(P)]
        dist.all_gather(xs, inp["x"].index_select(0, tok).contiguous(), group=group)
        dist.all_gather(ws, inp["topk_weights"].index_select(0, tok).contiguous(), group=group)
        ids_cat = torch.cat([t.index_select(0, tok) for t in all_ids])
        local_ids = torch.where((ids_cat >= lo) & (ids_cat < hi), ids_cat - lo, torch.full_like(ids_cat, -1))
        n = tok.numel()
        part = bl.reference_tokens(torch.cat(xs), local_ids, torch.cat(ws), self.w_gate, self.w_up, self.w_down,
                                   None, tokens=torch.arange(P * n, device=self.device))["y"]
        dist.all_reduce(part, group=group)
        ref = part[r * n:(r + 1) * n]
        if self.shared is not None:
            no_routes = torch.full((n, s.k), -1, dtype=ids.dtype, device=self.device)
            ref = ref + bl.reference_tokens(xs[r], no_routes, ws[r], self.w_gate, self.w_up, self.w_down,
                                            self.shared, tokens=torch.arange(n, device=self.device))["y"]
        return {"counts": counts.tolist(), "recv_rows": int(counts.sum()), "remote_rows": remote,
                "sent_rows": sent, "valid_routes": valid, "ref": ref}

    # -- checks -----------------------------------------------------------------------------

    def check(self, inputs: Dict[str, torch.Tensor], y: torch.Tensor) -> Dict[str, Any]:
        """y of the checked tokens against float64 (no collective: the reference is per set)."""
        c = bl.compare(y.index_select(0, self.tokens), self.meta_of(inputs)["ref"])
        return {"ok": c["rel_fro"] < RTOL, "tokens": self.tokens.numel(), "rtol": RTOL, **c}


# ---------------------------------------------------------------------------------------
# Benchmarks of one case


def run_merged(h: EPHarness, report: hz.Harness, bench: hz.Benchmark) -> Dict[str, Any]:
    return report._add(merge(h.run(bench), h.group, report))


def mok_workspace(mok, case: EPCase, config) -> Tuple[Any, str]:
    """This rank's workspace of the group for `config` (collective), or (None, why not)."""
    s = case.shape
    ws, why = None, ""
    try:
        ws = mok.functional.get_workspace(s.H, s.I, case.num_experts, s.k, s.T, s.I_s, device=case.device,
                                          config=config, group=case.group)
    except Exception as exc:
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    ok, why = agree(ws is not None, why, case.group)
    if not ok and ws is not None:
        mok.functional.clear_workspace_cache()
        ws.close()
        ws = None
    return ws, why


def release_workspace(mok, case: EPCase, ws) -> str:
    """Reports errors the device recorded, then frees the workspace once every rank is done."""
    why = ""
    try:
        ws.check_errors(wait=True)
    except Exception as exc:
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    barrier(case.group, case.device)
    mok.functional.clear_workspace_cache()
    ws.close()
    return agree(not why, why, case.group)[1]


def mok_layer_call(mok, case: EPCase, ws, backward: bool):
    """The timed call: mok's forward of this rank's layer on `ws` (backward: saving h, then the
    backward of dy)."""
    shared = case.shared if case.shared is not None else (None, None, None)

    def run(inp):
        y, ctx = mok.functional.forward(inp["x"], inp["topk_ids"], inp["topk_weights"], case.w_gate, case.w_up,
                                        case.w_down, *shared, workspace=ws, save_for_backward=backward)
        if backward:
            mok.functional.backward(ctx, inp["dy"])
        return y
    return run


def bench_mok(h, report, case: EPCase, state, group_name, config, name, panel, models,
              backward: bool = False) -> Optional[Dict[str, Any]]:
    """mok forward (backward: forward + backward) with `config`: one record (skipped with the
    reason where it cannot run); the check is y's against float64."""
    mok = state.get("mok")
    if mok is None:
        return report.skip(name, state["mok_status"], group=group_name, panel=panel, status="not available")
    if "failed_in" in state:
        return report.skip(name, f"skipped after an error in {state['failed_in']}", group=group_name, panel=panel)
    fwd_flops, pull_bytes = models
    ws, why = mok_workspace(mok, case, config)
    if ws is None:
        status = "not built" if "NotImplementedError" in why else "error"
        if status == "error":
            state["failed_in"] = group_name
        return report.skip(name, why, group=group_name, panel=panel, status=status)
    run = mok_layer_call(mok, case, ws, backward)

    meta = {"fwd_num_comm_sms": config.fwd_num_comm_sms, "minibatch_size": config.minibatch_size,
            "macrobatch_size": config.macrobatch_size, "num_blocks": config.num_blocks}
    rec = h.run(hz.Benchmark(name, case.inputs_with_dy if backward else case.inputs, run, flops=fwd_flops,
                             bytes=pull_bytes, check=case.check, group=group_name, panel=panel, meta=meta))
    device_error = release_workspace(mok, case, ws)
    if device_error and rec.get("status") == "ok":
        rec.update(status="error", error=f"device: {device_error}")
    merged = merge(rec, case.group, report)
    if merged.get("status") == "ok":
        # NVLink rates per rank, as averages over the call
        per_rank = gather_objects((pull_bytes, rec.get("ms")), case.group)
        rates = [b / (ms * 1e6) if ms else None for b, ms in per_rank]
        merged["nvlink"] = {"pull_bytes": [b for b, _ in per_rank], "pull_gbps_avg_over_call": rates,
                            "push_gbps_avg_over_call": rates, "note": NVLINK_NOTE}
    else:
        gather_objects(None, case.group)  # keep the collectives in step
    if merged.get("status") == "error":
        state["failed_in"] = group_name
    return report._add(merged)


def bench_mok_ep1(h, report, case: EPCase, state, group_name, config, name, panel, models,
                  backward: bool = False) -> Optional[Dict[str, Any]]:
    """mok at EP = 1 on each rank's GPU alone, at the same per-GPU load: the rank's own T tokens
    (the same x, topk_weights and dy) routed uniformly over its E/P local experts, so T·k rows
    pass through the same expert shapes with no exchange. EP = P over this is what the group's
    communication costs. The check is that y is finite (the routing is not the group's)."""
    mok = state.get("mok")
    if mok is None:
        return report.skip(name, state["mok_status"], group=group_name, panel=panel, status="not available")
    if "failed_in" in state:
        return report.skip(name, f"skipped after an error in {state['failed_in']}", group=group_name, panel=panel)
    s = case.shape
    ws, why = None, ""
    try:
        ws = mok.functional.get_workspace(s.H, s.I, s.E_l, s.k, s.T, s.I_s, device=case.device, config=config)
    except Exception as exc:
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    ok, why = agree(ws is not None, why, case.group)
    if not ok:
        if ws is not None:
            mok.functional.clear_workspace_cache()
            ws.close()
        state["failed_in"] = group_name
        return report.skip(name, why, group=group_name, panel=panel, status="error")
    run = mok_layer_call(mok, case, ws, backward)
    sets: Dict[int, Dict[str, torch.Tensor]] = {}

    def setup(i):
        if i not in sets:
            inp = dict(case.inputs_with_dy(i) if backward else case.inputs(i))
            ids, _ = sh.make_routing("uniform", s.T, s.E_l, s.k, seed=(case.seed * 1000 + i + 1) * 1024 + 511,
                                     device=case.device)
            sets[i] = {**inp, "topk_ids": ids}
        return sets[i]

    def finite(inp, y):
        ok = bool(torch.isfinite(y.float()).all().item())
        return {"ok": ok, "rel_err": 0.0 if ok else float("inf"), "tol": 0.0, "what": "y finite (EP = 1, own routing)"}

    rec = h.run(hz.Benchmark(name, setup, run, flops=models[0], check=finite, group=group_name, panel=panel))
    device_error = release_workspace(mok, case, ws)
    if device_error and rec.get("status") == "ok":
        rec.update(status="error", error=f"device: {device_error}")
    merged = merge(rec, case.group, report)
    if merged.get("status") == "error":
        state["failed_in"] = group_name
    return report._add(merged)


def bench_case(h: EPHarness, report: hz.Harness, case: EPCase, args, state) -> Dict[str, Any]:
    s = case.shape
    group_name = f"{s.name}/{case.routing}" + ("+shared" if s.I_s else "")
    meta0 = case.meta(0)
    fwd_flops = hz.moe_flops(s.T, s.k, s.H, s.I, s.I_s, routed_rows=meta0["valid_routes"])
    recv_flops = hz.moe_flops(s.T, s.k, s.H, s.I, routed_rows=meta0["recv_rows"])
    pull_bytes = float(meta0["remote_rows"] * s.H * 2)
    notes = {"group": group_name, "load": sh.expert_load(case.inputs(0)["topk_ids"], case.num_experts),
             "rows_per_rank": gather_objects({k: meta0[k] for k in ("recv_rows", "remote_rows", "sent_rows",
                                                                   "valid_routes")}, case.group)}

    def no_grad(fn):
        def run(inp):
            with torch.no_grad():
                return fn(inp)
        return run

    # NCCL all_to_all + PyTorch
    run_merged(h, report, hz.Benchmark(
        "nccl+torch fwd", case.inputs,
        no_grad(lambda inp: bl.nccl_ep_forward(inp["x"], inp["topk_ids"], inp["topk_weights"], case.w_gate,
                                               case.w_up, case.w_down, case.group, case.shared,
                                               w_gateup=case.w_gateup)),
        flops=fwd_flops, check=case.check, group=group_name, panel="fwd"))

    # NCCL all_to_all + PyTorch, forward + backward (autograd through the differentiable
    # all_to_all): the gradients of x, topk_weights and the experts' weights
    fb_flops = hz.moe_flops(s.T, s.k, s.H, s.I, s.I_s, direction="fwdbwd", routed_rows=meta0["valid_routes"])
    if not args.fwd_only:
        wgu = case.w_gateup.detach().clone().requires_grad_()
        wd = case.w_down.detach().clone().requires_grad_()

        def run_nccl_fb(inp):
            x = inp["x"].detach().requires_grad_()
            tw = inp["topk_weights"].detach().requires_grad_()
            with torch.enable_grad():
                y = bl.nccl_ep_forward(x, inp["topk_ids"], tw, case.w_gate, case.w_up, wd, case.group, case.shared,
                                       w_gateup=wgu)
                torch.autograd.grad(y, [x, tw, wgu, wd], inp["dy"])
            return y.detach()

        run_merged(h, report, hz.Benchmark("nccl+torch fwd+bwd", case.inputs_with_dy, run_nccl_fb, flops=fb_flops,
                                           check=lambda inp, y: case.check(inp, y), group=group_name,
                                           panel="fwd+bwd"))

    # DeepEP intranode dispatch/combine + PyTorch
    buffer = state.get("deep_ep_buffer")
    if buffer is None:
        report.skip("deepep+torch fwd", state["deep_ep_status"], group=group_name, panel="fwd",
                    status="not available")
    else:
        run_merged(h, report, hz.Benchmark(
            "deepep+torch fwd", case.inputs,
            no_grad(lambda inp: bl.deep_ep_forward(inp["x"], inp["topk_ids"], inp["topk_weights"], case.w_gate,
                                                   case.w_up, case.w_down, buffer, case.shared,
                                                   w_gateup=case.w_gateup)),
            flops=fwd_flops, check=case.check, group=group_name, panel="fwd"))

    # Experts only: the two grouped GEMMs on the rows this rank receives
    # NOTES: sets beyond those the layer benchmarks made reuse their row counts, so that this
    # setup, whose set count may differ per rank, never runs a collective
    def setup_experts(i):
        counts = case.meta(i % case.num_sets)["counts"]
        rows = sum(counts)
        gen = torch.Generator(case.device).manual_seed(case.seed * 1000 + i + 500 + 7919 * case.rank)
        offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(case.device)
        return dict(a=torch.randn(rows, s.H, device=case.device, dtype=torch.bfloat16, generator=gen),
                    h=torch.randn(rows, s.I, device=case.device, dtype=torch.bfloat16, generator=gen), offs=offs)

    with torch.no_grad():
        run_merged(h, report, hz.Benchmark(
            "experts only (grouped GEMMs)", setup_experts,
            lambda d: bl.experts_only(d["a"], d["offs"], case.w_gateup, case.w_down, d["h"]),
            flops=recv_flops, group=group_name, panel="fwd"))

    # Dense-rate floor of the rows each rank's experts receive (the slowest rank's)
    if h.ceiling_tflops:
        floor_flops = hz.moe_flops(s.T, s.k, s.H, s.I, s.I_s, routed_rows=meta0["recv_rows"])
        rec = h.model("dense-rate floor fwd", bl.dense_floor_ms(floor_flops, h.ceiling_tflops), group=group_name,
                      panel="fwd", flops=floor_flops, note=f"at {h.ceiling_tflops:.4g} TFLOP/s")
        report._add(merge(rec, case.group, report))

    # mok, and its knob sweep
    mok_config = state.get("config_factory")
    if mok_config is not None:
        bench_mok(h, report, case, state, group_name, mok_config(args.comm_sms, args.minibatch), "mok fwd", "fwd",
                  (fwd_flops, pull_bytes))
        if not args.fwd_only:
            bench_mok(h, report, case, state, group_name, mok_config(args.comm_sms, args.minibatch), "mok fwd+bwd",
                      "fwd+bwd", (fb_flops, 2 * pull_bytes), backward=True)
        # EP = 1 at the same per-GPU load (each rank alone), forward and forward + backward
        bench_mok_ep1(h, report, case, state, group_name, mok_config(args.comm_sms, args.minibatch),
                      "mok EP=1 fwd (same per-GPU load)", "fwd", (fwd_flops, 0.0))
        if not args.fwd_only:
            bench_mok_ep1(h, report, case, state, group_name, mok_config(args.comm_sms, args.minibatch),
                          "mok EP=1 fwd+bwd (same per-GPU load)", "fwd+bwd", (fb_flops, 0.0), backward=True)
        if args.sweep:
            for comm in SWEEP_COMM_SMS:
                for mb in SWEEP_MINIBATCH:
                    bench_mok(h, report, case, state, group_name, mok_config(comm, mb), f"mok fwd sms{comm} mb{mb}",
                              "sweep", (fwd_flops, pull_bytes))
    else:
        bench_mok(h, report, case, state, group_name, None, "mok fwd", "fwd", (fwd_flops, pull_bytes))
    return {**notes, "ratios": ratios(report, group_name)}


def ratios(report: hz.Harness, group: str) -> Dict[str, Optional[float]]:
    """Ratios of figures of this run (None where a figure is missing)."""
    def ms(name):
        r = report.find(name, group)
        return None if r is None else r["ms"]

    def div(a, b):
        return a / b if a is not None and b else None

    nccl, deep, experts = ms("nccl+torch fwd"), ms("deepep+torch fwd"), ms("experts only (grouped GEMMs)")
    floor, mok_fwd = ms("dense-rate floor fwd"), ms("mok fwd")
    nccl_fb, mok_fb = ms("nccl+torch fwd+bwd"), ms("mok fwd+bwd")
    ep1, ep1_fb = ms("mok EP=1 fwd (same per-GPU load)"), ms("mok EP=1 fwd+bwd (same per-GPU load)")
    mok_rec = report.find("mok fwd", group)
    rates = ((mok_rec or {}).get("nvlink") or {}).get("pull_gbps_avg_over_call") or []
    rates = [x for x in rates if x is not None]
    return {"nccl_fwd_ms": nccl, "deep_ep_fwd_ms": deep, "experts_only_ms": experts, "floor_fwd_ms": floor,
            "mok_fwd_ms": mok_fwd, "speedup_mok_vs_nccl": div(nccl, mok_fwd),
            "speedup_mok_vs_deep_ep": div(deep, mok_fwd), "mok_over_experts": div(mok_fwd, experts),
            "mok_over_floor": div(mok_fwd, floor), "nccl_over_experts": div(nccl, experts),
            "mok_pull_gbps_avg_min": min(rates) if rates else None,
            "mok_pull_gbps_avg_max": max(rates) if rates else None,
            "nccl_fwdbwd_ms": nccl_fb, "mok_fwdbwd_ms": mok_fb, "speedup_mok_fwdbwd_vs_nccl": div(nccl_fb, mok_fb),
            "mok_ep1_fwd_ms": ep1, "mok_fwd_over_ep1": div(mok_fwd, ep1),
            "mok_ep1_fwdbwd_ms": ep1_fb, "mok_fwdbwd_over_ep1": div(mok_fb, ep1_fb)}


def ratio_table(cases: List[Dict[str, Any]]) -> str:
    cols = [("nccl_fwd_ms", "nccl"), ("deep_ep_fwd_ms", "deepep"), ("experts_only_ms", "experts"),
            ("floor_fwd_ms", "floor"), ("mok_fwd_ms", "mok"), ("speedup_mok_vs_nccl", "nccl/mok"),
            ("speedup_mok_vs_deep_ep", "deepep/mok"), ("mok_over_experts", "mok/exp"),
            ("mok_over_floor", "mok/floor"), ("mok_pull_gbps_avg_min", "pull GB/s*"),
            ("mok_pull_gbps_avg_max", "(max)"), ("nccl_fwdbwd_ms", "nccl f+b"), ("mok_fwdbwd_ms", "mok f+b"),
            ("speedup_mok_fwdbwd_vs_nccl", "nccl/mok f+b"), ("mok_fwd_over_ep1", "mok/EP1"),
            ("mok_fwdbwd_over_ep1", "f+b/EP1")]
    lines = ["group".ljust(24) + "  ".join(c[1].rjust(10) for c in cols)]
    for c in cases:
        r = c["ratios"]
        cells = ["-" if r.get(key) is None else f"{r[key]:.3f}" for key, _ in cols]
        lines.append(c["group"][:24].ljust(24) + "  ".join(x.rjust(10) for x in cells))
    lines.append("* " + NVLINK_NOTE + " min and max over ranks; push GB/s is the same figure.")
    return "\n".join(lines)


def sweep_table(report: hz.Harness) -> str:
    rows = [r for r in report.results if r.get("panel") == "sweep"]
    if not rows:
        return ""
    lines = ["mok sweep (slowest rank's median ms; pull GB/s averaged over the call, slowest rank)",
             "group".ljust(24) + "config".ljust(18) + "ms".rjust(9) + "pull GB/s".rjust(11) + "  check"]
    for r in rows:
        ms = "-" if r.get("status") != "ok" else f"{r['ms']:.3f}"
        gbps = "-" if r.get("gbps") is None else f"{r['gbps']:.0f}"
        verdict = hz.Harness.check_text(r) if r.get("status") == "ok" else f"{r.get('status')}: {r.get('error', '')}"
        lines.append(str(r["group"])[:24].ljust(24) + r["name"].replace("mok fwd ", "")[:18].ljust(18)
                     + ms.rjust(9) + gbps.rjust(11) + "  " + verdict[:60])
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# One rank


def worker(rank: int, num_ranks: int, port: int, args) -> None:
    for name, value in ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    dist = _dist()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks,
                            timeout=timedelta(seconds=args.timeout))
    try:
        run_rank(rank, num_ranks, device, args)
        barrier(dist.group.WORLD, device)
    finally:
        dist.destroy_process_group()


def run_rank(rank: int, num_ranks: int, device: torch.device, args) -> None:
    dist = _dist()
    group = dist.group.WORLD
    lead = rank == 0
    h = EPHarness(device, group, reps=args.reps, warmup=args.warmup, ceiling_tflops=args.ceiling_tflops)
    report = hz.Harness(device, reps=args.reps, warmup=args.warmup, ceiling_tflops=args.ceiling_tflops,
                        verbose=lead)
    shape_list = [s.with_shared(bool(args.shared)) for s in sh.parse_shapes(args.shapes)]
    if lead:
        print(f"bench_ep: EP={num_ranks} on {num_ranks} x {hz.device_name(device)}, torch {torch.__version__}, "
              f"grouped GEMM: {bl.grouped_mm_backend(device)}, reps {args.reps}, slowest rank's median; "
              f"GB/s column: mok's NVLink pull bytes / call time (average over the call)", flush=True)

    # Ceiling: the slowest rank's dense matmul rate, unless given
    ceilings: Dict[str, Any] = {}
    if args.ceiling_tflops is None:
        merged = report._add(merge(hz.matmul_ceiling(h, 8192), group, report))
        h.ceiling_tflops = report.ceiling_tflops = merged.get("tflops")
        ceilings["tflops_measured"] = merged.get("tflops")

    # DeepEP: importable on every rank, one buffer for the largest hidden size
    state: Dict[str, Any] = {}
    ok, why = agree(bl.deep_ep_available(), "deep_ep is not importable", group)
    state["deep_ep_status"] = "importable" if ok else why
    if ok and not args.no_deep_ep:
        buffer, why = None, ""
        try:
            buffer = bl.deep_ep_buffer(group, max(s.H for s in shape_list))
        except Exception as exc:
            why = f"deep_ep.Buffer: {type(exc).__name__}: {exc}"
        ok, why = agree(buffer is not None, why, group)
        state["deep_ep_buffer"] = buffer if ok else None
        state["deep_ep_status"] = "ok" if ok else why
    elif args.no_deep_ep:
        state["deep_ep_status"] = "disabled (--no-deep-ep)"

    # mok: importable on every rank (a missing EP >= 2 path shows up per call as "not built")
    if args.no_mok:
        state.update(mok=None, mok_status="disabled (--no-mok)")
    else:
        module, why = bl.import_mok()
        ok, why = agree(module is not None, why, group)
        state.update(mok=module if ok else None, mok_status="importable" if ok else why)
        if ok:
            # Knobs not given on the command line: mok's defaults (MoKConfig, from libmok)
            defaults = module.functional.MoKConfig()
            for arg, field in (("comm_sms", "fwd_num_comm_sms"), ("minibatch", "minibatch_size"),
                               ("macrobatch", "macrobatch_size"), ("timeout_s", "timeout_s")):
                if getattr(args, arg) is None:
                    setattr(args, arg, getattr(defaults, field))

            def config_factory(comm_sms, minibatch):
                return module.functional.MoKConfig(fwd_num_comm_sms=comm_sms, minibatch_size=minibatch,
                                                   macrobatch_size=args.macrobatch, timeout_s=args.timeout_s)
            state["config_factory"] = config_factory

    # Every shape × routing, freeing between them
    cases = []
    for shape in shape_list:
        for routing in args.routings:
            case = EPCase(shape, routing, rank, num_ranks, device, args.seed, args.drop, group, args.check_tokens)
            cases.append(bench_case(h, report, case, args, state))
            del case
            torch.cuda.empty_cache()

    # Summary, JSON and chart (rank 0)
    if not lead:
        return
    print()
    print(ratio_table(cases))
    sweep = sweep_table(report)
    if sweep:
        print()
        print(sweep)
    failed = [f"{r['group']} {r['name']}" for r in report.failed_checks()]
    out_json = os.path.join(args.out, "bench_ep.json")
    report.write_json(out_json, {
        "command": " ".join(["bench_ep.py"] + args.argv), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "ep_size": num_ranks, "gpus": [torch.cuda.get_device_name(d) for d in range(num_ranks)],
        "env": {k: os.environ.get(k) for k in ENV_DEFAULTS}, "ceilings": ceilings,
        "deep_ep": state["deep_ep_status"], "mok": state["mok_status"], "nvlink_note": NVLINK_NOTE,
        "shapes": [{"name": s.name, "H": s.H, "I": s.I, "k": s.k, "E_l": s.E_l, "E": s.E_l * num_ranks, "T": s.T,
                    "I_s": s.I_s} for s in shape_list],
        "cases": cases, "failed_checks": failed})
    png = os.path.join(args.out, "bench_ep.png")
    why_not = report.plot(png, title=f"MoE layer, EP={num_ranks}", panels=("fwd", "sweep"))
    print(f"\nwrote {out_json}" + (f" and {png}" if why_not is None else f"; no chart: {why_not}"))
    if failed:
        print("CORRECTNESS FAILED: " + ", ".join(failed))


# ---------------------------------------------------------------------------------------
# Main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="dsv3,dsv3-t2k,qwen3", help="comma-separated shape names (docs/benchmarks.md), or 'all'")
    p.add_argument("--routing", default="uniform,zipf", help="comma-separated: uniform, zipf")
    p.add_argument("--gpus", type=int, default=0, help="ranks P (one GPU each; default: every visible GPU)")
    p.add_argument("--shared", type=int, choices=(0, 1), default=0, help="shared expert with I_s = I")
    p.add_argument("--reps", type=int, default=20, help="timed runs per figure (median, at least 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs first")
    p.add_argument("--out", default="out/bench", help="directory for bench_ep.json and .png")
    p.add_argument("--sweep", action="store_true",
                   help=f"mok over fwd_num_comm_sms {SWEEP_COMM_SMS} x minibatch_size {SWEEP_MINIBATCH}")
    p.add_argument("--comm-sms", type=int, help="mok fwd_num_comm_sms of the headline figure (default: mok's)")
    p.add_argument("--minibatch", type=int, help="mok minibatch_size of the headline figure (default: mok's)")
    p.add_argument("--macrobatch", type=int, help="mok macrobatch_size, ring rows (default: mok's)")
    p.add_argument("--timeout-s", type=float, help="mok device-side wait deadline (default: mok's)")
    p.add_argument("--timeout", type=int, default=900, help="seconds a collective may take before NCCL aborts")
    p.add_argument("--ceiling-tflops", type=float, help="dense bf16 rate (default: measured 8192^3 matmul)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drop", type=float, default=0.0, help="fraction of routes set to -1")
    p.add_argument("--check-tokens", type=int, default=8, help="tokens per rank checked against float64")
    p.add_argument("--no-mok", action="store_true", help="do not run mok")
    p.add_argument("--no-deep-ep", action="store_true", help="do not run DeepEP even where it imports")
    p.add_argument("--fwd-only", action="store_true", help="skip forward+backward (NCCL+PyTorch autograd, mok)")
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.reps = max(20, args.reps)
    args.routings = [r.strip() for r in args.routing.split(",") if r.strip()]
    for r in args.routings:
        if r not in sh.ROUTINGS:
            p.error(f"routing {r!r}; expected some of {', '.join(sh.ROUTINGS)}")
    try:
        sh.parse_shapes(args.shapes)
    except ValueError as exc:
        p.error(str(exc))
    return args


def why_not_runnable(args) -> Optional[str]:
    """None when an EP ≥ 2 run can start here, else the reason."""
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    count = torch.cuda.device_count()
    if count < 2:
        return (f"{count} GPU visible; EP >= 2 needs at least 2 (one process per GPU). bench_layer.py measures "
                f"one GPU; tests/python/test_ep.py runs the EP protocol on virtual ranks of one GPU")
    if args.gpus and not 2 <= args.gpus <= count:
        return f"--gpus {args.gpus}: between 2 and the {count} visible GPUs"
    try:
        import torch.distributed as dist
    except ImportError as exc:
        return f"torch.distributed does not import ({exc})"
    if not dist.is_available():
        return "this PyTorch build has no torch.distributed"
    if not dist.is_nccl_available():
        return "this PyTorch build has no NCCL backend"
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    reason = why_not_runnable(args)
    if reason is not None:
        print(f"bench_ep: {reason}; nothing to benchmark.")
        return 0
    for name, value in ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    num_ranks = args.gpus or torch.cuda.device_count()
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.join(args.out, "bench_ep.json")
    if os.path.exists(out_json):
        os.remove(out_json)
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(num_ranks, free_port(), args), nprocs=num_ranks, join=True)
    with open(out_json) as f:
        failed = json.load(f).get("failed_checks")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
