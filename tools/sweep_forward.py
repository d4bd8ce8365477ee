"""Sweep of the fused forward's knobs on one shape (median ms of CUDA-event timings, same
inputs): minibatch_size x macrobatch_size (EP = 1: no comm blocks), plus the unfused launches
(MOK_FORWARD_PATH=unfused) for reference.   python3 tools/sweep_forward.py [shape]"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "python")]
from bench.harness import median_ms  # noqa: E402
from bench.shapes import SHAPES as BENCH_SHAPES  # noqa: E402
from mok import functional as F  # noqa: E402

# The docs/benchmarks.md shapes by name (bench/shapes.py): (H, I, k, E_l, T)
SHAPES = {name: s.layer for name, s in BENCH_SHAPES.items()}




def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "dsv3"
    H, I, k, E, T = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    tw, ids = torch.randn(T, E, device="cuda", generator=g).softmax(-1).topk(k, dim=-1)
    ids = ids.int()
    w = [(torch.randn(E, I, H, device="cuda", generator=g) / H ** 0.5).bfloat16(),
         (torch.randn(E, I, H, device="cuda", generator=g) / H ** 0.5).bfloat16(),
         (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16()]
    ref = None
    print(f"{name}: fused forward, median ms")
    # minibatch == macrobatch walks each ring fill as a gate/up phase then a down phase
    # (the L2 behaviour of the unfused launches, with the gather of the next fill overlapped)
    for mini, macro in ((512, 16384), (1024, 16384), (2048, 16384), (1024, 4096), (1024, 65536),
                        (4096, 4096), (16384, 16384), (65536, 65536)):
        cfg = F.MoKConfig(minibatch_size=mini, macrobatch_size=macro)
        ws = F.create_workspace(H, I, E, k, max_tokens=T, device="cuda", config=cfg)
        ms = median_ms(lambda: F.forward(x, ids, tw, *w, workspace=ws))
        y, _ = F.forward(x, ids, tw, *w, workspace=ws)
        ref = y if ref is None else ref
        print(f"minibatch {mini:5d} macrobatch {macro:6d}: {ms:7.3f} ms  "
              f"{'same bits' if torch.equal(y, ref) else 'DIFFERENT BITS'}")
        del ws
    os.environ["MOK_FORWARD_PATH"] = "unfused"
    ws = F.create_workspace(H, I, E, k, max_tokens=T, device="cuda")
    ms = median_ms(lambda: F.forward(x, ids, tw, *w, workspace=ws))
    y, _ = F.forward(x, ids, tw, *w, workspace=ws)
    print(f"unfused launches: {ms:7.3f} ms  {'same bits' if torch.equal(y, ref) else 'DIFFERENT BITS'}")


if __name__ == "__main__":
    main()
