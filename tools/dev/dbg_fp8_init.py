"""Session 25: which tensor the block-scaled GEMM's uninitialised scale reads fall in (run under
compute-sanitizer --tool initcheck); not a test."""
import sys
import torch
sys.path.insert(0, "python")
sys.path.insert(0, "tests/python")
import mok.config
from mok import functional as F, ops
from oracle import make_routing, make_weights, make_x

H, I, E, K, T = 256, 256, 4, 2, 37
shared, pow2 = int(sys.argv[1]), False
mok.config.poison_outputs = True
g = torch.Generator().manual_seed(20 + shared + pow2)
w = make_weights(g, H, I, E, shared)
x = make_x(g, T, H)
ids, tw = make_routing(g, T, E, K)
cfg = F.MoKConfig(precision="fp8_block", fp8_pow2_scales=pow2)
wc = {n: (None if v is None else v.cuda()) for n, v in w.items()}
y, ctx = F.forward(x.cuda(), ids.cuda(), tw.cuda(), **wc, config=cfg)
torch.cuda.synchronize()
for n, fw in ctx.fp8.weights.items():
    if fw is not None:
        print(f"{n}: scales {tuple(fw.scales.shape)} at {fw.scales.data_ptr():#x}..{fw.scales.data_ptr() + fw.scales.numel() * 4:#x}, q at {fw.q.data_ptr():#x}")
print("NaN in y:", int(torch.isnan(y.float()).sum()))
rows, cnt, off, be, err = ops.build_schedule([ids.cuda()], E)
print("expert_count", cnt.tolist(), "expert_offset", off.tolist(), "block_expert", be.tolist())
print("config block_m", cfg.block_m, "ws", ctx.workspace)
