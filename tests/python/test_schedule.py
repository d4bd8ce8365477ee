"""build_schedule on the host against a direct Python computation of the plan."""
import pytest
import torch

from mok import functional as F
from oracle import make_routing

NO_ERROR = 0x7FFFFFFFFFFFFFFF


def expected_plan(ids_per_rank, num_experts, ep_rank, block_m):
    """Rows per local expert in canonical (rank, token, j) order, and the padded offsets."""
    num_local = num_experts // len(ids_per_rank)
    first = ep_rank * num_local
    rows = [[] for _ in range(num_local)]
    for s, ids in enumerate(ids_per_rank):
        for t, token_ids in enumerate(ids.tolist()):
            for j, e in enumerate(token_ids):
                if first <= e < first + num_local:
                    rows[e - first].append((s, t, j))
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + -(-len(r) // block_m) * block_m)
    return rows, offsets


def check_plan(schedule, ids_per_rank, num_experts, ep_rank, block_m, max_tokens):
    rows, offsets = expected_plan(ids_per_rank, num_experts, ep_rank, block_m)
    assert schedule.decode() == rows
    assert schedule.expert_count.tolist() == [len(r) for r in rows]
    assert schedule.expert_offset.tolist() == offsets
    # Capacity from the documented formula.
    num_local, k = len(rows), ids_per_rank[0].shape[1]
    max_rows = (len(ids_per_rank) * max_tokens * min(k, num_local) + num_local * (block_m - 1)) // block_m * block_m
    assert schedule.rows.numel() == max_rows and schedule.block_expert.numel() == max_rows // block_m
    # Padding rows are all ones; blocks map to their expert, -1 past the end.
    raw = schedule.rows
    for e, r in enumerate(rows):
        assert torch.all(raw[offsets[e] + len(r):offsets[e + 1]] == -1)
    assert torch.all(raw[offsets[-1]:] == -1)
    block_expert = [-1] * (max_rows // block_m)
    for e in range(num_local):
        for b in range(offsets[e] // block_m, offsets[e + 1] // block_m):
            block_expert[b] = e
    assert schedule.block_expert.tolist() == block_expert
    assert schedule.error[0].item() == NO_ERROR
    assert schedule.num_rows == sum(len(r) for r in rows) and schedule.num_padded_rows == offsets[-1]


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_m,minibatch,macrobatch", [(128, 1024, 16384), (4, 8, 16)])
def test_host_plan(gen, P, ids_dtype, block_m, minibatch, macrobatch):
    E, k = 4 * P, 3
    config = F.MoKConfig(block_m=block_m, minibatch_size=minibatch, macrobatch_size=macrobatch)
    counts = [int(torch.randint(0, 40, (1,), generator=gen)) for _ in range(P)]
    counts[P - 1] = 0 if P > 2 else counts[P - 1]
    ids = [make_routing(gen, T, E, k, ids_dtype)[0] for T in counts]
    max_tokens = max(counts) + 5
    for rank in range(P):
        schedule = F.build_schedule(ids, E, ep_rank=rank, max_tokens=max_tokens, config=config)
        check_plan(schedule, ids, E, rank, block_m, max_tokens)
        assert schedule.rows.dtype == torch.int32 and schedule.error.dtype == torch.int64


def test_skewed_routing_and_single_tensor(gen):
    # Every token to expert 2 (and one other): one long segment, several empty ones.
    ids = torch.stack([torch.full((50,), 2), torch.randint(3, 8, (50,), generator=gen)], dim=1)
    schedule = F.build_schedule(ids, 8, config=F.MoKConfig(block_m=16, minibatch_size=16, macrobatch_size=32))
    check_plan(schedule, [ids], 8, 0, 16, 50)
    assert schedule.expert_count[2] == 50 and schedule.expert_count[0] == 0


def test_row_records_and_printing(gen):
    ids = [torch.tensor([[0, 1], [2, -1]]), torch.tensor([[1, 3], [-1, -1], [3, 0]])]
    schedule = F.build_schedule(ids, 4, ep_rank=0)
    assert schedule.decode() == [[(0, 0, 0), (1, 2, 1)], [(0, 0, 1), (1, 0, 0)]]
    records = schedule.rows[:2].tolist()
    assert records == [0, (1 << 26) | (1 << 21) | 2]
    text = str(schedule)
    assert "rank 0/2" in text and "(1,2,1)" in text and "expert" in text


def test_host_plan_rejects_bad_ids():
    ids = torch.tensor([[0, 1], [2, 7]])
    with pytest.raises(ValueError, match=r"rank 0: topk_ids\[1, 1\] = 7 is outside \[-1, 4\)"):
        F.build_schedule(ids, 4)
    with pytest.raises(ValueError, match=r"topk_ids\[0, 1\] = 1 duplicates"):
        F.build_schedule([torch.tensor([[1, 1]]), ids], 4, ep_rank=1)
    with pytest.raises(ValueError, match="max_tokens"):
        F.build_schedule(ids, 4, max_tokens=1)
    with pytest.raises(ValueError, match="2-D"):
        F.build_schedule(torch.tensor([0, 1]), 4)
