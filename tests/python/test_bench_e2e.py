"""bench/bench_e2e.py: the --smoke run on the CPU as a user runs it (a subprocess) writes a JSON
with every figure for both models and every implementation, a PNG, and the table last, and the
models learn with the losses of every implementation within parity of grouped_mm's; the default
(GPU) models are the stated shapes (built on the meta device); a mok fallback fails the run."""
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "bench_e2e.py"
# mok's HF integration is part of the run wherever the package has it (an import error then fails)
HAS_MOK_HF = (ROOT / "python" / "mok" / "integrations" / "hf.py").exists()
# (mok_fp8: mok in fp8_block, the CPU reference's recipe here, its loss against the bf16 baseline's)
IMPLS = ["grouped_mm", "eager"] + (["mok", "mok_fp8"] if HAS_MOK_HF else [])
MODELS = ["qwen3", "dsv3"]
# Figures every implementation reports (the baseline's speed-up 1, its differences 0)
FIELDS = ("tokens_per_s", "step_ms_median", "step_ms_p10", "step_ms_p90", "speedup", "moe_share", "experts_share",
          "moe_fwd_ms", "moe_bwd_ms", "experts_ms", "step_ms_hooked", "peak_mem_gb", "state_gb", "first_loss",
          "final_loss", "mean_last10", "loss_diff_last10", "loss_diff_final", "loss_diff_max_step")

sys.path.insert(0, str(ROOT))
from bench import bench_e2e  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(completed process, e2e.json as a dict, output directory) of one smoke run."""
    out = tmp_path_factory.mktemp("e2e")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--impls", ",".join(IMPLS), "--out", str(out)]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{' '.join(cmd)} exited with {run.returncode}:\n{run.stdout}\n{run.stderr}"
    doc = json.loads((out / "e2e.json").read_text())
    return run, doc, out


def _finite(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def test_smoke_writes_every_figure(smoke):
    _, doc, _ = smoke
    assert doc["ok"] and not doc["failures"]
    assert doc["settings"]["vocab"] == 128 and doc["settings"]["impls"] == IMPLS and doc["baseline"] == "grouped_mm"
    assert [m["name"] for m in doc["models"]] == MODELS
    for m in doc["models"]:
        assert m["params"]["moe_blocks_count"] == 2 and m["params"]["experts"] > 0
        assert list(m["results"]) == IMPLS
        for impl, r in m["results"].items():
            where = f"{m['name']}/{impl}"
            assert r["status"] == "ok", f"{where}: {r.get('error')}"
            bad = {f: r.get(f) for f in FIELDS if not _finite(r.get(f))}
            assert not bad, f"{where}: missing or non-finite {bad}"
            assert len(r["losses"]) == doc["settings"]["steps"] and all(map(_finite, r["losses"])), where
            settings = doc["settings"]
            assert r["timed_steps"] == settings["steps"] - settings["warmup"] - settings["share_steps"], where
            assert 0 < r["experts_share"] <= r["moe_share"] < 1, where
            assert r["tokens_per_s"] > 0 and r["peak_mem_gb"] > 0
        base = m["results"]["grouped_mm"]
        assert base["speedup"] == 1.0 and base["loss_diff_final"] == 0.0
        if "mok" in m["results"]:
            assert m["results"]["mok"]["mok_fallbacks"] == [], m["results"]["mok"]["mok_fallbacks"]


def test_smoke_losses_fall_and_match(smoke):
    _, doc, _ = smoke
    for m in doc["models"]:
        for impl, r in m["results"].items():
            assert r["mean_last10"] < r["first_loss"] - 0.5, f"{m['name']}/{impl}: {r['losses']}"
            # Same weights, same batches: the curves agree (bf16 noise only)
            assert r["parity_ok"] and r["loss_diff_last10"] < bench_e2e.PARITY_TOL, f"{m['name']}/{impl}"
            assert r["losses"][0] == pytest.approx(m["results"]["grouped_mm"]["losses"][0], rel=1e-3)


def test_smoke_png_and_table_last(smoke):
    run, doc, out = smoke
    png = out / "e2e.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    rows = [line.split() for line in lines[-len(MODELS) * len(IMPLS):]]
    assert [(r[0], r[1]) for r in rows] == [(m, i) for m in MODELS for i in IMPLS], run.stdout
    assert all(r[-1] == "ok" for r in rows), run.stdout
    assert lines[-len(rows) - 2].split()[:3] == ["model", "impl", "tokens/s"], run.stdout


def test_default_models_are_the_stated_shapes():
    # What the GPU run builds (on the meta device here: no memory, no init)
    args = bench_e2e.parse_args(["--device", "cuda"])
    assert args.impl_list == ["grouped_mm", "mok"] and args.model_list == MODELS
    assert (args.steps, args.batch, args.seq, args.vocab) == (150, 2, 4096, 32000)
    specs = bench_e2e.model_specs(args)
    qwen3 = bench_e2e.build_model(specs["qwen3"], "grouped_mm", torch.device("meta"))
    assert bench_e2e.param_counts(qwen3) == {"total": 7_608_521_728, "experts": 7_247_757_312,
                                             "moe_blocks": 7_250_903_040, "moe_blocks_count": 12}
    attn, experts = qwen3.model.layers[0].self_attn, qwen3.model.layers[0].mlp.experts
    assert (attn.q_proj.out_features, attn.k_proj.out_features, attn.head_dim) == (32 * 128, 4 * 128, 128)
    assert tuple(experts.gate_up_proj.shape) == (128, 2 * 768, 2048) and qwen3.config.num_experts_per_tok == 8
    del qwen3
    dsv3 = bench_e2e.build_model(specs["dsv3"], "grouped_mm", torch.device("meta"))
    counts = bench_e2e.param_counts(dsv3)
    assert counts["moe_blocks_count"] == 4 == dsv3.config.num_hidden_layers  # first_k_dense_replace = 0
    mlp = dsv3.model.layers[0].mlp
    assert tuple(mlp.experts.gate_up_proj.shape) == (16, 2 * 2048, 7168) and dsv3.config.num_experts_per_tok == 8
    assert mlp.shared_experts.gate_proj.out_features == 2048
    assert (dsv3.config.n_group, dsv3.config.topk_group) == (1, 1)
    assert counts["total"] == 4_202_437_632


@pytest.mark.skipif(not HAS_MOK_HF, reason="mok.integrations.hf is not in this tree")
def test_a_mok_fallback_fails_the_run(monkeypatch):
    from mok.integrations import hf
    args = bench_e2e.parse_args(["--smoke", "--device", "cpu"])
    spec = bench_e2e.model_specs(args)["qwen3"]
    ids = torch.randint(0, args.vocab, (1, 16), generator=torch.Generator().manual_seed(0))
    # bf16: every experts module runs mok
    model = bench_e2e.build_model(spec, "mok", torch.device("cpu"))
    with bench_e2e.no_fallback("mok", hf):
        model(input_ids=ids, labels=ids).loss.backward()
    bench_e2e.check_mok_ran("mok", model)
    # float32 weights: mok.integrations.hf runs grouped_mm instead; its warning is an error ...
    import mok.integrations
    monkeypatch.setattr(mok.integrations, "_warned", set())
    model = bench_e2e.build_model(spec, "mok", torch.device("cpu")).float()
    with pytest.raises(hf.MokFallbackWarning):
        with bench_e2e.no_fallback("mok", hf):
            model(input_ids=ids)
    # ... and without the warning (it fires once per process), the cached decisions say it
    model = bench_e2e.build_model(spec, "mok", torch.device("cpu")).float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(input_ids=ids)
    with pytest.raises(RuntimeError, match="mok fell back to grouped_mm: .*bfloat16"):
        bench_e2e.check_mok_ran("mok", model)
    # A model whose experts never reached mok's function
    model = bench_e2e.build_model(spec, "grouped_mm", torch.device("cpu"))
    model(input_ids=ids)
    with pytest.raises(RuntimeError, match="never reached mok"):
        bench_e2e.check_mok_ran("mok", model)
