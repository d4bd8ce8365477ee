"""precision="fp8_block" on CUDA (docs/precision.md): the forward against the CPU reference's
(the same recipe; the tensor cores' fp8 k-block sums keep about 14 bits, so within tolerance),
bitwise reproducible and batch invariant; the training forward's saved pre-activations those of
the block-scaled gate/up kind on the same e4m3 rows, bit for bit; the backward (routed and shared experts)
against the CPU reference's, bitwise reproducible, the saved h's the replay's bits."""
import pytest
import torch

import mok
from mok import functional as F
from oracle import make_routing, make_weights, make_x

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and mok.has_cuda()), reason="needs a CUDA GPU and libmok's CUDA part")
H, I, E, K, T = 256, 256, 4, 2, 37


@gpu
@pytest.mark.parametrize("shared,pow2", [(0, False), (128, False), (128, True)])
def test_cuda_forward_is_the_reference(shared, pow2, monkeypatch):
    import mok.config
    monkeypatch.setattr(mok.config, "poison_outputs", True)  # every output starts as NaN
    g = torch.Generator().manual_seed(20 + shared + pow2)
    w = make_weights(g, H, I, E, shared)
    x = make_x(g, T, H)
    ids, tw = make_routing(g, T, E, K)
    cfg = F.MoKConfig(precision="fp8_block", fp8_pow2_scales=pow2)
    y_ref, _ = F.forward(x, ids, tw, **w, config=cfg)
    wc = {n: (None if v is None else v.cuda()) for n, v in w.items()}
    run = lambda n: F.forward(x[:n].cuda(), ids[:n].cuda(), tw[:n].cuda(), **wc, config=cfg)  # noqa: E731
    y, ctx = run(T)
    assert torch.isfinite(y.float()).all()
    diff = ((y.cpu().double() - y_ref.double()).norm() / y_ref.double().norm()).item()
    print(f"fp8_block CUDA forward against the CPU reference: relative Frobenius {diff:.2e}")
    assert diff < 1e-2, diff
    assert torch.equal(run(T)[0], y)  # bitwise, the copies cached on the workspace
    assert torch.equal(run(20)[0], y[:20])  # a token's row does not depend on the others


@gpu
@pytest.mark.parametrize("shared,pow2,start,ring", [(0, False, "1", 0), (256, True, "0", 256), (256, False, "1", 256)])
def test_fused_forward_is_the_launches_bitwise(shared, pow2, start, ring, monkeypatch):
    # The megakernel's fp8 policy runs the launches' tiles (128 x 256, the same k-block order,
    # promotions and epilogues): y and the saved h bit for bit.  A ring of 2 row blocks (its
    # slots reused, the gathers waiting on down tiles), no start gather (the gather warps copy
    # every row and its scales), a hot expert and a masked route.
    import mok.config
    monkeypatch.setattr(mok.config, "poison_outputs", True)
    g = torch.Generator().manual_seed(60 + shared + pow2)
    Hb, Ib, Eb, Tb = 512, 256, 8, 300
    w = {n: (None if v is None else v.cuda()) for n, v in make_weights(g, Hb, Ib, Eb, shared).items()}
    x = make_x(g, Tb, Hb).cuda()
    ids, tw = make_routing(g, Tb, Eb, K)
    ids[: Tb // 2, 0] = 3  # hot expert 3 (ids stay distinct per token: column 1 is another expert or -1)
    ids[: Tb // 2, 1] = torch.where(ids[: Tb // 2, 1] == 3, -1, ids[: Tb // 2, 1])
    ids, tw = ids.cuda(), tw.cuda()
    cfg = F.MoKConfig(precision="fp8_block", fp8_pow2_scales=pow2, macrobatch_size=ring, timeout_s=10)
    monkeypatch.setenv("MOK_FORWARD_START_GATHER", start)

    def run(path):
        monkeypatch.setenv("MOK_FORWARD_PATH", path)
        y, ctx = F.forward(x, ids, tw, **w, config=cfg)
        return y, ctx.saved[0], ctx.saved[1]

    from mok import ops
    used = int(ops.build_schedule([ids], Eb)[2][-1])  # the plan's rows (h past them is not written)
    unfused, fused = run("unfused"), run("fused")
    for name, a, b in zip(("y", "h", "shared h"), fused, unfused):
        if b is None:
            continue
        if name == "h":
            a, b = a[:used], b[:used]
        assert torch.isfinite(b.float()).all(), f"{name}: the launches left non-finite values"
        bad = (a.view(torch.int16) != b.view(torch.int16)).nonzero()
        assert bad.numel() == 0, f"{name}: {bad.shape[0]} values differ fused vs launches, first at {bad[0].tolist()}"
    assert torch.equal(run("fused")[0], fused[0])  # bitwise reproducible


@gpu
def test_cuda_forward_requantises_after_an_optimizer_step():
    g = torch.Generator().manual_seed(30)
    w = {n: (None if v is None else v.cuda()) for n, v in make_weights(g, H, I, E, 128).items()}
    x, (ids, tw) = make_x(g, T, H).cuda(), [t.cuda() for t in make_routing(g, T, E, K)]
    cfg = F.MoKConfig(precision="fp8_block")
    y0 = F.forward(x, ids, tw, **w, config=cfg)[0]
    w["w_down"].mul_(2)  # in place: the cached copy is stale
    y1 = F.forward(x, ids, tw, **w, config=cfg)[0]
    fresh = F.forward(x, ids, tw, **{n: (None if v is None else v.clone()) for n, v in w.items()}, config=cfg)[0]
    assert not torch.equal(y0, y1) and torch.equal(y1, fresh)


@gpu
@pytest.mark.parametrize("shared", [0, 128])
def test_saved_pre_activations_are_the_gate_up_kinds(shared):
    # h = [bf16(g) | bf16(u)] comes out of the forward's gate/up epilogue beside a in e4m3: at
    # every plan row, the gate_up_preact kind's value on the row's token quantised per row (pad
    # rows: zeros); the shared expert's per token.  Bit for bit (the same tiles, the same
    # k-block order).
    from mok import ops
    g = torch.Generator().manual_seed(40 + shared)
    w = {n: (None if v is None else v.cuda()) for n, v in make_weights(g, H, I, E, shared).items()}
    x = make_x(g, T, H).cuda()
    ids, tw = [t.cuda() for t in make_routing(g, T, E, K)]
    _, ctx = F.forward(x, ids, tw, **w, config=F.MoKConfig(precision="fp8_block"))
    h, shared_h = ctx.saved[0], ctx.saved[1]
    rows, _, offsets, block_expert, _ = ops.build_schedule([ids], E)
    used = int(offsets[-1])
    rec = rows[:used].to(torch.int64) & 0xFFFFFFFF
    pad = rec == 0xFFFFFFFF
    token = torch.where(pad, 0, rec & ((1 << F.TOKEN_BITS) - 1))
    qx, sx = ops.quantize_rows_fp8(x)
    ring = qx.view(torch.uint8)[token]
    ring[pad] = 0
    ring = ring.view(torch.float8_e4m3fn)
    ring_s = sx[:, token].contiguous()
    ring_s[:, pad] = 1.0
    fw = mok.quantize_weights(**w, transposed=False)
    want = ops.grouped_mm_fp8(ring, ring_s, fw["w_gate"].q, fw["w_gate"].scales, block_expert[: used // 128].contiguous(),
                              fw["w_up"].q, fw["w_up"].scales, kind="gate_up_preact")
    diff = (h[:used].view(torch.int16) != want.view(torch.int16)).nonzero()
    assert diff.numel() == 0, (
        f"{diff.shape[0]} values differ, rows {diff[:, 0].unique().tolist()[:8]} cols {diff[:, 1].unique().tolist()[:8]}; "
        f"first: saved {h[tuple(diff[0])].item()} want {want[tuple(diff[0])].item()} (pad row: {bool(pad[diff[0, 0]])})")
    if shared:
        t4 = (T + 3) // 4 * 4
        qx4, sx4 = ops.quantize_rows_fp8(torch.cat([x, x.new_zeros(t4 - T, H)]))
        ws = ops.grouped_mm_fp8(qx4, sx4, fw["ws_gate"].q[None], fw["ws_gate"].scales[None],
                                torch.zeros((t4 + 127) // 128, dtype=torch.int32, device="cuda"),
                                fw["ws_up"].q[None], fw["ws_up"].scales[None], kind="gate_up_preact")
        assert torch.equal(shared_h.view(torch.int16), ws[:T].view(torch.int16))


@gpu
@pytest.mark.parametrize("shared,pow2", [(0, False), (0, True), (128, False)])
def test_cuda_backward_is_the_reference(shared, pow2):
    # The CUDA backward's launches against the CPU reference's recipe:
    # every gradient within the tensor cores' fp8 sums (their k-block partials keep about 14
    # bits, so an e4m3 rounding of dh, a, x or w·dy may land one step apart); twice bitwise; the
    # training forward's saved h and the replay the same bits; w = 0 and w < 0 routes included
    g = torch.Generator().manual_seed(50 + pow2 + shared)
    w = make_weights(g, H, I, E, shared)
    x = make_x(g, T, H)
    ids, tw = make_routing(g, T, E, K)
    dy = torch.randn(T, H, generator=g).bfloat16()
    cfg = F.MoKConfig(precision="fp8_block", fp8_pow2_scales=pow2)
    _, ctx_ref = F.forward(x, ids, tw, **w, config=cfg)
    ref = F.backward(ctx_ref, dy)
    wc = {n: (None if v is None else v.cuda()) for n, v in w.items()}
    args = (x.cuda(), ids.cuda(), tw.cuda())
    _, ctx = F.forward(*args, **wc, config=cfg)
    got = F.backward(ctx, dy.cuda())
    again = F.backward(ctx, dy.cuda())
    _, ctx_replay = F.forward(*args, **wc, config=cfg, save_for_backward=False)
    replay = F.backward(ctx_replay, dy.cuda())
    names = ("dx", "d_topk_weights", "w_gate", "w_up", "w_down") + (("ws_gate", "ws_up", "ws_down") if shared else ())
    for name in names:
        a, b = getattr(got, name), getattr(ref, name)
        assert torch.isfinite(a.float()).all(), name
        rel = ((a.cpu().double() - b.double()).norm() / b.double().norm()).item()
        print(f"fp8_block CUDA backward {name} against the CPU reference: relative Frobenius {rel:.2e}")
        assert rel < 1e-2, (name, rel)  # measured 1.8e-3 - 5.1e-3 (session 26)
        assert torch.equal(a, getattr(again, name)), f"{name}: not bitwise reproducible"
        assert torch.equal(a, getattr(replay, name)), f"{name}: saved h and replay differ"
    masked = (ids < 0).cuda()
    assert torch.all(got.d_topk_weights[masked] == 0)


@gpu
def test_cuda_backward_writes_framework_layouts_in_place():
    # The weight gradients where a framework keeps them (grads_out, poisoned with NaN first).
    # Row-major: gate and up as the two row halves of one [E, 2I, H] gradient (Hugging Face's
    # gate_up_proj: an expert stride of 2I·H), the same bits as contiguous ones.  Column-major
    # (is_transposed storage: [E, H, I] for gate and up, [E, I, H] for down, the weights too),
    # written as their transposes by the wgrad with its operands swapped: within the tensor
    # cores' sums of the row-major run's.
    g = torch.Generator().manual_seed(60)
    w = {n: (None if v is None else v.cuda()) for n, v in make_weights(g, H, I, E, 0).items()}
    x, (ids, tw) = make_x(g, T, H).cuda(), (t.cuda() for t in make_routing(g, T, E, K))
    dy = torch.randn(T, H, generator=g).bfloat16().cuda()
    cfg = F.MoKConfig(precision="fp8_block")
    _, ctx = F.forward(x, ids, tw, **w, config=cfg)
    want = F.backward(ctx, dy)
    nan = lambda *shape: torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)  # noqa: E731
    gate_up, down = nan(E, 2 * I, H), nan(E, H, I)
    got = F.backward(ctx, dy, grads_out={"w_gate": gate_up[:, :I], "w_up": gate_up[:, I:], "w_down": down})
    assert torch.equal(gate_up[:, :I], want.w_gate) and torch.equal(gate_up[:, I:], want.w_up)
    assert torch.equal(down, want.w_down) and torch.equal(got.dx, want.dx)
    # (column-major gradients belong to column-major weights: the same values stored transposed)
    wt = {n: (None if v is None else v.transpose(1, 2).contiguous().transpose(1, 2)) for n, v in w.items()}
    _, ctx_t = F.forward(x, ids, tw, **wt, config=cfg)
    cols = {"w_gate": nan(E, H, I).transpose(1, 2), "w_up": nan(E, H, I).transpose(1, 2),
            "w_down": nan(E, I, H).transpose(1, 2)}
    F.backward(ctx_t, dy, grads_out=cols)
    for name, t in cols.items():
        ref = getattr(want, name)
        assert torch.isfinite(t.float()).all(), name
        rel = ((t.double() - ref.double()).norm() / ref.double().norm()).item()
        print(f"fp8_block column-major {name} gradient against the row-major one: relative Frobenius {rel:.2e}, "
              f"bitwise {torch.equal(t, ref)}")
        assert rel < 1e-3, (name, rel)


@gpu
@pytest.mark.parametrize("pow2", [False, True])
def test_cuda_backward_skewed_experts(pow2):
    # Experts of every size at once: expert 0 hot (every token's first route, 259 rows: three
    # 128-row k-blocks of its wgrad, the last partial), expert 1 one row, expert 2 none, expert 3
    # the rest; the gradients against the CPU reference, the empty expert's weight gradients
    # exactly zero, and the per-token gradients (dx, d topk_weights) of a prefix of the batch
    # the same bits as the whole batch's (a token's rows do not depend on the others').
    n = 259
    g = torch.Generator().manual_seed(70 + pow2)
    w = make_weights(g, H, I, E, 0)
    x = make_x(g, n, H)
    ids = torch.full((n, K), 3, dtype=torch.int32)
    ids[:, 0] = 0
    ids[5, 1] = 1
    ids[7, 1] = -1  # a masked route
    tw = torch.randn(n, K, generator=g)
    tw[3, 0] = 0.0
    dy = torch.randn(n, H, generator=g).bfloat16()
    cfg = F.MoKConfig(precision="fp8_block", fp8_pow2_scales=pow2)
    _, ctx_ref = F.forward(x, ids, tw, **w, config=cfg)
    ref = F.backward(ctx_ref, dy)
    wc = {k_: (None if v is None else v.cuda()) for k_, v in w.items()}

    def run(m):
        _, ctx = F.forward(x[:m].cuda(), ids[:m].cuda(), tw[:m].cuda(), **wc, config=cfg)
        return F.backward(ctx, dy[:m].cuda())

    got = run(n)
    for name in ("dx", "d_topk_weights", "w_gate", "w_up", "w_down"):
        a, b = getattr(got, name).cpu().double(), getattr(ref, name).double()
        assert torch.isfinite(a).all(), name
        rel = ((a - b).norm() / b.norm()).item()
        print(f"fp8_block CUDA backward, skewed experts (pow2={pow2}), {name}: relative Frobenius {rel:.2e}")
        assert rel < 1e-2, (name, rel)
    for name in ("w_gate", "w_up", "w_down"):
        assert torch.all(getattr(got, name)[2] == 0), f"{name}: the expert without rows has a gradient"
    assert got.d_topk_weights[7, 1] == 0
    part = run(100)
    assert torch.equal(part.dx, got.dx[:100]) and torch.equal(part.d_topk_weights, got.d_topk_weights[:100])
