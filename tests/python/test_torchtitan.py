"""mok.integrations.torchtitan: mok as the routed experts of TorchTitan 0.3's MoE layer.

A small TorchTitan MoE (router, GroupedExperts, LocalTokenDispatcher, optionally shared
experts) runs forward and backward through mok and through TorchTitan's own path; y, dx and
every parameter's gradient are checked against each other and against a float64 MoE computed
from the same bf16 parameters and the same routes, bitwise over two runs, and for reading the
experts' parameters in place.  Every test runs on the CPU and, with a GPU and mok's CUDA build,
on CUDA.  Without TorchTitan installed the tests that need it skip.
"""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mok
import mok.experts

try:
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher

    from mok.integrations import torchtitan as mok_titan
    HAVE_TITAN = True
except ImportError:
    HAVE_TITAN = False

needs_titan = pytest.mark.skipif(not HAVE_TITAN,
                                 reason='TorchTitan 0.3 is not installed (pip install "mok[torchtitan]")')

ROOT = Path(__file__).resolve().parents[2]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and mok.has_cuda() else [])
BF16 = torch.bfloat16
E, H, I, K, I_SHARED = 8, 256, 256, 2, 256
B, L = 2, 32
TOL = 2e-2

# TorchTitan's router asks for float32 autocast, which the CPU does not have (it warns and runs on)
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")


def build_moe(device, dtype=BF16, shared=False, seed=0, topk=K, dispatcher=None, route_norm=True,
              shared_inter=I_SHARED):
    """A TorchTitan MoE: softmax top-k router (scores normalised by default), 8 GroupedExperts,
    EP = 1 (LocalTokenDispatcher by default); parameters ~ N(0, 0.05) (the router's wider, so
    routes are well separated)."""
    dispatcher = dispatcher or LocalTokenDispatcher
    routed = RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=H, hidden_dim=I, num_experts=E),
        token_dispatcher=dispatcher.Config(num_experts=E, top_k=topk))
    router = TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=H, out_features=E),
                                          top_k=topk, score_func="softmax", route_norm=route_norm)
    ffn = None
    if shared:
        ffn = FeedForward.Config(w1=Linear.Config(in_features=H, out_features=shared_inter),
                                 w2=Linear.Config(in_features=shared_inter, out_features=H),
                                 w3=Linear.Config(in_features=H, out_features=shared_inter))
    config = MoE.Config(num_experts=E, routed_experts=routed, router=router, load_balance_coeff=1e-3,
                        shared_experts=ffn)
    return init_params(config.build(), seed).to(device=device, dtype=dtype)


def init_params(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if name.startswith("router") else 0.05))
    return model


def inputs(device, dtype=BF16, seed=1, hidden=H):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, hidden, generator=gen).to(device=device, dtype=dtype)
    probe = torch.randn(B, L, hidden, generator=gen).to(device=device, dtype=torch.float32)
    return x, probe


def run(model, x, probe):
    """y, dx and every parameter's gradient of loss = <y, probe>, and the routes used."""
    model.zero_grad(set_to_none=True)
    routes = {}
    hook = model.routed_experts.register_forward_pre_hook(lambda m, args: routes.update(ids=args[2].detach().clone()))
    try:
        x = x.detach().clone().requires_grad_()
        y = model(x)
        (y.float() * probe).sum().backward()
    finally:
        hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return y.detach(), x.grad, grads, routes["ids"]


def reference(model, x, probe, ids):
    """The MoE (softmax router) in float64 from the same parameters, on the routes `ids`
    [B, L, K]; returns y, dx and the parameters' gradients."""
    router = model.router
    assert router.score_func == "softmax" and router.num_expert_groups is None
    p = {name: t.detach().double().requires_grad_() for name, t in model.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    X = x64.reshape(-1, x.shape[-1])
    ids = ids.reshape(-1, ids.shape[-1])
    scores = torch.softmax(X @ p["router.gate.weight"].T, dim=-1).gather(-1, ids)
    if router.route_norm:
        scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    scores = scores * router.route_scale
    w1 = p["routed_experts.inner_experts.w1_EFD"]
    w2 = p["routed_experts.inner_experts.w2_EDF"]
    w3 = p["routed_experts.inner_experts.w3_EFD"]
    y = torch.zeros_like(X)
    for e in range(w1.shape[0]):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        h = F.silu(X[rows] @ w1[e].T) * (X[rows] @ w3[e].T)
        y = y.index_add(0, rows, scores[rows, slots, None] * (h @ w2[e].T))
    if "shared_experts.w1.weight" in p:
        s1, s2, s3 = (p[f"shared_experts.{n}.weight"] for n in ("w1", "w2", "w3"))
        y = y + (F.silu(X @ s1.T) * (X @ s3.T)) @ s2.T
    y = y.reshape(x.shape)
    (y * probe.double()).sum().backward()
    return y.detach(), x64.grad, {name: t.grad for name, t in p.items()}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _no_fallback():
    warnings.simplefilter("error", mok_titan.MokFallbackWarning)


# ---------------------------------------------------------------------------------------
# Without TorchTitan, and the import boundary


def test_import_error_names_the_extra():
    """Without TorchTitan the adapter's import fails with an ImportError naming mok[torchtitan]."""
    code = ("import importlib.abc, sys\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'torchtitan' or name.startswith('torchtitan.'):\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "try:\n"
            "    import mok.integrations.torchtitan\n"
            "except ImportError as e:\n"
            "    print('IMPORT-ERROR:', e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "IMPORT-ERROR:" in out.stdout and 'pip install "mok[torchtitan]"' in out.stdout, out.stdout


def test_import_mok_leaves_the_adapter_alone():
    code = ("import sys, mok\n"
            "print(sorted(m for m in sys.modules if m == 'torchtitan' or m.startswith(('torchtitan.', "
            "'mok.integrations.torchtitan'))))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


# ---------------------------------------------------------------------------------------
# Against TorchTitan's own path and float64


def check_against_torchtitan_and_float64(model, x, probe):
    """TorchTitan's path, then mok's (enabled here), and a float64 reference: y, dx and every
    parameter's gradient within TOL of each other; returns the gradients' names."""
    y_t, dx_t, g_t, ids_t = run(model, x, probe)                 # TorchTitan's own path
    assert mok_titan.enable(model) == 1
    with warnings.catch_warnings():
        _no_fallback()
        y_m, dx_m, g_m, ids_m = run(model, x, probe)             # mok
    assert torch.equal(ids_t, ids_m)                             # the routing is TorchTitan's, unchanged
    y_r, dx_r, g_r = reference(model, x, probe, ids_m)
    assert y_m.dtype == BF16 and y_m.shape == x.shape and dx_m.dtype == BF16
    errors = {"y": (rel(y_m, y_r), rel(y_t, y_r), rel(y_m, y_t)),
              "dx": (rel(dx_m, dx_r), rel(dx_t, dx_r), rel(dx_m, dx_t))}
    for name in g_r:
        assert g_m[name].dtype == BF16 and g_m[name].shape == g_r[name].shape, name
        errors[name] = (rel(g_m[name], g_r[name]), rel(g_t[name], g_r[name]), rel(g_m[name], g_t[name]))
    bad = {k: v for k, v in errors.items() if max(v) >= TOL}
    assert not bad, f"relative errors (mok vs f64, torchtitan vs f64, mok vs torchtitan) over {TOL}: {bad}"
    return set(g_r)


EXPERTS = {"router.gate.weight", "routed_experts.inner_experts.w1_EFD", "routed_experts.inner_experts.w2_EDF",
           "routed_experts.inner_experts.w3_EFD"}
SHARED = {f"shared_experts.{n}.weight" for n in ("w1", "w2", "w3")}


LAYERS = {
    "routed": dict(),
    "shared": dict(shared=True),
    # as TorchTitan's DeepSeek-V3 debug model's MoE layers: top-3, unnormalised scores, the
    # all-to-all dispatcher (at EP = 1), shared experts of width 512
    "dsv3": dict(shared=True, topk=3, route_norm=False, shared_inter=2 * I_SHARED,
                 dispatcher=AllToAllTokenDispatcher if HAVE_TITAN else None),
}


@needs_titan
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("device", DEVICES)
def test_matches_torchtitan_and_float64(device, layer):
    model = build_moe(device, **LAYERS[layer])
    x, probe = inputs(device)
    names = check_against_torchtitan_and_float64(model, x, probe)
    assert names == (EXPERTS | SHARED if model.shared_experts is not None else EXPERTS)


@needs_titan
@pytest.mark.parametrize("device", DEVICES)
def test_deepseek_v3_debugmodel(device):
    """TorchTitan's DeepSeek-V3 debug model built with MokConverter: every MoE layer's routed
    experts run mok (top-3 of 8, shared experts, the all-to-all dispatcher at EP = 1, the model's
    own router settings)."""
    try:
        from torchtitan.models.deepseek_v3 import model_registry
    except ImportError as e:  # TorchTitan 0.3.0's model packages need a torch newer than 2.11
        pytest.skip(f"TorchTitan's DeepSeek-V3 model does not import with torch {torch.__version__}: {e}")

    model = model_registry("debugmodel", converters=[mok_titan.MokConverter.Config()]).model.build()
    converted = [name for name, m in model.named_modules() if type(m) is mok_titan.MokRoutedExperts]
    assert converted == [f"layers.{i}.moe.routed_experts" for i in range(1, 6)]
    assert list(model.state_dict()) == list(model_registry("debugmodel").model.build().state_dict())
    moe = model.get_submodule("layers.1.moe")
    mok_titan.disable(moe)
    moe = init_params(moe).to(device=device, dtype=BF16)
    assert moe.router.top_k == 3 and moe.shared_experts is not None
    assert type(moe.routed_experts.token_dispatcher) is AllToAllTokenDispatcher
    x, probe = inputs(device, hidden=moe.router.gate.in_features)
    assert check_against_torchtitan_and_float64(moe, x, probe) == EXPERTS | SHARED


@needs_titan
@pytest.mark.parametrize("device", DEVICES)
def test_bitwise_deterministic(device):
    model = build_moe(device, shared=True)
    mok_titan.enable(model)
    x, probe = inputs(device)
    first = run(model, x, probe)
    second = run(model, x, probe)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for name in first[2]:
        assert torch.equal(first[2][name], second[2][name]), name


@needs_titan
@pytest.mark.parametrize("device", DEVICES)
def test_reads_parameters_in_place(device, monkeypatch):
    """mok gets TorchTitan's own parameter objects (no copy, no cast), and their gradients
    arrive on them."""
    model = build_moe(device)
    experts = model.routed_experts.inner_experts
    params = {name: (p, p.data_ptr()) for name, p in model.named_parameters()}
    assert mok_titan.enable(model) == 1
    calls = []
    real = mok.experts.experts_separate

    def spy(x, topk_ids, topk_weights, w_gate, w_up, w_down, **kwargs):
        calls.append((w_gate, w_up, w_down))
        return real(x, topk_ids, topk_weights, w_gate, w_up, w_down, **kwargs)

    monkeypatch.setattr(mok.experts, "experts_separate", spy)
    x, probe = inputs(device)
    with warnings.catch_warnings():
        _no_fallback()
        run(model, x, probe)
    assert len(calls) == 1
    w_gate, w_up, w_down = calls[0]
    assert w_gate is experts.w1_EFD and w_up is experts.w3_EFD and w_down is experts.w2_EDF
    for name, p in model.named_parameters():                     # the same tensors, the same storage
        assert p is params[name][0] and p.data_ptr() == params[name][1], name
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype, name
        assert p.grad.abs().sum() > 0, name


# ---------------------------------------------------------------------------------------
# Falling back to TorchTitan's path


@needs_titan
@pytest.mark.parametrize("device", DEVICES)
def test_float32_experts_fall_back_once(device):
    """float32 parameters: TorchTitan copies them to bf16 on each call, mok does not: TorchTitan's
    own path runs (the same results as without mok) and one warning says why."""
    mok.integrations._warned.clear()
    model = build_moe(device, dtype=torch.float32)
    x, probe = inputs(device, dtype=torch.float32)
    y_t, dx_t, g_t, _ = run(model, x, probe)
    mok_titan.enable(model)
    with pytest.warns(mok_titan.MokFallbackWarning, match="not all bfloat16"):
        y_m, dx_m, g_m, _ = run(model, x, probe)
    with warnings.catch_warnings():
        _no_fallback()                                           # once per (class, reason)
        run(model, x, probe)
    assert torch.equal(y_t, y_m)
    # the same path twice: bitwise on the CPU; on CUDA, torch's backward kernels are not all bitwise
    exact = device == "cpu"
    for name, a, b in [("dx", dx_t, dx_m)] + [(n, g_t[n], g_m[n]) for n in g_t]:
        assert torch.equal(a, b) if exact else rel(a, b) < 1e-3, name


@needs_titan
def test_fallback_reasons(monkeypatch):
    model = build_moe("cpu")
    mok_titan.enable(model)
    routed = model.routed_experts
    x, _ = inputs("cpu")
    scores = torch.rand(B, L, K)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(B * L)]).view(B, L, K)
    assert mok_titan.fallback_reason(routed, x, scores, ids) is None

    # the all-to-all dispatcher (TorchTitan's models' default) is the local one without an EP mesh
    routed.token_dispatcher = AllToAllTokenDispatcher.Config(num_experts=E, top_k=K).build()
    assert mok_titan.fallback_reason(routed, x, scores, ids) is None

    class Mesh:                                                  # what parallelize wires for EP = 2
        def size(self):
            return 2

    routed.token_dispatcher.ep_mesh = Mesh()
    assert "runs expert parallelism over 2 ranks" in mok_titan.fallback_reason(routed, x, scores, ids)

    class OtherDispatcher(LocalTokenDispatcher):
        pass

    routed.token_dispatcher = OtherDispatcher(LocalTokenDispatcher.Config(num_experts=E, top_k=K))
    assert "its token dispatcher is OtherDispatcher" in mok_titan.fallback_reason(routed, x, scores, ids)
    routed.token_dispatcher = LocalTokenDispatcher.Config(num_experts=E, top_k=K).build()

    with monkeypatch.context() as patch:
        patch.setattr(mok_titan._spmd, "is_type_checking", lambda: True)
        assert "SPMD type checking is on" in mok_titan.fallback_reason(routed, x, scores, ids)

    class QuantizedExperts(GroupedExperts):
        pass

    routed.inner_experts.__class__ = QuantizedExperts
    routed.__dict__.pop("_mok_decisions")
    assert "QuantizedExperts, not TorchTitan's GroupedExperts" in mok_titan.fallback_reason(routed, x, scores, ids)
    routed.inner_experts.__class__ = GroupedExperts

    # a shape mok cannot run: its reason is the warning's, and TorchTitan's path computes the call
    mok.integrations._warned.clear()
    monkeypatch.setattr(mok.experts, "unsupported_reason", lambda **kw: "a shape this mok does not run")
    routed.__dict__.pop("_mok_decisions")
    counts = torch.bincount(ids.flatten(), minlength=E)
    with pytest.warns(mok_titan.MokFallbackWarning, match="a shape this mok does not run"):
        y_m = routed(x, scores, ids, counts)
    y_t = RoutedExperts.forward(routed, x, scores, ids, counts)
    assert torch.equal(y_m, y_t)


@needs_titan
def test_float32_tokens_are_cast_like_torchtitan():
    """Tokens in float32 with bf16 experts: mok computes on bf16(x), as GroupedExperts does, and
    returns float32."""
    routed = build_moe("cpu").routed_experts
    x = inputs("cpu", dtype=torch.float32)[0]
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(B, L, K, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(B * L)]).view(B, L, K)
    counts = torch.bincount(ids.flatten(), minlength=E)
    y_t = routed(x, scores, ids, counts)
    mok_titan.enable(routed)
    with warnings.catch_warnings():
        _no_fallback()
        y_m = routed(x, scores, ids, counts)
    assert y_m.dtype == torch.float32 and y_m.shape == x.shape
    assert rel(y_m, y_t) < TOL


# ---------------------------------------------------------------------------------------
# Switching on and off


@needs_titan
def test_enable_disable_and_config():
    model = build_moe("cpu", shared=True)
    before = {name: p for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    assert mok_titan.enable(model) == 1 and type(model.routed_experts) is mok_titan.MokRoutedExperts
    assert mok_titan.enable(model) == 1                          # idempotent
    assert isinstance(model.routed_experts, RoutedExperts)
    assert list(model.state_dict()) == keys and all(p is before[n] for n, p in model.named_parameters())
    assert mok_titan.disable(model) == 1 and type(model.routed_experts) is RoutedExperts
    assert mok_titan.disable(model) == 0

    # at config time: every RoutedExperts.Config becomes a MokRoutedExperts.Config
    config = MoE.Config(num_experts=E, router=TokenChoiceTopKRouter.Config(
        num_experts=E, gate=Linear.Config(in_features=H, out_features=E), top_k=K),
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=H, hidden_dim=I, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K)))
    assert mok_titan.convert_config(config) is config
    assert type(config.routed_experts) is mok_titan.MokRoutedExperts.Config
    assert type(config.build().routed_experts) is mok_titan.MokRoutedExperts
    assert type(mok_titan.convert_config(RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=H, hidden_dim=I, num_experts=E),
        token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K)))) is mok_titan.MokRoutedExperts.Config

    # TorchTitan's parallelize (spmd_types backend) wraps GroupedExperts.forward on the instance and
    # keeps its weights plain tensors: mok still runs (it never calls that forward)
    model = build_moe("cpu")
    experts = model.routed_experts.inner_experts
    experts.forward = experts.forward
    mok_titan.enable(model)
    with warnings.catch_warnings():
        _no_fallback()
        model(inputs("cpu")[0])

    # after TorchTitan's parallelize has wrapped RoutedExperts.forward, enable says so instead of
    # doing nothing
    mok_titan.disable(model)
    model.routed_experts.forward = model.routed_experts.forward
    with pytest.raises(RuntimeError, match="before parallelizing"):
        mok_titan.enable(model)
