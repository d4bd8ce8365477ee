"""Timing ring of the fused forward (or, --backward, the fused backward): where the time of one
call goes, per role.

    python3 tools/trace_forward.py [shape] [--minibatch R] [--out DIR] [--backward] [--fp8]

Runs the fused forward on a shape of docs/benchmarks.md with MOK_TRACE=1, reads the ring
(mokWorkspaceReadTrace), prints a summary (tile time by kind, producer waits, gather
progress, grid barrier, combine) and draws a timeline PNG (matplotlib, when present)."""
import argparse
import os
import sys

import torch

os.environ["MOK_TRACE"] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "python")]
from bench.shapes import SHAPES as BENCH_SHAPES  # noqa: E402
from mok import functional as F  # noqa: E402

# The docs/benchmarks.md shapes by name (bench/shapes.py): (H, I, k, E_l, T)
SHAPES = {name: s.layer for name, s in BENCH_SHAPES.items()}
ROLES = ["gather", "producer wait", "producer load", "tile", "grid barrier", "combine"]
KINDS = {0: "shared gate/up", 1: "gate/up", 2: "shared down", 3: "down", 255: "-"}
KINDS_BWD = {0: "replay", 1: "dgrad down", 2: "dgrad gate/up", 3: "wgrad down", 4: "wgrad gate/up",
             5: "shared replay", 6: "shared dgrad down", 7: "shared dgrad g/u", 8: "shared wgrad down",
             9: "shared wgrad g/u", 255: "-"}

def summarize(ev, kinds=KINDS):
    t0 = ev[:, 0].min().item()
    span = (ev[:, 1].max().item() - t0) / 1e3
    print(f"traced span {span:.1f} us (first event to last)")
    lines = []
    for r, name in enumerate(ROLES):
        sel = ev[ev[:, 2] == r]
        if sel.numel() == 0:
            continue
        dur = (sel[:, 1] - sel[:, 0]).double() / 1e3
        lines.append(f"  {name:14} n={sel.shape[0]:6d}  total {dur.sum().item():10.1f} us  "
                     f"mean {dur.mean().item():7.2f} us  max {dur.max().item():8.2f} us")
    print("\n".join(lines))
    tiles = ev[ev[:, 2] == 3]
    for k in sorted(set(tiles[:, 3].tolist())):
        sel = tiles[tiles[:, 3] == k]
        dur = (sel[:, 1] - sel[:, 0]).double() / 1e3
        waits = ev[(ev[:, 2] == 1) & (ev[:, 3] == k)]
        wait = (waits[:, 1] - waits[:, 0]).double().sum().item() / 1e3
        print(f"  tiles {kinds.get(k, k):18} n={sel.shape[0]:6d}  mean {dur.mean().item():7.2f} us  "
              f"p90 {dur.quantile(0.9).item():7.2f} us  total {dur.sum().item():10.1f} us  producer waits {wait:9.1f} us")
    compute = tiles[:, 6].unique().numel()
    busy = (tiles[:, 1] - tiles[:, 0]).sum().item() / 1e3
    print(f"  compute blocks {compute}: tiles busy {busy / (compute * span):.1%} of span")
    gathers = ev[ev[:, 2] == 0]
    if gathers.numel():
        print(f"  gather (start gather, then the gather warps; EP = 1), last row block released at "
              f"{(gathers[:, 1].max().item() - t0) / 1e3:.1f} us")
    first_tile = (tiles[:, 0].min().item() - t0) / 1e3 if tiles.numel() else 0
    last_tile = (tiles[:, 1].max().item() - t0) / 1e3 if tiles.numel() else 0
    ends = []
    for b in tiles[:, 6].unique().tolist():
        ends.append((tiles[tiles[:, 6] == b][:, 1].max().item() - t0) / 1e3)
    ends = torch.tensor(ends)
    print(f"  first tile starts at {first_tile:.1f} us; blocks finish their last tile between "
          f"{ends.min().item():.1f} and {last_tile:.1f} us (median {ends.median().item():.1f})")
    comb = ev[ev[:, 2] == 5]
    if comb.numel():
        print(f"  combine: {(comb[:, 0].min().item() - t0) / 1e3:.1f} -> {(comb[:, 1].max().item() - t0) / 1e3:.1f} us")
    barrier = ev[ev[:, 2] == 4]
    if barrier.numel():
        print(f"  grid barrier: blocks arrive {(barrier[:, 0].min().item() - t0) / 1e3:.1f} -> "
              f"{(barrier[:, 0].max().item() - t0) / 1e3:.1f} us, pass by {(barrier[:, 1].max().item() - t0) / 1e3:.1f} us")
    stalls(ev, t0, span, kinds)
    return t0


def stalls(ev, t0, span, kinds, bins=10):
    """Per tile: its consumers' stall for inputs (the producer's ready time past the tile's start)
    and its run (the rest: loads, MMAs, epilogue); per time bin, how the compute blocks' time
    splits into runs, stalls and the rest (gather, start, end)."""
    per_kind = {}
    runs, waits = [], []  # (begin, end) in us since t0
    for b in ev[:, 6].unique().tolist():
        mine = ev[ev[:, 6] == b]
        prod = mine[mine[:, 2] == 1].tolist()
        tiles = mine[mine[:, 2] == 3].tolist()
        for (pb, pe, _, pk, pblk, pn, _), (tb, te, _, tk, tblk, tn, _) in zip(prod, tiles):
            if (pk, pblk, pn) != (tk, tblk, tn):
                print(f"  (block {b}: producer and tile events out of step; stall analysis stops there)")
                break
            ready = max(tb, pe)
            d = per_kind.setdefault(tk, [0, 0.0, 0.0])
            d[0] += 1
            d[1] += (ready - tb) / 1e3
            d[2] += (te - ready) / 1e3
            waits.append(((tb - t0) / 1e3, (ready - t0) / 1e3))
            runs.append(((ready - t0) / 1e3, (te - t0) / 1e3))
    n_blocks = ev[:, 6].unique().numel()
    print("  per kind: consumers' stall for inputs, and the run after it (loads + MMA + epilogue)")
    for k in sorted(per_kind):
        n, w, r = per_kind[k]
        print(f"    {kinds.get(k, k):18} n={n:6d}  stall mean {w / n:7.2f} us (total {w / 1e3:7.2f} SM-ms)"
              f"  run mean {r / n:7.2f} us (total {r / 1e3:7.2f} SM-ms)")
    width = span / bins
    def binned(iv):
        out = [0.0] * bins
        for a, e in iv:
            i = max(0, int(a // width))
            while i < bins and i * width < e:
                out[i] += max(0.0, min(e, (i + 1) * width) - max(a, i * width))
                i += 1
        return out
    r, w = binned(runs), binned(waits)
    print(f"  time bins of {width:.0f} us: % of the {n_blocks} blocks' time in tile runs / input stalls / neither")
    print("    " + "  ".join(f"{100 * r[i] / (n_blocks * width):3.0f}/{100 * w[i] / (n_blocks * width):2.0f}/"
                            f"{100 * (1 - (r[i] + w[i]) / (n_blocks * width)):2.0f}" for i in range(bins)))


def draw(ev, t0, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no timeline PNG")
        return
    colors = {(3, 1): "tab:blue", (3, 3): "tab:orange", (3, 0): "tab:cyan", (3, 2): "tab:olive",
              (0, 255): "tab:green", (1, None): "tab:red", (4, 255): "lightgray", (5, 255): "tab:purple"}
    fig, ax = plt.subplots(figsize=(16, 9))
    for row in ev.tolist():
        begin, end, role, kind, _, _, block = row
        key = (role, kind) if (role, kind) in colors else ((role, None) if (role, None) in colors else None)
        if key is None:
            continue
        ax.barh(block, (end - begin) / 1e3, left=(begin - t0) / 1e3, height=0.8, color=colors[key], linewidth=0)
    ax.set_xlabel("us since the first event")
    ax.set_ylabel("block")
    ax.set_title("fused forward: gate/up (blue), down (orange), shared (cyan/olive), gather (green), "
                 "producer waits (red), combine (purple)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="dsv3")
    ap.add_argument("--minibatch", type=int, default=F.MoKConfig().minibatch_size)
    ap.add_argument("--out", default=".")
    ap.add_argument("--warm", type=int, default=3, help="untraced calls first (sustained load: 30+)")
    ap.add_argument("--backward", action="store_true", help="trace the fused backward (of the saving forward)")
    ap.add_argument("--ring-all", action="store_true", help="the ring for every routed row (MACROBATCH_ALL_ROWS)")
    ap.add_argument("--fp8", action="store_true", help="precision fp8_block (the forward's fp8 policy)")
    args = ap.parse_args()
    H, I, k, E, T = SHAPES[args.shape]
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    tw, ids = torch.randn(T, E, device="cuda", generator=g).softmax(-1).topk(k, dim=-1)
    w = [(torch.randn(E, I, H, device="cuda", generator=g) / H ** 0.5).bfloat16(),
         (torch.randn(E, I, H, device="cuda", generator=g) / H ** 0.5).bfloat16(),
         (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16()]
    cfg = F.MoKConfig(minibatch_size=args.minibatch,
                      macrobatch_size=F.MACROBATCH_ALL_ROWS if args.ring_all else 0,
                      precision="fp8_block" if args.fp8 else "bf16")
    if args.fp8 and args.backward:
        raise SystemExit("--fp8: the fp8_block backward is launches (no fused backward to trace)")
    ws = F.create_workspace(H, I, E, k, max_tokens=T, device="cuda", config=cfg)
    if args.backward:
        dy = (torch.randn(T, H, device="cuda", generator=g) * 0.1).bfloat16()
        _, ctx = F.forward(x, ids.int(), tw, *w, workspace=ws)
        call = lambda: F.backward(ctx, dy)  # noqa: E731
    else:
        call = lambda: F.forward(x, ids.int(), tw, *w, workspace=ws)  # noqa: E731
    for _ in range(args.warm):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    what = "backward" if args.backward else "forward"
    print(f"{args.shape}: fused {what} {start.elapsed_time(end):.3f} ms (traced call, {cfg.precision}, "
          f"minibatch {args.minibatch})")
    ev = ws.read_trace()
    t0 = summarize(ev, KINDS_BWD if args.backward else KINDS)
    os.makedirs(args.out, exist_ok=True)
    draw(ev, t0, os.path.join(args.out, f"trace_{what}_{args.shape}{'_fp8' if args.fp8 else ''}.png"))


if __name__ == "__main__":
    main()
