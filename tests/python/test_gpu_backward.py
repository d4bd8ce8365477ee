"""The CUDA backward (EP = 1) against the float64 oracle and the CPU reference: odd routings,
weights 0 and negative, a ring that wraps (experts whose rows span macrobatches, fp32 partial
sums in between), main_grad accumulation, bitwise repeatability, graph replay, autograd, and
the BENCH.md shapes at full size (sampled against float64 on the GPU).  Outputs start as NaN
(conftest: poison_outputs)."""
import pytest
import torch

import mok
from mok import functional as F
from oracle import (BENCH_SHAPES, GRADS, WEIGHTS, assert_close, assert_grads_bitwise, bench_shape_layer, make_routing,
                    make_weights, make_x, reference, route_term_norms)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not mok.has_cuda(), reason="libmok was built without its CUDA part"),
]

def _layer(gen, H, I, E, k, T, I_s=0, masked=0.15):
    w = make_weights(gen, H, I, E, I_s)
    ids, tw = make_routing(gen, T, E, k, masked=masked)
    return make_x(gen, T, H), ids, tw, w, make_x(gen, T, H)


def _cuda(w):
    return {n: (t.cuda() if t is not None else None) for n, t in w.items()}


def _backward(x, ids, tw, w, dy, config=None, main_grads=None, workspace=None):
    ctx = F.recompute_forward_context(x.cuda(), ids.cuda(), tw.cuda(), **_cuda(w), config=config, workspace=workspace)
    return F.backward(ctx, dy.cuda(), main_grads=main_grads)


def _grad(g, name):
    return getattr(g, name)


def _check_against_oracle(tag, g, x, ids, tw, w, dy):
    _, ref = reference(x, ids, tw, w, dy)
    assert_close(f"{tag}: dx", g.dx.cpu(), ref["dx"])
    assert_close(f"{tag}: d_topk_weights", g.d_topk_weights.cpu(), ref["d_topk_weights"],
                 floor=route_term_norms(x, ids, w, dy))
    assert torch.all(g.d_topk_weights.cpu()[ids.long() == -1] == 0), f"{tag}: masked routes need d topk_weights = 0"
    for name in WEIGHTS:
        if w[name] is None:
            assert _grad(g, name) is None
        else:
            assert_close(f"{tag}: grad {name}", _grad(g, name).cpu(), ref[name])


@pytest.mark.parametrize("H,I,E,k,T,I_s,masked", [
    (256, 256, 8, 2, 300, 0, 0.15),      # T not a multiple of 128, -1 routes, fully masked tokens
    (512, 256, 16, 4, 257, 256, 0.0),    # shared expert
    (256, 512, 4, 1, 129, 256, 0.0),     # k = 1
    (256, 256, 8, 2, 0, 256, 0.0),       # T = 0: zeros for every weight gradient
    (768, 256, 32, 8, 64, 0, 0.3),       # experts with 0 rows and 1 row
])
def test_cuda_backward_matches_oracle_and_cpu(gen, H, I, E, k, T, I_s, masked):
    x, ids, tw, w, dy = _layer(gen, H, I, E, k, T, I_s, masked)
    g = _backward(x, ids, tw, w, dy)
    _check_against_oracle("CUDA backward", g, x, ids, tw, w, dy)
    # The CPU reference backend rounds the same way (its sums run in another order)
    _, ctx = F.forward(x, ids, tw, **w)
    c = F.backward(ctx, dy)
    for name in GRADS:
        if _grad(c, name) is not None:
            assert_close(f"CUDA vs CPU reference: {name}", _grad(g, name).cpu(), _grad(c, name).double(), tol=1e-2)
    if T == 0:
        for name in WEIGHTS:
            if w[name] is not None:
                assert (_grad(g, name) == 0).all(), f"T = 0: grad {name} must be zero"
    for _ in range(3):
        assert_grads_bitwise("run again", g, _backward(x, ids, tw, w, dy))


@pytest.mark.parametrize("H,I,E,k,T,I_s", [(512, 256, 16, 4, 257, 256), (256, 256, 8, 2, 300, 0), (256, 256, 8, 2, 0, 256)])
@pytest.mark.parametrize("path", ["fused", "unfused"])
def test_cuda_backward_reads_the_saved_pre_activations_bitwise(gen, monkeypatch, H, I, E, k, T, I_s, path):
    # A training forward keeps h = [g | u]: the backward reads it instead of recomputing it, and
    # gets the same bits (the forward's gate/up tiles are the replay's); y does not change.
    if path == "unfused":
        monkeypatch.setenv("MOK_FORWARD_PATH", "unfused")
    x, ids, tw, w, dy = _layer(gen, H, I, E, k, T, I_s)
    args = (x.cuda(), ids.cuda(), tw.cuda())
    y_plain, ctx_plain = F.forward(*args, **_cuda(w), save_for_backward=False)
    y, ctx = F.forward(*args, **_cuda(w))
    assert ctx_plain.saved is None and ctx.saved is not None
    assert torch.equal(y, y_plain), "saving the pre-activations changed y"
    g_saved = F.backward(ctx, dy.cuda())
    g_replay = F.backward(ctx_plain, dy.cuda())
    assert_grads_bitwise(f"saved vs recomputed ({path} forward)", g_saved, g_replay)
    _check_against_oracle("saved pre-activations", g_saved, x, ids, tw, w, dy)


def test_cuda_backward_weights_zero_negative_and_a_hot_expert(gen):
    # d topk_weights is <da, a> for every weight (0 and < 0 included: no division by w); every
    # token routes to expert 0 first (one hot expert with all rows, spanning row blocks)
    H, I, E, k, T = 256, 256, 8, 3, 400
    x, ids, tw, w, dy = _layer(gen, H, I, E, k, T, 256, masked=0.0)
    others = torch.rand(T, E - 1, generator=gen).argsort(dim=1)[:, :k - 1] + 1
    ids = torch.cat([torch.zeros(T, 1, dtype=torch.int64), others], 1).int().contiguous()
    tw[:, 0] = 0.0
    tw[:, 1] = -tw[:, 1].abs() - 0.1
    ids[::7] = -1  # tokens with every route masked
    g = _backward(x, ids, tw, w, dy)
    _check_against_oracle("w = 0, w < 0, hot expert", g, x, ids, tw, w, dy)
    assert g.d_topk_weights[:, 0].abs().sum() > 0, "w = 0 must still get its router gradient"


def test_cuda_backward_ring_wraps_with_fp32_partial_sums_and_main_grads(gen):
    # A ring of 256 rows: experts span macrobatches, their fp32 sums fold in ascending order
    H, I, E, k, T = 256, 256, 4, 2, 700
    x, ids, tw, w, dy = _layer(gen, H, I, E, k, T, 256, masked=0.05)
    small = F.MoKConfig(minibatch_size=128, macrobatch_size=256)
    g = _backward(x, ids, tw, w, dy, config=small)
    _check_against_oracle("ring of 256 rows", g, x, ids, tw, w, dy)
    big = _backward(x, ids, tw, w, dy)
    for name in ("dx", "d_topk_weights"):  # rows are independent of the ring
        assert torch.equal(_grad(g, name), _grad(big, name)), f"{name} depends on the ring size"
    # main_grad += the fp32 gradient (whose bf16 rounding is the returned gradient)
    start = {n: torch.randn(w[n].shape, generator=gen).cuda() for n in WEIGHTS}
    mg = {n: t.clone() for n, t in start.items()}
    g2 = _backward(x, ids, tw, w, dy, config=small, main_grads=mg)
    assert_grads_bitwise("with main_grads", g, g2)
    for n in WEIGHTS:
        added = mg[n] - start[n]
        assert_close(f"main_grad {n} increment", added.cpu(), _grad(g, n).double().cpu(), tol=1e-2)
        assert (added.bfloat16() == _grad(g, n)).float().mean() > 0.99, f"main_grad {n}: not the fp32 gradient"


def test_cuda_backward_in_graph_replays_with_new_inputs(gen):
    H, I, E, k, T = 512, 256, 16, 4, 300
    x, ids, tw, w, dy = _layer(gen, H, I, E, k, T, 256)
    cw = _cuda(w)
    sx, sids, stw, sdy = x.cuda(), ids.cuda(), tw.cuda(), dy.cuda()
    ws = F.get_workspace(H, I, E, k, max_tokens=512, shared_intermediate=256, device="cuda")
    ctx = F.recompute_forward_context(sx, sids, stw, **cw, workspace=ws)
    F.backward(ctx, sdy)  # warm-up outside capture (allocates the backward's buffers)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static, ctx_static = F.forward(sx, sids, stw, **cw, workspace=ws)
        g_static = F.backward(ctx_static, sdy)
    for _ in range(5):
        nx, (nids, ntw), ndy = make_x(gen, T, H), make_routing(gen, T, E, k), make_x(gen, T, H)
        sx.copy_(nx.cuda())
        sids.copy_(nids.cuda())
        stw.copy_(ntw.cuda())
        sdy.copy_(ndy.cuda())
        graph.replay()
        y, c = F.forward(sx, sids, stw, **cw, workspace=ws)
        assert torch.equal(y_static, y), "graph replay of the forward differs from eager"
        assert_grads_bitwise("graph replay", g_static, F.backward(c, sdy))


def test_cuda_backward_through_autograd_and_torch_library(gen):
    H, I, E, k, T = 256, 256, 8, 2, 200
    moe = mok.nn.MoE(H, I, E, k, shared_intermediate=256, device="cuda")
    x = make_x(gen, T, H).cuda().requires_grad_()
    y = moe(x)
    dy = make_x(gen, T, H).cuda()
    (y.float() * dy.float()).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    for name, p in moe.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad.float()).all(), f"{name} got no finite gradient"
    # torch.compile of forward + backward through the library op's fake implementation
    x2 = x.detach().clone().requires_grad_()

    def step(v):
        return (moe(v).float() * dy.float()).sum()

    torch.compile(step, backend="aot_eager")(x2).backward()
    assert torch.equal(x2.grad, x.grad), "compiled forward + backward differs from eager"


def test_cuda_backward_rejects_what_it_cannot_run(gen):
    x, ids, tw, w, dy = _layer(gen, 256, 96, 8, 2, 10)  # I = 96: not a multiple of 64
    with pytest.raises(NotImplementedError, match="intermediate = 96 must be a multiple of 64"):
        _backward(x, ids, tw, w, dy)
    x, ids, tw, w, dy = _layer(gen, 256, 256, 8, 2, 10)
    ctx = F.recompute_forward_context(x.cuda(), ids.cuda(), tw.cuda(), **_cuda(w))
    with pytest.raises(ValueError, match="dy"):
        F.backward(ctx, dy[:-1].cuda())


@pytest.mark.parametrize("name", ["dsv3", "qwen3", "fg30b", "fg120b"])
def test_cuda_backward_bench_shapes(gen, name):
    # Full size with the default config; sampled tokens and one expert's weight gradients
    # against float64 on the GPU, and two runs bitwise equal.
    H, I, k, E, T = BENCH_SHAPES[name]
    dev = "cuda"
    x, ids, tw, w = bench_shape_layer(gen, name, dev)
    dy = (torch.randn(T, H, generator=gen) * 0.1).to(torch.bfloat16).to(dev)
    ctx = F.recompute_forward_context(x, ids, tw, **w)
    g = F.backward(ctx, dy)
    assert_grads_bitwise(name, g, F.backward(ctx, dy))
    _, saved_ctx = F.forward(x, ids, tw, **w)  # the training forward's saved pre-activations
    assert_grads_bitwise(f"{name}: saved vs recomputed", g, F.backward(saved_ctx, dy))
    del saved_ctx
    # Per-route float64 quantities of the sampled tokens
    sample = torch.randperm(T, generator=gen)[:16].tolist()
    dx_ref = torch.zeros(16, H, dtype=torch.float64, device=dev)
    dtw_ref = torch.zeros(16, k, dtype=torch.float64, device=dev)
    for r, t in enumerate(sample):
        v, d = x[t].double(), dy[t].double()
        for j in range(k):
            e = int(ids[t, j])
            wg, wu, wd = w["w_gate"][e].double(), w["w_up"][e].double(), w["w_down"][e].double()
            gg, uu = wg @ v, wu @ v
            sg = torch.sigmoid(gg)
            da = wd.T @ d
            dtw_ref[r, j] = (da * (gg * sg * uu)).sum()
            wda = tw[t, j].double() * da
            dg = wda * uu * sg * (1 + gg * (1 - sg))
            du = wda * gg * sg
            dx_ref[r] += wg.T @ dg + wu.T @ du
    assert_close(f"{name}: dx of 16 sampled tokens", g.dx[sample].cpu(), dx_ref.cpu())
    assert_close(f"{name}: d topk_weights of 16 sampled tokens", g.d_topk_weights[sample].cpu(), dtw_ref.cpu())
    # Expert 0's weight gradients over all its rows
    tok, j = (ids.long() == 0).nonzero(as_tuple=True)
    v, d, wt = x[tok].double(), dy[tok].double(), tw[tok, j].double().unsqueeze(1)
    wg, wu, wd = w["w_gate"][0].double(), w["w_up"][0].double(), w["w_down"][0].double()
    gg, uu = v @ wg.T, v @ wu.T
    sg = torch.sigmoid(gg)
    a = gg * sg * uu
    da = d @ wd
    dg = wt * da * uu * sg * (1 + gg * (1 - sg))
    du = wt * da * gg * sg
    assert_close(f"{name}: grad w_down[0]", g.w_down[0].cpu(), (d.T @ (wt * a)).cpu())
    assert_close(f"{name}: grad w_gate[0]", g.w_gate[0].cpu(), (dg.T @ v).cpu())
    assert_close(f"{name}: grad w_up[0]", g.w_up[0].cpu(), (du.T @ v).cpu())


def _both_paths(monkeypatch, run):
    """run() under MOK_BACKWARD_PATH=unfused (the separate launches) and fused (the megakernel)."""
    monkeypatch.setenv("MOK_BACKWARD_PATH", "unfused")
    unfused = run()
    monkeypatch.setenv("MOK_BACKWARD_PATH", "fused")
    return unfused, run()


@pytest.mark.parametrize("H,I,E,k,T,I_s,masked,ring", [
    (512, 256, 16, 4, 257, 256, 0.0, 0),    # shared expert, default ring
    (256, 256, 8, 2, 300, 0, 0.15, 0),      # -1 routes, fully masked tokens
    (256, 512, 4, 1, 129, 256, 0.0, 0),     # k = 1
    (256, 256, 8, 2, 0, 256, 0.0, 0),       # T = 0: zero weight gradients, shared included
    (768, 256, 32, 8, 64, 0, 0.3, 0),       # experts with 0 rows and 1 row
    (256, 256, 4, 2, 700, 256, 0.05, 256),  # a ring of 256 rows: fp32 sums across macrobatches
    (256, 256, 64, 4, 300, 0, 0.0, 128),    # more experts than macrobatches, one block each
])
@pytest.mark.parametrize("saved", [False, True])
def test_fused_backward_equals_unfused_bitwise(gen, monkeypatch, H, I, E, k, T, I_s, masked, ring, saved):
    # The fused backward kernel runs the unfused launches' tiles with their K loops and epilogues
    # (wgrad_piece: the same fp32 pieces): every output bit for bit, main_grads included
    x, ids, tw, w, dy = _layer(gen, H, I, E, k, T, I_s, masked)
    config = F.MoKConfig(minibatch_size=128, macrobatch_size=ring) if ring else None
    start = {n: torch.randn(w[n].shape, generator=gen).cuda() for n in WEIGHTS if w[n] is not None}
    cw = _cuda(w)
    args = (x.cuda(), ids.cuda(), tw.cuda())

    def run():
        if saved:
            _, ctx = F.forward(*args, **cw, config=config)
        else:
            ctx = F.recompute_forward_context(*args, **cw, config=config)
        mg = {n: t.clone() for n, t in start.items()}
        return F.backward(ctx, dy.cuda(), main_grads=mg), mg

    (gu, mgu), (gf, mgf) = _both_paths(monkeypatch, run)
    assert_grads_bitwise("fused vs unfused", gu, gf)
    for n in start:
        assert torch.equal(mgu[n].view(torch.int32), mgf[n].view(torch.int32)), f"main_grad {n}: fused differs"
    _check_against_oracle("fused backward", gf, x, ids, tw, w, dy)
    for _ in range(2):
        assert_grads_bitwise("fused, run again", gf, run()[0])


def test_fused_backward_bench_shape_equals_unfused(gen, monkeypatch):
    # dsv3 at full size, the default config, the training forward's saved h
    x, ids, tw, w = bench_shape_layer(gen, "dsv3", "cuda")
    T, H = x.shape
    dy = (torch.randn(T, H, generator=gen) * 0.1).to(torch.bfloat16).cuda()
    _, ctx = F.forward(x, ids, tw, **w)
    gu, gf = _both_paths(monkeypatch, lambda: F.backward(ctx, dy))
    assert_grads_bitwise("dsv3: fused vs unfused", gu, gf)


@pytest.mark.parametrize("H,E,k,T,ring", [(512, 16, 4, 257, 0), (256, 4, 2, 700, 256), (768, 32, 8, 64, 0)])
@pytest.mark.parametrize("start", ["0", "3", "5"])
def test_fused_backward_start_gathers_equal_unfused(gen, monkeypatch, H, E, k, T, ring, start):
    # MOK_BACKWARD_START_GATHER=n: every block gathers the first n minibatches at the kernel's
    # start (the default 1; 0: the comm blocks gather all; past the plan's rows it is clamped):
    # the same rows, the same bits
    x, ids, tw, w, dy = _layer(gen, H, 256, E, k, T, 256, masked=0.1)
    config = F.MoKConfig(minibatch_size=128, macrobatch_size=ring) if ring else None
    monkeypatch.setenv("MOK_BACKWARD_START_GATHER", start)
    gu, gf = _both_paths(monkeypatch, lambda: _backward(x, ids, tw, w, dy, config=config))
    assert_grads_bitwise(f"start gather {start}: fused vs unfused", gu, gf)


@pytest.mark.parametrize("H,I,E,k,T,I_s,ring,transposed", [
    (512, 256, 16, 4, 1500, 256, 0, False),   # whole wgrad tiles (TMA stores), the shared expert's beside
    (256, 320, 8, 2, 900, 0, 0, False),       # partial tiles keep the register epilogue
    (256, 256, 4, 2, 700, 0, 256, False),     # fp32 pieces across macrobatches: not stored by TMA
    (512, 256, 16, 4, 1500, 0, 0, True),      # transposed weights: gradients transposed, gate/up split along N
])
@pytest.mark.parametrize("saved", [False, True])
def test_fused_backward_tma_store_tiles_equal_unfused(gen, monkeypatch, H, I, E, k, T, I_s, ring, transposed, saved):
    # Without main_grads the fused backward's whole, final routed wgrad tiles leave through two
    # stages of the ring and TMA stores (ops_bwd/wgrad.cuh); the unfused launches' wgrad kernel
    # stores from registers: the same bits.  Transposed weights (which the unfused launches do not
    # read) against the unfused launches on the row-major copies
    x, ids, tw, w, dy = _layer(gen, H, I, E, k, T, I_s, 0.05)
    config = F.MoKConfig(minibatch_size=128, macrobatch_size=ring) if ring else None
    args = (x.cuda(), ids.cuda(), tw.cuda())

    def run(cw):
        if saved:
            _, ctx = F.forward(*args, **cw, config=config)
        else:
            ctx = F.recompute_forward_context(*args, **cw, config=config)
        return F.backward(ctx, dy.cuda())

    monkeypatch.setenv("MOK_BACKWARD_PATH", "unfused")
    ref = run(_cuda(w))
    monkeypatch.setenv("MOK_BACKWARD_PATH", "fused")
    cw = _cuda(w)
    if transposed:
        for n in ("w_gate", "w_up", "w_down"):
            cw[n] = cw[n].transpose(-1, -2).contiguous().transpose(-1, -2)
    got = run(cw)
    if transposed:
        assert got.w_down.stride(-2) == 1, "transposed weights' gradients come column-major"
    assert_grads_bitwise("fused (TMA-store wgrad tiles) vs unfused", ref, got)

