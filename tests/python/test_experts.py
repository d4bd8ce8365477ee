"""Expert weights read in place (mok.experts, strided weights through the C ABI): every layout
frameworks store gives the bits of contiguous weights, forward and backward, the gradients
written in the weights' own layout, on the CPU backend and on CUDA (fused and unfused).  The
transposed layout (column-major matrices) runs on both; on CUDA through the fused kernels only
(the unfused launches refuse it by name: test_gpu_transposed.py)."""
import re

import pytest
import torch

import mok
from mok import experts as X
from mok import functional as F
from oracle import WEIGHTS, assert_close, make_routing, make_weights, make_x, reference
from bench.shapes import MODELS

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and mok.has_cuda() else [])
needs_cuda = pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA GPU and libmok's CUDA part")
LAYOUTS = ["concatenated", "interleaved", "padded_rows", "padded_experts", "transposed"]
ROUTED = ("w_gate", "w_up", "w_down")


def _nan(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _lay_out(w, layout, fill):
    """Views of the routed weights in `layout` holding the values of w (fill: how the rest of
    each buffer starts, e.g. NaN: a read outside the view shows).  Returns (views, buffers)."""
    g, u, d = w["w_gate"], w["w_up"], w["w_down"]
    E, I, H = g.shape
    if layout == "concatenated":  # HF's gate_up_proj [E, 2I, H]: gate rows, then up rows
        gu = torch.cat([g, u], dim=1)
        views = X.split_gate_up(gu, interleaved=False)
        return {"w_gate": views[0], "w_up": views[1], "w_down": d}, [gu]
    if layout == "interleaved":  # gate row i at 2i, up row i at 2i + 1
        gu = torch.stack([g, u], dim=2).reshape(E, 2 * I, H)
        views = X.split_gate_up(gu, interleaved=True)
        return {"w_gate": views[0], "w_up": views[1], "w_down": d}, [gu]
    if layout == "transposed":  # HF's is_transposed: gate_up [E, H, 2I] (gate columns, then up), down [E, I, H]
        gu = torch.cat([g, u], dim=1).transpose(1, 2).contiguous()
        down = d.transpose(1, 2).contiguous()
        views = X.split_gate_up(gu, transposed=True)
        return {"w_gate": views[0], "w_up": views[1], "w_down": down.transpose(1, 2)}, [gu, down]
    if layout == "padded_rows":  # rows 64 elements longer than K (row stride H + 64, I + 64)
        bufs = [fill((E, I, H + 64)), fill((E, I, H + 64)), fill((E, H, I + 64))]
        views = [bufs[0][..., :H], bufs[1][..., :H], bufs[2][..., :I]]
    else:  # padded_experts: 128 spare rows between experts (expert stride (rows + 128)·K)
        bufs = [fill((E, I + 128, H)), fill((E, I + 128, H)), fill((E, H + 128, I))]
        views = [bufs[0][:, :I], bufs[1][:, :I], bufs[2][:, :H]]
    for v, src in zip(views, (g, u, d)):
        v.copy_(src)
    return dict(zip(ROUTED, views)), bufs


def _layer(gen, device, H=256, I=256, E=4, k=2, T=200, I_s=0):
    w = make_weights(gen, H, I, E, I_s)
    ids, tw = make_routing(gen, T, E, k)
    to = {n: (t.to(device) if t is not None else None) for n, t in w.items()}
    return make_x(gen, T, H).to(device), ids.to(device), tw.to(device), to, make_x(gen, T, H).to(device)


def _refused(device, layout, H=256, I=256, E=4, k=2):
    """Why libmok refuses this layout on this device (None: it runs it): transposed weights on
    CUDA where the backward takes the unfused launches (more local experts than the fused
    kernel's table)."""
    return X.unsupported_reason(hidden=H, intermediate=I, num_experts=E, topk=k, device=device,
                                transposed=layout == "transposed")


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _assert_equal(tag, a, b):
    assert a.shape == b.shape, f"{tag}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert torch.equal(_bits(a.contiguous()), _bits(b.contiguous())), f"{tag}: the bits differ"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_weights_give_the_bits_of_contiguous_ones(gen, device, layout):
    x, ids, tw, w, dy = _layer(gen, device, I_s=256)
    views, _ = _lay_out(w, layout, lambda shape: _nan(shape, torch.bfloat16, device))
    strided = {**w, **views}
    assert not strided["w_gate"].is_contiguous()
    if _refused(device, layout):
        with pytest.raises(ValueError, match=re.escape(_refused(device, layout))):
            F.forward(x, ids, tw, **strided)
        return
    y0, ctx0 = F.forward(x, ids, tw, **w)
    y1, ctx1 = F.forward(x, ids, tw, **strided)
    _assert_equal(f"{layout}: y", y1, y0)
    # Gradients into buffers of the same layout (NaN around and inside them: every element of
    # a view is written, nothing outside), main_grads of that layout too
    nan = lambda shape: _nan(shape, torch.bfloat16, device)  # noqa: E731
    grad_views, grad_bufs = _lay_out({n: nan(w[n].shape) for n in ROUTED}, layout, nan)
    start = {n: torch.randn(w[n].shape, generator=gen).to(device) for n in ROUTED}
    mg_views, mg_bufs = _lay_out(start, layout, lambda shape: _nan(shape, torch.float32, device))
    mg0 = {n: start[n].clone() for n in ROUTED}
    g0 = F.backward(ctx0, dy, main_grads=mg0)
    g1 = F.backward(ctx1, dy, main_grads=mg_views, grads_out=grad_views)
    for name in ("dx", "d_topk_weights", *WEIGHTS):
        _assert_equal(f"{layout}: {name}", getattr(g1, name), getattr(g0, name))
    for n in ROUTED:
        assert getattr(g1, n) is grad_views[n], f"{layout}: grad {n} was not written in place"
        _assert_equal(f"{layout}: main_grad {n}", mg_views[n], mg0[n])
    for bufs, views in ((grad_bufs, grad_views), (mg_bufs, mg_views)):
        for buf in bufs:
            inside = sum(v.numel() for v in views.values()
                         if v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr())
            assert int(torch.isnan(buf.float()).sum()) == buf.numel() - inside, \
                f"{layout}: an element outside the views was written (or one inside was not)"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_experts_fused_parameter_against_float64(gen, device, interleaved):
    x, ids, tw, w, dy = _layer(gen, device, T=150)
    ids[3, 1] = 4  # HF's expert-parallel sentinel (id E): no route
    views, (gu,) = _lay_out(w, "interleaved" if interleaved else "concatenated", None)
    gate_up = gu.clone().requires_grad_()
    down = w["w_down"].clone().requires_grad_()
    xg = x.clone().requires_grad_()
    twg = tw.to(torch.bfloat16).requires_grad_()  # a framework's dtype: the gradient comes back in it
    y = X.experts(xg, ids, twg, gate_up, down, interleaved=interleaved)
    y.backward(dy)
    assert gate_up.grad.shape == gate_up.shape and twg.grad.dtype == torch.bfloat16
    ref_ids = torch.where(ids < 4, ids, -1)
    y_ref, ref = reference(x.cpu(), ref_ids.cpu(), twg.detach().float().cpu(), {n: t.cpu() if t is not None else None
                                                                              for n, t in w.items()}, dy.cpu())
    assert_close("y", y.detach().cpu(), y_ref)
    assert_close("dx", xg.grad.cpu(), ref["dx"])
    assert_close("d down_proj", down.grad.cpu(), ref["w_down"])
    d_gate, d_up = X.split_gate_up(gate_up.grad, interleaved)
    assert_close("d gate (in gate_up_proj's grad)", d_gate.cpu(), ref["w_gate"])
    assert_close("d up (in gate_up_proj's grad)", d_up.cpu(), ref["w_up"])
    assert_close("d topk_weights", twg.grad.float().cpu(), ref["d_topk_weights"], tol=2e-2)
    assert twg.grad[3, 1] == 0, "a sentinel route's weight gradient must be 0"
    # The same bits as the separate-weights path, run to run
    for _ in range(2):
        gate_up2 = gu.clone().requires_grad_()
        y2 = X.experts(x, ids, twg.detach(), gate_up2, w["w_down"], interleaved=interleaved)
        y2.backward(dy)
        _assert_equal("y run again", y2, y)
        _assert_equal("d gate_up run again", gate_up2.grad, gate_up.grad)
    g_sep = w["w_gate"].clone().requires_grad_()
    u_sep = w["w_up"].clone().requires_grad_()
    y3 = X.experts_separate(x, ids, twg.detach(), g_sep, u_sep, w["w_down"])
    y3.backward(dy)
    _assert_equal("y (fused parameter vs separate)", y, y3)
    _assert_equal("d gate (fused parameter vs separate)", d_gate, g_sep.grad)
    _assert_equal("d up (fused parameter vs separate)", d_up, u_sep.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_experts_with_a_shared_expert(gen, device):
    x, ids, tw, w, dy = _layer(gen, device, T=130, I_s=256)
    views, (gu,) = _lay_out(w, "concatenated", None)
    shared = [w[n].clone().requires_grad_() for n in ("ws_gate", "ws_up", "ws_down")]
    gate_up = gu.clone().requires_grad_()
    y = X.experts(x, ids, tw, gate_up, w["w_down"], shared=shared)
    y.backward(dy)
    y_ref, ref = reference(x.cpu(), ids.cpu(), tw.cpu(), {n: t.cpu() for n, t in w.items()}, dy.cpu())
    assert_close("y", y.detach().cpu(), y_ref)
    for t, n in zip(shared, ("ws_gate", "ws_up", "ws_down")):
        assert_close(f"d {n}", t.grad.cpu(), ref[n])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_shared", [False, True])
def test_experts_transposed_parameters(gen, device, with_shared):
    """transposed=True: gate_up_proj [E, H, 2I] and down_proj [E, I, H] (HF's is_transposed)
    read in place give the bits of experts() on the same matrices stored [E, 2I, H] and
    [E, H, I], forward and every gradient, and the gradients come back in the parameters'
    layout; against float64 too."""
    x, ids, tw, w, dy = _layer(gen, device, T=150, I_s=256 if with_shared else 0)
    ids[3, 1] = 4  # HF's expert-parallel sentinel (id E): no route
    _, (gu,) = _lay_out(w, "concatenated", None)
    gu_t, down_t = gu.transpose(1, 2).contiguous(), w["w_down"].transpose(1, 2).contiguous()  # [E, H, 2I], [E, I, H]
    names = ("ws_gate", "ws_up", "ws_down")
    if _refused(device, "transposed"):
        with pytest.raises(ValueError, match=re.escape(_refused(device, "transposed"))):
            X.experts(x, ids, tw, gu_t.requires_grad_(), down_t, transposed=True)
        return

    def run(gate_up, down, transposed):
        leaves = [t.clone().requires_grad_() for t in (x, tw, gate_up, down)]
        shared = [w[n].clone().requires_grad_() for n in names] if with_shared else None
        y = X.experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], transposed=transposed, shared=shared)
        y.backward(dy)
        return y.detach(), [t.grad for t in leaves] + ([t.grad for t in shared] if with_shared else [])

    y, grads = run(gu, w["w_down"], False)
    y_t, grads_t = run(gu_t, down_t, True)
    dx_t, dtw_t, d_gate_up_t, d_down_t = grads_t[:4]
    assert d_gate_up_t.shape == gu_t.shape and d_down_t.shape == down_t.shape, "gradients in the parameters' layout"
    _assert_equal("y", y_t, y)
    _assert_equal("dx", dx_t, grads[0])
    _assert_equal("d topk_weights", dtw_t, grads[1])
    _assert_equal("d gate_up_proj (transposed back)", d_gate_up_t.transpose(1, 2), grads[2])
    _assert_equal("d down_proj (transposed back)", d_down_t.transpose(1, 2), grads[3])
    for n, a, b in zip(names, grads_t[4:], grads[4:]):
        _assert_equal(f"d {n}", a, b)
    with torch.no_grad():  # the inference path reads the same views
        _assert_equal("y without autograd", X.experts(x, ids, tw, gu_t, down_t, transposed=True,
                                                      shared=[w[n] for n in names] if with_shared else None), y)
    # Against float64
    ref_ids = torch.where(ids < 4, ids, -1)
    y_ref, ref = reference(x.cpu(), ref_ids.cpu(), tw.cpu(), {n: t.cpu() if t is not None else None
                                                              for n, t in w.items()}, dy.cpu())
    assert_close("y", y_t.cpu(), y_ref)
    assert_close("dx", dx_t.cpu(), ref["dx"])
    assert_close("d gate (in gate_up_proj's grad, columns 0..I-1)", d_gate_up_t[:, :, :256].transpose(1, 2).cpu(),
                 ref["w_gate"])
    assert_close("d up (in gate_up_proj's grad, columns I..2I-1)", d_gate_up_t[:, :, 256:].transpose(1, 2).cpu(),
                 ref["w_up"])
    assert_close("d down_proj [E, I, H]", d_down_t.transpose(1, 2).cpu(), ref["w_down"])
    assert_close("d topk_weights", dtw_t.cpu(), ref["d_topk_weights"], tol=2e-2)
    for n, g in zip(names, grads_t[4:]):
        assert_close(f"d {n}", g.cpu(), ref[n])


def test_transposed_layout_errors(gen):
    x, ids, tw, w, _ = _layer(gen, "cpu", T=16)
    gu_t = torch.cat([w["w_gate"], w["w_up"]], dim=1).transpose(1, 2).contiguous()
    with pytest.raises(ValueError, match="interleaved=True with transposed=True.*TMA boxes cannot read"):
        X.experts(x, ids, tw, gu_t, w["w_down"].transpose(1, 2), interleaved=True, transposed=True)
    with pytest.raises(ValueError, match="interleaved=True with transposed=True"):
        X.split_gate_up(gu_t, interleaved=True, transposed=True)
    with pytest.raises(ValueError, match=r"gate_up_proj must be \[E, H, 2I\] \(transposed\), got shape \[4, 256, 3\]"):
        X.split_gate_up(gu_t[:, :, :3], transposed=True)
    # down_proj [E, H, I] with transposed=True: its view [E, I, H] is named
    x, ids, tw, w, _ = _layer(gen, "cpu", H=128, I=256, T=16)
    gu_t = torch.cat([w["w_gate"], w["w_up"]], dim=1).transpose(1, 2).contiguous()
    with pytest.raises(ValueError, match=r"w_down has shape \[4, 256, 128\], expected \[4, 128, 256\]"):
        X.experts(x, ids, tw, gu_t, w["w_down"], transposed=True)


def test_unsupported_reason_of_transposed_weights():
    # On CUDA the backward past the fused kernel's table of local experts runs the unfused
    # launches, which read row-major weights only; the forward, the CPU and the fused backward
    # take them
    why = X.unsupported_reason(hidden=256, intermediate=256, num_experts=1024, topk=2, device="cuda", transposed=True)
    assert why is not None and "1024 local experts" in why and "row-major routed weights only" in why
    assert X.unsupported_reason(hidden=256, intermediate=256, num_experts=1024, topk=2, device="cuda",
                                transposed=True, backward=False) is None
    assert X.unsupported_reason(hidden=256, intermediate=256, num_experts=1024, topk=2, device="cuda") is None
    assert X.unsupported_reason(hidden=256, intermediate=256, num_experts=4, topk=2, device="cuda",
                                transposed=True) is None
    assert X.unsupported_reason(hidden=256, intermediate=256, num_experts=4, topk=2, device="cpu",
                                transposed=True) is None


@pytest.mark.parametrize("device", DEVICES)
def test_layouts_mok_cannot_read_are_named_before_launch(gen, device):
    x, ids, tw, w, dy = _layer(gen, device, T=16)
    E, I, H = w["w_gate"].shape
    # The gate of an interleaved transposed gate_up [E, H, 2I]: unit stride along neither I nor H
    neither = torch.cat([w["w_gate"], w["w_up"]], dim=1).transpose(1, 2).contiguous().transpose(1, 2)[:, 0::2]
    with pytest.raises(ValueError, match=r"w_gate has strides .*: mok reads row-major matrices .* or column-major"):
        F.forward(x, ids, tw, neither, neither, w["w_down"])
    column_major = w["w_gate"].transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="must share strides"):
        F.forward(x, ids, tw, column_major, w["w_up"], w["w_down"])
    gu = torch.cat([w["w_gate"], w["w_up"]], dim=1)
    with pytest.raises(ValueError, match="must share strides"):
        F.forward(x, ids, tw, gu[:, :I], w["w_up"], w["w_down"])
    broadcast = w["w_gate"][:1].expand(E, I, H)
    with pytest.raises(ValueError, match="overlap"):
        F.forward(x, ids, tw, broadcast, broadcast, w["w_down"])
    _, ctx = F.forward(x, ids, tw, **w)
    with pytest.raises(ValueError, match="grad of w_up .*must share strides"):
        F.backward(ctx, dy, grads_out={"w_gate": gu[:, :I].clone(), "w_up": gu[:, I:]})


@needs_cuda
def test_cuda_names_what_tma_cannot_follow(gen):
    x, ids, tw, w, _ = _layer(gen, "cuda", T=16)
    E, I, H = w["w_gate"].shape
    # Rows 2 * (H + 4) bytes apart: TMA strides are multiples of 16 bytes
    odd_gate, odd_up = (torch.zeros(E, I, H + 4, dtype=torch.bfloat16, device="cuda")[..., :H] for _ in range(2))
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        F.forward(x, ids, tw, odd_gate, odd_up, w["w_down"])
    skew = torch.zeros(E * I * H + 8 * E, dtype=torch.bfloat16, device="cuda").as_strided((E, I, H), (I * H + 8, H, 1))
    with pytest.raises(ValueError, match="multiple of the row stride"):
        F.forward(x, ids, tw, skew, skew, w["w_down"])


@needs_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("saved", [False, True])
def test_cuda_fused_equals_unfused_with_strided_weights(gen, monkeypatch, layout, saved):
    if layout == "transposed":
        pytest.skip("the unfused launches read row-major weights only (test_gpu_transposed.py checks the refusal, "
                    "and compares the transposed layer with the row-major one bit for bit)")
    x, ids, tw, w, dy = _layer(gen, "cuda", H=512, I=256, E=8, k=2, T=300, I_s=256)
    views, _ = _lay_out(w, layout, lambda shape: _nan(shape, torch.bfloat16, "cuda"))
    strided = {**w, **views}

    def run(path):
        monkeypatch.setenv("MOK_FORWARD_PATH", path)
        monkeypatch.setenv("MOK_BACKWARD_PATH", path)
        if saved:
            y, ctx = F.forward(x, ids, tw, **strided)
        else:
            y, ctx = F.forward(x, ids, tw, **strided, save_for_backward=False)
        return y, F.backward(ctx, dy)

    yu, gu = run("unfused")
    yf, gf = run("fused")
    _assert_equal(f"{layout}: y fused vs unfused", yf, yu)
    for name in ("dx", "d_topk_weights", *WEIGHTS):
        _assert_equal(f"{layout}: {name} fused vs unfused", getattr(gf, name), getattr(gu, name))
    y0, ctx0 = F.forward(x, ids, tw, **w)
    _assert_equal(f"{layout}: y vs contiguous weights", yf, y0)
    g0 = F.backward(ctx0, dy)
    for name in ("dx", "d_topk_weights", *WEIGHTS):
        _assert_equal(f"{layout}: {name} vs contiguous weights", getattr(gf, name), getattr(g0, name))


def test_unsupported_reason_names_the_shape():
    assert X.unsupported_reason(hidden=2048, intermediate=768, num_experts=128, topk=8, device="cpu") is None
    assert X.unsupported_reason(hidden=2048, intermediate=768, num_experts=128, topk=8, device="cpu",
                                transposed=True) is None
    why = X.unsupported_reason(hidden=2048, intermediate=1408, num_experts=64, topk=6, device="cuda")
    if mok.has_cuda():
        # Every model of bench/shapes.py MODELS, forward and backward (DeepSeek-V2-Lite, gpt-oss...)
        for s in MODELS.values():
            assert X.unsupported_reason(hidden=s.H, intermediate=s.I, num_experts=s.E_l, topk=s.k,
                                        shared_intermediate=s.I_s, device="cuda") is None, s.name
        assert "hidden = 2912 must be a multiple of 64" in X.unsupported_reason(
            hidden=2912, intermediate=2880, num_experts=32, topk=4, device="cuda")
        assert "intermediate = 1400 must be a multiple of 64" in X.unsupported_reason(
            hidden=2048, intermediate=1400, num_experts=64, topk=6, device="cuda", backward=False)
    else:
        assert "without its CUDA part" in why
    assert "topk" in X.unsupported_reason(hidden=256, intermediate=256, num_experts=4, topk=9, device="cpu")
    assert "mps" in X.unsupported_reason(hidden=256, intermediate=256, num_experts=4, topk=2, device="mps")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["concatenated", "interleaved", "transposed"])
def test_experts_under_torch_compile(gen, device, layout):
    # mok::experts_saving / experts_backward traced through their fake implementations
    # (fullgraph: no graph break); the compiled step gives the eager bits
    if _refused(device, layout):
        pytest.skip(_refused(device, layout))  # test_experts_transposed_parameters checks the refusal
    x, ids, tw, w, dy = _layer(gen, device, T=100, I_s=256)
    _, (gu, *down) = _lay_out(w, layout, None)
    down = down[0] if down else w["w_down"]  # transposed: down_proj [E, I, H]

    shared = [w[n] for n in ("ws_gate", "ws_up", "ws_down")]

    def step(x, tw, gate_up, down):
        return X.experts(x, ids, tw, gate_up, down, interleaved=layout == "interleaved",
                         transposed=layout == "transposed", shared=shared)

    results = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (x, tw, gu, down)]
        y = fn(*leaves)
        y.backward(dy)
        results.append([y.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(("y", "dx", "d topk_weights", "d gate_up", "d down"), *results):
        _assert_equal(f"compiled vs eager: {name}", b, a)
