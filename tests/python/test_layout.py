"""mok.functional is the public face of the modules below it (config, workspace, symmetric,
schedule, args, emulated, virtual): every name it had before the split still resolves, to the
same object as in its home module, and no lower module imports functional."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mok
import mok.config
from mok import functional as F

REPO = Path(__file__).resolve().parents[2]
LOWER = ("config", "workspace", "symmetric", "schedule", "args", "emulated", "virtual")

# Every name of mok.functional before it was split (stdlib and typing imports left out).
NAMES = [
    "ForwardContext", "Gradients", "LayerDims", "MULTICAST_OFF_ENV", "MoKConfig", "NO_ERROR", "PAD_ROW",
    "ROUTED_NAMES", "ROUTE_CHECK_NAMES", "RankInputs", "SLOT_BITS", "Schedule", "TOKEN_BITS", "VirtualGroup",
    "WEIGHT_NAMES", "Workspace", "_REGION_ALIGN", "_alloc", "_auto_workspace", "_backward_args", "_barrier",
    "_c_config", "_cache", "_cache_lock", "_canonical_device", "_check_main_grads", "_check_regions", "_dims",
    "_emulated_config", "_forward_args", "_grad_buffers", "_group_size_rank", "_ids_list", "_lib",
    "_new_workspace", "_rank_context", "_rank_inputs", "_rendezvous", "_resolve_workspace", "_shape_of",
    "_symm_mem_module", "_symmetric_region", "_symmetric_workspace", "_warn_connections", "_weights_dict",
    "backward", "backward_emulated", "build_schedule", "build_schedule_tensors", "clear_workspace_cache",
    "create_virtual_group", "create_workspace", "forward", "forward_emulated", "get_workspace",
    "multicast_off_env", "plan_capacity", "recompute_forward_context", "symmetric_bytes",
    "token_bucket",
]


@pytest.mark.parametrize("name", NAMES)
def test_every_name_still_resolves(name):
    assert hasattr(F, name), name
    assert name in dir(F), name
    homes = [getattr(mok, m) for m in LOWER if name in vars(getattr(mok, m))]
    for home in homes:
        assert getattr(home, name) is getattr(F, name), (home.__name__, name)


def test_poison_outputs_reaches_the_allocator(monkeypatch):
    # Tests poison every output through mok.config (conftest); MOK_POISON_OUTPUTS=1 does it too.
    monkeypatch.setattr(mok.config, "poison_outputs", True)
    assert F._alloc((2,), torch.float32, "cpu").isnan().all()
    assert (F._alloc((2,), torch.int32, "cpu") == -559038737).all()
    # Off: no fill at all (torch.empty, whose contents are whatever the allocator hands back:
    # after poisoned tensors were freed that can be NaN, so the contents prove nothing)
    monkeypatch.setattr(mok.config, "poison_outputs", False)
    monkeypatch.setattr(torch, "full", lambda *a, **k: pytest.fail("an output filled with poison off"))
    assert F._alloc((2,), torch.float32, "cpu").shape == (2,)


def test_lower_modules_do_not_import_functional():
    # The lower modules in a fresh interpreter, with the package's __init__ bypassed
    code = ("import importlib, sys, types; pkg = types.ModuleType('mok'); pkg.__path__ = [sys.argv[1]]; "
            "sys.modules['mok'] = pkg; [importlib.import_module('mok.' + m) for m in sys.argv[2:]]; "
            "assert 'mok.functional' not in sys.modules, sorted(m for m in sys.modules if m.startswith('mok'))")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    subprocess.run([sys.executable, "-c", code, str(REPO / "python" / "mok"), *LOWER], check=True, env=env)
