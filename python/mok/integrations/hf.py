"""mok as an experts implementation of Hugging Face transformers 5.x.

    import mok.integrations.hf            # registers "mok" in transformers' ExpertsInterface
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, experts_implementation="mok")
    model.set_experts_implementation("mok")     # or switch a model already built (and back)

Every experts module that transformers' @use_experts_implementation decorates then calls
mok_experts_forward.  It runs mok.experts.experts on the module's own parameters (gate_up_proj
read in place, its gradient one tensor in its layout) when mok computes exactly what the module
computes; otherwise it runs transformers' grouped_mm experts function and warns once per
(module class, reason) with a MokFallbackWarning that names the reason.  The decision is taken
once per module and input kind (dtypes, devices, grad mode, top-k) and cached on the module;
fallback_reason(module, hidden_states, top_k_index, top_k_weights) gives it without running.

mok computes gated SwiGLU experts without biases: y = sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)),
weights gate_up_proj [E, 2I, H] and down_proj [E, H, I] in bf16.  is_concatenated=True: gate rows
then up rows; False: interleaved (gate row i at 2i, up row i at 2i + 1).  is_transposed=True with
is_concatenated=True: gate_up_proj [E, H, 2I] (gate columns, then up) and down_proj [E, I, H],
read in place as column-major matrices (mok.experts.experts(transposed=True)), on the CPU and
on CUDA.  Ids
outside [0, num_experts) (transformers' expert-parallel sentinel) route to no expert.

Covered, and checked against float64 and grouped_mm in tests/python/test_hf.py: Qwen3-MoE,
Qwen2-MoE (its shared expert stays the model's), DeepSeek-V3, Mixtral, OLMoE.  With transformers
5.17 the experts modules of DeepSeek-V2, dots1, ERNIE-4.5-MoE, GLM-4-MoE, Granite-MoE, Jamba,
LFM2-MoE, MiniMax, PhiMoE, Qwen3.5-MoE, Qwen3-Next and Qwen3-VL-MoE, among others, decide for
mok too (same flags and gate, SiLU by default; test_family_decisions builds each one's module).

Fall back to grouped_mm, with the reason (the first one that applies is named):
  gpt-oss, OpenAI privacy filter   biases (has_bias), a clamped SwiGLU with alpha (their own
                                   _apply_gate); gpt-oss's weights are also transposed with gate
                                   and up interleaved (is_concatenated=False)
  DeepSeek-V4, MiniMax-M3-VL,      a clamped SwiGLU (their own _apply_gate)
    GLM-5-Next, HY-V4
  Gemma-4 text experts             GELU (tanh) activation, not SiLU
  Nemotron-H                       ungated experts (has_gate=False, relu^2)
  any model                        an activation other than SiLU (config.hidden_act), weights or
                                   activations not in bfloat16, a device other than cpu/cuda,
                                   tensor subclasses (e.g. DTensor), transposed weights with
                                   gate and up interleaved (is_transposed=True,
                                   is_concatenated=False), and what
                                   mok.experts.unsupported_reason() names: e.g. more routes per
                                   token than local experts (expert parallelism), on CUDA an
                                   intermediate size its backward does not take, or on CUDA
                                   transposed weights where the call would take the separate
                                   launches (e.g. more than 512 local experts)
"""
from __future__ import annotations

from typing import Optional

import torch

try:
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import ExpertsInterface, _default_apply_gate, grouped_mm_experts_forward
except ImportError as err:  # transformers is missing, or older than 5.x (no experts interface)
    raise ImportError('mok.integrations.hf needs Hugging Face transformers 5.x (its experts interface): '
                      'pip install "mok[hf]"') from err

from .. import experts as _mok_experts
from ..config import MACROBATCH_ALL_ROWS, MoKConfig
from . import MokFallbackWarning, warn_once

__all__ = ["CONFIG", "MokFallbackWarning", "fallback_reason", "mok_experts_forward", "register"]

# The layer configuration of every mok call made here: the training one (the ring holds every
# routed row, so no expert's weight gradient is split into fp32 pieces: the faster backward,
# README "Knobs"; its cost is the ring, max_rows * (H + I) * 2 bytes, once per layer shape).
# Replace it to change the precision (dataclasses.replace(CONFIG, precision="fp8_block")): the
# shapes that precision cannot take fall back to grouped_mm, with the reason, like any other.
CONFIG = MoKConfig(macrobatch_size=MACROBATCH_ALL_ROWS)

_SILU_MODULES = (SiLUActivation, torch.nn.SiLU)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_UNDECIDED = object()


def _warn_once(module: torch.nn.Module, reason: str) -> None:
    warn_once(module, f"mok: {type(module).__name__} runs transformers' grouped_mm experts, not mok", reason)


def _activation_reason(module: torch.nn.Module) -> Optional[str]:
    # The activation object decides (transformers' "silu", torch's "swish" and F.silu); the
    # config's name only goes into the message.
    act = getattr(module, "act_fn", None)
    if type(act) in _SILU_MODULES or act is torch.nn.functional.silu:
        return None
    what = type(act).__name__ if isinstance(act, torch.nn.Module) else repr(act)
    config = getattr(module, "config", None)
    names = [f"{a}={getattr(config, a)!r}" for a in ("hidden_act", "hidden_activation") if getattr(config, a, None)]
    return f"its activation is {what}" + (f" ({', '.join(names)})" if names else "") + ", not SiLU"


def _module_reason(module: torch.nn.Module) -> Optional[str]:
    """Why mok cannot compute this module whatever its inputs; None when it can."""
    if not getattr(module, "has_gate", False):
        return "its experts have no gate projection (has_gate=False); mok runs gated (SwiGLU) experts"
    if module.has_bias:
        return "its projections have biases (has_bias=True); mok's experts have none"
    if module.is_transposed and not module.is_concatenated:
        return ("its weights are stored transposed with gate and up interleaved (is_transposed=True, "
                "is_concatenated=False): the gate would be every other column of gate_up_proj [E, H, 2I], a view "
                "mok's kernels cannot read in place")
    # A class (or instance) that overrides _apply_gate computes something else, e.g. a clamped SwiGLU.
    if getattr(module._apply_gate, "__func__", None) is not _default_apply_gate:
        return f"{type(module).__name__} has its own _apply_gate, not transformers' act(gate) * up"
    reason = _activation_reason(module)
    if reason is not None:
        return reason
    gate_up, down = module.gate_up_proj, module.down_proj
    experts, two_i, hidden = _dims(module) if gate_up.dim() == 3 else (0, 1, 0)  # (0, 1, 0): not 3-D
    num_experts = getattr(module, "num_experts", experts)
    want_down = (experts, two_i // 2, hidden) if module.is_transposed else (experts, hidden, two_i // 2)
    if two_i % 2 or tuple(down.shape) != want_down or experts != num_experts:
        layout = "[E, H, 2I] and [E, I, H] (is_transposed=True)" if module.is_transposed else "[E, 2I, H] and [E, H, I]"
        return (f"its weights are gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} for "
                f"num_experts = {num_experts}, not {layout}")
    return None


def _dims(module: torch.nn.Module):
    """(E, 2I, H) of a module's 3-D gate_up_proj, [E, 2I, H] or transposed [E, H, 2I]."""
    experts, a, b = module.gate_up_proj.shape
    return (experts, b, a) if module.is_transposed else (experts, a, b)


def _input_reason(module, x, topk, backward) -> Optional[str]:
    """Why mok cannot compute this module for inputs like x (module checks passed); None when it can."""
    gate_up, down = module.gate_up_proj, module.down_proj
    for name, t in (("hidden_states", x), ("gate_up_proj", gate_up), ("down_proj", down)):
        if type(t) not in _PLAIN_TENSORS:
            return f"{name} is a {type(t).__name__}; mok reads plain tensors"
    dtypes = {"hidden_states": x.dtype, "gate_up_proj": gate_up.dtype, "down_proj": down.dtype}
    if any(d != torch.bfloat16 for d in dtypes.values()):
        listed = ", ".join(f"{n} {d}" for n, d in dtypes.items())
        return f"mok computes in bfloat16 and the inputs are not all bfloat16 ({listed}); load the model in bfloat16"
    if x.device.type not in ("cpu", "cuda"):
        return f"hidden_states are on {x.device}; mok runs on cpu and cuda"
    if gate_up.device != x.device or down.device != x.device:
        return f"the expert weights are on {gate_up.device} / {down.device}, hidden_states on {x.device}"
    # mok's own rules for this layer on this device (e.g. the CUDA kernels' tile multiples)
    experts, two_i, hidden = _dims(module)
    return _mok_experts.unsupported_reason(hidden=hidden, intermediate=two_i // 2, num_experts=experts, topk=topk,
                                           device=x.device, backward=backward, transposed=module.is_transposed,
                                           config=CONFIG)


class _Decisions(dict):
    """What an experts module runs: module_reason, why mok cannot compute the module at all
    (None: it can), and by input kind (dtypes, devices, top-k, grad mode), why not."""

    def __init__(self, module_reason: Optional[str]):
        super().__init__()
        self.module_reason = module_reason


def fallback_reason(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> Optional[str]:
    """Why mok_experts_forward runs transformers' grouped_mm for this call; None when it runs mok.
    Decided once per module and input kind and cached on the module."""
    # The per-call cost is a dict lookup: the decision is cached on the module (not a buffer or
    # a parameter: state_dict and .to() do not see it).
    decisions = module.__dict__.get("_mok_decisions")
    if decisions is None:
        decisions = module.__dict__["_mok_decisions"] = _Decisions(_module_reason(module))
    if decisions.module_reason is not None:
        return decisions.module_reason
    gate_up, down = module.gate_up_proj, module.down_proj
    # Whether this call can be asked for a gradient: the backward's shape rules apply then.
    backward = torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad
                                            or gate_up.requires_grad or down.requires_grad)
    topk = top_k_index.shape[-1]
    key = (type(hidden_states), hidden_states.dtype, hidden_states.device, type(gate_up), gate_up.dtype,
           gate_up.device, type(down), down.dtype, down.device, topk, backward, CONFIG)
    reason = decisions.get(key, _UNDECIDED)
    if reason is _UNDECIDED:
        reason = decisions[key] = _input_reason(module, hidden_states, topk, backward)
    return reason


def mok_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts function signature: hidden_states [T, H], top_k_index [T, k] (ids
    >= num_experts: no route), top_k_weights [T, k] -> [T, H] in hidden_states' dtype."""
    reason = fallback_reason(self, hidden_states, top_k_index, top_k_weights)
    if reason is None:
        # gate_up_proj and down_proj are read in place; ids >= num_experts are no-routes.
        y = _mok_experts.experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                                 interleaved=not self.is_concatenated, transposed=self.is_transposed,
                                 config=CONFIG)
        return y.to(hidden_states.dtype)
    _warn_once(self, reason)
    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Register mok_experts_forward as experts implementation "mok" (idempotent)."""
    ExpertsInterface.register("mok", mok_experts_forward)


register()
