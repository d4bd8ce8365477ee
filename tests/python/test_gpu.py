"""GPU tests: the device-built schedule equals the host one bit for bit, device-side route
validation, and the CUDA layer's NotImplementedError. Skipped without a GPU."""
import pytest
import torch

import mok
from mok import functional as F
from oracle import WEIGHTS, make_routing, make_weights, make_x

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not mok.has_cuda(), reason="libmok was built without its CUDA part"),
]

NO_ERROR = 0x7FFFFFFFFFFFFFFF
PLAN_FIELDS = ("rows", "expert_count", "expert_offset", "block_expert", "error")


def _plans_equal(a, b, what):
    for name in PLAN_FIELDS:
        ta, tb = getattr(a, name).cpu(), getattr(b, name).cpu()
        assert torch.equal(ta, tb), f"{what}: {name} differs between the device and the host build"


def _routing(kind, gen, T, E, k, ids_dtype):
    if kind == "uniform":
        return make_routing(gen, T, E, k, ids_dtype, masked=0.0)[0]
    if kind == "masked":
        return make_routing(gen, T, E, k, ids_dtype, masked=0.4)[0]
    # All tokens to the last expert, the other routes spread over the rest.
    ids = torch.rand(T, E - 1, generator=gen).argsort(dim=1)[:, :k]
    ids[:, 0] = E - 1
    return ids.to(ids_dtype).contiguous()


@pytest.mark.parametrize("kind", ["uniform", "one_expert", "masked"])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_device_schedule_equals_host(gen, kind, P, ids_dtype):
    E, k = 4 * P, 3
    counts = [300, 513, 0, 256][:P] if P > 1 else [777]
    ids = [_routing(kind, gen, T, E, k, ids_dtype) for T in counts]
    for config in (F.MoKConfig(), F.MoKConfig(block_m=64, minibatch_size=128, macrobatch_size=256)):
        for rank in range(P):
            host = F.build_schedule(ids, E, ep_rank=rank, max_tokens=800, config=config)
            dev = F.build_schedule([t.cuda() for t in ids], E, ep_rank=rank, max_tokens=800, config=config)
            assert dev.rows.is_cuda
            _plans_equal(dev, host, f"{kind} P={P} rank={rank} block_m={config.block_m}")
            dev.check()


def test_device_schedule_all_ranks_empty():
    ids = [torch.zeros(0, 2, dtype=torch.int64, device="cuda") for _ in range(2)]
    dev = F.build_schedule(ids, 4, ep_rank=1)
    host = F.build_schedule([t.cpu() for t in ids], 4, ep_rank=1)
    _plans_equal(dev, host, "T=0 on every rank")
    assert dev.num_padded_rows == 0


def _first_bad_route(ids, num_experts):
    """Host computation of the device validation: cleaned ids and the lowest bad (rank, token, j)."""
    cleaned, first = [], None
    for s, t_ids in enumerate(ids):
        rows = t_ids.tolist()
        out = []
        for t, token in enumerate(rows):
            kept = list(token)
            for j, e in enumerate(token):
                bad = e < -1 or e >= num_experts or (e != -1 and e in token[:j])
                if bad:
                    kept[j] = -1
                    kind = 2 if (e < -1 or e >= num_experts) else 3
                    if first is None:
                        first = (s, t, j, e, kind)
            out.append(kept)
        cleaned.append(torch.tensor(out, dtype=t_ids.dtype).reshape(t_ids.shape))
    return cleaned, first


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_device_validation_masks_and_records(gen, ids_dtype):
    P, E, k = 3, 12, 4
    ids = [make_routing(gen, T, E, k, ids_dtype)[0] for T in (40, 300, 17)]
    ids[1][270, 2] = E                                       # out of range: the first bad route
    ids[1][299, 0] = -7                                      # out of range, later
    ids[1][280] = torch.tensor([2, 2, -1, 0], dtype=ids_dtype)  # duplicate, later
    ids[2][3] = torch.tensor([5, 6, 5, -1], dtype=ids_dtype)    # duplicate on the last rank
    cleaned, first = _first_bad_route(ids, E)
    assert first is not None and first[:3] == (1, 270, 2)
    for rank in range(P):
        dev = F.build_schedule([t.cuda() for t in ids], E, ep_rank=rank, max_tokens=300)
        host = F.build_schedule(cleaned, E, ep_rank=rank, max_tokens=300)
        for name in PLAN_FIELDS[:-1]:
            assert torch.equal(getattr(dev, name).cpu(), getattr(host, name)), f"rank {rank}: {name}"
        assert dev.first_error() == first
        with pytest.raises(ValueError, match=rf"rank 1: topk_ids\[270, 2\] = {E} is outside"):
            dev.check()
    # A duplicate alone is recorded as such.
    dup = [torch.tensor([[0, 1], [3, 3]], dtype=ids_dtype, device="cuda")]
    dev = F.build_schedule(dup, 4)
    assert dev.first_error() == (0, 1, 1, 3, 3)
    with pytest.raises(ValueError, match="duplicate"):
        dev.check()


def test_device_schedule_in_cuda_graph(gen):
    # The build needs no host synchronisation: it captures into a CUDA graph and replays.
    E, k = 8, 2
    ids = make_routing(gen, 200, E, k, torch.int32)[0].cuda()
    F.build_schedule(ids, E, max_tokens=256)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = F.build_schedule(ids, E, max_tokens=256)
    for _ in range(2):
        ids.copy_(make_routing(gen, 200, E, k, torch.int32)[0])
        graph.replay()
        torch.cuda.synchronize()
        _plans_equal(captured, F.build_schedule(ids.cpu(), E, max_tokens=256), "graph replay")


def test_cuda_layer_not_built_yet(gen):
    w = make_weights(gen, 64, 32, 8, 16)
    ids, tw = make_routing(gen, 10, 8, 2)
    args = [make_x(gen, 10, 64), ids, tw] + [w[n] for n in WEIGHTS]
    cuda_args = [a.cuda() for a in args]
    with pytest.raises(NotImplementedError, match="CUDA"):
        F.forward(*cuda_args)
    ctx = F.recompute_forward_context(*cuda_args)
    with pytest.raises(NotImplementedError, match="CUDA"):
        F.backward(ctx, cuda_args[0])
    with pytest.raises(NotImplementedError, match="CUDA"):
        mok.nn.MoE(64, 32, 8, 2, device="cuda")(cuda_args[0])


def test_workspace_device_must_match(gen):
    w = make_weights(gen, 64, 32, 8)
    ids, tw = make_routing(gen, 10, 8, 2)
    cuda_ws = F.create_workspace(64, 32, 8, 2, max_tokens=16, device="cuda:0")
    with pytest.raises(ValueError, match="workspace was built for cuda:0"):
        F.forward(make_x(gen, 10, 64), ids, tw, w["w_gate"], w["w_up"], w["w_down"], workspace=cuda_ws)
