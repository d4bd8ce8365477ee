"""The EP group of P ranks emulated in-process: against the float64 oracle, and per-token
bitwise against the EP = 1 run over the concatenated batch."""
import pytest
import torch

from mok import functional as F
from oracle import WEIGHTS, assert_close, make_routing, make_weights, make_x, reference, route_term_norms

ROUTED = ("w_gate", "w_up", "w_down")
SHARED = ("ws_gate", "ws_up", "ws_down")


def _group(gen, P, counts, H, I, E, k, Is, ids_dtype):
    """Full weights, and per rank: its tokens and its slice of the experts."""
    w = make_weights(gen, H, I, E, Is)
    El = E // P
    ranks, dys = [], []
    for r, T in enumerate(counts):
        ids, tw = make_routing(gen, T, E, k, ids_dtype)
        local = {n: w[n][r * El:(r + 1) * El] for n in ROUTED}
        ranks.append(F.RankInputs(make_x(gen, T, H), ids, tw, **local,
                                  **{n: w[n] for n in SHARED}))
        dys.append(make_x(gen, T, H))
    return w, ranks, dys


def _ep1(rank_list, w, dys):
    cat = [torch.cat([getattr(r, name) for r in rank_list]) for name in ("x", "topk_ids", "topk_weights")]
    y, ctx = F.forward(*cat, *[w[n] for n in WEIGHTS])
    return y, F.backward(ctx, torch.cat(dys))


@pytest.mark.parametrize("P,counts,Is,ids_dtype", [
    (1, [21], 16, torch.int32),
    (2, [17, 30], 0, torch.int64),
    (2, [0, 9], 16, torch.int32),
    (3, [12, 0, 25], 16, torch.int64),
    (4, [8, 19, 3, 14], 0, torch.int32),
    (4, [16, 1, 0, 7], 32, torch.int64),
])
def test_emulated_group(gen, P, counts, Is, ids_dtype):
    H, I, k = 64, 32, 3
    E = 4 * P if P > 1 else 6
    w, ranks, dys = _group(gen, P, counts, H, I, E, k, Is, ids_dtype)
    ys = F.forward_emulated(ranks, num_experts=E)
    grads = F.backward_emulated(ranks, dys, num_experts=E)

    # Against the float64 oracle: per rank for y, dx, d topk_weights and the shared grads;
    # the routed grads of rank r's experts sum over every rank's tokens.
    routed_ref = {n: torch.zeros(w[n].shape, dtype=torch.float64) for n in ROUTED}
    for r, (rank, dy) in enumerate(zip(ranks, dys)):
        y_ref, g_ref = reference(rank.x, rank.topk_ids, rank.topk_weights, w, dy)
        assert_close(f"rank {r} y", ys[r], y_ref)
        assert_close(f"rank {r} dx", grads[r].dx, g_ref["dx"])
        assert_close(f"rank {r} d_topk_weights", grads[r].d_topk_weights, g_ref["d_topk_weights"],
                     floor=route_term_norms(rank.x, rank.topk_ids, w, dy))
        for n in ROUTED:
            routed_ref[n] += g_ref[n]
        for n in SHARED:
            if Is:
                assert_close(f"rank {r} grad {n}", getattr(grads[r], n), g_ref[n])
            else:
                assert getattr(grads[r], n) is None
    for n in ROUTED:
        got = torch.cat([getattr(g, n) for g in grads])
        assert_close(f"grad {n}", got, routed_ref[n])

    # Bitwise against EP = 1 over the concatenated batch (rank order, all experts on one rank).
    y1, g1 = _ep1(ranks, w, dys)
    assert torch.equal(torch.cat(ys), y1), "y differs from the EP=1 run"
    assert torch.equal(torch.cat([g.dx for g in grads]), g1.dx), "dx differs from the EP=1 run"
    assert torch.equal(torch.cat([g.d_topk_weights for g in grads]), g1.d_topk_weights)
    for n in ROUTED:
        assert torch.equal(torch.cat([getattr(g, n) for g in grads]), getattr(g1, n)), f"grad {n} differs"
    # A rank's shared-expert grads sum its own tokens: equal to EP = 1 over that rank alone.
    for r in range(P if Is else 0):
        _, g_own = _ep1([ranks[r]], w, [dys[r]])
        for n in SHARED:
            assert torch.equal(getattr(grads[r], n), getattr(g_own, n)), f"rank {r} grad {n} differs"

    # Run twice: the same bits.
    ys2 = F.forward_emulated(ranks, num_experts=E)
    grads2 = F.backward_emulated(ranks, dys, num_experts=E)
    for r in range(P):
        assert torch.equal(ys[r], ys2[r])
        for n in ("dx", "d_topk_weights") + WEIGHTS:
            a, b = getattr(grads[r], n), getattr(grads2[r], n)
            assert (a is None and b is None) or torch.equal(a, b), f"rank {r} {n} differs between runs"


def test_emulated_main_grads_and_dict_ranks(gen):
    P, E, H, I, k = 2, 8, 32, 16, 2
    w, ranks, dys = _group(gen, P, [10, 13], H, I, E, k, 16, torch.int64)
    as_dicts = [vars(r) for r in ranks]
    zero = [{n: torch.zeros(getattr(r, n).shape) for n in WEIGHTS} for r in ranks]
    grads = F.backward_emulated(as_dicts, dys, num_experts=E, main_grads=zero)
    for r in range(P):
        for n in WEIGHTS:
            assert torch.equal(getattr(grads[r], n), zero[r][n].to(torch.bfloat16)), f"rank {r} {n}"


def test_emulated_errors_name_the_rank(gen):
    P, E = 2, 8
    w, ranks, dys = _group(gen, P, [6, 6], 32, 16, E, 2, 0, torch.int32)
    ranks[1].topk_ids[4, 0] = 9
    with pytest.raises(ValueError, match=r"rank 1: topk_ids\[4, 0\] = 9 is outside \[-1, 8\)"):
        F.forward_emulated(ranks, num_experts=E)
    with pytest.raises(ValueError, match="num_experts"):
        F.forward_emulated(ranks, num_experts=7)
    with pytest.raises(ValueError, match="dy tensors"):
        F.backward_emulated(ranks, dys[:1], num_experts=E)
