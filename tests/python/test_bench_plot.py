"""bench_layer.py's picture and its "best_baseline" entries (bench/plot.py), on synthetic results in
the structure bench_layer.py writes (no GPU), and once end to end through bench_layer.py on the CPU."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import plot as lp  # noqa: E402

pytest.importorskip("matplotlib")

VARIANTS = ("fused/gather", "split/gather", "fused/index_add", "split/index_add")
SHAPES = [{"name": "dsv3", "H": 7168, "I": 2048, "k": 8, "E_l": 16, "T": 4096, "I_s": 0},
          {"name": "qwen3", "H": 4096, "I": 1536, "k": 8, "E_l": 32, "T": 4096, "I_s": 0},
          {"name": "dsv4pro", "H": 7168, "I": 3072, "k": 6, "E_l": 12, "T": 4096, "I_s": 0}]


def timed(name, group, panel, ms, *, check=True, meta=None):
    """A harness record of a timed benchmark (Harness.run)."""
    r = {"name": name, "group": group, "panel": panel, "kind": "timed", "flops": 1e12, "bytes": 1e9,
         "graphs": False, "meta": dict(meta or {}), "sets": 4, "set_bytes": 1 << 26, "ms": ms, "p10": 0.97 * ms,
         "p90": 1.05 * ms, "min": 0.95 * ms, "mean": ms, "reps": 20, "times_ms": [ms] * 20, "tflops": 1e12 / (ms * 1e9),
         "gbps": 1e9 / (ms * 1e6), "frac_tflops": 0.5, "frac_gbps": 0.2, "status": "ok"}
    if check is not None:
        r["check"] = {"ok": check, "rel_fro": 4e-3 if check else 0.3, "tokens": 8, "rtol": 1e-2,
                      "y": {"max_abs": 0.01, "rel_fro": 4e-3}}
    return r


def model(name, group, panel, ms):
    return {"name": name, "group": group, "panel": panel, "kind": "model", "status": "ok", "ms": ms, "p10": None,
            "p90": None, "flops": 1e12, "bytes": 0.0, "note": "at 800 TFLOP/s", "tflops": 800.0, "gbps": None,
            "frac_tflops": 1.0, "frac_gbps": None}


def skip(name, group, panel, reason, status="skipped"):
    return {"name": name, "group": group, "panel": panel, "kind": "timed", "status": status, "error": reason}


def synthetic_doc(*, fwd_only=False, mok="ok", failing_fast_variant=False):
    """The JSON bench_layer.py writes, with made-up times: per case the four torch variants (fwd,
    and fwd+bwd unless fwd_only), torch's bwd alone, experts-only, floors and mok."""
    results = [timed("dense mm 8192^3 bfloat16", "ceiling", "ceiling", 1.4, check=None),
               timed("copy 1024 MiB", "ceiling", "ceiling", 0.5, check=None)]
    groups, expected = [], {}
    for si, shape in enumerate(SHAPES):
        for ri, routing in enumerate(("uniform", "zipf")):
            group = f"{shape['name']}/{routing}"
            groups.append(group)
            base = 2.0 + si + 0.5 * ri
            for d, scale in (("fwd", 1.0), ("fwd+bwd", 3.0)):
                if d == "fwd+bwd" and fwd_only:
                    continue
                # A different fastest variant per case; mok slower than torch on one case
                times = {v: scale * (base + 0.1 * ((i - si - ri) % 4)) for i, v in enumerate(VARIANTS)}
                for v in VARIANTS:
                    results.append(timed(f"torch ep1 {d} {v}", group, d, times[v], meta={"variant": v}))
                if failing_fast_variant and group == "qwen3/zipf":
                    # Fastest of all but its check failed: not the baseline
                    results[-1]["ms"] = 0.5 * min(times.values())
                    results[-1]["check"]["ok"] = False
                    times.pop(VARIANTS[-1])
                best = min(times, key=times.get)
                mok_ms = scale * base * (1.2 if group == "dsv4pro/zipf" else 0.7 - 0.05 * si)
                expected[group, d] = (best, times[best], mok_ms)
                if d == "fwd+bwd":
                    results.append(timed(f"torch ep1 bwd {best}", group, "bwd", 2.0 * base))
            results.append(timed("experts only (grouped GEMMs)", group, "fwd", 0.4 * base, check=None))
            results.append(timed("experts only + SwiGLU", group, "fwd", 0.45 * base, check=None))
            results.append(model("dense-rate floor fwd", group, "fwd", 0.3 * base))
            if not fwd_only:
                results.append(timed("experts only bwd (grouped GEMMs)", group, "bwd", 0.8 * base, check=None))
                results.append(model("dense-rate floor fwd+bwd", group, "fwd+bwd", 0.9 * base))
                results.append(model("dense-rate floor bwd", group, "bwd", 0.6 * base))
            if mok == "ok":
                for d in ("fwd",) + (() if fwd_only else ("fwd+bwd",)):
                    results.append(timed(f"mok {d}", group, d, expected[group, d][2]))
                if not fwd_only:
                    results.append(timed("mok bwd", group, "bwd", 1.5 * base))
            else:
                results.append(skip("mok fwd", group, "fwd", "not built: libmok.so without CUDA", "not available"))
    cases = []
    for group in groups:
        best = {d: (expected[group, d][0] if (group, d) in expected else None) for d in ("fwd", "fwd+bwd")}
        cases.append({"group": group, "load": {"min": 900.0, "max": 3100.0, "imbalance": 1.5},
                      "torch_best_variant": best, "ratios": {"torch_fwd_ms": expected[group, "fwd"][1]},
                      "best_baseline": lp.best_baselines(results, group)})  # as bench_layer.bench_case does
    mok_status = "ok" if mok == "ok" else "not built"
    doc = {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "l2_bytes": 62914560, "reps": 20, "warmup": 5,
           "graphs": False, "ceiling_tflops": 785.0, "ceiling_gbps": 4200.0,
           "command": "bench_layer.py --shapes dsv3,qwen3,dsv4pro --routing uniform,zipf --out out/bench",
           "time": "2026-01-01 12:00:00", "ceilings": {"tflops_measured": 785.0, "gbps_measured": 4200.0},
           "deep_ep": False, "grouped_mm": "torch._grouped_mm", "shapes": SHAPES,
           "mok": {"status": mok_status, "fwd": mok_status, "fwd+bwd": "not run" if fwd_only else mok_status},
           "cases": cases, "results": results}
    return json.loads(json.dumps(doc)), expected  # through JSON, as the plot reads it


def assert_png(path):
    assert path.is_file() and path.stat().st_size > 10_000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("fwd_only", [False, True])
def test_best_baseline_and_plot(tmp_path, fwd_only):
    doc, expected = synthetic_doc(fwd_only=fwd_only, failing_fast_variant=True)
    for case in doc["cases"]:
        group, best = case["group"], case["best_baseline"]
        assert set(best) == {"fwd", "fwd+bwd"}
        for d in ("fwd", "fwd+bwd"):
            if fwd_only and d == "fwd+bwd":
                assert best[d] is None
                continue
            variant, ms, mok_ms = expected[group, d]
            e = best[d]
            # The minimum over the correct torch variants of this case and direction
            candidates = {r["name"]: r["ms"] for r in doc["results"] if r["group"] == group and r["panel"] == d
                          and r["name"].startswith(f"torch ep1 {d} ") and r["check"]["ok"]}
            assert len(candidates) == (3 if group == "qwen3/zipf" else 4)
            assert e["ms"] == min(candidates.values()) == ms
            assert e["name"] == f"torch ep1 {d} {variant}" and e["variant"] == variant
            assert e["variants_ms"] == {n.split(" ")[-1]: t for n, t in candidates.items()}
            assert e["mok_ms"] == mok_ms and e["mok_check_ok"] is True
            assert e["speedup_mok"] == pytest.approx(ms / mok_ms)
            if group == "qwen3/zipf":
                assert e["variants_failed_check"] == ["split/index_add"]
    assert doc["cases"][-1]["best_baseline"]["fwd"]["speedup_mok"] < 1  # dsv4pro/zipf: mok slower
    png = tmp_path / "bench_layer.png"
    assert lp.plot_layer(doc, str(png), dpi=60) is None
    assert_png(png)


def test_plot_without_mok_and_from_results(tmp_path):
    # mok not built: baselines alone; and a JSON whose cases lack best_baseline is recomputed
    doc, expected = synthetic_doc(mok="not built")
    e = doc["cases"][0]["best_baseline"]["fwd"]
    assert e["mok_ms"] is None and e["speedup_mok"] is None and e["mok_status"] == "not available"
    assert e["ms"] == expected["dsv3/uniform", "fwd"][1]
    assert doc["cases"][0]["best_baseline"]["fwd+bwd"]["mok_status"] == "not available"  # the forward's
    for case in doc["cases"]:
        del case["best_baseline"]
    png = tmp_path / "no_mok.png"
    assert lp.plot_layer(doc, str(png), dpi=60) is None
    assert_png(png)
    # Redrawn from a JSON file by the command line
    path = tmp_path / "bench_layer.json"
    path.write_text(json.dumps(synthetic_doc()[0]))
    assert lp.main([str(path)]) == 0
    assert_png(tmp_path / "bench_layer.png")
    assert lp.plot_layer({"cases": [], "results": []}, str(tmp_path / "empty.png")) is not None


def test_bench_layer_cpu_writes_best_baseline_and_picture(tmp_path):
    # End to end on the CPU (tiny shape, few reps, given ceilings): the JSON's best_baseline is the
    # fastest correct torch variant, its speed-up the table's; the picture is written
    torch = pytest.importorskip("torch")
    from bench import bench_layer

    threads = torch.get_num_threads()
    try:
        rc = bench_layer.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--reps", "2", "--warmup", "0",
                               "--ceiling-tflops", "1", "--ceiling-gbps", "10", "--check-tokens", "4"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    doc = json.loads((tmp_path / "bench_layer.json").read_text())
    assert [c["group"] for c in doc["cases"]] == ["tiny/uniform", "tiny/zipf"]
    for case in doc["cases"]:
        for d, key in (("fwd", "speedup_mok_fwd_vs_torch"), ("fwd+bwd", "speedup_mok_fwdbwd_vs_torch")):
            e = case["best_baseline"][d]
            timed_ms = {r["name"]: r["ms"] for r in doc["results"] if r["group"] == case["group"]
                        and r["name"].startswith(f"torch ep1 {d} ") and r["status"] == "ok" and r["check"]["ok"]}
            assert len(timed_ms) == 4 and e["ms"] == min(timed_ms.values())
            assert e["variant"] == case["torch_best_variant"][d]
            if e["mok_ms"] is not None:
                assert e["speedup_mok"] == pytest.approx(e["ms"] / e["mok_ms"])
                assert e["speedup_mok"] == pytest.approx(case["ratios"][key])
    assert_png(tmp_path / "bench_layer.png")
