"""How a call's work is split across CTAs (runtime values, never compiled in)."""

from __future__ import annotations

from dataclasses import dataclass

MIN_CHUNKS_PER_SPLIT = 2  # below this the merge traffic outweighs the extra parallelism
CTAS_PER_SM_TARGET = 2


@dataclass(frozen=True)
class SplitPlan:
    num_chunks: int  # chunks of block_n entries per token, main then extra
    chunks_per_split: int
    num_splits: int


def plan_splits(num_tokens: int, num_heads: int, topk: int, extra_topk: int, *, heads_per_cta: int,
                block_n: int, num_sms: int) -> SplitPlan:
    """Split each token's chunks so that the grid has about ``CTAS_PER_SM_TARGET`` CTAs per SM."""
    num_chunks = -(-topk // block_n) + -(-extra_topk // block_n)
    base_ctas = num_tokens * -(-num_heads // heads_per_cta)
    wanted = max(1, -(-(CTAS_PER_SM_TARGET * num_sms) // base_ctas))
    per_split = max(-(-num_chunks // wanted), min(MIN_CHUNKS_PER_SPLIT, num_chunks))
    return SplitPlan(num_chunks, per_split, -(-num_chunks // per_split))
