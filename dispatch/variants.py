"""Variant keys: the one place that says which kernels are compiled, and for which call.

A variant is a kernel configuration plus a target arch. Everything else about a call
(num_tokens, num_heads, topk, extra_topk, page block sizes, strides, the split of the work)
is a runtime argument, so the set of variants is small and closed:

    partial: precision (``precisions_for(arch)``) x head_groups (1 or 2: ``head_groups_for``) x has_topk_length x
             has_extra_topk_length x (split mode | final mode without sink | final mode with sink),
             and for the "f16" kernel on an arch whose SMs hold two of it (sm_90a),
             x two_ctas_per_sm (the 128-register launch bound: ``splits.two_ctas_per_sm``)
    merge:   has_sink x split_batch (``merge_batch_for(num_splits)``)

A call whose work needs one split runs the partial kernel in final mode (it writes out
and lse itself); otherwise the partial kernel writes per-split partials and the merge
kernel combines them. ``variant_space(arch)`` enumerates the set;
``variants_for(metadata, arch, num_splits, head_groups, two_ctas_per_sm=...)`` picks from it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from cute_kernels.arch import SMEM_PER_SM_BY_ARCH
from cute_kernels.sparse_mla_decode.config import (
    BLOCK_SCALED_ARCHS, HEAD_GROUPS, MERGE_BATCHES, PRECISIONS, MergeConfig, PartialConfig, merge_batch_for,
)

from .metadata import DecodeMetadata
from .splits import ctas_per_split, plan_splits, resident_ctas_per_sm, two_bounded_f16_ctas_fit, two_ctas_per_sm

DEFAULT_PRECISION = "f16"


@dataclass(frozen=True)
class KernelVariant:
    """One compiled unit: a kernel configuration for one target arch."""

    config: PartialConfig | MergeConfig
    arch: str

    @property
    def kind(self) -> str:
        return "partial" if isinstance(self.config, PartialConfig) else "merge"

    @property
    def name(self) -> str:
        return f"{self.config.name}_{self.arch}"


# Two head groups with splits from this many 16-head blocks per call (tokens x ceil(heads /
# 16)) and this many entries per token (topk + extra_topk) up: the precisions but "f16" ...
TWO_GROUPS_MIN_BLOCKS = 32
TWO_GROUPS_MIN_ENTRIES = 256
# ... and "f16" where an SM holds one of its 16-head CTAs anyway (sm_120)
F16_TWO_GROUPS_MIN_BLOCKS = 64
F16_TWO_GROUPS_MIN_ENTRIES = 512
# "f16" where an SM holds two CTAs of either head-group count held to 128 registers (the H200):
# two groups when the 32-head CTAs (tokens x ceil(heads / 32)) fill at least this fraction
# (numerator, denominator) of the SMs' slots for them, with no split ...
F16_BOUNDED_TWO_GROUPS_MIN_FILL = (3, 4)
# ... or, with the 32-head grid split and two CTAs per SM: where the 16-head grid splits too,
# when each 32-head CTA gets at least this many chunks (enough work to pay for its larger merge)
F16_BOUNDED_TWO_GROUPS_MIN_SPLIT_CHUNKS = 7
# ... and where the 16-head grid needs no split, when a 16-head CTA's chunks outnumber a 32-head
# CTA's times this ratio (numerator, denominator: a 32-head chunk costs 1.6 of a 16-head one, two
# CTAs per SM each) by this many (the 32-head grid's merge and prologue, in 16-head chunks)
F16_BOUNDED_TWO_GROUPS_CHUNK_COST = (8, 5)
F16_BOUNDED_TWO_GROUPS_SPLIT_COST_CHUNKS = 7


def head_groups_for(num_heads: int, num_tokens: int, num_sms: int, *, topk: int, extra_topk: int = 0,
                    smem_per_sm: int, precision: str = DEFAULT_PRECISION) -> int:
    """16-head groups per CTA.

    16 or fewer heads: one (they do not pay for 32).

    "f16" where an SM holds two of its 16-head CTAs (the H200:
    ``splits.two_bounded_f16_ctas_fit``): there the 32-head kernel is held to 128 registers
    too, two CTAs per SM, and two groups are used where those CTAs alone fill at least
    ``F16_BOUNDED_TWO_GROUPS_MIN_FILL`` of the slots (tokens x ceil(heads / 32) >= 198 on
    132 SMs): each gathered byte then becomes an MMA operand once for 32 heads (4622 sm_90a
    warp-instructions per 32 heads and chunk against 5824 for two 16-head CTAs). Measured
    (session 15, BENCHMARKS.md; the 16-head and 32-head CTAs each at the dispatch's split):
    0.82-0.88x the time at 64 x 128, 128 x 64 and 256 x 32 / 64 / 128 heads (256 32-head
    CTAs or more); 1.01-1.02x at 48 x 128 and 96 x 64 (192: a quarter of the slots idle);
    1.09-1.16x where the 32-head grid needs a split the 16-head one does not (64 x 64 x 512,
    32 x 128 x 512, 128 x 32 x 512) or more splits (8 x 128 x 1024). Held to one CTA per
    SM (208 registers, 2026-12-01), 32-head CTAs had been slower there.
    Where the 32-head grid splits, two CTAs per SM (session 16, BENCHMARKS.md: 29 shapes of
    4-48 tokens x 64 / 128 heads, each group count at its own split, ``scripts/split_sweep.py
    --plan-only``): one wave's time is about a fixed part plus the chunks per CTA times 1.44 us
    (16 heads) or 2.3 us (32 heads), and the 32-head grid's fixed part is the larger (more
    splits to merge). With splits on both sides, 32-head CTAs from
    ``F16_BOUNDED_TWO_GROUPS_MIN_SPLIT_CHUNKS`` (7) chunks each: 0.80-0.99x the time at 7-16
    chunks (12 x 128 x 2048 59.3 -> 47.2 us, 16 x 128 x 1024 36.4 -> 35.2), 1.006x at 8 x 128
    x 1792 (7); 1.02-1.12x at 4-6 chunks (8 x 128 x 1024 23.7 -> 25.7). Where the 16-head grid
    needs no split (132-264 CTAs: a wave whose CTAs all have every chunk), 32-head CTAs when
    8 / 5 of their chunks plus ``F16_BOUNDED_TWO_GROUPS_SPLIT_COST_CHUNKS`` (7) stay within the
    16-head CTAs' chunks: 20 x 128 x 2048 101.4 -> 68.0 us, 18 x 128 x 1024 55.4 -> 42.1, 24 x
    128 x 2048 0.90x; at 32 against 16 chunks 0.98-1.01x (24 x 128, 32 x 128, 64 x 64 x 1024:
    left to 16 heads), at 16 against 8 1.14x.
    Where an SM holds one 16-head CTA anyway (sm_120: 100 KB of shared memory per SM), two
    groups when the 16-head blocks outnumber the SMs or there are at least
    ``F16_TWO_GROUPS_MIN_BLOCKS`` of them with ``F16_TWO_GROUPS_MIN_ENTRIES`` entries per token:
    measured on the H200 with its 16-head CTAs held to one per SM (session 8, BENCHMARKS.md;
    sm_120's occupancy, not an sm_120 measurement), 32-head CTAs were 1.27-1.39x faster at
    64 and 256 tokens x 64/128 heads, 1.03-1.12x at 8 x 128 with 512+ entries, 0.91x at
    8 x 128 x 128 and 0.92-1.01x at 8 x 64 (each gathered byte becomes an MMA operand once
    for 32 heads: 129 instead of 180 warp-instructions per head and chunk in the sm_120a SASS).

    The other precisions: two (each gathered and dequantized row then serves 32 heads)
    when there are more than 16 heads and either the 16-head blocks alone outnumber the SMs
    (no split needed) or there are at least ``TWO_GROUPS_MIN_BLOCKS`` of them and at least
    ``TWO_GROUPS_MIN_ENTRIES`` entries per token; one otherwise (a small call, latency-bound,
    gets more, lighter CTAs). Measured on the H200 (BENCHMARKS.md, ``scripts/split_sweep.py
    --head-groups 2``): with splits, 32-head CTAs are 1-6% faster at 8 tokens x 64/128 heads
    with 512+ entries, 2-10% slower there with 128 entries and 1-9% slower at 1 token;
    without a split they were the better choice."""
    blocks = num_tokens * -(-num_heads // 16)
    entries = topk + extra_topk
    if num_heads <= 16:
        return 1
    if precision == "f16":
        if two_bounded_f16_ctas_fit(smem_per_sm):
            return _bounded_f16_head_groups(num_heads, num_tokens, num_sms, topk, extra_topk, smem_per_sm)
        min_blocks, min_entries = F16_TWO_GROUPS_MIN_BLOCKS, F16_TWO_GROUPS_MIN_ENTRIES
    else:
        min_blocks, min_entries = TWO_GROUPS_MIN_BLOCKS, TWO_GROUPS_MIN_ENTRIES
    if blocks > num_sms or (blocks >= min_blocks and entries >= min_entries):
        return 2
    return 1


def _bounded_f16_head_groups(num_heads: int, num_tokens: int, num_sms: int, topk: int, extra_topk: int,
                             smem_per_sm: int) -> int:
    """``head_groups_for`` where an SM holds two "f16" CTAs of either head-group count (the H200)."""
    one, two = (PartialConfig(head_groups=g, precision="f16", two_ctas_per_sm=True) for g in HEAD_GROUPS)
    slots = num_sms * resident_ctas_per_sm(two, smem_per_sm)
    num, den = F16_BOUNDED_TWO_GROUPS_MIN_FILL
    if ctas_per_split(num_tokens, num_heads, two) * den >= num * slots:
        return 2

    def plan(cfg):
        return plan_splits(num_tokens, num_heads, topk, extra_topk, cfg=cfg, num_sms=num_sms, smem_per_sm=smem_per_sm)
    plan_one, plan_two = plan(one), plan(two)
    if plan_two.num_splits == 1 or not two_ctas_per_sm(two, plan_two, num_tokens, num_heads, num_sms, smem_per_sm):
        return 1
    c1, c2 = plan_one.chunks_per_split, plan_two.chunks_per_split
    if plan_one.num_splits > 1:
        return 2 if c2 >= F16_BOUNDED_TWO_GROUPS_MIN_SPLIT_CHUNKS else 1
    num, den = F16_BOUNDED_TWO_GROUPS_CHUNK_COST
    return 2 if num * c2 + den * F16_BOUNDED_TWO_GROUPS_SPLIT_COST_CHUNKS <= den * c1 else 1


def partial_shape_config(num_heads: int, num_tokens: int, num_sms: int,
                         precision: str = DEFAULT_PRECISION, *, topk: int, extra_topk: int = 0, smem_per_sm: int,
                         head_groups: int | None = None) -> PartialConfig:
    """The partial kernel's shape fields (head groups, block_n, warps) and precision for a
    call on a GPU of ``num_sms`` SMs with ``smem_per_sm`` bytes of shared memory each: what
    the split plan depends on (the flags of a variant do not change its resources). The
    "f16" kernel (either head-group count) is planned as two CTAs per SM where the SM holds two
    (``two_ctas_per_sm``; the launch then drops that bound where the grid has no more CTAs
    than SMs: ``splits.two_ctas_per_sm``). ``head_groups``: that many instead of
    ``head_groups_for``'s choice (a measurement aid: ``scripts/bench.py --head-groups``)."""
    groups = head_groups or head_groups_for(num_heads, num_tokens, num_sms, topk=topk, extra_topk=extra_topk,
                                            smem_per_sm=smem_per_sm, precision=precision)
    return PartialConfig(head_groups=groups, precision=precision,
                         two_ctas_per_sm=precision == "f16")


def precisions_for(arch: str) -> tuple[str, ...]:
    """The compute paths compiled for ``arch``: bf16 and fp8 everywhere, and the block-scaled
    FP8 form ("mxf8") where the hardware has it."""
    return tuple(p for p in PRECISIONS if p != "mxf8" or arch in BLOCK_SCALED_ARCHS)


def resolve_precision(precision: str | None, arch: str) -> str:
    """The compute path of a call: the caller's choice, else the default for ``arch``.

    The default is "f16" on every arch, by measurement (BENCHMARKS.md, README "Precision"):
    on the H200 it is faster than "bf16" on every bench shape (up to 1.9x at 64 tokens x
    64/128 heads) and as accurate (the cache values are exact in f16; P has 11 bits, not
    8); its sm_120a main loop per chunk and thread (16 heads, without the rare rescale) has
    319 instructions in the nope warps and 348 in the rope warp (sm_120: one CTA per SM, no
    128-register bound), against bf16's 1117.
    The FP8 paths are slower on the H200 (sm_90 has no e4m3 ``mma.sync``: ptxas emulates
    it) and 10x less accurate; on sm_120 they are for measuring there first."""
    if precision is None:
        return DEFAULT_PRECISION
    if precision not in precisions_for(arch):
        raise ValueError(f"precision {precision!r} is not available on {arch}: use one of {precisions_for(arch)} "
                         f"or None (the default, {DEFAULT_PRECISION})")
    return precision


def variants_for(md: DecodeMetadata, arch: str, num_splits: int, head_groups: int,
                 precision: str = DEFAULT_PRECISION, *, two_ctas_per_sm: bool = False) -> tuple[KernelVariant, ...]:
    """The variants to launch, in order, for the call described by ``md``, split
    ``num_splits`` ways with ``head_groups`` 16-head groups per CTA (``head_groups_for``),
    the partial kernel held to two CTAs' registers per SM or not (``splits.two_ctas_per_sm``)."""
    final = num_splits == 1
    partial = PartialConfig(
        head_groups=head_groups,
        has_topk_length=md.has_topk_length,
        has_extra_topk_length=md.has_extra_topk_length,
        final_output=final,
        has_sink=final and md.has_sink,
        precision=precision,
        two_ctas_per_sm=two_ctas_per_sm,
    )
    if final:
        return (KernelVariant(partial, arch),)
    merge = MergeConfig(has_sink=md.has_sink, split_batch=merge_batch_for(num_splits))
    return KernelVariant(partial, arch), KernelVariant(merge, arch)


_MODES = ((False, False), (True, False), (True, True))  # (final_output, has_sink)


def variant_space(arch: str) -> list[KernelVariant]:
    """Every variant the dispatch can select for ``arch``."""
    two_fit = two_bounded_f16_ctas_fit(SMEM_PER_SM_BY_ARCH[arch])
    out = [
        KernelVariant(PartialConfig(head_groups=g, has_topk_length=a, has_extra_topk_length=b, final_output=f,
                                    has_sink=s, precision=p, two_ctas_per_sm=two), arch)
        for p, g, a, b, (f, s), two in itertools.product(precisions_for(arch), HEAD_GROUPS, (False, True), (False, True),
                                                         _MODES, (False, True))
        if not two or (p == "f16" and two_fit)
    ]
    out += [KernelVariant(MergeConfig(has_sink=s, split_batch=b), arch) for s in (False, True) for b in MERGE_BATCHES]
    return out
