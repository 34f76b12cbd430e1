"""How a call's work is split across CTAs (runtime values, never compiled in)."""

from __future__ import annotations

from dataclasses import dataclass

from cute_kernels.sparse_mla_decode.config import REGISTERS_PER_SM, MergeConfig, PartialConfig

# One chunk (32 entries) per split when the grid needs splits at all: measured on the H200
# (scripts/bench.py, 2026-11-29) T=1 went from 17.9-20.4 us to 13.3-19.2 us against a
# minimum of 2 chunks, and no shape of the grid got slower beyond noise (< 1%).
MIN_CHUNKS_PER_SPLIT = 1
# A plan whose CTAs would have this many chunks or fewer, two to an SM, runs one CTA per SM
# with more chunks instead (``plan_splits``)
MAX_CHUNKS_TWO_PER_SM = 3
# The merge kernel combines at most this many splits (one of its threads per split).
MAX_SPLITS = MergeConfig().max_splits
DRIVER_SMEM_PER_CTA = 1024


@dataclass(frozen=True)
class SplitPlan:
    num_chunks: int  # chunks of block_n entries per token, main then extra
    chunks_per_split: int
    num_splits: int


def resident_ctas_per_sm(cfg: PartialConfig, smem_per_sm: int) -> int:
    """How many partial-kernel CTAs of ``cfg`` one SM holds at once (registers, shared memory).

    On sm_120 (100 KB of shared memory per SM) that is 1 for every configuration; on the
    H200 (228 KB) 2 for the "f16" kernel of either head-group count held to 128 registers
    (``two_ctas_per_sm``) and for the bf16 / FP8 one-group kernels (128 threads), 1 for the
    other two-group kernels (registers)."""
    by_registers = REGISTERS_PER_SM // (cfg.max_registers * cfg.num_threads)
    by_smem = smem_per_sm // (cfg.smem_bytes() + DRIVER_SMEM_PER_CTA)
    return max(1, min(by_registers, by_smem))


def two_bounded_f16_ctas_fit(smem_per_sm: int) -> bool:
    """Whether an SM with ``smem_per_sm`` bytes of shared memory holds two "f16" one-group
    CTAs held to 128 registers (the H200: yes; sm_120: no): where the dispatch plans the
    "f16" kernels two to an SM (the 32-head one too where its grid is large enough:
    ``variants.head_groups_for``) and the variant space has their bounded forms."""
    return resident_ctas_per_sm(PartialConfig(precision="f16", two_ctas_per_sm=True), smem_per_sm) > 1


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
                num_sms: int, smem_per_sm: int) -> SplitPlan:
    """Split each token's chunks so that the grid fills the GPU once: about as many CTAs as
    the SMs hold at once (``resident_ctas_per_sm``), and no more than ``MAX_SPLITS`` splits.

    One wave rather than several: a CTA with more chunks overlaps the gather of each chunk
    with the work on the previous one, and the merge has fewer splits to combine.

    Where that would put two CTAs of at most ``MAX_CHUNKS_TWO_PER_SM`` chunks on an SM, one
    CTA per SM with twice the chunks instead: measured on the H200 (``scripts/split_sweep.py``,
    BENCHMARKS.md) 1 x 128 x 1024 went from 18.3 to 16.0 us and 8 x 16 x 1024 from 19.3 to
    16.4 us (one chunk per CTA: nothing to overlap its gather with), and 8 x 64 x 512 from
    16.3 to 15.2 us (two chunks). The sweep of session 10 (every split count, 2026-12-01):
    three chunks two per SM lose too (8 x 64 x 128+512 16.7 us against 15.7 with one CTA per
    SM and five chunks; 16 x 128 x 192, 32 x 16 x 128+512, 4 x 64 x 1152 and 2 x 128 x
    128+1024 best where this rule puts them), four tie (8 x 64 x 1024 18.8 / 18.7, 8 x 128 x
    512 18.3 / 18.5) and eight win (8 x 128 x 1024 24.5 against 26.9 with sixteen).
    And where one CTA per SM then leaves only two splits, one split (final mode, no merge
    kernel): 64 x 16 x 128 14.1 -> 12.8 us in the sweep (the merge of 64 x 16 rows costs
    more than two more chunks), and in ``scripts/bench.py`` 64 x 16 x 128 14.0 -> 12.7 us and
    8 x 128 x 128 13.1 -> 12.2. (On sm_120 an SM holds one CTA anyway.) Checked again at the
    kernels of session 12 (2026-12-02, BENCHMARKS.md session 14): at 1 x 128 x 1024, 1 x 128 x
    128+512, 1 x 64 x 1024, 8 x 128 x 1024, 8 x 16 x 128 and 64 x 16 x 128 no split count beats
    this rule's by more than 0.1 us."""
    block_n = cfg.block_n
    num_chunks = -(-topk // block_n) + -(-extra_topk // block_n)
    base_ctas = ctas_per_split(num_tokens, num_heads, cfg)

    def split_for(slots: int) -> SplitPlan:
        wanted = min(max(1, slots // base_ctas), MAX_SPLITS)  # rounded down: never a second wave
        per_split = max(-(-num_chunks // wanted), min(MIN_CHUNKS_PER_SPLIT, num_chunks))
        return SplitPlan(num_chunks, per_split, -(-num_chunks // per_split))

    plan = split_for(resident_ctas_per_sm(cfg, smem_per_sm) * num_sms)
    if plan.chunks_per_split <= MAX_CHUNKS_TWO_PER_SM and base_ctas * plan.num_splits > num_sms:
        plan = split_for(num_sms)
        if plan.num_splits == 2:
            plan = SplitPlan(num_chunks, num_chunks, 1)
    return plan
