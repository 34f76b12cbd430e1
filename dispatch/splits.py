"""How a call's work is split across CTAs (runtime values, never compiled in)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from cute_kernels.arch import REGISTERS_PER_SM, RESERVED_SMEM_PER_CTA
from cute_kernels.sparse_mla_decode.config import MergeConfig, PartialConfig
from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT
from cute_kernels.sparse_mla_decode.tuning import MAX_CHUNKS_TWO_PER_SM, MIN_CHUNKS_PER_SPLIT

# The merge kernel combines at most this many splits (one of its threads per split).
MAX_SPLITS = MergeConfig().max_splits


@dataclass(frozen=True)
class SplitPlan:
    num_chunks: int  # chunks of block_n entries per token, main then extra
    chunks_per_split: int
    num_splits: int


@functools.lru_cache(maxsize=1024)
def resident_ctas_per_sm(cfg: PartialConfig, smem_per_sm: int) -> int:
    """How many partial-kernel CTAs of ``cfg`` one SM holds at once (registers, shared memory).

    On sm_120 (100 KB of shared memory per SM) that is 1 for every configuration; on the
    H200 (228 KB) 2 for the "f16" kernel of either head-group count held to 128 registers
    (``two_ctas_per_sm``) and for the bf16 / FP8 one-group kernels (128 threads), 1 for the
    other two-group kernels (registers). Cached: a configuration's shared memory plan is the
    costly part of selecting a call's kernels, and a few configurations serve every call."""
    by_registers = REGISTERS_PER_SM // (cfg.max_registers * cfg.num_threads)
    by_smem = smem_per_sm // (cfg.smem_bytes() + RESERVED_SMEM_PER_CTA)
    return max(1, min(by_registers, by_smem))


@functools.lru_cache(maxsize=None)
def f16_bound_allowed(kv_format: str = DEFAULT_FORMAT) -> bool:
    """Whether the "f16" kernel of ``kv_format`` can be held to 128 registers at all: only
    where it has 256 threads (MODEL1's 7 nope warps and its rope warp; the formats of 512
    nope dims have 8 nope warps, 288 threads, and cannot), as ``PartialConfig.check`` says."""
    try:
        PartialConfig(kv_format=kv_format, precision="f16", two_ctas_per_sm=True).check()
    except ValueError:
        return False
    return True


def two_bounded_f16_ctas_fit(smem_per_sm: int, kv_format: str = DEFAULT_FORMAT) -> bool:
    """Whether an SM with ``smem_per_sm`` bytes of shared memory holds two "f16" one-group
    CTAs of ``kv_format`` held to 128 registers (MODEL1 on the H200: yes; on sm_120: no;
    a format whose "f16" kernel cannot be bounded: never): where the dispatch plans the
    "f16" kernels two to an SM (the 32-head one too where its grid is large enough:
    ``variants.head_groups_for``) and the variant space has their bounded forms."""
    if not f16_bound_allowed(kv_format):
        return False
    cfg = PartialConfig(kv_format=kv_format, precision="f16", two_ctas_per_sm=True)
    return resident_ctas_per_sm(cfg, smem_per_sm) > 1


def ctas_per_split(num_tokens: int, num_heads: int, cfg: PartialConfig) -> int:
    """The CTAs one split of a call launches: one per token and block of ``cfg.heads_per_cta`` heads."""
    return num_tokens * -(-num_heads // cfg.heads_per_cta)


def two_ctas_per_sm(cfg: PartialConfig, plan: SplitPlan, num_tokens: int, num_heads: int, num_sms: int,
                    smem_per_sm: int) -> bool:
    """Whether the planned grid runs two CTAs at once on some SM, so that the kernel must be
    held to half the registers (``PartialConfig.two_ctas_per_sm``): only for a ``cfg`` planned
    that way (``dispatch.variants.partial_shape_config``), on a GPU whose SMs hold two (the
    H200, not sm_120), and a grid of more CTAs than SMs. Otherwise each SM runs at most one
    CTA and the kernel may use every register."""
    if not cfg.two_ctas_per_sm or resident_ctas_per_sm(cfg, smem_per_sm) < 2:
        return False
    return ctas_per_split(num_tokens, num_heads, cfg) * plan.num_splits > num_sms


def plan_splits(num_tokens: int, num_heads: int, topk: int, extra_topk: int, *, cfg: PartialConfig,
                num_sms: int, smem_per_sm: int, max_splits: int = MAX_SPLITS) -> SplitPlan:
    """Split each token's chunks so that the grid fills the GPU once: about as many CTAs as
    the SMs hold at once (``resident_ctas_per_sm``), and no more than ``MAX_SPLITS`` splits.

    One wave rather than several: a CTA with more chunks overlaps the gather of each chunk
    with the work on the previous one, and the merge has fewer splits to combine. Where that
    would put two CTAs of at most ``MAX_CHUNKS_TWO_PER_SM`` chunks on an SM, one CTA per SM
    with twice the chunks instead, and where one CTA per SM then leaves only two splits, one
    split (final mode, no merge kernel). ``max_splits``: fewer than ``MAX_SPLITS`` (a list of
    a call of two formats, whose splits the merge combines with the other list's).
    ``docs/tuning.md`` has the measurements."""
    block_n = cfg.block_n
    num_chunks = -(-topk // block_n) + -(-extra_topk // block_n)
    base_ctas = ctas_per_split(num_tokens, num_heads, cfg)
    if base_ctas <= 0:
        raise ValueError(f"a split plan needs at least one token and one head, got num_tokens={num_tokens}, "
                         f"num_heads={num_heads}")

    def split_for(slots: int) -> SplitPlan:
        wanted = min(max(1, slots // base_ctas), max_splits)  # rounded down: never a second wave
        per_split = max(-(-num_chunks // wanted), min(MIN_CHUNKS_PER_SPLIT, num_chunks))
        return SplitPlan(num_chunks, per_split, -(-num_chunks // per_split))

    plan = split_for(resident_ctas_per_sm(cfg, smem_per_sm) * num_sms)
    if plan.chunks_per_split <= MAX_CHUNKS_TWO_PER_SM and base_ctas * plan.num_splits > num_sms:
        plan = split_for(num_sms)
        if plan.num_splits == 2:
            plan = SplitPlan(num_chunks, num_chunks, 1)
    return plan
