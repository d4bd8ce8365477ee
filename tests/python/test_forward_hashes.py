"""The forward's bits on fixed inputs stay what they were when recorded (forward_hashes.py):
the lock that lets the engine under the kernels be rebuilt without changing a bit."""
import json

import pytest
import torch

import mok
import forward_hashes as fh


def _table():
    assert fh.HASHES.is_file(), f"{fh.HASHES} is missing: run tests/python/forward_hashes.py --record"
    return json.loads(fh.HASHES.read_text())


@pytest.mark.parametrize("name", [n for n, c in fh.CASES.items() if c[0] <= 1024])
def test_cpu_reference_bits_unchanged(name):
    want = _table()["cpu"][name]
    assert fh.run(name, "cpu") == want, f"CPU reference output of {name} changed"


@pytest.mark.skipif(not (torch.cuda.is_available() and mok.has_cuda()), reason="needs a CUDA GPU and libmok with CUDA")
@pytest.mark.parametrize("name", list(fh.CASES))
def test_cuda_forward_bits_unchanged(name):
    key = fh.device_key("cuda")
    table = _table()
    if key not in table:
        pytest.skip(f"no hashes recorded for {key} (recorded: {sorted(table)}); forward_hashes.py --record adds them")
    assert fh.run(name, "cuda") == table[key][name], f"CUDA forward output of {name} on {key} changed"
