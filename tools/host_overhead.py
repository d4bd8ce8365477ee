"""Where a mok forward's wall time goes outside its kernels (EP=1, one GPU).

    python3 tools/host_overhead.py [shape]

Prints, for the same inputs: the host time of one call (no synchronisation), the
per-call CUDA-event time (as bench/ times it), the time per call of 20 calls issued back to
back, and the time of a CUDA-graph replay. When the first exceeds the GPU time, the
per-call figure measures the host, not the GPU."""
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "python")]
from bench.shapes import SHAPES as BENCH_SHAPES  # noqa: E402
from mok import functional as F  # noqa: E402

# The docs/benchmarks.md shapes by name (bench/shapes.py): (H, I, k, E_l, T)
SHAPES = {name: s.layer for name, s in BENCH_SHAPES.items()}


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "dsv3"
    H, I, k, E, T = SHAPES[name]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=g).bfloat16()
    ids = torch.rand(T, E, device=dev, generator=g).topk(k, dim=1).indices.int()
    w = torch.rand(T, k, device=dev, generator=g)
    wg = (torch.randn(E, I, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    wu = (torch.randn(E, I, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    wd = (torch.randn(E, H, I, device=dev, generator=g) / I ** 0.5).bfloat16()

    def call():
        return F.forward(x, ids, w, wg, wu, wd)[0]

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    # Host time per call (the GPU runs behind)
    t0 = time.perf_counter()
    for _ in range(20):
        call()
    host_ms = (time.perf_counter() - t0) / 20 * 1e3
    torch.cuda.synchronize()
    # Per-call events
    per = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        call()
        e.record()
        per.append((s, e))
    torch.cuda.synchronize()
    per_ms = sorted(s.elapsed_time(e) for s, e in per)[10]
    # Back to back
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        call()
    e.record()
    torch.cuda.synchronize()
    b2b_ms = s.elapsed_time(e) / 20
    # Graph replay
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    graph_ms = sorted(s.elapsed_time(e) for s, e in times)[10]
    print(f"{name}: host per call {host_ms:.3f} ms | events per call (median) {per_ms:.3f} ms | "
          f"back-to-back {b2b_ms:.3f} ms/call | graph replay {graph_ms:.3f} ms")


if __name__ == "__main__":
    main()
