"""The fused backward (ring for every row) on a shape of bench/shapes.py, --warm calls then one
more, for a profiler to attach (ncu -k regex:fused_backward --launch-skip N --launch-count 1):
python3 tools/dev/bwd_once.py qwen3 --warm 3"""
import argparse
import sys

import torch

sys.path.insert(0, "python")
sys.path.insert(0, "tools")
from mok import functional as F  # noqa: E402
from sustained import SHAPES  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("shape", nargs="?", default="qwen3")
ap.add_argument("--warm", type=int, default=3)
args = ap.parse_args()
H, I, k, E, T = SHAPES[args.shape]
g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
tw, ids = torch.randn(T, E, device="cuda", generator=g).softmax(-1).topk(k, dim=-1)
w = [(torch.randn(E, I, H, device="cuda", generator=g) / H ** 0.5).bfloat16(),
     (torch.randn(E, I, H, device="cuda", generator=g) / H ** 0.5).bfloat16(),
     (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16()]
ws = F.create_workspace(H, I, E, k, max_tokens=T, device="cuda",
                        config=F.MoKConfig(macrobatch_size=F.MACROBATCH_ALL_ROWS))
dy = (torch.randn(T, H, device="cuda", generator=g) * 0.1).bfloat16()
_, ctx = F.forward(x, ids.int(), tw, *w, workspace=ws)
for _ in range(args.warm + 1):
    F.backward(ctx, dy)
torch.cuda.synchronize()
print("done")
