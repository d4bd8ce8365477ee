"""mok as an experts implementation of Hugging Face transformers 5.x.

    import mok.integrations.hf            # registers "mok" in transformers' ExpertsInterface
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, experts_implementation="mok")
    model.set_experts_implementation("mok")     # or switch a model already built (and back)

    mok.integrations.hf.fuse_shared_experts(model)   # DeepSeek-V3-style shared experts in mok's call too

Every experts module that transformers' @use_experts_implementation decorates then calls
mok_experts_forward.  It runs mok.experts.experts on the module's own parameters (gate_up_proj
read in place, its gradient one [E, 2I, H] tensor) when mok computes exactly what the module
computes; otherwise it runs transformers' grouped_mm experts function and warns once per
(module class, reason) with a MokFallbackWarning that names the reason.  The decision is taken
once per module and input kind (dtypes, devices, grad mode, top-k) and cached on the module;
fallback_reason(module, hidden_states, top_k_index, top_k_weights) gives it without running.

mok computes gated SwiGLU experts without biases: y = sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)),
weights gate_up_proj [E, 2I, H] and down_proj [E, H, I] in bf16.  is_concatenated=True: gate rows
then up rows; False: interleaved (gate row i at 2i, up row i at 2i + 1).  Ids outside
[0, num_experts) (transformers' expert-parallel sentinel) route to no expert.

Covered, and checked against float64 and grouped_mm in tests/python/test_hf.py: Qwen3-MoE,
Qwen2-MoE (its shared expert stays the model's), DeepSeek-V3, Mixtral, OLMoE.  With transformers
5.17 the experts modules of DeepSeek-V2, dots1, ERNIE-4.5-MoE, GLM-4-MoE, Granite-MoE, Jamba,
LFM2-MoE, MiniMax, PhiMoE, Qwen3.5-MoE, Qwen3-Next and Qwen3-VL-MoE, among others, decide for
mok too (same flags and gate, SiLU by default; test_family_decisions builds each one's module).

Fall back to grouped_mm, with the reason (the first one that applies is named):
  gpt-oss, OpenAI privacy filter   biases (has_bias), transposed weights, a clamped SwiGLU with
                                   alpha (their own _apply_gate)
  DeepSeek-V4, MiniMax-M3-VL,      a clamped SwiGLU (their own _apply_gate)
    GLM-5-Next, HY-V4
  Gemma-4 text experts             GELU (tanh) activation, not SiLU
  Nemotron-H                       ungated experts (has_gate=False, relu^2)
  any model                        an activation other than SiLU (config.hidden_act), weights or
                                   activations not in bfloat16, a device other than cpu/cuda,
                                   tensor subclasses (e.g. DTensor), and what
                                   mok.experts.unsupported_reason() names: e.g. more routes per
                                   token than local experts (expert parallelism), or on CUDA an
                                   intermediate size its backward does not take
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import types

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

__all__ = ["CONFIG", "MokFallbackWarning", "fallback_reason", "fuse_shared_experts", "mok_experts_forward",
           "register"]

# The layer configuration of every mok call made here: the training one (the ring holds every
# routed row, so no expert's weight gradient is split into fp32 pieces: the faster backward,
# README "Knobs"; its cost is the ring, max_rows * (H + I) * 2 bytes, once per layer shape).
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
    if module.is_transposed:
        return ("its weights are stored transposed (is_transposed=True: [E, H, 2I] and [E, I, H]); this mok reads "
                "[E, 2I, H] and [E, H, I] (transposed layouts come in a later release)")
    # A class (or instance) that overrides _apply_gate computes something else, e.g. a clamped SwiGLU.
    if getattr(module._apply_gate, "__func__", None) is not _default_apply_gate:
        return f"{type(module).__name__} has its own _apply_gate, not transformers' act(gate) * up"
    reason = _activation_reason(module)
    if reason is not None:
        return reason
    gate_up, down = module.gate_up_proj, module.down_proj
    experts, two_i, hidden = gate_up.shape if gate_up.dim() == 3 else (0, 1, 0)  # (0, 1, 0): not 3-D
    num_experts = getattr(module, "num_experts", experts)
    if two_i % 2 or tuple(down.shape) != (experts, hidden, two_i // 2) or experts != num_experts:
        return (f"its weights are gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} for "
                f"num_experts = {num_experts}, not [E, 2I, H] and [E, H, I]")
    return None


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
    experts, two_i, hidden = gate_up.shape
    return _mok_experts.unsupported_reason(hidden=hidden, intermediate=two_i // 2, num_experts=experts, topk=topk,
                                           device=x.device, backward=backward)


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
           gate_up.device, type(down), down.dtype, down.device, topk, backward)
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
                                 interleaved=not self.is_concatenated, config=CONFIG)
        return y.to(hidden_states.dtype)
    _warn_once(self, reason)
    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


# ---------------------------------------------------------------------------------------
# Shared experts fused into mok's call (DeepSeek-V3-style blocks)
#
# A block of the DeepSeek-V3 form runs router -> experts -> + shared_experts(x). Fused, mok
# computes the plain SwiGLU shared expert in the same kernel as the routed ones and adds it in
# the same fp32 sum (y = bf16(sum_j w_j o_j + o_shared): one rounding, not two).

# The statements of the block forwards this fuses (ast-normalised: DeepseekV3MoE, GLM-4-MoE,
# dots1, ... in transformers 5.17) and of their shared MLPs' forwards.
_BLOCK_FORWARD = ("residuals = hidden_states", "orig_shape = hidden_states.shape",
                  "_, topk_weights, topk_indices = self.gate(hidden_states)",
                  "hidden_states = hidden_states.view(-1, hidden_states.shape[-1])",
                  "hidden_states = self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)",
                  "hidden_states = hidden_states + self.shared_experts(residuals)", "return hidden_states")
_MLP_FORWARDS = (("down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))", "return down_proj"),
                 ("return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))",))


def _statements(fn) -> tuple:
    """The statements of fn's body as ast.unparse writes them (docstring left out); () when
    its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return ()
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    return tuple(ast.unparse(s) for s in body)


def _shared_block_reason(block: torch.nn.Module) -> Optional[str]:
    """Why the shared expert of `block` cannot be fused into mok's call; None when it can."""
    if _statements(type(block).forward) != _BLOCK_FORWARD:
        return f"{type(block).__name__}.forward is not the router -> experts -> + shared_experts block mok fuses"
    shared, experts = block.shared_experts, block.experts
    if _statements(type(shared).forward) not in _MLP_FORWARDS:
        return f"its shared expert {type(shared).__name__} is not a plain SwiGLU MLP"
    for name in ("gate_proj", "up_proj", "down_proj"):
        proj = getattr(shared, name)
        if not isinstance(proj, torch.nn.Linear) or proj.bias is not None:
            return f"its shared expert's {name} is not a Linear without bias"
    return _activation_reason(shared) or _module_reason(experts)


def _fused_shared_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The block's forward with its shared expert computed by mok (falls back to the block's
    own forward, which still runs its experts through mok when it can)."""
    orig_shape = hidden_states.shape
    _, topk_weights, topk_indices = self.gate(hidden_states)
    x = hidden_states.view(-1, orig_shape[-1])
    experts, shared = self.experts, self.shared_experts
    reason = (None if experts.config._experts_implementation == "mok" else
              f'the experts implementation is "{experts.config._experts_implementation}", not "mok"')
    reason = reason or fallback_reason(experts, x, topk_indices, topk_weights)
    weights = (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
    if reason is None:
        # The layer with the shared expert, on these inputs (dtypes, shape rules), once per kind
        cache = self.__dict__.setdefault("_mok_shared_decisions", {})
        backward = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, *weights))
        key = (x.dtype, x.device, tuple(w.dtype for w in weights), topk_indices.shape[-1], backward)
        if key not in cache:
            cache[key] = _shared_input_reason(experts, x, weights, topk_indices.shape[-1], backward)
        reason = cache[key]
    if reason is not None:
        _warn_once(self, f"its shared expert runs as transformers' MLP: {reason}")
        return type(self).forward(self, hidden_states)
    y = _mok_experts.experts(x, topk_indices, topk_weights, experts.gate_up_proj, experts.down_proj,
                             interleaved=not experts.is_concatenated, shared=weights, config=CONFIG)
    return y.view(orig_shape).to(hidden_states.dtype)


def _shared_input_reason(experts, x, weights, topk, backward) -> Optional[str]:
    if any(type(w) not in _PLAIN_TENSORS or w.dtype != torch.bfloat16 or w.device != x.device for w in weights):
        return "its shared expert's weights are not plain bfloat16 tensors on the experts' device"
    num_experts, two_i, hidden = experts.gate_up_proj.shape
    return _mok_experts.unsupported_reason(hidden=hidden, intermediate=two_i // 2, num_experts=num_experts,
                                           topk=topk, device=x.device, backward=backward,
                                           shared_intermediate=weights[0].shape[0])


def fuse_shared_experts(model: torch.nn.Module, enable: bool = True) -> int:
    """Compute the shared experts of `model`'s DeepSeek-V3-style MoE blocks (router ->
    experts -> + a plain SwiGLU shared expert) inside mok's call, with the routed experts
    (enable=False: back to the blocks' own forward). Returns how many blocks changed; a block
    of another form keeps its forward (MokFallbackWarning names why, once per class)."""
    changed = 0
    for block in model.modules():
        # MoE blocks with a shared expert (DeepSeek-V3's shared_experts, Qwen2-MoE's shared_expert...)
        if not (hasattr(block, "experts") and (hasattr(block, "shared_experts") or hasattr(block, "shared_expert"))):
            continue
        fused = block.__dict__.get("forward") is not None
        if not enable:
            if fused:
                del block.forward
                changed += 1
            continue
        reason = _shared_block_reason(block)
        if reason is not None:
            _warn_once(block, f"its shared expert stays transformers': {reason}")
        elif not fused:
            block.forward = types.MethodType(_fused_shared_forward, block)
            changed += 1
    return changed


def register() -> None:
    """Register mok_experts_forward as experts implementation "mok" (idempotent)."""
    ExpertsInterface.register("mok", mok_experts_forward)


register()
