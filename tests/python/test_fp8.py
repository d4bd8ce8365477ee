"""The fp8 block-scaling reference (mok.fp8, docs/precision.md): layouts, the scale rules, the
rounding bound, and the float64 oracle of a block-scaled GEMM step.  CPU only."""
import pytest
import torch

from mok import fp8


def _blocks_of_rows(x):
    m, k = x.shape
    return x.float().reshape(m, k // 128, 128)


@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_rows_layout_scales_and_bound(pow2):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 384, generator=g) * torch.logspace(-3, 3, 7).unsqueeze(1)).bfloat16()
    x[3, 128:256] = 0  # a block of zeros
    q, s = fp8.quantize_rows(x, pow2=pow2)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (7, 384)
    assert s.dtype == torch.float32 and s.shape == (3, 7)  # k-block-major: [K/128, M]
    amax = _blocks_of_rows(x).abs().amax(-1).t()  # [K/128, M]
    assert s[1, 3] == 1 and torch.all(q[3, 128:256].float() == 0)
    live = amax > 0
    if pow2:
        assert torch.all(torch.log2(s).frac() == 0), "UE8M0 scales are powers of two"
        assert torch.all(s[live] >= amax[live] / fp8.E4M3_MAX)
        assert torch.all(s[live] < 2 * amax[live] / fp8.E4M3_MAX)
    else:
        # each live block's largest value lands on the format's largest
        qmax = _blocks_of_rows(q.float()).abs().amax(-1).t()
        assert torch.all(qmax[live] == fp8.E4M3_MAX)
    # round to nearest in e4m3: within 2^-4 of the value, or of the smallest subnormal step
    deq = fp8.dequantize_rows(q, s)
    step = s.t().repeat_interleave(128, dim=1)
    err = (deq - x.float()).abs()
    assert torch.all(err <= x.float().abs() * 2.0 ** -4 + step * 2.0 ** -10)


@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_blocks_partial_rows_and_experts(pow2):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 200, 256, generator=g).bfloat16()  # 200 rows: a partial second block
    w[1, 128:, :128] = 0
    q, s = fp8.quantize_blocks(w, pow2=pow2)
    assert q.shape == w.shape and q.dtype == torch.float8_e4m3fn
    assert s.shape == (3, 2, 2)
    assert s[1, 1, 0] == 1 and torch.all(q[1, 128:, :128].float() == 0)
    want = w.float()[2, 128:200, 128:256].abs().max() / fp8.E4M3_MAX
    if pow2:
        assert s[2, 1, 1] >= want and s[2, 1, 1] < 2 * want
    else:
        assert s[2, 1, 1] == want
    deq = fp8.dequantize_blocks(q, s)
    scale = s.repeat_interleave(128, 1)[:, :200].repeat_interleave(128, 2)
    assert torch.all((deq - w.float()).abs() <= w.float().abs() * 2.0 ** -4 + scale * 2.0 ** -10)


def test_block_scaled_reference_is_the_recipe():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(6, 256, generator=g)
    b = torch.randn(130, 256, generator=g)
    qa, sa = fp8.quantize_rows(a)
    qb, sb = fp8.quantize_blocks(b)
    ref = fp8.block_scaled_mm_reference(qa, sa, qb, sb)
    assert ref.dtype == torch.float64 and ref.shape == (6, 130)
    # element by element, the definition
    for m, n in [(0, 0), (5, 129), (3, 127), (2, 128)]:
        want = 0.0
        for kb in range(2):
            part = sum(float(qa[m, k].float()) * float(qb[n, k].float()) for k in range(kb * 128, kb * 128 + 128))
            want += part * float(sa[kb, m]) * float(sb[n // 128, kb])
        assert ref[m, n].item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    # and the dequantised product: close to the full-precision one
    exact = a.double() @ b.double().t()
    assert (ref - exact).abs().max() < 0.1 * exact.abs().max()


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.quantize_rows(torch.randn(2, 100))
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        fp8.quantize_rows(torch.randn(2, 2, 128))
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        fp8.quantize_blocks(torch.zeros(128, 128, dtype=torch.int32))
