"""mok.ops.grouped_mm_fp8: the block-scaled fp8 forward kinds of the grouped-GEMM engine
(docs/precision.md).  The argument checks run anywhere (the C side checks the views before it
rejects CPU tensors); the GPU tests compare with the float64 oracle of the recipe
(mok.fp8.block_scaled_mm_reference) and run twice bitwise."""
import pytest
import torch

import mok
from mok import fp8, ops

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and mok.has_cuda()), reason="needs a CUDA GPU and libmok's CUDA part")
lib_has_it = pytest.mark.skipif(not mok._lib.has_symbol("mokGroupedGemmBlockScaled"),
                                reason="this libmok predates mokGroupedGemmBlockScaled")


def _problem(E, N, K, blocks, device, gate_up, seed=0):
    g = torch.Generator().manual_seed(seed)
    M = 128 * len(blocks)
    a = torch.randn(M, K, generator=g).bfloat16()
    w0 = (torch.randn(E, N, K, generator=g) / K ** 0.5).bfloat16()
    w1 = (torch.randn(E, N, K, generator=g) / K ** 0.5).bfloat16()
    qa, sa = fp8.quantize_rows(a)
    qb0, sb0 = fp8.quantize_blocks(w0)
    qb1, sb1 = fp8.quantize_blocks(w1)
    be = torch.tensor(blocks, dtype=torch.int32)
    t = [qa, sa, qb0, sb0, be] + ([qb1, sb1] if gate_up else [])
    return [x.to(device) for x in t]


@lib_has_it
def test_arguments_are_checked_before_the_device():
    qa, sa, qb0, sb0, be, qb1, sb1 = _problem(2, 128, 256, [0, 1], "cpu", True)
    with pytest.raises(ValueError, match="a must be float8_e4m3fn"):
        ops.grouped_mm_fp8(qa.float().bfloat16(), sa, qb0, sb0, be)
    with pytest.raises(ValueError, match="needs b1 and b1_scales"):
        ops.grouped_mm_fp8(qa, sa, qb0, sb0, be, kind="gate_up")
    with pytest.raises(ValueError, match="'down' takes b0"):
        ops.grouped_mm_fp8(qa, sa, qb0, sb0, be, b1=qb1, b1_scales=sb1, kind="down")
    with pytest.raises(ValueError, match=r"a_scales has shape \[256, 2\], expected \[2, 256\]"):
        ops.grouped_mm_fp8(qa, sa.t().contiguous(), qb0, sb0, be)
    with pytest.raises(ValueError, match="b1_scales"):
        ops.grouped_mm_fp8(qa, sa, qb0, sb0, be, b1=qb1, b1_scales=sb1[:, :, :1].contiguous())
    with pytest.raises(ValueError, match="on the CPU"):
        ops.grouped_mm_fp8(qa, sa, qb0, sb0, be)
    with pytest.raises(ValueError, match="pow2 go with quantize_out=True"):
        ops.grouped_mm_fp8(qa, sa, qb0, sb0, be, qb1, sb1, pow2=True)
    with pytest.raises(ValueError, match="quantize_out is for kind 'gate_up'"):
        ops.grouped_mm_fp8(qa, sa, qb0, sb0, be, quantize_out=True)
    with pytest.raises(ValueError, match="out must be float8_e4m3fn"):
        ops.grouped_mm_fp8(qa, sa, qb0, sb0, be, qb1, sb1, out=torch.empty(256, 128, dtype=torch.bfloat16),
                           quantize_out=True)
    with pytest.raises(ValueError, match=r"out_scales has shape \[2, 256\], expected \[1, 256\]"):
        ops.grouped_mm_fp8(qa, sa, qb0, sb0, be, qb1, sb1, quantize_out=True, out_scales=torch.empty(2, 256))


def _run(kind, E=3, N=320, K=512, blocks=(2, 0, 1, -1, 2)):
    """Two poisoned runs of kind; the problem and both outputs."""
    gate_up = kind != "down"
    t = _problem(E, N, K, list(blocks), "cuda", gate_up)
    qa, sa, qb0, sb0, be = t[:5]
    extra = dict(b1=t[5], b1_scales=t[6]) if gate_up else {}
    M, cols = 128 * len(blocks), 2 * N if kind == "gate_up_preact" else N
    outs = [ops.grouped_mm_fp8(qa, sa, qb0, sb0, be, kind=kind,
                               out=torch.full((M, cols), float("nan"), dtype=torch.bfloat16, device="cuda"), **extra)
            for _ in range(2)]
    return t, outs


def _nan_tailed(t):
    """t's values in a buffer whose memory past t's end is NaN (a read past the end shows)."""
    buf = torch.full((t.numel() + 4096,), float("nan"), dtype=t.dtype, device=t.device)
    buf[: t.numel()] = t.flatten()
    return buf[: t.numel()].view(t.shape)


@gpu
@lib_has_it
@pytest.mark.parametrize("kind", ["down", "gate_up"])
def test_no_scale_past_k_is_read(kind):
    # The K loop runs K / 128 k-blocks of 128 and reads those k-blocks' scales only: with NaN
    # past the end of every scale tensor the result is still the ordinary one, bit for bit (a
    # loop over the bf16 tile's k-blocks of 64 ran twice K, its operand loads past K zero-filled,
    # so only a scale read past the end could show it: the cause of session 24's NaN layer)
    t, (want, _) = _run(kind)
    qa, sa, qb0, sb0, be = t[:5]
    extra = dict(b1=t[5], b1_scales=_nan_tailed(t[6])) if kind == "gate_up" else {}
    got = ops.grouped_mm_fp8(qa, _nan_tailed(sa), qb0, _nan_tailed(sb0), be, kind=kind,
                             out=torch.full_like(want, float("nan")), **extra)
    live = torch.tensor([2, 0, 1, -1, 2]).repeat_interleave(128).cuda() >= 0
    assert torch.isfinite(got[live].float()).all()
    assert torch.equal(got[live], want[live])


@gpu
@lib_has_it
@pytest.mark.parametrize("kind", ["down", "gate_up_preact", "gate_up"])
def test_against_the_float64_recipe(kind):
    E, N, K, blocks = 3, 320, 512, [2, 0, 1, -1, 2]
    # poisoned outputs: every written element is overwritten, the -1 block's stay NaN
    t, outs = _run(kind, E, N, K, blocks)
    qa, sa, qb0, sb0 = t[:4]
    M, cols = 128 * len(blocks), 2 * N if kind == "gate_up_preact" else N
    live = torch.tensor(blocks).repeat_interleave(128) >= 0
    got = outs[0].double().cpu()
    assert torch.isnan(got[~live]).all(), "the -1 block's rows were written"
    assert not torch.isnan(got[live]).any(), "rows of a live block were left unwritten"
    assert torch.equal(outs[0][live.cuda()], outs[1][live.cuda()]), "not bitwise reproducible"
    want = torch.zeros(M, cols, dtype=torch.float64)
    for i, e in enumerate(blocks):
        if e < 0:
            continue
        rows = slice(128 * i, 128 * i + 128)
        ref = lambda qb, sb: fp8.block_scaled_mm_reference(qa[rows].cpu(), sa[:, rows].cpu(), qb[e].cpu(),  # noqa: E731
                                                           sb[e].cpu())
        g = ref(qb0, sb0)
        if kind == "down":
            want[rows] = g
        else:
            u = ref(t[5], t[6])
            want[rows] = torch.cat([g, u], 1) if kind == "gate_up_preact" else torch.nn.functional.silu(g) * u
    err = (got[live] - want[live]).abs()
    # bf16 output rounding, and the tensor cores' fp8 sums within a k-block
    assert torch.all(err <= want[live].abs() * 2.0 ** -7 + 1e-3 * want[live].abs().max()), err.max()


@gpu
@lib_has_it
@pytest.mark.parametrize("pow2", [False, True])
def test_gate_up_writes_a_quantised_for_down(pow2):
    # a = silu(g)·u quantised per row and 128 channels in the epilogue: against mok.fp8's
    # quantiser applied to the float64 oracle's a (the kernel's a is its fp32 value, from the
    # tensor cores' fp8 sums of a k-block, which keep about 14 bits: each block's scale within
    # 2^-10 relative, its largest value on 448, every value within e4m3's rounding), the -1
    # block untouched, and its output usable as the down kind's A
    E, N, K, blocks = 2, 256, 384, [1, -1, 0]
    qa, sa, qb0, sb0, be, qb1, sb1 = _problem(E, N, K, blocks, "cuda", True, seed=3)
    M = 128 * len(blocks)
    poison = torch.full((M, N), float("nan"), device="cuda").to(torch.float8_e4m3fn)
    q, s = ops.grouped_mm_fp8(qa, sa, qb0, sb0, be, qb1, sb1, out=poison.clone(), quantize_out=True, pow2=pow2)
    q2, s2 = ops.grouped_mm_fp8(qa, sa, qb0, sb0, be, qb1, sb1, out=poison.clone(), quantize_out=True, pow2=pow2)
    live = torch.tensor(blocks).repeat_interleave(128) >= 0
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s[:, live.cuda()], s2[:, live.cuda()])
    assert torch.isnan(q[~live.cuda()].float()).all(), "the -1 block's rows were written"
    want = torch.zeros(M, N, dtype=torch.float64)
    for i, e in enumerate(blocks):
        if e < 0:
            continue
        rows = slice(128 * i, 128 * i + 128)
        g = fp8.block_scaled_mm_reference(qa[rows].cpu(), sa[:, rows].cpu(), qb0[e].cpu(), sb0[e].cpu())
        u = fp8.block_scaled_mm_reference(qa[rows].cpu(), sa[:, rows].cpu(), qb1[e].cpu(), sb1[e].cpu())
        want[rows] = torch.nn.functional.silu(g) * u
    amax = want[live].reshape(-1, N // 128, 128).abs().amax(-1).t()  # [N/128, live rows]
    got_s = s[:, live.cuda()].double().cpu()
    qf = q[live.cuda()].float().cpu().reshape(-1, N // 128, 128)
    if pow2:  # UE8M0: a power of two, the ceiling of max |a| / 448 (up to a's few-ulp difference)
        assert torch.all(torch.log2(got_s).frac() == 0)
        assert torch.all(got_s >= amax / fp8.E4M3_MAX * (1 - 2.0 ** -10))
        ratio = got_s / (amax / fp8.E4M3_MAX)
        assert torch.all(ratio < 2 * (1 + 2.0 ** -10)), f"scale / (amax / 448) up to {ratio.max().item()}"
        assert torch.all(qf.abs().amax(-1) > fp8.E4M3_MAX / 2 * 0.99)
    else:
        assert torch.all((got_s - amax / fp8.E4M3_MAX).abs() <= 2.0 ** -10 * amax / fp8.E4M3_MAX)
        assert torch.all(qf.abs().amax(-1) == fp8.E4M3_MAX)
    # Each value within e4m3's rounding of a (half an ulp: 2^-4 relative, 2^-10 of the scale for
    # subnormals) once a's own difference from the float64 recipe is allowed for: the tensor
    # cores' k-block sums err relative to the sums' magnitude, so up to 2^-10 of the row block's
    # largest |a| (measured: under 5e-5 of it)
    deq = (qf.double() * got_s.t().unsqueeze(-1)).reshape(-1, N)
    w = want[live]
    step = got_s.t().repeat_interleave(128, dim=1)
    delta = amax.t().repeat_interleave(128, dim=1) * 2.0 ** -10
    err = (deq - w).abs() - ((w.abs() + delta) * 2.0 ** -4 + delta + step * 2.0 ** -10)
    assert torch.all(err <= 0), f"{int((err > 0).sum())} values outside e4m3's rounding, worst by {err.max().item():.3g}"


@pytest.mark.skipif(not mok._lib.has_symbol("mokQuantizeRowsE4m3"), reason="this libmok predates mokQuantizeRowsE4m3")
def test_quantize_rows_arguments_are_checked():
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.quantize_rows_fp8(torch.zeros(4, 192, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="on the CPU"):
        ops.quantize_rows_fp8(torch.zeros(4, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="scales has shape"):
        ops.quantize_rows_fp8(torch.zeros(4, 256, dtype=torch.bfloat16), scales=torch.zeros(4, 2))


@gpu
@pytest.mark.skipif(not mok._lib.has_symbol("mokQuantizeRowsE4m3"), reason="this libmok predates mokQuantizeRowsE4m3")
@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_rows_on_the_gpu_is_the_reference_bit_for_bit(pow2):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(300, 7168, generator=g) * torch.logspace(-4, 4, 300).unsqueeze(1)).bfloat16()
    x[7, 128:256] = 0
    x[9, :128] = 1e-30  # tiny values: the scale stays a normal fp32
    q, s = ops.quantize_rows_fp8(x.cuda(), pow2=pow2)
    qr, sr = fp8.quantize_rows(x, pow2=pow2)
    assert torch.equal(s.cpu(), sr)
    assert torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8))
    q2, s2 = ops.quantize_rows_fp8(x.cuda(), pow2=pow2)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    # the reference run on the GPU too (a scale divided by 448 exactly there as well)
    qg, sg = fp8.quantize_rows(x.cuda(), pow2=pow2)
    assert torch.equal(sg, s) and torch.equal(qg.view(torch.uint8), q.view(torch.uint8))


blocks_lib = pytest.mark.skipif(not mok._lib.has_symbol("mokQuantizeBlocksE4m3"),
                                reason="this libmok predates mokQuantizeBlocksE4m3")


@blocks_lib
def test_quantize_blocks_arguments_are_checked():
    with pytest.raises(ValueError, match="multiples of 128"):
        ops.quantize_blocks_fp8(torch.zeros(2, 128, 192, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="nothing to make"):
        ops.quantize_blocks_fp8(torch.zeros(128, 128, dtype=torch.bfloat16), q=False, qt=False)
    with pytest.raises(ValueError, match="w must be bfloat16"):
        ops.quantize_blocks_fp8(torch.zeros(128, 128))
    with pytest.raises(ValueError, match="on the CPU"):
        ops.quantize_blocks_fp8(torch.zeros(2, 128, 256, dtype=torch.bfloat16))


def _weights(E, R, C, column_major, seed):
    """[E, R, C] bf16 with each 128 x 128 block at its own magnitude (1e-6 .. 1e4), one block of
    zeros; column-major: the transposed view of a contiguous [E, C, R]."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.logspace(-6, 4, E * (R // 128) * (C // 128)).reshape(E, R // 128, C // 128)
    mag = mag.flatten()[torch.randperm(mag.numel(), generator=g)].reshape(mag.shape)
    mag[0, 0, 0] = 0
    w = torch.randn(E, R, C, generator=g) * mag.repeat_interleave(128, 1).repeat_interleave(128, 2)
    w = w.bfloat16()
    return w.transpose(1, 2).contiguous().transpose(1, 2) if column_major else w


@gpu
@blocks_lib
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("column_major", [False, True])
def test_quantize_blocks_on_the_gpu_is_the_reference_bit_for_bit(pow2, column_major):
    # Both orientations from one read: q is mok.fp8.quantize_blocks' bit for bit, qt its
    # transpose, the scales the same; and each alone (q=False / qt=False) the same bits
    w = _weights(3, 256, 384, column_major, seed=5)
    q, qt, s = ops.quantize_blocks_fp8(w.cuda(), pow2=pow2)
    qr, sr = fp8.quantize_blocks(w.contiguous(), pow2=pow2)
    assert torch.equal(s.cpu(), sr)
    assert torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(qt.cpu().view(torch.uint8), qr.transpose(1, 2).contiguous().view(torch.uint8))
    q1, none, s1 = ops.quantize_blocks_fp8(w.cuda(), qt=False, pow2=pow2)
    none2, qt2, _ = ops.quantize_blocks_fp8(w[1].cuda(), q=False, pow2=pow2)
    assert none is None and none2 is None
    assert torch.equal(q1.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s1, s)
    assert torch.equal(qt2.view(torch.uint8), qt[1].view(torch.uint8))


@gpu
@lib_has_it
@blocks_lib
def test_dgrad_reads_the_transposed_copy_with_the_weights_scales():
    # da = dy · W for W [E, H, I] (w_down): B = qt [E, I, H] (N = I, K = H) with W's own scales
    # [E, H/128, I/128] = [E, K/128, N/128] (b_transposed): the same bits as with the scales laid
    # out for qt, and the float64 recipe's value
    E, H, I, blocks = 2, 384, 256, [1, 0, -1, 1]
    w = _weights(E, H, I, False, seed=6) * 1e-3
    _, qt, s = ops.quantize_blocks_fp8(w.cuda())
    g = torch.Generator().manual_seed(7)
    dy = torch.randn(128 * len(blocks), H, generator=g).bfloat16()
    qa, sa = fp8.quantize_rows(dy)
    be = torch.tensor(blocks, dtype=torch.int32).cuda()
    poison = lambda: torch.full((qa.shape[0], I), float("nan"), dtype=torch.bfloat16, device="cuda")  # noqa: E731
    got = ops.grouped_mm_fp8(qa.cuda(), sa.cuda(), qt, s, be, out=poison(), b_transposed=True)
    same = ops.grouped_mm_fp8(qa.cuda(), sa.cuda(), qt, s.transpose(1, 2).contiguous(), be, out=poison())
    assert torch.equal(got.view(torch.int16), same.view(torch.int16))  # bits: the -1 block's rows stay NaN
    for i, e in enumerate(blocks):
        rows = slice(128 * i, 128 * i + 128)
        if e < 0:
            assert torch.isnan(got[rows].float()).all()
            continue
        want = fp8.block_scaled_mm_reference(qa[rows], sa[:, rows], qt[e].cpu(), s[e].t().contiguous().cpu())
        err = (got[rows].double().cpu() - want).abs()
        assert torch.all(err <= want.abs() * 2.0 ** -7 + 1e-3 * want.abs().max()), err.max()
    with pytest.raises(ValueError, match=r"b0_scales \(b_transposed\) has shape"):
        ops.grouped_mm_fp8(qa.cuda(), sa.cuda(), qt, s.transpose(1, 2).contiguous()[:, :1], be, b_transposed=True)


def _layer_weights(E, H, I, Is, column_major, seed):
    """A layer's bf16 weights (routed ones column-major: views of transposed stacks)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, col=False):
        t = (torch.randn(*shape, generator=g) * 10.0 ** torch.randint(-3, 2, (1,), generator=g).item()).bfloat16()
        return t.transpose(-1, -2).contiguous().transpose(-1, -2) if col else t
    return dict(w_gate=w(E, I, H, col=column_major), w_up=w(E, I, H, col=column_major),
                w_down=w(E, H, I, col=column_major), ws_gate=w(Is, H), ws_up=w(Is, H), ws_down=w(H, Is))


def test_quantize_weights_on_the_cpu_is_quantize_blocks():
    ws = _layer_weights(2, 256, 128, 128, True, seed=8)
    fw = mok.quantize_weights(**ws, pow2=True)
    for name, w in ws.items():
        q, s = fp8.quantize_blocks(w.contiguous(), pow2=True)
        f = fw[name]
        assert torch.equal(f.scales, s) and torch.equal(f.q.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(f.qt.view(torch.uint8), q.transpose(-1, -2).contiguous().view(torch.uint8))
    assert fw.current(**ws)
    ws["w_up"].mul_(2)  # an optimizer step in place: the copy is stale
    assert not fw.current(**ws)
    with pytest.raises(ValueError, match="multiples of 128"):
        mok.quantize_weights(**dict(ws, ws_down=torch.zeros(256, 192, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="w_gate must be bfloat16"):
        mok.quantize_weights(**dict(ws, w_gate=ws["w_gate"].float()))


@gpu
@pytest.mark.skipif(not mok._lib.has_symbol("mokQuantizeWeights"), reason="this libmok predates mokQuantizeWeights")
@pytest.mark.parametrize("column_major", [False, True])
def test_quantize_weights_on_the_gpu_is_the_cpus_bit_for_bit(column_major):
    ws = _layer_weights(3, 384, 256, 128, column_major, seed=9)
    cpu = mok.quantize_weights(**ws)
    gpu_ws = {n: w.cuda() for n, w in ws.items()}
    gpu_ws = {n: (w if not column_major or n.startswith("ws") else
                  w.transpose(-1, -2).contiguous().transpose(-1, -2)) for n, w in gpu_ws.items()}
    dev = mok.quantize_weights(**gpu_ws)
    for name in ws:
        a, b = cpu[name], dev[name]
        assert torch.equal(b.scales.cpu(), a.scales), name
        assert torch.equal(b.q.cpu().view(torch.uint8), a.q.view(torch.uint8)), name
        assert torch.equal(b.qt.cpu().view(torch.uint8), a.qt.view(torch.uint8)), name
    fwd_only = mok.quantize_weights(**gpu_ws, transposed=False)
    assert fwd_only["w_down"].qt is None and torch.equal(fwd_only["w_down"].q, dev["w_down"].q)


@pytest.mark.skipif(not mok._lib.has_symbol("mokQuantizeWeights"), reason="this libmok predates mokQuantizeWeights")
def test_quantize_weights_views_are_checked_before_the_device():
    # The C entry point names a misshaped copy, then refuses CPU tensors (mok.quantize_weights
    # quantises CPU weights itself, with mok.fp8)
    import ctypes
    from mok.quantized import Fp8Weight, fp8_views
    ws = _layer_weights(2, 256, 128, 128, False, seed=10)
    e4m3 = torch.float8_e4m3fn

    def call(fw):
        config = mok._lib.default_config()
        config.hidden, config.intermediate, config.shared_intermediate, config.num_experts = 256, 128, 128, 2
        views = mok._lib.Views()
        return mok._lib.check(mok._lib.symbol("mokQuantizeWeights")(
            ctypes.byref(config), ctypes.byref(views.weights(ws, "weights.", mok._lib.BF16)),
            ctypes.byref(fp8_views(views, fw)), 0, None))
    good = Fp8Weight(torch.empty(2, 128, 256, dtype=e4m3), torch.empty(2, 256, 128, dtype=e4m3),
                     torch.empty(2, 1, 2))
    with pytest.raises(ValueError, match=r"fp8.w_gate.qt has shape \[2, 128, 256\], expected \[2, 256, 128\]"):
        call({"w_gate": Fp8Weight(good.q, good.q.clone(), good.scales)})
    with pytest.raises(ValueError, match=r"fp8.w_down.scales has shape"):
        call({"w_down": Fp8Weight(torch.empty(2, 256, 128, dtype=e4m3), None, good.scales)})
    with pytest.raises(ValueError, match="on the CPU"):
        call({"w_gate": good})


def test_quantized_weights_are_current_only_for_the_same_live_tensors():
    ws = _layer_weights(1, 128, 128, 128, False, seed=11)
    fw = mok.quantize_weights(**ws)
    assert fw.current(**ws)
    assert not fw.current(**dict(ws, w_down=ws["w_down"].clone()))  # equal values, another tensor
    assert not fw.current(**dict(ws, ws_gate=None))
    ws["w_down"].add_(1)  # an optimizer step in place
    assert not fw.current(**ws)
