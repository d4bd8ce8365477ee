"""EP >= 2. On the CPU: the config ABI (num_blocks, config version 2) and clear errors for bad
arguments. On a GPU (skipped without one, or without the symmetric-memory entry points):
virtual ranks (P = 2, 4, 8 on one device) bit for bit against EP = 1 with all experts local
and against the CPU reference, 100 runs bitwise identical, skewed routing with a wrapping
ring, CUDA-graph replays, a rank that never arrives; and with two GPUs, a real EP = 2 group
over PyTorch symmetric memory bit for bit against EP = 1."""
import contextlib
import ctypes
import dataclasses
import os
import re
import socket
from pathlib import Path

import pytest
import torch

import mok
from mok import _lib
from mok import functional as F
from oracle import assert_close, make_routing, make_weights, make_x, reference, route_term_norms

ROUTED = ("w_gate", "w_up", "w_down")
SHARED = ("ws_gate", "ws_up", "ws_down")
# The multi-GPU cases (TestMultiGPU; their checks also run on virtual ranks)
H2, I2, E2, K2, IS2 = 512, 256, 16, 4, 256
COUNTS_BY_WORLD = {2: (300, 257), 4: (300, 0, 384, 129), 8: (300, 0, 384, 129, 311, 64, 290, 200)}
MULTI_KINDS = ("masked", "zipf", "empty_rank", "uneven")
MULTI_RUNS = {"masked": 100}  # runs per case in each rank (bitwise the same every time); else 3
MAX_T2 = 512
MULTI_CONFIG = dict(minibatch_size=128, macrobatch_size=256)  # the ring wraps
SYMMETRIC_SYMBOLS = ("mokSymmetricBytes", "mokWorkspaceCreateSymmetric")
HEADER = Path(__file__).resolve().parents[2] / "include" / "mok" / "mok.h"

GPU = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not mok.has_cuda(), reason="libmok was built without its CUDA part"),
    pytest.mark.skipif(not all(_lib.has_symbol(n) for n in SYMMETRIC_SYMBOLS),
                       reason="libmok has no EP >= 2 symmetric path (mokWorkspaceCreateSymmetric) yet"),
]


# ---------------------------------------------------------------------------------------
# CPU: the ABI and argument errors


def _header_config_fields():
    """Field names of mokConfig_t in include/mok/mok.h, in order."""
    text = HEADER.read_text()
    body = re.search(r"typedef struct mokConfig_t \{(.*?)\} mokConfig_t;", text, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    return re.findall(r"^\s*(?:u?int64_t|double)\s+(\w+)\s*;", body, re.M)


def test_config_layout_mirrors_the_c_struct():
    fields = _lib.mokConfig._fields_
    # Every field 8 bytes wide, in order: num_blocks (config version 2), then fp8_pow2_scales (3)
    assert ctypes.sizeof(_lib.mokConfig) == 8 * len(fields) == 22 * 8
    for i, (name, ctype) in enumerate(fields):
        assert ctypes.sizeof(ctype) == 8, name
        assert getattr(_lib.mokConfig, name).offset == 8 * i, name
    assert [name for name, _ in fields[-2:]] == ["num_blocks", "fp8_pow2_scales"]
    assert _lib.ABI_VERSION == (0, 6) and _lib.CONFIG_VERSION == 3
    c = _lib.default_config()
    assert (c.size, c.version, c.num_blocks, c.fp8_pow2_scales) == (176, 3, 0, 0)
    if HEADER.is_file():
        assert [name for name, _ in fields] == _header_config_fields()
        text = HEADER.read_text()
        assert re.search(r"#define MOK_CONFIG_VERSION 3\b", text)
        assert re.search(r"/\*num_blocks\*/ 0, /\*fp8_pow2_scales\*/ 0", text)


def test_get_config_round_trip_keeps_num_blocks():
    config = F.MoKConfig(num_blocks=7, fwd_num_comm_sms=3, minibatch_size=256, macrobatch_size=512, timeout_s=2.5)
    ws = F.create_workspace(64, 32, 8, 2, 16, shared_intermediate=16, config=config)
    try:
        c = ws.c_config()
        assert (c.size, c.version) == (ctypes.sizeof(_lib.mokConfig), _lib.CONFIG_VERSION)
        assert (c.num_blocks, c.fwd_num_comm_sms, c.minibatch_size, c.macrobatch_size, c.timeout_s) == (
            7, 3, 256, 512, 2.5)
        assert (c.hidden, c.num_experts, c.max_tokens, c.device) == (64, 8, 16, _lib.DEVICE_CPU)
    finally:
        ws.close()


def _created_by_an_older_caller(c, fields: int, version: int):
    """The config a workspace keeps when a caller compiled against an older config version
    passes c: only its first `fields` fields (mokWorkspaceGetConfig's copy of the normalised one)."""
    c.size, c.version = fields * 8, version
    handle = ctypes.c_void_p()
    _lib.check(_lib.lib.mokWorkspaceCreate(ctypes.byref(c), ctypes.byref(handle)))
    try:
        out = _lib.default_config()
        _lib.check(_lib.lib.mokWorkspaceGetConfig(handle, ctypes.byref(out)))
        return out
    finally:
        _lib.check(_lib.lib.mokWorkspaceDestroy(handle))


def test_version_1_caller_gets_the_default_num_blocks():
    # A caller compiled against config version 1 passes 20 fields: the C side must not read a 21st.
    c = F._c_config(F.LayerDims(64, 32, 8, 2, 16), F.MoKConfig(num_blocks=9), _lib.DEVICE_CPU)
    out = _created_by_an_older_caller(c, 20, 1)
    assert (out.num_blocks, out.version, out.hidden) == (0, 3, 64)


def test_version_2_caller_gets_fp32_scales():
    # A caller compiled against config version 2 passes 21 fields: fp8_pow2_scales keeps its default
    c = F._c_config(F.LayerDims(128, 128, 8, 2, 16), F.MoKConfig(precision="fp8_block", fp8_pow2_scales=True),
                    _lib.DEVICE_CPU)
    out = _created_by_an_older_caller(c, 21, 2)
    assert (out.fp8_pow2_scales, out.version, out.precision) == (0, 3, _lib.PRECISIONS["fp8_block"])


def test_mokconfig_num_blocks():
    c = F.MoKConfig(num_blocks=4)
    assert c.num_blocks == 4 and F.MoKConfig().num_blocks == 0
    assert c != F.MoKConfig() and c == F.MoKConfig(num_blocks=4) and len({c, F.MoKConfig()}) == 2
    assert dataclasses.replace(c, minibatch_size=512).num_blocks == 4
    assert dataclasses.replace(c, num_blocks=2).num_blocks == 2
    assert "num_blocks=4" in repr(c)
    with pytest.raises(ValueError, match="num_blocks"):
        F.MoKConfig(num_blocks=-1)
    # The workspace cache tells them apart
    assert F.get_workspace(64, 32, 8, 2, 16, config=c) is not F.get_workspace(64, 32, 8, 2, 16)
    assert F.get_workspace(64, 32, 8, 2, 16, config=c).c_config().num_blocks == 4
    F.clear_workspace_cache()


def test_mokconfig_with_num_blocks_runs_through_nn_and_ops(gen):
    moe = mok.nn.MoE(64, 32, 8, 2, config=F.MoKConfig(num_blocks=4, num_threads=1))
    x = make_x(gen, 10, 64)
    y = moe(x)
    assert y.shape == x.shape and not torch.isnan(y).any()


def test_symmetric_entry_points_are_declared_or_not_implemented():
    for name in SYMMETRIC_SYMBOLS:
        if _lib.has_symbol(name):
            fn = _lib.symbol(name)
            assert fn.restype is ctypes.c_int and fn.argtypes is not None
        else:
            with pytest.raises(NotImplementedError, match=name):
                _lib.symbol(name)
    if not _lib.has_symbol("mokSymmetricBytes"):
        with pytest.raises(NotImplementedError, match="mokSymmetricBytes"):
            F.symmetric_bytes(F.LayerDims(512, 256, 16, 4, 300, 0, 2, 0), device="cuda:0")


@pytest.mark.skipif(not _lib.has_symbol("mokSymmetricBytes"), reason="libmok has no mokSymmetricBytes yet")
def test_symmetric_bytes_covers_the_byte_map():
    # A formula of the config: no device is touched
    for P, T, H, k in [(2, 300, 512, 4), (8, 4096, 7168, 8)]:
        dims = F.LayerDims(H, 256, 8 * P, k, T, 0, P, 0)
        nbytes = F.symmetric_bytes(dims, device="cuda:0")
        # flags, routing tables, x, combine slots (docs/design.md, "EP >= 2")
        assert nbytes >= 3 * P * 8 + P * T * k * 8 + T * H * 2 + T * k * H * 2
        assert F.symmetric_bytes(dims._replace(ep_rank=P - 1), device="cuda:0") == nbytes, "byte map differs per rank"
        assert F.symmetric_bytes(dims._replace(max_tokens=2 * T), device="cuda:0") > nbytes
        config = F.MoKConfig(num_blocks=16, minibatch_size=256, macrobatch_size=512)
        assert F.symmetric_bytes(dims, config, device="cuda:0") == nbytes, "knobs change the byte map"
    with pytest.raises(ValueError, match="num_experts"):
        F.symmetric_bytes(F.LayerDims(512, 256, 15, 4, 300, 0, 2, 0), device="cuda:0")


def test_symmetric_workspace_argument_errors():
    dims = F.LayerDims(512, 256, 16, 4, 300, 0, 2, 0)
    with pytest.raises(ValueError, match="runs on CUDA"):
        F.Workspace(dims, F.MoKConfig(), "cpu", regions=[4096, 8192])
    with pytest.raises(ValueError, match="1 symmetric regions for ep_size = 2"):
        F.Workspace(dims, F.MoKConfig(), "cuda:0", regions=[4096])
    with pytest.raises(ValueError, match="rank 1 has address 0x0"):
        F.Workspace.symmetric(dims, F.MoKConfig(), "cuda:0", [4096, 0])
    with pytest.raises(ValueError, match="pass group="):
        F.create_workspace(512, 256, 16, 4, 300, ep_size=2, device="cuda:0")
    with pytest.raises(ValueError, match="pass group="):
        F.get_workspace(512, 256, 16, 4, 300, ep_size=2, ep_rank=1, device="cuda:0")


def test_virtual_group_argument_errors():
    with pytest.raises(ValueError, match="CUDA device"):
        F.create_virtual_group(512, 256, 16, 4, 300, ep_size=2, device="cpu")
    with pytest.raises(ValueError, match="at least one rank"):
        F.create_virtual_group(512, 256, 16, 4, 300, ep_size=0, device="cuda:0")
    with pytest.raises(ValueError, match="multiple of ep_size"):
        F.create_virtual_group(512, 256, 15, 4, 300, ep_size=2, device="cuda:0")


# ---------------------------------------------------------------------------------------
# GPU helpers


TS = [300, 257, 384, 129, 311, 64, 290, 200]


def _ids(kind, gen, T, E, k, P):
    """Routing of one rank: (topk_ids int32 [T, k], topk_weights fp32 [T, k])."""
    ids, tw = make_routing(gen, T, E, k, masked=0.5 if kind == "masked" else 0.1)
    if kind == "one_expert":
        # Every token to expert E-1, its other routes spread over the rest
        ids = torch.rand(T, E - 1, generator=gen).argsort(dim=1)[:, :k].to(torch.int32)
        ids[:, 0] = E - 1
    elif kind == "zipf":
        # Expert e drawn with weight 1 / (e + 1)^1.2, k distinct per token: the first experts' owners hot
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
        ids = (torch.multinomial(p.expand(T, E), k, replacement=False, generator=gen).to(torch.int32) if T
               else torch.empty(0, k, dtype=torch.int32))
    elif kind == "one_rank":
        # Every route to rank 0's experts (as many as it owns), the rest masked
        local = E // P
        n = min(k, local)
        ids = torch.full((T, k), -1, dtype=torch.int32)
        ids[:, :n] = torch.rand(T, local, generator=gen).argsort(dim=1)[:, :n].to(torch.int32)
    return ids.contiguous(), tw


def _token_counts(kind, P):
    if kind == "empty_rank":
        return [0 if s == 1 else TS[s] for s in range(P)]
    if kind == "all_empty":
        return [0] * P
    if kind == "uneven":
        return [1, 480, 33, 300, 2, 400, 128, 0][:P]
    return TS[:P]


def _make_ranks(gen, P, H, I, E, k, counts, kind="uniform", I_s=0):
    """Per-rank CPU inputs: tokens, global routing, the rank's E/P experts, shared weights."""
    w = make_weights(gen, H, I, E, I_s)
    E_l = E // P
    ranks = []
    for s, T in enumerate(counts):
        ids, tw = _ids(kind, gen, T, E, k, P)
        local = {n: w[n][s * E_l:(s + 1) * E_l].contiguous() for n in ROUTED}
        ranks.append(F.RankInputs(make_x(gen, T, H), ids, tw, **local, **{n: w[n] for n in SHARED}))
    return ranks


def _to_cuda(rank: F.RankInputs) -> F.RankInputs:
    fields = {f.name: getattr(rank, f.name) for f in dataclasses.fields(rank)}
    return F.RankInputs(**{n: (None if t is None else t.cuda()) for n, t in fields.items()})


def _ep1_outputs(ranks, config=None):
    """Every rank's tokens in one EP = 1 CUDA call with all experts local (the ranks' weights
    concatenated), split back per rank."""
    x = torch.cat([r.x for r in ranks])
    ids = torch.cat([r.topk_ids for r in ranks])
    tw = torch.cat([r.topk_weights for r in ranks])
    weights = {n: torch.cat([getattr(r, n) for r in ranks]) for n in ROUTED}
    weights.update({n: getattr(ranks[0], n) for n in SHARED})
    ep1_config = dataclasses.replace(config or F.MoKConfig(), num_blocks=0)
    y, _ = F.forward(x, ids, tw, **weights, config=ep1_config)
    return list(torch.split(y, [r.x.shape[0] for r in ranks]))


def _assert_bitwise(name, got, want):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    a, b = got.view(torch.int16), want.view(torch.int16)
    if not torch.equal(a, b):
        rows = (a != b).any(dim=1).nonzero().flatten().tolist()
        raise AssertionError(f"{name}: {len(rows)} of {got.shape[0]} tokens differ in their bits "
                             f"(first: {rows[:8]})")


def _check_outputs(ys, ranks, ranks_cpu, E, config=None):
    """Bitwise vs EP = 1 per token, and vs the CPU reference (relative Frobenius < 1e-2)."""
    for r, (y, want) in enumerate(zip(ys, _ep1_outputs(ranks, config))):
        _assert_bitwise(f"rank {r} y vs EP=1", y, want)
    for r, (y, ref) in enumerate(zip(ys, F.forward_emulated(ranks_cpu, num_experts=E))):
        assert_close(f"rank {r} y vs CPU reference", y.cpu(), ref.double())


def _run_group(gen, P, E, k, counts, kind="uniform", config=None, I_s=0, H=512, I=256):
    ranks_cpu = _make_ranks(gen, P, H, I, E, k, counts, kind, I_s)
    ranks = [_to_cuda(r) for r in ranks_cpu]
    with F.create_virtual_group(H, I, E, k, max(max(counts), 1), I_s, ep_size=P, config=config) as group:
        assert group.config.num_blocks == (config.num_blocks if config and config.num_blocks else
                                           torch.cuda.get_device_properties(0).multi_processor_count // P)
        ys = group.forward(ranks)
        group.check_errors()
        _check_outputs(ys, ranks, ranks_cpu, E, config)


# ---------------------------------------------------------------------------------------
# GPU: virtual ranks


class TestVirtualRanks:
    pytestmark = GPU

    @pytest.mark.parametrize("P,E,k,I_s", [(2, 16, 4, 0), (2, 32, 8, 256), (4, 16, 4, 256), (4, 32, 8, 0),
                                           (8, 16, 4, 0), (8, 32, 8, 256)])
    def test_equals_ep1_bitwise_and_reference(self, gen, P, E, k, I_s):
        _run_group(gen, P, E, k, TS[:P], I_s=I_s)

    @pytest.mark.parametrize("kind", ["one_expert", "one_rank", "empty_rank", "all_empty", "masked", "uneven"])
    @pytest.mark.parametrize("P", [2, 4, 8])
    def test_skewed_routing_with_a_wrapping_ring(self, gen, P, kind):
        # Minibatches of 128 rows in a ring of 256: every rank's routed rows wrap it
        config = F.MoKConfig(minibatch_size=128, macrobatch_size=256)
        _run_group(gen, P, 16, 4, _token_counts(kind, P), kind, config)

    @pytest.mark.parametrize("P,E,k,I_s,kind", [(2, 16, 4, 0, "uniform"), (2, 16, 4, 256, "empty_rank"),
                                                (4, 32, 8, 256, "uniform"), (4, 16, 4, 0, "one_rank"),
                                                (8, 16, 4, 256, "uneven"), (4, 16, 4, 0, "all_empty")])
    @pytest.mark.parametrize("path", ["fused", "unfused"])
    def test_backward_dx_equals_ep1_bitwise_and_reference(self, gen, monkeypatch, P, E, k, I_s, kind, path):
        # The EP >= 2 backward (the fused kernel, and the unfused launches): each owner pulls
        # dy, x and the weights of its rows from their home ranks, pushes dx rows and d
        # topk_weights home; a token's dx and d topk_weights
        # equal EP = 1's bit for bit (same tiles per row), the weight gradients match the
        # emulated reference (their row order is the group's)
        monkeypatch.setenv("MOK_BACKWARD_PATH", path)
        H, I = 512, 256
        counts = _token_counts(kind, P)
        ranks_cpu = _make_ranks(gen, P, H, I, E, k, counts, kind, I_s)
        ranks = [_to_cuda(r) for r in ranks_cpu]
        dys_cpu = [make_x(gen, T, H) for T in counts]
        dys = [d.cuda() for d in dys_cpu]
        with F.create_virtual_group(H, I, E, k, max(max(counts), 1), I_s, ep_size=P) as group:
            grads = group.backward(ranks, dys)
            again = group.backward(ranks, dys)
            group.check_errors()
        for r in range(P):
            for name in ("dx", "d_topk_weights", *ROUTED, *(SHARED if I_s else ())):
                a, b = getattr(grads[r], name), getattr(again[r], name)
                assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                   b.view(torch.int16) if b.dtype == torch.bfloat16 else b), \
                    f"rank {r} {name}: two runs differ"
        # EP = 1 with every expert local
        weights = {n: torch.cat([getattr(rk, n) for rk in ranks]) for n in ROUTED}
        weights.update({n: getattr(ranks[0], n) for n in SHARED})
        ctx = F.recompute_forward_context(torch.cat([rk.x for rk in ranks]), torch.cat([rk.topk_ids for rk in ranks]),
                                          torch.cat([rk.topk_weights for rk in ranks]), **weights)
        g1 = F.backward(ctx, torch.cat(dys))
        for r, (dx, dtw) in enumerate(zip(torch.split(g1.dx, counts), torch.split(g1.d_topk_weights, counts))):
            _assert_bitwise(f"rank {r} dx vs EP=1", grads[r].dx, dx)
            assert torch.equal(grads[r].d_topk_weights, dtw), f"rank {r} d topk_weights differ from EP=1"
        ref = F.backward_emulated(ranks_cpu, dys_cpu, num_experts=E)
        E_l = E // P
        for r in range(P):
            for name in ("dx", "d_topk_weights", *ROUTED, *(SHARED if I_s else ())):
                assert_close(f"rank {r} {name} vs the emulated reference", getattr(grads[r], name).cpu(),
                             getattr(ref[r], name).double(), tol=1e-2)
            for name in ROUTED:
                assert_close(f"rank {r} {name} vs EP=1", getattr(grads[r], name).cpu(),
                             getattr(g1, name)[r * E_l:(r + 1) * E_l].cpu().double(), tol=1e-2)

    @pytest.mark.parametrize("path", ["fused", "unfused"])
    def test_backward_100_runs_bitwise_identical(self, gen, monkeypatch, path):
        monkeypatch.setenv("MOK_BACKWARD_PATH", path)
        P, E, k, counts = 4, 16, 4, [200, 0, 333, 64]
        ranks = [_to_cuda(r) for r in _make_ranks(gen, P, 512, 256, E, k, counts, "uniform", 256)]
        dys = [make_x(gen, T, 512).cuda() for T in counts]
        with F.create_virtual_group(512, 256, E, k, max(counts), 256, ep_size=P) as group:
            first = group.backward(ranks, dys)
            for run in range(100):
                again = group.backward(ranks, dys)
                for r in range(P):
                    for name in ("dx", "d_topk_weights", *ROUTED, *SHARED):
                        a, b = getattr(first[r], name), getattr(again[r], name)
                        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b), \
                            f"run {run} rank {r} {name} differs"
            group.check_errors()

    def test_explicit_num_blocks_and_comm_sms(self, gen):
        config = F.MoKConfig(num_blocks=12, fwd_num_comm_sms=2, minibatch_size=256, macrobatch_size=512)
        _run_group(gen, 4, 16, 4, TS[:4], config=config)

    @pytest.mark.parametrize("P", [2, 4, 8])
    def test_100_runs_bitwise_identical(self, gen, P):
        assert mok.config.poison_outputs, "conftest poisons every output"
        E, k = 16, 4
        ranks = [_to_cuda(r) for r in _make_ranks(gen, P, 512, 256, E, k, TS[:P], I_s=256)]
        with F.create_virtual_group(512, 256, E, k, max(TS[:P]), 256, ep_size=P) as group:
            first = group.forward(ranks)
            for run in range(100):
                again = group.forward(ranks)
                for r in range(P):
                    _assert_bitwise(f"run {run + 1} rank {r}", again[r], first[r])
            group.check_errors()

    def test_inputs_are_checked_before_any_rank_is_issued(self, gen):
        ranks = [_to_cuda(r) for r in _make_ranks(gen, 2, 512, 256, 16, 4, [300, 200])]
        with F.create_virtual_group(512, 256, 16, 4, 256, ep_size=2) as group:
            with pytest.raises(ValueError, match="rank 0 x has 300 tokens"):
                group.forward(ranks)
            with F.create_virtual_group(512, 256, 18, 4, 256, ep_size=3) as three:
                with pytest.raises(ValueError, match="2 rank inputs for a virtual group of 3"):
                    three.forward(ranks)
            wrong = dataclasses.replace(ranks[1], w_gate=torch.cat([ranks[1].w_gate] * 2))
            with pytest.raises(ValueError, match="rank 1 w_gate holds 16 experts"):
                group.forward([dataclasses.replace(ranks[0], x=ranks[0].x[:256], topk_ids=ranks[0].topk_ids[:256],
                                                   topk_weights=ranks[0].topk_weights[:256]), wrong])
            with pytest.raises(ValueError, match="rank 1 x is on cpu"):
                group.forward_rank(1, dataclasses.replace(ranks[1], x=ranks[1].x.cpu()))
            # Nothing was issued: the group still works
            ranks[0] = dataclasses.replace(ranks[0], x=ranks[0].x[:256], topk_ids=ranks[0].topk_ids[:256],
                                           topk_weights=ranks[0].topk_weights[:256])
            ys = group.forward(ranks)
            group.check_errors()
            for r, (y, want) in enumerate(zip(ys, _ep1_outputs(ranks))):
                _assert_bitwise(f"rank {r}", y, want)

    @pytest.mark.parametrize("P", [2, 4, 8])
    def test_graph_replays_with_new_inputs(self, gen, P):
        E, k, I_s = 16, 4, 256
        counts = TS[:P]
        static = [_to_cuda(r) for r in _make_ranks(gen, P, 512, 256, E, k, counts, I_s=I_s)]
        with F.create_virtual_group(512, 256, E, k, max(counts), I_s, ep_size=P) as group:
            group.forward(static)  # warm-up outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = group.forward(static)
            for _ in range(10):
                # New tokens and routing copied into the captured inputs
                for rank, new in zip(static, _make_ranks(gen, P, 512, 256, E, k, counts, "masked", I_s)):
                    rank.x.copy_(new.x)
                    rank.topk_ids.copy_(new.topk_ids)
                    rank.topk_weights.copy_(new.topk_weights)
                graph.replay()
                eager = group.forward(static)
                for r in range(P):
                    _assert_bitwise(f"rank {r} graph replay vs eager", captured[r], eager[r])
            group.check_errors()
            for r, (y, want) in enumerate(zip(captured, _ep1_outputs(static))):
                _assert_bitwise(f"rank {r} last replay vs EP=1", y, want)

    @pytest.mark.parametrize("kind", MULTI_KINDS)
    def test_multi_gpu_cases_on_virtual_ranks(self, seed, kind):
        # The cases and checks of TestMultiGPU (which needs 2+ GPUs) on a virtual group of 4:
        # the same inputs, the same oracle comparisons, so the multi-GPU test's own code has run
        ranks_cpu, dys_cpu = _multi_gpu_case(seed, 4, kind)
        got = _virtual_outputs([_to_cuda(r) for r in ranks_cpu], [d.cuda() for d in dys_cpu], 4)
        _check_multi_case(f"virtual EP=4 {kind}", seed, 4, kind, got, against_virtual=False)

    def test_a_rank_that_never_arrives_times_out(self, gen):
        ranks = [_to_cuda(r) for r in _make_ranks(gen, 2, 512, 256, 16, 4, [300, 200])]
        # A fresh group: after a timeout its workspaces may be unusable
        group = F.create_virtual_group(512, 256, 16, 4, 300, ep_size=2, config=F.MoKConfig(timeout_s=0.5))
        try:
            group.forward_rank(0, ranks[0])  # rank 1 never calls
            with pytest.raises(RuntimeError) as info:
                group.check_errors(wait=True)
            assert not isinstance(info.value, ValueError)
            message = str(info.value).lower()
            assert "rank" in message and ("peer" in message or "timeout" in message or "timed out" in message), message
        finally:
            group.close()

    @pytest.mark.parametrize("P", [2, 4])
    def test_transposed_weights_bitwise(self, gen, P):
        # Column-major (transposed) routed weights at EP >= 2: each rank's fused forward and backward
        # (the transposed policy) give the bits of the same group on row-major copies, y, dx,
        # d topk_weights and every gradient (written column-major, in the weights' orientation)
        H, I, E, k = 512, 256, 16, 4
        counts = _token_counts("uneven", P)
        ranks = [_to_cuda(r) for r in _make_ranks(gen, P, H, I, E, k, counts, "uniform", 256)]

        def col_major(t):
            return t.transpose(-1, -2).contiguous().transpose(-1, -2)

        transposed = [dataclasses.replace(r, **{n: col_major(getattr(r, n)) for n in ROUTED}) for r in ranks]
        dys = [make_x(gen, T, H).cuda() for T in counts]
        with F.create_virtual_group(H, I, E, k, max(max(counts), 1), 256, ep_size=P) as group:
            ys, grads = group.forward(ranks), group.backward(ranks, dys)
            ys_t, grads_t = group.forward(transposed), group.backward(transposed, dys)
            group.check_errors()
        for r in range(P):
            _assert_bitwise(f"rank {r} y", ys_t[r], ys[r])
            for name in ("dx", "d_topk_weights", *ROUTED, *SHARED):
                a, b = getattr(grads[r], name), getattr(grads_t[r], name)
                if name in ROUTED:
                    assert b.stride(-2) == 1, f"rank {r} grad {name}: not column-major"
                assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                   b.view(torch.int16) if b.dtype == torch.bfloat16 else b), \
                    f"rank {r} {name}: transposed weights differ from row-major ones"


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


class TestVirtualRanksFp8:
    """precision fp8_block at EP >= 2 on virtual ranks: each rank quantises its x per token into
    its region and the comm blocks pull the e4m3 rows and their scales; the backward pulls x and
    dy once per row, quantised in the pull, and pushes dx rows and d topk_weights home.  Every
    token's y, dx and d topk_weights, and every routed weight gradient, are EP = 1's bits (the
    same rows per expert, in the same order: the same 128-row column blocks of the wgrad
    operands); the shared expert's gradients are those of EP = 1 over the rank's own tokens."""
    pytestmark = GPU

    @staticmethod
    def _config(pow2, **kw):
        return F.MoKConfig(precision="fp8_block", fp8_pow2_scales=pow2, timeout_s=20, **kw)

    @pytest.mark.parametrize("P,E,k,I_s,kind,pow2,ring", [
        (2, 16, 4, 0, "uniform", False, 0), (2, 32, 8, 256, "empty_rank", True, 0),
        (4, 16, 4, 256, "one_rank", False, 256), (4, 32, 8, 0, "uneven", True, 256),
        (8, 16, 4, 256, "masked", False, 0), (4, 16, 4, 0, "all_empty", False, 0)])
    def test_forward_and_backward_equal_ep1_bitwise(self, gen, monkeypatch, P, E, k, I_s, kind, pow2, ring):
        import mok.config
        monkeypatch.setattr(mok.config, "poison_outputs", True)  # every output starts as NaN
        H, I = 512, 256
        counts = _token_counts(kind, P)
        ranks = [_to_cuda(r) for r in _make_ranks(gen, P, H, I, E, k, counts, kind, I_s)]
        dys = [make_x(gen, T, H).cuda() for T in counts]
        # ring 256: minibatches of 128 rows, every rank's routed rows wrap the forward's ring
        config = self._config(pow2, **(dict(minibatch_size=128, macrobatch_size=ring) if ring else {}))
        with F.create_virtual_group(H, I, E, k, max(max(counts), 1), I_s, ep_size=P, config=config) as group:
            ys = group.forward(ranks)
            grads = group.backward(ranks, dys)
            ys2, grads2 = group.forward(ranks), group.backward(ranks, dys)
            group.check_errors()
        for r in range(P):
            _assert_bitwise(f"rank {r} y, two runs", ys2[r], ys[r])
            for name in ("dx", "d_topk_weights", *ROUTED, *(SHARED if I_s else ())):
                assert torch.equal(_bits(getattr(grads2[r], name)), _bits(getattr(grads[r], name))), \
                    f"rank {r} {name}: two runs differ"
        # EP = 1 with every expert local, every rank's tokens in one call
        weights = {n: torch.cat([getattr(rk, n) for rk in ranks]) for n in ROUTED}
        weights.update({n: getattr(ranks[0], n) for n in SHARED})
        x, ids, tw = (torch.cat([getattr(rk, n) for rk in ranks]) for n in ("x", "topk_ids", "topk_weights"))
        ep1 = dataclasses.replace(config, num_blocks=0)
        y1, _ = F.forward(x, ids, tw, **weights, config=ep1)
        g1 = F.backward(F.recompute_forward_context(x, ids, tw, **weights, config=ep1), torch.cat(dys))
        for r, (y, dx, dtw) in enumerate(zip(torch.split(y1, counts), torch.split(g1.dx, counts),
                                             torch.split(g1.d_topk_weights, counts))):
            _assert_bitwise(f"rank {r} y vs EP=1", ys[r], y)
            _assert_bitwise(f"rank {r} dx vs EP=1", grads[r].dx, dx)
            assert torch.equal(grads[r].d_topk_weights, dtw), f"rank {r} d topk_weights differ from EP=1"
            assert torch.isfinite(ys[r].float()).all() and torch.isfinite(grads[r].dx.float()).all()
        E_l = E // P
        for r in range(P):
            for name in ROUTED:
                want = getattr(g1, name)[r * E_l:(r + 1) * E_l]
                assert torch.equal(_bits(getattr(grads[r], name)), _bits(want)), f"rank {r} {name} differs from EP=1"
            if I_s and counts[r] > 0:
                # The shared expert over the rank's own tokens: EP = 1 on those tokens alone
                sl = slice(sum(counts[:r]), sum(counts[:r + 1]))
                gr = F.backward(F.recompute_forward_context(x[sl], ids[sl], tw[sl], **weights, config=ep1), dys[r])
                for name in SHARED:
                    assert torch.equal(_bits(getattr(grads[r], name)), _bits(getattr(gr, name))), \
                        f"rank {r} {name} differs from EP=1 over its tokens"

    def test_against_the_bf16_group(self, gen):
        # The fp8 group's outputs against the bf16 group's (the same inputs): block-scaled e4m3
        # keeps y and dx within a few percent (relative Frobenius), reported
        P, H, I, E, k, I_s = 4, 512, 256, 16, 4, 256
        counts = TS[:P]
        ranks = [_to_cuda(r) for r in _make_ranks(gen, P, H, I, E, k, counts, "uniform", I_s)]
        dys = [make_x(gen, T, H).cuda() for T in counts]
        out = {}
        for prec in ("bf16", "fp8_block"):
            with F.create_virtual_group(H, I, E, k, max(counts), I_s, ep_size=P,
                                        config=F.MoKConfig(precision=prec)) as group:
                out[prec] = (group.forward(ranks), group.backward(ranks, dys))
                group.check_errors()
        for r in range(P):
            for name, a, b in [("y", out["fp8_block"][0][r], out["bf16"][0][r]),
                               ("dx", out["fp8_block"][1][r].dx, out["bf16"][1][r].dx),
                               ("dW_down", out["fp8_block"][1][r].w_down, out["bf16"][1][r].w_down)]:
                rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
                print(f"rank {r} {name}: fp8_block against bf16, relative Frobenius {rel:.3e}")
                assert rel < 0.08, f"rank {r} {name}: {rel}"


# ---------------------------------------------------------------------------------------
# Every visible GPU (2, 4 or 8): a real EP group over PyTorch symmetric memory




def _world() -> int:
    n = torch.cuda.device_count()
    return 8 if n >= 8 else (4 if n >= 4 else 2)


def _multi_gpu_counts(kind, world):
    if kind == "empty_rank":  # rank 1 has no tokens
        return [0 if r == 1 else c for r, c in enumerate(COUNTS_BY_WORLD[world])]
    if kind == "uneven":
        return _token_counts("uneven", world)
    return list(COUNTS_BY_WORLD[world])


def _multi_gpu_case(seed, world, kind="masked"):
    """Every rank's CPU inputs and dy of one case (the same in the workers and the parent)."""
    gen = torch.Generator().manual_seed(seed)
    counts = _multi_gpu_counts(kind, world)
    ranks = _make_ranks(gen, world, H2, I2, E2, K2, counts, kind, IS2)
    return ranks, [make_x(gen, T, H2) for T in counts]


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@contextlib.contextmanager
def _ep_process(rank, world, port):
    """A spawned rank's process group (NCCL, multicast off) on GPU `rank`, torn down at exit."""
    F.multicast_off_env()
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def _close_group_workspace(dist, ws):
    """Nobody frees its region while a peer may still use it."""
    torch.cuda.synchronize()
    dist.barrier()
    F.clear_workspace_cache()
    ws.close()


def _multi_gpu_worker(rank, world, port, seed, out_dir):
    """One rank of the EP group (spawned): per case its forward (saving h) and backward, run
    MULTI_RUNS times and bitwise the same every time; the first run's outputs saved for the parent."""
    mok.config.poison_outputs = True
    with _ep_process(rank, world, port) as dist:
        ws = F.get_workspace(H2, I2, E2, K2, MAX_T2, IS2, device=f"cuda:{rank}", group=dist.group.WORLD,
                             config=F.MoKConfig(**MULTI_CONFIG))
        assert ws.is_symmetric and (ws.dims.ep_size, ws.dims.ep_rank) == (world, rank)
        for kind in MULTI_KINDS:
            ranks, dys = _multi_gpu_case(seed, world, kind)
            mine, dy = _to_cuda(ranks[rank]), dys[rank].cuda()
            first = None
            for run in range(MULTI_RUNS.get(kind, 3)):
                y, ctx = F.forward(mine.x, mine.topk_ids, mine.topk_weights, mine.w_gate, mine.w_up, mine.w_down,
                                   mine.ws_gate, mine.ws_up, mine.ws_down, workspace=ws)
                g = F.backward(ctx, dy)
                out = {"y": y, "dx": g.dx, "d_topk_weights": g.d_topk_weights,
                       **{n: getattr(g, n) for n in ROUTED + SHARED}}
                if first is None:
                    first = {n: t.clone() for n, t in out.items()}
                    continue
                for n, t in out.items():
                    assert torch.equal(_bits(t), _bits(first[n])), \
                        f"rank {rank} {kind} run {run}: {n} differs from run 0"
            ws.check_errors()
            torch.save({n: t.cpu() for n, t in first.items()}, os.path.join(out_dir, f"{kind}_{rank}.pt"))
        _close_group_workspace(dist, ws)


def _missing_rank_worker(rank, world, port, seed, out_dir):
    """The last rank never calls, first the forward, then (fresh workspaces) the backward:
    every other rank's call comes back on its own with a timeout naming that peer."""
    absent = world - 1
    with _ep_process(rank, world, port) as dist:
        ranks, dys = _multi_gpu_case(seed, world)
        mine, dy = _to_cuda(ranks[rank]), dys[rank].cuda()
        args = (mine.x, mine.topk_ids, mine.topk_weights, mine.w_gate, mine.w_up, mine.w_down, mine.ws_gate,
                mine.ws_up, mine.ws_down)
        for phase, timeout in (("forward", 1.0), ("backward", 1.5)):  # a new timeout: a new workspace
            ws = F.get_workspace(H2, I2, E2, K2, MAX_T2, IS2, device=f"cuda:{rank}", group=dist.group.WORLD,
                                 config=F.MoKConfig(timeout_s=timeout, **MULTI_CONFIG))
            if rank != absent:
                if phase == "forward":
                    F.forward(*args, workspace=ws, save_for_backward=False)
                else:
                    F.backward(F.recompute_forward_context(*args, workspace=ws), dy)
                with pytest.raises(RuntimeError) as info:
                    ws.check_errors(wait=True)
                message = str(info.value)
                assert f"rank {rank}" in message and f"peer {absent}" in message, f"{phase}: {message}"
                with open(os.path.join(out_dir, f"{phase}_{rank}.txt"), "w") as f:
                    f.write(message)
            _close_group_workspace(dist, ws)


def _virtual_outputs(ranks, dys, world):
    """y and the gradients of every rank through a virtual group of `world` ranks on one GPU,
    in the workers' record layout (CPU tensors)."""
    config = F.MoKConfig(**MULTI_CONFIG)
    with F.create_virtual_group(H2, I2, E2, K2, MAX_T2, IS2, ep_size=world, config=config) as group:
        grads = group.backward(ranks, dys)
        ys = group.forward(ranks)
        group.check_errors()
    return [{"y": y.cpu(), "dx": g.dx.cpu(), "d_topk_weights": g.d_topk_weights.cpu(),
             **{n: getattr(g, n).cpu() for n in ROUTED + SHARED}} for y, g in zip(ys, grads)]


def _check_multi_case(tag, seed, world, kind, got, against_virtual):
    """got[r]: rank r's outputs of case `kind` (y, dx, d topk_weights, the weight gradients).
    Per token y, dx and d topk_weights bitwise equal to EP = 1 on one GPU (and, with
    against_virtual, to a virtual group of `world` ranks); y and every gradient against the
    float64 oracle: the routed experts' over every rank's tokens, the shared expert's over the
    rank's own (zero for a rank of no tokens)."""
    ranks_cpu, dys_cpu = _multi_gpu_case(seed, world, kind)
    ranks = [_to_cuda(r) for r in ranks_cpu]
    dys = [d.cuda() for d in dys_cpu]
    counts = [r.x.shape[0] for r in ranks_cpu]
    E_l = E2 // world
    for r, want in enumerate(_ep1_outputs(ranks)):
        _assert_bitwise(f"{tag} rank {r} y vs EP=1", got[r]["y"], want.cpu())
    # EP = 1 over every rank's tokens, every expert local
    weights = {n: torch.cat([getattr(rk, n) for rk in ranks]) for n in ROUTED}
    weights.update({n: getattr(ranks[0], n) for n in SHARED})
    cat = {n: torch.cat([getattr(rk, n) for rk in ranks]) for n in ("x", "topk_ids", "topk_weights")}
    g1 = F.backward(F.recompute_forward_context(cat["x"], cat["topk_ids"], cat["topk_weights"], **weights),
                    torch.cat(dys))
    for r, (dx, dtw) in enumerate(zip(torch.split(g1.dx, counts), torch.split(g1.d_topk_weights, counts))):
        _assert_bitwise(f"{tag} rank {r} dx vs EP=1", got[r]["dx"], dx.cpu())
        assert torch.equal(got[r]["d_topk_weights"], dtw.cpu()), f"{tag} rank {r} d topk_weights vs EP=1"
    if against_virtual:
        for r, v in enumerate(_virtual_outputs(ranks, dys, world)):
            for n in ("y", "dx"):
                _assert_bitwise(f"{tag} rank {r} {n} vs virtual EP={world}", got[r][n], v[n])
            assert torch.equal(got[r]["d_topk_weights"], v["d_topk_weights"]), \
                f"{tag} rank {r} d topk_weights vs virtual"
    w_cpu = {n: torch.cat([getattr(rk, n) for rk in ranks_cpu]) for n in ROUTED}
    w_cpu.update({n: getattr(ranks_cpu[0], n) for n in SHARED})
    x_all = torch.cat([rk.x for rk in ranks_cpu])
    ids_all = torch.cat([rk.topk_ids for rk in ranks_cpu])
    dy_all = torch.cat(dys_cpu)
    y64, ref = reference(x_all, ids_all, torch.cat([rk.topk_weights for rk in ranks_cpu]), w_cpu, dy_all)
    floors = torch.split(route_term_norms(x_all, ids_all, w_cpu, dy_all), counts)
    for r, (y_r, dx_r, dtw_r) in enumerate(zip(torch.split(y64, counts), torch.split(ref["dx"], counts),
                                               torch.split(ref["d_topk_weights"], counts))):
        assert_close(f"{tag} rank {r} y vs float64", got[r]["y"], y_r)
        assert_close(f"{tag} rank {r} dx vs float64", got[r]["dx"], dx_r)
        assert_close(f"{tag} rank {r} d topk_weights vs float64", got[r]["d_topk_weights"], dtw_r, floor=floors[r])
        for n in ROUTED:
            assert_close(f"{tag} rank {r} {n} vs float64", got[r][n], ref[n][r * E_l:(r + 1) * E_l])
        if counts[r] == 0:
            for n in SHARED:
                assert not got[r][n].float().any(), f"{tag} rank {r} (no tokens): {n} not zero"
            continue
        rk = ranks_cpu[r]
        _, ref_r = reference(rk.x, rk.topk_ids, rk.topk_weights, w_cpu, dys_cpu[r])
        for n in SHARED:
            assert_close(f"{tag} rank {r} {n} vs float64", got[r][n], ref_r[n])


class TestMultiGPU:
    pytestmark = GPU + [
        pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
        pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
                           reason="needs torch.distributed with NCCL"),
    ]

    def test_real_ep_forward_and_backward_equal_ep1_virtual_and_oracle(self, seed, tmp_path):
        # Every case (a masked routing, zipf, a rank of no tokens, uneven T) at real EP = P over
        # every GPU: per token y, dx and d topk_weights bitwise equal to EP = 1 on one GPU and to
        # virtual EP = P; y and every gradient against the float64 oracle; each case repeated
        # in the workers (100 runs for one) bitwise
        import torch.multiprocessing as mp

        world = _world()
        mp.spawn(_multi_gpu_worker, args=(world, _free_port(), seed, str(tmp_path)), nprocs=world, join=True)
        for kind in MULTI_KINDS:
            got = [torch.load(tmp_path / f"{kind}_{r}.pt") for r in range(world)]
            _check_multi_case(f"real EP={world} {kind}", seed, world, kind, got, against_virtual=True)

    def test_real_ep_missing_rank_times_out_naming_it(self, seed, tmp_path):
        import torch.multiprocessing as mp

        world = _world()
        mp.spawn(_missing_rank_worker, args=(world, _free_port(), seed, str(tmp_path)), nprocs=world, join=True)
        for phase in ("forward", "backward"):
            for r in range(world - 1):
                assert (tmp_path / f"{phase}_{r}.txt").exists(), f"{phase}: rank {r} reported nothing"
