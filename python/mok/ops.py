"""mok's torch.library ops (namespace `mok`), with fake implementations for torch.compile
and autograd for mok::forward.

The workspace is not an op argument: the ops take the config knobs as plain ints/floats and
look the workspace up in functional's cache (max_tokens = 0: T rounded up to a power of two).
"""
import ctypes
import dataclasses
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _lib
from . import functional as F

_PRECISION_NAMES = {code: name for name, code in F._lib.PRECISIONS.items()}
# The knob defaults of the op signatures: libmok's (mokGetDefaultConfig), as plain numbers when
# the ops are defined (torch.library takes literal-valued defaults). tests/python/test_defaults.py
# checks that they match MoKConfig's.
_D = _lib.config_defaults()


def config_args(config: Optional[F.MoKConfig] = None) -> dict:
    """The op arguments that carry a MoKConfig (precision as its mokPrecision_t code)."""
    args = dataclasses.asdict(config or F.MoKConfig())
    args["precision"] = F._lib.PRECISIONS[args["precision"]]
    return args


def _config(fwd_num_comm_sms, bwd_num_comm_sms, minibatch_size, macrobatch_size, block_m,
            schedule_capacity_multiplier, precision, timeout_s, num_threads, num_blocks,
            fp8_pow2_scales=False) -> F.MoKConfig:
    if precision not in _PRECISION_NAMES:
        raise ValueError(f"precision = {precision}; expected one of {sorted(_PRECISION_NAMES)}")
    return F.MoKConfig(fwd_num_comm_sms, bwd_num_comm_sms, minibatch_size, macrobatch_size, block_m,
                       schedule_capacity_multiplier, _PRECISION_NAMES[precision], timeout_s, num_threads,
                       num_blocks, bool(fp8_pow2_scales))


def _workspace(x, topk_ids, w_gate, ws_gate, max_tokens, config) -> Optional[F.Workspace]:
    if max_tokens <= 0:
        return None
    shared = 0 if ws_gate is None else ws_gate.shape[0]
    return F.get_workspace(w_gate.shape[2], w_gate.shape[1], w_gate.shape[0], topk_ids.shape[1], max_tokens,
                           shared_intermediate=shared, device=x.device, config=config)


@torch.library.custom_op("mok::forward", mutates_args=())
def forward(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
            ws_gate: Optional[Tensor] = None, ws_up: Optional[Tensor] = None, ws_down: Optional[Tensor] = None,
            max_tokens: int = 0, fwd_num_comm_sms: int = _D["fwd_num_comm_sms"],
            bwd_num_comm_sms: int = _D["bwd_num_comm_sms"], minibatch_size: int = _D["minibatch_size"],
            macrobatch_size: int = _D["macrobatch_size"], block_m: int = _D["block_m"],
            schedule_capacity_multiplier: float = _D["schedule_capacity_multiplier"],
            precision: int = _D["precision"], timeout_s: float = _D["timeout_s"],
            num_threads: int = _D["num_threads"], num_blocks: int = _D["num_blocks"],
            fp8_pow2_scales: bool = bool(_D["fp8_pow2_scales"])) -> Tensor:
    """y [T, H] bf16 of the MoE layer (EP = 1)."""
    config = _config(fwd_num_comm_sms, bwd_num_comm_sms, minibatch_size, macrobatch_size, block_m,
                     schedule_capacity_multiplier, precision, timeout_s, num_threads, num_blocks, fp8_pow2_scales)
    ws = _workspace(x, topk_ids, w_gate, ws_gate, max_tokens, config)
    y, _ = F.forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, workspace=ws,
                     config=None if ws is not None else config)
    return y


@forward.register_fake
def _(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None, *args):
    return x.new_empty((x.shape[0], w_down.shape[1]), dtype=torch.bfloat16)


@torch.library.custom_op("mok::backward", mutates_args=())
def backward(dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor,
             w_down: Tensor, ws_gate: Optional[Tensor] = None, ws_up: Optional[Tensor] = None,
             ws_down: Optional[Tensor] = None, max_tokens: int = 0,
             fwd_num_comm_sms: int = _D["fwd_num_comm_sms"], bwd_num_comm_sms: int = _D["bwd_num_comm_sms"],
             minibatch_size: int = _D["minibatch_size"], macrobatch_size: int = _D["macrobatch_size"],
             block_m: int = _D["block_m"], schedule_capacity_multiplier: float = _D["schedule_capacity_multiplier"],
             precision: int = _D["precision"], timeout_s: float = _D["timeout_s"],
             num_threads: int = _D["num_threads"], num_blocks: int = _D["num_blocks"],
             fp8_pow2_scales: bool = bool(_D["fp8_pow2_scales"]),
             saved_h: Optional[Tensor] = None, saved_shared_h: Optional[Tensor] = None
             ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, d_topk_weights, d w_gate, d w_up, d w_down, d ws_gate, d ws_up, d ws_down); the
    shared-expert gradients are empty tensors when there is no shared expert.  saved_h (and
    saved_shared_h with a shared expert): what mok::forward_saving returned for the same inputs
    (the pre-activations are then read, not recomputed)."""
    config = _config(fwd_num_comm_sms, bwd_num_comm_sms, minibatch_size, macrobatch_size, block_m,
                     schedule_capacity_multiplier, precision, timeout_s, num_threads, num_blocks, fp8_pow2_scales)
    ws = _workspace(x, topk_ids, w_gate, ws_gate, max_tokens, config)
    ctx = F.recompute_forward_context(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                                      workspace=ws, config=None if ws is not None else config)
    if saved_h is not None:
        ctx.saved = (saved_h, saved_shared_h if ws_gate is not None else None)
    g = F.backward(ctx, dy)
    absent = x.new_empty((0,), dtype=torch.bfloat16)
    shared = [t if t is not None else absent.clone() for t in (g.ws_gate, g.ws_up, g.ws_down)]
    return (g.dx, g.d_topk_weights, g.w_gate, g.w_up, g.w_down, *shared)


@backward.register_fake
def _(dy, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None, *args):
    def like(w):
        return x.new_empty((0,) if w is None else w.shape, dtype=torch.bfloat16)

    return (x.new_empty(x.shape, dtype=torch.bfloat16), topk_weights.new_empty(topk_ids.shape, dtype=torch.float32),
            like(w_gate), like(w_up), like(w_down), like(ws_gate), like(ws_up), like(ws_down))


@torch.library.custom_op("mok::forward_saving", mutates_args=())
def forward_saving(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                   ws_gate: Optional[Tensor] = None, ws_up: Optional[Tensor] = None, ws_down: Optional[Tensor] = None,
                   max_tokens: int = 0, fwd_num_comm_sms: int = _D["fwd_num_comm_sms"],
                   bwd_num_comm_sms: int = _D["bwd_num_comm_sms"], minibatch_size: int = _D["minibatch_size"],
                   macrobatch_size: int = _D["macrobatch_size"], block_m: int = _D["block_m"],
                   schedule_capacity_multiplier: float = _D["schedule_capacity_multiplier"],
                   precision: int = _D["precision"], timeout_s: float = _D["timeout_s"],
                   num_threads: int = _D["num_threads"], num_blocks: int = _D["num_blocks"],
                   fp8_pow2_scales: bool = bool(_D["fp8_pow2_scales"])
                   ) -> Tuple[Tensor, Tensor, Tensor]:
    """(y, saved_h, saved_shared_h): the training forward on CUDA, with the gate/up
    pre-activations kept for mok::backward (saved_shared_h is empty without a shared expert)."""
    config = _config(fwd_num_comm_sms, bwd_num_comm_sms, minibatch_size, macrobatch_size, block_m,
                     schedule_capacity_multiplier, precision, timeout_s, num_threads, num_blocks, fp8_pow2_scales)
    ws = _workspace(x, topk_ids, w_gate, ws_gate, max_tokens, config)
    y, ctx = F.forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, workspace=ws,
                       config=None if ws is not None else config, save_for_backward=True)
    h, shared_h = ctx.saved
    return y, h, shared_h if shared_h is not None else x.new_empty((0,), dtype=torch.bfloat16)


@forward_saving.register_fake
def _(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None, max_tokens=0,
      fwd_num_comm_sms=_D["fwd_num_comm_sms"], bwd_num_comm_sms=_D["bwd_num_comm_sms"],
      minibatch_size=_D["minibatch_size"], macrobatch_size=_D["macrobatch_size"], block_m=_D["block_m"], *args):
    T, E, k = int(x.shape[0]), int(w_gate.shape[0]), int(topk_ids.shape[1])
    config = F.MoKConfig(block_m=block_m, minibatch_size=minibatch_size, macrobatch_size=macrobatch_size)
    max_rows, _, _ = F.plan_capacity(E, k, max_tokens if max_tokens > 0 else F.token_bucket(T), 1, config)
    shared = x.new_empty((T, 2 * ws_gate.shape[0]) if ws_gate is not None else (0,), dtype=torch.bfloat16)
    return (x.new_empty((T, w_down.shape[1]), dtype=torch.bfloat16),
            x.new_empty((max_rows, 2 * w_gate.shape[1]), dtype=torch.bfloat16), shared)


def _setup_saving(ctx, inputs, output) -> None:
    x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, *config = inputs
    _, h, shared_h = output
    ctx.save_for_backward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, h, shared_h)
    ctx.config = config
    ctx.mark_non_differentiable(h, shared_h)


def _backward_saving(ctx, dy, _dh, _dsh):
    *saved, h, shared_h = ctx.saved_tensors
    has_shared = saved[6] is not None
    grads = torch.ops.mok.backward(dy.contiguous(), *saved, *ctx.config, h, shared_h if has_shared else None)
    dx, d_topk_weights, d_gate, d_up, d_down, ds_gate, ds_up, ds_down = grads
    shared = (ds_gate, ds_up, ds_down) if has_shared else (None, None, None)
    return (dx, None, d_topk_weights, d_gate, d_up, d_down, *shared) + (None,) * len(ctx.config)


forward_saving.register_autograd(_backward_saving, setup_context=_setup_saving)


def _setup_context(ctx, inputs, output) -> None:
    x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, *config = inputs
    ctx.save_for_backward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    ctx.config = config


def _backward(ctx, dy):
    saved = ctx.saved_tensors
    has_shared = saved[6] is not None
    grads = torch.ops.mok.backward(dy.contiguous(), *saved, *ctx.config)
    dx, d_topk_weights, d_gate, d_up, d_down, ds_gate, ds_up, ds_down = grads
    shared = (ds_gate, ds_up, ds_down) if has_shared else (None, None, None)
    return (dx, None, d_topk_weights, d_gate, d_up, d_down, *shared) + (None,) * len(ctx.config)


forward.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("mok::build_schedule", mutates_args=())
def build_schedule(topk_ids: List[Tensor], num_experts: int, ep_rank: int = 0, max_tokens: int = 0,
                   block_m: int = _D["block_m"], minibatch_size: int = _D["minibatch_size"],
                   macrobatch_size: int = _D["macrobatch_size"]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(rows, expert_count, expert_offset, block_expert, error) of rank ep_rank's plan from the
    gathered routing (P = len(topk_ids)); max_tokens = 0: the largest T."""
    config = F.MoKConfig(block_m=block_m, minibatch_size=minibatch_size, macrobatch_size=macrobatch_size)
    return F.build_schedule_tensors(topk_ids, num_experts, ep_rank=ep_rank,
                                    max_tokens=max_tokens if max_tokens > 0 else None, config=config)


@build_schedule.register_fake
def _(topk_ids, num_experts, ep_rank=0, max_tokens=0, block_m=_D["block_m"], minibatch_size=_D["minibatch_size"],
      macrobatch_size=_D["macrobatch_size"]):
    if max_tokens <= 0:
        max_tokens = max(t.shape[0] for t in topk_ids)
    config = F.MoKConfig(block_m=block_m, minibatch_size=minibatch_size, macrobatch_size=macrobatch_size)
    max_rows, max_blocks, num_local = F.plan_capacity(num_experts, topk_ids[0].shape[1], int(max_tokens),
                                                      len(topk_ids), config)
    ids = topk_ids[0]
    return (ids.new_empty((max_rows,), dtype=torch.int32), ids.new_empty((num_local,), dtype=torch.int32),
            ids.new_empty((num_local + 1,), dtype=torch.int32), ids.new_empty((max_blocks,), dtype=torch.int32),
            ids.new_empty((4,), dtype=torch.int64))


def grouped_mm(a: Tensor, b0: Tensor, block_expert: Tensor, b1: Optional[Tensor] = None,
               out: Optional[Tensor] = None, kind: Optional[str] = None, *, h: Optional[Tensor] = None,
               row_weight: Optional[Tensor] = None, wa: Optional[Tensor] = None,
               dtw_partials: Optional[Tensor] = None) -> Tensor:
    """mok's grouped-GEMM engine on CUDA tensors (tests and benchmarks).

    a [M, K] bf16, rows grouped in 128-row blocks; block_expert [ceil(M/128)] int32 gives each
    block's expert (-1: past the end, left unwritten).  K and N multiples of 64.  kind
    (default: "gate_up" with b1, "down" without):
      "down":          out = a @ b0[e].T, b0 [E, N, K];
      "gate_up":       out = silu(a @ b0[e].T) * (a @ b1[e].T), b0, b1 [E, N, K];
      "dgrad_down":    out = a @ b0[e], b0 = w_down [E, K, N] as stored (da = dy @ W_down);
      "dgrad_gate_up": out = a @ cat(b0[e], b1[e]), b0 = w_gate, b1 = w_up [E, K/2, N] as
                       stored (dx = [dg | du] @ [W_gate; W_up]);
      "gate_up_preact": out = [a @ b0[e].T | a @ b1[e].T] [M, 2N] bf16, b0, b1 [E, N, K]: the
                       pre-activations h = [g | u] the backward replays;
      "dgrad_down_swiglu": the SwiGLU backward in the epilogue of da = a @ b0[e] (a = dy rows
                       [M, H], b0 = w_down [E, H, I] as stored).  h [M, 2I] bf16
                       (= [g | u], required), row_weight [M] fp32 (required); returns
                       out = dh [M, 2I] bf16 = [bf16(w*da*u*silu'(g)) | bf16(w*da*silu(g))], and
                       writes wa [M, I] bf16 = bf16(w*a) and dtw_partials [M, ceil(I/128)] fp32
                       (the sums of da*a over each 128 channels: d topk_weights = their sum in
                       ascending order) where given; a = bf16(silu(g)*u) from h as stored."""
    if kind is None:
        kind = "gate_up" if b1 is not None else "down"
    if kind not in _lib.GEMM_KINDS:
        raise ValueError(f"kind must be one of {sorted(_lib.GEMM_KINDS)}, got {kind!r}")
    _lib.expect_tensor(a, "a", _lib.BF16, ndim=2)
    _lib.expect_tensor(b0, "b0", _lib.BF16, ndim=3)
    _lib.expect_tensor(block_expert, "block_expert", _lib.INT32, ndim=1)
    two_b = kind in ("gate_up", "dgrad_gate_up", "gate_up_preact")
    if two_b and b1 is None:
        raise ValueError(f"kind {kind!r} needs b1")
    if b1 is not None:
        _lib.expect_tensor(b1, "b1", _lib.BF16, ndim=3)
    if out is not None:
        _lib.expect_tensor(out, "out", _lib.BF16, ndim=2)
    swiglu_bwd = kind == "dgrad_down_swiglu"
    extra = (("h", h, _lib.BF16, 2), ("row_weight", row_weight, _lib.FP32, 1), ("wa", wa, _lib.BF16, 2),
             ("dtw_partials", dtw_partials, _lib.FP32, 2))
    for name, t, dtypes, ndim in extra:
        if not swiglu_bwd and t is not None:
            raise ValueError(f"{name} is an input of kind 'dgrad_down_swiglu' only, not of {kind!r}")
        if swiglu_bwd and t is None and name in ("h", "row_weight"):
            raise ValueError(f"kind 'dgrad_down_swiglu' needs {name} ("
                             + ("[M, 2I] bf16, the saved [g | u]" if name == "h" else "[M] float32, the route weights")
                             + ")")
        if t is not None:
            _lib.expect_tensor(t, name, dtypes, ndim=ndim)
    _lib.device_index(a.device, "a")
    n = b0.shape[2] if kind.startswith("dgrad") else b0.shape[1]
    if out is None:
        wide = swiglu_bwd or kind == "gate_up_preact"
        out = torch.empty(a.shape[0], 2 * n if wide else n, dtype=torch.bfloat16, device=a.device)
    views = _lib.Views()
    args = _lib.mokGroupedGemmArgs(views(a, "a", _lib.BF16), views(b0, "b0", _lib.BF16),
                                   views(b1 if b1 is not None else b0, "b1", _lib.BF16),
                                   views(block_expert, "block_expert", _lib.INT32), views(out, "out", _lib.BF16),
                                   _lib.GEMM_KINDS[kind], 0, views(h, "h", _lib.BF16),
                                   views(row_weight, "row_weight", _lib.FP32), views(wa, "wa", _lib.BF16),
                                   views(dtw_partials, "dtw_partials", _lib.FP32))
    _lib.check(_lib.lib.mokGroupedGemm(ctypes.byref(args), _lib.stream_of(_lib.device_index(a.device))))
    return out


def grouped_mm_fp8(a: Tensor, a_scales: Tensor, b0: Tensor, b0_scales: Tensor, block_expert: Tensor,
                   b1: Optional[Tensor] = None, b1_scales: Optional[Tensor] = None, out: Optional[Tensor] = None,
                   kind: Optional[str] = None, *, quantize_out: bool = False, out_scales: Optional[Tensor] = None,
                   pow2: bool = False, b_transposed: bool = False):
    """The forward kinds of grouped_mm in fp8 with block scales (DeepSeek-V3's recipe,
    docs/precision.md), on CUDA tensors: a [M, K] and b0 / b1 [E, N, K] float8_e4m3fn with fp32
    scales a_scales [K/128, M] (per row and 128 of K, k-block-major) and b*_scales [E, ceil(N/128),
    K/128] (per 128 x 128 block): what mok.fp8.quantize_rows / quantize_blocks return.  Each
    k-block's e4m3 sum is scaled into the fp32 result once; then kind's epilogue as in
    grouped_mm ("down", "gate_up", "gate_up_preact"; default "gate_up" with b1, "down" without),
    out bf16.  K % 128 == 0, N % 64 == 0, M % 4 == 0.
    quantize_out (gate_up, N % 128 == 0): a = silu(g)·u quantised as mok.fp8.quantize_rows does
    it, from its fp32 value, for the down kind: returns (out e4m3 [M, N], out_scales [N/128, M])
    (pow2: power-of-two scales, UE8M0).
    b_transposed: b0 / b1 are transposed copies (quantize_blocks_fp8's qt) and b*_scales the
    scales of the matrices they transpose, [E, K/128, ceil(N/128)] (a block's scale is its
    transpose's): the dgrad GEMMs on the weights' one set of scales."""
    if kind is None:
        kind = "gate_up" if b1 is not None else "down"
    if kind not in ("down", "gate_up", "gate_up_preact"):
        raise ValueError(f"kind must be 'down', 'gate_up' or 'gate_up_preact' in fp8, got {kind!r}")
    _lib.expect_tensor(a, "a", _lib.E4M3, ndim=2)
    _lib.expect_tensor(a_scales, "a_scales", _lib.FP32, ndim=2)
    _lib.expect_tensor(b0, "b0", _lib.E4M3, ndim=3)
    _lib.expect_tensor(b0_scales, "b0_scales", _lib.FP32, ndim=3)
    _lib.expect_tensor(block_expert, "block_expert", _lib.INT32, ndim=1)
    two_b = kind != "down"
    if two_b and (b1 is None or b1_scales is None):
        raise ValueError(f"kind {kind!r} needs b1 and b1_scales")
    if not two_b and (b1 is not None or b1_scales is not None):
        raise ValueError("kind 'down' takes b0 and b0_scales only")
    if two_b:
        _lib.expect_tensor(b1, "b1", _lib.E4M3, ndim=3)
        _lib.expect_tensor(b1_scales, "b1_scales", _lib.FP32, ndim=3)
    if quantize_out and kind != "gate_up":
        raise ValueError(f"quantize_out is for kind 'gate_up' (a for the down kind), not {kind!r}")
    if (out_scales is not None or pow2) and not quantize_out:
        raise ValueError("out_scales and pow2 go with quantize_out=True")
    m, n = a.shape[0], b0.shape[1]
    out_dtype = _lib.E4M3 if quantize_out else _lib.BF16
    if out is None:
        out = torch.empty(m, 2 * n if kind == "gate_up_preact" else n, dtype=out_dtype[0], device=a.device)
    _lib.expect_tensor(out, "out", out_dtype, ndim=2)
    if quantize_out:
        if out_scales is None:
            out_scales = torch.empty(n // 128, m, dtype=torch.float32, device=a.device)
        _lib.expect_tensor(out_scales, "out_scales", _lib.FP32, ndim=2)
    views = _lib.Views()
    args = _lib.mokGroupedGemmArgs(views(a, "a", _lib.E4M3), views(b0, "b0", _lib.E4M3),
                                   views(b1 if two_b else b0, "b1", _lib.E4M3),
                                   views(block_expert, "block_expert", _lib.INT32), views(out, "out", out_dtype),
                                   _lib.GEMM_KINDS[kind], 0, views(None, "h"), views(None, "row_weight"),
                                   views(None, "wa"), views(None, "dtw_partials"))
    scales = _lib.mokGemmBlockScales(views(a_scales, "a_scales", _lib.FP32), views(b0_scales, "b0_scales", _lib.FP32),
                                     views(b1_scales if two_b else b0_scales, "b1_scales", _lib.FP32),
                                     views(out_scales, "out_scales", _lib.FP32), 1 if pow2 else 0,
                                     1 if b_transposed else 0)
    fn = _lib.symbol("mokGroupedGemmBlockScaled")
    _lib.check(fn(ctypes.byref(args), ctypes.byref(scales), _lib.stream_of(_lib.device_index(a.device))))
    return (out, out_scales) if quantize_out else out


def quantize_rows_fp8(x: Tensor, q: Optional[Tensor] = None, scales: Optional[Tensor] = None, *,
                      pow2: bool = False):
    """mok.fp8.quantize_rows on the GPU, one kernel (the quantiser the gathers will run on the
    rows they copy): x [M, K] bf16 (K % 128 == 0) -> (q [M, K] float8_e4m3fn, scales [K/128, M]
    fp32), bit for bit the same (pow2: power-of-two scales, as quantize_rows(pow2=True))."""
    _lib.expect_tensor(x, "x", _lib.BF16, ndim=2)
    m, k = x.shape
    if q is None:
        q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    if scales is None:
        scales = torch.empty(k // 128 if k % 128 == 0 else 0, m, dtype=torch.float32, device=x.device)
    views = _lib.Views()
    vx, vq, vs = views(x, "x", _lib.BF16), views(q, "q", _lib.E4M3), views(scales, "scales", _lib.FP32)
    fn = _lib.symbol("mokQuantizeRowsE4m3")
    _lib.check(fn(ctypes.byref(vx), ctypes.byref(vq), ctypes.byref(vs), 1 if pow2 else 0,
                  _lib.stream_of(_lib.device_index(x.device))))
    return q, scales


def quantize_blocks_fp8(w: Tensor, *, q: bool = True, qt: bool = True, pow2: bool = False):
    """mok.fp8.quantize_blocks on the GPU, one kernel, one read of w: w [E, R, C] or [R, C] bf16
    (R, C multiples of 128; row- or column-major matrices, read in place) -> (q [.., R, C],
    qt [.., C, R], scales [.., R/128, C/128]): a scale per 128 x 128 block and w / scale in
    float8_e4m3fn, as stored (q) and transposed (qt, what the dgrad GEMMs read with
    b_transposed=True; the scales serve both).  q=False or qt=False: that copy is not made
    (None).  pow2: power-of-two scales (UE8M0)."""
    if not isinstance(w, Tensor) or w.dim() not in (2, 3):
        raise ValueError(f"w must be a [E, R, C] or [R, C] tensor, got {getattr(w, 'shape', type(w))}")
    if not (q or qt):
        raise ValueError("quantize_blocks_fp8: q=False and qt=False leave nothing to make")
    _lib.expect_tensor(w, "w", _lib.BF16, ndim=w.dim())
    *lead, r, c = w.shape
    if r % 128 or c % 128:
        raise ValueError(f"w is [{r}, {c}] per matrix: both must be multiples of 128 (whole blocks)")
    fp8 = torch.float8_e4m3fn
    oq = torch.empty(*lead, r, c, dtype=fp8, device=w.device) if q else None
    oqt = torch.empty(*lead, c, r, dtype=fp8, device=w.device) if qt else None
    scales = torch.empty(*lead, r // 128, c // 128, dtype=torch.float32, device=w.device)
    views = _lib.Views()
    vw = views(w, "w", _lib.BF16)
    vq, vqt = views(oq, "q", _lib.E4M3), views(oqt, "qt", _lib.E4M3)
    vs = views(scales, "scales", _lib.FP32)
    fn = _lib.symbol("mokQuantizeBlocksE4m3")
    _lib.check(fn(ctypes.byref(vw), ctypes.byref(vq), ctypes.byref(vqt), ctypes.byref(vs), 1 if pow2 else 0,
                  _lib.stream_of(_lib.device_index(w.device))))
    return oq, oqt, scales


def dgrad_down_swiglu_fp8(dy: Tensor, dy_scales: Tensor, w_down_qt: Tensor, w_down_scales: Tensor,
                          block_expert: Tensor, h: Tensor, row_weight: Tensor, *, a: Optional[Tensor] = None,
                          dtw_partials: Optional[Tensor] = None, pow2: bool = False):
    """fp8_block's dgrad down with the SwiGLU backward in its epilogue, on CUDA tensors: da = dy ·
    W_down[e] block-scaled (dy [M, H] float8_e4m3fn with dy_scales [H/128, M] from
    quantize_rows_fp8; W_down's transposed copy w_down_qt [E, I, H] with W_down's own scales
    [E, H/128, I/128], as quantize_blocks_fp8 returns them), then per row (weight row_weight [M])
    and channel, from the saved h = [g | u] [M, 2I] bf16: dg = (w·da·u)·silu'(g), du = w·da·silu(g)
    (docs/precision.md).  Returns (dh [M, 2I] float8_e4m3fn, dh_scales [2I/128, M]): dh quantised
    per row and 128 channels, the dgrad gate/up kind's A.  a ([M, I] bf16: silu(g)·u) and
    dtw_partials ([M, I/128] fp32: Σ da · a as the forward quantised a) are written where given."""
    _lib.expect_tensor(dy, "dy", _lib.E4M3, ndim=2)
    _lib.expect_tensor(w_down_qt, "w_down_qt", _lib.E4M3, ndim=3)
    m, inter = dy.shape[0], w_down_qt.shape[1]
    dh = torch.empty(m, 2 * inter, dtype=torch.float8_e4m3fn, device=dy.device)
    dh_scales = torch.empty(2 * inter // 128, m, dtype=torch.float32, device=dy.device)
    views = _lib.Views()
    args = _lib.mokGroupedGemmArgs(views(dy, "dy", _lib.E4M3), views(w_down_qt, "w_down_qt", _lib.E4M3),
                                   views(w_down_qt, "w_down_qt", _lib.E4M3),
                                   views(block_expert, "block_expert", _lib.INT32), views(dh, "dh", _lib.E4M3),
                                   _lib.GEMM_KINDS["dgrad_down_swiglu"], 0, views(h, "h", _lib.BF16),
                                   views(row_weight, "row_weight", _lib.FP32), views(a, "a", _lib.BF16),
                                   views(dtw_partials, "dtw_partials", _lib.FP32))
    scales = _lib.mokGemmBlockScales(views(dy_scales, "dy_scales", _lib.FP32),
                                     views(w_down_scales, "w_down_scales", _lib.FP32),
                                     views(w_down_scales, "w_down_scales", _lib.FP32),
                                     views(dh_scales, "dh_scales", _lib.FP32), 1 if pow2 else 0, 1)
    fn = _lib.symbol("mokGroupedGemmBlockScaled")
    _lib.check(fn(ctypes.byref(args), ctypes.byref(scales), _lib.stream_of(_lib.device_index(dy.device))))
    return dh, dh_scales


def dgrad_gate_up_fp8(dh: Tensor, dh_scales: Tensor, w_gate_qt: Tensor, w_gate_scales: Tensor, w_up_qt: Tensor,
                      w_up_scales: Tensor, block_expert: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """fp8_block's dgrad gate/up on CUDA tensors: dx rows = dh · [W_gate; W_up][e] block-scaled,
    dh [M, 2I] float8_e4m3fn with dh_scales [2I/128, M] (dgrad_down_swiglu_fp8's), the weights'
    transposed copies w_gate_qt, w_up_qt [E, H, I] with their own scales [E, I/128, H/128]
    (quantize_blocks_fp8's qt and scales): K = 2I, the gate k-blocks then the up ones, no stacked
    copy.  out bf16 [M, H]."""
    _lib.expect_tensor(dh, "dh", _lib.E4M3, ndim=2)
    _lib.expect_tensor(w_gate_qt, "w_gate_qt", _lib.E4M3, ndim=3)
    if out is None:
        out = torch.empty(dh.shape[0], w_gate_qt.shape[1], dtype=torch.bfloat16, device=dh.device)
    views = _lib.Views()
    args = _lib.mokGroupedGemmArgs(views(dh, "dh", _lib.E4M3), views(w_gate_qt, "w_gate_qt", _lib.E4M3),
                                   views(w_up_qt, "w_up_qt", _lib.E4M3), views(block_expert, "block_expert", _lib.INT32),
                                   views(out, "out", _lib.BF16), _lib.GEMM_KINDS["dgrad_gate_up"], 0, views(None, "h"),
                                   views(None, "row_weight"), views(None, "wa"), views(None, "dtw_partials"))
    scales = _lib.mokGemmBlockScales(views(dh_scales, "dh_scales", _lib.FP32),
                                     views(w_gate_scales, "w_gate_scales", _lib.FP32),
                                     views(w_up_scales, "w_up_scales", _lib.FP32), views(None, "out_scales"), 0, 1)
    fn = _lib.symbol("mokGroupedGemmBlockScaled")
    _lib.check(fn(ctypes.byref(args), ctypes.byref(scales), _lib.stream_of(_lib.device_index(dh.device))))
    return out


def quantize_cols_fp8(v: Tensor, qt: Optional[Tensor] = None, scales: Optional[Tensor] = None, *,
                      pow2: bool = False):
    """mok.fp8.quantize_cols on the GPU, one kernel: v [R, C] bf16 (R, C multiples of 128) ->
    (qt [C, R] float8_e4m3fn: v transposed, scales [R/128, C] fp32): a scale per column and 128
    rows, the fp8 wgrad kind's operands (grouped_wgrad_fp8)."""
    _lib.expect_tensor(v, "v", _lib.BF16, ndim=2)
    r, c = v.shape
    if r % 128 or c % 128:
        raise ValueError(f"v is [{r}, {c}]: both must be multiples of 128 (scales per 128 rows)")
    if qt is None:
        qt = torch.empty(c, r, dtype=torch.float8_e4m3fn, device=v.device)
    if scales is None:
        scales = torch.empty(r // 128, c, dtype=torch.float32, device=v.device)
    views = _lib.Views()
    fn = _lib.symbol("mokQuantizeColsE4m3")
    _lib.check(fn(ctypes.byref(views(v, "v", _lib.BF16)), ctypes.byref(views(qt, "qt", _lib.E4M3)),
                  ctypes.byref(views(scales, "scales", _lib.FP32)), 1 if pow2 else 0,
                  _lib.stream_of(_lib.device_index(v.device))))
    return qt, scales


def grouped_wgrad_fp8(a: Tensor, a_scales: Tensor, b: Tensor, b_scales: Tensor, expert_offset: Tensor,
                      expert_count: Tensor, out: Optional[Tensor] = None, acc: Optional[Tensor] = None,
                      main_grad: Optional[Tensor] = None, accumulate: bool = False,
                      store_acc: bool = False) -> Optional[Tensor]:
    """The fp8 wgrad kind on CUDA tensors: out[e] = Σ over expert e's k-blocks of 128 rows of the
    k-block's e4m3 sum of a[m, r]·b[n, r], times a_scales[kb, m]·b_scales[kb, n], promoted into
    fp32 once per k-block (mok.fp8.wgrad_reference is the recipe).  a [Mo, R] and b [No, R]
    float8_e4m3fn, the operands transposed as quantize_cols_fp8 writes them, with their scales
    [R/128, Mo] and [R/128, No]; expert_offset [E+1] (multiples of 128) and expert_count [E]
    int32, the rows past each count up to the next multiple of 128 zero.  out bf16 [E, Mo, No],
    acc / main_grad fp32 as in grouped_wgrad; without any, a bf16 out is allocated and returned."""
    _lib.expect_tensor(a, "a", _lib.E4M3, ndim=2)
    _lib.expect_tensor(b, "b", _lib.E4M3, ndim=2)
    e = expert_count.shape[0]
    if out is None and acc is None and main_grad is None:
        out = torch.empty(e, a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
    views = _lib.Views()
    args = _lib.mokGroupedWgradBlockScaledArgs(
        views(a, "a", _lib.E4M3), views(b, "b", _lib.E4M3), views(a_scales, "a_scales", _lib.FP32),
        views(b_scales, "b_scales", _lib.FP32), views(expert_offset, "expert_offset", _lib.INT32),
        views(expert_count, "expert_count", _lib.INT32), views(out, "out", _lib.BF16), views(acc, "acc", _lib.FP32),
        views(main_grad, "main_grad", _lib.FP32), 1 if accumulate else 0, 1 if store_acc else 0, 0)
    fn = _lib.symbol("mokGroupedWgradBlockScaled")
    _lib.check(fn(ctypes.byref(args), _lib.stream_of(_lib.device_index(a.device))))
    return out


def grouped_wgrad(a: Tensor, b: Tensor, expert_offset: Tensor, expert_count: Tensor,
                  out: Optional[Tensor] = None, acc: Optional[Tensor] = None, main_grad: Optional[Tensor] = None,
                  accumulate: bool = False, store_acc: bool = False) -> Optional[Tensor]:
    """mok's K-grouped weight-gradient GEMM on CUDA tensors (tests, benchmarks, the backward).

    out[e] = a[rows of e].T @ b[rows of e], a [R, Mo] and b [R, No] bf16; expert_offset [E+1]
    int32 (first row of each expert, a multiple of 64), expert_count [E] int32; rows past an
    expert's count up to the next multiple of 64 must be zero (the plan's padding rows).  In
    fp32: total = (acc if accumulate else 0) + the sum; acc = total (store_acc), out =
    bf16(total), main_grad += total, each where given.  Without out, acc and main_grad, a bf16
    out [E, Mo, No] is allocated and returned."""
    _lib.expect_tensor(a, "a", _lib.BF16, ndim=2)
    _lib.expect_tensor(b, "b", _lib.BF16, ndim=2)
    _lib.expect_tensor(expert_offset, "expert_offset", _lib.INT32, ndim=1)
    _lib.expect_tensor(expert_count, "expert_count", _lib.INT32, ndim=1)
    for t, name, dtype in ((out, "out", _lib.BF16), (acc, "acc", _lib.FP32), (main_grad, "main_grad", _lib.FP32)):
        if t is not None:
            _lib.expect_tensor(t, name, dtype, ndim=3)
    _lib.device_index(a.device, "a")
    if out is None and main_grad is None and not store_acc:
        out = torch.empty(expert_count.shape[0], a.shape[1], b.shape[1], dtype=torch.bfloat16, device=a.device)
    views = _lib.Views()
    args = _lib.mokGroupedWgradArgs(
        views(a, "a", _lib.BF16), views(b, "b", _lib.BF16), views(expert_offset, "expert_offset", _lib.INT32),
        views(expert_count, "expert_count", _lib.INT32), views(out, "out", _lib.BF16), views(acc, "acc", _lib.FP32),
        views(main_grad, "main_grad", _lib.FP32), int(accumulate), int(store_acc), 0)
    _lib.check(_lib.lib.mokGroupedWgrad(ctypes.byref(args), _lib.stream_of(_lib.device_index(a.device))))
    return out
