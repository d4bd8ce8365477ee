"""Every rejected input's error names the argument and what was expected: wrong dtype, a meta
device, a non-tensor, a wrong number of dimensions, through functional, build_schedule,
grouped_mm, the ops and mok.nn.MoE."""
import re

import pytest
import torch

import mok
from mok import _lib, ops
from mok import functional as F
from oracle import WEIGHTS, make_routing, make_weights, make_x

H, I, E, k, T = 64, 32, 8, 2, 12


@pytest.fixture
def layer(gen):
    w = make_weights(gen, H, I, E, 16)
    ids, tw = make_routing(gen, T, E, k, torch.int32)
    return make_x(gen, T, H), ids, tw, w


def _args(x, ids, tw, w):
    return (x, ids, tw) + tuple(w[n] for n in WEIGHTS)


def _raises(exc, *fragments):
    """pytest.raises(exc) whose message holds every fragment (the argument's name, what it expected)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


@pytest.fixture(params=["auto", "explicit"])
def workspace(request):
    """forward without a workspace (it is made from the inputs) and with one."""
    if request.param == "auto":
        return None
    return F.create_workspace(H, I, E, k, max_tokens=16, shared_intermediate=16)


class TestForward:
    def test_int16_ids(self, layer, workspace):
        x, ids, tw, w = layer
        with _raises(ValueError, "topk_ids must be int32 or int64", "got int16"):
            F.forward(*_args(x, ids.to(torch.int16), tw, w), workspace=workspace)

    def test_float64_weights(self, layer, workspace):
        x, ids, tw, w = layer
        with _raises(ValueError, "topk_weights must be float32", "got float64"):
            F.forward(*_args(x, ids, tw.double(), w), workspace=workspace)
        with _raises(ValueError, "w_down must be bfloat16", "got float64"):
            F.forward(*_args(x, ids, tw, dict(w, w_down=w["w_down"].double())), workspace=workspace)
        with _raises(ValueError, "ws_gate must be bfloat16", "got float64"):
            F.forward(*_args(x, ids, tw, dict(w, ws_gate=w["ws_gate"].double())), workspace=workspace)

    def test_float64_x(self, layer, workspace):
        x, ids, tw, w = layer
        with _raises(ValueError, "x must be bfloat16", "got float64"):
            F.forward(*_args(x.double(), ids, tw, w), workspace=workspace)

    def test_meta_x(self, layer, workspace):
        x, ids, tw, w = layer
        with _raises(ValueError, "x must be on a cpu or cuda device", "got meta"):
            F.forward(*_args(x.to("meta"), ids, tw, w), workspace=workspace)
        with _raises(ValueError, "x must be on a cpu or cuda device", "got meta"):
            F.recompute_forward_context(*_args(x.to("meta"), ids, tw, w), workspace=workspace)

    def test_meta_ids(self, layer, workspace):
        x, ids, tw, w = layer
        with _raises(ValueError, "topk_ids must be on a cpu or cuda device", "got meta"):
            F.forward(*_args(x, ids.to("meta"), tw, w), workspace=workspace)
        with _raises(ValueError, "topk_weights must be on a cpu or cuda device", "got meta"):
            F.forward(*_args(x, ids, tw.to("meta"), w), workspace=workspace)
        with _raises(ValueError, "w_up must be on a cpu or cuda device", "got meta"):
            F.forward(*_args(x, ids, tw, dict(w, w_up=w["w_up"].to("meta"))), workspace=workspace)

    def test_non_tensor(self, layer, workspace):
        x, ids, tw, w = layer
        with _raises(TypeError, "x must be a torch.Tensor", "got list"):
            F.forward(*_args(x.tolist(), ids, tw, w), workspace=workspace)
        with _raises(TypeError, "topk_ids must be a torch.Tensor", "got list"):
            F.forward(*_args(x, ids.tolist(), tw, w), workspace=workspace)
        with _raises(TypeError, "topk_weights must be a torch.Tensor", "got list"):
            F.forward(*_args(x, ids, tw.tolist(), w), workspace=workspace)
        with _raises(TypeError, "w_gate must be a torch.Tensor", "got str"):
            F.forward(*_args(x, ids, tw, dict(w, w_gate="w_gate")), workspace=workspace)
        with _raises(TypeError, "workspace must be a mok Workspace", "got str"):
            F.forward(*_args(x, ids, tw, w), workspace="cpu")

    def test_wrong_ndim(self, layer, workspace):
        x, ids, tw, w = layer
        with _raises(ValueError, "x must be 2-D", "got shape [768]"):
            F.forward(*_args(x.flatten(), ids, tw, w), workspace=workspace)
        expect = "topk_ids must be 2-D" if workspace is None else "topk_ids has shape [1, 12, 2], expected [12, 2]"
        with _raises(ValueError, expect):
            F.forward(*_args(x, ids[None], tw, w), workspace=workspace)
        with _raises(ValueError, "x must have at most 4 dimensions"):
            _lib.Views()(torch.zeros(1, 1, 1, 1, 1, dtype=torch.bfloat16), "x", _lib.BF16)

    def test_through_the_op(self, layer):
        x, ids, tw, w = layer
        with _raises(ValueError, "topk_ids must be int32 or int64", "got int16"):
            torch.ops.mok.forward(*_args(x, ids.to(torch.int16), tw, w))
        with _raises(ValueError, "topk_weights must be float32", "got float64"):
            torch.ops.mok.forward(*_args(x, ids, tw.double(), w))


class TestBackward:
    @pytest.fixture
    def ctx(self, layer):
        x, ids, tw, w = layer
        return F.forward(*_args(x, ids, tw, w))[1]

    def test_dy(self, ctx, layer):
        x = layer[0]
        with _raises(ValueError, "dy must be bfloat16", "got float64"):
            F.backward(ctx, x.double())
        with _raises(ValueError, "dy must be on a cpu or cuda device", "got meta"):
            F.backward(ctx, x.to("meta"))
        with _raises(TypeError, "dy must be a torch.Tensor", "got list"):
            F.backward(ctx, x.tolist())
        with _raises(ValueError, "dy has shape [768], expected [12, 64]"):
            F.backward(ctx, x.flatten())

    def test_main_grads(self, ctx, layer):
        x, w = layer[0], layer[3]
        with _raises(ValueError, "main_grad of w_gate must be float32", "got float64"):
            F.backward(ctx, x, main_grads={"w_gate": torch.zeros(w["w_gate"].shape, dtype=torch.float64)})
        with _raises(ValueError, "main_grad of w_up must be on a cpu or cuda device", "got meta"):
            F.backward(ctx, x, main_grads={"w_up": torch.zeros(w["w_up"].shape, device="meta")})
        with _raises(TypeError, "main_grad of w_down must be a torch.Tensor", "got int"):
            F.backward(ctx, x, main_grads={"w_down": 0})
        with _raises(TypeError, "main_grads must be a mapping", "got list"):
            F.backward(ctx, x, main_grads=[torch.zeros(1)])

    def test_ctx(self, layer):
        with _raises(TypeError, "ctx must be the ForwardContext", "got tuple"):
            F.backward(tuple(layer[:3]), layer[0])


class TestWorkspace:
    def test_meta_device(self):
        with _raises(ValueError, "device must be cpu or cuda", "got meta"):
            F.get_workspace(H, I, E, k, 16, device="meta")
        with _raises(ValueError, "device must be cpu or cuda", "got meta"):
            F.create_workspace(H, I, E, k, 16, device="meta")
        with _raises(ValueError, "device must be cpu or cuda", "got meta"):
            _lib.device_index(torch.device("meta"))

    def test_config_type(self):
        with _raises(TypeError, "config must be a mok MoKConfig", "got dict"):
            F.get_workspace(H, I, E, k, 16, config={"minibatch_size": 256})
        with _raises(TypeError, "config must be a mok MoKConfig", "got dict"):
            F.create_workspace(H, I, E, k, 16, config={"minibatch_size": 256})


class TestBuildSchedule:
    def test_int16_ids(self, gen):
        ids = make_routing(gen, T, E, k)[0]
        with _raises(ValueError, "rank 0 topk_ids must be int32 or int64", "got int16"):
            F.build_schedule(ids.to(torch.int16), E)
        with _raises(ValueError, "rank 1 topk_ids must be int32 or int64", "got int16"):
            F.build_schedule([ids, ids.to(torch.int16)], E)
        with _raises(ValueError, "topk_ids must be int32 or int64", "got float64"):
            torch.ops.mok.build_schedule([ids.double()], E)

    def test_meta_ids(self, gen):
        ids = make_routing(gen, T, E, k)[0]
        with _raises(ValueError, "rank 0 topk_ids must be on a cpu or cuda device", "got meta"):
            F.build_schedule(ids.to("meta"), E)
        with _raises(ValueError, "rank 1 topk_ids must be on a cpu or cuda device", "got meta"):
            F.build_schedule([ids, ids.to("meta")], E)

    def test_non_tensor_and_ndim(self, gen):
        ids = make_routing(gen, T, E, k)[0]
        with _raises(ValueError, "rank 0 topk_ids must be a 2-D tensor [T, k]", "got list"):
            F.build_schedule([ids.tolist()], E)
        with _raises(ValueError, "rank 1 topk_ids must be a 2-D tensor [T, k]", "got (24,)"):
            F.build_schedule([ids, ids.flatten()], E)


class TestGroupedMM:
    def _inputs(self):
        return (torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(1, 256, 64, dtype=torch.bfloat16),
                torch.zeros(1, dtype=torch.int32))

    def test_dtypes(self):
        a, b, be = self._inputs()
        with _raises(ValueError, "a must be bfloat16", "got float32"):
            ops.grouped_mm(a.float(), b, be)
        with _raises(ValueError, "b1 must be bfloat16", "got float64"):
            ops.grouped_mm(a, b, be, b1=b.double())
        with _raises(ValueError, "block_expert must be int32", "got int16"):
            ops.grouped_mm(a, b, be.to(torch.int16))

    def test_meta_non_tensor_ndim(self):
        a, b, be = self._inputs()
        with _raises(ValueError, "a must be on a cpu or cuda device", "got meta"):
            ops.grouped_mm(a.to("meta"), b, be)
        with _raises(TypeError, "b0 must be a torch.Tensor", "got list"):
            ops.grouped_mm(a, b.tolist(), be)
        with _raises(ValueError, "b0 must be 3-D", "got shape [256, 64]"):
            ops.grouped_mm(a, b[0], be)
        with _raises(ValueError, "out must be 2-D", "got shape [128]"):
            ops.grouped_mm(a, b, be, out=torch.zeros(128, dtype=torch.bfloat16))


class TestGroupedMMDgradDownSwiGLU:
    """kind "dgrad_down_swiglu": its inputs are checked in Python, and shapes by the C side before
    it rejects CPU tensors (so all of it shows without a GPU)."""
    M, H_, I_ = 130, 64, 256

    def _inputs(self):
        M, H_, I_ = self.M, self.H_, self.I_
        return dict(a=torch.zeros(M, H_, dtype=torch.bfloat16), b0=torch.zeros(2, H_, I_, dtype=torch.bfloat16),
                    block_expert=torch.zeros(2, dtype=torch.int32), kind="dgrad_down_swiglu",
                    h=torch.zeros(M, 2 * I_, dtype=torch.bfloat16), row_weight=torch.zeros(M),
                    wa=torch.zeros(M, I_, dtype=torch.bfloat16), dtw_partials=torch.zeros(M, I_ // 128))

    def test_valid_inputs_reach_the_cuda_check(self):
        with _raises(ValueError, "CUDA tensors"):
            ops.grouped_mm(**self._inputs())
        args = self._inputs()
        args.update(wa=None, dtw_partials=None)  # optional
        with _raises(ValueError, "CUDA tensors"):
            ops.grouped_mm(**args)

    def test_missing_inputs(self):
        for name, what in (("h", "[M, 2I] bf16"), ("row_weight", "[M] float32")):
            args = self._inputs()
            args[name] = None
            with _raises(ValueError, "kind 'dgrad_down_swiglu' needs " + name, what):
                ops.grouped_mm(**args)

    def test_dtypes_and_ndim(self):
        for name, bad, fragments in (("h", torch.float32, ("h must be bfloat16", "got float32")),
                                     ("row_weight", torch.bfloat16, ("row_weight must be float32", "got bfloat16")),
                                     ("wa", torch.float32, ("wa must be bfloat16", "got float32")),
                                     ("dtw_partials", torch.float64, ("dtw_partials must be float32", "got float64"))):
            args = self._inputs()
            args[name] = args[name].to(bad)
            with _raises(ValueError, *fragments):
                ops.grouped_mm(**args)
        args = self._inputs()
        args["row_weight"] = args["row_weight"][:, None]
        with _raises(ValueError, "row_weight must be 1-D", "got shape [130, 1]"):
            ops.grouped_mm(**args)

    def test_shapes_checked_by_the_c_side(self):
        M, I_ = self.M, self.I_
        for name, shape, fragment in (("h", (M, I_), "h has shape [130, 256], expected [130, 512]"),
                                      ("out", (M, I_), "out (dh) has shape [130, 256], expected [130, 512]"),
                                      ("wa", (M, 2 * I_), "wa has shape [130, 512], expected [130, 256]"),
                                      ("dtw_partials", (M, 1), "dtw_partials has shape [130, 1], expected [130, 2]")):
            args = self._inputs()
            dtype = torch.float32 if name == "dtw_partials" else torch.bfloat16
            args[name] = torch.zeros(*shape, dtype=dtype)
            with _raises(ValueError, fragment):
                ops.grouped_mm(**args)
        args = self._inputs()
        args.update(b0=torch.zeros(2, self.H_, 352, dtype=torch.bfloat16), h=torch.zeros(M, 704, dtype=torch.bfloat16),
                    wa=None, dtw_partials=None)
        with _raises(ValueError, "I = b0.shape[2] = 352 must be a multiple of 64"):
            ops.grouped_mm(**args)

    def test_epilogue_inputs_belong_to_this_kind(self):
        a, b, be = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(1, 64, 256, dtype=torch.bfloat16), \
            torch.zeros(1, dtype=torch.int32)
        with _raises(ValueError, "h is an input of kind 'dgrad_down_swiglu' only", "'dgrad_down'"):
            ops.grouped_mm(a, b, be, kind="dgrad_down", h=torch.zeros(128, 512, dtype=torch.bfloat16))


class TestEmulated:
    def test_rank_named(self, gen):
        ranks = []
        for s in range(2):
            ids, tw = make_routing(gen, 5, E, k)
            w = make_weights(gen, H, I, E // 2)
            ranks.append(F.RankInputs(make_x(gen, 5, H), ids, tw, w["w_gate"], w["w_up"], w["w_down"]))
        ranks[1].topk_ids = ranks[1].topk_ids.to(torch.int16)
        with _raises(ValueError, "rank 1: topk_ids must be int32 or int64", "got int16"):
            F.forward_emulated(ranks, num_experts=E)
        ranks[1].topk_ids = ranks[1].topk_ids.int()
        ranks[0].topk_weights = ranks[0].topk_weights.double()
        with _raises(ValueError, "rank 0: topk_weights must be float32", "got float64"):
            F.forward_emulated(ranks, num_experts=E)


class TestMoE:
    @pytest.fixture
    def moe(self):
        return mok.nn.MoE(H, I, E, k)

    def test_x(self, moe, gen):
        x = make_x(gen, T, H)
        with _raises(ValueError, "x must be bfloat16", "got float64"):
            moe(x.double())
        with _raises(ValueError, "x must be on cpu", "got meta"):
            moe(x.to("meta"))
        with _raises(TypeError, "x must be a torch.Tensor", "got list"):
            moe(x.tolist())
        with _raises(ValueError, f"x must have shape [..., hidden = {H}]", "got [12, 32]"):
            moe(x[:, :32])

    def test_routing(self, moe, gen):
        x = make_x(gen, T, H)
        ids, tw = make_routing(gen, T, E, k)
        with _raises(ValueError, "topk_ids must be int32 or int64", "got int16"):
            moe(x, ids.to(torch.int16), tw)
        with _raises(ValueError, "topk_ids must be on cpu", "got meta"):
            moe(x, ids.to("meta"), tw)
        with _raises(TypeError, "topk_weights must be a torch.Tensor", "got list"):
            moe(x, ids, tw.tolist())
        with _raises(ValueError, f"topk_ids must have shape [..., topk = {k}]", "got [12, 1]"):
            moe(x, ids[:, :1], tw)
        # float64 routing weights are taken (as float32)
        assert torch.equal(moe(x, ids, tw.double()), moe(x, ids, tw))

    def test_config(self):
        with _raises(TypeError, "config must be a mok MoKConfig", "got dict"):
            mok.nn.MoE(H, I, E, k, config={"block_m": 64})
