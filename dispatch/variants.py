"""Variant keys: the one place that says which kernels are compiled, and for which call.

A variant is a kernel configuration plus a target arch. Everything else about a call
(num_tokens, num_heads, topk, extra_topk, page block sizes, strides, the split of the work)
is a runtime argument, so the set of variants is small and closed:

    partial: precision x has_topk_length x has_extra_topk_length
    merge:   has_sink

``variant_space(arch)`` enumerates it; ``variants_for(metadata, arch)`` picks from it.
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


def variants_for(md: DecodeMetadata, arch: str, precision: str = DEFAULT_PRECISION):
    """The (partial, merge) variants that serve the call described by ``md``."""
    partial = PartialConfig(
        has_topk_length=md.has_topk_length,
        has_extra_topk_length=md.has_extra_topk_length,
        precision=precision,
    )
    merge = MergeConfig(has_sink=md.has_sink)
    return KernelVariant(partial, arch), KernelVariant(merge, arch)


def variant_space(arch: str) -> list[KernelVariant]:
    """Every variant the dispatch can select for ``arch``."""
    out = [
        KernelVariant(PartialConfig(has_topk_length=a, has_extra_topk_length=b, precision=p), arch)
        for p, a, b in itertools.product(PRECISIONS, (False, True), (False, True))
    ]
    out += [KernelVariant(MergeConfig(has_sink=s), arch) for s in (False, True)]
    return out
