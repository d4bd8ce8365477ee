"""The layer at the sustained clock: every variant timed interleaved, after the GPU has been
under load for a while, so all of them see the same (power-capped) clock.

    python3 tools/sustained.py [shape] [--heat-s 3] [--rounds 20]
    python3 tools/sustained.py [shape] --gemm     # the backward's GEMM kinds, mok vs torch._grouped_mm
    python3 tools/sustained.py [shape] --fp8      # the block-scaled fp8 forward kinds, vs dense fp8 and bf16
    python3 tools/sustained.py [shape] --backward # the layer's backward, mok vs the torch autograd pipeline
    python3 tools/sustained.py [shape] --gemm --variants base,g4:MOK_TILE_N_GROUP=4,g16:MOK_TILE_N_GROUP=16
                                                  # mok under several knob settings, all interleaved

Variants (EP=1, one GPU, no shared expert, uniform routing): dense bf16 mm 8192^3, the
torch EP=1 pipeline (bench/baselines.torch_ep1_forward), the experts-only grouped GEMMs, and
mok's fused forward. After --heat-s seconds of back-to-back calls of all of them, --rounds
rounds each time one call of every variant (CUDA events, no synchronisation in between);
medians are printed with the dense-rate floor at the sustained matmul rate. bench/ times
each variant after its own warm-up; this tool removes that thermal bias from the ratios."""
import argparse
import os
import random
import re
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, ROOT)
from bench import baselines as bl  # noqa: E402
from bench.shapes import MODELS, SHAPES as BENCH_SHAPES  # noqa: E402
from mok import functional as F  # noqa: E402
import mok  # noqa: E402
from mok import ops  # noqa: E402

# The docs/benchmarks.md shapes by name (bench/shapes.py): (H, I, k, E_l, T)
SHAPES = {name: s.layer for name, s in {**BENCH_SHAPES, **MODELS}.items()}


def interleaved(variants, heat_s, rounds):
    """Median ms of each variant: heat_s seconds of back-to-back calls of all of them, then
    `rounds` rounds each timing one call of every variant (CUDA events), in an order shuffled
    per round (fixed seed), so that no variant always follows the same neighbour."""
    with torch.no_grad():
        for fn in variants.values():
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < heat_s:
            for fn in variants.values():
                fn()
            torch.cuda.synchronize()
        events = {name: [] for name in variants}
        order = list(variants.items())
        shuffle = random.Random(0).shuffle
        for _ in range(rounds):
            shuffle(order)
            for name, fn in order:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                events[name].append((s, e))
        torch.cuda.synchronize()
    return {name: sorted(s.elapsed_time(e) for s, e in ev)[len(ev) // 2] for name, ev in events.items()}


def gemm_kinds(args, H, I, k, E, T):
    """The backward's GEMM kinds at the sustained clock, mok and torch._grouped_mm interleaved:
    dgrad down (dy · W_down[e]), dgrad gate/up ([dg|du] · [W_gate; W_up][e]), wgrad down and
    wgrad gate/up (K-grouped over each expert's rows), uniform routing (T·k/E rows each)."""
    dev = torch.device("cuda")
    rows = T * k // E // 128 * 128
    M = rows * E
    g = torch.Generator(device=dev).manual_seed(0)
    bf = dict(device=dev, dtype=torch.bfloat16)
    dy = torch.randn(M, H, device=dev, generator=g).bfloat16()
    dgu = (torch.randn(M, 2 * I, device=dev, generator=g) / (2 * I) ** 0.5).bfloat16()
    x = torch.randn(M, H, device=dev, generator=g).bfloat16()
    act = torch.randn(M, I, device=dev, generator=g).bfloat16()
    wg = (torch.randn(E, I, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    wu = (torch.randn(E, I, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    wd = (torch.randn(E, H, I, device=dev, generator=g) / I ** 0.5).bfloat16()
    wgu = torch.cat([wg, wu], dim=1).contiguous()
    wd_t = wd.transpose(1, 2).contiguous()  # W_down stored transposed: [E, I, H], K = H contiguous
    block_expert = torch.arange(E, device=dev, dtype=torch.int32).repeat_interleave(rows // 128)
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * rows
    ex_off = torch.arange(E + 1, device=dev, dtype=torch.int32) * rows
    ex_cnt = torch.full((E,), rows, device=dev, dtype=torch.int32)
    da, dx, da_k = torch.empty(M, I, **bf), torch.empty(M, H, **bf), torch.empty(M, I, **bf)
    gwd, gwgu = torch.empty(E, H, I, **bf), torch.empty(E, 2 * I, H, **bf)
    h = torch.randn(M, 2 * I, device=dev, generator=g).bfloat16()
    rw = torch.rand(M, device=dev, generator=g)
    dh, wa = torch.empty(M, 2 * I, **bf), torch.empty(M, I, **bf)
    parts = torch.empty(M, I // 128, device=dev, dtype=torch.float32)

    def torch_dgrad_swiglu():
        # torch._grouped_mm, then the SwiGLU backward and <da, a> in eager torch
        da_t = torch._grouped_mm(dy, wd, offs=offs).float()
        gg, uu = h.float().chunk(2, dim=1)
        sg = torch.sigmoid(gg)
        sl = gg * sg
        a = (sl * uu).bfloat16().float()
        dtw = (da_t * a).sum(1)
        daw = da_t * rw[:, None]
        return torch.cat([daw * uu * sg * (1 + gg * (1 - sg)), daw * sl], 1).bfloat16(), (rw[:, None] * a).bfloat16(), dtw

    mm_a = torch.randn(8192, 8192, device=dev, generator=g).bfloat16()
    mm_b = torch.randn(8192, 8192, device=dev, generator=g).bfloat16()
    kinds = {
        "dgrad down": (2 * M * H * I,
                       lambda: ops.grouped_mm(dy, wd, block_expert, out=da, kind="dgrad_down"),
                       lambda: torch._grouped_mm(dy, wd, offs=offs)),
        # The same product with B K-major (W_down stored transposed: the down kind's tiles), the
        # orientation the transposed policy's dgrad reads
        "dgrad down B K-major": (2 * M * H * I,
                                 lambda: ops.grouped_mm(dy, wd_t, block_expert, out=da_k, kind="down"),
                                 lambda: torch._grouped_mm(dy, wd, offs=offs)),
        "dgrad gate/up": (4 * M * H * I,
                          lambda: ops.grouped_mm(dgu, wg, block_expert, wu, out=dx, kind="dgrad_gate_up"),
                          lambda: torch._grouped_mm(dgu, wgu, offs=offs)),
        "dgrad dn+swiglu": (2 * M * H * I,
                            lambda: ops.grouped_mm(dy, wd, block_expert, out=dh, kind="dgrad_down_swiglu", h=h,
                                                   row_weight=rw, wa=wa, dtw_partials=parts),
                            torch_dgrad_swiglu),
        "wgrad down": (2 * M * H * I,
                       lambda: ops.grouped_wgrad(dy, act, ex_off, ex_cnt, out=gwd),
                       lambda: torch._grouped_mm(dy.t(), act, offs=offs)),
        "wgrad gate/up": (4 * M * H * I,
                          lambda: ops.grouped_wgrad(dgu, x, ex_off, ex_cnt, out=gwgu),
                          lambda: torch._grouped_mm(dgu.t(), x, offs=offs)),
    }
    knobs = parse_variants(args.variants)
    variants = {"dense mm 8192^3": lambda: torch.mm(mm_a, mm_b)}
    for name, (_, mok_fn, torch_fn) in kinds.items():
        for vname, env in knobs.items():
            variants[f"mok[{vname}] " + name] = with_env(env, mok_fn)
        variants["torch " + name] = torch_fn
    # Every variant's output equals the base variant's (the knobs change the schedule, not the bits)
    outs = {"dgrad down": da, "dgrad down B K-major": da_k, "dgrad gate/up": dx, "dgrad dn+swiglu": dh, "wgrad down": gwd, "wgrad gate/up": gwgu}
    for name, (_, mok_fn, _) in kinds.items():
        ref = None
        for vname, env in knobs.items():
            outs[name].fill_(float("nan"))
            with_env(env, mok_fn)()
            got = outs[name].clone()
            if ref is None:
                ref = got
            elif not torch.equal(got, ref):
                raise SystemExit(f"{name}: variant {vname} differs from {next(iter(knobs))}")
    if not torch.equal(da, da_k):
        raise SystemExit("dgrad down: B K-major differs from B N-major")
    ms = interleaved(variants, args.heat_s, args.rounds)
    dense = 2 * 8192 ** 3 / ms["dense mm 8192^3"] / 1e9
    print(f"{args.shape} GEMM kinds, sustained ({args.heat_s:.0f} s of load first, {args.rounds} interleaved rounds); "
          f"dense mm {dense:.0f} TFLOP/s; {E} experts x {rows} rows; variants {args.variants}")
    for name, (flops, _, _) in kinds.items():
        t = ms["torch " + name]
        for vname in knobs:
            m = ms[f"mok[{vname}] " + name]
            print(f"  {name:15} {vname:8} mok {m:.3f} ms ({flops / m / 1e9:.0f} TFLOP/s, "
                  f"{flops / m / 1e9 / dense:.2f} of dense)  torch {t:.3f} ms  torch/mok {t / m:.3f}")


def gemm_fp8(args, H, I, k, E, T):
    """The block-scaled fp8 forward kinds (ops.grouped_mm_fp8, DeepSeek-V3's recipe) at the
    sustained clock, interleaved with: the dense fp8 and bf16 8192^3 matmuls (torch._scaled_mm
    with per-tensor scales, torch.mm), mok's bf16 kinds, and torch._scaled_grouped_mm (rowwise
    scales) where this torch has it.  Uniform routing (T·k/E rows per expert); fp8 operands and
    scales from mok.fp8's quantisers (not timed: the layer will quantise inside its kernels)."""
    from mok import fp8
    dev = torch.device("cuda")
    rows = T * k // E // 128 * 128
    M = rows * E
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, H, device=dev, generator=g).bfloat16()
    act = torch.randn(M, I, device=dev, generator=g).bfloat16()
    wg = (torch.randn(E, I, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    wu = (torch.randn(E, I, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    wd = (torch.randn(E, H, I, device=dev, generator=g) / I ** 0.5).bfloat16()
    be = torch.arange(E, device=dev, dtype=torch.int32).repeat_interleave(rows // 128)
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * rows
    (qx, sx), (qa, sa) = fp8.quantize_rows(x), fp8.quantize_rows(act)
    (qg, sg), (qu, su), (qd, sd) = fp8.quantize_blocks(wg), fp8.quantize_blocks(wu), fp8.quantize_blocks(wd)
    bf = dict(device=dev, dtype=torch.bfloat16)
    y_gu8, y_d8, y_gu, y_d = torch.empty(M, I, **bf), torch.empty(M, H, **bf), torch.empty(M, I, **bf), torch.empty(M, H, **bf)
    mm_a = torch.randn(8192, 8192, device=dev, generator=g).bfloat16()
    mm_b = torch.randn(8192, 8192, device=dev, generator=g).bfloat16()
    one = torch.ones((), device=dev)
    mm_a8, mm_b8 = mm_a.to(torch.float8_e4m3fn), mm_b.to(torch.float8_e4m3fn)
    knobs = parse_variants(args.variants)
    fp8_kinds = {"gate/up": lambda: ops.grouped_mm_fp8(qx, sx, qg, sg, be, qu, su, out=y_gu8, kind="gate_up"),
                 "down": lambda: ops.grouped_mm_fp8(qa, sa, qd, sd, be, out=y_d8)}
    # The dgrad kinds on the weights' transposed copies with their own scales (b_transposed):
    # da = dy · W_down (B = W_downᵀ [E, I, H], K = H) and dx = dh · [W_gate; W_up] (B = [W_gateᵀ |
    # W_upᵀ] [E, H, 2I], K = 2I: the gate k-blocks, then the up ones, their scales stacked so)
    if mok._lib.has_symbol("mokQuantizeWeights"):
        fw = mok.quantize_weights(wg, wu, wd)
        qt_gu = torch.cat([fw["w_gate"].qt, fw["w_up"].qt], 2).contiguous()
        st_gu = torch.cat([fw["w_gate"].scales, fw["w_up"].scales], 1).contiguous()
        qdh, sdh = fp8.quantize_rows(torch.cat([act, act], 1))
        y_da8, y_dx8 = torch.empty(M, I, **bf), torch.empty(M, H, **bf)
        fp8_kinds["dgrad down"] = lambda: ops.grouped_mm_fp8(qx, sx, fw["w_down"].qt, fw["w_down"].scales, be,
                                                             out=y_da8, b_transposed=True)
        fp8_kinds["dgrad gate/up"] = lambda: ops.grouped_mm_fp8(qdh, sdh, qt_gu, st_gu, be, out=y_dx8,
                                                                b_transposed=True)
        if mok._lib.has_symbol("mokGroupedWgradBlockScaled"):
            # The backward's own forms (C ABI 0.6): dgrad gate/up on the two transposed copies (a
            # K split, no stacked copy), and dgrad down with the SwiGLU backward writing dh in e4m3
            y_dx8s = torch.empty(M, H, **bf)
            fp8_kinds["dgrad gate/up split"] = lambda: ops.dgrad_gate_up_fp8(
                qdh, sdh, fw["w_gate"].qt, fw["w_gate"].scales, fw["w_up"].qt, fw["w_up"].scales, be, out=y_dx8s)
            h_saved = torch.randn(M, 2 * I, device=dev, generator=g).bfloat16()
            rw = torch.rand(M, device=dev, generator=g)
            fp8_kinds["dgrad down swiglu"] = lambda: ops.dgrad_down_swiglu_fp8(
                qx, sx, fw["w_down"].qt, fw["w_down"].scales, be, h_saved, rw)
    # The wgrad kind (K-grouped over each expert's rows, both operands per channel and 128 rows,
    # transposed): dW_down = (w·dy)ᵀ · a (Mo = H, No = I) and [dW_gate; dW_up] = [dg | du]ᵀ · x
    # (Mo = 2I, No = H); the rows' operands from quantize_cols (not timed: the epilogues will
    # write them)
    if mok._lib.has_symbol("mokGroupedWgradBlockScaled"):
        cnt = torch.full((E,), rows, device=dev, dtype=torch.int32)
        off = torch.arange(E + 1, device=dev, dtype=torch.int32) * rows
        (qxt, sxt), (qat, sat) = ops.quantize_cols_fp8(x), ops.quantize_cols_fp8(act)
        (qdyt, sdyt), (qdht, sdht) = ops.quantize_cols_fp8(x), ops.quantize_cols_fp8(torch.cat([act, act], 1))
        dwd, dwgu = torch.empty(E, H, I, **bf), torch.empty(E, 2 * I, H, **bf)
        fp8_kinds["wgrad down"] = lambda: ops.grouped_wgrad_fp8(qdyt, sdyt, qat, sat, off, cnt, out=dwd)
        fp8_kinds["wgrad gate/up"] = lambda: ops.grouped_wgrad_fp8(qdht, sdht, qxt, sxt, off, cnt, out=dwgu)
    variants = {
        "dense bf16 8192^3": lambda: torch.mm(mm_a, mm_b),
        "dense fp8 8192^3": lambda: torch._scaled_mm(mm_a8, mm_b8.t(), one, one, out_dtype=torch.bfloat16),
        "mok bf16 gate/up": lambda: ops.grouped_mm(x, wg, be, wu, out=y_gu),
        "mok bf16 down": lambda: ops.grouped_mm(act, wd, be, out=y_d),
    }
    for vname, env in knobs.items():
        for name, fn in fp8_kinds.items():
            variants[f"mok[{vname}] fp8 {name}"] = with_env(env, fn)
    # Every knob's fp8 output equals the first's (the tile changes the schedule, not the bits)
    outs = {"gate/up": y_gu8, "down": y_d8}
    if "wgrad down" in fp8_kinds:
        outs.update({"wgrad down": dwd, "wgrad gate/up": dwgu})
    if "dgrad down" in fp8_kinds:
        outs.update({"dgrad down": y_da8, "dgrad gate/up": y_dx8})
    if "dgrad gate/up split" in fp8_kinds:
        outs["dgrad gate/up split"] = y_dx8s
        variants["mok quantise weights"] = lambda: mok.quantize_weights(wg, wu, wd)
    for name, out in outs.items():
        ref = None
        for vname, env in knobs.items():
            out.fill_(float("nan"))
            with_env(env, fp8_kinds[name])()
            if ref is None:
                ref = out.clone()
            elif not torch.equal(out, ref):  # reported, not fatal: the timing still counts
                print(f"  fp8 {name}: variant {vname} differs from {next(iter(knobs))} (not bit for bit)")
    if "dgrad gate/up split" in fp8_kinds:
        fp8_kinds["dgrad gate/up"]()
        fp8_kinds["dgrad gate/up split"]()
        print(f"  dgrad gate/up on the two copies equals the stacked copy's, bit for bit: {torch.equal(y_dx8, y_dx8s)}")
    # What a separate quantisation pass costs (mok.fp8's torch quantisers; the layer will
    # quantise inside its kernels instead): x [M, H] and a [M, I] per row and 128 channels
    variants["torch quantise x rows"] = lambda: fp8.quantize_rows(x)
    variants["torch quantise a rows"] = lambda: fp8.quantize_rows(act)
    qx_buf, sx_buf = torch.empty_like(qx), torch.empty_like(sx)
    variants["mok quantise x rows"] = lambda: ops.quantize_rows_fp8(x, qx_buf, sx_buf)
    # The wgrad operands' column quantiser on x (every knob: its kernel may be one)
    qcols = {}
    if mok._lib.has_symbol("mokGroupedWgradBlockScaled"):
        qxt_buf, sxt_buf = torch.empty(H, M, dtype=torch.float8_e4m3fn, device=dev), torch.empty(M // 128, H, device=dev)
        for vname, env in knobs.items():
            fn = with_env(env, lambda: ops.quantize_cols_fp8(x, qxt_buf, sxt_buf))
            variants[f"mok[{vname}] quantise x cols"] = fn
            qxt_buf.view(torch.uint8).fill_(0xFF)
            fn()
            got = (qxt_buf.view(torch.uint8).clone(), sxt_buf.clone())
            if qcols and not (torch.equal(got[0], next(iter(qcols.values()))[0]) and
                              torch.equal(got[1], next(iter(qcols.values()))[1])):
                print(f"  quantise x cols: variant {vname} differs (not bit for bit)")
            qcols[vname] = got
    # The experts' chain, launch after launch: fp8 (x quantised, gate/up writing a in e4m3 for
    # down, down) against bf16 (gate/up, down): the forward's GEMM work in each precision
    qa_buf, sa_buf = torch.empty(M, I, dtype=torch.float8_e4m3fn, device=dev), torch.empty(I // 128, M, device=dev)

    def fp8_chain():
        ops.quantize_rows_fp8(x, qx_buf, sx_buf)
        ops.grouped_mm_fp8(qx_buf, sx_buf, qg, sg, be, qu, su, out=qa_buf, quantize_out=True, out_scales=sa_buf)
        ops.grouped_mm_fp8(qa_buf, sa_buf, qd, sd, be, out=y_d8)

    def bf16_chain():
        ops.grouped_mm(x, wg, be, wu, out=y_gu)
        ops.grouped_mm(y_gu, wd, be, out=y_d)
    variants["mok fp8 experts chain"] = fp8_chain
    variants["mok bf16 experts chain"] = bf16_chain
    # The layer's forward in each precision (the bar: fp8_block >= 1.5x bf16), routed by
    # a softmax top-k over T tokens; inference (no h kept) and training (h kept for the backward)
    xt = torch.randn(T, H, device=dev, generator=g).bfloat16()
    tw, ids = torch.randn(T, E, device=dev, generator=g).softmax(-1).topk(k, dim=-1)
    ids = ids.int()
    dyt = (torch.randn(T, H, device=dev, generator=g) * 0.1).bfloat16()
    layer = {}
    for prec in ("bf16", "fp8_block"):
        lws = F.create_workspace(H, I, E, k, max_tokens=T, device="cuda", config=F.MoKConfig(precision=prec))
        layer[prec] = (lambda w: lambda save: F.forward(xt, ids, tw, wg, wu, wd, workspace=w, save_for_backward=save)[0])(lws)
        variants[f"mok {prec} layer fwd"] = (lambda f: lambda: f(False))(layer[prec])
        variants[f"mok {prec} layer fwd +save h"] = (lambda f: lambda: f(True))(layer[prec])
        # forward (saving h) + backward: the second bar (fp8_block >= 1.4x bf16)
        variants[f"mok {prec} layer fwd+bwd"] = (lambda w: lambda: F.backward(
            F.forward(xt, ids, tw, wg, wu, wd, workspace=w, save_for_backward=True)[1], dyt))(lws)
        # the other choice of what the backward keeps: nothing (h recomputed by the replay kind)
        variants[f"mok {prec} layer fwd+bwd (recompute h)"] = (lambda w: lambda: (
            F.forward(xt, ids, tw, wg, wu, wd, workspace=w, save_for_backward=False),
            F.backward(F.recompute_forward_context(xt, ids, tw, wg, wu, wd, workspace=w), dyt)))(lws)
        saved = F.forward(xt, ids, tw, wg, wu, wd, workspace=lws, save_for_backward=True)[1].saved
        kept = sum(t.numel() * t.element_size() for t in saved if t is not None)
        print(f"  {prec}: the training forward keeps h, {kept / 2**20:.1f} MiB ({kept / T / 1024:.1f} KiB a token)")
    # fp8_block's forward + backward under each further knob set (--variants), its gradients
    # checked bit for bit against the first's
    fb8 = variants["mok fp8_block layer fwd+bwd"]
    for vname, env in list(knobs.items())[1:]:
        variants[f"mok fp8_block layer fwd+bwd [{vname}]"] = with_env(env, fb8)
        a, b = fb8(), with_env(env, fb8)()
        same = all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("dx", "d_topk_weights", "w_gate", "w_up", "w_down"))
        print(f"  fp8_block fwd+bwd [{vname}]: gradients {'bit for bit' if same else 'DIFFER from'} the first knob set's")
    # fp8_block's forward as launches (MOK_FORWARD_PATH=unfused: the same tiles), against the
    # megakernel's fp8 policy above
    variants["mok fp8_block layer fwd (launches)"] = with_env({"MOK_FORWARD_PATH": "unfused"},
                                                               lambda: layer["fp8_block"](False))
    if hasattr(torch, "_scaled_grouped_mm"):  # torch's fp8 layer forward (rowwise, weights quantised once)
        fw8 = bl.torch_fp8_weights(wg, wu, wd)
        variants["torch fp8 layer fwd (rowwise)"] = lambda: bl.torch_fp8_forward(xt, ids, tw, fw8)
    y16, y8 = layer["bf16"](False), layer["fp8_block"](False)
    print(f"  fp8_block layer forward against bf16: relative Frobenius difference "
          f"{((y8.float() - y16.float()).norm() / y16.float().norm()).item():.2e}")
    if hasattr(torch, "_scaled_grouped_mm"):
        # rowwise: a scale per row of the activations and per output column of each expert
        def rowwise(t):
            s = t.float().abs().amax(-1).clamp(min=1e-12) / fp8.E4M3_MAX
            return (t.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn), s
        (rx, rsx), (ra, rsa) = rowwise(x), rowwise(act)
        (rgu, rsgu), (rd, rsd) = rowwise(torch.cat([wg, wu], 1)), rowwise(wd)
        variants["torch rowwise fp8 gate/up"] = lambda: torch._scaled_grouped_mm(
            rx, rgu.transpose(-2, -1), rsx, rsgu, offs=offs, out_dtype=torch.bfloat16)
        variants["torch rowwise fp8 down"] = lambda: torch._scaled_grouped_mm(
            ra, rd.transpose(-2, -1), rsa, rsd, offs=offs, out_dtype=torch.bfloat16)
    # fp8 against bf16 on the same inputs: the recipe's error, reported (docs/precision.md)
    fp8_kinds["gate/up"]()
    fp8_kinds["down"]()
    variants["mok bf16 gate/up"]()
    variants["mok bf16 down"]()
    for name, a8, a16 in (("gate/up", y_gu8, y_gu), ("down", y_d8, y_d)):
        rel = ((a8.float() - a16.float()).norm() / a16.float().norm()).item()
        print(f"  fp8 {name} against bf16: relative Frobenius difference {rel:.2e}")
    for name, fn in list(variants.items()):
        try:
            fn()
        except Exception as e:  # a torch without that fp8 path on this card: reported, not timed
            print(f"  {name}: not timed ({type(e).__name__}: {e})")
            del variants[name]
    ms = interleaved(variants, args.heat_s, args.rounds)
    dense16 = 2 * 8192 ** 3 / ms["dense bf16 8192^3"] / 1e9
    dense8 = 2 * 8192 ** 3 / ms["dense fp8 8192^3"] / 1e9 if "dense fp8 8192^3" in ms else float("nan")
    print(f"{args.shape} fp8 GEMM kinds, sustained ({args.heat_s:.0f} s of load first, {args.rounds} interleaved "
          f"rounds); dense fp8 {dense8:.0f} TFLOP/s, bf16 {dense16:.0f}; {E} experts x {rows} rows")
    flops = {"gate/up": 4 * M * H * I, "down": 2 * M * H * I, "dgrad down": 2 * M * H * I,
             "dgrad gate/up": 4 * M * H * I, "dgrad gate/up split": 4 * M * H * I, "dgrad down swiglu": 2 * M * H * I,
             "wgrad down": 2 * M * H * I, "wgrad gate/up": 4 * M * H * I}
    for name, f in flops.items():
        if name not in fp8_kinds:
            continue
        m16 = ms.get(f"mok bf16 {name}")
        for vname in knobs:
            m8 = ms[f"mok[{vname}] fp8 {name}"]
            line = (f"  {name:13} {vname:6} mok fp8 {m8:.3f} ms ({f / m8 / 1e9:.0f} TFLOP/s, "
                    f"{f / m8 / 1e9 / dense8:.2f} of dense fp8)")
            if m16 is not None:
                line += f"  mok bf16 {m16:.3f} ms (bf16/fp8 {m16 / m8:.2f})"
            if f"torch rowwise fp8 {name}" in ms:
                t = ms[f"torch rowwise fp8 {name}"]
                line += f"  torch rowwise fp8 {t:.3f} ms (torch/mok {t / m8:.2f})"
            print(line)
    print(f"  separate quantisation passes (torch): x {ms['torch quantise x rows']:.3f} ms, "
          f"a {ms['torch quantise a rows']:.3f} ms; mok's one-kernel quantiser, x {ms['mok quantise x rows']:.3f} ms "
          f"({M * H * 3 / ms['mok quantise x rows'] / 1e6:.0f} GB/s)")
    for vname in qcols:
        t = ms[f"mok[{vname}] quantise x cols"]
        print(f"  quantise x cols [{vname}]: {t:.3f} ms ({M * H * 3 / t / 1e6:.0f} GB/s)")
    if "mok quantise weights" in ms:
        wbytes = 3 * E * H * I * (2 + 1 + 1)  # bf16 read, q and qt written
        print(f"  weights quantised (q and qt, every routed weight): {ms['mok quantise weights']:.3f} ms "
              f"({wbytes / ms['mok quantise weights'] / 1e6:.0f} GB/s)")
    f8, b16 = ms["mok fp8 experts chain"], ms["mok bf16 experts chain"]
    print(f"  experts chain (quantise x, gate/up -> a in e4m3, down): fp8 {f8:.3f} ms, bf16 {b16:.3f} ms, "
          f"bf16/fp8 {b16 / f8:.2f}")
    for tag in ("", " +save h"):
        f8, b16 = ms[f"mok fp8_block layer fwd{tag}"], ms[f"mok bf16 layer fwd{tag}"]
        print(f"  layer forward{tag}: fp8_block {f8:.3f} ms, bf16 {b16:.3f} ms, bf16/fp8 {b16 / f8:.2f}")
    if "mok fp8_block layer fwd (launches)" in ms:
        fl, f8 = ms["mok fp8_block layer fwd (launches)"], ms["mok fp8_block layer fwd"]
        print(f"  layer forward, fp8_block as launches: {fl:.3f} ms, launches / megakernel {fl / f8:.2f}")
    if "torch fp8 layer fwd (rowwise)" in ms:
        t8 = ms["torch fp8 layer fwd (rowwise)"]
        print(f"  layer forward, torch's rowwise fp8 pipeline: {t8:.3f} ms, torch fp8 / mok fp8_block "
              f"{t8 / ms['mok fp8_block layer fwd']:.2f}")
    if "mok fp8_block layer fwd+bwd" in ms:
        f8, b16 = ms["mok fp8_block layer fwd+bwd"], ms["mok bf16 layer fwd+bwd"]
        print(f"  layer forward+backward: fp8_block {f8:.3f} ms, bf16 {b16:.3f} ms, bf16/fp8 {b16 / f8:.2f}")
        for vname in list(knobs)[1:]:
            v8 = ms[f"mok fp8_block layer fwd+bwd [{vname}]"]
            print(f"  layer forward+backward [{vname}]: fp8_block {v8:.3f} ms ({v8 / f8:.3f} of the first knob set's)")
        r8, r16 = ms["mok fp8_block layer fwd+bwd (recompute h)"], ms["mok bf16 layer fwd+bwd (recompute h)"]
        print(f"  layer forward+backward, h recomputed: fp8_block {r8:.3f} ms ({r8 / f8:.3f} of h saved), "
              f"bf16 {r16:.3f} ms ({r16 / b16:.3f}), bf16/fp8 {r16 / r8:.2f}")


def backward_rows(args, H, I, k, E, T):
    """The layer's backward at the sustained clock: the torch EP=1 autograd backward (its graph
    kept, retain_graph) and forward+backward, torch's bare backward GEMMs (dgrad and wgrad of
    both, _grouped_mm), and mok's backward and forward+backward, interleaved."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=g).bfloat16()
    dy = (torch.randn(T, H, device=dev, generator=g) * 0.1).bfloat16()
    tw, ids = torch.randn(T, E, device=dev, generator=g).softmax(-1).topk(k, dim=-1)
    ids = ids.int()
    tw = tw / tw.sum(-1, keepdim=True)
    wg = (torch.randn(E, I, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    wu = (torch.randn(E, I, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    wd = (torch.randn(E, H, I, device=dev, generator=g) / I ** 0.5).bfloat16()
    wgu = torch.cat([wg, wu], dim=1).contiguous()
    leaves = [t.clone().requires_grad_() for t in (x, tw, wgu, wd)]

    def torch_forward():
        xl, twl, wgul, wdl = leaves
        return bl.torch_ep1_forward(xl, ids, twl, None, None, wdl, w_gateup=wgul)

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.enable_grad():
        y_graph = torch_forward()
    torch.cuda.synchronize()
    torch_kept = torch.cuda.memory_allocated() - before - y_graph.numel() * y_graph.element_size()

    def torch_forward_grad():
        with torch.enable_grad():
            return torch_forward()

    def torch_bwd():
        with torch.enable_grad():
            return torch.autograd.grad(y_graph, leaves, dy, retain_graph=True)

    def torch_fb():
        with torch.enable_grad():
            return torch.autograd.grad(torch_forward(), leaves, dy)

    perm, token, offs, _ = bl.route_plan(ids, E)
    M = token.numel()
    dgu = (torch.randn(M, 2 * I, device=dev, generator=g) / (2 * I) ** 0.5).bfloat16()
    dy_rows, x_rows = dy.index_select(0, token), x.index_select(0, token)
    act = torch.randn(M, I, device=dev, generator=g).bfloat16()

    def torch_gemms():
        torch._grouped_mm(dy_rows, wd, offs=offs)
        torch._grouped_mm(dgu, wgu, offs=offs)
        torch._grouped_mm(dy_rows.t(), act, offs=offs)
        torch._grouped_mm(dgu.t(), x_rows, offs=offs)

    ws = F.create_workspace(H, I, E, k, max_tokens=T, device="cuda")
    ctx = F.recompute_forward_context(x, ids, tw, wg, wu, wd, workspace=ws)
    _, saved_ctx = F.forward(x, ids, tw, wg, wu, wd, workspace=ws)  # the training forward's saved h

    def mok_fb(w=ws):
        _, c = F.forward(x, ids, tw, wg, wu, wd, workspace=w)
        return F.backward(c, dy)

    # The ring holding every routed row (one macrobatch: no fp32 partial sums between them):
    # MACROBATCH_ALL_ROWS, the recommended training configuration (until session 12 this row
    # used minibatch_size = 2048 and the ring rounded up to it)
    ws_all = F.create_workspace(H, I, E, k, max_tokens=T, device="cuda",
                                config=F.MoKConfig(macrobatch_size=F.MACROBATCH_ALL_ROWS))
    ring = ws_all.c_config().macrobatch_size
    _, saved_all = F.forward(x, ids, tw, wg, wu, wd, workspace=ws_all)

    # Transposed weights (column-major copies: HF's is_transposed layout) through the fused
    # kernels' transposed policy, the ring for every row; their gradients written transposed
    def col_major(t):
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)

    wgT, wuT, wdT = col_major(wg), col_major(wu), col_major(wd)
    _, saved_all_t = F.forward(x, ids, tw, wgT, wuT, wdT, workspace=ws_all)
    grads_t = {n: col_major(torch.empty_like(t)) for n, t in (("w_gate", wg), ("w_up", wu), ("w_down", wd))}

    def mok_fb_t():
        _, c = F.forward(x, ids, tw, wgT, wuT, wdT, workspace=ws_all)
        return F.backward(c, dy, grads_out=grads_t)

    fwd_mini, fwd_macro = map(int, re.search(r"minibatch_size\s*=\s*(\d+) rows, macrobatch_size = (\d+)",
                                             ws.describe()).groups())
    print(f"{args.shape}: minibatch {fwd_mini} rows, macrobatch {fwd_macro} rows (the forward's)")
    mm_a = torch.randn(8192, 8192, device=dev, generator=g).bfloat16()
    mm_b = torch.randn(8192, 8192, device=dev, generator=g).bfloat16()
    variants = {
        "dense mm 8192^3": lambda: torch.mm(mm_a, mm_b),
        "torch EP=1 bwd": torch_bwd,
        "torch EP=1 fwd+bwd": torch_fb,
        "torch bwd GEMMs": torch_gemms,
        "mok bwd": lambda: F.backward(saved_ctx, dy),
        "mok bwd (recompute h)": lambda: F.backward(ctx, dy),
        "mok fwd+bwd": mok_fb,
        f"mok bwd ring={ring}": lambda: F.backward(saved_all, dy),
        f"mok fwd+bwd ring={ring}": lambda: mok_fb(ws_all),
        # The same tiles as separate launches (MOK_BACKWARD_PATH=unfused): the fused kernel's gain
        "mok bwd unfused": with_env({"MOK_BACKWARD_PATH": "unfused"}, lambda: F.backward(saved_ctx, dy)),
        # The fused backward with the forward's minibatch (before its own rule)
        "mok bwd mini=fwd": with_env({"MOK_BACKWARD_MINIBATCH": str(fwd_mini)}, lambda: F.backward(saved_ctx, dy)),
        "torch EP=1 fwd (graph kept)": lambda: torch_forward_grad(),
        "mok fwd (save h)": lambda: F.forward(x, ids, tw, wg, wu, wd, workspace=ws)[0],
        "mok fwd+bwd unfused": with_env({"MOK_BACKWARD_PATH": "unfused"}, mok_fb),
        f"mok bwd ring={ring} transposed": lambda: F.backward(saved_all_t, dy, grads_out=grads_t),
        f"mok fwd+bwd ring={ring} transposed": mok_fb_t,
        f"mok fwd ring={ring}": lambda: F.forward(x, ids, tw, wg, wu, wd, workspace=ws_all)[0],
        f"mok fwd ring={ring} transposed": lambda: F.forward(x, ids, tw, wgT, wuT, wdT, workspace=ws_all)[0],
    }
    if args.explore:
        # The noise floor of the A/Bs: the same calls again, interleaved with the others
        variants.update({
            "mok bwd (repeat)": lambda: F.backward(saved_ctx, dy),
            f"mok bwd ring={ring} (repeat)": lambda: F.backward(saved_all, dy),
            f"mok fwd ring={ring}": lambda: F.forward(x, ids, tw, wg, wu, wd, workspace=ws_all)[0],
        })
    if args.explore_v5:
        # Session 12's knobs: the start gather of every block (0: none, as before; 2
        # minibatches), minibatch and ring
        bwd = lambda: F.backward(saved_ctx, dy)  # noqa: E731
        fwd = lambda: F.forward(x, ids, tw, wg, wu, wd, workspace=ws)[0]  # noqa: E731
        old = {"MOK_BACKWARD_START_GATHER": "0", "MOK_FORWARD_START_GATHER": "0"}
        variants.update({
            "mok bwd start=0": with_env({"MOK_BACKWARD_START_GATHER": "0"}, bwd),
            "mok bwd start=2": with_env({"MOK_BACKWARD_START_GATHER": "2"}, bwd),
            "mok fwd (save h) start=0": with_env({"MOK_FORWARD_START_GATHER": "0"}, fwd),
            "mok fwd+bwd start=0": with_env(old, mok_fb),
            "mok bwd start=4": with_env({"MOK_BACKWARD_START_GATHER": "4"}, bwd),
            "mok bwd start=all": with_env({"MOK_BACKWARD_START_GATHER": "1024"}, bwd),
            "mok bwd mini=ring/2": with_env({"MOK_BACKWARD_MINIBATCH": str(fwd_macro // 2)}, bwd),
            "mok bwd mini=ring": with_env({"MOK_BACKWARD_MINIBATCH": str(fwd_macro)}, bwd),
            f"mok bwd ring={ring} start=2": with_env({"MOK_BACKWARD_START_GATHER": "2"},
                                                    lambda: F.backward(saved_all, dy)),
            f"mok bwd ring={ring} unfused": with_env({"MOK_BACKWARD_PATH": "unfused"},
                                                    lambda: F.backward(saved_all, dy)),
            f"mok fwd+bwd ring={ring} start=2": with_env({"MOK_BACKWARD_START_GATHER": "2"}, lambda: mok_fb(ws_all)),
            f"mok fwd ring={ring}": lambda: F.forward(x, ids, tw, wg, wu, wd, workspace=ws_all)[0],
            f"mok bwd ring={ring} start=2 mini=ring": with_env(
                {"MOK_BACKWARD_START_GATHER": "2", "MOK_BACKWARD_MINIBATCH": str(ring)}, lambda: F.backward(saved_all, dy)),
            f"mok fwd+bwd ring={ring} start=2 mini=ring": with_env(
                {"MOK_BACKWARD_START_GATHER": "2", "MOK_BACKWARD_MINIBATCH": str(ring)}, lambda: mok_fb(ws_all)),
        })
    if args.explore_gather:
        # The raster knob of the fused backward (session 11, docs/perf.md)
        variants.update({
            "mok bwd n_group=1": with_env({"MOK_TILE_N_GROUP": "1"}, lambda: F.backward(saved_ctx, dy)),
            "mok bwd n_group=4": with_env({"MOK_TILE_N_GROUP": "4"}, lambda: F.backward(saved_ctx, dy)),
        })
    # --variants name:ENV=VAL,...: the backward under those knobs (the ring for every row), after
    # checking its gradients equal the default's bit for bit
    if args.variants and args.variants != "base":
        ref = F.backward(saved_all, dy)
        for vname, env in parse_variants(args.variants).items():
            got = with_env(env, lambda: F.backward(saved_all, dy))()
            for name in ("dx", "d_topk_weights", "w_gate", "w_up", "w_down"):
                if not torch.equal(getattr(ref, name), getattr(got, name)):
                    raise SystemExit(f"mok backward: {name} differs under variant {vname}")
            variants[f"mok bwd ring={ring} [{vname}]"] = with_env(env, lambda: F.backward(saved_all, dy))
    a, b, c = F.backward(ctx, dy), F.backward(ctx, dy), F.backward(saved_ctx, dy)
    d = variants["mok bwd unfused"]()
    for name in ("dx", "d_topk_weights", "w_gate", "w_up", "w_down"):
        if not all(torch.equal(getattr(a, name), getattr(o, name)) for o in [b, c, d]):
            raise SystemExit(f"mok backward: {name} differs between two runs, with the saved h or unfused")
    e, f = F.backward(saved_all, dy), F.backward(saved_all_t, dy, grads_out=grads_t)
    for name in ("dx", "d_topk_weights", "w_gate", "w_up", "w_down"):
        if not torch.equal(getattr(e, name), getattr(f, name)):
            raise SystemExit(f"mok backward: {name} differs between row-major and transposed weights")
    ms = interleaved(variants, args.heat_s, args.rounds)
    dense = 2 * 8192 ** 3 / ms["dense mm 8192^3"] / 1e9
    flops = 12 * T * k * H * I  # dgrad + wgrad of the three projections
    floor = flops / (dense * 1e9)
    print(f"{args.shape} backward, sustained ({args.heat_s:.0f} s of load first, {args.rounds} interleaved rounds); "
          f"dense mm {dense:.0f} TFLOP/s -> backward floor {floor:.3f} ms (replay +{floor / 2:.3f})")
    for name in list(variants)[1:]:
        print(f"  {name:20} {ms[name]:.3f} ms")
    saved = saved_ctx.saved[0].numel() * 2 / T
    print(f"  activation memory kept between forward and backward, per token: mok {saved / 1024:.1f} KiB "
          f"(h = [g | u] of its routed rows, worst-case rows), torch autograd {torch_kept / T / 1024:.1f} KiB")
    for tag in ("", " unfused", f" ring={ring}"):
        print(f"  torch / mok{tag}: backward {ms['torch EP=1 bwd'] / ms['mok bwd' + tag]:.3f}   fwd+bwd "
              f"{ms['torch EP=1 fwd+bwd'] / ms['mok fwd+bwd' + tag]:.3f}   mok bwd / torch GEMMs "
              f"{ms['mok bwd' + tag] / ms['torch bwd GEMMs']:.3f}")


def parse_variants(text):
    """'base,g4:MOK_TILE_N_GROUP=4' -> {"base": {}, "g4": {"MOK_TILE_N_GROUP": "4"}}; ';' joins knobs."""
    out = {}
    for item in text.split(","):
        name, _, rest = item.partition(":")
        out[name] = dict(kv.split("=", 1) for kv in rest.split(";") if kv)
    return out


def with_env(env, fn):
    """fn run with the environment variables in env set (mok reads its knobs at each launch)."""
    if not env:
        return fn

    def run():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="dsv3")
    ap.add_argument("--heat-s", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--gemm", action="store_true", help="the backward's GEMM kinds instead of the forward")
    ap.add_argument("--backward", action="store_true", help="the layer's backward and forward+backward")
    ap.add_argument("--fp8", action="store_true", help="the block-scaled fp8 forward GEMM kinds")
    ap.add_argument("--explore", action="store_true",
                    help="with --backward: the default calls repeated (the noise floor of the A/Bs)")
    ap.add_argument("--explore-v5", action="store_true",
                    help="with --backward: session 12's variants (start gather, minibatch, ring)")
    ap.add_argument("--explore-gather", action="store_true",
                    help="with --backward: session 11's raster variants too")
    ap.add_argument("--minibatches", default="0",
                    help="forward: minibatch sizes of mok's workspaces timed side by side (0 = mok's choice)")
    ap.add_argument("--variants", default="base",
                    help="--gemm, --backward and the forward: name[:ENV=VAL[;ENV=VAL]],... knob settings of "
                         "mok timed side by side")
    args = ap.parse_args()
    H, I, k, E, T = SHAPES[args.shape]
    if args.gemm:
        return gemm_kinds(args, H, I, k, E, T)
    if args.fp8:
        return gemm_fp8(args, H, I, k, E, T)
    if args.backward:
        return backward_rows(args, H, I, k, E, T)
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
    variants = {
        "dense mm 8192^3": lambda: torch.mm(mm_a, mm_b),
        "torch EP=1 fwd": lambda: bl.torch_ep1_forward(x, ids, tw, wg, wu, wd, w_gateup=wgu),
        "experts only": lambda: bl.experts_only(a_rows, offs, wgu, wd, h_rows),
    }
    mok_names, first_y = [], None
    for mb in (int(v) for v in args.minibatches.split(",")):
        ws = F.create_workspace(H, I, E, k, max_tokens=T, device="cuda", config=F.MoKConfig(minibatch_size=mb))
        name = f"mok fused fwd mb={ws.c_config().minibatch_size}" + (" (mok's)" if mb == 0 else "")
        y = F.forward(x, ids, tw, wg, wu, wd, workspace=ws, save_for_backward=False)[0]
        if first_y is None:
            first_y = y.clone()
        elif not torch.equal(y, first_y):
            raise SystemExit(f"{name}: output differs from {mok_names[0]}")
        variants[name] = (lambda w: lambda: F.forward(x, ids, tw, wg, wu, wd, workspace=w,
                                                      save_for_backward=False)[0])(ws)
        mok_names.append(name)
        if mb == 0:  # the training forward: h = [g | u] kept for the backward
            variants[name + " +save h"] = (lambda w: lambda: F.forward(x, ids, tw, wg, wu, wd, workspace=w)[0])(ws)
            mok_names.append(name + " +save h")
            # --variants: mok's workspace under other knob settings (the same bits checked first)
            for vname, env in parse_variants(args.variants).items():
                if not env:
                    continue
                fwd = (lambda w: lambda: F.forward(x, ids, tw, wg, wu, wd, workspace=w, save_for_backward=False)[0])(ws)
                fwd_h = (lambda w: lambda: F.forward(x, ids, tw, wg, wu, wd, workspace=w)[0])(ws)
                if not torch.equal(with_env(env, fwd)(), first_y):
                    raise SystemExit(f"{vname}: output differs from {mok_names[0]}")
                variants[f"{name} {vname}"] = with_env(env, fwd)
                variants[f"{name} +save h {vname}"] = with_env(env, fwd_h)
                mok_names += [f"{name} {vname}", f"{name} +save h {vname}"]
    ms = interleaved(variants, args.heat_s, args.rounds)
    mm_tflops = 2 * 8192 ** 3 / ms["dense mm 8192^3"] / 1e9
    flops = 6 * T * k * H * I
    floor = flops / (mm_tflops * 1e9)
    print(f"{args.shape}, sustained ({args.heat_s:.0f} s of load first, {args.rounds} interleaved rounds):")
    print(f"  dense mm rate {mm_tflops:.0f} TFLOP/s -> layer floor {floor:.3f} ms")
    for name in ["torch EP=1 fwd", "experts only"] + mok_names:
        print(f"  {name:16} {ms[name]:.3f} ms  ({flops / ms[name] / 1e9:.0f} TFLOP/s, {ms[name] / floor:.2f}x floor)")
    for name in mok_names:
        print(f"  {name}: torch / mok {ms['torch EP=1 fwd'] / ms[name]:.3f}   "
              f"mok / experts {ms[name] / ms['experts only']:.3f}")


if __name__ == "__main__":
    main()
