"""examples/train_hf.py runs as a user runs it (a subprocess) and trains a Hugging Face MoE model
with experts_implementation="mok": exit status 0, a printed loss that went down and no fallback to
transformers' grouped_mm, on the CPU and, where there is one, on a CUDA GPU."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mok

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_hf.py"
STEPS = 8
STEP_LINE = re.compile(r"^step\s+(\d+)\s+loss\s+(\S+)", re.MULTILINE)


def _train(device: str):
    """(printed output, losses) of a small run of the example on `device`."""
    env = dict(os.environ)  # MOK_LIBRARY, if set, passes through
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(EXAMPLE), "--device", device, "--tokens", "64", "--steps", str(STEPS)]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"{' '.join(cmd)} exited with {run.returncode}:\n{output}"
    steps = [(int(s), float(loss)) for s, loss in STEP_LINE.findall(run.stdout)]
    assert [s for s, _ in steps] == list(range(1, STEPS + 1)), f"expected {STEPS} step lines:\n{output}"
    losses = [loss for _, loss in steps]
    assert all(loss == loss for loss in losses), f"a NaN loss: {losses}\n{output}"
    assert losses[-1] < losses[0], f"the loss did not go down: {losses}\n{output}"
    assert "OK: the loss went down" in output and "experts_implementation='mok'" in output, output
    return output, losses


def test_train_hf_cpu():
    _train("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not mok.has_cuda(), reason="libmok was built without its CUDA part")
def test_train_hf_cuda():
    _train("cuda")
