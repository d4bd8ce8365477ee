"""Shared test setup: the package path, poisoned outputs, and a fresh seed per test that is
printed when the test fails (set MOK_TEST_SEED to replay one)."""
import os
import sys
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent.parent / "python"))
sys.path.insert(0, str(_HERE))

import mok  # noqa: E402

# Every output starts as NaN (or junk integers): an element the C side does not write fails.
mok.config.poison_outputs = True


def _fresh_seed() -> int:
    if os.environ.get("MOK_TEST_SEED"):
        return int(os.environ["MOK_TEST_SEED"])
    return int.from_bytes(os.urandom(4), "little")


@pytest.fixture
def seed(request) -> int:
    value = _fresh_seed()
    request.node._mok_seed = value
    return value


@pytest.fixture
def gen(seed) -> torch.Generator:
    """A CPU generator seeded freshly for this test."""
    return torch.Generator().manual_seed(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "_mok_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("mok seed", f"MOK_TEST_SEED={seed} reproduces this test's inputs"))
