"""Shared pieces of the GPU tests' inputs: per-token lengths and per-head sinks of each kind
the cases name (CPU tensors, drawn from the case's generator)."""

from __future__ import annotations

import math

import torch


def lengths_of(kind: str | None, T: int, topk: int, gen: torch.Generator) -> torch.Tensor | None:
    """int32 ``[T]`` lengths: None; "random" in [0, topk]; "short" in [0, topk / 16] (a
    ratio-128 row: about seq / 128 valid entries of its width); "edge": 0, past topk, negative,
    exactly topk, 1, INT32_MAX, then random."""
    if kind is None:
        return None
    if kind in ("random", "short"):
        vals = torch.randint(0, (topk if kind == "random" else topk // 16) + 1, (T,), generator=gen)
    else:
        edge = torch.tensor([0, topk + 7, -5, topk, 1, 2**31 - 1], dtype=torch.int64)
        vals = torch.cat([edge, torch.randint(0, topk + 1, (max(T - len(edge), 0),), generator=gen)])[:T]
    return vals.to(torch.int32)


def sink_of(kind: str | None, H: int, gen: torch.Generator) -> torch.Tensor | None:
    """float32 ``[H]`` sinks: None; "finite"; "+inf"; "-inf"; "mixed" (finite, +inf and -inf heads)."""
    if kind is None:
        return None
    if kind in ("+inf", "-inf"):
        return torch.full((H,), math.inf if kind == "+inf" else -math.inf)
    vals = torch.randn(H, generator=gen) * 3 + 4
    if kind == "mixed":
        vals[0::3] = math.inf
        vals[1::3] = -math.inf
    return vals.float()
