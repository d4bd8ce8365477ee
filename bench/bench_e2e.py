#!/usr/bin/env python3
"""End-to-end training benchmark: Hugging Face causal LMs built from configs (random init,
nothing downloaded), trained on a fixed synthetic corpus once per experts implementation, in one
process: mok (`experts_implementation="mok"`, registered by `import mok.integrations.hf`) against
HF's default `grouped_mm` (and `eager` on request: --impls grouped_mm,mok,eager).

Per model and implementation: tokens/s (median step after warm-up) and the speed-up over
grouped_mm, the share of the step spent in the sparse-MoE blocks (and in the experts alone), peak
memory, and the loss curve from the same initial weights on the same batches (parity: the mean loss
of the last 10 steps and the final loss within 1 % of grouped_mm's). Writes DIR/e2e.json (after
each implementation, so an interrupted run keeps what it finished) and DIR/e2e.png (loss curves,
loss difference in %, tokens/s bars labelled with the speed-up); the table comes last on stdout.
Exit status 1 when an implementation failed (an error, a non-finite loss, a mok fallback) or missed
parity; 0 otherwise.

  python3 bench/bench_e2e.py --out out/bench                        # both models, one H200, ~4-5 min
  python3 bench/bench_e2e.py --models qwen3 --impls grouped_mm,mok,eager --out out/bench_eager
  python3 bench/bench_e2e.py --models qwen3 --impls grouped_mm,mok,mok_fp8 --steps 200 --out out/bench_fp8
                                                # mok in fp8_block too: its loss against bf16's
  python3 bench/bench_e2e.py --smoke --device cpu --out /tmp/e2e    # CPU smoke test (< 1 min)

Models (--qwen3-layers, --dsv3-layers, --vocab, --batch, --seq change them; bf16, SDPA attention,
vocab 32000, untied embeddings, no router aux loss, 2 x 4096 tokens per step):
  qwen3  Qwen3-30B-A3B's layer (its config.json): hidden 2048, 128 experts, top-8 (normalised),
         moe_intermediate 768, attention 32 heads / 4 KV heads / head_dim 128, rope theta 1e6;
         12 layers: 7.61 G parameters (7.25 G in experts), about 61 GB of weights, grads and AdamW
         states.
  dsv3   DeepSeek-V3's layer as one GPU of an EP = 16 deployment holds it, the `dsv3` shape of
         docs/benchmarks.md (E_l = 16, H 7168, I 2048, top-8: T·k routed rows per GPU): hidden
         7168, 16 routed experts of moe_intermediate 2048, top-8, one shared expert (n_shared_experts
         = 1), sigmoid router with n_group = topk_group = 1 and routed_scaling_factor 2.5,
         DeepSeek-V3's MLA attention (128 heads, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128),
         first_k_dense_replace = 0 (every layer MoE); 4 layers: 4.20 G parameters (2.82 G in
         experts), about 34 GB of weights, grads and AdamW states plus roughly 7 GB of activations
         per layer. The full 256 experts would be 11.3 G parameters per layer (90 GB with AdamW):
         one H200 holds one such layer and nothing else.
  --smoke  both families at hidden 128, 8 experts, top-2, 2 layers, seq 64, vocab 128, 24 steps.

Time on one H200 (measured 2026-12-02): qwen3 0.22-0.28 s per step, dsv3 0.34-0.42 s; with
150 steps per implementation the default run (both models x grouped_mm, mok) takes about 4-5
minutes. eager adds minutes (qwen3's 128 experts loop on the host).

Method (also in the JSON under "method"):
  step      zero_grad, forward with labels (HF's shifted cross-entropy), backward, grad-norm clip
            (--clip), AdamW (fused on CUDA) with bf16 parameters and states, lr --lr after a linear
            warm-up of --lr-warmup steps. Implementations run one after another in one process
            (two copies of the qwen3 model and its AdamW states do not fit one H200).
  tokens/s  batch·seq / median step time over the steps after --warmup and before the hooked
            steps; each step between two CUDA events (perf_counter on the CPU); no host sync in
            the loop (the losses stay on the device until the end).
  MoE share CUDA events recorded by forward pre/post hooks and full-backward pre/post hooks on
            every sparse-MoE block (router + experts [+ shared expert]) and, separately, on every
            experts module, summed per step, over the step time of the same steps: the last
            --share-steps steps, the only ones with the hooks attached. Caveats: an interval is
            the GPU timeline between two events, so it also holds GPU idle time inside the block
            (host syncs, launch gaps) and, in the backward, any unrelated ready autograd node the
            engine runs between the block's first and last backward nodes (in a sequential decoder
            only the residual add); the hooks' identity autograd nodes cost a little, hence the
            separate hooked steps (their step time is in the JSON as step_ms_hooked).
  peak mem  torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), the previous
            implementation's model and optimizer freed first: weights, grads, AdamW states,
            activations, workspaces. On the CPU: the process's max RSS (not per implementation).
  parity    each implementation starts from the same weights (built once, copied to the host,
            loaded into each fresh model) and sees the same batches: a seeded sparse Markov chain
            (4 successors per token, Zipf-like popularity) that the models learn within the run.
  fallback  for mok, mok.integrations.hf's MokFallbackWarning is an error, and after the first
            step and at the end every experts module's cached decision must be "mok": a module
            that ran grouped_mm instead fails the implementation.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import resource
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import harness as hz  # noqa: E402

BASELINE = "grouped_mm"
PARITY_TOL = 0.01  # relative difference allowed between the losses (mean of the last 10, final)
LAST_N = 10
GB = 1e9


# ---------------------------------------------------------------------------------------
# Model configurations


def model_specs(args) -> Dict[str, Dict[str, Any]]:
    """name -> {"family", "label", "config": kwargs of the transformers config class}."""
    common = dict(vocab_size=args.vocab, max_position_embeddings=max(4096, args.seq), use_cache=False,
                  tie_word_embeddings=False, initializer_range=0.02, rms_norm_eps=1e-6)
    if args.smoke:
        qwen3 = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=128, norm_topk_prob=True)
        dsv3 = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16,
                    qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=128)
    else:
        # Qwen3-30B-A3B's layer (its config.json), fewer layers
        qwen3 = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=args.qwen3_layers,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        # DeepSeek-V3's layer with the experts of one GPU at EP = 16 (docs/benchmarks.md "dsv3")
        dsv3 = dict(hidden_size=7168, intermediate_size=18432, num_hidden_layers=args.dsv3_layers,
                    num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=16,
                    num_experts_per_tok=8, moe_intermediate_size=2048)
    qwen3.update(decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False, **common)
    dsv3.update(n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, **common)
    L_q, L_d = qwen3["num_hidden_layers"], dsv3["num_hidden_layers"]
    return {
        "qwen3": {"family": "qwen3_moe", "config": qwen3,
                  "label": f"Qwen3-30B-A3B-shaped, {L_q} layers" + (" (smoke)" if args.smoke else "")},
        "dsv3": {"family": "deepseek_v3", "config": dsv3,
                 "label": (f"DeepSeek-V3 layer, 16 routed experts (EP=16 per-GPU load) + 1 shared, {L_d} layers"
                           if not args.smoke else f"DeepSeek-V3-family, {L_d} layers (smoke)")},
    }


def make_config(spec: Dict[str, Any]):
    import transformers
    cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "deepseek_v3": transformers.DeepseekV3Config}[spec["family"]]
    return cls(**spec["config"])


def build_model(spec: Dict[str, Any], impl: str, device: torch.device):
    """A fresh causal LM of `spec` on `device` with experts implementation `impl`, bf16, SDPA
    attention, in training mode; its weights are HF's random init (replaced by the caller)."""
    from transformers import AutoModelForCausalLM
    cfg = make_config(spec)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, experts_implementation=impl, attn_implementation="sdpa",
                                                 dtype=torch.bfloat16)
    model.train()
    # HF swaps "grouped_mm" for "eager" only when none was requested; an explicit request that
    # cannot dispatch raises. Check that the one asked for is the one set.
    got = model.config._experts_implementation
    if got != impl:
        raise RuntimeError(f"asked for experts_implementation={impl!r}, the model has {got!r}")
    return model


def moe_modules(model) -> Tuple[List[torch.nn.Module], List[torch.nn.Module]]:
    """(sparse-MoE blocks, their experts modules): a block holds a router `gate` and `experts`."""
    blocks = [m for m in model.modules()
              if isinstance(getattr(m, "experts", None), torch.nn.Module) and hasattr(m, "gate")]
    return blocks, [b.experts for b in blocks]


def param_counts(model) -> Dict[str, int]:
    blocks, experts = moe_modules(model)
    total = sum(p.numel() for p in model.parameters())
    ex = sum(p.numel() for e in experts for p in e.parameters())
    blk = sum(p.numel() for b in blocks for p in b.parameters())
    return {"total": total, "experts": ex, "moe_blocks": blk, "moe_blocks_count": len(blocks)}


# ---------------------------------------------------------------------------------------
# The corpus: a seeded sparse Markov chain (each token has 4 successors with fixed
# probabilities, successors drawn Zipf-like), so the loss falls (unigram, then bigram)


def make_corpus(steps: int, batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """int64 [steps, batch, seq] on the CPU, the same for a given seed everywhere."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=gen)
    zipf = 1.0 / (torch.arange(vocab, dtype=torch.float64) + 10.0)
    zipf = zipf[torch.argsort(perm)]  # token perm[r] has popularity rank r
    succ = torch.multinomial(zipf, vocab * 4, replacement=True, generator=gen).view(vocab, 4)
    p_next = torch.tensor([0.55, 0.25, 0.12, 0.08], dtype=torch.float64)
    n = steps * batch
    choice = torch.multinomial(p_next, n * seq, replacement=True, generator=gen).view(n, seq)
    cur = torch.multinomial(zipf, n, replacement=True, generator=gen)
    out = torch.empty(n, seq, dtype=torch.int64)
    for t in range(seq):
        out[:, t] = cur
        cur = succ[cur, choice[:, t]]
    return out.view(steps, batch, seq)


# ---------------------------------------------------------------------------------------
# Clocks: CUDA events on the GPU, perf_counter on the CPU


class Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class MoEHooks:
    """Events around every sparse-MoE block and experts module, forward and backward; attached
    only for the hooked steps (full-backward hooks add identity autograd nodes)."""

    def __init__(self, model, clock: Clock) -> None:
        self.clock = clock
        self.blocks, self.experts = moe_modules(model)
        self.handles: List[Any] = []
        self.open: Dict[Any, Any] = {}
        self.spans: Dict[str, List[Any]] = {}

    def attach(self) -> None:
        for kind, mods in (("block", self.blocks), ("experts", self.experts)):
            for m in mods:
                self.handles += [
                    m.register_forward_pre_hook(self._start(kind, "fwd")),
                    m.register_forward_hook(self._end(kind, "fwd")),
                    m.register_full_backward_pre_hook(self._start(kind, "bwd")),
                    m.register_full_backward_hook(self._end(kind, "bwd")),
                ]

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _start(self, kind: str, direction: str) -> Callable:
        def hook(module, *_):
            self.open[(kind, direction, id(module))] = self.clock.mark()
        return hook

    def _end(self, kind: str, direction: str) -> Callable:
        def hook(module, *_):
            start = self.open.pop((kind, direction, id(module)), None)
            if start is None:
                raise RuntimeError(f"MoE hook: {kind} {direction} ended without a start")
            self.spans.setdefault(f"{kind}_{direction}", []).append((start, self.clock.mark()))
        return hook

    def take(self) -> Dict[str, float]:
        """ms per kind/direction since the last take (synchronises)."""
        self.clock.sync()
        out = {k: sum(self.clock.ms(a, b) for a, b in v) for k, v in self.spans.items()}
        counts = {f"{k}_count": len(v) for k, v in self.spans.items()}
        self.spans = {}
        return {**out, **counts}


# ---------------------------------------------------------------------------------------
# mok's HF integration and its fallback guard


# mok's implementations: the experts implementation HF dispatches to, and the precision of the
# mok layer (mok.integrations.hf.CONFIG) while the implementation trains. "mok_fp8" is mok in
# fp8_block (DeepSeek-V3's block-scaled recipe, docs/precision.md) against the same baseline: the
# issue's training-parity check (its final loss within 1 % of the bf16 baseline's).
MOK_IMPLS = {"mok": "bf16", "mok_fp8": "fp8_block"}


def hf_impl(impl: str) -> str:
    """The experts_implementation HF is asked for (mok's precisions share "mok")."""
    return "mok" if impl in MOK_IMPLS else impl


@contextlib.contextmanager
def mok_precision(impl: str, mok_hf):
    """mok's layer configuration in `impl`'s precision while it trains, restored after."""
    if impl not in MOK_IMPLS or mok_hf is None:
        yield
        return
    saved = mok_hf.CONFIG
    mok_hf.CONFIG = dataclasses.replace(saved, precision=MOK_IMPLS[impl])
    try:
        yield
    finally:
        mok_hf.CONFIG = saved


def import_mok_hf():
    """(mok.integrations.hf, None) or (None, why not)."""
    try:
        import mok.integrations.hf as mok_hf  # noqa: F401  (registers experts_implementation="mok")
        return mok_hf, None
    except Exception as exc:  # noqa: BLE001
        return None, f"not importable ({type(exc).__name__}: {exc})"


def mok_fallbacks(model) -> List[str]:
    """Why any experts module of model did not run mok (empty: every one ran it). Reads the
    decisions mok.integrations.hf caches on each module (the reason per input kind, None for mok)."""
    problems = []
    for i, module in enumerate(moe_modules(model)[1]):
        decisions = module.__dict__.get("_mok_decisions")
        if decisions is None:
            problems.append(f"experts module {i} ({type(module).__name__}) never reached mok's experts function")
            continue
        reasons = [decisions.module_reason] + list(decisions.values())
        problems += [f"{type(module).__name__}: {r}" for r in reasons if r is not None]
    return sorted(set(problems))


@contextlib.contextmanager
def no_fallback(impl: str, mok_hf):
    """For mok: its MokFallbackWarning becomes an error (the first fallback of a module class and
    reason in this process warns; the cached decisions are checked as well)."""
    if impl not in MOK_IMPLS:
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", mok_hf.MokFallbackWarning)
        yield


def check_mok_ran(impl: str, model) -> None:
    if impl in MOK_IMPLS:
        problems = mok_fallbacks(model)
        if problems:
            raise RuntimeError("mok fell back to grouped_mm: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------
# One implementation: fresh model from the shared initial weights, train, measure


def lr_at(step: int, args) -> float:
    return args.lr * min(1.0, (step + 1) / max(1, args.lr_warmup))


def run_impl(spec, impl: str, init_state, corpus: torch.Tensor, args, device: torch.device, mok_hf) -> Dict[str, Any]:
    """Train a fresh model of `spec` with experts implementation `impl` from `init_state` on
    `corpus` for args.steps steps; its figures (timing, MoE share, memory, losses)."""
    clock = Clock(device)
    rec: Dict[str, Any] = {"impl": impl}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    model = build_model(spec, hf_impl(impl), device)
    model.load_state_dict(init_state, strict=True)
    params = [p for p in model.parameters() if p.requires_grad]
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay,
                            fused=fused or None)
    rec["build_s"] = time.perf_counter() - t0
    hooks = MoEHooks(model, clock)
    steps, hooked_from = args.steps, args.steps - args.share_steps
    losses, marks, share = [], [], []

    # Training loop: no host sync inside (losses stay on the device until the end)
    t1 = time.perf_counter()
    with no_fallback(impl, mok_hf), mok_precision(impl, mok_hf):
        for step in range(steps):
            if step == hooked_from:
                hooks.attach()
            ids = corpus[step]
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            start = clock.mark()
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(params, args.clip)
            opt.step()
            end = clock.mark()
            marks.append((start, end))
            losses.append(loss.detach())
            if step == 0:
                check_mok_ran(impl, model)  # fail fast
            if step >= hooked_from:
                s = hooks.take()
                s["step_ms"] = clock.ms(start, end)
                share.append(s)
            if args.verbose and (step % args.log_every == 0 or step == steps - 1):
                print(f"  {impl:>10} step {step:4d} loss {loss.item():.4f}", flush=True)
        hooks.detach()
        clock.sync()
    check_mok_ran(impl, model)
    rec["run_s"] = time.perf_counter() - t1

    # Step times: after warm-up, without hooks
    step_ms = [clock.ms(a, b) for a, b in marks]
    timed = step_ms[args.warmup:hooked_from]
    med = statistics.median(timed)
    rec.update(step_ms_median=med, step_ms_p10=hz.percentile(timed, 10), step_ms_p90=hz.percentile(timed, 90),
               step_ms_mean=statistics.fmean(timed), timed_steps=len(timed),
               tokens_per_s=args.batch * args.seq / (med / 1e3))

    # MoE share from the hooked steps
    if share:
        tot = sum(s["step_ms"] for s in share)
        per = lambda key: sum(s.get(key, 0.0) for s in share) / len(share)  # noqa: E731
        rec.update(step_ms_hooked=tot / len(share), moe_fwd_ms=per("block_fwd"), moe_bwd_ms=per("block_bwd"),
                   experts_fwd_ms=per("experts_fwd"), experts_bwd_ms=per("experts_bwd"), hooked_steps=len(share))
        rec["moe_ms"] = rec["moe_fwd_ms"] + rec["moe_bwd_ms"]
        rec["experts_ms"] = rec["experts_fwd_ms"] + rec["experts_bwd_ms"]
        rec["moe_share"] = rec["moe_ms"] / rec["step_ms_hooked"]
        rec["experts_share"] = rec["experts_ms"] / rec["step_ms_hooked"]
        n_blocks = len(hooks.blocks)
        for key in ("block_fwd", "block_bwd", "experts_fwd", "experts_bwd"):
            got = [s.get(f"{key}_count", 0) for s in share]
            if any(c != n_blocks for c in got):
                raise RuntimeError(f"MoE hooks: {key} fired {got} times per step, expected {n_blocks}")

    # Losses and memory
    rec["losses"] = [float(x) for x in torch.stack(losses).float().cpu()]
    rec["final_loss"] = rec["losses"][-1]
    rec["mean_last10"] = statistics.fmean(rec["losses"][-LAST_N:])
    rec["first_loss"] = rec["losses"][0]
    rec["finite"] = all(math.isfinite(x) for x in rec["losses"])
    state = hz.tensor_bytes([list(model.parameters()), [p.grad for p in params if p.grad is not None],
                             [list(s.values()) for s in opt.state.values()]])
    rec["state_gb"] = state / GB
    if device.type == "cuda":
        rec["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / GB
        rec["peak_mem_source"] = "torch.cuda.max_memory_allocated"
    else:
        rec["peak_mem_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
        rec["peak_mem_source"] = "process max RSS (CPU; not per implementation)"
    if impl in MOK_IMPLS:
        rec["mok_fallbacks"] = mok_fallbacks(model)
    rec["status"] = "ok" if rec["finite"] else "error"
    if not rec["finite"]:
        rec["error"] = "non-finite loss"
    del model, opt, params, hooks, losses, marks
    return rec


def compare(results: Dict[str, Dict[str, Any]], baseline: str) -> None:
    """Speed-up and loss differences against the baseline, in place."""
    base = results.get(baseline)
    base_ok = base is not None and base.get("status") == "ok"
    for impl, r in results.items():
        if r.get("status") != "ok":
            continue
        if not base_ok:
            r.update(speedup=None, loss_diff_last10=None, loss_diff_final=None, parity_ok=None)
            continue
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["loss_diff_last10"] = abs(r["mean_last10"] - base["mean_last10"]) / abs(base["mean_last10"])
        r["loss_diff_final"] = abs(r["final_loss"] - base["final_loss"]) / abs(base["final_loss"])
        n = min(len(r["losses"]), len(base["losses"]))
        r["loss_diff_max_step"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"][:n], base["losses"][:n]))
        r["parity_ok"] = r["loss_diff_last10"] <= PARITY_TOL and r["loss_diff_final"] <= PARITY_TOL


# ---------------------------------------------------------------------------------------
# Reporting


def fmt(v, spec: str, scale: float = 1.0) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v * scale, spec)


def table(doc: Dict[str, Any]) -> str:
    cols = [("model", 7, "<"), ("impl", 10, "<"), ("tokens/s", 10, ">"), (f"vs {doc['baseline']}", 13, ">"),
            ("MoE share", 9, ">"), ("exp share", 9, ">"), ("peak GB", 8, ">"), ("final loss", 10, ">"),
            ("dloss10 %", 9, ">"), ("dfinal %", 9, ">"), ("parity", 6, ">")]
    head = "  ".join(format(c, f"{a}{w}") for c, w, a in cols)
    lines = [head, "-" * len(head)]
    for m in doc["models"]:
        if "error" in m:  # the model itself failed (its build, its initial weights)
            lines.append(f"{m['name']:<7}  error: {str(m['error'])[:100]}")
        for impl, r in m["results"].items():
            if r.get("status") != "ok":
                lines.append(f"{m['name']:<7}  {impl:<10}  {r.get('status')}: {str(r.get('error', ''))[:90]}")
                continue
            parity = {True: "ok", False: "FAIL", None: "-"}[r.get("parity_ok")]
            cells = [m["name"], impl, fmt(r["tokens_per_s"], ".0f"), fmt(r.get("speedup"), ".3f") + "x",
                     fmt(r.get("moe_share"), ".1f", 100) + "%", fmt(r.get("experts_share"), ".1f", 100) + "%",
                     fmt(r.get("peak_mem_gb"), ".1f"), fmt(r["final_loss"], ".4f"),
                     fmt(r.get("loss_diff_last10"), ".3f", 100), fmt(r.get("loss_diff_final"), ".3f", 100), parity]
            lines.append("  ".join(format(c, f"{a}{w}") for c, (_, w, a) in zip(cells, cols)))
    return "\n".join(lines)


def plot(doc: Dict[str, Any], path: str) -> Optional[str]:
    """Per model: loss curves, relative loss difference to the baseline, tokens/s bars."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    models = [m for m in doc["models"] if any(r.get("status") == "ok" for r in m["results"].values())]
    if not models:
        return "no results to plot"
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 4.2 * len(models)), squeeze=False,
                             gridspec_kw={"width_ratios": [2.2, 1.6, 1.0]})
    base = doc["baseline"]
    order = list(doc["settings"]["impls"])
    color = lambda impl: f"C{order.index(impl) if impl in order else len(order)}"  # noqa: E731
    for row, m in zip(axes, models):
        ok = {i: r for i, r in m["results"].items() if r.get("status") == "ok"}
        ax = row[0]
        for impl, r in ok.items():
            ax.plot(range(len(r["losses"])), r["losses"], label=impl, lw=1.2, alpha=0.85,
                    ls="--" if impl == base else "-", color=color(impl))
        ax.set_title(f"{m['name']}: {m['label']}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax = row[1]
        if base in ok:
            b = ok[base]["losses"]
            for impl, r in ok.items():
                if impl == base:
                    continue
                n = min(len(b), len(r["losses"]))
                ax.plot(range(n), [100 * (x - y) / y for x, y in zip(r["losses"][:n], b[:n])], label=impl, lw=1,
                        color=color(impl))
            ax.axhline(0, color="k", lw=0.6)
            for lim in (-100 * PARITY_TOL, 100 * PARITY_TOL):
                ax.axhline(lim, color="r", lw=0.6, ls=":")
        ax.set_title(f"loss vs {base}, %", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax = row[2]
        names = list(ok)
        vals = [ok[i]["tokens_per_s"] for i in names]
        bars = ax.bar(names, vals, color=[color(i) for i in names])
        for bar, impl in zip(bars, names):
            sp = ok[impl].get("speedup")
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), "" if sp is None else f"{sp:.3f}x",
                    ha="center", va="bottom", fontsize=8)
        ax.set_title("tokens/s (median step)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"end to end, {doc['device']}, {doc['settings']['batch']} x {doc['settings']['seq']} tokens/step",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


METHOD = {
    "step": "zero_grad(set_to_none); loss = model(input_ids, labels=input_ids).loss (HF's shifted cross-entropy); "
            "backward; clip_grad_norm_ (--clip); AdamW (fused on CUDA) with bf16 params and states",
    "tokens_per_s": "batch*seq / median step time over the steps after --warmup and before the hooked steps; "
                    "each step between two CUDA events (perf_counter on the CPU); no host sync inside the loop",
    "moe_share": "CUDA events from forward pre/post hooks and full-backward pre/post hooks on every sparse-MoE block "
                 "(router + experts [+ shared expert]), summed per step, over the step time of the same hooked "
                 "steps (the last --share-steps); experts_share the same on the experts modules alone. Caveat: an "
                 "interval is GPU timeline between two events: it includes GPU idle time inside the block (host "
                 "syncs, launch gaps) and, in the backward, any unrelated ready autograd node run between the "
                 "block's first and last backward nodes (only residual adds in a sequential decoder); the hooks' "
                 "identity autograd nodes add a little time, so tokens/s comes from unhooked steps",
    "peak_mem": "torch.cuda.max_memory_allocated after reset_peak_memory_stats, the previous implementation's model "
                "and optimizer freed first (weights, grads, AdamW states, activations); CPU: process max RSS",
    "order": "implementations one after another in one process, fresh model and optimizer each",
    "parity": "same initial weights (built once, copied to the host, loaded into each fresh model), same batches; "
              f"relative |difference| of the mean loss over the last {LAST_N} steps and of the final loss against "
              f"the baseline, within {PARITY_TOL:.0%}",
    "corpus": "seeded sparse Markov chain over the vocabulary: each token has 4 successors (p = .55/.25/.12/.08) "
              "drawn from a Zipf-like popularity (1/(rank+10)); sequences start at a popularity-drawn token",
}


# ---------------------------------------------------------------------------------------
# Main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3,dsv3", help="comma-separated: qwen3, dsv3")
    p.add_argument("--impls", default=None,
                   help="comma-separated experts implementations (default grouped_mm,mok; with --smoke "
                        "grouped_mm,mok,eager); eager is slow at full size")
    p.add_argument("--baseline", default=BASELINE, help="implementation the others are compared with")
    p.add_argument("--steps", type=int, default=None, help="training steps per implementation (default 150; smoke 24)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 5; smoke 2)")
    p.add_argument("--share-steps", type=int, default=None,
                   help="last steps with the MoE timing hooks, not in the tokens/s median (default 5; smoke 2)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 4096; smoke 64)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 32000; smoke 128)")
    p.add_argument("--qwen3-layers", type=int, default=12)
    p.add_argument("--dsv3-layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate (default 1e-4: at 3e-4 both models "
                   "spiked early in both implementations, and the runs diverged chaotically after; smoke 1e-3)")
    p.add_argument("--lr-warmup", type=int, default=10, help="linear learning-rate warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0, help="grad-norm clip (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--smoke", action="store_true", help="tiny models (hidden 128, 8 experts, top-2, 2 layers, seq 64)")
    p.add_argument("--out", default="out/bench", help="directory for e2e.json and e2e.png")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (--device cpu)")
    p.add_argument("--log-every", type=int, default=20, help="print the loss every N steps (with --verbose)")
    p.add_argument("--verbose", action="store_true", help="print losses while training (syncs at those steps)")
    args = p.parse_args(argv)
    smoke = args.smoke
    for name, full, tiny in (("steps", 150, 24), ("warmup", 5, 2), ("share_steps", 5, 2), ("seq", 4096, 64),
                             ("vocab", 32000, 128), ("lr", 1e-4, 1e-3)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if smoke else full)
    if args.impls is None:
        args.impls = "grouped_mm,mok,eager" if smoke else "grouped_mm,mok"
    args.impl_list = [s.strip() for s in args.impls.split(",") if s.strip()]
    args.model_list = [s.strip() for s in args.models.split(",") if s.strip()]
    for m in args.model_list:
        if m not in ("qwen3", "dsv3"):
            p.error(f"model {m!r}; expected qwen3 and/or dsv3")
    if len(set(args.impl_list)) != len(args.impl_list) or not args.impl_list:
        p.error("--impls: a non-empty list without repeats")
    if args.steps - args.share_steps - args.warmup < 1:
        p.error("--steps must exceed --warmup + --share-steps")
    if args.steps < LAST_N:
        p.error(f"--steps must be at least {LAST_N}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import transformers
    except ImportError as exc:
        print(f"bench_e2e: transformers is not importable ({exc}); nothing to run.")
        return 2
    device, status = hz.bench_device("bench_e2e", args.device, args.smoke, "--smoke", "the full models are GPU-sized",
                                     threads=args.threads)
    if device is None:
        return status
    os.makedirs(args.out, exist_ok=True)
    out_json, out_png = os.path.join(args.out, "e2e.json"), os.path.join(args.out, "e2e.png")

    # mok's HF integration, where asked for
    mok_hf, mok_status = None, "not requested"
    if any(i in MOK_IMPLS for i in args.impl_list):
        mok_hf, why = import_mok_hf()
        mok_status = why or "importable"
        if mok_hf is not None:
            import mok
            mok_status += f" (mok {mok.__version__}, CUDA part {'built' if mok.has_cuda() else 'not built'})"
    specs = model_specs(args)
    doc: Dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"), "device": hz.device_name(device), "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "mok_hf": mok_status, "baseline": args.baseline,
        "parity_tolerance": PARITY_TOL,
        "settings": {"batch": args.batch, "seq": args.seq, "tokens_per_step": args.batch * args.seq,
                     "vocab": args.vocab, "steps": args.steps, "warmup": args.warmup, "share_steps": args.share_steps,
                     "lr": args.lr, "lr_warmup": args.lr_warmup, "weight_decay": args.weight_decay,
                     "clip": args.clip, "betas": [0.9, 0.95], "seed": args.seed, "dtype": "bfloat16",
                     "attn_implementation": "sdpa", "optimizer": "AdamW(fused)" if device.type == "cuda" else "AdamW",
                     "impls": args.impl_list, "smoke": args.smoke, "router_aux_loss": "off"},
        "method": METHOD, "models": []}
    print(f"bench_e2e: {doc['device']}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"impls {','.join(args.impl_list)}, {args.steps} steps ({args.warmup} warm-up, {args.share_steps} hooked), "
          f"{args.batch} x {args.seq} tokens, vocab {args.vocab}, mok HF integration: {mok_status}", flush=True)
    corpus_cpu = make_corpus(args.steps, args.batch, args.seq, args.vocab, args.seed)

    def write():
        with open(out_json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
            f.write("\n")

    for name in args.model_list:
        spec = specs[name]
        entry = {"name": name, "label": spec["label"], "family": spec["family"], "config": spec["config"],
                 "results": {}}
        doc["models"].append(entry)
        # The initial weights: built once, kept on the host
        try:
            torch.manual_seed(args.seed)
            t0 = time.perf_counter()
            model = build_model(spec, args.baseline if args.baseline in args.impl_list else args.impl_list[0], device)
            entry["params"] = param_counts(model)
            init_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            entry["init_s"] = time.perf_counter() - t0
            del model
        except Exception as exc:  # noqa: BLE001  (recorded; the exit status says it)
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-4000:]
            print(f"{name}: ERROR building the model: {entry['error']}", flush=True)
            write()
            continue
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        counts = entry["params"]
        print(f"{name}: {spec['label']}; {counts['total'] / 1e9:.3f} G parameters "
              f"({counts['experts'] / 1e9:.3f} G in experts, {counts['moe_blocks_count']} MoE blocks)", flush=True)
        corpus = corpus_cpu.to(device)
        for impl in args.impl_list:
            try:
                if impl in MOK_IMPLS and mok_hf is None:
                    raise RuntimeError(f"mok.integrations.hf {mok_status}")
                rec = run_impl(spec, impl, init_state, corpus, args, device, mok_hf)
            except Exception as exc:  # noqa: BLE001  (recorded; the exit status says it)
                rec = {"impl": impl, "status": "error", "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()[-4000:]}
                print(f"  {impl:>10}: ERROR {rec['error']}", flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            entry["results"][impl] = rec
            if rec.get("status") == "ok":
                print(f"  {impl:>10}: {rec['tokens_per_s']:.0f} tokens/s (median {rec['step_ms_median']:.2f} ms), "
                      f"MoE share {fmt(rec.get('moe_share'), '.1f', 100)}%, peak {rec['peak_mem_gb']:.2f} GB, "
                      f"loss {rec['first_loss']:.3f} -> {rec['final_loss']:.4f}, "
                      f"{rec['build_s']:.1f} s build + {rec['run_s']:.1f} s run", flush=True)
            compare(entry["results"], args.baseline)
            write()  # partial results survive an interrupted run
        del init_state, corpus
        gc.collect()
        plot(doc, out_png)

    # Verdicts, files, then the table last
    failures = []
    for m in doc["models"]:
        if "error" in m:
            failures.append(f"{m['name']}: {m['error']}")
        for impl, r in m["results"].items():
            if r.get("status") != "ok":
                failures.append(f"{m['name']}/{impl}: {r.get('error')}")
            elif r.get("parity_ok") is False:
                failures.append(f"{m['name']}/{impl}: loss parity (last {LAST_N}: {100 * r['loss_diff_last10']:.3f} %, "
                                f"final: {100 * r['loss_diff_final']:.3f} %; tolerance {100 * PARITY_TOL:.0f} %)")
    doc["ok"] = not failures
    doc["failures"] = failures
    write()
    why_not = plot(doc, out_png)
    print(f"\nwrote {out_json}" + (f" and {out_png}" if why_not is None else f"; no chart: {why_not}"))
    for f in failures:
        print(f"FAILED {f}")
    print()
    print(table(doc))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
