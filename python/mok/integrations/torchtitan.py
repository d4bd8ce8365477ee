"""mok as the routed-experts computation of TorchTitan 0.3 MoE layers.

    from mok.integrations import torchtitan as mok_titan
    mok_titan.enable(model)          # every RoutedExperts in the model runs mok (before parallelize)
    mok_titan.disable(model)         # and back to TorchTitan's own path
    # or at model-config time: every RoutedExperts.Config becomes a MokRoutedExperts.Config
    spec = deepseek_v3.model_registry("16B", converters=[mok_titan.MokConverter.Config()])
    model_config = mok_titan.convert_config(model_config)

TorchTitan 0.3's MoE (torchtitan.models.common.moe) routes in MoE.forward and hands
RoutedExperts.forward the tokens with their top-k expert ids and scores; RoutedExperts then
permutes the tokens (its token dispatcher), runs GroupedExperts on them and combines the
weighted outputs.  That is the level mok adapts: MokRoutedExperts.forward gives the tokens,
the ids and the scores to mok.experts.experts_separate, which does the permutation, the three
grouped GEMMs, SwiGLU and the weighted combine in one deterministic layer.  The routing (the
router, its expert bias and the tokens-per-expert counts) and the shared experts stay
TorchTitan's.

GroupedExperts stores its weights in mok's layout: w1_EFD and w3_EFD [E, I, H] are mok's
w_gate and w_up and w2_EDF [E, H, I] its w_down, all K-major.  mok reads these parameters in
place (no per-call copy) and autograd writes their gradients, and that of the router's
scores, to TorchTitan's own tensors.

mok runs a call when it computes the function TorchTitan's path computes (up to bf16
rounding); otherwise the call runs TorchTitan's own RoutedExperts.forward and a
MokFallbackWarning names the reason, once per (module class, reason).  The reasons:
  - expert parallelism: an EP mesh of more than one rank, or a dispatcher other than
    LocalTokenDispatcher, AllToAllTokenDispatcher (the default of TorchTitan's models) and
    TorchAOTokenDispatcher, whose paths without an EP mesh are the local one (DeepEP,
    HybridEP and MinimalAsyncEP fall back); mok's own EP has its own dispatch;
  - experts other than GroupedExperts itself (GPT-OSS experts: biases and a clamped SwiGLU;
    the MXFP8 / Float8 converters' subclasses: quantized grouped GEMMs);
  - DTensor expert weights (tensor-parallel experts); mok reads plain local tensors;
  - expert weights not in bfloat16: TorchTitan casts float32 parameters with .bfloat16() on
    every call, a copy mok does not make (keep the experts in bfloat16, e.g. FSDP2's
    MixedPrecisionPolicy(param_dtype=torch.bfloat16), or model.to(torch.bfloat16));
  - tokens or weights on a device other than cpu / cuda, or not all on one device;
  - SPMD type checking (TorchTitan's debug.spmd_typechecking);
  - a shape mok.experts.unsupported_reason() names (e.g. the CUDA path needs H, I % 64 == 0).
Tokens in another floating dtype are cast to bfloat16, as GroupedExperts does, and the result
cast back to their dtype.

Install: pip install "mok[torchtitan]" (TorchTitan 0.3; its MoE needs torchtitan, spmd_types,
tyro, docstring-parser and typeguard, none of TorchTitan's training extras).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

try:
    import spmd_types as _spmd
    from torchtitan.distributed.utils import get_spmd_backend
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import (AllToAllTokenDispatcher, LocalTokenDispatcher,
                                                           TorchAOTokenDispatcher)
    from torchtitan.protocols.model import ModelConfigConverter
except ImportError as err:  # TorchTitan missing, or not 0.3 (0.2 kept its MoE in torchtitan.models.moe)
    raise ImportError("mok.integrations.torchtitan needs TorchTitan 0.3 (torchtitan.models.common.moe): "
                      'pip install "mok[torchtitan]"') from err

from .. import experts as _mok_experts
from ..config import MACROBATCH_ALL_ROWS, MoKConfig
from . import MokFallbackWarning, warn_once

__all__ = ["CONFIG", "MokConverter", "MokFallbackWarning", "MokRoutedExperts", "convert_config", "disable", "enable",
           "fallback_reason", "mok_routed_experts_forward"]

# The layer configuration of every mok call made here: the training one (the ring holds every
# routed row: the faster backward, README "Knobs"), as mok.integrations.hf's.
CONFIG = MoKConfig(macrobatch_size=MACROBATCH_ALL_ROWS)

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_UNDECIDED = object()


def _warn_once(module: torch.nn.Module, reason: str) -> None:
    warn_once(module, f"mok: {type(module).__name__} runs TorchTitan's experts, not mok", reason)


def _weights(module: torch.nn.Module):
    experts = module.inner_experts
    return experts.w1_EFD, experts.w3_EFD, experts.w2_EDF


# The dispatchers whose EP = 1 path (no EP mesh, or one of size 1) is LocalTokenDispatcher's
# permutation and score-weighted combine (TorchAO's pads each expert's rows, then unpads).
_ALL_TO_ALL = (AllToAllTokenDispatcher, TorchAOTokenDispatcher)


def _dispatcher_reason(module: torch.nn.Module) -> Optional[str]:
    """Why mok cannot stand in for this RoutedExperts' dispatch now; None when it can.  Asked
    on every call: parallelize wires the EP mesh after the module is built."""
    if get_spmd_backend() == "spmd_types" and _spmd.is_type_checking():
        return "SPMD type checking is on (debug.spmd_typechecking); mok's outputs carry no SPMD types"
    dispatcher = module.token_dispatcher
    kind = type(dispatcher)
    if kind is LocalTokenDispatcher:
        return None
    if kind in _ALL_TO_ALL:
        mesh = dispatcher.ep_mesh
        size = 1 if mesh is None else mesh.size()
        if size == 1:
            return None
        return (f"its token dispatcher {kind.__name__} runs expert parallelism over {size} ranks; mok adapts "
                "TorchTitan's EP = 1 path")
    return (f"its token dispatcher is {kind.__name__}; mok adapts TorchTitan's EP = 1 path (LocalTokenDispatcher, "
            "or AllToAllTokenDispatcher without an EP mesh)")


def _module_reason(module: torch.nn.Module) -> Optional[str]:
    """Why mok cannot compute this RoutedExperts' experts whatever its inputs; None when it can."""
    experts = module.inner_experts
    if type(experts) is not GroupedExperts:
        return (f"its experts are {type(experts).__name__}, not TorchTitan's GroupedExperts (mok computes bias-free "
                "SwiGLU experts in bfloat16)")
    if "_grouped_mm" in experts.__dict__:  # the seam TorchTitan's quantized variants override
        return "its GroupedExperts has its own _grouped_mm (a quantized or custom grouped GEMM)"
    w_gate, w_up, w_down = _weights(module)
    shapes = [tuple(w.shape) for w in (w_gate, w_up, w_down)]
    if (any(len(s) != 3 for s in shapes) or shapes[0] != shapes[1]
            or shapes[2] != (shapes[0][0], shapes[0][2], shapes[0][1])):
        return (f"its weights are w1_EFD {shapes[0]}, w3_EFD {shapes[1]} and w2_EDF {shapes[2]}, not [E, I, H], "
                "[E, I, H] and [E, H, I]")
    return None


def _input_reason(module, x, scores, topk, backward) -> Optional[str]:
    """Why mok cannot compute this module for inputs like these (module checks passed)."""
    w_gate, w_up, w_down = _weights(module)
    named = (("x", x), ("topk_scores", scores), ("w1_EFD", w_gate), ("w3_EFD", w_up), ("w2_EDF", w_down))
    for name, t in named:
        if type(t) not in _PLAIN_TENSORS:
            return f"{name} is a {type(t).__name__}; mok reads plain local tensors"
    dtypes = {name: t.dtype for name, t in named[2:]}
    if any(d != torch.bfloat16 for d in dtypes.values()):
        listed = ", ".join(f"{n} {d}" for n, d in dtypes.items())
        return (f"the expert weights are not all bfloat16 ({listed}); mok reads them in place in bfloat16, where "
                "TorchTitan copies them with .bfloat16() on every call: keep the experts in bfloat16 (FSDP2 "
                "MixedPrecisionPolicy(param_dtype=torch.bfloat16), or model.to(torch.bfloat16))")
    if not x.dtype.is_floating_point or not scores.dtype.is_floating_point:
        return f"x is {x.dtype} and topk_scores {scores.dtype}; mok takes floating tokens and scores"
    if x.device.type not in ("cpu", "cuda"):
        return f"x is on {x.device}; mok runs on cpu and cuda"
    devices = {t.device for _, t in named}
    if len(devices) > 1:
        return f"x, the scores and the expert weights are on several devices ({sorted(map(str, devices))})"
    experts, inter, hidden = w_gate.shape
    return _mok_experts.unsupported_reason(hidden=hidden, intermediate=inter, num_experts=experts, topk=topk,
                                           device=x.device, backward=backward)


def fallback_reason(module: torch.nn.Module, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor,
                    topk_expert_ids_BLK: torch.Tensor) -> Optional[str]:
    """Why this RoutedExperts call would run TorchTitan's path, not mok; None: it runs mok.
    Past the dispatcher, the answer is cached on the module per input kind (dtypes, devices,
    shapes, grad mode, top-k)."""
    reason = _dispatcher_reason(module)
    if reason is not None:
        return reason
    state = module.__dict__.get("_mok_decisions")
    if state is None:
        state = module.__dict__["_mok_decisions"] = {"module": _module_reason(module)}
    reason = state["module"]
    if reason is not None:
        return reason
    w_gate, w_up, w_down = _weights(module)
    backward = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x_BLD, topk_scores_BLK, w_gate, w_up, w_down))
    topk = topk_expert_ids_BLK.shape[-1]
    key = (type(x_BLD), x_BLD.dtype, x_BLD.device, type(topk_scores_BLK), topk_scores_BLK.dtype,
           topk_scores_BLK.device, *((type(w), w.dtype, w.device, tuple(w.shape)) for w in (w_gate, w_up, w_down)),
           topk, backward)
    reason = state.get(key, _UNDECIDED)
    if reason is _UNDECIDED:
        reason = state[key] = _input_reason(module, x_BLD, topk_scores_BLK, topk, backward)
    return reason


def mok_routed_experts_forward(module: torch.nn.Module, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor,
                               topk_expert_ids_BLK: torch.Tensor,
                               num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """RoutedExperts.forward's contract: x_BLD [B, L, D], topk_scores_BLK and
    topk_expert_ids_BLK [B, L, K] -> [B, L, D] in x's dtype (the routed experts' sum, without
    the shared experts).  num_local_tokens_per_expert_E is TorchTitan's count for its own
    grouped GEMMs; mok plans from the ids."""
    reason = fallback_reason(module, x_BLD, topk_scores_BLK, topk_expert_ids_BLK)
    if reason is not None:
        _warn_once(module, reason)
        return RoutedExperts.forward(module, x_BLD, topk_scores_BLK, topk_expert_ids_BLK,
                                     num_local_tokens_per_expert_E)
    B, L, D = x_BLD.shape
    K = topk_scores_BLK.shape[-1]
    x_TD = x_BLD.reshape(B * L, D)
    if x_TD.dtype != torch.bfloat16:  # as GroupedExperts: x_RD.bfloat16(), the result .type_as(x)
        x_TD = x_TD.to(torch.bfloat16)
    w_gate, w_up, w_down = _weights(module)
    y_TD = _mok_experts.experts_separate(x_TD, topk_expert_ids_BLK.reshape(B * L, K),
                                         topk_scores_BLK.reshape(B * L, K), w_gate, w_up, w_down, config=CONFIG)
    return y_TD.to(x_BLD.dtype).view(B, L, D)


class MokRoutedExperts(RoutedExperts):
    """RoutedExperts whose forward runs mok (mok_routed_experts_forward); the same
    parameters, state dict and config fields as RoutedExperts."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        pass

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        return mok_routed_experts_forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK,
                                          num_local_tokens_per_expert_E)


def enable(model: torch.nn.Module) -> int:
    """Make every RoutedExperts in `model` (RoutedExperts itself, not a subclass) a
    MokRoutedExperts, in place: the same module objects and parameters.  Call it before
    TorchTitan's parallelize (which wraps each module's forward).  Returns how many modules
    now run mok."""
    count = 0
    for name, m in model.named_modules():
        if type(m) is MokRoutedExperts:
            count += 1
        elif type(m) is RoutedExperts:
            if "forward" in m.__dict__:
                raise RuntimeError(f"mok: {name or 'the model'} ({type(m).__name__}) has a forward of its own "
                                   "(TorchTitan's parallelize wraps it): call mok.integrations.torchtitan.enable "
                                   "before parallelizing, or build the model with convert_config")
            m.__class__ = MokRoutedExperts
            m.__dict__.pop("_mok_decisions", None)
            count += 1
    return count


def disable(model: torch.nn.Module) -> int:
    """Make every MokRoutedExperts in `model` a RoutedExperts again; returns how many."""
    count = 0
    for m in model.modules():
        if type(m) is MokRoutedExperts:
            m.__class__ = RoutedExperts
            m.__dict__.pop("_mok_decisions", None)
            count += 1
    return count


def convert_config(config):
    """Replace every RoutedExperts.Config in a TorchTitan model config tree (in place) by a
    MokRoutedExperts.Config with the same fields; returns the config (a new one where the
    root itself was a RoutedExperts.Config)."""
    def converted(c):
        fields = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.init}
        return MokRoutedExperts.Config(**fields)

    if type(config) is RoutedExperts.Config:
        return converted(config)
    found = [(parent, attr, c) for _, c, parent, attr in config.traverse(RoutedExperts.Config)
             if type(c) is RoutedExperts.Config]
    for parent, attr, c in found:
        if isinstance(parent, list):
            parent[attr] = converted(c)
        else:
            setattr(parent, attr, converted(c))
    return config


class MokConverter(ModelConfigConverter):
    """TorchTitan's model-config converter for mok: convert() is convert_config, so that a
    model registry's `converters=[MokConverter.Config()]` builds its MoE layers with mok."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        pass

    def __init__(self, config: Config):
        self.config = config

    def convert(self, model_config):
        return convert_config(model_config)
