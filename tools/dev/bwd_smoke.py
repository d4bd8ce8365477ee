"""A small fused backward against the unfused one, bit for bit, with a watchdog (an experiment's
first check on the device): python3 tools/dev/bwd_smoke.py"""
import faulthandler
import os
import sys
import time

import torch

faulthandler.dump_traceback_later(60, exit=True)
sys.path.insert(0, "python")
from mok import functional as F  # noqa: E402

g = torch.Generator().manual_seed(0)
H, I, E, k, T = 256, 256, 8, 2, 300
x = torch.randn(T, H, generator=g).bfloat16().cuda()
ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int().cuda()
tw = torch.rand(T, k, generator=g).cuda()
wg = (torch.randn(E, I, H, generator=g) / 16).bfloat16().cuda()
wu = (torch.randn(E, I, H, generator=g) / 16).bfloat16().cuda()
wd = (torch.randn(E, H, I, generator=g) / 16).bfloat16().cuda()
dy = torch.randn(T, H, generator=g).bfloat16().cuda()
y, ctx = F.forward(x, ids, tw, wg, wu, wd)
torch.cuda.synchronize()
t = time.time()
gr = F.backward(ctx, dy)
torch.cuda.synchronize()
print(f"fused backward {time.time() - t:.3f} s")
os.environ["MOK_BACKWARD_PATH"] = "unfused"
ref = F.backward(ctx, dy)
torch.cuda.synchronize()
same = {n: torch.equal(getattr(gr, n), getattr(ref, n)) for n in ("dx", "d_topk_weights", "w_gate", "w_up", "w_down")}
print("fused == unfused bit for bit:", same)
sys.exit(0 if all(same.values()) else 1)
