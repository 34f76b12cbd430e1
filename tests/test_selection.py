"""Kernel selection (CPU): the variants a call's metadata keys, their names and configurations,
head groups, split plans, CTAs per SM and the register bound, precisions, and the overrides a
plan takes."""

import dataclasses
import itertools
import math
import re

import pytest

from cute_kernels.sparse_mla_decode.config import MergeConfig, PartialConfig
from cute_kernels.sparse_mla_decode.kv_format import (
    EXTRA_FORMATS, FORMATS, GLM_NOPE_FP8, MODEL1_NVFP4, V32_FP8, get_format,
)
from dispatch.policy.call_metadata import DecodeMetadata
from dispatch.policy.registry import H200_SMEM_PER_SM, SM120_SMEM_PER_SM
from dispatch.policy.occupancy import resident_ctas_per_sm
from dispatch.policy.splits import MAX_SPLITS, plan_splits, two_ctas_per_sm
from dispatch.policy.head_groups import head_groups_for, partial_shape_config
from dispatch.policy.precision import check_format_precision, precisions_for, resolve_precision
from dispatch.policy.variant_space import variant_space, variants_for
from tests.dispatch_inputs import MODEL1, _md


@pytest.mark.parametrize("kv_format", sorted(FORMATS))
def test_variant_keys_follow_the_metadata(kv_format):
    extra_lengths = (False, True) if kv_format in EXTRA_FORMATS else (False,)
    for a, b, s in itertools.product((False, True), extra_lengths, (False, True)):
        md = _md(kv_format, num_tokens=3, num_heads=8, topk=192, page_block_size=64, extra_topk=512 * b,
                 has_topk_length=a, has_extra_topk_length=b, has_sink=s)
        partial, merge = variants_for(md, "sm_120a", num_splits=3, head_groups=1)
        assert partial.config == PartialConfig(kv_format=kv_format, has_topk_length=a,
                                               has_extra_topk_length=b)  # 8 heads: one group
        assert merge.config == MergeConfig(has_sink=s, split_batch=8)  # 3 splits: one batch of 8
        (final,) = variants_for(md, "sm_120a", num_splits=1, head_groups=1)  # one split: no merge, sink in the epilogue
        assert final.config == PartialConfig(kv_format=kv_format, has_topk_length=a, has_extra_topk_length=b,
                                             final_output=True, has_sink=s)
        # one list of a call of two formats: split partials even for one split, merged
        lone, lone_merge = variants_for(md, "sm_120a", num_splits=1, head_groups=1, split_mode=True)
        assert lone == partial and lone_merge.config == MergeConfig(has_sink=s, split_batch=8), (lone, lone_merge)
        space = variant_space("sm_120a")
        assert partial in space and merge in space
        # a format read only as an extra cache runs in split mode alone (a list of a two-format call)
        assert (final in space) == FORMATS[kv_format].main, final.name


def test_variants_need_the_format():
    with pytest.raises(ValueError, match="kv_format must be known"):
        variants_for(DecodeMetadata(num_tokens=1, num_heads=16), "sm_120a", num_splits=1, head_groups=1)


@pytest.mark.parametrize("kv_format", sorted(FORMATS))
def test_shapes_do_not_reach_the_key(kv_format):
    """num_tokens, topk, extra_topk and page sizes are runtime values; num_heads and num_tokens
    reach the key only through the number of 16-head groups per CTA (``head_groups_for``)."""
    extras = (0, 8192) if kv_format in EXTRA_FORMATS else (0,)
    for precision in ("bf16", "f16"):
        keys = {}
        for T, H, topk, extra, page in itertools.product((1, 65), (1, 8, 16, 17, 64, 128), (1, 100, 1152),
                                                        extras, (2, 64, 256)):
            md = _md(kv_format, num_tokens=T, num_heads=H, topk=topk, page_block_size=page, extra_topk=extra)
            groups = head_groups_for(H, T, num_sms=188, topk=topk, extra_topk=extra, smem_per_sm=SM120_SMEM_PER_SM,
                                     precision=precision, kv_format=kv_format)
            keys.setdefault(groups, set()).add((variants_for(md, "sm_120a", 1, groups, precision),
                                                variants_for(md, "sm_120a", 4, groups, precision)))
        assert all(len(k) == 1 for k in keys.values())
        assert set(keys) == {1, 2}


def test_variant_names_hold_every_code_generating_field():
    space = variant_space("sm_120a") + variant_space("sm_121a")
    assert len({v.name for v in space}) == len(space) == len(set(space))
    for v in space:
        v.config.check()
        for f in dataclasses.fields(v.config):
            value = 5 - v.config.stages if f.name == "num_stages" else _another(getattr(v.config, f.name))  # 2 <-> 3
            other = dataclasses.replace(v.config, **{f.name: value})
            assert other.name != v.config.name, f"{f.name} is not part of the kernel name"


def _another(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2
    return value + "x"


def test_variant_space_per_format():
    """Per format: only its precisions, an extra list only where a model pairs it with an
    extra cache, the 128-register bound only for a 256-thread "f16" kernel; every
    configuration generates (``check``) and holds its format in its name."""
    for arch in ("sm_90a", "sm_120a", "sm_121a"):
        partials = [v for v in variant_space(arch) if v.kind == "partial"]
        assert {v.config.kv_format for v in partials} == set(FORMATS)
        for v in partials:
            cfg = v.config
            v.config.check()
            assert f"_{cfg.kv_format}_" in v.name
            assert cfg.precision in FORMATS[cfg.kv_format].paths
            assert not cfg.has_extra_topk_length or cfg.kv_format in FORMATS[cfg.kv_format].extras
            assert not cfg.two_ctas_per_sm or (cfg.precision == "f16" and cfg.num_threads == 256)
        inline_f16 = [v.config for v in partials if get_format(v.config.kv_format).inline and v.config.precision == "f16"]
        assert inline_f16 and all(cfg.num_threads == 288 and not cfg.two_ctas_per_sm for cfg in inline_f16)


def test_the_bf16_dequantize_width_cannot_be_tuned_away_from_its_loads(monkeypatch):
    from cute_kernels.sparse_mla_decode import tuning

    PartialConfig(precision="bf16").check()
    monkeypatch.setattr(tuning, "DEQUANT_VALUES", 8)
    with pytest.raises(ValueError, match="DEQUANT_VALUES is 8"):
        PartialConfig(precision="bf16").check()
    PartialConfig(precision="f16").check()  # the other paths do not use it


def test_head_groups_follow_heads_and_load():
    def bf16(*args, **kw):
        return head_groups_for(*args, precision="bf16", smem_per_sm=SM120_SMEM_PER_SM, **kw)

    assert bf16(16, 4096, 188, topk=512) == 1  # 16 heads or fewer: one group
    assert bf16(128, 1, 188, topk=2048) == 1  # 8 blocks of 16 heads: latency-bound, lighter CTAs
    assert bf16(128, 3, 188, topk=512) == 1  # 24 blocks
    assert bf16(128, 4, 188, topk=512) == 2  # 32 blocks: each gathered row serves 32 heads
    assert bf16(128, 4, 188, topk=128) == 1  # ... but not for 128 entries (with splits)
    assert bf16(64, 8, 132, topk=256) == 2
    assert bf16(64, 34, 132, topk=64) == 2  # more blocks than SMs: no split, two groups
    assert bf16(64, 33, 132, topk=64) == 1  # 132 blocks: splits come in, 64 entries
    assert bf16(17, 200, 188, topk=1) == 2
    # "f16" (the default) where an SM holds two CTAs of either shape (the H200): two groups
    # where the 32-head CTAs fill three quarters of the 264 slots without a split, or, split,
    # get enough chunks each (measured, ``head_groups_for``)
    def h200(H, T, topk=1024, extra_topk=0):
        return head_groups_for(H, T, 132, topk=topk, extra_topk=extra_topk, smem_per_sm=H200_SMEM_PER_SM)

    for H, T in ((16, 4096), (128, 4), (128, 8), (64, 64), (128, 32), (128, 48), (64, 98), (32, 197)):
        assert h200(H, T) == 1, (H, T)
    for H, T in ((128, 64), (128, 256), (64, 99), (64, 128), (32, 198), (17, 200), (128, 50)):
        assert h200(H, T) == 2, (H, T)
    assert h200(128, 64, topk=1) == 2  # without a split the rule does not look at the entries
    # both grids split: 32-head CTAs from 7 chunks each (16 x 128 x 1024: 2 splits of 16
    # chunks against 4 of 8; 12 x 128 x 1024: 2 of 16 against 5 of 7) ...
    for H, T, topk, extra in ((128, 16, 1024, 0), (64, 32, 1024, 0), (128, 12, 1024, 0), (128, 8, 2048, 0),
                              (128, 16, 128, 1024)):
        assert h200(H, T, topk, extra) == 2, (H, T, topk, extra)
    # ... not below (8 x 128 x 1024: 8 splits of 4; 12 x 64 x 2048: 11 of 6; 16 x 128 x 128+512: 4 of 5)
    for H, T, topk, extra in ((128, 8, 1024, 0), (64, 12, 2048, 0), (128, 16, 128, 512), (128, 16, 512, 0),
                              (128, 4, 2048, 0)):
        assert h200(H, T, topk, extra) == 1, (H, T, topk, extra)
    # the 16-head grid without a split: 32-head CTAs where 8 / 5 of their chunks + 7 <= the
    # 16-head CTAs' (18 x 128 x 1024: 3 splits of 11 against 32 chunks; 24 x 128 x 2048: 2 of 32
    # against 64) ...
    for H, T, topk in ((128, 18, 1024), (128, 20, 2048), (64, 40, 1024), (64, 34, 1024), (128, 24, 2048),
                       (64, 36, 2048)):
        assert h200(H, T, topk) == 2, (H, T, topk)
    # ... not at 16 against 32 (24 x 128, 64 x 64, 32 x 128 x 1024) or 8 against 16 (64 x 64 x 512)
    for H, T, topk in ((128, 24, 1024), (64, 64, 1024), (64, 64, 512), (128, 32, 1024)):
        assert h200(H, T, topk) == 1, (H, T, topk)

    # ... and where it holds one (sm_120): 32-head CTAs for many heads (measured at that occupancy)
    def f16(*args, **kw):
        return head_groups_for(*args, smem_per_sm=SM120_SMEM_PER_SM, **kw)

    assert f16(16, 4096, 188, topk=1024) == 1  # 16 heads: one group
    assert f16(64, 64, 188, topk=128) == 2  # 256 blocks > 188 SMs
    assert f16(128, 8, 188, topk=512) == 2  # 64 blocks, 512 entries
    assert f16(128, 8, 188, topk=128) == 1  # ... but not 128 entries
    assert f16(64, 8, 188, topk=1024) == 1  # 32 blocks


def test_h200_head_group_rule_only_where_the_f16_kernel_can_be_held():
    """The H200's "f16" rule plans two 128-register CTAs per SM; the inline formats' 288-thread
    "f16" kernel cannot be held there, so they take the generic "f16" rule (the one sm_120
    uses, at the H200's SM count) and are planned unbounded."""
    cases = [(128, 8, 1024), (128, 4, 1024), (64, 64, 1024), (128, 64, 1024), (128, 16, 512), (64, 12, 2048),
             (32, 198, 1024), (128, 8, 2048), (16, 4096, 2048)]
    differs = 0
    for kv_format in (V32_FP8.name, GLM_NOPE_FP8.name):
        for H, T, topk in cases:
            got = head_groups_for(H, T, 132, topk=topk, smem_per_sm=H200_SMEM_PER_SM, kv_format=kv_format)
            generic = head_groups_for(H, T, 132, topk=topk, smem_per_sm=SM120_SMEM_PER_SM, kv_format=kv_format)
            model1 = head_groups_for(H, T, 132, topk=topk, smem_per_sm=H200_SMEM_PER_SM)
            assert got == generic, (kv_format, H, T, topk)
            differs += got != model1
            cfg = partial_shape_config(H, T, 132, topk=topk, smem_per_sm=H200_SMEM_PER_SM, kv_format=kv_format)
            assert cfg.kv_format == kv_format and not cfg.two_ctas_per_sm
            cfg.check()
    assert differs  # the H200 rule is not the generic one: the branch matters
    assert partial_shape_config(128, 64, 132, topk=1024, smem_per_sm=H200_SMEM_PER_SM).two_ctas_per_sm


@pytest.mark.parametrize("T,H,topk,extra", [(1, 16, 128, 0), (1, 128, 2048, 8192), (300, 128, 128, 0),
                                            (7, 1, 1, 0), (64, 64, 512, 512), (4096, 8, 100, 33),
                                            (1, 8, 8192, 8192)])
def test_split_plan_covers_every_chunk_once(T, H, topk, extra):
    cfg = partial_shape_config(H, T, 188, topk=topk, extra_topk=extra, smem_per_sm=SM120_SMEM_PER_SM)
    plan = plan_splits(T, H, topk, extra, cfg=cfg, num_sms=188, smem_per_sm=SM120_SMEM_PER_SM)
    assert plan.num_chunks == math.ceil(topk / 32) + math.ceil(extra / 32)
    assert 1 <= plan.num_splits <= MAX_SPLITS  # the merge kernel has one thread per split
    assert plan.num_splits * plan.chunks_per_split >= plan.num_chunks
    assert (plan.num_splits - 1) * plan.chunks_per_split < plan.num_chunks
    if T * math.ceil(H / cfg.heads_per_cta) >= 188:  # sm_120: one CTA per SM
        assert plan.num_splits == 1


def test_split_plans_follow_the_h200_measurements():
    """The splits ``plan_splits`` picks on the H200 (132 SMs, two 16-head "f16" CTAs per SM)
    where ``scripts.split_sweep`` measured the choice (``docs/tuning.md``)."""
    expected = {  # (T, H, topk, extra): (chunks per split, splits)
        (1, 16, 128, 0): (1, 4),  # single-chunk CTAs, few: as many splits as chunks
        (1, 128, 1024, 0): (2, 16),  # single-chunk CTAs would be two per SM: one per SM, two chunks
        (8, 16, 1024, 0): (2, 16),
        (8, 64, 512, 0): (4, 4),  # two-chunk CTAs two per SM: one per SM, four chunks (16.1 -> 14.9 us)
        (8, 64, 128, 512): (5, 4),  # three-chunk CTAs two per SM: one per SM, five (16.7 -> 15.7 us)
        (8, 128, 512, 0): (4, 4),  # four chunks: two CTAs per SM stay
        (8, 128, 1024, 0): (8, 4),
        (64, 16, 128, 0): (4, 1),  # one CTA per SM would leave two splits: one, no merge (14.0 -> 12.7 us)
        (8, 128, 128, 0): (4, 1),  # the same (13.1 -> 12.2 us)
        (64, 64, 1024, 0): (32, 1),
    }
    for (T, H, topk, extra), want in expected.items():
        cfg = partial_shape_config(H, T, 132, topk=topk, extra_topk=extra, smem_per_sm=H200_SMEM_PER_SM)
        plan = plan_splits(T, H, topk, extra, cfg=cfg, num_sms=132, smem_per_sm=H200_SMEM_PER_SM)
        assert (plan.chunks_per_split, plan.num_splits) == want, (T, H, topk, extra, plan)


def test_dealt_lists_are_planned_one_cta_per_sm_where_that_keeps_eight_splits():
    """A call with a length tensor deals the chunks its lengths reach across the splits; where
    its one-wave plan would put two CTAs on an H200 SM, it is planned for one CTA per SM
    instead if each token keeps ``MIN_DEALT_SPLITS_ONE_PER_SM`` splits (the ratio-128 list,
    128 + 8192 wide with 512 valid, at 16 heads and 8 tokens: 15.8 -> 13.4 us, ``docs/tuning.md``);
    a call without lengths, or one left with fewer splits, keeps the plan of two CTAs per SM."""
    expected = {  # (T, H, topk, extra): ((splits, two per SM) with lengths, the same without)
        (8, 16, 128, 8192): ((16, False), (29, True)),
        (16, 16, 128, 8192): ((8, False), (16, True)),
        (4, 32, 128, 8192): ((16, False), (29, True)),
        (32, 16, 128, 8192): ((8, True), (8, True)),  # one CTA per SM would leave 4
        (64, 16, 128, 1024): ((4, True), (4, True)),  # likewise 2
        (1, 16, 128, 8192): ((29, False), (29, False)),  # one CTA per SM either way
    }
    for (T, H, topk, extra), want in expected.items():
        cfg = partial_shape_config(H, T, 132, topk=topk, extra_topk=extra, smem_per_sm=H200_SMEM_PER_SM)
        got = []
        for dealt in (True, False):
            plan = plan_splits(T, H, topk, extra, cfg=cfg, num_sms=132, smem_per_sm=H200_SMEM_PER_SM, dealt=dealt)
            got.append((plan.num_splits, two_ctas_per_sm(cfg, plan, num_tokens=T, num_heads=H, num_sms=132,
                                                         smem_per_sm=H200_SMEM_PER_SM)))
        assert tuple(got) == want, (T, H, topk, extra, got)
        # on sm_120 (one CTA per SM always) the lengths change no plan
        cfg = partial_shape_config(H, T, 188, topk=topk, extra_topk=extra, smem_per_sm=SM120_SMEM_PER_SM)
        assert len({plan_splits(T, H, topk, extra, cfg=cfg, num_sms=188, smem_per_sm=SM120_SMEM_PER_SM, dealt=d)
                    for d in (True, False)}) == 1
    # the dispatch passes the call's length tensors on: the extra list's length, or the main's
    from dispatch.policy.selection import select_kernels
    for lengths, want in (({}, (29, True)), ({"has_extra_topk_length": True}, (16, False)),
                          ({"has_topk_length": True}, (16, False))):
        md = _md(num_tokens=8, num_heads=16, topk=128, page_block_size=64, extra_topk=8192, extra_page_block_size=2,
                 **lengths)
        sel = select_kernels(md, "sm_90a", num_sms=132, smem_per_sm=H200_SMEM_PER_SM, precision="f16")
        assert (sel.split.num_splits, sel.two_ctas_per_sm) == want, lengths
    # the "bf16" / FP8 paths' two CTAs per SM are not the register bound's: their plans stay
    for precision in ("bf16", "fp8"):
        plans = {select_kernels(_md("v32_fp8", num_tokens=8, num_heads=32, topk=2048, page_block_size=64, extra_topk=0,
                                    has_topk_length=lengths), "sm_90a", num_sms=132, smem_per_sm=H200_SMEM_PER_SM,
                                precision=precision).split for lengths in (True, False)}
        assert len(plans) == 1 and plans.pop().num_splits == 16, precision


def test_split_plan_refuses_an_empty_grid():
    cfg = partial_shape_config(16, 1, 188, topk=128, smem_per_sm=SM120_SMEM_PER_SM)
    with pytest.raises(ValueError, match="at least one token and one head"):
        plan_splits(0, 16, 128, 0, cfg=cfg, num_sms=188, smem_per_sm=SM120_SMEM_PER_SM)


@pytest.mark.parametrize("T,H,topk,extra", [(1, 128, 1024, 0), (8, 16, 512, 0), (64, 16, 128, 0), (8, 128, 1024, 0),
                                            (64, 128, 512, 0), (8, 64, 128, 512), (256, 8, 128, 0),
                                            (256, 64, 128, 0)])
def test_register_bound_only_where_two_ctas_share_an_sm(T, H, topk, extra):
    """The "f16" kernel (16- or 32-head CTAs) is held to 128 registers exactly where its grid
    has more CTAs than the H200 has SMs (two then share one); never on sm_120 (one CTA per SM)."""
    md = _md(num_tokens=T, num_heads=H, topk=topk, page_block_size=64, extra_topk=extra)
    for sms, smem, arch in ((132, H200_SMEM_PER_SM, "sm_90a"), (188, SM120_SMEM_PER_SM, "sm_120a")):
        cfg = partial_shape_config(H, T, sms, topk=topk, extra_topk=extra, smem_per_sm=smem)
        plan = plan_splits(T, H, topk, extra, cfg=cfg, num_sms=sms, smem_per_sm=smem)
        two = two_ctas_per_sm(cfg, plan, num_tokens=T, num_heads=H, num_sms=sms, smem_per_sm=smem)
        ctas = T * math.ceil(H / cfg.heads_per_cta) * plan.num_splits
        assert two == (arch == "sm_90a" and ctas > sms), (arch, cfg, plan)
        partial = variants_for(md, arch, plan.num_splits, cfg.head_groups, two_ctas_per_sm=two)[0]
        assert partial.config.max_registers == (128 if two else 255)
        assert partial in variant_space(arch)


def test_the_bounded_variants_are_where_an_sm_holds_two_of_them():
    from cute_kernels.arch import SUPPORTED_ARCHS

    for arch in SUPPORTED_ARCHS:  # the 128-register variants only where an SM holds two CTAs
        held = {(v.config.kv_format, v.config.head_groups) for v in variant_space(arch)
                if v.kind == "partial" and v.config.two_ctas_per_sm}
        # only the 256-thread "f16" kernels, MODEL1 FP8's and NVFP4's: both head-group counts on
        # the H200 (228 KB per SM); on sm_80 (164 KB) the 16-head ones (MODEL1 FP8's 32-head
        # CTA, 86,160 bytes, does not fit twice; NVFP4's does, but spills at 128 registers, and
        # sm_80's binaries ship); none with 100 KB
        expected = {"sm_90a": {(f, g) for f in (MODEL1, MODEL1_NVFP4.name) for g in (1, 2)},
                    "sm_80": {(MODEL1, 1), (MODEL1_NVFP4.name, 1)}}.get(arch, set())
        assert held == expected, arch


def test_resident_ctas_per_sm():
    """sm_120 (100 KB of shared memory per SM) holds one partial CTA of either shape and
    precision; the H200 (228 KB) two of the one-group shape (bf16: 128 threads; f16: 256
    threads held to 128 registers by the launch bound), two of the f16 two-group shape held
    the same way, and one bf16 two-group CTA."""
    for precision in ("bf16", "f16"):
        one, two = (PartialConfig(head_groups=g, precision=precision, two_ctas_per_sm=precision == "f16")
                    for g in (1, 2))
        assert resident_ctas_per_sm(one, SM120_SMEM_PER_SM) == resident_ctas_per_sm(two, SM120_SMEM_PER_SM) == 1
        assert resident_ctas_per_sm(one, H200_SMEM_PER_SM) == 2
        assert resident_ctas_per_sm(two, H200_SMEM_PER_SM) == (2 if precision == "f16" else 1)
    for groups in (1, 2):
        assert PartialConfig(head_groups=groups, two_ctas_per_sm=True).max_registers == 128
        PartialConfig(head_groups=groups, two_ctas_per_sm=True).check()
        assert resident_ctas_per_sm(PartialConfig(head_groups=groups), H200_SMEM_PER_SM) == 1  # unbounded: one
    assert PartialConfig(head_groups=1).max_registers == PartialConfig(head_groups=2).max_registers == 255
    with pytest.raises(ValueError, match="for the 256-thread \"f16\" kernel"):
        PartialConfig(head_groups=1, precision="bf16", two_ctas_per_sm=True).check()


def test_precision_defaults_and_availability():
    """f16 unless asked (by measurement: README "Precision"); the block-scaled form only
    where the hardware has it, refused elsewhere with the arch named."""
    for arch in ("sm_90a", "sm_120a", "sm_121a"):
        assert resolve_precision(None, arch) == "f16"
        assert resolve_precision("fp8", arch) == "fp8"
        assert resolve_precision("bf16", arch) == "bf16"
    assert precisions_for("sm_120a") == precisions_for("sm_121a") == ("bf16", "f16", "fp8", "mxf8")
    assert precisions_for("sm_90a") == ("bf16", "f16", "fp8")
    with pytest.raises(ValueError, match="'mxf8' is not available on sm_90a"):
        resolve_precision("mxf8", "sm_90a")
    for arch in ("sm_90a", "sm_120a"):
        counts = {}
        for v in variant_space(arch):
            if v.kind == "partial":
                counts[v.config.kv_format, v.config.precision] = counts.get((v.config.kv_format, v.config.precision),
                                                                            0) + 1
        # MODEL1: every precision serves every call shape (2 groups x 12), and on the H200 the
        # "f16" kernels of both groups also held to two CTAs per SM (24 more); the inline
        # formats: no extra list (2 groups x 6), no "mxf8" (FP32 scales), never held
        want = {(MODEL1, p): 24 + (24 if p == "f16" and arch == "sm_90a" else 0) for p in precisions_for(arch)}
        want.update({(f, p): 12 for f in (V32_FP8.name, GLM_NOPE_FP8.name) for p in ("bf16", "f16", "fp8")})
        # NVFP4: "f16" only, the call shapes of MODEL1, held on the H200 as MODEL1's
        want[MODEL1_NVFP4.name, "f16"] = 24 + (24 if arch == "sm_90a" else 0)
        # V4.1 FP8 (UE8M0 per 32 dims): "f16" and "bf16", MODEL1's call shapes (an extra list
        # of its own format), never held (288 threads); V4.1 NVFP4, read only as an extra
        # cache: "f16", split mode alone (2 groups x with or without lengths)
        want.update({(f, p): 24 for f in ("v41_fp8", "v41_fp8_inline") for p in ("bf16", "f16")})
        want.update({(f.name, "f16"): 4 for f in FORMATS.values() if not f.main})
        assert counts == want, arch


def test_precision_a_format_lacks_is_refused_naming_it():
    """"mxf8" reads UE8M0 scale bytes: MODEL1's; the FP32-scale formats are refused on every
    arch, with the format named (the arch check comes second)."""
    for arch in ("sm_90a", "sm_120a", "sm_121a"):
        for kv_format in (V32_FP8.name, GLM_NOPE_FP8.name):
            for precision in (None, "fp8"):
                check_format_precision(precision, kv_format)
                assert resolve_precision(precision, arch) == (precision or "f16")
            with pytest.raises(ValueError, match=f"'mxf8' does not read {kv_format} caches"):
                check_format_precision("mxf8", kv_format)
    check_format_precision("mxf8", MODEL1)
    assert resolve_precision("mxf8", "sm_120a") == "mxf8"


@pytest.mark.parametrize("overrides,message", [
    (dict(head_groups=3), "overrides.head_groups must be one of (1, 2)"),
    (dict(num_splits=0), "overrides.num_splits must be in [1, 128]"),
    (dict(num_splits=129), "overrides.num_splits must be in [1, 128]"),
    (dict(num_stages=4), "overrides.num_stages must be 2 or 3"),
])
def test_plan_overrides_refuse_what_no_kernel_has(overrides, message):
    from dispatch import PlanOverrides

    with pytest.raises(ValueError, match=re.escape(message)):
        PlanOverrides(**overrides).check()


@pytest.mark.parametrize("overrides,message", [
    (dict(head_groups=True), "overrides.head_groups must be an int or None, got True (bool)"),
    (dict(num_splits=2.0), "overrides.num_splits must be an int or None, got 2.0 (float)"),
    (dict(num_stages="3"), "overrides.num_stages must be an int or None, got '3' (str)"),
    (dict(two_ctas_per_sm=1), "overrides.two_ctas_per_sm must be True, False or None, got 1 (int)"),
])
def test_plan_overrides_refuse_the_wrong_types(overrides, message):
    from dispatch import PlanOverrides

    with pytest.raises(ValueError, match=re.escape(message)):
        PlanOverrides(**overrides).check()


def test_plan_overrides_name_the_precision_a_register_bound_does_not_fit():
    from dispatch import PlanOverrides

    PlanOverrides(two_ctas_per_sm=True).check("f16")
    PlanOverrides(two_ctas_per_sm=False).check("bf16")
    for precision in ("bf16", "fp8", "mxf8"):
        with pytest.raises(ValueError, match=rf"overrides.two_ctas_per_sm=True .*precision is '{precision}'"):
            PlanOverrides(two_ctas_per_sm=True).check(precision)


@pytest.mark.parametrize("target", ["sm_80", "sm_86", "sm_89"])
def test_a_profile_selects_what_its_target_selects_on_a_gpu_with_more_shared_memory(target):
    """The arch profile of ``target`` on an H200 (228 KB per SM) plans every deployment call
    of every path the target has as the target itself does (its shared memory per SM, its
    bounded kernels, its paths): the same variants but for the name, so that the GPU tests
    under the profile run the kernels the target ships."""
    from cute_kernels.arch import arch_facts
    from dispatch.policy.registry import deployment_calls
    from dispatch.policy.selection import select_kernels

    profile = f"{target}_on_sm_90a"
    checked = 0
    for precision in precisions_for(target):
        for md, sms in itertools.islice(deployment_calls(precision, target), 0, None, 97):
            mine = select_kernels(md, target, num_sms=sms, smem_per_sm=arch_facts(target).smem_per_sm,
                                  precision=precision)
            theirs = select_kernels(md, profile, num_sms=sms, smem_per_sm=H200_SMEM_PER_SM, precision=precision)
            assert [v.name + "_on_sm_90a" for v in mine.variants] == [v.name for v in theirs.variants], md
            assert (mine.head_groups, mine.split, mine.two_ctas_per_sm) == \
                (theirs.head_groups, theirs.split, theirs.two_ctas_per_sm)
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("arch,precision,lacks", [("sm_80", "fp8", "sm_80 has no e4m3 MMA"),
                                                  ("sm_86", "mxf8", "sm_86 has no block-scaled MMA"),
                                                  ("sm_86_on_sm_90a", "fp8", "sm_86 has no e4m3 MMA")])
def test_a_path_the_arch_lacks_is_refused_naming_the_instruction(arch, precision, lacks):
    with pytest.raises(ValueError, match=re.escape(f"precision '{precision}' is not available on ") + ".*"
                       + re.escape(f": {lacks} (mma.sync")):
        resolve_precision(precision, arch)
    assert resolve_precision(None, arch) == "f16" and resolve_precision("bf16", arch) == "bf16"
