"""mok.integrations.hf: mok as the experts implementation "mok" of Hugging Face transformers 5.x.

Tiny models of each covered family run their experts through mok and are checked against a
float64 SwiGLU computed from the same bf16 weights and against transformers' grouped_mm; modules
mok cannot compute fall back to grouped_mm with one warning naming the reason.  Each test runs on
the CPU and, with a GPU and mok's CUDA build, on CUDA.
"""
import copy
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import mok  # noqa: E402
import mok.experts  # noqa: E402
from mok.integrations import hf  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.integrations.moe import grouped_mm_experts_forward  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and mok.has_cuda() else [])
BF16 = torch.bfloat16

# Tiny causal LMs: hidden 256, expert width 256, 8 experts, top-2, 2 MoE layers.
COMMON = dict(vocab_size=128, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "qwen3_moe": dict(intermediate_size=256, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                      head_dim=64, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen2_moe": dict(intermediate_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                      num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
    "deepseek_v3": dict(intermediate_size=256, moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None,
                        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64),
    "mixtral": dict(intermediate_size=256, num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(intermediate_size=256, num_experts=8, num_experts_per_tok=2),
}


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    """Each test sees the first fallback warning of every (class, reason) again."""
    monkeypatch.setattr(mok.integrations, "_warned", set())


@pytest.fixture
def mok_calls(monkeypatch):
    """The calls that reached mok.experts.experts: (gate_up_proj, down_proj) as passed."""
    calls, real = [], mok.experts.experts

    def counting(x, topk_ids, topk_weights, gate_up_proj, down_proj, **kwargs):
        calls.append((gate_up_proj, down_proj))
        return real(x, topk_ids, topk_weights, gate_up_proj, down_proj, **kwargs)

    monkeypatch.setattr(mok.experts, "experts", counting)
    return calls


def tiny_model(family, device, implementation="mok", dtype=BF16, seed=0, **overrides):
    config = AutoConfig.for_model(family, **{**COMMON, **FAMILIES.get(family, {}), **overrides})
    torch.manual_seed(seed)
    kwargs = {} if implementation is None else {"experts_implementation": implementation}
    return AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs).to(device)


def experts_of(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "has_gate")]


def set_weights(module, gen, scale=1.0):
    """Weights of unit-scale outputs (the models' init makes the experts' part tiny)."""
    with torch.no_grad():
        for p in (module.gate_up_proj, module.down_proj):
            p.copy_(scale * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def routing(num_tokens, num_experts, topk, gen, device):
    """Distinct ids per token, fp32 weights; a few EP sentinels (id = E: no route)."""
    ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :topk]
    ids[::7, -1] = num_experts
    ids[3] = num_experts
    weights = torch.rand(num_tokens, topk, generator=gen)
    return ids.to(device), weights.to(device).requires_grad_()


def reference(x, ids, weights, gate_up, down, interleaved=False):
    """y = sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)) in float64, differentiable."""
    num_experts, two_i, _ = gate_up.shape
    gate = gate_up[:, 0::2] if interleaved else gate_up[:, :two_i // 2]
    up = gate_up[:, 1::2] if interleaved else gate_up[:, two_i // 2:]
    y = torch.zeros_like(x)
    for e in range(num_experts):
        tok, j = torch.where(ids == e)
        xe = x[tok]
        a = torch.nn.functional.silu(xe @ gate[e].T) * (xe @ up[e].T)
        y = y.index_add(0, tok, (a @ down[e].T) * weights[tok, j, None])
    return y


def rel(got, want):
    """||got - want|| / ||want|| in float64; got must be finite (outputs start as NaN)."""
    assert got is not None and torch.isfinite(got).all(), "non-finite or missing values"
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / want.norm()).item()


def run_module(module, x, ids, weights, dy):
    """(y, dx, d weights, d gate_up_proj, d down_proj) of one forward and backward."""
    x = x.detach().clone().requires_grad_()
    weights = weights.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = module(x, ids, weights)
    y.backward(dy)
    return y.detach(), x.grad, weights.grad, module.gate_up_proj.grad, module.down_proj.grad


def module_inputs(module, gen, device, num_tokens=64):
    num_experts, hidden = module.gate_up_proj.shape[0], module.down_proj.shape[2 if module.is_transposed else 1]
    x = torch.randn(num_tokens, hidden, generator=gen).to(BF16).to(device)
    ids, weights = routing(num_tokens, num_experts, 2, gen, device)
    dy = torch.randn(num_tokens, hidden, generator=gen).to(BF16).to(device)
    return x, ids, weights, dy


def float64_grads(module, x, ids, weights, dy, interleaved=False):
    leaves = [t.detach().double().requires_grad_() for t in (x, weights, module.gate_up_proj, module.down_proj)]
    y = reference(*leaves[:1], ids, *leaves[1:], interleaved=interleaved)
    return (y.detach(), *torch.autograd.grad(y, leaves, dy.double()))


def check_against_float64(got, want):
    names = ("y", "dx", "d top_k_weights", "d gate_up_proj", "d down_proj")
    # Measured about 3e-3 for all five: the bf16 rounding of the intermediate a and of the
    # outputs (d top_k_weights is fp32, but sums products of the bf16-rounded a).
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)}, want {tuple(w.shape)}"
        err = rel(g, w)
        assert err < 1e-2, f"{name}: rel. error {err:.2e} against float64"


# ---------------------------------------------------------------------------------------------
# Each family's experts module through mok, against float64


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_experts_module_matches_float64(family, device, gen, mok_calls):
    model = tiny_model(family, device)
    module = experts_of(model)[0]
    assert module.config._experts_implementation == "mok"
    set_weights(module, gen)
    x, ids, weights, dy = module_inputs(module, gen, device)
    assert hf.fallback_reason(module, x.requires_grad_(), ids, weights) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.MokFallbackWarning)
        got = run_module(module, x, ids, weights, dy)
    # mok ran once, on the module's own parameters (no copy of gate_up_proj), and the
    # gradient of gate_up_proj is one [E, 2I, H] tensor.
    assert len(mok_calls) == 1
    assert mok_calls[0][0] is module.gate_up_proj and mok_calls[0][1] is module.down_proj
    assert got[3].shape == module.gate_up_proj.shape and got[0].dtype == BF16
    check_against_float64(got, float64_grads(module, x, ids, weights, dy))


@pytest.mark.parametrize("device", DEVICES)
def test_interleaved_layout(device, gen, mok_calls):
    """is_concatenated=False: gate row i at 2i, up row i at 2i + 1 (read in place)."""
    module = experts_of(tiny_model("qwen3_moe", device))[0]
    set_weights(module, gen)
    x, ids, weights, dy = module_inputs(module, gen, device)
    want = float64_grads(module, x, ids, weights, dy)
    two_i = module.gate_up_proj.shape[1]
    with torch.no_grad():
        concatenated = module.gate_up_proj.clone()
        module.gate_up_proj[:, 0::2] = concatenated[:, :two_i // 2]
        module.gate_up_proj[:, 1::2] = concatenated[:, two_i // 2:]
    module.is_concatenated = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.MokFallbackWarning)
        y, dx, dw, d_gate_up, d_down = run_module(module, x, ids, weights, dy)
    assert len(mok_calls) == 1
    assert rel(torch.cat([d_gate_up[:, 0::2], d_gate_up[:, 1::2]], dim=1), want[3]) < 1e-2
    check_against_float64((y, dx, dw, want[3], d_down), want)
    assert rel(y, reference(x.double(), ids, weights.double(), module.gate_up_proj.double(),
                            module.down_proj.double(), interleaved=True)) < 1e-2


def transpose_parameters(module):
    """Store a module's experts as HF's is_transposed ones are: gate_up_proj [E, H, 2I] (gate
    columns, then up) and down_proj [E, I, H], the same matrices."""
    with torch.no_grad():
        module.gate_up_proj = torch.nn.Parameter(module.gate_up_proj.transpose(1, 2).contiguous())
        module.down_proj = torch.nn.Parameter(module.down_proj.transpose(1, 2).contiguous())
    module.is_transposed = True
    return module


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_layout(device, gen, mok_calls):
    """is_transposed=True (is_concatenated=True): mok reads gate_up_proj [E, H, 2I] and down_proj
    [E, I, H] in place and returns their gradients in that layout, on the CPU and on CUDA (the
    fused kernels' transposed policy)."""
    module = experts_of(tiny_model("qwen3_moe", device))[0]
    set_weights(module, gen)
    x, ids, weights, dy = module_inputs(module, gen, device)
    want = float64_grads(module, x, ids, weights, dy)
    transpose_parameters(module)
    assert hf._module_reason(module) is None
    assert mok.experts.unsupported_reason(hidden=256, intermediate=256, num_experts=8, topk=2, device=device,
                                          transposed=True) is None
    assert hf.fallback_reason(module, x.requires_grad_(), ids, weights) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.MokFallbackWarning)
        y, dx, dw, d_gate_up, d_down = run_module(module, x, ids, weights, dy)
    assert len(mok_calls) == 1
    assert mok_calls[0][0] is module.gate_up_proj and mok_calls[0][1] is module.down_proj
    assert d_gate_up.shape == module.gate_up_proj.shape == (8, 256, 512) and d_down.shape == (8, 256, 256)
    check_against_float64((y, dx, dw, d_gate_up.transpose(1, 2), d_down.transpose(1, 2)), want)
    # grouped_mm reads the same transposed parameters: the same function
    y_hf = grouped_mm_experts_forward(module, x.detach(), ids, weights.detach())
    assert rel(y, y_hf) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic(device, gen, mok_calls):
    module = experts_of(tiny_model("qwen3_moe", device))[0]
    set_weights(module, gen)
    inputs = module_inputs(module, gen, device)
    first = [t.clone() for t in run_module(module, *inputs)]
    second = run_module(module, *inputs)
    assert len(mok_calls) == 2
    for name, a, b in zip(("y", "dx", "d top_k_weights", "d gate_up_proj", "d down_proj"), first, second):
        assert torch.isfinite(a).all() and torch.equal(a, b), f"{name} differs between two runs"


# ---------------------------------------------------------------------------------------------
# Whole models


def loss_and_grads(model, input_ids, routes):
    """(logits, loss, gradients) of one step: the experts' weights' and, as "layer L d
    top_k_weights", each MoE layer's routing weights'.  routes {layer: (top_k_index,
    top_k_weights)} is filled by the first run and replayed by the others, the weights entering
    as leaves: two models a rounding apart route alike (a near tie in a router can flip) and
    their routers get no gradient."""
    replay, leaves = bool(routes), {}

    def route(module, args):
        layer = layers[module]
        if not replay:
            routes[layer] = (args[1], args[2].detach())
        ids, weights = routes[layer]
        dtype = torch.float64 if args[0].dtype == torch.float64 else weights.dtype
        leaves[layer] = weights.to(dtype, copy=True).requires_grad_()
        return args[0], ids, leaves[layer]

    layers = {m: layer for layer, m in enumerate(experts_of(model))}
    hooks = [m.register_forward_pre_hook(route) for m in layers]
    try:
        model.zero_grad(set_to_none=True)
        out = model(input_ids, labels=input_ids)
        out.loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if ".experts." in n}
    grads.update({f"layer {layer} d top_k_weights": leaf.grad for layer, leaf in leaves.items()})
    return out.logits.detach().clone(), out.loss.detach(), grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_matches_grouped_mm(family, device, gen, mok_calls):
    """A training step of the whole model through mok: its logits, loss and gradients are as
    close to a float64 copy of the model (same weights, same routes) as grouped_mm's are."""
    model = tiny_model(family, device)
    for module in experts_of(model):
        set_weights(module, gen, scale=0.5)
    input_ids = torch.randint(3, COMMON["vocab_size"], (2, 16), generator=gen).to(device)
    routes = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.MokFallbackWarning)
        got = loss_and_grads(model, input_ids, routes)
    assert len(mok_calls) == len(experts_of(model)) == COMMON["num_hidden_layers"]
    exact_model = copy.deepcopy(model).to(torch.float64)
    exact_model.set_experts_implementation("eager")  # the modeling file's own loop over experts
    model.set_experts_implementation("grouped_mm")
    hf_got = loss_and_grads(model, input_ids, routes)
    exact = loss_and_grads(exact_model, input_ids, routes)
    assert len(mok_calls) == COMMON["num_hidden_layers"]
    assert rel(got[0], hf_got[0]) < 2e-2
    assert abs(got[1].item() - hf_got[1].item()) < 1e-2 * hf_got[1].item()
    assert got[2].keys() == hf_got[2].keys() == exact[2].keys() and len(got[2]) == 3 * len(routes)
    # bf16 roundings add up along the model (about 1e-2 on the first layer's gradients for
    # either implementation): mok must be as accurate as grouped_mm, within 1.5x.
    for name, ours, theirs, want in [("logits", got[0], hf_got[0], exact[0])] + [
            (n, got[2][n], hf_got[2][n], exact[2][n]) for n in sorted(got[2])]:
        err, hf_err = rel(ours, want), rel(theirs, want)
        assert err < 1.5 * hf_err + 2e-3, f"{name}: rel. error {err:.1e} against float64, grouped_mm's {hf_err:.1e}"


@pytest.mark.parametrize("device", DEVICES)
def test_set_experts_implementation(device, gen, mok_calls):
    model = tiny_model("qwen3_moe", device, implementation=None)
    assert model.config._experts_implementation == "grouped_mm"
    input_ids = torch.randint(3, COMMON["vocab_size"], (2, 16), generator=gen).to(device)
    with torch.no_grad():
        default = model(input_ids).logits
        assert not mok_calls
        model.set_experts_implementation("mok")
        assert all(m.config._experts_implementation == "mok" for m in experts_of(model))
        with_mok = model(input_ids).logits
        assert len(mok_calls) == 2
        model.set_experts_implementation("grouped_mm")
        again = model(input_ids).logits
        assert len(mok_calls) == 2
    assert torch.equal(default, again)
    assert rel(with_mok, default) < 2e-2


def test_from_pretrained(tmp_path, gen, mok_calls):
    tiny_model("mixtral", "cpu", implementation=None).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=BF16, experts_implementation="mok")
    with torch.no_grad():
        logits = model(torch.randint(3, COMMON["vocab_size"], (1, 8), generator=gen)).logits
    assert torch.isfinite(logits).all()
    assert len(mok_calls) == 2


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA GPU and mok's CUDA build")
def test_no_weight_copy_on_cuda(gen):
    """A training step allocates the two weight gradients and activations, not a weight-sized copy."""
    model = tiny_model("qwen3_moe", "cuda", hidden_size=1024, moe_intermediate_size=512, num_experts=16)
    module = experts_of(model)[0]
    set_weights(module, gen)
    inputs = module_inputs(module, gen, "cuda", num_tokens=256)
    run_module(module, *inputs)  # the workspace is made here
    module.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run_module(module, *inputs)
    torch.cuda.synchronize()
    grad_bytes = module.gate_up_proj.nbytes + module.down_proj.nbytes
    extra = torch.cuda.max_memory_allocated() - base - grad_bytes
    assert extra < module.gate_up_proj.nbytes // 2, (
        f"a step took {extra / 2**20:.1f} MiB beyond the weight gradients; gate_up_proj is "
        f"{module.gate_up_proj.nbytes / 2**20:.1f} MiB")


# ---------------------------------------------------------------------------------------------
# Fallbacks: grouped_mm's result, one warning naming the reason


def clamped_experts(model):
    """A module of a class with its own _apply_gate (a clamped SwiGLU, not plain SwiGLU)."""
    base = type(experts_of(model)[0])

    class ClampedExperts(base):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(max=0.5)) * up.clamp(-0.5, 0.5)

    return ClampedExperts(model.config).to(BF16)


def with_biases(model, gen):
    module = experts_of(model)[0]
    module.has_bias = True
    num_experts, two_i, hidden = module.gate_up_proj.shape
    module.gate_up_proj_bias = torch.nn.Parameter(torch.randn(num_experts, two_i, generator=gen).to(BF16))
    module.down_proj_bias = torch.nn.Parameter(torch.randn(num_experts, hidden, generator=gen).to(BF16))
    return module


def transposed_interleaved(device):
    module = transpose_parameters(experts_of(tiny_model("qwen3_moe", device))[0])
    module.is_concatenated = False
    return module


FALLBACKS = {
    "bias": (lambda device, gen: with_biases(tiny_model("qwen3_moe", "cpu"), gen).to(device), "has_bias=True"),
    "transposed_interleaved": (lambda device, gen: transposed_interleaved(device),
                               "is_transposed=True, is_concatenated=False"),
    "gelu": (lambda device, gen: experts_of(tiny_model("qwen3_moe", device, hidden_act="gelu"))[0], "not SiLU"),
    "apply_gate": (lambda device, gen: clamped_experts(tiny_model("qwen3_moe", "cpu")).to(device), "_apply_gate"),
    "float32": (lambda device, gen: experts_of(tiny_model("qwen3_moe", device, dtype=torch.float32))[0],
                "mok computes in bfloat16"),
}


def check_fallback(module, gen, device, mok_calls, expect, dtype=BF16):
    set_weights(module, gen)
    x, ids, weights, dy = module_inputs(module, gen, device)
    x, dy = x.to(dtype), dy.to(dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [run_module(module, x, ids, weights, dy) for _ in range(2)]
    fallbacks = [w for w in caught if issubclass(w.category, hf.MokFallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in fallbacks]
    assert expect in str(fallbacks[0].message) and type(module).__name__ in str(fallbacks[0].message)
    assert hf.fallback_reason(module, x.requires_grad_(), ids, weights) in str(fallbacks[0].message)
    assert not mok_calls
    y = grouped_mm_experts_forward(module, x, ids, weights.detach())
    for y_got, *_ in got:
        assert torch.isfinite(y_got).all() and torch.equal(y_got, y)
    return str(fallbacks[0].message)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_fallback(case, device, gen, mok_calls):
    make, expect = FALLBACKS[case]
    module = make(device, gen)
    check_fallback(module, gen, device, mok_calls, expect, dtype=module.gate_up_proj.dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_fallback_unsupported_shape(device, gen, mok_calls, monkeypatch):
    """A shape mok.experts.unsupported_reason() names: its reason is the warning's; it is asked
    once per input kind, with backward = whether a gradient can be asked for."""
    asked = []

    def unsupported(**kwargs):
        asked.append(kwargs)
        return f"intermediate = {kwargs['intermediate']} is a test's unsupported shape"

    monkeypatch.setattr(mok.experts, "unsupported_reason", unsupported)
    module = experts_of(tiny_model("qwen3_moe", device))[0]
    message = check_fallback(module, gen, device, mok_calls, "intermediate = 256 is a test's unsupported shape")
    assert [a.pop("device").type for a in asked] == [device], message
    assert asked == [dict(hidden=256, intermediate=256, num_experts=8, topk=2, backward=True, transposed=False,
                          config=hf.CONFIG)]
    with torch.no_grad():
        module(*module_inputs(module, gen, device)[:3])
    assert [a["backward"] for a in asked] == [True, False]


def test_fp8_block_config_and_its_shapes(gen, mok_calls, monkeypatch):
    """CONFIG in fp8_block: a module whose expert width is a multiple of 128 runs mok in fp8 (the
    CPU reference's recipe: not the bf16 bits); one of width 192 falls back, naming fp8's blocks."""
    import dataclasses
    monkeypatch.setattr(hf, "CONFIG", dataclasses.replace(hf.CONFIG, precision="fp8_block"))
    module = experts_of(tiny_model("qwen3_moe", "cpu"))[0]
    set_weights(module, gen)
    x, ids, weights, _ = module_inputs(module, gen, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.MokFallbackWarning)
        with torch.no_grad():
            y8 = module(x, ids, weights)
    assert len(mok_calls) == 1 and torch.isfinite(y8).all()
    y16 = grouped_mm_experts_forward(module, x, ids, weights)
    diff = ((y8.double() - y16.double()).norm() / y16.double().norm()).item()
    assert 1e-3 < diff < 0.15, diff  # e4m3's rounding, not bf16's bits and not garbage
    narrow = experts_of(tiny_model("qwen3_moe", "cpu", moe_intermediate_size=192))[0]
    check_fallback(narrow, gen, "cpu", [], "multiples of 128")


@pytest.mark.parametrize("device", DEVICES)
def test_fallback_more_routes_than_experts(device, gen, mok_calls):
    """Expert parallelism with fewer local experts than routes per token (e.g. 4 local experts,
    top-6 with the other ranks' experts as sentinels): mok needs topk <= num_experts."""
    module = experts_of(tiny_model("qwen3_moe", device, num_experts=4))[0]
    set_weights(module, gen)
    num_tokens, hidden = 32, module.gate_up_proj.shape[2]
    x = torch.randn(num_tokens, hidden, generator=gen).to(BF16).to(device)
    ids = torch.cat([torch.rand(num_tokens, 4, generator=gen).argsort(dim=1), torch.full((num_tokens, 2), 4)], dim=1)
    ids = ids.gather(1, torch.rand(num_tokens, 6, generator=gen).argsort(dim=1)).to(device)
    weights = torch.rand(num_tokens, 6, generator=gen).to(device)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = module(x, ids, weights)
    messages = [str(w.message) for w in caught if issubclass(w.category, hf.MokFallbackWarning)]
    assert len(messages) == 1 and "topk = 6" in messages[0], messages
    assert not mok_calls and torch.equal(y, grouped_mm_experts_forward(module, x, ids, weights))
    assert rel(y, reference(x.double(), ids, weights.double(), module.gate_up_proj.double(),
                            module.down_proj.double())) < 1e-2


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA GPU and mok's CUDA build")
def test_cuda_intermediate_on_the_64_grid(gen, mok_calls):
    """moe_intermediate_size = 192, a multiple of 64 but not of the 128 x 256 tiles (as
    DeepSeek-V2-Lite's 1408): mok trains it, against float64; 96 falls back, naming why."""
    module = experts_of(tiny_model("qwen3_moe", "cuda", moe_intermediate_size=192))[0]
    set_weights(module, gen)
    x, ids, weights, dy = module_inputs(module, gen, "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.MokFallbackWarning)
        got = run_module(module, x, ids, weights, dy)
    assert len(mok_calls) == 1
    check_against_float64(got, float64_grads(module, x, ids, weights, dy))
    mok_calls.clear()
    module = experts_of(tiny_model("qwen3_moe", "cuda", moe_intermediate_size=96))[0]
    reason = mok.experts.unsupported_reason(hidden=256, intermediate=96, num_experts=8, topk=2, device="cuda")
    assert reason is not None and "intermediate = 96 must be a multiple of 64" in reason
    check_fallback(module, gen, "cuda", mok_calls, reason)


@pytest.mark.parametrize("device", DEVICES)
def test_gpt_oss_falls_back(device, gen, mok_calls):
    """gpt-oss: biases, transposed weights and a clamped SwiGLU: grouped_mm's logits, bitwise."""
    model = tiny_model("gpt_oss", device, head_dim=64, intermediate_size=256, num_local_experts=8,
                       num_experts_per_tok=2, max_position_embeddings=4096)
    input_ids = torch.randint(3, COMMON["vocab_size"], (2, 16), generator=gen).to(device)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = model(input_ids).logits
        model.set_experts_implementation("grouped_mm")
        want = model(input_ids).logits
    messages = [str(w.message) for w in caught if issubclass(w.category, hf.MokFallbackWarning)]
    assert len(messages) == 1 and "GptOssExperts" in messages[0] and "has_bias=True" in messages[0], messages
    assert not mok_calls
    assert torch.isfinite(logits).all() and torch.equal(logits, want)


# ---------------------------------------------------------------------------------------------
# The families hf.py's docstring names: what each one's experts module decides (built on the
# meta device from the family's default config; families this transformers lacks are skipped)

FAMILY_DECISIONS = {
    **{family: None for family in ("deepseek_v2", "dots1", "ernie4_5_moe", "glm4_moe", "granitemoe", "jamba",
                                   "lfm2_moe", "minimax", "phimoe", "qwen3_5_moe", "qwen3_next", "qwen3_vl_moe")},
    "gpt_oss": "has_bias=True", "openai_privacy_filter": "has_bias=True", "deepseek_v4": "_apply_gate",
    "minimax_m3_vl": "_apply_gate", "glm5_next": "_apply_gate", "hy_v4": "_apply_gate",
    "nemotron_h": "has_gate=False", "gemma4": "not SiLU",
}


def default_experts_module(family):
    import importlib
    import inspect

    try:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        config = AutoConfig.for_model(family)
    except (ImportError, KeyError, ValueError):
        pytest.skip(f"this transformers has no {family}")
    config = getattr(config, "text_config", None) or config
    for name, value in (("num_experts", 8), ("num_local_experts", 8), ("moe_intermediate_size", 256)):
        if getattr(config, name, 0) is None:  # defaults of dense variants
            setattr(config, name, value)
    classes = [c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, torch.nn.Module)
               and c.__module__ == module.__name__ and hasattr(c, "_apply_gate")]
    assert len(classes) == 1, f"{family}: experts classes {classes}"
    with torch.device("meta"):
        return classes[0](config)


@pytest.mark.parametrize("family", sorted(FAMILY_DECISIONS))
def test_family_decisions(family):
    reason = hf._module_reason(default_experts_module(family))
    expect = FAMILY_DECISIONS[family]
    if expect is None:
        assert reason is None, f"{family}: {reason}"
    else:
        assert reason is not None and expect in reason, f"{family}: {reason}"


# ---------------------------------------------------------------------------------------------
# Imports


def run_python(code):
    env = dict(os.environ)  # MOK_LIBRARY, if set, passes through
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    return run.returncode, run.stdout + run.stderr


def test_import_mok_does_not_import_transformers():
    rc, out = run_python("import sys, mok, mok.integrations; assert 'transformers' not in sys.modules, 'imported'")
    assert rc == 0, out


def test_import_without_transformers_names_the_extra():
    rc, out = run_python("import sys; sys.modules['transformers'] = None\n"
                         "try:\n    import mok.integrations.hf\nexcept ImportError as e:\n    print(e)\n"
                         "else:\n    sys.exit('no ImportError')")
    assert rc == 0 and 'pip install "mok[hf]"' in out, out


def test_register_is_idempotent():
    hf.register()
    hf.register()
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    assert ALL_EXPERTS_FUNCTIONS["mok"] is hf.mok_experts_forward

