"""The knob defaults have one home, libmok's MOK_CONFIG_INITIALIZER (mokGetDefaultConfig): MoKConfig,
the op schemas and the benchmark command lines take them from there. A literal default written
again that disagrees fails here."""
import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import mok  # noqa: F401  (registers the ops)
from mok import _lib, ops
from mok import functional as F

REPO = Path(__file__).resolve().parents[2]
KNOBS = [f.name for f in dataclasses.fields(F.MoKConfig)]


def _expected(name):
    """The library's default of a MoKConfig field, as MoKConfig holds it."""
    value = _lib.config_defaults()[name]
    if name == "fp8_pow2_scales":  # a flag: a bool in MoKConfig and the op schemas
        return bool(value)
    return {code: p for p, code in _lib.PRECISIONS.items()}[value] if name == "precision" else value


def test_config_defaults_cover_every_knob():
    defaults = _lib.config_defaults()
    assert set(KNOBS) <= set(defaults)
    assert (defaults["fwd_num_comm_sms"], defaults["minibatch_size"], defaults["block_m"]) == (8, 0, 128)  # minibatch 0: chosen by mok


@pytest.mark.parametrize("name", KNOBS)
def test_mokconfig_defaults_are_the_library_defaults(name):
    field = {f.name: f for f in dataclasses.fields(F.MoKConfig)}[name]
    assert field.default == _expected(name), name
    assert getattr(F.MoKConfig(), name) == _expected(name), name
    assert type(getattr(F.MoKConfig(), name)) is type(_expected(name)), name


@pytest.mark.parametrize("op", ["forward", "backward", "build_schedule"])
def test_op_schema_defaults_are_the_library_defaults(op):
    defaults = _lib.config_defaults()
    schema = getattr(torch.ops.mok, op).default._schema
    checked = []
    for arg in schema.arguments:
        if arg.name in KNOBS:
            assert arg.default_value == defaults[arg.name], f"mok::{op} {arg.name}"
            checked.append(arg.name)
    expect = KNOBS if op != "build_schedule" else ["block_m", "minibatch_size", "macrobatch_size"]
    assert sorted(checked) == sorted(expect)


def test_config_args_of_the_default_config_are_the_op_defaults():
    schema = torch.ops.mok.forward.default._schema
    op_defaults = {a.name: a.default_value for a in schema.arguments if a.name in KNOBS}
    assert ops.config_args() == op_defaults == ops.config_args(F.MoKConfig())


# Command-line options of bench/ and tools/ that set a knob: their default must come from mok
# (MoKConfig or None, filled from it), never a number written in the script.
KNOB_OPTIONS = {"--comm-sms", "--comm", "--minibatch", "--macrobatch", "--timeout-s", "--block-m", "--num-blocks",
                "--num-threads", "--bwd-comm-sms"}


def _knob_options_with_literal_defaults(path):
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
            continue
        names = {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
        if not names & KNOB_OPTIONS:
            continue
        for kw in node.keywords:
            if kw.arg == "default" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, (int, float)):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {sorted(names)} default={kw.value.value}")
    return found


def test_scripts_write_no_literal_knob_default():
    scripts = sorted((REPO / "bench").glob("*.py")) + sorted((REPO / "tools").glob("*.py"))
    assert scripts
    found = [f for path in scripts for f in _knob_options_with_literal_defaults(path)]
    assert not found, "knob defaults written as literals (read them from mok.MoKConfig()): " + "; ".join(found)


def test_batch_sizes_chosen_by_mok_for_any_token_count():
    # minibatch_size / macrobatch_size = 0 (the defaults): the library chooses them from the
    # shape (two full waves of the grid per expert GEMM of a minibatch; a host config assumes
    # 132 SMs); 32k tokens per GPU (fg30b) works with the defaults, explicit knobs stay.
    assert F.MoKConfig().minibatch_size == 0 and F.MoKConfig().macrobatch_size == 0
    ws = F.create_workspace(4096, 1024, 64, 4, 32768)
    c = ws.c_config()
    # fg30b: min(1024/128, 4096/256) = 8 tiles per row block -> ceil(2*132/8) = 33 blocks
    assert (c.minibatch_size, c.macrobatch_size) == (33 * 128, 4 * 33 * 128)
    assert f"minibatch_size     = {33 * 128} rows" in ws.describe()
    ws = F.create_workspace(64, 32, 8, 2, 32768, ep_size=8, ep_rank=3)
    c = ws.c_config()
    assert c.minibatch_size == 264 * 128 and c.macrobatch_size % c.minibatch_size == 0  # one tile per block
    # A small grid (8 blocks: 16-block minibatches) with 2.1M worst-case rows: raised to 4224
    # rows so that the task table's 511 minibatches hold the plan
    ws = F.create_workspace(64, 32, 256, 8, 32768, ep_size=8, config=F.MoKConfig(macrobatch_size=0, num_blocks=8))
    assert (ws.c_config().minibatch_size, ws.c_config().macrobatch_size) == (4224, 16896)
    ws = F.create_workspace(64, 32, 8, 2, 64, config=F.MoKConfig(minibatch_size=256, macrobatch_size=512))
    assert (ws.c_config().minibatch_size, ws.c_config().macrobatch_size) == (256, 512)

def test_macrobatch_of_every_row():
    # macrobatch_size = MACROBATCH_ALL_ROWS: the ring holds every row of a worst-case plan (one
    # macrobatch), a whole number of minibatches; the minibatch as for an unknown ring, or the
    # caller's; other negative sizes are refused with the field named
    assert F.MACROBATCH_ALL_ROWS == -1
    rows = F.plan_capacity(16, 8, 4096)[0]  # dsv3: 4096 * 8 + 16 * 127, in whole row blocks
    assert rows == 34688
    ws = F.create_workspace(7168, 2048, 16, 8, 4096, config=F.MoKConfig(macrobatch_size=F.MACROBATCH_ALL_ROWS))
    c = ws.c_config()
    assert c.minibatch_size == 17 * 128  # min(2048/128, 7168/256) = 16 tiles -> ceil(264/16) blocks
    assert c.macrobatch_size == 16 * 2176 >= rows  # 15.9 minibatches of rows, rounded up
    assert "macrobatch_size = 34816" in ws.describe()
    ws = F.create_workspace(256, 128, 8, 2, 1000,
                            config=F.MoKConfig(minibatch_size=384, macrobatch_size=F.MACROBATCH_ALL_ROWS))
    rows = F.plan_capacity(8, 2, 1000)[0]
    assert ws.c_config().macrobatch_size == -(-rows // 384) * 384 >= rows
    ws = F.create_workspace(256, 128, 8, 2, 0, config=F.MoKConfig(macrobatch_size=F.MACROBATCH_ALL_ROWS))
    assert ws.c_config().macrobatch_size == ws.c_config().minibatch_size  # T = 0: one minibatch
    with pytest.raises(ValueError, match="macrobatch_size = -2"):
        F.create_workspace(256, 128, 8, 2, 64, config=F.MoKConfig(macrobatch_size=-2))
