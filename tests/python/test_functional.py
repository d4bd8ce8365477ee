"""functional.forward / backward on the CPU reference against the float64 oracle, run-twice
determinism, main_grad accumulation and input validation."""
import pytest
import torch

import mok
from mok import functional as F
from oracle import WEIGHTS, assert_close, make_routing, make_weights, make_x, reference, route_term_norms

# (T, H, I, E, k, I_s, ids dtype)
SHAPES = [
    (0, 64, 32, 8, 2, 0, torch.int32),
    (0, 32, 16, 4, 2, 16, torch.int64),
    (1, 32, 16, 4, 1, 0, torch.int64),
    (9, 36, 20, 5, 1, 12, torch.int32),
    (37, 64, 32, 8, 2, 16, torch.int32),
    (64, 128, 64, 16, 4, 32, torch.int64),
    (20, 96, 48, 6, 6, 0, torch.int32),
]


def _layer(gen, T, H, I, E, k, Is, ids_dtype):
    w = make_weights(gen, H, I, E, Is)
    ids, tw = make_routing(gen, T, E, k, ids_dtype)
    return make_x(gen, T, H), ids, tw, w


def _args(x, ids, tw, w):
    return (x, ids, tw) + tuple(w[n] for n in WEIGHTS)


@pytest.mark.parametrize("T,H,I,E,k,Is,ids_dtype", SHAPES)
def test_forward_backward_match_oracle(gen, T, H, I, E, k, Is, ids_dtype):
    x, ids, tw, w = _layer(gen, T, H, I, E, k, Is, ids_dtype)
    dy = make_x(gen, T, H)
    y, ctx = F.forward(*_args(x, ids, tw, w))
    g = F.backward(ctx, dy)
    y_ref, g_ref = reference(x, ids, tw, w, dy)
    assert y.dtype == torch.bfloat16 and g.dx.dtype == torch.bfloat16 and g.d_topk_weights.dtype == torch.float32
    assert_close("y", y, y_ref)
    assert_close("dx", g.dx, g_ref["dx"])
    assert_close("d_topk_weights", g.d_topk_weights, g_ref["d_topk_weights"],
                 floor=route_term_norms(x, ids, w, dy))
    for name in WEIGHTS:
        if w[name] is None:
            assert getattr(g, name) is None, f"{name}: gradient of an absent weight"
        else:
            assert getattr(g, name).dtype == torch.bfloat16
            assert_close(f"grad {name}", getattr(g, name), g_ref[name])
    # Masked routes get d topk_weights = 0.
    masked = ids.long() == -1
    assert torch.all(g.d_topk_weights[masked] == 0)


def test_zero_and_negative_routing_weights(gen):
    # d topk_weights must be <dy, expert(x)> for weights 0 and < 0 too (no division by w).
    x, ids, tw, w = _layer(gen, 24, 64, 32, 8, 3, 0, torch.int64)
    ids = torch.rand(24, 8, generator=gen).argsort(dim=1)[:, :3].contiguous()
    tw[:, 0] = 0.0
    tw[:, 1] = -tw[:, 1].abs() - 0.1
    dy = make_x(gen, 24, 64)
    _, ctx = F.forward(*_args(x, ids, tw, w))
    g = F.backward(ctx, dy)
    _, g_ref = reference(x, ids, tw, w, dy)
    floor = route_term_norms(x, ids, w, dy)
    assert_close("d_topk_weights at w = 0", g.d_topk_weights[:, 0], g_ref["d_topk_weights"][:, 0], floor=floor[:, 0])
    assert_close("d_topk_weights at w < 0", g.d_topk_weights[:, 1], g_ref["d_topk_weights"][:, 1], floor=floor[:, 1])
    assert g.d_topk_weights[:, 0].abs().sum() > 0


def test_run_twice_bitwise(gen):
    x, ids, tw, w = _layer(gen, 45, 64, 32, 8, 2, 16, torch.int32)
    dy = make_x(gen, 45, 64)
    y1, ctx1 = F.forward(*_args(x, ids, tw, w))
    y2, ctx2 = F.forward(*_args(x, ids, tw, w))
    assert torch.equal(y1, y2)
    g1, g2 = F.backward(ctx1, dy), F.backward(ctx2, dy)
    for name in ("dx", "d_topk_weights") + WEIGHTS:
        assert torch.equal(getattr(g1, name), getattr(g2, name)), f"{name} differs between two runs"


def test_batch_invariance(gen):
    # A token's y and dx do not depend on the other tokens of the batch.
    x, ids, tw, w = _layer(gen, 40, 64, 32, 8, 2, 16, torch.int64)
    dy = make_x(gen, 40, 64)
    y, ctx = F.forward(*_args(x, ids, tw, w))
    g = F.backward(ctx, dy)
    part = slice(11, 23)
    y_part, ctx_part = F.forward(*_args(x[part], ids[part], tw[part], w))
    g_part = F.backward(ctx_part, dy[part])
    assert torch.equal(y[part], y_part)
    assert torch.equal(g.dx[part], g_part.dx)
    assert torch.equal(g.d_topk_weights[part], g_part.d_topk_weights)


def test_recompute_forward_context(gen):
    x, ids, tw, w = _layer(gen, 30, 64, 32, 8, 2, 16, torch.int32)
    dy = make_x(gen, 30, 64)
    _, ctx = F.forward(*_args(x, ids, tw, w))
    ctx2 = F.recompute_forward_context(*_args(x, ids, tw, w))
    assert ctx2.workspace is ctx.workspace
    g1, g2 = F.backward(ctx, dy), F.backward(ctx2, dy)
    for name in ("dx", "d_topk_weights") + WEIGHTS:
        assert torch.equal(getattr(g1, name), getattr(g2, name)), name


def test_main_grads_accumulate(gen):
    x, ids, tw, w = _layer(gen, 33, 64, 32, 8, 2, 16, torch.int64)
    dy = make_x(gen, 33, 64)
    _, ctx = F.forward(*_args(x, ids, tw, w))
    # 0 + g = g exactly: a run into zero buffers gives the fp32 gradient.
    fp32 = {n: torch.zeros(w[n].shape) for n in WEIGHTS}
    g = F.backward(ctx, dy, main_grads=fp32)
    before = {n: torch.randn(w[n].shape, generator=gen) for n in WEIGHTS}
    after = {n: t.clone() for n, t in before.items()}
    g2 = F.backward(ctx, dy, main_grads=after)
    for n in WEIGHTS:
        assert torch.equal(after[n], before[n] + fp32[n]), f"main_grad of {n} != before + fp32 gradient"
        assert torch.equal(getattr(g, n), fp32[n].to(torch.bfloat16)), f"bf16 grad of {n} != bf16(fp32 grad)"
        assert torch.equal(getattr(g, n), getattr(g2, n))
    # Only some buffers given: the others stay absent.
    only = {"w_down": torch.zeros(w["w_down"].shape)}
    F.backward(ctx, dy, main_grads=only)
    assert torch.equal(only["w_down"], fp32["w_down"])
    with pytest.raises(ValueError, match="unknown names"):
        F.backward(ctx, dy, main_grads={"router": torch.zeros(1)})
    with pytest.raises(ValueError, match="main_grad of w_up"):
        F.backward(ctx, dy, main_grads={"w_up": torch.zeros(w["w_up"].shape, dtype=torch.bfloat16)})


def test_workspace_describe_and_cache():
    ws = F.get_workspace(64, 32, 8, 2, 128, shared_intermediate=16)
    assert F.get_workspace(64, 32, 8, 2, 128, shared_intermediate=16) is ws
    assert F.get_workspace(64, 32, 8, 2, 128, shared_intermediate=16, config=F.MoKConfig(num_threads=1)) is not ws
    text = ws.describe()
    assert "P*T_max*min(k,E_l) + E_l*(block_m-1)" in text and "T_max=128" in text
    c = ws.c_config()
    assert (c.hidden, c.intermediate, c.shared_intermediate, c.num_experts, c.topk, c.max_tokens) == (
        64, 32, 16, 8, 2, 128)
    assert ws.dims.max_tokens == 128 and ws.config == F.MoKConfig()
    own = F.create_workspace(64, 32, 8, 2, 16)
    own.close()
    with pytest.raises(RuntimeError, match="closed"):
        own.describe()
    assert F.token_bucket(0) == 1 and F.token_bucket(1) == 1 and F.token_bucket(5) == 8 and F.token_bucket(64) == 64


def test_workspace_from_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        ws = F.get_workspace(64, 32, 8, 2, 16, ep_size=4, ep_rank=3, group=group)
        assert (ws.dims.ep_size, ws.dims.ep_rank) == (1, 0)
        assert F.get_workspace(64, 32, 8, 2, 16, group=group) is ws
        assert F.get_workspace(64, 32, 8, 2, 16) is not ws
    finally:
        F.clear_workspace_cache()
        dist.destroy_process_group()


def test_bad_config_raises():
    with pytest.raises(ValueError, match="minibatch_size"):
        F.create_workspace(64, 32, 8, 2, 16, config=F.MoKConfig(minibatch_size=100))
    with pytest.raises(ValueError, match="num_experts"):
        F.create_workspace(64, 32, 6, 2, 16, ep_size=4)
    with pytest.raises(ValueError, match="precision"):
        F.create_workspace(64, 32, 8, 2, 16, config=F.MoKConfig(precision="fp4"))


class TestInvalidInputs:
    """Each bad input raises ValueError naming the tensor, index or value; the workspace
    stays usable afterwards."""

    H, I, E, k, T = 64, 32, 8, 2, 12

    @pytest.fixture
    def case(self, gen):
        ws = F.create_workspace(self.H, self.I, self.E, self.k, max_tokens=16)
        x, ids, tw, w = _layer(gen, self.T, self.H, self.I, self.E, self.k, 0, torch.int32)
        return ws, x, ids, tw, w

    def _still_works(self, ws, x, ids, tw, w):
        y, ctx = F.forward(*_args(x, ids, tw, w), workspace=ws)
        y_auto, _ = F.forward(*_args(x, ids, tw, w))
        assert torch.equal(y, y_auto)
        F.backward(ctx, x)

    @pytest.mark.parametrize("bad", ["E", -2])
    def test_id_out_of_range(self, case, bad):
        ws, x, ids, tw, w = case
        bad_ids = ids.clone()
        value = self.E if bad == "E" else bad
        bad_ids[5, 1] = value
        with pytest.raises(ValueError, match=rf"topk_ids\[5, 1\] = {value} is outside \[-1, {self.E}\)"):
            F.forward(*_args(x, bad_ids, tw, w), workspace=ws)
        self._still_works(*case)

    def test_duplicate_id(self, case):
        ws, x, ids, tw, w = case
        bad_ids = ids.clone()
        bad_ids[7] = torch.tensor([3, 3], dtype=ids.dtype)
        with pytest.raises(ValueError, match=r"topk_ids\[7, 1\] = 3 duplicates topk_ids\[7, 0\]"):
            F.forward(*_args(x, bad_ids, tw, w), workspace=ws)
        _, ctx = F.forward(*_args(x, ids, tw, w), workspace=ws)
        ctx.topk_ids = bad_ids
        with pytest.raises(ValueError, match="duplicates"):
            F.backward(ctx, x)
        self._still_works(*case)

    def test_wrong_dtype(self, case):
        ws, x, ids, tw, w = case
        with pytest.raises(ValueError, match="x must be bfloat16, got float32"):
            F.forward(*_args(x.float(), ids, tw, w), workspace=ws)
        with pytest.raises(ValueError, match="topk_weights must be float32, got bfloat16"):
            F.forward(*_args(x, ids, tw.bfloat16(), w), workspace=ws)
        with pytest.raises(ValueError, match="topk_ids must be int32 or int64"):
            F.forward(*_args(x, ids.float(), tw, w), workspace=ws)
        with pytest.raises(ValueError, match="float16"):
            F.forward(*_args(x.half(), ids, tw, w), workspace=ws)
        self._still_works(*case)

    def test_wrong_shape(self, case, gen):
        ws, x, ids, tw, w = case
        bad = dict(w, w_gate=make_weights(gen, self.H, self.I + 8, self.E)["w_gate"])
        with pytest.raises(ValueError, match=r"w_gate has shape \[8, 40, 64\], expected \[8, 32, 64\]"):
            F.forward(*_args(x, ids, tw, bad), workspace=ws)
        with pytest.raises(ValueError):
            F.forward(*_args(x, ids, tw, bad))
        with pytest.raises(ValueError, match="topk_weights has shape"):
            F.forward(*_args(x, ids, tw[:, :1].contiguous(), w), workspace=ws)
        _, ctx = F.forward(*_args(x, ids, tw, w), workspace=ws)
        with pytest.raises(ValueError, match="dy has shape"):
            F.backward(ctx, x[:-1])
        self._still_works(*case)

    def test_non_contiguous(self, case):
        ws, x, ids, tw, w = case
        x_t = x.t().contiguous().t()
        assert x_t.shape == x.shape and not x_t.is_contiguous()
        with pytest.raises(ValueError, match="x must be contiguous"):
            F.forward(*_args(x_t, ids, tw, w), workspace=ws)
        self._still_works(*case)

    def test_too_many_tokens(self, case, gen):
        ws, x, ids, tw, w = case
        x2, (ids2, tw2) = make_x(gen, 17, self.H), make_routing(gen, 17, self.E, self.k)
        with pytest.raises(ValueError, match="17 tokens but the workspace was built for max_tokens = 16"):
            F.forward(*_args(x2, ids2, tw2, w), workspace=ws)
        self._still_works(*case)

    def test_shared_weights_without_shared_expert(self, case, gen):
        ws, x, ids, tw, w = case
        with_shared = make_weights(gen, self.H, self.I, self.E, 16)
        with pytest.raises(ValueError, match="shared_intermediate = 0"):
            F.forward(*_args(x, ids, tw, dict(w, ws_gate=with_shared["ws_gate"], ws_up=with_shared["ws_up"],
                                                 ws_down=with_shared["ws_down"])), workspace=ws)
        self._still_works(*case)

    def test_config_and_workspace_disagree(self, case):
        ws, x, ids, tw, w = case
        with pytest.raises(ValueError, match="differs from the workspace"):
            F.forward(*_args(x, ids, tw, w), workspace=ws, config=F.MoKConfig(minibatch_size=512))


def test_cpu_workspace_checks_and_trace():
    ws = F.create_workspace(64, 32, 8, 2, max_tokens=16)
    ws.check_errors()  # nothing recorded on the CPU backend
    with pytest.raises(RuntimeError, match="records no trace"):
        ws.read_trace()


def test_grouped_mm_needs_cuda_tensors():
    a = torch.zeros(128, 64, dtype=torch.bfloat16)
    b = torch.zeros(1, 256, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA tensors"):
        mok.ops.grouped_mm(a, b, torch.zeros(1, dtype=torch.int32))


def test_ring_of_every_row_matches_the_oracle(gen):
    # macrobatch_size = MACROBATCH_ALL_ROWS (the training configuration): the same layer as the
    # default ring, against the oracle, and y bitwise equal to the default ring's (the forward's
    # sums do not depend on the ring)
    x, ids, tw, w = _layer(gen, 64, 128, 64, 16, 4, 32, torch.int32)
    dy = make_x(gen, 64, 128)
    ws = F.create_workspace(128, 64, 16, 4, 64, shared_intermediate=32,
                            config=F.MoKConfig(minibatch_size=128, macrobatch_size=F.MACROBATCH_ALL_ROWS))
    assert ws.c_config().macrobatch_size >= F.plan_capacity(16, 4, 64)[0]
    y, ctx = F.forward(*_args(x, ids, tw, w), workspace=ws)
    g = F.backward(ctx, dy)
    y_default, _ = F.forward(*_args(x, ids, tw, w))
    assert torch.equal(y, y_default)
    y_ref, g_ref = reference(x, ids, tw, w, dy)
    assert_close("y", y, y_ref)
    assert_close("dx", g.dx, g_ref["dx"])
    for name in WEIGHTS:
        assert_close(f"grad {name}", getattr(g, name), g_ref[name])
