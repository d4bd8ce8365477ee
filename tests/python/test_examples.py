"""The training examples run as a user runs them (a subprocess) and train: exit status 0 and a
printed loss that went down, on the CPU and, where there is one, on a CUDA GPU.
  examples/train_moe.py  mok.nn.MoE
  examples/train_hf.py   a Hugging Face MoE causal LM with experts_implementation="mok" (no
                         fallback to transformers' grouped_mm)"""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mok

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
STEP_LINE = re.compile(r"^step\s+(\d+)\s+loss\s+(\S+)", re.MULTILINE)


def _train(device: str, example: str = "train_moe.py"):
    """(printed output, losses) of a small run of `example` on `device`."""
    env = dict(os.environ)  # MOK_LIBRARY, if set, passes through
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(ROOT / "examples" / example), "--device", device, "--tokens", "64", "--steps", str(STEPS)]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"{' '.join(cmd)} exited with {run.returncode}:\n{output}"
    steps = [(int(s), float(loss)) for s, loss in STEP_LINE.findall(run.stdout)]
    assert [s for s, _ in steps] == list(range(1, STEPS + 1)), f"expected {STEPS} step lines:\n{output}"
    losses = [loss for _, loss in steps]
    assert all(loss == loss for loss in losses), f"a NaN loss: {losses}\n{output}"
    assert losses[-1] < losses[0], f"the loss did not go down: {losses}\n{output}"
    return output, losses


def test_train_moe_cpu():
    output, _ = _train("cpu")
    assert "OK: the loss went down" in output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not mok.has_cuda(), reason="libmok was built without its CUDA part")
def test_train_moe_cuda():
    output, _ = _train("cuda")
    if "GPU backward is not built" in output:
        # Trained on the CPU; every step compared the GPU forward with the CPU forward.
        assert output.count("GPU forward vs CPU") == STEPS + 1, output
    else:
        assert "forward and backward on the GPU" in output, output


needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


@needs_hf
def test_train_hf_cpu():
    output, _ = _train("cpu", "train_hf.py")
    assert "OK: the loss went down" in output and "experts_implementation='mok'" in output, output


@needs_hf
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not mok.has_cuda(), reason="libmok was built without its CUDA part")
def test_train_hf_cuda():
    output, _ = _train("cuda", "train_hf.py")
    assert "OK: the loss went down" in output and "experts_implementation='mok'" in output, output
