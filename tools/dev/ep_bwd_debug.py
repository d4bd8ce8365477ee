# Debug: virtual EP=2 backward, several runs, each compared to EP=1 per token
import sys, torch
sys.path.insert(0, "python"); sys.path.insert(0, "tests/python")
from mok import functional as F
from oracle import make_weights, make_routing, make_x
torch.manual_seed(0)
gen = torch.Generator().manual_seed(1)
P, H, I, E, k = 2, 512, 256, 16, 4
counts = [300, 257]
w = make_weights(gen, H, I, E, 0)
El = E // P
ranks, dys = [], []
for s, T in enumerate(counts):
    ids, tw = make_routing(gen, T, E, k, masked=0.1)
    local = {n: w[n][s * El:(s + 1) * El].contiguous().cuda() for n in ("w_gate", "w_up", "w_down")}
    ranks.append(F.RankInputs(make_x(gen, T, H).cuda(), ids.cuda(), tw.cuda(), **local))
    dys.append(make_x(gen, T, H).cuda())
weights = {n: w[n].cuda() for n in ("w_gate", "w_up", "w_down")}
ctx = F.recompute_forward_context(torch.cat([r.x for r in ranks]), torch.cat([r.topk_ids for r in ranks]),
                                  torch.cat([r.topk_weights for r in ranks]), **weights)
g1 = F.backward(ctx, torch.cat(dys))
want = torch.split(g1.dx, counts)
wdtw = torch.split(g1.d_topk_weights, counts)
import mok
mok.config.poison_outputs = True
with F.create_virtual_group(H, I, E, k, 512, 0, ep_size=P) as group:
    for mode in ("sync", "back-to-back", "back-to-back"):
        outs = []
        for run in range(3):
            outs.append(group.backward(ranks, dys))
            if mode == "sync":
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        for run, g in enumerate(outs):
            for r in range(P):
                bad = (g[r].dx.view(torch.int16) != want[r].view(torch.int16)).any(1)
                nan = torch.isnan(g[r].dx.float()).any(1)
                badw = (g[r].d_topk_weights != wdtw[r]).any(1)
                rows = bad.nonzero().flatten().tolist()
                print(f"{mode} run {run} rank {r}: dx bad {int(bad.sum())}/{counts[r]} nan {int(nan.sum())} "
                      f"first {rows[:5]}; dtw bad {int(badw.sum())}")
        try:
            group.check_errors()
            print("errors: none")
        except Exception as e:
            print("errors:", e)
