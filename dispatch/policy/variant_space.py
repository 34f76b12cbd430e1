"""Variant keys: the one place that says which kernels are compiled, and for which call.

A variant is a kernel configuration plus a target arch. Everything else about a call
(num_tokens, num_heads, topk, extra_topk, page block sizes, strides, the split of the work)
is a runtime argument, so the set of variants is small and closed:

    partial: kv_format (``kv_format.FORMATS``) x precision (the format's ``paths`` that the
             arch has: ``precision.format_precisions``) x head_groups (1 or 2:
             ``head_groups.head_groups_for``) x has_topk_length x has_extra_topk_length (only
             for a format whose ``extras`` hold itself: an extra cache of its own format,
             read in the same kernel) x (split mode |
             final mode without sink | final mode with sink; split mode alone for a format
             read only as an extra cache), and for an "f16" kernel that can be held to two
             CTAs on an arch whose SMs hold two of it (MODEL1's on sm_90a; on sm_80 its
             16-head one), x two_ctas_per_sm
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

from cute_kernels.arch import Arch, arch_facts
from cute_kernels.sparse_mla_decode.config import HEAD_GROUPS, MergeConfig, PartialConfig, merge_batch_for
from cute_kernels.sparse_mla_decode.kv_format import FORMATS
from cute_kernels.sparse_mla_decode.tuning import DEFAULT_PRECISION, MERGE_BATCHES

from .call_metadata import DecodeMetadata
from .occupancy import bounded_f16_head_groups, two_bounded_f16_ctas_fit
from .precision import format_precisions


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

    @property
    def target(self) -> Arch:
        """The facts of ``arch`` (a target, or an arch profile)."""
        return arch_facts(self.arch)


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


def variant_space(arch: str) -> list[KernelVariant]:
    """Every variant the dispatch can select for ``arch``: per format (MODEL1's first), its
    partial kernels (a format read only as an extra cache, not ``main``: in split
    mode, its list the kernel's main list), then the merge kernels every format shares."""
    out = []
    for kv_format, fmt in FORMATS.items():
        smem_per_sm, bounded = arch_facts(arch).smem_per_sm, bounded_f16_head_groups(arch)
        extra_lengths = (False, True) if kv_format in fmt.extras else (False,)
        modes = _MODES if fmt.main else _MODES[:1]
        out += [
            KernelVariant(PartialConfig(kv_format=kv_format, head_groups=g, has_topk_length=a,
                                        has_extra_topk_length=b, final_output=f, has_sink=s, precision=p,
                                        two_ctas_per_sm=two), arch)
            for p, g, a, b, (f, s), two in itertools.product(format_precisions(arch, kv_format), HEAD_GROUPS,
                                                             (False, True), extra_lengths, modes, (False, True))
            if not two or (p == "f16" and two_bounded_f16_ctas_fit(smem_per_sm, kv_format, g, bounded))
        ]
    out += [KernelVariant(MergeConfig(has_sink=s, split_batch=b), arch) for s in (False, True) for b in MERGE_BATCHES]
    return out
