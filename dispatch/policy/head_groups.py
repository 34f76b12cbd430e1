"""How many 16-head groups a partial-kernel CTA covers, and the partial kernel's shape for a
call (what the split plan depends on). The measurements behind each rule: ``docs/tuning.md``."""

from __future__ import annotations

from cute_kernels.sparse_mla_decode.config import HEAD_GROUPS, PartialConfig
from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT
from cute_kernels.sparse_mla_decode.tuning import (
    DEFAULT_PRECISION, F16_BOUNDED_TWO_GROUPS_CHUNK_COST, F16_BOUNDED_TWO_GROUPS_MIN_FILL,
    F16_BOUNDED_TWO_GROUPS_MIN_SPLIT_CHUNKS, F16_BOUNDED_TWO_GROUPS_SPLIT_COST_CHUNKS, F16_TWO_GROUPS_MIN_BLOCKS,
    F16_TWO_GROUPS_MIN_ENTRIES, TWO_GROUPS_MIN_BLOCKS, TWO_GROUPS_MIN_ENTRIES,
)

from .occupancy import ctas_per_split, f16_bound_allowed, resident_ctas_per_sm, two_bounded_f16_ctas_fit
from .splits import plan_splits, two_ctas_per_sm


def head_groups_for(num_heads: int, num_tokens: int, num_sms: int, *, topk: int, extra_topk: int = 0,
                    smem_per_sm: int, precision: str = DEFAULT_PRECISION, kv_format: str = DEFAULT_FORMAT,
                    bounded_head_groups: tuple[int, ...] = HEAD_GROUPS) -> int:
    """16-head groups per CTA (``docs/tuning.md`` has the measurements behind each rule).

    16 or fewer heads: one. "f16" where an SM holds two of the format's 128-register CTAs of
    either size (MODEL1 on the H200: ``occupancy.two_bounded_f16_ctas_fit``; a format whose
    "f16" kernel cannot be bounded never is, nor one whose 32-head kernel is not bounded on
    the arch, ``bounded_head_groups``: ``occupancy.bounded_f16_head_groups``, sm_80):
    ``_bounded_f16_head_groups``.
    Otherwise two when the 16-head blocks (tokens x ceil(heads / 16)) outnumber the SMs, or
    when there are at least ``*_TWO_GROUPS_MIN_BLOCKS`` of them and at least
    ``*_TWO_GROUPS_MIN_ENTRIES`` entries per token ("f16" where an SM holds one CTA anyway,
    sm_120: ``F16_...``; the other paths: ``TWO_GROUPS_...``); one otherwise (a small call is
    latency-bound: more, lighter CTAs)."""
    blocks = num_tokens * -(-num_heads // 16)
    entries = topk + extra_topk
    if num_heads <= 16:
        return 1
    if precision == "f16":
        if all(two_bounded_f16_ctas_fit(smem_per_sm, kv_format, g, bounded_head_groups) for g in HEAD_GROUPS):
            return _bounded_f16_head_groups(num_heads, num_tokens, num_sms, topk, extra_topk, smem_per_sm, kv_format)
        min_blocks, min_entries = F16_TWO_GROUPS_MIN_BLOCKS, F16_TWO_GROUPS_MIN_ENTRIES
    else:
        min_blocks, min_entries = TWO_GROUPS_MIN_BLOCKS, TWO_GROUPS_MIN_ENTRIES
    if blocks > num_sms or (blocks >= min_blocks and entries >= min_entries):
        return 2
    return 1


def _bounded_f16_head_groups(num_heads: int, num_tokens: int, num_sms: int, topk: int, extra_topk: int,
                             smem_per_sm: int, kv_format: str) -> int:
    """``head_groups_for`` where an SM holds two "f16" CTAs of either head-group count (the H200):
    two where the 32-head CTAs fill at least ``F16_BOUNDED_TWO_GROUPS_MIN_FILL`` of the slots
    with no split; with the 32-head grid split (and two CTAs per SM), where the 16-head grid
    splits too, when each 32-head CTA gets at least ``F16_BOUNDED_TWO_GROUPS_MIN_SPLIT_CHUNKS``
    chunks, and where it does not, when the 32-head CTAs' chunks, weighted by
    ``F16_BOUNDED_TWO_GROUPS_CHUNK_COST``, plus ``F16_BOUNDED_TWO_GROUPS_SPLIT_COST_CHUNKS`` stay
    within the 16-head CTAs' chunks."""
    one, two = (PartialConfig(kv_format=kv_format, head_groups=g, precision="f16", two_ctas_per_sm=True)
                for g in HEAD_GROUPS)
    slots = num_sms * resident_ctas_per_sm(two, smem_per_sm)
    num, den = F16_BOUNDED_TWO_GROUPS_MIN_FILL
    if ctas_per_split(num_tokens, num_heads, two) * den >= num * slots:
        return 2

    def plan(cfg):
        return plan_splits(num_tokens, num_heads, topk, extra_topk, cfg=cfg, num_sms=num_sms, smem_per_sm=smem_per_sm)
    plan_one, plan_two = plan(one), plan(two)
    if plan_two.num_splits == 1 or not two_ctas_per_sm(two, plan_two, num_tokens=num_tokens, num_heads=num_heads,
                                                       num_sms=num_sms, smem_per_sm=smem_per_sm):
        return 1
    c1, c2 = plan_one.chunks_per_split, plan_two.chunks_per_split
    if plan_one.num_splits > 1:
        return 2 if c2 >= F16_BOUNDED_TWO_GROUPS_MIN_SPLIT_CHUNKS else 1
    num, den = F16_BOUNDED_TWO_GROUPS_CHUNK_COST
    return 2 if num * c2 + den * F16_BOUNDED_TWO_GROUPS_SPLIT_COST_CHUNKS <= den * c1 else 1


def partial_shape_config(num_heads: int, num_tokens: int, num_sms: int,
                         precision: str = DEFAULT_PRECISION, *, topk: int, extra_topk: int = 0, smem_per_sm: int,
                         head_groups: int | None = None, kv_format: str = DEFAULT_FORMAT,
                         bounded_head_groups: tuple[int, ...] = HEAD_GROUPS) -> PartialConfig:
    """The partial kernel's format, shape fields (head groups, block_n, warps) and precision
    for a call on a GPU of ``num_sms`` SMs with ``smem_per_sm`` bytes of shared memory each:
    what the split plan depends on (the flags of a variant do not change its resources). The
    "f16" kernel of a format that can bound it (``occupancy.f16_bound_allowed``), of one of
    the arch's ``bounded_head_groups`` (``occupancy.bounded_f16_head_groups``: both counts
    but where the binaries ship), is planned as two CTAs per SM where the SM holds two
    (``two_ctas_per_sm``; the launch then drops that bound where the grid has no more CTAs
    than SMs: ``splits.two_ctas_per_sm``). ``head_groups``: that many instead of
    ``head_groups_for``'s choice (a measurement aid: ``scripts/bench.py --head-groups``)."""
    groups = head_groups or head_groups_for(num_heads, num_tokens, num_sms, topk=topk, extra_topk=extra_topk,
                                            smem_per_sm=smem_per_sm, precision=precision, kv_format=kv_format,
                                            bounded_head_groups=bounded_head_groups)
    return PartialConfig(kv_format=kv_format, head_groups=groups, precision=precision,
                         two_ctas_per_sm=precision == "f16" and f16_bound_allowed(kv_format)
                         and groups in bounded_head_groups)
