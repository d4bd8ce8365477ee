"""The layer benchmark's picture: mok against the best torch baseline of each shape.

Works on the JSON document bench_layer.py writes (the harness records under "results", the
per-case summaries under "cases"); needs no GPU, no torch and no mok, only matplotlib for the PNG.

  python3 bench/plot.py out/bench/bench_layer.json [out.png]   # redraw a run's picture
"""
from __future__ import annotations

import json
import math
import os
import sys
import textwrap
from typing import Any, Dict, List, Optional, Sequence

# Directions of the layer benchmark: the harness panel and how the picture names it
DIRECTIONS = (("fwd", "forward"), ("fwd+bwd", "forward+backward"))
TORCH_PREFIX = "torch ep1 {direction} "  # + variant: the torch EP=1 pipeline's records
MOK_NAME = "mok {direction}"


def _find(results: Sequence[Dict[str, Any]], name: str, group: str) -> Optional[Dict[str, Any]]:
    """The first record of (name, group), whatever its status."""
    return next((r for r in results if r.get("name") == name and r.get("group") == group), None)


def _timed(record: Optional[Dict[str, Any]]) -> bool:
    return record is not None and record.get("status") == "ok" and record.get("ms") is not None


def best_baseline(results: Sequence[Dict[str, Any]], group: str, direction: str) -> Optional[Dict[str, Any]]:
    """The fastest torch EP=1 variant of one case and direction ('fwd' or 'fwd+bwd') against mok.

    Among the variants timed in this run (records named "torch ep1 <direction> <variant>",
    status ok) whose correctness check passed, the lowest median; mok's median of the same case
    and direction; speedup_mok = baseline ms / mok ms (> 1: mok faster). None when neither torch
    nor mok was timed in this direction (e.g. forward+backward under --fwd-only)."""
    prefix = TORCH_PREFIX.format(direction=direction)
    variants_ms: Dict[str, float] = {}
    failed_check: List[str] = []
    for r in results:
        name = r.get("name", "")
        if r.get("group") != group or r.get("panel") != direction or not name.startswith(prefix) or not _timed(r):
            continue
        variant = name[len(prefix):]
        if (r.get("check") or {}).get("ok", True):
            variants_ms[variant] = r["ms"]
        else:
            failed_check.append(variant)
    mok = _find(results, MOK_NAME.format(direction=direction), group)
    if not variants_ms and not _timed(mok):
        return None
    entry: Dict[str, Any] = {"name": None, "variant": None, "ms": None, "p10": None, "p90": None}
    if variants_ms:
        variant = min(variants_ms, key=variants_ms.get)
        rec = _find(results, prefix + variant, group)
        entry.update(name=rec["name"], variant=variant, ms=rec["ms"], p10=rec.get("p10"), p90=rec.get("p90"))
    entry["variants_ms"] = variants_ms
    if failed_check:
        entry["variants_failed_check"] = failed_check
    if _timed(mok):
        entry.update(mok_ms=mok["ms"], mok_p10=mok.get("p10"), mok_p90=mok.get("p90"),
                     mok_check_ok=(mok.get("check") or {}).get("ok", True))
    else:
        # Why not: mok's own record, or (none: forward+backward is not run) the forward's
        mok_fwd = _find(results, MOK_NAME.format(direction="fwd"), group) if mok is None else None
        why = mok if mok is not None else mok_fwd if mok_fwd is not None and not _timed(mok_fwd) else None
        entry.update(mok_ms=None, mok_p10=None, mok_p90=None,
                     mok_status=_short_status(why) if why is not None else "not run")
    entry["speedup_mok"] = entry["ms"] / entry["mok_ms"] if entry["ms"] is not None and entry["mok_ms"] else None
    return entry


def best_baselines(results: Sequence[Dict[str, Any]], group: str) -> Dict[str, Optional[Dict[str, Any]]]:
    """best_baseline of both directions: {"fwd": …, "fwd+bwd": …} (a case's "best_baseline")."""
    return {d: best_baseline(results, group, d) for d, _ in DIRECTIONS}


def _short_status(record: Dict[str, Any]) -> str:
    """'not available' (mok not importable or --no-mok), 'not built', 'skipped', 'error'."""
    return str(record.get("status", "not run"))


# ---------------------------------------------------------------------------------------
# The picture


def _split_group(group: str):
    """'dsv3/zipf+shared' -> ('dsv3', 'zipf', True)."""
    shape, _, routing = group.partition("/")
    shared = routing.endswith("+shared")
    return shape, routing[:-len("+shared")] if shared else routing, shared


def _fmt_ms(ms: float) -> str:
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def _subtitle(doc: Dict[str, Any]) -> str:
    parts = [str(doc.get("device", "?"))]
    if doc.get("torch"):
        parts.append(f"torch {doc['torch']}")
    if doc.get("grouped_mm"):
        parts.append(f"grouped GEMM: {doc['grouped_mm']}")
    if doc.get("reps"):
        parts.append(f"median of {doc['reps']} timed calls ({'CUDA-graph replays' if doc.get('graphs') else 'eager'})"
                     ", whiskers p10–p90")
    if doc.get("time"):
        parts.append(str(doc["time"]))
    return " · ".join(parts)


def plot_layer(doc: Dict[str, Any], path: str, dpi: int = 110) -> Optional[str]:
    """Draw bench_layer.json's picture into `path` (PNG). One panel per shape × routing with two
    groups, forward and forward+backward (a direction not measured is left out), each with the
    best torch baseline of that case (its variant under the bar) and mok, mok's speed-up over it
    above mok's bar; median ms on the y axis. The best baselines come from the cases'
    "best_baseline" entries (recomputed from "results" where a case lacks them). Returns None when
    written, else the reason it was not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
        from matplotlib.transforms import blended_transform_factory
    except ImportError:
        return "matplotlib is not installed; no PNG written"
    results = doc.get("results", [])
    cases = []
    for case in doc.get("cases", []):
        best = case.get("best_baseline") or best_baselines(results, case["group"])
        if any(best.get(d) for d, _ in DIRECTIONS):
            cases.append((case["group"], best))
    if not cases:
        return "no torch or mok layer figures to plot"

    # Grid: shapes in rows, a shape's routings side by side (two shapes a row when there are two routings)
    shapes = list(dict.fromkeys(_split_group(g)[0] for g, _ in cases))
    routings = list(dict.fromkeys(_split_group(g)[1] for g, _ in cases))
    per_row = max(1, 4 // len(routings)) if len(shapes) > 1 else 1
    ncols = min(per_row, len(shapes)) * len(routings)
    nrows = math.ceil(len(shapes) / per_row)
    # Header: title, what the ratio is, the run; wrapped to the figure's width
    entries = [e for _, b in cases for e in b.values() if e]
    title = "MoE layer on one GPU: mok vs the fastest torch EP=1 baseline of each shape"
    if not any(e.get("mok_ms") is not None for e in entries):
        status = str((doc.get("mok") or {}).get("status")
                     or ", ".join(sorted({e.get("mok_status", "not run") for e in entries})))
        title += f" (mok: {status if len(status) <= 60 else status[:57] + '...'})"
    explain = ("speed-up above mok's bar = best baseline ms / mok ms (> 1: mok faster); the baseline is the fastest "
               "correct torch variant of that shape in this run, named under its bar")
    width = max(9.0, 4.6 * ncols)
    title_lines = textwrap.wrap(title, int(width * 72 / (13 * 0.62)))
    sub_width = int(width * 72 / (8.5 * 0.55))
    sub_lines = [line for part in (explain, _subtitle(doc)) for line in textwrap.wrap(part, sub_width)]
    head = 0.15 + 0.26 * len(title_lines) + 0.08 + 0.16 * len(sub_lines) + 0.3
    height = 3.5 * nrows + head + 0.45
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    dims = {s.get("name"): s for s in doc.get("shapes", [])}
    base_color, mok_color = "#a6a6a6", "#1f6fb4"

    for group, best in cases:
        shape, routing, shared = _split_group(group)
        si, ri = shapes.index(shape), routings.index(routing)
        ax = axes[si // per_row][(si % per_row) * len(routings) + ri]
        ax.set_visible(True)
        trans = blended_transform_factory(ax.transData, ax.transAxes)
        shown = [(d, label, best[d]) for d, label in DIRECTIONS if best.get(d)]
        # Bars: (x, ms, p10, p90, colour, tick label) per direction, best baseline then mok
        bars = []
        for gi, (d, label, e) in enumerate(shown):
            x0 = gi * 2.6
            bars.append((x0, e.get("ms"), e.get("p10"), e.get("p90"), base_color,
                         f"torch\n{e['variant']}" if e.get("variant") else "torch\n(no correct one)"))
            bars.append((x0 + 1, e.get("mok_ms"), e.get("mok_p10"), e.get("mok_p90"), mok_color, "mok"))
            ax.text(x0 + 0.5, -0.25, label, transform=trans, ha="center", va="top", fontsize=9)
        top = max([(p90 if p90 is not None else ms) for _, ms, _, p90, _, _ in bars if ms is not None] or [1.0])
        ax.set_ylim(0, top * 1.25)
        bar_tops = {}
        for x, ms, p10, p90, color, tick in bars:
            if ms is None:
                continue
            lo, hi = max(0.0, ms - (p10 if p10 is not None else ms)), max(0.0, (p90 if p90 is not None else ms) - ms)
            ax.bar(x, ms, 0.8, color=color, yerr=[[lo], [hi]], capsize=3,
                   error_kw={"elinewidth": 0.8, "ecolor": "#444444"})
            if ms > 0.12 * top:  # the median inside the bar, or above it where the bar is short
                ax.text(x, ms / 2, _fmt_ms(ms), ha="center", va="center", fontsize=7.5,
                        color="white" if color == mok_color else "black")
                bar_tops[x] = (ms + hi, 3)
            else:
                ax.annotate(_fmt_ms(ms), (x, ms + hi), xytext=(0, 2), textcoords="offset points", ha="center",
                            va="bottom", fontsize=7.5)
                bar_tops[x] = (ms + hi, 12)
        for gi, (d, label, e) in enumerate(shown):
            x = gi * 2.6 + 1
            # Speed-up above mok's bar, or why there is no mok bar
            if e.get("mok_ms") is not None and e.get("speedup_mok") is not None:
                s, ok = e["speedup_mok"], e.get("mok_check_ok", True)
                y, dy = bar_tops[x]
                ax.annotate(f"{s:.2f}×", (x, y), xytext=(0, dy), textcoords="offset points", ha="center",
                            va="bottom", fontsize=10, fontweight="bold",
                            color="#1a7f37" if s >= 1 and ok else "#c0392b")
                if not ok:
                    ax.annotate("check failed", (x, y), xytext=(0, dy + 13), textcoords="offset points",
                                ha="center", va="bottom", fontsize=7, color="#c0392b")
            elif e.get("mok_ms") is None:
                ax.text(x, 0.04, f"mok\n{e.get('mok_status', 'not run')}", transform=trans, ha="center",
                        va="bottom", fontsize=7.5, color="#666666", style="italic")
        ax.set_xticks([b[0] for b in bars])
        ax.set_xticklabels([b[5] for b in bars], fontsize=7.5)
        ax.tick_params(axis="x", length=0)
        ax.set_xlim(-0.7, (len(shown) - 1) * 2.6 + 1.7)
        ax.set_ylabel("ms (median)", fontsize=8)
        ax.tick_params(axis="y", labelsize=7.5)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        dim = dims.get(shape)
        sub = (f"\nT={dim['T']} H={dim['H']} I={dim['I']} k={dim['k']} E={dim['E_l']}"
               + (f" I_s={dim['I_s']}" if dim.get("I_s") else "")) if dim else ""
        ax.set_title(f"{shape} · {routing}" + (" + shared expert" if shared else "") + sub, fontsize=9.5)

    fig.text(0.5, 1 - 0.12 / height, "\n".join(title_lines), ha="center", va="top", fontsize=13,
             fontweight="bold")
    fig.text(0.5, 1 - (0.12 + 0.26 * len(title_lines) + 0.08) / height, "\n".join(sub_lines), ha="center",
             va="top", fontsize=8.5, color="#333333")
    fig.legend(handles=[Patch(color=base_color, label="best torch EP=1 baseline (fastest variant)"),
                        Patch(color=mok_color, label="mok")],
               loc="lower center", ncol=2, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.4 / height, 1, 1 - head / height), h_pad=1.6)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or len(argv) > 2:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    with open(argv[0]) as f:
        doc = json.load(f)
    png = argv[1] if len(argv) > 1 else os.path.splitext(argv[0])[0] + ".png"
    why_not = plot_layer(doc, png)
    print(f"wrote {png}" if why_not is None else f"no chart: {why_not}")
    return 0 if why_not is None else 1


if __name__ == "__main__":
    sys.exit(main())
