"""One training forward and two backward calls of the fused kernels on a BENCH.md shape, for a
profiler to attach (ncu -k regex:fused_backward --launch-skip 1 --launch-count 1 ...).

    python3 tools/dev/profile_fused_bwd.py [shape]"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from mok import functional as F  # noqa: E402
from sustained import SHAPES  # noqa: E402

H, I, k, E, T = SHAPES[sys.argv[1] if len(sys.argv) > 1 else "dsv3"][:5]
g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
tw, ids = torch.randn(T, E, device="cuda", generator=g).softmax(-1).topk(k, dim=-1)
w = [(torch.randn(E, I, H, device="cuda", generator=g) / H ** 0.5).bfloat16(),
     (torch.randn(E, I, H, device="cuda", generator=g) / H ** 0.5).bfloat16(),
     (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16()]
dy = (torch.randn(T, H, device="cuda", generator=g) * 0.1).bfloat16()
ws = F.create_workspace(H, I, E, k, max_tokens=T, device="cuda")
_, ctx = F.forward(x, ids.int(), tw, *w, workspace=ws)
for _ in range(2):
    F.backward(ctx, dy)
torch.cuda.synchronize()
print("done")
