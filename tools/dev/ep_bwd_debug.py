# Debug: virtual EP=2 backward calls, timed, checked against EP=1 per token (EP1_FIRST=1: the
# EP=1 backward runs before the group's first call, loading every kernel first)
import os, sys, time, torch
sys.path.insert(0, "python"); sys.path.insert(0, "tests/python")
import mok
from mok import functional as F
from oracle import make_weights, make_routing, make_x
mok.config.poison_outputs = True
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


def ep1():
    ctx = F.recompute_forward_context(torch.cat([r.x for r in ranks]), torch.cat([r.topk_ids for r in ranks]),
                                      torch.cat([r.topk_weights for r in ranks]), **weights)
    g1 = F.backward(ctx, torch.cat(dys))
    return torch.split(g1.dx, counts)


want = ep1() if os.environ.get("EP1_FIRST") == "1" else None
with F.create_virtual_group(H, I, E, k, 300, 0, ep_size=P) as group:
    outs = []
    for run in range(2):
        t0 = time.time()
        outs.append(group.backward(ranks, dys))
        torch.cuda.synchronize()
        try:
            group.check_errors()
            err = "none"
        except Exception as e:
            err = str(e)[:300]
        print(f"call {run}: {time.time() - t0:.2f} s, errors: {err}", flush=True)
if want is None:
    want = ep1()
for run, g in enumerate(outs):
    for r in range(P):
        bad = (g[r].dx.view(torch.int16) != want[r].view(torch.int16)).any(1)
        print(f"call {run} rank {r}: dx bad {int(bad.sum())}/{counts[r]}")
