"""A call's kernel selection, decided in one place.

``select_kernels`` takes what the dispatch's choice for a call depends on (the call's
metadata, the target's arch, SM count and shared memory per SM, the compute path, and any
``PlanOverrides``) and returns the ``KernelSelection``: the head groups per CTA, the split of
the work, whether two CTAs share an SM (the register bound) and the kernel variants to
launch. ``DecodePlan`` plans a call with it, ``registry.registry_calls`` /
``registry_variants`` list the deployment grid's selections (what the AOT build compiles),
and the tests and tools that report a call's choices ask it too.
"""

from __future__ import annotations

import dataclasses

from cute_kernels.arch import arch_facts
from cute_kernels.sparse_mla_decode.config import HEAD_GROUPS, PartialConfig

from .call_metadata import DecodeMetadata
from .splits import MAX_SPLITS, SplitPlan, plan_splits, two_ctas_per_sm
from .head_groups import partial_shape_config
from .occupancy import bounded_f16_head_groups
from .variant_space import KernelVariant, merge_variant, variants_for


@dataclasses.dataclass(frozen=True)
class PlanOverrides:
    """Choices a plan makes by the dispatch's measured rules, forced instead: a measurement
    and testing aid (``plan_sparse_mla_decode(..., overrides=...)``). A forced variant need
    not be in the variant space (it is then compiled on first use, or refused when compiling
    is switched off). None leaves a choice to the dispatch.

    head_groups: 16-head groups per CTA (1 or 2); num_splits: splits per token (1: the
    partial kernel writes out / lse itself, no merge), at most the token's chunks and
    ``splits.MAX_SPLITS``; num_stages: raw row stages (2 or 3); two_ctas_per_sm: the "f16"
    kernel held to 128 registers (True) or not."""

    head_groups: int | None = None
    num_splits: int | None = None
    num_stages: int | None = None
    two_ctas_per_sm: bool | None = None

    def check(self, precision: str | None = None) -> None:
        """Raise ValueError for a value no kernel has (of the wrong type, out of range, or,
        given the plan's ``precision``, a register bound its kernel does not have)."""
        for name in ("head_groups", "num_splits", "num_stages"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"overrides.{name} must be an int or None, got {value!r} ({type(value).__name__})")
        if self.two_ctas_per_sm is not None and not isinstance(self.two_ctas_per_sm, bool):
            raise ValueError(f"overrides.two_ctas_per_sm must be True, False or None, got {self.two_ctas_per_sm!r} "
                             f"({type(self.two_ctas_per_sm).__name__})")
        if self.head_groups is not None and self.head_groups not in HEAD_GROUPS:
            raise ValueError(f"overrides.head_groups must be one of {HEAD_GROUPS}, got {self.head_groups!r}")
        if self.num_splits is not None and not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"overrides.num_splits must be in [1, {MAX_SPLITS}], got {self.num_splits!r}")
        if self.num_stages is not None and self.num_stages not in (2, 3):
            raise ValueError(f"overrides.num_stages must be 2 or 3, got {self.num_stages!r}")
        if self.two_ctas_per_sm and precision is not None and precision != "f16":
            raise ValueError(f"overrides.two_ctas_per_sm=True holds the \"f16\" kernel to 128 registers; this plan's "
                             f"precision is {precision!r}, whose kernel has no such bound")


@dataclasses.dataclass(frozen=True)
class KernelSelection:
    """What the dispatch chose for one call (``select_kernels``).

    head_groups: 16-head groups per CTA; split: how each token's chunks are split
    (``splits.SplitPlan``); two_ctas_per_sm: whether the partial kernel is held to 128
    registers (two CTAs share an SM); variants: the kernels to launch, in order (the partial
    kernel, then the merge kernel where there is more than one split). A call whose extra
    list is of another format (``DecodeMetadata.mixed``): those fields are the main list's
    launch, ``extra`` the extra list's (its own head groups, split and register bound, as a
    call of that format), and the variants are the two partial kernels, then the merge of
    all their splits (the main list's first)."""

    head_groups: int
    split: SplitPlan
    two_ctas_per_sm: bool
    variants: tuple[KernelVariant, ...]
    extra: "KernelSelection | None" = None

    @property
    def num_splits(self) -> int:
        """The splits of the call's partial outputs (every launch's)."""
        return self.split.num_splits + (self.extra.num_splits if self.extra is not None else 0)


def select_kernels(md: DecodeMetadata, arch: str, *, num_sms: int, smem_per_sm: int, precision: str,
                   overrides: PlanOverrides | None = None) -> KernelSelection:
    """The dispatch's choice for the call ``md`` describes (its shape, optional inputs and
    ``kv_format``, which must be known) on ``arch`` with ``num_sms`` SMs of ``smem_per_sm``
    bytes of shared memory each, computed in ``precision`` (resolved: never None):

    1. the head groups (``head_groups.partial_shape_config``: ``head_groups_for``'s rule);
    2. the split (``splits.plan_splits``, for that shape and its shared memory);
    3. the register bound (``splits.two_ctas_per_sm``: the planned grid puts two CTAs on an SM);
    4. the variants (``variant_space.variants_for``).

    A call whose extra list is of another format (``DecodeMetadata.mixed``): each list as a
    call of its own format (``DecodeMetadata.list_calls``), both in split mode, the extra
    list's splits at most what the main list's leave of ``splits.MAX_SPLITS``, then one merge
    of all the splits. (One kernel reads one format: a chunk loop that switched formats would
    hold both formats' code and registers; the cost is one more launch.)

    ``overrides`` (checked first: ``PlanOverrides.check``, ValueError) forces any of these:
    the head groups; the raw row stages (which the split plan then sees, and the partial
    variant is built with); the splits (equal chunk ranges, ValueError where they cannot give
    that count; not for a mixed call); the register bound. The variants are not checked
    (``PartialConfig.check``: ``DecodePlan`` does) and, with overrides, need not be in the
    variant space."""
    ov = overrides or PlanOverrides()
    ov.check(precision)
    # a GPU of ``arch`` has the arch's shared memory per SM; an arch profile runs its
    # target's choices on a GPU with more (``cute_kernels.arch.profile``), and plans as the
    # target does
    smem_per_sm = min(smem_per_sm, arch_facts(arch).smem_per_sm)
    if md.kv_format is None:
        raise ValueError(f"{md.describe()}: the call's kv_format must be known to pick its kernels")
    if not md.mixed:
        return _select_one(md, arch, num_sms, smem_per_sm, precision, ov)
    if ov.num_splits is not None:
        raise ValueError(f"overrides.num_splits: a call of two cache formats ({md.kv_format} + {md.extra_kv_format}) "
                         f"splits each list by itself; force splits on a call of one format")
    main_md, extra_md = md.list_calls()
    main = _select_one(main_md, arch, num_sms, smem_per_sm, precision, ov, max_splits=MAX_SPLITS - 1,
                       split_mode=True)
    extra = _select_one(extra_md, arch, num_sms, smem_per_sm, precision, ov,
                        max_splits=MAX_SPLITS - main.num_splits, split_mode=True)
    total = main.num_splits + extra.num_splits
    merge = merge_variant(md.has_sink, total, arch)
    return dataclasses.replace(main, variants=(main.variants[0], extra.variants[0], merge), extra=extra)


def _select_one(md: DecodeMetadata, arch: str, num_sms: int, smem_per_sm: int, precision: str, ov: PlanOverrides,
                max_splits: int = MAX_SPLITS, split_mode: bool = False) -> KernelSelection:
    """``select_kernels`` for a call of one format; ``max_splits``: at most that many splits;
    ``split_mode``: the partial kernel writes split partials even with one split (a list of a
    mixed call)."""
    T, H, topk, extra_topk = md.num_tokens, md.num_heads, md.topk, md.extra_topk
    shape = partial_shape_config(H, T, num_sms, precision, topk=topk, extra_topk=extra_topk, smem_per_sm=smem_per_sm,
                                 head_groups=ov.head_groups, kv_format=md.kv_format,
                                 bounded_head_groups=bounded_f16_head_groups(arch))
    if ov.num_stages is not None:  # the split plan sees the stages' shared memory too
        shape = dataclasses.replace(shape, num_stages=ov.num_stages)
    split = plan_splits(T, H, topk, extra_topk, cfg=shape, num_sms=num_sms, smem_per_sm=smem_per_sm,
                        max_splits=max_splits, dealt=md.has_topk_length or md.has_extra_topk_length)
    if ov.num_splits is not None:
        chunks = split.num_chunks
        per_split = -(-chunks // min(ov.num_splits, chunks))
        split = SplitPlan(chunks, per_split, -(-chunks // per_split))
        if split.num_splits != ov.num_splits:
            raise ValueError(f"overrides.num_splits={ov.num_splits}: {chunks} chunks of {shape.block_n} entries "
                             f"split into equal ranges give {split.num_splits} splits")
    two_per_sm = ov.two_ctas_per_sm
    if two_per_sm is None:
        two_per_sm = two_ctas_per_sm(shape, split, num_tokens=T, num_heads=H, num_sms=num_sms, smem_per_sm=smem_per_sm)
    variants = variants_for(md, arch, split.num_splits, shape.head_groups, precision=precision,
                            two_ctas_per_sm=two_per_sm, split_mode=split_mode)
    if ov.num_stages is not None:
        variants = tuple(dataclasses.replace(v, config=dataclasses.replace(v.config, num_stages=ov.num_stages))
                         if isinstance(v.config, PartialConfig) else v for v in variants)
    return KernelSelection(shape.head_groups, split, two_per_sm, variants)


def select_for_call(call, overrides: PlanOverrides | None = None) -> KernelSelection:
    """``select_kernels`` for a validated call (``dispatch.api.validate_call``): its metadata,
    arch, SM count, shared memory per SM and compute path."""
    return select_kernels(call.launch_metadata, call.arch, num_sms=call.num_sms, smem_per_sm=call.smem_per_sm,
                          precision=call.precision, overrides=overrides)
