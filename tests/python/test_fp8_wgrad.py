"""fp8_block's wgrad kind (mok.ops.grouped_wgrad_fp8, docs/precision.md) and its operands'
quantiser (mok.ops.quantize_cols_fp8): per channel and 128 rows of an expert, transposed
(K-major), the k-block's e4m3 sum promoted with both scales once per 128 rows.  Against the
float64 recipe (mok.fp8.wgrad_reference), bitwise across runs, zero-row, one-row and hot experts."""
import pytest
import torch

import mok
from mok import fp8, ops

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and mok.has_cuda()), reason="needs a CUDA GPU and libmok's CUDA part")
has_it = pytest.mark.skipif(not mok._lib.has_symbol("mokGroupedWgradBlockScaled"),
                            reason="this libmok predates mokGroupedWgradBlockScaled")


def test_quantize_cols_is_quantize_rows_of_the_transpose():
    # A column's scale over 128 rows is the transposed row's over 128 of K: the same numbers
    g = torch.Generator().manual_seed(1)
    v = (torch.randn(384, 256, generator=g) * torch.logspace(-3, 3, 256)).bfloat16()
    v[128:256, 7] = 0
    for pow2 in (False, True):
        q, s = fp8.quantize_cols(v, pow2=pow2)
        qr, sr = fp8.quantize_rows(v.t().contiguous(), pow2=pow2)
        assert q.shape == (256, 384) and s.shape == (3, 256)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
    assert s[1, 7] == 1.0  # a block of zeros


def _problem(counts, Mo, No, seed=0):
    """Plan-like rows: expert e's `counts[e]` rows at a multiple of 128, zero up to the next one;
    the operands quantised per column and 128 rows (the reference's quantiser)."""
    g = torch.Generator().manual_seed(seed)
    padded = [(c + 127) // 128 * 128 for c in counts]
    offsets = [sum(padded[:e]) for e in range(len(counts) + 1)]
    R = max(offsets[-1], 128)
    a = torch.zeros(R, Mo)
    b = torch.zeros(R, No)
    for e, c in enumerate(counts):
        a[offsets[e]:offsets[e] + c] = torch.randn(c, Mo, generator=g)
        b[offsets[e]:offsets[e] + c] = torch.randn(c, No, generator=g) * 3
    a, b = a.bfloat16(), b.bfloat16()
    (qa, sa), (qb, sb) = fp8.quantize_cols(a), fp8.quantize_cols(b)
    return qa, sa, qb, sb, torch.tensor(offsets, dtype=torch.int32), torch.tensor(counts, dtype=torch.int32), (a, b)


@has_it
def test_arguments_are_checked_before_the_device():
    qa, sa, qb, sb, off, cnt, _ = _problem([130, 0], 128, 256)
    with pytest.raises(ValueError, match="a must be float8_e4m3fn"):
        ops.grouped_wgrad_fp8(qa.float(), sa, qb, sb, off, cnt)
    with pytest.raises(ValueError, match=r"a_scales has shape \[128, 2\], expected \[2, 128\]"):
        ops.grouped_wgrad_fp8(qa, sa.t().contiguous(), qb, sb, off, cnt)
    with pytest.raises(ValueError, match="expert_offset"):
        ops.grouped_wgrad_fp8(qa, sa, qb, sb, off[:2], cnt)
    with pytest.raises(ValueError, match="on the CPU"):
        ops.grouped_wgrad_fp8(qa, sa, qb, sb, off, cnt)
    # the fp8 dgrad kinds of mokGroupedGemmBlockScaled name what is wrong before any launch
    e4 = torch.float8_e4m3fn
    dh, w = torch.zeros(128, 512, dtype=e4), torch.zeros(2, 384, 256, dtype=e4)
    with pytest.raises(ValueError, match=r"K = 2I"):
        ops.dgrad_gate_up_fp8(dh[:, :384], torch.ones(3, 128), w, torch.ones(2, 2, 3), w, torch.ones(2, 2, 3),
                              torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="on the CPU"):
        ops.dgrad_gate_up_fp8(dh, torch.ones(4, 128), w, torch.ones(2, 2, 3), w, torch.ones(2, 2, 3),
                              torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"b0_scales \(b_transposed\)"):
        ops.dgrad_down_swiglu_fp8(torch.zeros(128, 384, dtype=e4), torch.ones(3, 128), torch.zeros(2, 256, 384, dtype=e4),
                                  torch.ones(2, 2, 3), torch.zeros(1, dtype=torch.int32),
                                  torch.zeros(128, 512, dtype=torch.bfloat16), torch.ones(128))
    with pytest.raises(ValueError, match="multiples of 128"):
        ops.quantize_cols_fp8(torch.zeros(128, 192, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="on the CPU"):
        ops.quantize_cols_fp8(torch.zeros(128, 256, dtype=torch.bfloat16))


@gpu
@has_it
@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_cols_on_the_gpu_is_the_reference_bit_for_bit(pow2):
    g = torch.Generator().manual_seed(2)
    v = (torch.randn(640, 384, generator=g) * torch.logspace(-4, 4, 384)).bfloat16()
    v[256:384, 5] = 0
    q, s = ops.quantize_cols_fp8(v.cuda(), pow2=pow2)
    qr, sr = fp8.quantize_cols(v, pow2=pow2)
    assert torch.equal(s.cpu(), sr)
    assert torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8))


@gpu
@has_it
@pytest.mark.parametrize("counts", [[300, 0, 1, 129], [1024]])
def test_against_the_float64_recipe(counts):
    # Mo = 256 (two m-tiles), No = 384 (a partial 256-wide tile): outputs poisoned, an expert
    # with no rows gets zeros, one with one row its one k-block, a hot one many
    Mo, No = 256, 384
    qa, sa, qb, sb, off, cnt, _ = _problem(counts, Mo, No, seed=len(counts))
    want = fp8.wgrad_reference(qa, sa, qb, sb, off.tolist(), cnt.tolist())
    dev = [t.cuda() for t in (qa, sa, qb, sb, off, cnt)]
    outs = []
    for _ in range(2):
        out = torch.full((len(counts), Mo, No), float("nan"), dtype=torch.bfloat16, device="cuda")
        ops.grouped_wgrad_fp8(*dev, out=out)
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), "not bitwise reproducible"
    got = outs[0].double().cpu()
    assert not torch.isnan(got).any(), "elements left unwritten"
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.all(got[e] == 0)
    err = (got - want).abs()
    # bf16 output rounding, and the tensor cores' fp8 sums within a k-block
    assert torch.all(err <= want.abs() * 2.0 ** -7 + 1e-3 * want.abs().max()), err.max()


@gpu
@has_it
def test_fp32_outputs_accumulate():
    # acc = the fp32 sum (store_acc), then main_grad += it and out = bf16(acc + sum) (accumulate)
    Mo, No = 128, 256
    qa, sa, qb, sb, off, cnt, _ = _problem([200, 77], Mo, No, seed=5)
    dev = [t.cuda() for t in (qa, sa, qb, sb, off, cnt)]
    acc = torch.full((2, Mo, No), float("nan"), device="cuda")
    ops.grouped_wgrad_fp8(*dev, acc=acc, store_acc=True)
    main_grad = torch.full((2, Mo, No), 0.5, device="cuda")
    ops.grouped_wgrad_fp8(*dev, main_grad=main_grad)
    assert torch.equal(main_grad, acc + 0.5)
    out = ops.grouped_wgrad_fp8(*dev, acc=acc.clone(), accumulate=True, out=torch.empty(2, Mo, No, dtype=torch.bfloat16,
                                                                                          device="cuda"))
    assert torch.equal(out, (acc + acc).bfloat16())


# ---- the dgrad-down kind with the SwiGLU backward, dh out in e4m3 (mok.ops.dgrad_down_swiglu_fp8) ----

def _swiglu_bwd_problem(seed=0, E=2, H=384, I=256, blocks=(1, 0, -1, 1)):
    g = torch.Generator().manual_seed(seed)
    M = 128 * len(blocks)
    dy = torch.randn(M, H, generator=g).bfloat16()
    w_down = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
    h = torch.randn(M, 2 * I, generator=g).bfloat16()
    rw = torch.randn(M, generator=g)
    rw[::7] = 0.0  # w = 0 rows: dh = 0, the partials still da · a
    return dy, w_down, h, rw, torch.tensor(blocks, dtype=torch.int32)


def _swiglu_bwd_reference(dy, w_down, h, rw, blocks, pow2):
    """The recipe in float64 (docs/precision.md): da block-scaled, then the element math, dh and
    a quantised per row and 128 channels (mok.fp8's quantisers, float64 values rounded to fp32)."""
    I = w_down.shape[2]
    qdy, sdy = fp8.quantize_rows(dy)
    qw, sw = fp8.quantize_blocks(w_down)  # [E, H, I], [E, H/128, I/128]
    qt, st = qw.transpose(1, 2).contiguous(), sw.transpose(1, 2).contiguous()
    M = dy.shape[0]
    dh = torch.zeros(M, 2 * I, dtype=torch.float64)
    a = torch.zeros(M, I, dtype=torch.float64)
    da = torch.zeros(M, I, dtype=torch.float64)
    for i, e in enumerate(blocks.tolist()):
        if e < 0:
            continue
        rows = slice(128 * i, 128 * i + 128)
        da[rows] = fp8.block_scaled_mm_reference(qdy[rows], sdy[:, rows], qt[e], st[e])
    g, u = h[:, :I].double(), h[:, I:].double()
    sg = torch.sigmoid(g)
    sl = g * sg
    a = sl * u
    wda = rw.double()[:, None] * da
    dh[:, :I] = (wda * u) * (sg * (1 + g * (1 - sg)))
    dh[:, I:] = wda * sl
    qa, sa = fp8.quantize_rows(a.float(), pow2=pow2)
    a_deq = fp8.dequantize_rows(qa, sa).double()
    partials = (da * a_deq).reshape(M, I // 128, 128).sum(-1)
    return da, dh, a, partials, (qdy, sdy, qt, sw)


@gpu
@pytest.mark.skipif(not mok._lib.has_symbol("mokGroupedWgradBlockScaled"), reason="this libmok predates 0.6")
@pytest.mark.parametrize("pow2", [False, True])
def test_dgrad_down_swiglu_against_the_float64_recipe(pow2):
    dy, w_down, h, rw, blocks = _swiglu_bwd_problem(seed=3 + pow2)
    da, dh, a, partials, (qdy, sdy, qt, sw) = _swiglu_bwd_reference(dy, w_down, h, rw, blocks, pow2)
    M, I = dy.shape[0], w_down.shape[2]
    live = blocks.repeat_interleave(128) >= 0
    a_out = torch.full((M, I), float("nan"), dtype=torch.bfloat16, device="cuda")
    parts = torch.full((M, I // 128), float("nan"), device="cuda")
    cuda = lambda t: t.cuda()  # noqa: E731
    q, s = ops.dgrad_down_swiglu_fp8(cuda(qdy), cuda(sdy), cuda(qt), cuda(sw), cuda(blocks), cuda(h), cuda(rw),
                                     a=a_out, dtw_partials=parts, pow2=pow2)
    q2, s2 = ops.dgrad_down_swiglu_fp8(cuda(qdy), cuda(sdy), cuda(qt), cuda(sw), cuda(blocks), cuda(h), cuda(rw),
                                       pow2=pow2)
    lv = live.cuda()
    assert torch.equal(q[lv].view(torch.uint8), q2[lv].view(torch.uint8)) and torch.equal(s[:, lv], s2[:, lv])
    # dh: each value within e4m3's rounding of the recipe's once da's tensor-core error (2^-10 of
    # the row block's largest |dh|) is allowed for; its scale within 2^-9 of max / 448 (pow2:
    # the power of two at or above it)
    got = fp8.dequantize_rows(q[lv].cpu(), s[:, lv].cpu()).double()
    want = dh[live]
    amax = want.abs().reshape(-1, 2 * I // 128, 128).amax(-1)
    delta = (amax * 2.0 ** -10).repeat_interleave(128, dim=1)
    step = s[:, lv].cpu().double().t().repeat_interleave(128, dim=1)
    err = (got - want).abs() - ((want.abs() + delta) * 2.0 ** -4 + delta + step * 2.0 ** -10)
    assert torch.all(err <= 0), f"{int((err > 0).sum())} dh values outside e4m3's rounding"
    ratio = s[:, lv].cpu().double().t() / (amax / fp8.E4M3_MAX).clamp(min=1e-30)
    has = amax > 0
    if pow2:
        assert torch.all(torch.log2(s[:, lv].cpu()).frac() == 0)
        assert torch.all((ratio[has] >= 1 - 2.0 ** -9) & (ratio[has] < 2 * (1 + 2.0 ** -9)))
    else:
        assert torch.all((ratio[has] - 1).abs() <= 2.0 ** -9)
    # a and the router-gradient partials
    assert torch.allclose(a_out[lv].double().cpu(), a[live], rtol=2.0 ** -8, atol=0)
    pw = partials[live]
    assert torch.all((parts[lv].double().cpu() - pw).abs() <= 1e-3 * pw.abs().max() + 2.0 ** -6 * pw.abs())
    assert torch.isnan(a_out[~lv].float()).all(), "the -1 block's rows were written"


# ---- the dgrad gate/up kind on the two transposed copies (mok.ops.dgrad_gate_up_fp8) ----------

@gpu
@pytest.mark.skipif(not mok._lib.has_symbol("mokGroupedWgradBlockScaled"), reason="this libmok predates 0.6")
def test_dgrad_gate_up_reads_both_copies_as_one_stacked_one():
    # K = 2I split between W_gate's and W_up's transposed copies, each with its own scales: the
    # bits of the same kind on a stacked copy [E, H, 2I] with stacked scales (the k-blocks in the
    # same order), and the float64 recipe within the tensor cores' sums
    g = torch.Generator().manual_seed(9)
    E, H, I, blocks = 2, 384, 256, [1, -1, 0, 1]
    M = 128 * len(blocks)
    wg, wu = [(torch.randn(E, I, H, generator=g) / H ** 0.5).bfloat16().cuda() for _ in range(2)]
    _, qtg, sg = ops.quantize_blocks_fp8(wg)  # qt [E, H, I], scales [E, I/128, H/128]
    _, qtu, su = ops.quantize_blocks_fp8(wu)
    dh = torch.randn(M, 2 * I, generator=g).bfloat16().cuda()
    qdh, sdh = ops.quantize_rows_fp8(dh)
    be = torch.tensor(blocks, dtype=torch.int32, device="cuda")
    got = ops.dgrad_gate_up_fp8(qdh, sdh, qtg, sg, qtu, su, be,
                                out=torch.full((M, H), float("nan"), dtype=torch.bfloat16, device="cuda"))
    stacked = torch.cat([qtg, qtu], 2).contiguous()
    st = torch.cat([sg, su], 1).contiguous()
    same = ops.grouped_mm_fp8(qdh, sdh, stacked, st, be, b_transposed=True,
                              out=torch.full((M, H), float("nan"), dtype=torch.bfloat16, device="cuda"))
    assert torch.equal(got.view(torch.int16), same.view(torch.int16))
    live = torch.tensor(blocks).repeat_interleave(128) >= 0
    want = torch.zeros(M, H, dtype=torch.float64)
    for i, e in enumerate(blocks):
        if e >= 0:
            rows = slice(128 * i, 128 * i + 128)
            want[rows] = fp8.block_scaled_mm_reference(qdh[rows].cpu(), sdh[:, rows].cpu(), stacked[e].cpu(),
                                                       st[e].t().contiguous().cpu())
    err = (got.double().cpu()[live] - want[live]).abs()
    assert torch.all(err <= want[live].abs() * 2.0 ** -7 + 1e-3 * want[live].abs().max()), err.max()
    assert torch.isnan(got[~live.cuda()].float()).all()
