"""One training forward and --calls backward calls (default 2) of the fused kernels on a
BENCH.md shape, for a profiler to attach (ncu -k regex:fused_backward --launch-skip 1
--launch-count 1 ...); --ring-all: the ring for every routed row (MACROBATCH_ALL_ROWS).

    python3 tools/dev/profile_fused_bwd.py [shape] [--ring-all] [--calls N]"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from mok import functional as F  # noqa: E402
from sustained import SHAPES  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("shape", nargs="?", default="dsv3")
ap.add_argument("--ring-all", action="store_true")
ap.add_argument("--calls", type=int, default=2)
args = ap.parse_args()
H, I, k, E, T = SHAPES[args.shape][:5]
g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
tw, ids = torch.randn(T, E, device="cuda", generator=g).softmax(-1).topk(k, dim=-1)
w = [(torch.randn(E, I, H, device="cuda", generator=g) / H ** 0.5).bfloat16(),
     (torch.randn(E, I, H, device="cuda", generator=g) / H ** 0.5).bfloat16(),
     (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16()]
dy = (torch.randn(T, H, device="cuda", generator=g) * 0.1).bfloat16()
cfg = F.MoKConfig(macrobatch_size=F.MACROBATCH_ALL_ROWS if args.ring_all else 0)
ws = F.create_workspace(H, I, E, k, max_tokens=T, device="cuda", config=cfg)
_, ctx = F.forward(x, ids.int(), tw, *w, workspace=ws)
for _ in range(args.calls):
    F.backward(ctx, dy)
torch.cuda.synchronize()
print("done")
