"""Baselines of docs/benchmarks.md, written the way a strong engineer would: the torch EP=1
pipeline, the experts-only grouped GEMMs, the dense-rate floor, the NCCL+PyTorch and DeepEP+PyTorch EP≥2
forwards, a float64 reference on a token slice, and the mok entry.

Weight layouts are mok's: w_gate, w_up [E_l, I, H], w_down [E_l, H, I]; shared ws_gate, ws_up
[I_s, H], ws_down [H, I_s]. `torch._grouped_mm(a, b, offs)` computes a[rows of e] @ b[e], so the
weights go in as transposed views (K-major, no copy).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

COMBINES = ("gather", "index_add")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [M, K] rows grouped by offs (int32 cumulative ends, offs[-1] = M) times b [G, K, N].
    CUDA: torch._grouped_mm. CPU (smoke mode only): a per-expert loop of matmuls."""
    if a.is_cuda:
        return torch._grouped_mm(a, b, offs=offs)
    # CPU smoke-mode fallback: per-expert loop (reads offs on the host)
    ends = offs.tolist()
    if ends and ends[-1] != a.shape[0]:
        raise ValueError(f"grouped_mm loop: offs[-1] = {ends[-1]} but {a.shape[0]} rows")
    outs, start = [], 0
    for e, end in enumerate(ends):
        outs.append(a[start:end] @ b[e])
        start = end
    return torch.cat(outs)


def grouped_mm_backend(device) -> str:
    """Which grouped-GEMM path grouped_mm takes on `device`."""
    return "torch._grouped_mm" if torch.device(device).type == "cuda" else "per-expert loop (CPU smoke fallback)"


def route_plan(topk_ids: torch.Tensor, num_experts: int):
    """Sort the T·k routes by expert (stable), on the device with no host sync.

    Returns (perm, token, offs, valid): perm [N] int64 route index of each sorted row, token [N]
    int64 its token, offs [E] int32 cumulative row ends (offs[-1] = N), valid [N] bool route
    selected. The -1 routes join the last expert's group so that every row is written; callers
    give them weight 0, so they add exactly 0 to y and to every gradient."""
    flat = topk_ids.reshape(-1)
    valid = flat >= 0
    # Sort key: expert id, -1 routes in the last expert's group
    key = torch.where(valid, flat, num_experts - 1)
    sorted_key, perm = torch.sort(key, stable=True)
    token = torch.div(perm, topk_ids.shape[1], rounding_mode="floor")
    # Cumulative ends per expert from the sorted ids
    # NOTES: searchsorted, not bincount (which syncs to size its output) nor an item store
    # (offs[-1] = N copies from the host and syncs)
    experts = torch.arange(num_experts, device=flat.device, dtype=sorted_key.dtype)
    offs = torch.searchsorted(sorted_key, experts, right=True, out_int32=True)
    return perm, token, offs, valid


def _swiglu(gu: Optional[torch.Tensor], g: Optional[torch.Tensor] = None,
            u: Optional[torch.Tensor] = None) -> torch.Tensor:
    if gu is not None:
        g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def shared_forward(x: torch.Tensor, shared: Sequence[torch.Tensor]) -> torch.Tensor:
    """Shared expert as dense matmuls: shared = (ws_gate, ws_up, ws_down) or, fused,
    (ws_gateup [2·I_s, H], ws_down)."""
    if len(shared) == 2:
        ws_gateup, ws_down = shared
        h = _swiglu(x @ ws_gateup.t())
    else:
        ws_gate, ws_up, ws_down = shared
        h = _swiglu(None, x @ ws_gate.t(), x @ ws_up.t())
    return h @ ws_down.t()


def torch_ep1_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared=None, *,
                      w_gateup: Optional[torch.Tensor] = None, combine: str = "gather") -> torch.Tensor:
    """y [T, H] bf16 of one rank's MoE layer with all experts local (EP = 1), differentiable.

    Gate/up: one grouped GEMM on w_gateup [E, 2I, H] (fused) when given, else two on w_gate and
    w_up. combine='gather' (deterministic): the routing weight scales the SwiGLU output (bf16)
    before the down GEMM, rows are gathered back to [T, k, H] and summed over k with fp32
    accumulation. combine='index_add': fp32 weighted rows are scatter-added into an fp32 [T, H]
    (atomics: not bitwise reproducible)."""
    if combine not in COMBINES:
        raise ValueError(f"combine {combine!r}; expected one of {COMBINES}")
    num_tokens, topk = topk_ids.shape
    hidden = x.shape[1]
    num_experts = w_down.shape[0]
    # Sort routes by expert
    perm, token, offs, valid = route_plan(topk_ids, num_experts)
    weight = torch.where(valid, topk_weights.reshape(-1), 0.0).index_select(0, perm)
    # Gather rows in expert order
    a = x.index_select(0, token)
    # Gate/up grouped GEMM(s), SwiGLU
    if w_gateup is not None:
        h = _swiglu(grouped_mm(a, w_gateup.transpose(1, 2), offs))
    else:
        h = _swiglu(None, grouped_mm(a, w_gate.transpose(1, 2), offs), grouped_mm(a, w_up.transpose(1, 2), offs))
    # Down GEMM and weighted combine
    if combine == "gather":
        h = h * weight.to(h.dtype).unsqueeze(1)
        rows = grouped_mm(h, w_down.transpose(1, 2), offs)
        inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
        routes = rows.index_select(0, inv).view(num_tokens, topk, hidden)
        if shared is None:
            return routes.sum(dim=1)  # fp32 accumulation, one rounding to bf16
        y32 = routes.sum(dim=1, dtype=torch.float32)
    else:
        rows = grouped_mm(h, w_down.transpose(1, 2), offs)
        y32 = torch.zeros(num_tokens, hidden, device=x.device, dtype=torch.float32)
        y32 = y32.index_add(0, token, rows * weight.unsqueeze(1))
    # Shared expert last, one rounding
    if shared is not None:
        y32 = y32 + shared_forward(x, shared)
    return y32.to(x.dtype)


def rowwise_fp8(t: torch.Tensor):
    """t [..., K] -> (e4m3 t / s, s [...] fp32): one scale per row over all of K (max |t| / 448),
    the scaling torch._scaled_grouped_mm takes."""
    s = t.float().abs().amax(-1).clamp(min=1e-12) / 448.0
    return (t.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn), s


def torch_fp8_weights(w_gate, w_up, w_down):
    """The routed weights quantised rowwise for torch_fp8_forward, once (as a training step
    would cache them): ([E, 2I, H] e4m3, [E, 2I]), ([E, H, I] e4m3, [E, H])."""
    return rowwise_fp8(torch.cat([w_gate, w_up], dim=1)), rowwise_fp8(w_down)


def torch_fp8_forward(x, topk_ids, topk_weights, fp8_weights, shared=None) -> torch.Tensor:
    """y [T, H] bf16 of the routed layer (EP = 1) through torch's fp8 grouped GEMM: the routes sorted
    by expert, their rows of x quantised rowwise, torch._scaled_grouped_mm for gate/up, the
    SwiGLU in bf16 quantised rowwise, torch._scaled_grouped_mm for down, the weighted gather
    combine of torch_ep1_forward; the shared expert (if any) in bf16.  Forward only (torch's
    scaled grouped GEMM has no autograd here)."""
    (qgu, sgu), (qd, sd) = fp8_weights
    num_tokens, topk = topk_ids.shape
    perm, token, offs, valid = route_plan(topk_ids, qd.shape[0])
    weight = torch.where(valid, topk_weights.reshape(-1), 0.0).index_select(0, perm)
    qa, sa = rowwise_fp8(x.index_select(0, token))
    gu = torch._scaled_grouped_mm(qa, qgu.transpose(-2, -1), sa, sgu, offs=offs, out_dtype=torch.bfloat16)
    h = _swiglu(gu) * weight.to(torch.bfloat16).unsqueeze(1)
    qh, sh = rowwise_fp8(h)
    rows = torch._scaled_grouped_mm(qh, qd.transpose(-2, -1), sh, sd, offs=offs, out_dtype=torch.bfloat16)
    inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    y32 = rows.index_select(0, inv).view(num_tokens, topk, -1).sum(dim=1, dtype=torch.float32)
    if shared is not None:
        y32 = y32 + shared_forward(x, shared)
    return y32.to(x.dtype)


def experts_only(a_rows: torch.Tensor, offs: torch.Tensor, w_gateup: torch.Tensor, w_down: torch.Tensor,
                 h: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The two grouped GEMMs on pre-gathered rows a_rows [N, H]. Given h [N, I], the down GEMM
    reads it (GEMMs alone); else h = SiLU(gate)·up of the first GEMM (GEMMs + SwiGLU)."""
    gu = grouped_mm(a_rows, w_gateup.transpose(1, 2), offs)
    if h is None:
        h = _swiglu(gu)
    return grouped_mm(h, w_down.transpose(1, 2), offs)


def grouped_wgrad(a_t: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per group g: a_t[:, rows of g] · b[rows of g] -> [G, M, N] (a_t [M, R], b [R, N], K = rows).
    CUDA: torch._grouped_mm 2-D x 2-D with offs. CPU (smoke mode only): a per-expert loop."""
    if a_t.is_cuda:
        return torch._grouped_mm(a_t, b, offs=offs)
    outs, start = [], 0
    for end in offs.tolist():
        outs.append(a_t[:, start:end] @ b[start:end])
        start = end
    return torch.stack(outs)


def experts_only_backward(dy_rows: torch.Tensor, dgu: torch.Tensor, x_rows: torch.Tensor, act: torch.Tensor,
                          offs: torch.Tensor, w_gateup: torch.Tensor, w_down: torch.Tensor):
    """The experts' four backward GEMMs on pre-gathered rows (no SwiGLU, no gather):
    da = dy·W_down[e] [N, I], dx = [dg|du]·[W_gate; W_up][e] [N, H] (dgrad, the weights as
    stored), dW_down = dyᵀ·act [E, H, I], [dW_gate; dW_up] = [dg|du]ᵀ·x [E, 2I, H] (wgrad)."""
    return (grouped_mm(dy_rows, w_down, offs), grouped_mm(dgu, w_gateup, offs),
            grouped_wgrad(dy_rows.t(), act, offs), grouped_wgrad(dgu.t(), x_rows, offs))


def dense_floor_ms(flops: float, ceiling_tflops: float) -> float:
    """Milliseconds the FLOPs take at the dense matmul rate."""
    return flops / (ceiling_tflops * 1e9)


# ---------------------------------------------------------------------------------------
# EP ≥ 2: NCCL all_to_all + PyTorch (one rank's call)


def _all_to_all(rows: torch.Tensor, recv_splits, send_splits, group) -> torch.Tensor:
    """Differentiable all_to_all_single of rows (functional collectives, waited on)."""
    import torch.distributed._functional_collectives as fc

    return fc.wait_tensor(fc.all_to_all_single_autograd(rows, recv_splits, send_splits, group))


def nccl_ep_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, group, shared=None, *,
                    w_gateup: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y [T, H] of one rank under EP = size of `group` (this rank owns experts
    rank·E_l … (rank+1)·E_l − 1 of E = E_l·P; topk_ids in [0, E) or -1). Differentiable:
    autograd-aware all_to_all_single. One host sync for the exchanged counts, as the method needs."""
    import torch.distributed as dist

    num_ranks = dist.get_world_size(group)
    num_local, hidden = w_down.shape[0], x.shape[1]
    num_experts = num_local * num_ranks
    num_tokens, topk = topk_ids.shape
    device = x.device
    # Sort routes by global expert (so by destination rank too); -1 routes last
    flat = topk_ids.reshape(-1)
    valid = flat >= 0
    key = torch.where(valid, flat, num_experts)
    sorted_key, perm = torch.sort(key, stable=True)
    ends = torch.searchsorted(sorted_key, torch.arange(num_experts, device=device, dtype=sorted_key.dtype),
                              right=True)
    send_counts = torch.diff(ends, prepend=ends.new_zeros(1))
    # Exchange per-expert counts: row s of recv_counts = what rank s sends for my experts
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    counts = torch.stack([send_counts, recv_counts]).view(2, num_ranks, num_local).cpu()  # host sync
    send_splits = counts[0].sum(1).tolist()
    recv_splits = counts[1].sum(1).tolist()
    num_send, num_recv = sum(send_splits), sum(recv_splits)
    # Dispatch: gather the selected rows in expert order and exchange them
    perm = perm[:num_send]
    token = torch.div(perm, topk, rounding_mode="floor")
    rows = x.index_select(0, token)
    recv = _all_to_all(rows, recv_splits, send_splits, group)
    # Regroup received rows from (source rank, expert) to (expert, source rank) order
    local_ids = torch.arange(num_local, device=device).repeat(num_ranks)
    row_expert = torch.repeat_interleave(local_ids, recv_counts, output_size=num_recv)
    order = torch.sort(row_expert, stable=True).indices
    offs = torch.cumsum(recv_counts.view(num_ranks, num_local).sum(0), 0).to(torch.int32)
    a = recv.index_select(0, order)
    # Expert GEMMs (grouped) and SwiGLU
    if num_recv > 0:
        if w_gateup is not None:
            h = _swiglu(grouped_mm(a, w_gateup.transpose(1, 2), offs))
        else:
            h = _swiglu(None, grouped_mm(a, w_gate.transpose(1, 2), offs), grouped_mm(a, w_up.transpose(1, 2), offs))
        out = grouped_mm(h, w_down.transpose(1, 2), offs)
    else:
        out = a.new_zeros(0, hidden)
    # Back to (source rank, expert) order, and home
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(num_recv, device=device))
    back = _all_to_all(out.index_select(0, inv), send_splits, recv_splits, group)
    # Weighted sum per token in fp32 (scatter-add), shared expert last
    weight = topk_weights.reshape(-1).index_select(0, perm)
    y32 = torch.zeros(num_tokens, hidden, device=device, dtype=torch.float32)
    y32 = y32.index_add(0, token, back * weight.unsqueeze(1))
    if shared is not None:
        y32 = y32 + shared_forward(x, shared)
    return y32.to(x.dtype)


def deep_ep_available() -> bool:
    """True when `import deep_ep` works (the DeepEP+PyTorch baseline can run)."""
    try:
        import deep_ep  # noqa: F401
    except Exception:
        return False
    return True


# ---------------------------------------------------------------------------------------
# EP ≥ 2: DeepEP intranode dispatch/combine + PyTorch (one rank's call)


def deep_ep_buffer(group, hidden: int, num_nvl_bytes: Optional[int] = None):
    """A deep_ep.Buffer for intranode (NVLink) dispatch/combine of bf16 rows of `hidden`
    (collective over `group`: create it once, on every rank, and reuse it). Its NVLink buffer is
    DeepEP's size hint for the dispatch and combine configs of this group size, unless given."""
    import deep_ep
    import torch.distributed as dist

    num_ranks = dist.get_world_size(group)
    if num_nvl_bytes is None:
        hidden_bytes = hidden * 2
        hints = []
        for name in ("get_dispatch_config", "get_combine_config"):
            config = getattr(deep_ep.Buffer, name)(num_ranks)
            hints.append(config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
        num_nvl_bytes = max(hints)
    return deep_ep.Buffer(group, int(num_nvl_bytes), 0)


def deep_ep_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, buffer, shared=None, *,
                    w_gateup: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y [T, H] of one rank under EP = buffer's group size, with DeepEP's intranode dispatch and
    combine around the same grouped GEMMs as nccl_ep_forward (forward only).

    Dispatch sends each token once to every rank that owns one of its experts, with its ids made
    local (−1 for the other ranks' experts) and the per-local-expert row counts on the host (the
    host sync DeepEP's normal mode needs). The receiving rank sorts the selected (token, j) routes
    by local expert, runs the grouped GEMMs, sums each token's weighted routes in fp32 (scatter-add)
    and combine adds the per-rank partial sums at the token's home rank."""
    num_local, hidden = w_down.shape[0], x.shape[1]
    num_experts = num_local * buffer.group_size
    topk = topk_ids.shape[1]
    device = x.device
    ids = topk_ids.to(torch.int64)
    # Layout, then dispatch of the token rows, ids and weights
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, num_experts)
    recv_x, recv_ids, recv_weights, recv_counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=topk_weights.float())
    num_recv = recv_x.shape[0]
    num_rows = int(sum(recv_counts))
    # Selected routes sorted by local expert (stable); the other ranks' routes after the end
    flat = recv_ids.reshape(-1)
    key = torch.where(flat >= 0, flat, num_local)
    sorted_key, perm = torch.sort(key, stable=True)
    perm = perm[:num_rows]
    token = torch.div(perm, topk, rounding_mode="floor")
    offs = torch.searchsorted(sorted_key, torch.arange(num_local, device=device, dtype=sorted_key.dtype),
                              right=True, out_int32=True)
    # Expert GEMMs (grouped) and SwiGLU on the gathered rows
    partial = torch.zeros(num_recv, hidden, device=device, dtype=torch.float32)
    if num_rows > 0:
        a = recv_x.index_select(0, token)
        if w_gateup is not None:
            h = _swiglu(grouped_mm(a, w_gateup.transpose(1, 2), offs))
        else:
            h = _swiglu(None, grouped_mm(a, w_gate.transpose(1, 2), offs), grouped_mm(a, w_up.transpose(1, 2), offs))
        rows = grouped_mm(h, w_down.transpose(1, 2), offs)
        # Weighted sum of each received token's local routes in fp32
        weight = recv_weights.reshape(-1).index_select(0, perm)
        partial.index_add_(0, token, rows.float() * weight.unsqueeze(1))
    # Combine: the home rank adds the partial sums of every rank that served the token
    combined, _, _ = buffer.combine(partial.to(x.dtype), handle)
    if shared is None:
        return combined
    return (combined.float() + shared_forward(x, shared).float()).to(x.dtype)


# ---------------------------------------------------------------------------------------
# Float64 reference on a token slice


def reference_tokens(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared=None, *,
                     tokens: torch.Tensor, dy: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """float64 y of the listed tokens (and dx, d topk_weights given dy [T, H]), computed expert by
    expert from the bf16 values. shared = (ws_gate, ws_up, ws_down) or None."""
    xs = x.detach().index_select(0, tokens).double()
    ids = topk_ids.index_select(0, tokens).long()
    ws = topk_weights.detach().index_select(0, tokens).double()
    dys = None if dy is None else dy.index_select(0, tokens).double()
    y = torch.zeros_like(xs)
    dx = torch.zeros_like(xs)
    dtw = torch.zeros_like(ws)

    def expert(rows, wg, wu, wd, scale, slot):
        # One expert on some rows: forward, and backward given dy
        s_idx = rows
        xe = xs.index_select(0, s_idx)
        g, u = xe @ wg.t(), xe @ wu.t()
        sg = F.silu(g)
        o = (sg * u) @ wd.t()
        y.index_add_(0, s_idx, scale.unsqueeze(1) * o)
        if dys is not None:
            de = dys.index_select(0, s_idx)
            if slot is not None:
                dtw[s_idx, slot] = (de * o).sum(1)
            dh = (de * scale.unsqueeze(1)) @ wd
            sig = torch.sigmoid(g)
            dg = dh * u * sig * (1 + g * (1 - sig))
            du = dh * sg
            dx.index_add_(0, s_idx, dg @ wg + du @ wu)

    # Routed experts, one at a time in float64
    for e in torch.unique(ids[ids >= 0]).tolist():
        s_idx, j_idx = (ids == e).nonzero(as_tuple=True)
        expert(s_idx, w_gate[e].detach().double(), w_up[e].detach().double(), w_down[e].detach().double(),
               ws[s_idx, j_idx], j_idx)
    # Shared expert
    if shared is not None:
        ws_gate, ws_up, ws_down = (t.detach().double() for t in shared)
        all_rows = torch.arange(xs.shape[0], device=xs.device)
        expert(all_rows, ws_gate, ws_up, ws_down, torch.ones(xs.shape[0], dtype=xs.dtype, device=xs.device), None)
    out = {"y": y}
    if dys is not None:
        out.update(dx=dx, d_topk_weights=dtw)
    return out


def compare(got: torch.Tensor, ref: torch.Tensor) -> Dict[str, float]:
    """max-abs and relative-Frobenius error of got against a float64 reference."""
    diff = got.double() - ref
    norm = ref.norm().item()
    return {"max_abs": diff.abs().max().item() if diff.numel() else 0.0,
            "rel_fro": diff.norm().item() / norm if norm > 0 else diff.norm().item()}


# ---------------------------------------------------------------------------------------
# mok entry


def import_mok() -> Tuple[Any, str]:
    """(mok module, "") when `import mok` works, else (None, reason)."""
    try:
        import mok
        import mok.functional  # noqa: F401
    except Exception as exc:
        return None, f"not importable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return mok, ""


def mok_forward(mok, x, topk_ids, topk_weights, w_gate, w_up, w_down, shared=None, workspace=None, config=None):
    """y of mok.functional.forward (raises NotImplementedError where the kernels are not built);
    config: a mok.functional.MoKConfig (precision) for the workspace made on first use."""
    ws = tuple(shared) if shared is not None else (None, None, None)
    y, _ = mok.functional.forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, *ws, workspace=workspace,
                                  config=config)
    return y


def mok_forward_backward(mok, x, topk_ids, topk_weights, w_gate, w_up, w_down, dy, shared=None, workspace=None,
                         config=None):
    """(y, gradients) of mok.functional.forward then backward."""
    ws = tuple(shared) if shared is not None else (None, None, None)
    y, ctx = mok.functional.forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, *ws, workspace=workspace,
                                    config=config)
    return y, mok.functional.backward(ctx, dy)
