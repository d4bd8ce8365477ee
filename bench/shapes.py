"""Benchmark shapes of docs/benchmarks.md by name, and deterministic routing generators."""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class Shape:
    """Per-GPU load of one MoE layer: E_l local experts, T tokens before routing."""

    name: str
    H: int
    I: int
    k: int
    E_l: int
    T: int
    I_s: int = 0  # shared-expert intermediate size (0: no shared expert)
    models: str = ""

    @property
    def layer(self) -> Tuple[int, int, int, int, int]:
        """(H, I, k, E_l, T): what the tools and tests unpack."""
        return self.H, self.I, self.k, self.E_l, self.T

    @property
    def rows_per_expert(self) -> int:
        """Routed rows per local expert with uniform routing, T·k / E_l."""
        return self.T * self.k // self.E_l

    @property
    def rows(self) -> int:
        """Routed rows T·k (every route selected)."""
        return self.T * self.k

    def with_shared(self, on: bool) -> "Shape":
        """The same shape with a shared expert of I_s = I (on) or none (off)."""
        return dataclasses.replace(self, I_s=self.I if on else 0)


SHAPES: Dict[str, Shape] = {s.name: s for s in (
    Shape("dsv3", 7168, 2048, 8, 16, 4096, models="DeepSeek-V3, Kimi K2.x"),
    Shape("dsv3-t2k", 7168, 2048, 8, 16, 2048, models="DeepSeek-V3, 2,048 tokens per GPU"),
    Shape("qwen3", 4096, 1536, 8, 32, 4096, models="Qwen3-235B-A22B"),
    Shape("qwen35", 4096, 1024, 10, 16, 4096, models="Qwen3.5-397B-A17B"),
    Shape("glm5", 6144, 2048, 8, 16, 4096, models="GLM-5.x"),
    Shape("dsv4pro", 7168, 3072, 6, 12, 4096, models="DeepSeek-V4-Pro"),
    Shape("fg30b", 4096, 1024, 4, 64, 32768, models="fine-grained 30B-class MoE, 32k tokens per GPU"),
    Shape("fg120b", 4096, 2048, 4, 64, 32768, models="fine-grained 120B-class MoE, 32k tokens per GPU"),
)}

# The expert dimensions of released models (the checkpoints' config.json: hidden_size,
# moe_intermediate_size or intermediate_size, shared-expert width, routed experts, top-k).
# T is a per-GPU token count for benchmarks; tests scale E and T down and keep H, I and I_s.
MODELS: Dict[str, Shape] = {s.name: s for s in (
    Shape("glm45air", 4096, 1408, 8, 128, 4096, I_s=1408, models="GLM-4.5-Air"),
    Shape("dsv2lite", 2048, 1408, 6, 64, 4096, I_s=2816, models="DeepSeek-V2-Lite"),
    Shape("qwen15moe", 2048, 1408, 4, 60, 4096, I_s=5632, models="Qwen1.5-MoE-A2.7B"),
    Shape("gptoss20b", 2880, 2880, 4, 32, 4096, models="gpt-oss-20b"),
    Shape("olmoe", 2048, 1024, 8, 64, 4096, models="OLMoE-1B-7B"),
    Shape("qwen3_30b", 2048, 768, 8, 128, 4096, models="Qwen3-30B-A3B"),
    Shape("mixtral", 4096, 14336, 2, 8, 4096, models="Mixtral-8x7B"),
)}

# CPU smoke shape: small, T·k a multiple of 8, more experts than k.
TINY = Shape("tiny", 64, 32, 4, 8, 96, models="CPU smoke test")

ROUTINGS = ("uniform", "zipf")
ZIPF_SLOPE = 1.2


def parse_shapes(spec: str) -> List[Shape]:
    """Shapes from a comma-separated list of names, or 'all'."""
    if spec.strip() == "all":
        return list(SHAPES.values())
    out = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        if name == TINY.name:
            out.append(TINY)
        elif name in SHAPES:
            out.append(SHAPES[name])
        else:
            raise ValueError(f"unknown shape {name!r}; expected 'all' or some of {sorted(SHAPES)}")
    return out


def make_routing(kind: str, num_tokens: int, num_experts: int, topk: int, *, seed: int,
                 device, drop: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int32 [T, k], topk_weights fp32 [T, k]) on `device`, the same for a given seed
    on every device (drawn on the CPU).

    uniform: softmax over N(0, 1) logits, top-k, the top-k probabilities renormalised.
    zipf: the same with logit bias -1.2·log(rank) for expert e of rank e + 1, so low ids are popular.
    drop > 0 sets that fraction of routes to -1 ("no selection"; their weight stays as drawn).
    """
    if kind not in ROUTINGS:
        raise ValueError(f"routing {kind!r}; expected one of {ROUTINGS}")
    if not 0 < topk <= num_experts:
        raise ValueError(f"top-{topk} of {num_experts} experts")
    gen = torch.Generator().manual_seed(seed)
    # Random logits, biased toward low expert ids for zipf
    logits = torch.randn(num_tokens, num_experts, generator=gen, dtype=torch.float32)
    if kind == "zipf":
        rank = torch.arange(1, num_experts + 1, dtype=torch.float32)
        logits = logits - ZIPF_SLOPE * torch.log(rank)
    # Top-k of the softmax, renormalised over the selected experts
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, topk, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    ids = ids.to(torch.int32)
    # Optional "no selection" routes
    if drop > 0:
        mask = torch.rand(num_tokens, topk, generator=gen) < drop
        ids = ids.masked_fill(mask, -1)
    return ids.to(device), weights.to(device)


def expert_load(topk_ids: torch.Tensor, num_experts: int) -> Dict[str, float]:
    """Rows per expert: min, max, and max over mean (1 = balanced)."""
    ids = topk_ids.reshape(-1)
    counts = torch.bincount(ids[ids >= 0].long(), minlength=num_experts).float()
    mean = counts.mean().item()
    return {"min": counts.min().item(), "max": counts.max().item(),
            "imbalance": counts.max().item() / mean if mean > 0 else math.nan}
