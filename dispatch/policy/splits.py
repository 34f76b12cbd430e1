"""How a call's work is split across CTAs (runtime values, never compiled in)."""

from __future__ import annotations

from dataclasses import dataclass

from cute_kernels.sparse_mla_decode.config import MergeConfig, PartialConfig
from cute_kernels.sparse_mla_decode.tuning import (MAX_CHUNKS_TWO_PER_SM, MAX_PLANNED_SPLITS, MIN_CHUNKS_PER_SPLIT,
                                                   MIN_DEALT_SPLITS_ONE_PER_SM)

from .occupancy import ctas_per_split, resident_ctas_per_sm

# The merge kernel combines at most this many splits (one of its threads per split).
MAX_SPLITS = MergeConfig().max_splits


@dataclass(frozen=True)
class SplitPlan:
    num_chunks: int  # chunks of block_n entries per token, main then extra
    chunks_per_split: int
    num_splits: int


def two_ctas_per_sm(cfg: PartialConfig, plan: SplitPlan, *, num_tokens: int, num_heads: int, num_sms: int,
                    smem_per_sm: int) -> bool:
    """Whether the planned grid runs two CTAs at once on some SM, so that the kernel must be
    held to half the registers (``PartialConfig.two_ctas_per_sm``): only for a ``cfg`` planned
    that way (``head_groups.partial_shape_config``), on a GPU whose SMs hold two (the
    H200, not sm_120), and a grid of more CTAs than SMs. Otherwise each SM runs at most one
    CTA and the kernel may use every register."""
    if not cfg.two_ctas_per_sm or resident_ctas_per_sm(cfg, smem_per_sm) < 2:
        return False
    return ctas_per_split(num_tokens, num_heads, cfg) * plan.num_splits > num_sms


def plan_splits(num_tokens: int, num_heads: int, topk: int, extra_topk: int, *, cfg: PartialConfig,
                num_sms: int, smem_per_sm: int, max_splits: int = MAX_SPLITS, dealt: bool = False) -> SplitPlan:
    """Split each token's chunks so that the grid fills the GPU once: about as many CTAs as
    the SMs hold at once (``resident_ctas_per_sm``), and no more than ``MAX_PLANNED_SPLITS``
    splits (the merge's largest batch: it loads them with their lse values in one round trip).

    One wave rather than several: a CTA with more chunks overlaps the gather of each chunk
    with the work on the previous one, and the merge has fewer splits to combine. Where that
    would put two CTAs of at most ``MAX_CHUNKS_TWO_PER_SM`` chunks on an SM, one CTA per SM
    with twice the chunks instead, and where one CTA per SM then leaves only two splits, one
    split (final mode, no merge kernel). ``max_splits``: fewer than ``MAX_SPLITS`` (a list of
    a call of two formats, whose splits the merge combines with the other list's).

    ``dealt``: the call has a length tensor, so its kernel deals the chunks the lengths reach
    out across the splits (``gather.ChunkGather.bound_chunks``). The host plans for the lists'
    widths, not knowing the lengths, and a list wider than its lengths (vLLM 0.34's ratio-128
    rows, ``vllm/models/deepseek_v4/common/ops/cache_utils.py`` l. 669-671: ``docs/design.md``)
    leaves most of those CTAs one chunk or none: where its grid would put two "f16" CTAs held
    to 128 registers on an SM (``cfg.two_ctas_per_sm``), it is planned for one CTA per SM
    instead, with every register, if that still gives each token
    ``MIN_DEALT_SPLITS_ONE_PER_SM`` splits. (The head groups were chosen before, on the plans
    for the widths: ``head_groups.head_groups_for``.)
    ``docs/tuning.md`` has the measurements."""
    block_n = cfg.block_n
    num_chunks = -(-topk // block_n) + -(-extra_topk // block_n)
    base_ctas = ctas_per_split(num_tokens, num_heads, cfg)
    if base_ctas <= 0:
        raise ValueError(f"a split plan needs at least one token and one head, got num_tokens={num_tokens}, "
                         f"num_heads={num_heads}")

    def split_for(slots: int) -> SplitPlan:
        # rounded down: never a second wave; at most one merge batch of splits
        wanted = min(max(1, slots // base_ctas), max_splits, MAX_PLANNED_SPLITS)
        per_split = max(-(-num_chunks // wanted), min(MIN_CHUNKS_PER_SPLIT, num_chunks))
        return SplitPlan(num_chunks, per_split, -(-num_chunks // per_split))

    plan = split_for(resident_ctas_per_sm(cfg, smem_per_sm) * num_sms)
    if base_ctas * plan.num_splits > num_sms:  # two CTAs on some SM
        one_per_sm = split_for(num_sms)
        if plan.chunks_per_split <= MAX_CHUNKS_TWO_PER_SM:
            plan = one_per_sm if one_per_sm.num_splits != 2 else SplitPlan(num_chunks, num_chunks, 1)
        elif dealt and cfg.two_ctas_per_sm and one_per_sm.num_splits >= MIN_DEALT_SPLITS_ONE_PER_SM:
            plan = one_per_sm
    return plan
