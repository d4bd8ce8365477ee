"""The standalone dgrad-down kinds of a BENCH.md shape for a profiler to attach: three calls of
the SwiGLU-backward kind (ping-pong 128 x 128), then three of the plain dgrad down
(ncu -k regex:grouped_gemm --launch-skip 2 --launch-count 1: the third SwiGLU call;
--launch-skip 5: the third plain one).

    python3 tools/dev/profile_swiglu_kind.py [shape]"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from mok import ops  # noqa: E402
from sustained import SHAPES  # noqa: E402

H, I, k, E, T = SHAPES[sys.argv[1] if len(sys.argv) > 1 else "qwen3"][:5]
dev = torch.device("cuda")
rows = T * k // E // 128 * 128
M = rows * E
g = torch.Generator(device=dev).manual_seed(0)
bf = dict(device=dev, dtype=torch.bfloat16)
dy = torch.randn(M, H, device=dev, generator=g).bfloat16()
wd = (torch.randn(E, H, I, device=dev, generator=g) / I ** 0.5).bfloat16()
block_expert = torch.arange(E, device=dev, dtype=torch.int32).repeat_interleave(rows // 128)
h = torch.randn(M, 2 * I, device=dev, generator=g).bfloat16()
rw = torch.rand(M, device=dev, generator=g)
dh, wa, da = torch.empty(M, 2 * I, **bf), torch.empty(M, I, **bf), torch.empty(M, I, **bf)
parts = torch.empty(M, I // 128, device=dev, dtype=torch.float32)
for _ in range(3):
    ops.grouped_mm(dy, wd, block_expert, out=dh, kind="dgrad_down_swiglu", h=h, row_weight=rw, wa=wa,
                   dtw_partials=parts)
for _ in range(3):
    ops.grouped_mm(dy, wd, block_expert, out=da, kind="dgrad_down")
torch.cuda.synchronize()
print("done")
