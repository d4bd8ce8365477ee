"""One benchmark harness for every mok benchmark.

A benchmark registers a name, a FLOP and byte model (per call), an input-set factory and a run
function (and optionally a correctness callback). The harness rotates input sets so the L2 does
not hold them, warms up, times each call with CUDA events (optionally as CUDA-graph replays),
takes the median of the runs, checks the output of the last timed call on its own inputs, and
reports ms (median, p10, p90), effective TFLOP/s, GB/s and the fraction of the ceilings.
Results go to stdout (one row per benchmark), a JSON file and a PNG chart.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

# H200 L2 is about 60 MB; used when the device does not report it.
DEFAULT_L2_BYTES = 60 << 20


@dataclasses.dataclass
class Benchmark:
    """What a benchmark registers. `setup(i)` makes independent input set i; `run(inputs)` is
    the timed call and returns its output; `check(inputs, output)` returns a dict with "ok"."""

    name: str
    setup: Callable[[int], Any]
    run: Callable[[Any], Any]
    flops: float = 0.0
    bytes: float = 0.0
    check: Optional[Callable[[Any, Any], Dict[str, Any]]] = None
    group: str = ""
    panel: str = ""
    meta: Dict[str, Any] = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# FLOP and byte models of one MoE layer (docs/benchmarks.md)


def moe_flops(T: int, k: int, H: int, I: int, I_s: int = 0, *, direction: str = "fwd",
              recompute: bool = False, routed_rows: Optional[int] = None) -> float:
    """FLOPs of a layer call. Forward 6·rows·H·I routed (rows = T·k unless given) + 6·T·H·I_s
    shared; backward twice the forward, plus the gate/up GEMMs (4·rows·H·I + 4·T·H·I_s) when
    they are recomputed. direction: 'fwd', 'bwd' or 'fwdbwd'."""
    rows = T * k if routed_rows is None else routed_rows
    fwd = 6.0 * rows * H * I + 6.0 * T * H * I_s
    bwd = 2.0 * fwd + (4.0 * rows * H * I + 4.0 * T * H * I_s if recompute else 0.0)
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[direction]


def moe_bytes(T: int, k: int, H: int, I: int, E_l: int, I_s: int = 0, *, direction: str = "fwd",
              elem: int = 2) -> float:
    """Compulsory HBM bytes of a layer call: weights read once per pass, activations in and
    out once, routing read; intermediates excluded. Backward adds weight gradients written,
    x and dy read, dx and d topk_weights written."""
    weights = 3.0 * (E_l * I * H + I_s * H) * elem
    routing = T * k * 8.0
    fwd = weights + 2.0 * T * H * elem + routing
    bwd = 2.0 * weights + 3.0 * T * H * elem + routing + T * k * 4.0
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[direction]


# ---------------------------------------------------------------------------------------
# Helpers


def tensor_bytes(obj: Any, seen: Optional[set] = None) -> int:
    """Bytes of the distinct tensor storages reachable from obj (dicts, sequences, dataclasses)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = (obj.device, obj.untyped_storage().data_ptr())
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(tensor_bytes(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    return 0


def median_ms(fn: Callable[[], Any], reps: int = 20, warmup: int = 3) -> float:
    """Median of `reps` CUDA-event timings of fn() after `warmup` untimed calls (for the
    small scripts that time one call on fixed inputs; benchmarks use Harness)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def percentile(values: List[float], q: float) -> float:
    """q-th percentile (0..100) by linear interpolation."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def l2_bytes(device: torch.device) -> int:
    """L2 size of a CUDA device (0 on the CPU)."""
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def device_name(device: torch.device) -> str:
    """A readable name of the device."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def bench_device(tool: str, device: str, small: bool, small_flag: str, why_big: str,
                 threads: int = 1) -> "tuple[Optional[torch.device], int]":
    """(device, 0) to run on, or (None, exit status): no visible GPU for a cuda run is nothing
    to measure (0, with a hint at the CPU smoke mode); a CPU run needs the small mode
    (`small_flag`; 2, saying `why_big`). On the CPU, `threads` threads (tiny shapes: more only
    add noise on a shared CPU); a cuda device is the current one."""
    if device == "cuda" and not torch.cuda.is_available():
        print(f"{tool}: no CUDA GPU visible; nothing to run. Use --device cpu {small_flag} for a smoke test of "
              "the code paths.")
        return None, 0
    if device == "cpu" and not small:
        print(f"{tool}: --device cpu runs only with {small_flag} ({why_big}).")
        return None, 2
    if device == "cpu":
        torch.set_num_threads(threads)
        return torch.device("cpu"), 0
    return torch.device("cuda", torch.cuda.current_device()), 0


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


# ---------------------------------------------------------------------------------------
# The harness


class Harness:
    """Runs registered benchmarks and collects their results.

    reps: timed calls (median over them); warmup: untimed calls first (at least one per set);
    graphs: capture each set's call in a CUDA graph and time replays; rotate_factor: input sets
    rotate until their bytes exceed rotate_factor × L2 (at least min_sets, at most max_sets)."""

    COLUMNS = ("group", "benchmark", "ms", "p10", "p90", "TFLOP/s", "GB/s", "%peak", "check")
    WIDTHS = (18, 34, 8, 8, 8, 8, 8, 6, 24)

    def __init__(self, device, *, reps: int = 20, warmup: int = 5, graphs: bool = False,
                 ceiling_tflops: Optional[float] = None, ceiling_gbps: Optional[float] = None,
                 rotate_factor: float = 3.0, min_sets: int = 2, max_sets: int = 16,
                 max_rotation_bytes: int = 8 << 30, verbose: bool = True) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.reps, self.warmup, self.graphs = max(1, reps), max(0, warmup), graphs
        self.ceiling_tflops, self.ceiling_gbps = ceiling_tflops, ceiling_gbps
        self.rotate_factor, self.min_sets, self.max_sets = rotate_factor, min_sets, max_sets
        self.max_rotation_bytes = max_rotation_bytes
        self.l2 = l2_bytes(self.device)
        self.verbose = verbose
        self.results: List[Dict[str, Any]] = []
        self._header_printed = False

    # -- timing -------------------------------------------------------------------------

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def num_sets(self, set_bytes: int) -> int:
        """Input sets to rotate over so that they do not stay in the L2."""
        if set_bytes <= 0:
            return 1
        n = max(self.min_sets, math.ceil(self.rotate_factor * self.l2 / set_bytes))
        n = min(n, self.max_sets, max(self.min_sets, self.max_rotation_bytes // set_bytes))
        return max(1, n)

    def _graph_callables(self, bench: Benchmark, sets: List[Any]):
        """One CUDA graph per input set (one memory pool); returns replay callables and outputs."""
        pool = torch.cuda.graph_pool_handle()
        calls, outs = [], []
        # Warm up on a side stream, as capture requires
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for inputs in sets:
                bench.run(inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._sync()
        # Capture each set's call
        for inputs in sets:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    out = bench.run(inputs)
            except Exception as exc:
                raise RuntimeError(f"CUDA graph capture failed ({type(exc).__name__}: {exc})") from exc
            calls.append(graph.replay)
            outs.append(out)
        self._sync()
        return calls, outs

    def _time(self, calls: List[Callable[[], Any]]):
        """Per-call milliseconds of `reps` calls rotating over `calls`; the last output and
        the index of its set."""
        n = len(calls)
        # Warm-up: at least one call per set
        for r in range(max(self.warmup, n)):
            calls[r % n]()
        self._sync()
        # Timed calls: CUDA events around each, one synchronisation at the end
        out = None
        if self.device.type == "cuda":
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
            for r in range(self.reps):
                starts[r].record()
                out = calls[r % n]()
                ends[r].record()
            ends[-1].synchronize()
            times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        else:
            times = []
            for r in range(self.reps):
                t0 = time.perf_counter()
                out = calls[r % n]()
                times.append((time.perf_counter() - t0) * 1e3)
        return times, out, (self.reps - 1) % n

    # -- running ------------------------------------------------------------------------

    def run(self, bench: Benchmark) -> Dict[str, Any]:
        """Time one benchmark and record its result (errors are recorded, not raised)."""
        record: Dict[str, Any] = {"name": bench.name, "group": bench.group, "panel": bench.panel,
                                  "kind": "timed", "flops": bench.flops, "bytes": bench.bytes,
                                  "graphs": self.graphs, "meta": dict(bench.meta)}
        sets: List[Any] = []
        try:
            # Input sets: enough to exceed the rotation target
            sets.append(bench.setup(0))
            set_bytes = tensor_bytes(sets[0])
            n = self.num_sets(set_bytes)
            sets.extend(bench.setup(i) for i in range(1, n))
            record.update(sets=n, set_bytes=set_bytes)
            # Calls to time: eager, or a CUDA graph per set
            if self.graphs:
                calls, graph_outs = self._graph_callables(bench, sets)
            else:
                calls = [(lambda inputs=inputs: bench.run(inputs)) for inputs in sets]
            times, out, last = self._time(calls)
            if self.graphs:
                out = graph_outs[last]
            record.update(self._stats(times, bench.flops, bench.bytes))
            record["status"] = "ok"
            # Correctness on the inputs of the last timed call
            if bench.check is not None:
                try:
                    record["check"] = bench.check(sets[last], out)
                except Exception as exc:  # a failing check is a result, not a crash
                    record["check"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        except NotImplementedError as exc:
            record.update(status="not built", error=str(exc).splitlines()[0] if str(exc) else "")
        except Exception as exc:
            record.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        finally:
            del sets
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return self._add(record)

    def _stats(self, times: List[float], flops: float, nbytes: float) -> Dict[str, Any]:
        ms = percentile(times, 50)
        out = {"ms": ms, "p10": percentile(times, 10), "p90": percentile(times, 90),
               "min": min(times), "mean": sum(times) / len(times), "reps": len(times), "times_ms": times}
        out.update(self._rates(ms, flops, nbytes))
        return out

    def _rates(self, ms: float, flops: float, nbytes: float) -> Dict[str, Any]:
        tflops = flops / (ms * 1e9) if flops and ms > 0 else None
        gbps = nbytes / (ms * 1e6) if nbytes and ms > 0 else None
        return {"tflops": tflops, "gbps": gbps,
                "frac_tflops": tflops / self.ceiling_tflops if tflops and self.ceiling_tflops else None,
                "frac_gbps": gbps / self.ceiling_gbps if gbps and self.ceiling_gbps else None}

    def model(self, name: str, ms: float, *, group: str = "", panel: str = "", flops: float = 0.0,
              nbytes: float = 0.0, note: str = "") -> Dict[str, Any]:
        """Record a modelled (not timed) figure, e.g. a dense-rate floor."""
        record = {"name": name, "group": group, "panel": panel, "kind": "model", "status": "ok",
                  "ms": ms, "p10": None, "p90": None, "flops": flops, "bytes": nbytes, "note": note}
        record.update(self._rates(ms, flops, nbytes))
        return self._add(record)

    def skip(self, name: str, reason: str, *, group: str = "", panel: str = "",
             status: str = "skipped") -> Dict[str, Any]:
        """Record a benchmark that did not run, with the reason."""
        return self._add({"name": name, "group": group, "panel": panel, "kind": "timed",
                          "status": status, "error": reason})

    def _add(self, record: Dict[str, Any]) -> Dict[str, Any]:
        self.results.append(record)
        if self.verbose:
            if not self._header_printed:
                print(self.header(), flush=True)
                self._header_printed = True
            print(self.row(record), flush=True)
        return record

    def find(self, name: str, group: str) -> Optional[Dict[str, Any]]:
        """The successful result of (name, group), if any."""
        for r in self.results:
            if r["name"] == name and r["group"] == group and r.get("status") == "ok":
                return r
        return None

    # -- reporting ----------------------------------------------------------------------

    def header(self) -> str:
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(self.COLUMNS, self.WIDTHS))]
        cells[-1] = self.COLUMNS[-1]
        line = "  ".join(cells)
        return line + "\n" + "-" * len(line)

    @staticmethod
    def check_text(record: Dict[str, Any]) -> str:
        """One-word verdict of a record's correctness check."""
        check = record.get("check")
        if not check:
            return ""
        if "error" in check:
            return "FAIL " + check["error"][:40]
        verdict = "ok" if check.get("ok") else "FAIL"
        if "rel_fro" in check:
            verdict += f" rel {check['rel_fro']:.1e}"
        return verdict

    def row(self, r: Dict[str, Any]) -> str:
        w = self.WIDTHS
        head = [str(r.get("group", ""))[:w[0]].ljust(w[0]), str(r["name"])[:w[1]].ljust(w[1])]
        if r.get("status") != "ok":
            return "  ".join(head) + f"  {r.get('status')}: {r.get('error', '')}"
        frac = r.get("frac_tflops") or r.get("frac_gbps")
        cells = [_fmt(r.get("ms"), ".3f"), _fmt(r.get("p10"), ".3f"), _fmt(r.get("p90"), ".3f"),
                 _fmt(r.get("tflops"), ".1f"), _fmt(r.get("gbps"), ".0f"),
                 _fmt(None if frac is None else 100 * frac, ".0f")]
        tail = self.check_text(r) if r.get("kind") == "timed" else f"({r.get('note', 'model')})"
        return "  ".join(head + [c.rjust(wi) for c, wi in zip(cells, w[2:8])] + [tail])

    def table(self) -> str:
        """All results as a text table."""
        return "\n".join([self.header()] + [self.row(r) for r in self.results])

    def failed_checks(self) -> List[Dict[str, Any]]:
        """Results whose correctness check failed."""
        return [r for r in self.results if r.get("check") and not r["check"].get("ok")]

    def write_json(self, path: str, extra: Optional[Dict[str, Any]] = None) -> None:
        """Write the results (and `extra` top-level fields) as JSON."""
        doc = {"device": device_name(self.device), "torch": torch.__version__,
               "l2_bytes": self.l2, "reps": self.reps, "warmup": self.warmup, "graphs": self.graphs,
               "ceiling_tflops": self.ceiling_tflops, "ceiling_gbps": self.ceiling_gbps}
        doc.update(extra or {})
        doc["results"] = self.results
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
            f.write("\n")

    def plot(self, path: str, title: str = "", panels: Optional[Sequence[str]] = None) -> Optional[str]:
        """Grouped bar chart of median ms (p10-p90 whiskers), one subplot per `panel` value (all,
        or those listed). Returns None when written, else the reason it was not."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return "matplotlib is not installed; no PNG written"
        ok = [r for r in self.results if r.get("status") == "ok" and r.get("ms") is not None
              and (panels is None or r["panel"] in panels)]
        panels = list(dict.fromkeys(r["panel"] for r in ok))
        if not panels:
            return "no results to plot"
        fig, axes = plt.subplots(len(panels), 1, figsize=(12, 4 * len(panels)), squeeze=False)
        for ax, panel in zip(axes[:, 0], panels):
            rows = [r for r in ok if r["panel"] == panel]
            groups = list(dict.fromkeys(r["group"] for r in rows))
            names = list(dict.fromkeys(r["name"] for r in rows))
            width = 0.8 / max(1, len(names))
            # One bar series per benchmark name, placed within each group
            for s, name in enumerate(names):
                xs, ys, lo, hi = [], [], [], []
                for g, group in enumerate(groups):
                    r = next((r for r in rows if r["group"] == group and r["name"] == name), None)
                    if r is None:
                        continue
                    xs.append(g - 0.4 + width * (s + 0.5))
                    ys.append(r["ms"])
                    lo.append(r["ms"] - (r["p10"] if r.get("p10") is not None else r["ms"]))
                    hi.append((r["p90"] if r.get("p90") is not None else r["ms"]) - r["ms"])
                hatch = "//" if any(r["kind"] == "model" for r in rows if r["name"] == name) else None
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=name, hatch=hatch)
            ax.set_xticks(range(len(groups)))
            ax.set_xticklabels(groups, rotation=20, ha="right")
            ax.set_ylabel("ms (median)")
            ax.set_title(f"{title} {panel}".strip())
            ax.legend(fontsize=7, ncol=2)
            ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return None


# ---------------------------------------------------------------------------------------
# Ceiling probes (run through the harness itself)


def _run_eager(harness: Harness, bench: Benchmark) -> Dict[str, Any]:
    # NOTES: ceilings are eager kernel launches; a copy captured in a graph becomes a memcpy
    # node (copy engine, ~2.7 TB/s on H200 instead of ~4.2)
    graphs, harness.graphs = harness.graphs, False
    try:
        return harness.run(bench)
    finally:
        harness.graphs = graphs


def matmul_ceiling(harness: Harness, n: int = 8192, dtype=torch.bfloat16) -> Dict[str, Any]:
    """Dense n³ matmul rate on the harness device (the TFLOP/s ceiling)."""
    device = harness.device
    b = torch.randn(n, n, device=device, dtype=dtype)

    def setup(i):
        return torch.randn(n, n, device=device, dtype=dtype)

    return _run_eager(harness, Benchmark(f"dense mm {n}^3 {str(dtype).split('.')[-1]}", setup,
                                         lambda a: torch.mm(a, b), flops=2.0 * n ** 3,
                                         bytes=3.0 * n * n * b.element_size(), group="ceiling", panel="ceiling"))


def copy_ceiling(harness: Harness, nbytes: int = 1 << 30) -> Dict[str, Any]:
    """Device copy bandwidth, read + write bytes (the GB/s ceiling)."""
    device = harness.device
    dst = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)

    def setup(i):
        return torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16).uniform_()

    return _run_eager(harness, Benchmark(f"copy {nbytes >> 20} MiB", setup, lambda src: dst.copy_(src),
                                         bytes=2.0 * nbytes, group="ceiling", panel="ceiling"))
