"""fp8_block's weights (docs/precision.md): each weight quantised per 128 x 128 block, in its own
orientation (q, what the forward reads) and transposed (qt, what the backward's dgrad reads), with
one set of scales, made once per optimizer step.

    fw = mok.quantize_weights(w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    fw.current(w_gate=..., ...)   # still the quantisation of these tensors (their version)

CUDA tensors: one kernel per weight (mokQuantizeWeights, one read of each weight). CPU tensors:
mok.fp8.quantize_blocks, the definition the kernel is tested against bit for bit."""
from __future__ import annotations

import ctypes
import dataclasses
import weakref
from typing import Any, Dict, Optional

import torch

from . import _lib, fp8

# Weight name -> is it a routed expert stack ([E, R, C]; the shared expert's are [R, C])
_NAMES = {"w_gate": True, "w_up": True, "w_down": True, "ws_gate": False, "ws_up": False, "ws_down": False}


@dataclasses.dataclass
class Fp8Weight:
    """One weight W [.., R, C] in e4m3: q [.., R, C], qt [.., C, R] (None when not made), scales
    [.., R/128, C/128] fp32, q · scale (per block) standing for W."""

    q: Optional[torch.Tensor]
    qt: Optional[torch.Tensor]
    scales: torch.Tensor


@dataclasses.dataclass
class Fp8Weights:
    """What quantize_weights returns: name -> Fp8Weight (None for an absent weight), whether the
    scales are powers of two, and the version of each source tensor when it was quantised."""

    weights: Dict[str, Optional[Fp8Weight]]
    pow2: bool
    versions: Dict[str, int]
    sources: Dict[str, Any]  # a weak reference to each source tensor (a freed one is never current)

    def current(self, **weights: Optional[torch.Tensor]) -> bool:
        """True when these tensors (name=tensor) are the very ones quantised, unchanged since
        (their autograd version counter, which in-place optimizer steps advance)."""
        for name, w in weights.items():
            if (w is None) != (self.weights.get(name) is None):
                return False
            if w is not None and (self.sources[name]() is not w or w._version != self.versions[name]):
                return False
        return True

    def __getitem__(self, name: str) -> Optional[Fp8Weight]:
        return self.weights[name]


def quantize_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                     ws_gate: Optional[torch.Tensor] = None, ws_up: Optional[torch.Tensor] = None,
                     ws_down: Optional[torch.Tensor] = None, *, pow2: bool = False,
                     transposed: bool = True) -> Fp8Weights:
    """The layer's weights in fp8_block (as mok.functional.forward takes them: w_gate, w_up
    [E, I, H], w_down [E, H, I], the shared expert's [I_s, H] and [H, I_s], bf16, row- or
    column-major matrices read in place; H, I, I_s multiples of 128). pow2: power-of-two
    scales (UE8M0). transposed=False: no qt copies (a forward-only model: half the memory)."""
    given = dict(w_gate=w_gate, w_up=w_up, w_down=w_down, ws_gate=ws_gate, ws_up=ws_up, ws_down=ws_down)
    for name, w in given.items():
        if w is None:
            if _NAMES[name]:
                raise ValueError(f"{name} is required")
            continue
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
        if w.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {w.dtype}")
        if w.dim() != (3 if _NAMES[name] else 2):
            raise ValueError(f"{name} must be {'[E, R, C]' if _NAMES[name] else '[R, C]'}, got shape {tuple(w.shape)}")
        if w.shape[-1] % 128 or w.shape[-2] % 128:
            raise ValueError(f"{name} is {tuple(w.shape)}: fp8_block needs its last two dimensions multiples of "
                             f"128 (whole 128 x 128 blocks)")
    devices = {w.device for w in given.values() if w is not None}
    if len(devices) != 1:
        raise ValueError(f"the weights are on several devices: {sorted(map(str, devices))}")
    (device,) = devices
    out: Dict[str, Optional[Fp8Weight]] = {}
    for name, w in given.items():
        if w is None:
            out[name] = None
            continue
        *lead, r, c = w.shape
        e4m3 = torch.float8_e4m3fn
        if device.type == "cpu":
            q, s = fp8.quantize_blocks(w.contiguous(), pow2=pow2)
            out[name] = Fp8Weight(q, q.transpose(-1, -2).contiguous() if transposed else None, s)
        else:
            out[name] = Fp8Weight(torch.empty(*lead, r, c, dtype=e4m3, device=device),
                                  torch.empty(*lead, c, r, dtype=e4m3, device=device) if transposed else None,
                                  torch.empty(*lead, r // 128, c // 128, dtype=torch.float32, device=device))
    if device.type != "cpu":
        config = _lib.default_config()
        config.hidden = w_gate.shape[2]
        config.intermediate = w_gate.shape[1]
        config.shared_intermediate = 0 if ws_gate is None else ws_gate.shape[0]
        config.num_experts = w_gate.shape[0]
        config.device = _lib.device_index(device)
        views = _lib.Views()
        fn = _lib.symbol("mokQuantizeWeights")
        _lib.check(fn(ctypes.byref(config), ctypes.byref(views.weights(given, "weights.", _lib.BF16)),
                      ctypes.byref(fp8_views(views, out)), 1 if pow2 else 0, _lib.stream_of(config.device)))
    return Fp8Weights(out, pow2, {n: w._version for n, w in given.items() if w is not None},
                      {n: weakref.ref(w) for n, w in given.items() if w is not None})


def fp8_views(views: _lib.Views, weights: Dict[str, Optional[Fp8Weight]], tag: str = "") -> _lib.mokFp8Weights:
    """The mokFp8Weights of quantised weights (absent entries stay absent)."""
    f = _lib.mokFp8Weights()
    for name in _lib.WEIGHT_NAMES:
        w = weights.get(name)
        if w is None:
            continue
        setattr(f, name, _lib.mokFp8Weight(views(w.q, f"{tag}fp8.{name}.q", _lib.E4M3),
                                           views(w.qt, f"{tag}fp8.{name}.qt", _lib.E4M3),
                                           views(w.scales, f"{tag}fp8.{name}.scales", _lib.FP32)))
    return f
