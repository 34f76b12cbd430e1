"""Calls of two cache formats (CPU): a main and an extra cache of different formats run a partial
kernel per list, then one merge of all their splits; what such a call selects, validates, plans
and launches, and the calls whose extra cache has the main format (one partial kernel)."""

import dataclasses
import itertools
import re

import pytest
import torch

from cute_kernels.sparse_mla_decode.cache_view import page_division_magic
from cute_kernels.sparse_mla_decode.config import MergeConfig, merge_batch_for
from cute_kernels.sparse_mla_decode.kernel_args import MERGE_ARGS, PARTIAL_ARGS
from cute_kernels.sparse_mla_decode.kv_format import EXTRA_FORMATS, FORMATS, MODEL1_NVFP4, V41_FP8
from dispatch import InvalidDecodeInput, sparse_mla_decode
from dispatch.policy.registry import H200_SMEM_PER_SM, SM120_SMEM_PER_SM
from dispatch.policy.selection import PlanOverrides, select_kernels
from dispatch.policy.splits import MAX_PLANNED_SPLITS, MAX_SPLITS, SplitPlan, plan_splits
from dispatch.policy.precision import format_precisions
from dispatch.policy.variant_space import variant_space, variants_for
from dispatch.runtime.plan import DecodePlan
from dispatch.tools.sample_inputs import make_cache, make_indices
from tests.dispatch_inputs import MODEL1, NVFP4_CACHE, SM120_TARGET, _EXTRA_IDX, _cpu_plan, _inputs, _md, _stub_kernels


# the models' main + extra pairings of two formats (EXTRA_FORMATS), main first
MIXED_PAIRS = sorted((main, extra) for main, extras in EXTRA_FORMATS.items() for extra in extras if extra != main)
# (T, H, topk, extra_topk): decode batches, and one token against 8192 + 8192 entries
_MIXED_SHAPES = [(1, 16, 128, 64), (4, 64, 1152, 512), (64, 128, 128, 512), (300, 8, 128, 2048), (1, 128, 8192, 8192),
                 (1, 16, 8192, 8192)]
_TARGETS = [SM120_TARGET, ("sm_90a", 132, H200_SMEM_PER_SM)]


def _mixed_md(main, extra, T, H, topk, extra_topk, has_len=False, has_extra_len=False, has_sink=False, extra_page=64):
    return _md(main, num_tokens=T, num_heads=H, topk=topk, page_block_size=64, extra_topk=extra_topk,
               extra_page_block_size=extra_page, has_topk_length=has_len, has_extra_topk_length=has_extra_len,
               has_sink=has_sink, extra_kv_format=extra)


def _covers_every_chunk_once(split: SplitPlan, entries: int, block_n: int) -> bool:
    return (split.num_chunks == -(-entries // block_n) and split.num_splits * split.chunks_per_split >= split.num_chunks
            and (split.num_splits - 1) * split.chunks_per_split < split.num_chunks)


@pytest.mark.parametrize("main,extra", MIXED_PAIRS)
def test_a_mixed_call_selects_a_partial_kernel_per_list_and_one_merge(main, extra):
    """A call whose extra cache is of another format: each list a call of its own format
    (``DecodeMetadata.list_calls``) in split mode, the extra list's kernel reading it as its
    main list (its lengths, no extra list), then one merge of all the splits; every variant
    in the variant space, the splits at most what the merge combines."""
    for (arch, sms, smem), (T, H, topk, extra_topk), flags in itertools.product(
            _TARGETS, _MIXED_SHAPES, itertools.product((False, True), repeat=3)):
        has_len, has_extra_len, has_sink = flags
        md = _mixed_md(main, extra, T, H, topk, extra_topk, has_len, has_extra_len, has_sink, extra_page=2)
        assert md.mixed
        main_md, extra_md = md.list_calls()
        assert main_md == dataclasses.replace(md, extra_topk=0, extra_page_block_size=None,
                                              has_extra_topk_length=False, extra_kv_format=None)
        assert extra_md == dataclasses.replace(main_md, kv_format=extra, topk=extra_topk, page_block_size=2,
                                               has_topk_length=has_extra_len)
        with pytest.raises(ValueError, match="a call of two formats runs a partial kernel per list"):
            variants_for(md, arch, 4, 1)
        space = set(variant_space(arch))
        for precision in set(format_precisions(arch, main)) & set(format_precisions(arch, extra)):
            what = (arch, precision, md)
            sel = select_kernels(md, arch, num_sms=sms, smem_per_sm=smem, precision=precision)
            assert len(sel.variants) == 3 and sel.extra is not None, what
            first, second, merge = sel.variants
            assert first == variants_for(main_md, arch, sel.split.num_splits, sel.head_groups, precision,
                                         two_ctas_per_sm=sel.two_ctas_per_sm, split_mode=True)[0], what
            assert second == sel.extra.variants[0] == variants_for(
                extra_md, arch, sel.extra.split.num_splits, sel.extra.head_groups, precision,
                two_ctas_per_sm=sel.extra.two_ctas_per_sm, split_mode=True)[0], what
            for partial, kv_format, has_topk_length in ((first, main, has_len), (second, extra, has_extra_len)):
                cfg = partial.config
                assert (cfg.kv_format, cfg.precision, cfg.has_topk_length) == (kv_format, precision, has_topk_length)
                assert not (cfg.final_output or cfg.has_sink or cfg.has_extra_topk_length), (what, cfg)
            assert sel.num_splits == sel.split.num_splits + sel.extra.split.num_splits <= MAX_SPLITS, what
            assert sel.split.num_splits < MAX_SPLITS, what  # the extra list has at least one split
            assert merge.config == MergeConfig(has_sink=has_sink, split_batch=merge_batch_for(sel.num_splits)), what
            assert _covers_every_chunk_once(sel.split, topk, first.config.block_n), (what, sel.split)
            assert _covers_every_chunk_once(sel.extra.split, extra_topk, second.config.block_n), (what, sel.extra)
            assert set(sel.variants) <= space, (what, [v.name for v in sel.variants if v not in space])


def test_a_mixed_call_splits_at_most_what_the_merge_combines():
    """Each list plans at most ``MAX_PLANNED_SPLITS`` splits (one merge batch), as it would
    alone, and the extra list at most what the main list's leave of ``MAX_SPLITS`` (the merge
    kernel's threads; ``plan_splits``' ``max_splits``, which binds only a list that would
    plan more): one token of 16 heads against 8192 + 8192 entries takes what each list alone
    would; one of 128 heads fills the GPU once per list well below it."""
    for arch, sms, smem in _TARGETS:
        md = _mixed_md(MODEL1, MODEL1_NVFP4.name, 1, 16, 8192, 8192)
        alone = [select_kernels(list_md, arch, num_sms=sms, smem_per_sm=smem,
                                precision="f16").num_splits for list_md in md.list_calls()]
        assert alone == [MAX_PLANNED_SPLITS, MAX_PLANNED_SPLITS], (arch, alone)
        sel = select_kernels(md, arch, num_sms=sms, smem_per_sm=smem, precision="f16")
        assert [sel.split.num_splits, sel.extra.split.num_splits] == alone, (arch, sel)
        assert sel.num_splits <= MAX_SPLITS, (arch, sel)
        for bound in (1, 5, MAX_PLANNED_SPLITS - 1):
            bounded = plan_splits(1, 16, 8192, 0, cfg=sel.variants[0].config, num_sms=sms, smem_per_sm=smem,
                                  max_splits=bound)
            assert bounded.num_splits <= bound, (arch, bound, bounded)
        longer = select_kernels(_mixed_md(MODEL1, MODEL1_NVFP4.name, 1, 1, 8192, 65536), arch, num_sms=sms,
                                smem_per_sm=smem, precision="f16")
        assert 1 < longer.extra.split.num_splits and longer.num_splits <= MAX_SPLITS, (arch, longer)
    sel = select_kernels(_mixed_md(MODEL1, MODEL1_NVFP4.name, 1, 128, 8192, 8192), "sm_120a", num_sms=188,
                         smem_per_sm=SM120_SMEM_PER_SM, precision="f16")
    assert 1 < sel.split.num_splits and 1 < sel.extra.split.num_splits and sel.num_splits <= MAX_SPLITS, sel


def test_a_call_whose_extra_cache_has_the_main_format_is_one_call():
    """An extra cache of the main cache's format (named or not) is the extra list of one
    partial kernel, as before formats could differ."""
    for kv_format in (MODEL1, MODEL1_NVFP4.name, V41_FP8.name, "v41_fp8_inline"):
        for named in (None, kv_format):
            md = _mixed_md(kv_format, named, 4, 64, 128, 512, has_extra_len=True)
            assert not md.mixed
            sel = select_kernels(md, "sm_120a", num_sms=188, smem_per_sm=SM120_SMEM_PER_SM, precision="f16")
            assert sel.extra is None and sel.num_splits == sel.split.num_splits, sel
            assert sel.variants[0].config.has_extra_topk_length and sel.variants[0].config.kv_format == kv_format


def _mixed_caches(main, extra, gen, extra_block_stride=None):
    """A main cache of ``main`` (4 blocks of 64) and an extra cache of ``extra`` (4 blocks of 64)."""
    stride = dict(block_stride=extra_block_stride) if extra_block_stride else {}
    return (make_cache(4, 64, device="cpu", kv_format=main, gen=gen),
            make_cache(4, 64, device="cpu", kv_format=extra, gen=gen, **stride))


@pytest.mark.parametrize("main,extra", sorted((m, e) for m, extras in EXTRA_FORMATS.items() for e in extras))
def test_the_models_pairings_validate_and_plan(monkeypatch, main, extra):
    """Every main + extra pairing a model uses is served: a pairing of two formats (DeepSeek-V4's
    FP8 and NVFP4 records either way, DeepSeek-V4.1's FP8 main cache with an extra cache of any
    of its records) validates and plans a partial kernel per list and a merge; an extra cache of
    the main format is the extra list of the one partial kernel."""
    gen = torch.Generator().manual_seed(21)
    main_cache, extra_cache = _mixed_caches(main, extra, gen)
    kw = dict(kv_cache=main_cache, kv_format=main, extra_kv_cache=extra_cache,
              extra_indices=make_indices(2, 64, 256, device="cpu", gen=gen), extra_kv_format=extra)
    plan, call = _cpu_plan(monkeypatch, **kw)
    assert call.extra.fmt.name == extra and call.launch_metadata.mixed == (main != extra)
    assert call.launch_metadata.extra_kv_format == (extra if main != extra else None)
    if main != extra:
        assert [v.kind for v in plan.variants] == ["partial", "partial", "merge"], plan.variants
        assert [v.config.kv_format for v in plan.variants[:2]] == [main, extra]
        assert plan.num_splits == plan.split.num_splits + plan.extra_split.num_splits
    else:
        assert plan.extra_split is None and plan.variants[0].config.kv_format == main
    # unnamed: the main format where the extra cache's width is one of its own (528 beside
    # 528), else the format the width names (584 or 384); 288 bytes is either NVFP4 record
    if FORMATS[extra].bytes_per_token != 288:
        _, unnamed = _cpu_plan(monkeypatch, **{**kw, "extra_kv_format": None})
        read_as = main if FORMATS[extra].view_widths == FORMATS[main].view_widths else extra
        assert unnamed.extra.fmt.name == read_as and unnamed.launch_metadata.mixed == (read_as != main), unnamed
    base = _inputs()
    with pytest.raises(InvalidDecodeInput, match="the kernels run on CUDA devices only") as info:  # served
        sparse_mla_decode(base["q"], indices=base["indices"], **kw)
    assert str(info.value).startswith(FORMATS[main].model_type + ": num_tokens=2")


def _launch_args(plan) -> list[dict]:
    """Each launch's kernel arguments by name: a ``Bind`` as (what it binds, its offset)."""
    schemas = (PARTIAL_ARGS,) * (len(plan.variants) - 1) + (MERGE_ARGS,)
    return [{a.name: (v.key, v.offset) if hasattr(v, "key") else v for a, v in zip(schema, args)}
            for schema, args in zip(schemas, plan._args)]


@pytest.mark.parametrize("main,extra,extra_block_stride", [
    (MODEL1, MODEL1_NVFP4.name, None), (MODEL1_NVFP4.name, MODEL1, None),
    ("v41_fp8_inline", "v41_nvfp4_inline", 66 * 288),  # flat rows in blocks padded by two rows: 66 a block
])
def test_a_mixed_plan_launches_each_list_as_a_call_of_its_format(monkeypatch, main, extra, extra_block_stride):
    """A call of two formats launches the main list alone, then the extra list as the main list
    of a kernel of its format (the extra cache's page, strides, slots, indices, lengths), its
    splits written after the main list's in the one set of partial outputs, then the merge of
    all of them. Every launch knows the outputs' total splits; each its own (the grid's)."""
    gen = torch.Generator().manual_seed(22)
    main_cache, extra_cache = _mixed_caches(main, extra, gen, extra_block_stride)
    T, H = 2, 16
    plan, call = _cpu_plan(monkeypatch, kv_cache=main_cache, kv_format=main, extra_kv_cache=extra_cache,
                           extra_indices=make_indices(T, 64, 256, device="cpu", gen=gen), extra_kv_format=extra,
                           topk_length=torch.full((T,), 100, dtype=torch.int32),
                           extra_topk_length=torch.full((T,), 50, dtype=torch.int32),
                           attn_sink=torch.zeros(H))
    first, second, merge = _launch_args(plan)
    main_splits, extra_splits, total = plan.split.num_splits, plan.extra_split.num_splits, plan.num_splits
    assert main_splits > 1 and extra_splits > 1 and total == main_splits + extra_splits  # offsets that matter
    assert plan._o_part_bytes == T * total * H * 512 * 4 and plan.scratch_bytes >= T * total * H * (512 * 4 + 4)
    # the main list alone
    assert (first["main_cache"], first["main_idx"], first["main_len"]) == (("main", 0), ("indices", 0),
                                                                          ("topk_length", 0))
    assert (first["main_topk"], first["main_page"], first["main_row_stride"], first["extra_topk"]) == (
        128, call.main.index_page, call.main.row_stride, 0)
    assert (first["chunks_per_split"], first["launch_splits"], first["num_splits"]) == (
        plan.split.chunks_per_split, main_splits, total)
    assert (first["o_part"], first["lse_part"]) == (("scratch", 0), ("scratch", plan._o_part_bytes))
    # the extra list as a kernel's main list: every main_* value the extra list's (its topk below)
    for name in ("cache", "page", "page_magic", "block_stride", "row_stride", "num_slots", "idx", "idx_stride", "len"):
        assert second[f"main_{name}"] == first[f"extra_{name}"], name
    index_page = 66 if extra_block_stride else 64
    assert (second["main_cache"], second["main_idx"], second["main_len"]) == (("extra", 0), ("extra_indices", 0),
                                                                             ("extra_topk_length", 0))
    assert (second["main_topk"], second["main_page"], second["main_page_magic"], second["main_row_stride"]) == (
        64, index_page, page_division_magic(index_page), FORMATS[extra].row_pitches[0] if FORMATS[extra].inline
        else FORMATS[extra].bytes_per_token)
    assert (second["main_block_stride"], second["main_num_slots"]) == (call.extra.block_stride, call.extra.num_slots)
    assert second["extra_topk"] == 0
    assert (second["chunks_per_split"], second["launch_splits"], second["num_splits"]) == (
        plan.extra_split.chunks_per_split, extra_splits, total)
    # its split s is split main_splits + s of the [T, total, H, ...] partial outputs
    assert (second["o_part"], second["lse_part"]) == (("scratch", main_splits * H * 512 * 4),
                                                      ("scratch", plan._o_part_bytes + main_splits * H * 4))
    changed = {"chunks_per_split", "launch_splits", "o_part", "lse_part"} | {n for n in second if n.startswith("main_")}
    assert {n: v for n, v in second.items() if n not in changed} == {n: v for n, v in first.items() if n not in changed}
    # the merge of all the splits, the sink its own
    assert (merge["num_splits"], merge["o_part"], merge["lse_part"], merge["attn_sink"]) == (
        total, ("scratch", 0), ("scratch", plan._o_part_bytes), ("attn_sink", 0))
    assert plan.variants[2].config == MergeConfig(has_sink=True, split_batch=merge_batch_for(total))
    assert not any(v.config.has_sink for v in plan.variants[:2])


def test_overrides_num_splits_is_refused_for_a_mixed_call(monkeypatch):
    """A call of two formats splits each list by itself: a forced split count is refused;
    the other overrides apply to both lists' kernels."""
    md = _mixed_md(MODEL1, MODEL1_NVFP4.name, 2, 16, 128, 64)
    message = ("overrides.num_splits: a call of two cache formats (model1_fp8 + model1_nvfp4) splits each list by "
               "itself")
    with pytest.raises(ValueError, match=re.escape(message)):
        select_kernels(md, "sm_120a", num_sms=188, smem_per_sm=SM120_SMEM_PER_SM, precision="f16",
                       overrides=PlanOverrides(num_splits=2))
    _, call = _cpu_plan(monkeypatch, extra_kv_cache=NVFP4_CACHE, extra_indices=_EXTRA_IDX)
    assert call.launch_metadata.mixed
    with pytest.raises(ValueError, match=re.escape(message)):
        DecodePlan(call, PlanOverrides(num_splits=1))
    sel = select_kernels(md, "sm_120a", num_sms=188, smem_per_sm=SM120_SMEM_PER_SM, precision="f16",
                         overrides=PlanOverrides(head_groups=2, num_stages=2))
    assert sel.head_groups == sel.extra.head_groups == 2
    assert [(v.config.head_groups, v.config.stages) for v in sel.variants[:2]] == [(2, 2), (2, 2)], sel.variants


_TARGET = SM120_TARGET


@pytest.mark.parametrize("heads", [65535, 65536])
def test_a_call_that_merges_takes_at_most_65535_heads(monkeypatch, heads):
    """The merge kernel's grid puts the heads in its y, which CUDA limits to 65,535: a call of
    two formats, or one split by ``PlanOverrides``, plans with 65,535 heads and is refused with
    65,536 before any kernel is loaded, naming q's shape and the limit (the two formats' call
    by the validation, the forced split by the plan); a call of one format the dispatch does
    not split launches no merge and is served with either."""
    from dispatch.api import validate_call
    from dispatch.runtime import loader

    _stub_kernels(monkeypatch)
    loaded = []
    monkeypatch.setattr(loader, "get_compiled", loaded.append)
    base = _inputs(T=1)
    q = torch.empty(1, heads, 512, dtype=torch.bfloat16)
    merged = {"two formats": (dict(extra_kv_cache=NVFP4_CACHE, extra_indices=torch.zeros(1, 64, dtype=torch.int32)),
                              None),
              "a forced split": ({}, PlanOverrides(num_splits=2))}
    for what, (kw, overrides) in merged.items():
        loaded.clear()
        if heads <= 65535:
            plan = DecodePlan(validate_call(q, base["kv_cache"], base["indices"], _target=_TARGET, **kw), overrides)
            assert plan.variants[-1].kind == "merge" and len(loaded) == len(plan.variants), what
            continue
        message = (f"q of shape [1, {heads}, 512]: the merge kernel's grid would be (1, {heads}, 1), its y the "
                   f"call's heads ({heads:,}), past CUDA's limit of 65,535 on a grid's y")
        with pytest.raises(InvalidDecodeInput, match=re.escape(message)):
            DecodePlan(validate_call(q, base["kv_cache"], base["indices"], _target=_TARGET, **kw), overrides)
        assert not loaded, what
    plan = DecodePlan(validate_call(q, base["kv_cache"], base["indices"], _target=_TARGET))
    assert plan.final and [v.kind for v in plan.variants] == ["partial"]


def _launch_expressions() -> tuple[str, str, str]:
    """The kernels' own launch code: PartialKernel._launch's head blocks and grid, and
    MergeKernel._launch's grid, as written in their source."""
    from pathlib import Path

    import cute_kernels

    source = Path(cute_kernels.__file__).parent / "sparse_mla_decode"
    partial, merge = (source / "partial.py").read_text(), (source / "merge.py").read_text()
    head_blocks = re.search(r"\n\s+head_blocks = (.+)\n", partial).group(1)
    return head_blocks, re.search(r"grid=(\(.+?\)),", partial).group(1), re.search(r"grid=(\(.+?\)),", merge).group(1)


@pytest.mark.parametrize("kv_format,extra_format,T,H", [(MODEL1, MODEL1, 3, 40), (MODEL1, MODEL1_NVFP4.name, 2, 20),
                                                        (MODEL1_NVFP4.name, MODEL1, 1, 128)])
def test_the_grids_checked_are_those_the_kernels_launch(monkeypatch, kv_format, extra_format, T, H):
    """``plan.launch_grids`` (what the GPU's limits are checked on) is what each kernel's
    launch code computes from the plan's arguments: the grid expressions of
    ``PartialKernel._launch`` and ``MergeKernel._launch``, read from their source and evaluated
    on every launch of a plan."""
    import types

    from dispatch.runtime.plan import launch_grids

    head_blocks, partial_grid, merge_grid = _launch_expressions()
    assert (head_blocks, partial_grid, merge_grid) == ("(p.num_heads + self.hb - 1) // self.hb",
                                                       "(p.num_tokens * head_blocks, p.launch_splits, 1)",
                                                       "(p.num_tokens, p.num_heads, 1)")
    gen = torch.Generator().manual_seed(23)
    q = torch.randn(T, H, 512, generator=gen).to(torch.bfloat16)
    idx = make_indices(T, 2048, 256, device="cpu", gen=gen)  # long lists: split, so a merge is launched
    plan, call = _cpu_plan(monkeypatch, q=q, indices=idx, kv_cache=_mixed_caches(kv_format, extra_format, gen)[0],
                           kv_format=kv_format, extra_kv_cache=_mixed_caches(extra_format, extra_format, gen)[1],
                           extra_indices=make_indices(T, 1024, 256, device="cpu", gen=gen))
    grids = launch_grids(call.selection, T, H)
    schemas = (PARTIAL_ARGS,) * (len(plan.variants) - 1) + (MERGE_ARGS,)
    assert plan.variants[-1].kind == "merge" and [v for v, _ in grids] == list(plan.variants)
    for (variant, grid), schema, args in zip(grids, schemas, plan._args):
        p = types.SimpleNamespace(**{a.name: v for a, v in zip(schema, args)})
        scope = {"p": p, "self": types.SimpleNamespace(hb=getattr(variant.config, "heads_per_cta", None))}
        if variant.kind == "partial":
            scope["head_blocks"] = eval(head_blocks, scope)
        assert eval(partial_grid if variant.kind == "partial" else merge_grid, scope) == grid, variant.name
