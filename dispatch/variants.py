"""Variant keys: the one place that says which kernels are compiled, and for which call.

A variant is a kernel configuration plus a target arch. Everything else about a call
(num_tokens, num_heads, topk, extra_topk, page block sizes, strides, the split of the work)
is a runtime argument, so the set of variants is small and closed:

    partial: kv_format (``kv_format.FORMATS``) x precision (``precisions_of(format)`` that
             ``precisions_for(arch)`` has) x head_groups (1 or 2: ``head_groups_for``) x
             has_topk_length x has_extra_topk_length (only for a format a model pairs with an
             extra cache of its own format: ``kv_format.EXTRA_FORMATS``) x (split mode |
             final mode without sink | final mode with sink; split mode alone for a format
             read only as an extra cache), and for an "f16" kernel that can be held to two
             CTAs on an arch whose SMs hold two of it (MODEL1's on sm_90a), x two_ctas_per_sm
             (the 128-register launch bound: ``splits.two_ctas_per_sm``)
    merge:   has_sink x split_batch (``merge_batch_for(num_splits)``): every format's value
             width is the same (``kv_format.D_V``), so one merge kernel serves them all

A call whose work needs one split runs the partial kernel in final mode (it writes out
and lse itself); otherwise the partial kernel writes per-split partials and the merge
kernel combines them. A call whose extra cache is of another format than its main cache
runs one partial kernel per list, each as a call of its format in split mode, and the merge
(``selection.select_kernels``). ``variant_space(arch)`` enumerates the set;
``variants_for(metadata, arch, num_splits, head_groups, two_ctas_per_sm=...)`` picks from it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from cute_kernels.arch import BLOCK_SCALED_ARCHS, SMEM_PER_SM_BY_ARCH
from cute_kernels.sparse_mla_decode.config import (
    HEAD_GROUPS, PRECISIONS, MergeConfig, PartialConfig, merge_batch_for, precisions_of,
)
from cute_kernels.sparse_mla_decode.kv_format import (
    DEFAULT_FORMAT, EXTRA_FORMATS, EXTRA_ONLY_FORMATS, FORMATS, get_format,
)
from cute_kernels.sparse_mla_decode.tuning import (
    DEFAULT_PRECISION, F16_BOUNDED_TWO_GROUPS_CHUNK_COST, F16_BOUNDED_TWO_GROUPS_MIN_FILL,
    F16_BOUNDED_TWO_GROUPS_MIN_SPLIT_CHUNKS, F16_BOUNDED_TWO_GROUPS_SPLIT_COST_CHUNKS, F16_TWO_GROUPS_MIN_BLOCKS,
    F16_TWO_GROUPS_MIN_ENTRIES, MERGE_BATCHES, TWO_GROUPS_MIN_BLOCKS, TWO_GROUPS_MIN_ENTRIES,
)

from .metadata import DecodeMetadata
from .splits import (
    ctas_per_split, f16_bound_allowed, plan_splits, resident_ctas_per_sm, two_bounded_f16_ctas_fit, two_ctas_per_sm,
)


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


def head_groups_for(num_heads: int, num_tokens: int, num_sms: int, *, topk: int, extra_topk: int = 0,
                    smem_per_sm: int, precision: str = DEFAULT_PRECISION, kv_format: str = DEFAULT_FORMAT) -> int:
    """16-head groups per CTA (``docs/tuning.md`` has the measurements behind each rule).

    16 or fewer heads: one. "f16" where an SM holds two of the format's 128-register CTAs of
    either size (MODEL1 on the H200: ``splits.two_bounded_f16_ctas_fit``; a format whose
    "f16" kernel cannot be bounded never is): ``_bounded_f16_head_groups``.
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
        if two_bounded_f16_ctas_fit(smem_per_sm, kv_format):
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
    if plan_two.num_splits == 1 or not two_ctas_per_sm(two, plan_two, num_tokens, num_heads, num_sms, smem_per_sm):
        return 1
    c1, c2 = plan_one.chunks_per_split, plan_two.chunks_per_split
    if plan_one.num_splits > 1:
        return 2 if c2 >= F16_BOUNDED_TWO_GROUPS_MIN_SPLIT_CHUNKS else 1
    num, den = F16_BOUNDED_TWO_GROUPS_CHUNK_COST
    return 2 if num * c2 + den * F16_BOUNDED_TWO_GROUPS_SPLIT_COST_CHUNKS <= den * c1 else 1


def partial_shape_config(num_heads: int, num_tokens: int, num_sms: int,
                         precision: str = DEFAULT_PRECISION, *, topk: int, extra_topk: int = 0, smem_per_sm: int,
                         head_groups: int | None = None, kv_format: str = DEFAULT_FORMAT) -> PartialConfig:
    """The partial kernel's format, shape fields (head groups, block_n, warps) and precision
    for a call on a GPU of ``num_sms`` SMs with ``smem_per_sm`` bytes of shared memory each:
    what the split plan depends on (the flags of a variant do not change its resources). The
    "f16" kernel (either head-group count) of a format that can bound it
    (``splits.f16_bound_allowed``) is planned as two CTAs per SM where the SM holds two
    (``two_ctas_per_sm``; the launch then drops that bound where the grid has no more CTAs
    than SMs: ``splits.two_ctas_per_sm``). ``head_groups``: that many instead of
    ``head_groups_for``'s choice (a measurement aid: ``scripts/bench.py --head-groups``)."""
    groups = head_groups or head_groups_for(num_heads, num_tokens, num_sms, topk=topk, extra_topk=extra_topk,
                                            smem_per_sm=smem_per_sm, precision=precision, kv_format=kv_format)
    return PartialConfig(kv_format=kv_format, head_groups=groups, precision=precision,
                         two_ctas_per_sm=precision == "f16" and f16_bound_allowed(kv_format))


def precisions_for(arch: str) -> tuple[str, ...]:
    """The compute paths compiled for ``arch``: "bf16", "f16" (the default) and "fp8"
    everywhere, and the block-scaled FP8 form ("mxf8") where the hardware has it."""
    return tuple(p for p in PRECISIONS if p != "mxf8" or arch in BLOCK_SCALED_ARCHS)


def check_format_precision(precision: str | None, kv_format: str = DEFAULT_FORMAT) -> None:
    """Raise ValueError, naming the format, for a compute path ``kv_format`` does not have
    (``config.precisions_of``: "mxf8" needs UE8M0 scale bytes). None (the default) always
    passes: ``DEFAULT_PRECISION`` reads every format."""
    fmt = get_format(kv_format)
    if precision is not None and precision not in precisions_of(fmt):
        what = "e2m1 values" if fmt.e2m1 else f"{fmt.scale_type} scales"
        raise ValueError(f"precision {precision!r} does not read {fmt.name} caches ({what}): "
                         f"use one of {precisions_of(fmt)} or None (the default, {DEFAULT_PRECISION})")


def resolve_precision(precision: str | None, arch: str, kv_format: str = DEFAULT_FORMAT) -> str:
    """The compute path of a call: the caller's choice, else ``tuning.DEFAULT_PRECISION``
    ("f16" on every arch and format, by measurement: ``docs/tuning.md``). Refuses a path the
    format (``check_format_precision``) or the arch (``precisions_for``) lacks."""
    check_format_precision(precision, kv_format)
    if precision is None:
        return DEFAULT_PRECISION
    if precision not in precisions_for(arch):
        raise ValueError(f"precision {precision!r} is not available on {arch}: use one of {precisions_for(arch)} "
                         f"or None (the default, {DEFAULT_PRECISION})")
    return precision


def variants_for(md: DecodeMetadata, arch: str, num_splits: int, head_groups: int,
                 precision: str = DEFAULT_PRECISION, *, two_ctas_per_sm: bool = False,
                 split_mode: bool = False) -> tuple[KernelVariant, ...]:
    """The variants to launch, in order, for the call of one format described by ``md`` (its
    ``kv_format`` must be known), split ``num_splits`` ways with ``head_groups`` 16-head groups
    per CTA (``head_groups_for``), the partial kernel held to two CTAs' registers per SM or not
    (``splits.two_ctas_per_sm``). ``split_mode``: split partials even for one split (one list
    of a call of two formats: ``selection.select_kernels``)."""
    if md.kv_format is None:
        raise ValueError(f"{md.describe()}: the call's kv_format must be known to pick its kernels")
    if md.mixed:
        raise ValueError(f"{md.describe()}: a call of two formats runs a partial kernel per list "
                         f"(selection.select_kernels)")
    final = num_splits == 1 and not split_mode
    partial = PartialConfig(
        kv_format=md.kv_format,
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
    return KernelVariant(partial, arch), merge_variant(md.has_sink, num_splits, arch)


def merge_variant(has_sink: bool, num_splits: int, arch: str) -> KernelVariant:
    """The merge kernel of a call whose partial outputs have ``num_splits`` splits."""
    return KernelVariant(MergeConfig(has_sink=has_sink, split_batch=merge_batch_for(num_splits)), arch)


_MODES = ((False, False), (True, False), (True, True))  # (final_output, has_sink)


def format_precisions(arch: str, kv_format: str) -> tuple[str, ...]:
    """The compute paths compiled for ``kv_format`` on ``arch``: the format's
    (``precisions_of``) that the arch has (``precisions_for``), in ``PRECISIONS`` order."""
    return tuple(p for p in precisions_for(arch) if p in precisions_of(get_format(kv_format)))


def variant_space(arch: str) -> list[KernelVariant]:
    """Every variant the dispatch can select for ``arch``: per format (MODEL1's first), its
    partial kernels (a format read only as an extra cache, ``EXTRA_ONLY_FORMATS``: in split
    mode, its list the kernel's main list), then the merge kernels every format shares."""
    out = []
    for kv_format in FORMATS:
        two_fit = two_bounded_f16_ctas_fit(SMEM_PER_SM_BY_ARCH[arch], kv_format)
        extra_lengths = (False, True) if kv_format in EXTRA_FORMATS.get(kv_format, ()) else (False,)
        modes = _MODES[:1] if kv_format in EXTRA_ONLY_FORMATS else _MODES
        out += [
            KernelVariant(PartialConfig(kv_format=kv_format, head_groups=g, has_topk_length=a,
                                        has_extra_topk_length=b, final_output=f, has_sink=s, precision=p,
                                        two_ctas_per_sm=two), arch)
            for p, g, a, b, (f, s), two in itertools.product(format_precisions(arch, kv_format), HEAD_GROUPS,
                                                             (False, True), extra_lengths, modes, (False, True))
            if not two or (p == "f16" and two_fit)
        ]
    out += [KernelVariant(MergeConfig(has_sink=s, split_batch=b), arch) for s in (False, True) for b in MERGE_BATCHES]
    return out
