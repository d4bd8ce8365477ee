"""GPU tests: the device-built schedule equals the host one bit for bit, device-side route
validation, the CUDA forward against the float64 oracle (small shapes and every shape of
bench/shapes.py), graph capture, and clear errors for what is not built yet. Skipped without a GPU."""
import pytest
import torch

import mok
from mok import functional as F
from oracle import BENCH_SHAPES, WEIGHTS, assert_close, bench_shape_layer, make_routing, make_weights, make_x, reference

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not mok.has_cuda(), reason="libmok was built without its CUDA part"),
]

NO_ERROR = 0x7FFFFFFFFFFFFFFF
PLAN_FIELDS = ("rows", "expert_count", "expert_offset", "block_expert", "error")


def _plans_equal(a, b, what):
    for name in PLAN_FIELDS:
        ta, tb = getattr(a, name).cpu(), getattr(b, name).cpu()
        assert torch.equal(ta, tb), f"{what}: {name} differs between the device and the host build"


def _routing(kind, gen, T, E, k, ids_dtype):
    if kind == "uniform":
        return make_routing(gen, T, E, k, ids_dtype, masked=0.0)[0]
    if kind == "masked":
        return make_routing(gen, T, E, k, ids_dtype, masked=0.4)[0]
    # All tokens to the last expert, the other routes spread over the rest.
    ids = torch.rand(T, E - 1, generator=gen).argsort(dim=1)[:, :k]
    ids[:, 0] = E - 1
    return ids.to(ids_dtype).contiguous()


@pytest.mark.parametrize("kind", ["uniform", "one_expert", "masked"])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_device_schedule_equals_host(gen, kind, P, ids_dtype):
    E, k = 4 * P, 3
    counts = [300, 513, 0, 256][:P] if P > 1 else [777]
    ids = [_routing(kind, gen, T, E, k, ids_dtype) for T in counts]
    for config in (F.MoKConfig(), F.MoKConfig(block_m=64, minibatch_size=128, macrobatch_size=256)):
        for rank in range(P):
            host = F.build_schedule(ids, E, ep_rank=rank, max_tokens=800, config=config)
            dev = F.build_schedule([t.cuda() for t in ids], E, ep_rank=rank, max_tokens=800, config=config)
            assert dev.rows.is_cuda
            _plans_equal(dev, host, f"{kind} P={P} rank={rank} block_m={config.block_m}")
            dev.check()


def test_device_schedule_all_ranks_empty():
    ids = [torch.zeros(0, 2, dtype=torch.int64, device="cuda") for _ in range(2)]
    dev = F.build_schedule(ids, 4, ep_rank=1)
    host = F.build_schedule([t.cpu() for t in ids], 4, ep_rank=1)
    _plans_equal(dev, host, "T=0 on every rank")
    assert dev.num_padded_rows == 0


def _first_bad_route(ids, num_experts):
    """Host computation of the device validation: cleaned ids and the lowest bad (rank, token, j)."""
    cleaned, first = [], None
    for s, t_ids in enumerate(ids):
        rows = t_ids.tolist()
        out = []
        for t, token in enumerate(rows):
            kept = list(token)
            for j, e in enumerate(token):
                bad = e < -1 or e >= num_experts or (e != -1 and e in token[:j])
                if bad:
                    kept[j] = -1
                    kind = 2 if (e < -1 or e >= num_experts) else 3
                    if first is None:
                        first = (s, t, j, e, kind)
            out.append(kept)
        cleaned.append(torch.tensor(out, dtype=t_ids.dtype).reshape(t_ids.shape))
    return cleaned, first


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_device_validation_masks_and_records(gen, ids_dtype):
    P, E, k = 3, 12, 4
    ids = [make_routing(gen, T, E, k, ids_dtype)[0] for T in (40, 300, 17)]
    ids[1][270, 2] = E                                       # out of range: the first bad route
    ids[1][299, 0] = -7                                      # out of range, later
    ids[1][280] = torch.tensor([2, 2, -1, 0], dtype=ids_dtype)  # duplicate, later
    ids[2][3] = torch.tensor([5, 6, 5, -1], dtype=ids_dtype)    # duplicate on the last rank
    cleaned, first = _first_bad_route(ids, E)
    assert first is not None and first[:3] == (1, 270, 2)
    for rank in range(P):
        dev = F.build_schedule([t.cuda() for t in ids], E, ep_rank=rank, max_tokens=300)
        host = F.build_schedule(cleaned, E, ep_rank=rank, max_tokens=300)
        for name in PLAN_FIELDS[:-1]:
            assert torch.equal(getattr(dev, name).cpu(), getattr(host, name)), f"rank {rank}: {name}"
        assert dev.first_error() == first
        with pytest.raises(ValueError, match=rf"rank 1: topk_ids\[270, 2\] = {E} is outside"):
            dev.check()
    # A duplicate alone is recorded as such.
    dup = [torch.tensor([[0, 1], [3, 3]], dtype=ids_dtype, device="cuda")]
    dev = F.build_schedule(dup, 4)
    assert dev.first_error() == (0, 1, 1, 3, 3)
    with pytest.raises(ValueError, match="duplicate"):
        dev.check()


def test_device_schedule_in_cuda_graph(gen):
    # The build needs no host synchronisation: it captures into a CUDA graph and replays.
    E, k = 8, 2
    ids = make_routing(gen, 200, E, k, torch.int32)[0].cuda()
    F.build_schedule(ids, E, max_tokens=256)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = F.build_schedule(ids, E, max_tokens=256)
    for _ in range(2):
        ids.copy_(make_routing(gen, 200, E, k, torch.int32)[0])
        graph.replay()
        torch.cuda.synchronize()
        _plans_equal(captured, F.build_schedule(ids.cpu(), E, max_tokens=256), "graph replay")


def _layer(gen, H, I, E, k, T, I_s=0, masked=0.15):
    w = make_weights(gen, H, I, E, I_s)
    ids, tw = make_routing(gen, T, E, k, masked=masked)
    return make_x(gen, T, H), ids, tw, w


@pytest.mark.parametrize("H,I,E,k,T,I_s,masked", [
    (256, 128, 8, 2, 300, 0, 0.15),      # T not a multiple of 128, -1 routes, a fully masked token
    (512, 256, 16, 4, 257, 256, 0.0),    # shared expert
    (256, 384, 4, 1, 129, 128, 0.0),     # k = 1
    (256, 128, 8, 2, 0, 128, 0.0),       # T = 0
    (768, 256, 32, 8, 64, 0, 0.3),       # experts with 0 rows
])
def test_cuda_forward_matches_oracle(gen, H, I, E, k, T, I_s, masked):
    x, ids, tw, w = _layer(gen, H, I, E, k, T, I_s, masked)
    dy = torch.zeros(T, H, dtype=torch.bfloat16)
    ref_y, _ = reference(x, ids, tw, w, dy)
    cuda_w = {n: (t.cuda() if t is not None else None) for n, t in w.items()}
    y, _ = F.forward(x.cuda(), ids.cuda(), tw.cuda(), **cuda_w)
    assert_close("y (CUDA)", y.cpu(), ref_y)
    y_cpu, _ = F.forward(x, ids, tw, **w)
    assert_close("y (CUDA) vs CPU reference", y.cpu(), y_cpu.double())
    for _ in range(5):
        again, _ = F.forward(x.cuda(), ids.cuda(), tw.cuda(), **cuda_w)
        assert torch.equal(again, y), "CUDA forward is not bitwise reproducible"


@pytest.mark.parametrize("name", ["dsv3", "dsv3-t2k", "qwen3", "qwen35", "glm5", "dsv4pro", "fg30b", "fg120b"])
def test_cuda_forward_bench_shapes(gen, name):
    # Every shape of bench/shapes.py (docs/benchmarks.md) at full size; a sample of tokens against
    # a float64 oracle on the GPU (a token's output does not depend on the other tokens: batch
    # invariance).
    # The default config throughout: T = 32768 (fg*) makes 130k rows, which mok's own choice of
    # minibatch and ring sizes must handle.
    H, I, k, E, T = BENCH_SHAPES[name]
    dev = "cuda"
    x, ids, tw, w = bench_shape_layer(gen, name, dev)
    y, _ = F.forward(x, ids, tw, **w)
    again, _ = F.forward(x, ids, tw, **w)
    assert torch.equal(y, again), f"{name}: not bitwise reproducible"
    sample = torch.randperm(T, generator=gen)[:32].to(dev)
    ref = torch.zeros(32, H, dtype=torch.float64, device=dev)
    for j in range(k):
        for r, t in enumerate(sample.tolist()):
            e = int(ids[t, j])
            v = x[t].double()
            a = torch.nn.functional.silu(w["w_gate"][e].double() @ v) * (w["w_up"][e].double() @ v)
            ref[r] += tw[t, j].double() * (w["w_down"][e].double() @ a)
    assert_close(f"y ({name}, 32 sampled tokens)", y[sample].cpu(), ref.cpu())


def test_cuda_forward_in_graph_replays_with_new_inputs(gen):
    x, ids, tw, w = _layer(gen, 512, 256, 16, 4, 300, 256)
    cuda_w = {n: t.cuda() for n, t in w.items()}
    sx, sids, stw = x.cuda(), ids.cuda(), tw.cuda()
    ws = F.get_workspace(512, 256, 16, 4, max_tokens=512, shared_intermediate=256, device="cuda")
    F.forward(sx, sids, stw, **cuda_w, workspace=ws)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static, _ = F.forward(sx, sids, stw, **cuda_w, workspace=ws)
    for _ in range(10):
        nx, (nids, ntw) = make_x(gen, 300, 512), make_routing(gen, 300, 16, 4)
        sx.copy_(nx.cuda())
        sids.copy_(nids.cuda())
        stw.copy_(ntw.cuda())
        graph.replay()
        eager, _ = F.forward(sx, sids, stw, **cuda_w, workspace=ws)
        assert torch.equal(y_static, eager), "graph replay differs from the eager forward"


def test_cuda_moe_module_forward(gen):
    x, ids, tw, w = _layer(gen, 256, 128, 8, 2, 10)
    moe = mok.nn.MoE(256, 128, 8, 2, device="cuda")
    y = moe(x.cuda())
    assert y.shape == x.shape and not torch.isnan(y).any()


def test_cuda_forward_unsupported_shape_is_a_clear_error(gen):
    x, ids, tw, w = _layer(gen, 64, 32, 8, 2, 10)
    args = [x.cuda(), ids.cuda(), tw.cuda()] + [w[n].cuda() if w[n] is not None else None for n in WEIGHTS]
    with pytest.raises(NotImplementedError, match="intermediate = 32 must be a multiple of 64"):
        F.forward(*args)


def test_workspace_device_must_match(gen):
    w = make_weights(gen, 64, 32, 8)
    ids, tw = make_routing(gen, 10, 8, 2)
    cuda_ws = F.create_workspace(64, 32, 8, 2, max_tokens=16, device="cuda:0")
    with pytest.raises(ValueError, match="workspace was built for cuda:0"):
        F.forward(make_x(gen, 10, 64), ids, tw, w["w_gate"], w["w_up"], w["w_down"], workspace=cuda_ws)


def test_cuda_forward_device_validation_raises_at_check(gen):
    x, ids, tw, w = _layer(gen, 256, 128, 8, 2, 50, masked=0.0)
    ids[17, 1] = 99
    cuda_w = {n: (t.cuda() if t is not None else None) for n, t in w.items()}
    ws = F.create_workspace(256, 128, 8, 2, max_tokens=64, device="cuda")
    y, _ = F.forward(x.cuda(), ids.cuda(), tw.cuda(), **cuda_w, workspace=ws)  # no host sync: no error yet
    with pytest.raises(ValueError, match=r"\[17, 1\] = 99"):
        ws.check_errors()
    # The bad route was masked: the result equals the oracle with that route removed.
    ids[17, 1] = -1
    ref_y, _ = reference(x, ids, tw, w, torch.zeros(50, 256, dtype=torch.bfloat16))
    assert_close("y with the bad route masked", y.cpu(), ref_y)
    ws.check_errors()  # reported once


@pytest.mark.parametrize("swiglu", [False, True])
def test_grouped_mm_matches_torch(gen, swiglu):
    E, K, N = 3, 512, 512
    blocks = torch.tensor([0, 0, 2, 1, 1, -1], dtype=torch.int32)
    a = torch.randn(len(blocks) * 128, K, generator=gen).bfloat16().cuda()
    b0 = (torch.randn(E, N, K, generator=gen) / K ** 0.5).bfloat16().cuda()
    b1 = (torch.randn(E, N, K, generator=gen) / K ** 0.5).bfloat16().cuda() if swiglu else None
    out = torch.full((a.shape[0], N), float("nan"), dtype=torch.bfloat16, device="cuda")
    mok.ops.grouped_mm(a, b0, blocks.cuda(), b1, out=out)
    for i, e in enumerate(blocks.tolist()):
        rows = slice(i * 128, (i + 1) * 128)
        if e < 0:
            assert torch.isnan(out[rows]).all(), "blocks past the end must stay unwritten"
            continue
        g = a[rows].double() @ b0[e].double().T
        want = torch.nn.functional.silu(g) * (a[rows].double() @ b1[e].double().T) if swiglu else g
        assert_close(f"grouped_mm block {i}", out[rows].cpu(), want.cpu())


def test_grouped_mm_gate_up_preact_is_the_gate_up_tiles_before_the_swiglu(gen):
    # h = [bf16(a @ w_gate[e].T) | bf16(a @ w_up[e].T)]: against float64, and its SwiGLU equals
    # the gate/up kind's output where the latter rounds once (same fp32 accumulators)
    E, K, N = 3, 512, 384
    blocks = torch.tensor([0, 2, 2, 1, -1], dtype=torch.int32).cuda()
    a = torch.randn(5 * 128, K, generator=gen).bfloat16().cuda()
    b0 = (torch.randn(E, N, K, generator=gen) / K ** 0.5).bfloat16().cuda()
    b1 = (torch.randn(E, N, K, generator=gen) / K ** 0.5).bfloat16().cuda()
    h = torch.full((a.shape[0], 2 * N), float("nan"), dtype=torch.bfloat16, device="cuda")
    mok.ops.grouped_mm(a, b0, blocks, b1, out=h, kind="gate_up_preact")
    again = mok.ops.grouped_mm(a, b0, blocks, b1, kind="gate_up_preact")
    assert torch.equal(h[:512], again[:512]), "not bitwise reproducible"
    for i, e in enumerate(blocks.tolist()):
        rows = slice(i * 128, (i + 1) * 128)
        if e < 0:
            assert torch.isnan(h[rows]).all(), "blocks past the end must stay unwritten"
            continue
        assert_close(f"h gate of block {i}", h[rows, :N].cpu(), (a[rows].double() @ b0[e].double().T).cpu(), tol=5e-3)
        assert_close(f"h up of block {i}", h[rows, N:].cpu(), (a[rows].double() @ b1[e].double().T).cpu(), tol=5e-3)


@pytest.mark.parametrize("kind", ["dgrad_down", "dgrad_gate_up"])
def test_grouped_mm_dgrad_kinds_read_the_weights_as_stored(gen, kind):
    # da = dy · W_down[e] (W_down [E, H, I]); dx = [dg | du] · [W_gate; W_up][e] ([E, I, H] each)
    E, K, N = 3, 768, 512
    blocks = torch.tensor([2, 0, 0, 2, -1], dtype=torch.int32)  # expert 1 has no rows
    a = torch.randn(len(blocks) * 128, K, generator=gen).bfloat16().cuda()
    bk = K // 2 if kind == "dgrad_gate_up" else K
    b0 = (torch.randn(E, bk, N, generator=gen) / K ** 0.5).bfloat16().cuda()
    b1 = (torch.randn(E, bk, N, generator=gen) / K ** 0.5).bfloat16().cuda() if kind == "dgrad_gate_up" else None
    out = torch.full((a.shape[0], N), float("nan"), dtype=torch.bfloat16, device="cuda")
    mok.ops.grouped_mm(a, b0, blocks.cuda(), b1, out=out, kind=kind)
    again = mok.ops.grouped_mm(a, b0, blocks.cuda(), b1, kind=kind)
    for i, e in enumerate(blocks.tolist()):
        rows = slice(i * 128, (i + 1) * 128)
        if e < 0:
            assert torch.isnan(out[rows]).all(), "blocks past the end must stay unwritten"
            continue
        b = b0[e] if b1 is None else torch.cat([b0[e], b1[e]], dim=0)
        assert_close(f"{kind} block {i}", out[rows].cpu(), (a[rows].double() @ b.double()).cpu())
        assert torch.equal(again[rows], out[rows]), "not bitwise reproducible"


def test_grouped_mm_dgrad_down_swiglu_matches_float64(gen):
    # Rows laid out as the plan lays them out: expert 2 with 1 row, expert 0 with 130 (a second
    # block of 2), expert 1 with none, each padded to 128 rows (padding: dy = 0, h = 0, w = 0),
    # then a -1 block (left unwritten).
    E, H, I = 3, 512, 512
    blocks, kinds = [], []
    for e, n in ((2, 1), (0, 130)):
        nb = (n + 127) // 128
        blocks += [e] * nb
        kinds += [1] * n + [0] * (nb * 128 - n)
    blocks.append(-1)
    kinds += [-1] * 128
    M, kinds = len(blocks) * 128, torch.tensor(kinds)
    dy = torch.randn(M, H, generator=gen).bfloat16()
    w_down = (torch.randn(E, H, I, generator=gen) / H ** 0.5).bfloat16()
    g = (2 * torch.randn(M, I, generator=gen)).bfloat16()
    u = torch.randn(M, I, generator=gen).bfloat16()
    w = torch.rand(M, generator=gen) * 1.5 - 0.5
    w[130] = 0.0  # a real route of weight 0: dh = 0, its partials still exact
    pad = kinds == 0
    dy[pad], g[pad], u[pad], w[pad] = 0, 0, 0, 0
    h = torch.cat([g, u], dim=1)
    be = torch.tensor(blocks, dtype=torch.int32).cuda()
    nan = dict(dtype=torch.bfloat16, device="cuda")
    dh = torch.full((M, 2 * I), float("nan"), **nan)
    wa = torch.full((M, I), float("nan"), **nan)
    part = torch.full((M, I // 128), float("nan"), device="cuda")
    args = (dy.cuda(), w_down.cuda(), be)
    eps = dict(h=h.cuda(), row_weight=w.cuda())
    got = mok.ops.grouped_mm(*args, out=dh, kind="dgrad_down_swiglu", wa=wa, dtw_partials=part, **eps)
    assert got is dh
    wa2 = torch.empty_like(wa)
    part2 = torch.empty_like(part)
    again = mok.ops.grouped_mm(*args, kind="dgrad_down_swiglu", wa=wa2, dtw_partials=part2, **eps)
    live = slice(0, (len(blocks) - 1) * 128)  # the rows of the blocks before the -1 block
    assert torch.equal(again[live], dh[live]) and torch.equal(wa2[live], wa[live]) and \
        torch.equal(part2[live], part[live]), "not bitwise reproducible"
    dh, wa, part = dh.cpu(), wa.cpu(), part.cpu()
    for i, e in enumerate(blocks):
        rows = slice(i * 128, (i + 1) * 128)
        if e < 0:
            assert torch.isnan(dh[rows]).all() and torch.isnan(wa[rows]).all() and torch.isnan(part[rows]).all(), \
                "a -1 block's rows must stay unwritten"
            continue
        da = dy[rows].double() @ w_down[e].double()
        gd, ud, wd = g[rows].double(), u[rows].double(), w[rows].double()[:, None]
        sg = torch.sigmoid(gd)
        sl = gd * sg
        a = (sl * ud).float().bfloat16().double()
        dsilu = sg * (1 + gd * (1 - sg))
        real = kinds[rows] == 1
        want_dh = torch.cat([wd * da * ud * dsilu, wd * da * sl], dim=1)
        want_part = (da * a).reshape(128, I // 128, 128).sum(-1)
        assert_close(f"dh of block {i} (expert {e})", dh[rows][real], want_dh[real])
        assert_close(f"wa of block {i} (expert {e})", wa[rows][real], (wd * a)[real])
        assert_close(f"dtw_partials of block {i} (expert {e})", part[rows][real], want_part[real], tol=1e-3)
        assert_close(f"d topk_weights of block {i}", part[rows][real].double().sum(1), (da * a)[real].sum(1), tol=1e-3)
        assert (dh[rows][~real] == 0).all() and (wa[rows][~real] == 0).all() and (part[rows][~real] == 0).all(), \
            "padding rows (w = 0, h = 0, dy = 0) must give zeros"
    assert (dh[130] == 0).all() and part[130].abs().sum() > 0, "w = 0: dh = 0 and the partials still <da, a>"


def _wgrad_operands(gen, Mo, No, counts):
    """a [R, Mo], b [R, No] bf16 with each expert's rows at 128-padded offsets, padding rows zero."""
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + (c + 127) // 128 * 128)
    a = torch.randn(offsets[-1], Mo, generator=gen).bfloat16()
    b = torch.randn(offsets[-1], No, generator=gen).bfloat16()
    for e, c in enumerate(counts):
        a[offsets[e] + c:offsets[e + 1]] = 0
        b[offsets[e] + c:offsets[e + 1]] = 0
    return a, b, offsets


def test_grouped_wgrad_matches_float64_with_empty_and_one_row_experts(gen):
    # out[e] = a[rows of e].T @ b[rows of e] at the plan's 128-padded offsets, padding rows zero
    counts = [3, 0, 1, 200]
    Mo, No = 256, 256
    a, b, offsets = _wgrad_operands(gen, Mo, No, counts)
    off = torch.tensor(offsets, dtype=torch.int32).cuda()
    cnt = torch.tensor(counts, dtype=torch.int32).cuda()
    main_grad = torch.full((len(counts), Mo, No), 0.5, device="cuda")
    out = mok.ops.grouped_wgrad(a.cuda(), b.cuda(), off, cnt)
    mok.ops.grouped_wgrad(a.cuda(), b.cuda(), off, cnt, main_grad=main_grad)
    again = mok.ops.grouped_wgrad(a.cuda(), b.cuda(), off, cnt)
    assert torch.equal(out, again), "not bitwise reproducible"
    for e, c in enumerate(counts):
        rows = slice(offsets[e], offsets[e] + c)
        want = a[rows].double().T @ b[rows].double()
        if c == 0:
            assert (out[e] == 0).all(), "an expert with no rows must get zeros"
            continue
        assert_close(f"wgrad expert {e} ({c} rows)", out[e].cpu(), want)
        assert (main_grad[e].double().cpu() - 0.5 - want).abs().max() < 1e-3 * (1 + want.abs().max())


def test_trace_records_every_role(gen, monkeypatch):
    monkeypatch.setenv("MOK_TRACE", "1")
    x, ids, tw, w = _layer(gen, 512, 256, 16, 4, 700, 256, masked=0.0)
    cuda_w = {n: t.cuda() for n, t in w.items()}
    ws = F.create_workspace(512, 256, 16, 4, max_tokens=1024, shared_intermediate=256, device="cuda",
                            config=F.MoKConfig(minibatch_size=256, macrobatch_size=512))
    F.forward(x.cuda(), ids.cuda(), tw.cuda(), **cuda_w, workspace=ws)
    ev = ws.read_trace()
    roles = set(ev[:, 2].tolist())
    assert roles == {0, 1, 2, 3, 4, 5}, f"roles recorded: {sorted(roles)}"
    assert (ev[:, 1] >= ev[:, 0]).all(), "an event ends before it begins"
    tiles = ev[ev[:, 2] == 3]
    # Every shared tile: ceil(700/128) row blocks x (gate/up tiles of 96 channels: ceil(256/96),
    # down tiles of 192 columns: ceil(512/192)), the row-major forward's 128 x 192 tiles
    # (src/cuda/fused/policy.cuh, ForwardPolicyBf16)
    shared = tiles[(tiles[:, 3] == 0) | (tiles[:, 3] == 2)]
    assert shared.shape[0] == 6 * (3 + 3)
