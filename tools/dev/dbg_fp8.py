"""Session 25 debugging of the fp8_block layer forward on CUDA and the quantising gate/up
epilogue: where the values go wrong (not a test)."""
import sys
import torch
sys.path.insert(0, "python")
sys.path.insert(0, "tests/python")
import mok
import mok.config
from mok import fp8, ops, functional as F
from oracle import make_routing, make_weights, make_x
from test_fp8_ops import _problem

torch.set_printoptions(precision=5, linewidth=200)
H, I, E, K, T = 256, 256, 4, 2, 37
for shared in (0, 128):
    g = torch.Generator().manual_seed(20 + shared)
    w = make_weights(g, H, I, E, shared)
    x = make_x(g, T, H)
    ids, tw = make_routing(g, T, E, K)
    cfg = F.MoKConfig(precision="fp8_block")
    y_ref, _ = F.forward(x, ids, tw, **w, config=cfg)
    wc = {n: (None if v is None else v.cuda()) for n, v in w.items()}
    for poison in (False, True):
        mok.config.poison_outputs = poison
        y, ctx = F.forward(x.cuda(), ids.cuda(), tw.cuda(), **wc, config=cfg)
        torch.cuda.synchronize()
        yf = y.float().cpu()
        bad = ~torch.isfinite(yf)
        print(f"shared={shared} poison={poison}: non-finite {int(bad.sum())} of {bad.numel()}; rows with any "
              f"{bad.any(1).nonzero().flatten().tolist()[:12]}; cols with any {bad.any(0).nonzero().flatten().tolist()[:4]}..")
        ok = torch.isfinite(yf).all(1)
        if ok.any():
            d = (yf[ok].double() - y_ref[ok].double()).norm() / y_ref[ok].double().norm()
            print(f"   finite rows {int(ok.sum())}: rel Frobenius vs CPU ref {d.item():.3e}")
        percol = (yf.double() - y_ref.double()).abs().nan_to_num(1e9).amax(0)
        print("   max |diff| by 32-col group:", [f"{v:.2e}" for v in percol.reshape(-1, 32).amax(1).tolist()])
    mok.config.poison_outputs = False
    from mok.quantized import quantize_weights
    gq = quantize_weights(**wc, transposed=False)
    cq = quantize_weights(**w, transposed=False)
    for n in ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down"):
        a, b = gq[n], cq[n]
        if a is None:
            continue
        print(f"   {n}: q equal {torch.equal(a.q.cpu().view(torch.uint8), b.q.view(torch.uint8))}, scales equal "
              f"{torch.equal(a.scales.cpu(), b.scales)}, q NaN bytes {int((a.q.view(torch.uint8) & 0x7f == 0x7f).sum())}")

for pow2 in (False, True):
    E2, N, K2, blocks = 2, 256, 384, [1, -1, 0]
    qa, sa, qb0, sb0, be, qb1, sb1 = _problem(E2, N, K2, blocks, "cuda", True, seed=3)
    M = 128 * len(blocks)
    q, s = ops.grouped_mm_fp8(qa, sa, qb0, sb0, be, qb1, sb1, out=torch.zeros(M, N, device="cuda").to(torch.float8_e4m3fn),
                              quantize_out=True, pow2=pow2)
    a16 = ops.grouped_mm_fp8(qa, sa, qb0, sb0, be, qb1, sb1).float().cpu()
    for i, e in enumerate(blocks):
        if e < 0:
            continue
        rows = slice(128 * i, 128 * i + 128)
        gg = fp8.block_scaled_mm_reference(qa[rows].cpu(), sa[:, rows].cpu(), qb0[e].cpu(), sb0[e].cpu())
        uu = fp8.block_scaled_mm_reference(qa[rows].cpu(), sa[:, rows].cpu(), qb1[e].cpu(), sb1[e].cpu())
        want = torch.nn.functional.silu(gg) * uu
        for c in range(N // 128):
            cols = slice(128 * c, 128 * c + 128)
            wv = want[:, cols]
            amax = wv.abs().amax(1)
            gs = s[c, rows].double().cpu()
            qf = q[rows, cols].float().double().cpu()
            deq = qf * gs[:, None]
            err = (deq - wv).abs() - (wv.abs() * 0.07 + gs[:, None] * 0.002)
            r, cc = divmod(int(err.argmax()), 128)
            print(f"pow2={pow2} block {i} (expert {e}) cols {c}: scale/(amax/448) in [{(gs / (amax / 448)).min():.4f}, "
                  f"{(gs / (amax / 448)).max():.4f}]; worst row {r} col {cc}: want {wv[r, cc]:.5g} deq {deq[r, cc]:.5g} "
                  f"bf16 kind {a16[128 * i + r, 128 * c + cc]:.5g} scale {gs[r]:.4g}; violations {int((err > 0).sum())}; "
                  f"bf16 kind vs want rel {((a16[rows, cols].double() - wv).norm() / wv.norm()).item():.2e}")
