"""How a call's work is split across CTAs (runtime values, never compiled in)."""

from __future__ import annotations

from dataclasses import dataclass

from cute_kernels.sparse_mla_decode.config import MergeConfig

# One chunk (32 entries) per split when the grid needs splits at all: measured on the H200
# (scripts/bench.py, 2026-11-29) T=1 went from 17.9-20.4 us to 13.3-19.2 us against a
# minimum of 2 chunks, and no shape of the grid got slower beyond noise (< 1%).
MIN_CHUNKS_PER_SPLIT = 1
CTAS_PER_SM_TARGET = 2
# The merge kernel combines at most this many splits (one of its threads per split).
MAX_SPLITS = MergeConfig().max_splits


@dataclass(frozen=True)
class SplitPlan:
    num_chunks: int  # chunks of block_n entries per token, main then extra
    chunks_per_split: int
    num_splits: int


def plan_splits(num_tokens: int, num_heads: int, topk: int, extra_topk: int, *, heads_per_cta: int,
                block_n: int, num_sms: int) -> SplitPlan:
    """Split each token's chunks so that the grid has about ``CTAS_PER_SM_TARGET`` CTAs per SM
    (and no more than ``MAX_SPLITS`` splits)."""
    num_chunks = -(-topk // block_n) + -(-extra_topk // block_n)
    base_ctas = num_tokens * -(-num_heads // heads_per_cta)
    wanted = min(max(1, -(-(CTAS_PER_SM_TARGET * num_sms) // base_ctas)), MAX_SPLITS)
    per_split = max(-(-num_chunks // wanted), min(MIN_CHUNKS_PER_SPLIT, num_chunks))
    return SplitPlan(num_chunks, per_split, -(-num_chunks // per_split))
