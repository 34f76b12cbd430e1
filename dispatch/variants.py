"""Variant keys: the one place that says which kernels are compiled, and for which call.

A variant is a kernel configuration plus a target arch. Everything else about a call
(num_tokens, num_heads, topk, extra_topk, page block sizes, strides, the split of the work)
is a runtime argument, so the set of variants is small and closed:

    partial: precision x head_groups (1 for <= 16 heads, else 2) x has_topk_length x
             has_extra_topk_length x (split mode | final mode without sink | final mode with sink)
    merge:   has_sink

A call whose work needs one split runs the partial kernel in final mode (it writes out
and lse itself); otherwise the partial kernel writes per-split partials and the merge
kernel combines them. ``variant_space(arch)`` enumerates the set;
``variants_for(metadata, arch, num_splits)`` picks from it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from cute_kernels.sparse_mla_decode.config import PRECISIONS, MergeConfig, PartialConfig

from .metadata import DecodeMetadata

DEFAULT_PRECISION = "bf16"


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


def head_groups_for(num_heads: int) -> int:
    """16-head groups per CTA: two once there are more than 16 heads, so that each gathered and
    dequantized row serves 32 heads (measured: see BENCHMARKS.md); one otherwise, so that 16 or
    fewer heads do not pay for 32."""
    return 2 if num_heads > 16 else 1


def heads_per_cta_for(num_heads: int) -> int:
    return PartialConfig(head_groups=head_groups_for(num_heads)).heads_per_cta


def variants_for(md: DecodeMetadata, arch: str, num_splits: int,
                 precision: str = DEFAULT_PRECISION) -> tuple[KernelVariant, ...]:
    """The variants to launch, in order, for the call described by ``md`` split ``num_splits`` ways."""
    final = num_splits == 1
    partial = PartialConfig(
        head_groups=head_groups_for(md.num_heads),
        has_topk_length=md.has_topk_length,
        has_extra_topk_length=md.has_extra_topk_length,
        final_output=final,
        has_sink=final and md.has_sink,
        precision=precision,
    )
    if final:
        return (KernelVariant(partial, arch),)
    return KernelVariant(partial, arch), KernelVariant(MergeConfig(has_sink=md.has_sink), arch)


_MODES = ((False, False), (True, False), (True, True))  # (final_output, has_sink)


def variant_space(arch: str) -> list[KernelVariant]:
    """Every variant the dispatch can select for ``arch``."""
    out = [
        KernelVariant(PartialConfig(head_groups=g, has_topk_length=a, has_extra_topk_length=b, final_output=f,
                                    has_sink=s, precision=p), arch)
        for p, g, a, b, (f, s) in itertools.product(PRECISIONS, (1, 2), (False, True), (False, True), _MODES)
    ]
    out += [KernelVariant(MergeConfig(has_sink=s), arch) for s in (False, True)]
    return out
