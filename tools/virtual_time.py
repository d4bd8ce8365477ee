#!/usr/bin/env python3
"""The EP >= 2 protocols timed on one GPU (virtual ranks, mok.functional.create_virtual_group):
P ranks' persistent kernels on P streams, SMs / P blocks each, the comm blocks pulling rows
from the other ranks' regions; beside them, interleaved in the same rounds, one rank's share at
EP = 1 on the same SMs / P blocks (config.num_blocks), where the producers' gather warps copy
the rows instead.  Forward, and forward + backward; medians of CUDA-event times per call.

  python3 tools/virtual_time.py qwen3 --ranks 2,4 [--tokens 2048] [--rounds 20]

Per rank: T / P tokens and E_l / P local experts of the shape's per-GPU load (bench/shapes.py),
uniform routing over the group's E_l experts.  The
virtual ranks share one GPU, so their time is P ranks' work on the whole GPU: the EP = 1 row
runs one rank's share (T tokens, E / P experts, its rows) on 1 / P of the SMs; the ratio of
the two is the cost of the cross-rank protocol (exchange, pulls over the same HBM, barriers)
over the gather warps' local copies.
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mok import functional as F  # noqa: E402
from bench import shapes as sh  # noqa: E402


def time_ms(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="qwen3")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--tokens", type=int, default=0, help="tokens per rank (default: the shape's T / P)")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    # The shape's per-GPU load spread over the P virtual ranks: E = its E_l experts in the group,
    # T / P tokens per rank
    H, I, k, E, T_shape = sh.SHAPES[args.shape].layer
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(0)
    for P in (int(p) for p in args.ranks.split(",")):
        T = args.tokens or T_shape // P
        El = E // P
        ranks, dys = [], []
        for r in range(P):
            x = torch.randn(T, H, device=dev, generator=g).bfloat16()
            tw, ids = torch.randn(T, E, device=dev, generator=g).softmax(-1).topk(k, dim=-1)
            weights = [(torch.randn(El, a, b, device=dev, generator=g) / b ** 0.5).bfloat16()
                       for a, b in ((I, H), (I, H), (H, I))]
            ranks.append(F.RankInputs(x, ids.int(), (tw / tw.sum(-1, keepdim=True)).float(), *weights))
            dys.append((torch.randn(T, H, device=dev, generator=g) * 0.1).bfloat16())
        group = F.create_virtual_group(H, I, E, k, T, ep_size=P)
        # One rank's share at EP = 1 on SMs / P blocks: its tokens routed over its E / P experts
        local_tw, local_ids = torch.randn(T, El, device=dev, generator=g).softmax(-1).topk(k, dim=-1)
        local_ids = local_ids.int()
        local = dict(w_gate=ranks[0].w_gate, w_up=ranks[0].w_up, w_down=ranks[0].w_down)
        ws1 = F.create_workspace(H, I, El, k, max_tokens=T, device="cuda", config=F.MoKConfig(num_blocks=sms // P))

        local_tw = (local_tw / local_tw.sum(-1, keepdim=True)).float()

        def ep1_fb():
            _, ctx = F.forward(ranks[0].x, local_ids, local_tw, **local, workspace=ws1)
            return F.backward(ctx, dys[0])

        variants = {
            f"virtual EP={P} fwd": lambda: group.forward(ranks),
            f"virtual EP={P} fwd+bwd": lambda: (group.forward(ranks), group.backward(ranks, dys)),
            f"EP=1 share on {sms // P} SMs fwd": lambda: F.forward(ranks[0].x, local_ids, local_tw,
                                                                  **local, workspace=ws1, save_for_backward=False),
            f"EP=1 share on {sms // P} SMs fwd+bwd": ep1_fb,
        }
        for fn in variants.values():  # warm up, and any error surfaces here
            fn()
        group.check_errors()
        times = {n: [] for n in variants}
        for _ in range(args.rounds):
            for n, fn in variants.items():
                times[n].append(time_ms(fn))
        group.check_errors()
        med = {n: statistics.median(v) for n, v in times.items()}
        print(f"{args.shape}: P = {P}, {T} tokens and {El} experts per rank, {sms // P} SMs per rank, "
              f"{args.rounds} interleaved rounds (median ms)")
        for n, v in med.items():
            print(f"  {n:34} {v:8.3f}")
        for what in ("fwd", "fwd+bwd"):
            ratio = med[f"virtual EP={P} {what}"] / med[f"EP=1 share on {sms // P} SMs {what}"]
            print(f"  virtual EP={P} / EP=1 share, {what}: {ratio:.3f}")
        group.close()


if __name__ == "__main__":
    main()
