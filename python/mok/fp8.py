"""DeepSeek-V3's fp8 block scaling (docs/precision.md), as mok's kernels lay it out: the reference
quantisers and the float64 oracle of a block-scaled GEMM.

    quantize_rows(x)     x [M, K]      -> e4m3 [M, K], scales [K/128, M]  (1 x 128: a row, 128 of K)
    quantize_blocks(w)   w [..., N, K] -> e4m3 [..., N, K], scales [..., ceil(N/128), K/128]
    block_scaled_mm_reference(qa, sa, qb, sb) = Σ over k-blocks of (qa · qbᵀ over the k-block)
                                                · sa · sb, in float64

A block's scale is amax / 448 (E4M3_MAX), or with pow2=True its power-of-two ceiling (the UE8M0
scales DeepSeek-V3 and TransformerEngine use, with which scaling is exact); a block of zeros
has scale 1. Values are x / scale rounded to nearest even and saturated to ±448. The activation
scales are k-block-major ([K/128, M]) because the GEMM's producer loads a tile's 128 row
scales of a k-block as one TMA box (gemm::GroupedGemmArgs.a_scales). Plain PyTorch: these run
on any device and are the definition the kernels' fused quantisation is tested against.
"""
from __future__ import annotations

from typing import Tuple

import torch

E4M3_MAX = 448.0
BLOCK = 128


def _check(t: torch.Tensor, name: str, min_dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < min_dims:
        raise ValueError(f"{name} must have at least {min_dims} dimensions, got shape {tuple(t.shape)}")
    if not (t.is_floating_point() and t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2)):
        raise TypeError(f"{name} must be a bf16, fp16 or fp32 tensor, got {t.dtype}")
    if t.shape[-1] % BLOCK != 0:
        raise ValueError(f"{name}: its last dimension (K = {t.shape[-1]}) must be a multiple of {BLOCK}")


def _scales(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    """fp32 scales from fp32 block maxima: amax / 448 (or its power-of-two ceiling); 1 for 0.
    Divided by a tensor, not a Python number: torch on CUDA multiplies by a number's reciprocal
    (1/448 is inexact), so that the reference is the same bits on every device."""
    s = amax / amax.new_full((), E4M3_MAX)
    if pow2:
        # 2^ceil(log2 s), exactly: frexp gives s = m · 2^e with m in [0.5, 1)
        m, e = torch.frexp(s)
        s = torch.ldexp(torch.ones_like(s), torch.where(m == 0.5, e - 1, e))
    return torch.where(amax > 0, s, torch.ones_like(s))


def _quantize(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_rows(x: torch.Tensor, *, pow2: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [K/128, M]): a scale per row and 128 of K."""
    _check(x, "x", 2)
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    s = _scales(blocks.abs().amax(dim=-1), pow2)  # [M, K/128]
    q = _quantize(blocks, s.unsqueeze(-1)).reshape(m, k)
    return q, s.t().contiguous()


def quantize_blocks(w: torch.Tensor, *, pow2: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (e4m3 [..., N, K], fp32 scales [..., ceil(N/128), K/128]): a scale per
    128 x 128 block (a partial last block of rows has its own)."""
    _check(w, "w", 2)
    *lead, n, k = w.shape
    nb = (n + BLOCK - 1) // BLOCK
    wf = w.float()
    if nb * BLOCK != n:  # zero rows to whole blocks (zeros do not change a block's max)
        wf = torch.cat([wf, wf.new_zeros(*lead, nb * BLOCK - n, k)], dim=-2)
    blocks = wf.reshape(*lead, nb, BLOCK, k // BLOCK, BLOCK)
    s = _scales(blocks.abs().amax(dim=(-3, -1)), pow2)  # [..., nb, K/128]
    q = _quantize(blocks, s.unsqueeze(-2).unsqueeze(-1)).reshape(*lead, nb * BLOCK, k)[..., :n, :]
    return q.contiguous(), s


def quantize_cols(v: torch.Tensor, *, pow2: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """v [R, C] (R, C multiples of 128) -> (e4m3 [C, R]: v transposed, fp32 scales [R/128, C]):
    a scale per column and 128 rows (the wgrad operands, per channel and 128 tokens of an
    expert, written K-major for the fp8 wgrad kind)."""
    _check(v, "v", 2)
    r, c = v.shape
    if r % BLOCK or c % BLOCK:
        raise ValueError(f"v is [{r}, {c}]: both must be multiples of {BLOCK}")
    blocks = v.float().reshape(r // BLOCK, BLOCK, c)
    s = _scales(blocks.abs().amax(dim=1), pow2)  # [R/128, C]
    q = _quantize(blocks, s.unsqueeze(1)).reshape(r, c)
    return q.t().contiguous(), s


def wgrad_reference(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor, offsets, counts
                    ) -> torch.Tensor:
    """The fp8 wgrad kind's recipe in float64: out[e][m, n] = Σ over expert e's k-blocks of 128
    rows of (Σ_r qa[m, r]·qb[n, r]) · sa[kb, m] · sb[kb, n], for qa [Mo, R], qb [No, R] e4m3 and
    their scales [R/128, Mo], [R/128, No] (quantize_cols); offsets / counts per expert."""
    a, b = qa.double(), qb.double()
    out = torch.zeros(len(counts), qa.shape[0], qb.shape[0], dtype=torch.float64)
    for e, (o, n) in enumerate(zip(offsets, counts)):
        for kb in range(o // BLOCK, (o + n + BLOCK - 1) // BLOCK):
            part = a[:, kb * BLOCK:(kb + 1) * BLOCK] @ b[:, kb * BLOCK:(kb + 1) * BLOCK].t()
            out[e] += part * sa[kb].double()[:, None] * sb[kb].double()[None, :]
    return out


def dequantize_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The fp32 values quantize_rows' output stands for: q · scale."""
    m, k = q.shape
    return (q.float().reshape(m, k // BLOCK, BLOCK) * s.t().unsqueeze(-1)).reshape(m, k)


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The fp32 values quantize_blocks' output stands for: q · its block's scale."""
    *_, n, k = q.shape
    full = s.repeat_interleave(BLOCK, dim=-2)[..., :n, :].repeat_interleave(BLOCK, dim=-1)
    return q.float() * full


def block_scaled_mm_reference(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """float64 [M, N] = Σ over k-blocks kb of (Σ over k in kb of qa[m, k] · qb[n, k]) · sa[kb, m] ·
    sb[n / 128, kb]: the math of a block-scaled GEMM step (qa [M, K], sa [K/128, M], qb [N, K],
    sb [ceil(N/128), K/128]), exactly."""
    m, k = qa.shape
    n = qb.shape[0]
    kb = k // BLOCK
    a = qa.double().reshape(m, kb, BLOCK)
    b = qb.double().reshape(n, kb, BLOCK)
    partial = torch.einsum("mkc,nkc->kmn", a, b)  # [K/128, M, N]
    sbn = sb.double().repeat_interleave(BLOCK, dim=0)[:n]  # [N, K/128]
    return (partial * sa.double().unsqueeze(-1) * sbn.t().unsqueeze(1)).sum(dim=0)
