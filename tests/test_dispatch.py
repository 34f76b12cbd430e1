"""Dispatch: variant keys, the split plan, and every refusal of the public API (CPU)."""

import dataclasses
import itertools
import math
import re

import pytest
import torch

from cute_kernels.sparse_mla_decode.config import MergeConfig, PartialConfig
from dispatch import InvalidDecodeInput, sparse_mla_decode
from dispatch.metadata import MODEL_TYPE, DecodeMetadata
from dispatch.registry import H200_SMEM_PER_SM, SM120_SMEM_PER_SM
from dispatch.splits import MAX_SPLITS, plan_splits, resident_ctas_per_sm, two_ctas_per_sm
from dispatch.variants import (
    head_groups_for, partial_shape_config, precisions_for, resolve_precision, variant_space, variants_for,
)
from dispatch.testing import make_cache, make_indices


def test_variant_keys_follow_the_metadata():
    for a, b, s in itertools.product((False, True), repeat=3):
        md = DecodeMetadata(num_tokens=3, num_heads=8, d_qk=512, topk=192, page_block_size=64, extra_topk=512,
                            has_topk_length=a, has_extra_topk_length=b, has_sink=s)
        partial, merge = variants_for(md, "sm_120a", num_splits=3, head_groups=1)
        assert partial.config == PartialConfig(has_topk_length=a, has_extra_topk_length=b)  # 8 heads: one group
        assert merge.config == MergeConfig(has_sink=s, split_batch=8)  # 3 splits: one batch of 8
        (final,) = variants_for(md, "sm_120a", num_splits=1, head_groups=1)  # one split: no merge, sink in the epilogue
        assert final.config == PartialConfig(has_topk_length=a, has_extra_topk_length=b, final_output=True,
                                             has_sink=s)
        space = variant_space("sm_120a")
        assert partial in space and merge in space and final in space


def test_shapes_do_not_reach_the_key():
    """num_tokens, topk, extra_topk and page sizes are runtime values; num_heads and num_tokens
    reach the key only through the number of 16-head groups per CTA (``head_groups_for``)."""
    for precision in ("bf16", "f16"):
        keys = {}
        for T, H, topk, extra, page in itertools.product((1, 65), (1, 8, 16, 17, 64, 128), (1, 100, 1152),
                                                        (0, 8192), (2, 64, 256)):
            md = DecodeMetadata(num_tokens=T, num_heads=H, d_qk=512, topk=topk, page_block_size=page,
                                extra_topk=extra)
            groups = head_groups_for(H, T, num_sms=188, topk=topk, extra_topk=extra, smem_per_sm=SM120_SMEM_PER_SM,
                                     precision=precision)
            keys.setdefault(groups, set()).add((variants_for(md, "sm_120a", 1, groups, precision),
                                                variants_for(md, "sm_120a", 4, groups, precision)))
        assert all(len(k) == 1 for k in keys.values())
        assert set(keys) == {1, 2}


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


@pytest.mark.parametrize("T,H,topk,extra", [(1, 128, 1024, 0), (8, 16, 512, 0), (64, 16, 128, 0), (8, 128, 1024, 0),
                                            (64, 128, 512, 0), (8, 64, 128, 512), (256, 8, 128, 0),
                                            (256, 64, 128, 0)])
def test_register_bound_only_where_two_ctas_share_an_sm(T, H, topk, extra):
    """The "f16" kernel (16- or 32-head CTAs) is held to 128 registers exactly where its grid
    has more CTAs than the H200 has SMs (two then share one); never on sm_120 (one CTA per SM)."""
    md = DecodeMetadata(num_tokens=T, num_heads=H, d_qk=512, topk=topk, page_block_size=64, extra_topk=extra)
    for sms, smem, arch in ((132, H200_SMEM_PER_SM, "sm_90a"), (188, SM120_SMEM_PER_SM, "sm_120a")):
        cfg = partial_shape_config(H, T, sms, topk=topk, extra_topk=extra, smem_per_sm=smem)
        plan = plan_splits(T, H, topk, extra, cfg=cfg, num_sms=sms, smem_per_sm=smem)
        two = two_ctas_per_sm(cfg, plan, T, H, sms, smem)
        ctas = T * math.ceil(H / cfg.heads_per_cta) * plan.num_splits
        assert two == (arch == "sm_90a" and ctas > sms), (arch, cfg, plan)
        partial = variants_for(md, arch, plan.num_splits, cfg.head_groups, two_ctas_per_sm=two)[0]
        assert partial.config.max_registers == (128 if two else 255)
        assert partial in variant_space(arch)


# ---------------------------------------------------------------------- refusals
def _inputs(T=2, H=16, topk=128, device="cpu"):
    cache = make_cache(4, 64, device=device)
    return dict(q=torch.randn(T, H, 512).to(torch.bfloat16), kv_cache=cache,
                indices=make_indices(T, topk, 256, device=device))


def _call(overrides, **kwargs):
    base = _inputs()
    base.update(overrides)
    return sparse_mla_decode(base.pop("q"), base.pop("kv_cache"), base.pop("indices"), **base, **kwargs)


# q [B=2, S=2, H, 512]: 4 tokens whose lengths may come as [2, 2]
_BATCHED = dict(q=torch.randn(2, 2, 16, 512).to(torch.bfloat16), indices=make_indices(4, 128, 256, device="cpu"))
# [2, 2] int32 rows 4 apart: no [4] view of it exists (reshape would copy, and the kernels read the original)
_STRIDED_ROWS = torch.zeros(2, 4, dtype=torch.int32)[:, :2]


BAD = [
    ("q float32", dict(q=torch.randn(2, 16, 512)), {}, "q must be bfloat16"),
    ("q width 576", dict(q=torch.randn(2, 16, 576).to(torch.bfloat16)), {}, "expected d_qk = 512"),
    ("q 2-D", dict(q=torch.randn(16, 512).to(torch.bfloat16)), {}, "expected [num_tokens, num_heads, 512]"),
    ("q last dim strided", dict(q=torch.randn(2, 16, 1024).to(torch.bfloat16)[..., ::2]), {},
     "contiguous in its last dimension"),
    ("q heads misaligned", dict(q=torch.randn(2, 16, 515).to(torch.bfloat16)[..., :512]), {}, "multiples of 8"),
    ("indices int64", dict(indices=torch.zeros(2, 128, dtype=torch.int64)), {}, "indices must be int32"),
    ("indices tokens", dict(indices=torch.zeros(3, 128, dtype=torch.int32)), {}, "indices has shape [3, 128]"),
    ("indices empty", dict(indices=torch.zeros(2, 0, dtype=torch.int32)), {}, "topk must be at least 1"),
    ("indices strided", dict(indices=torch.zeros(2, 256, dtype=torch.int32)[:, ::2]), {},
     "indices must be contiguous in its last dimension"),
    ("cache float16", dict(kv_cache=torch.zeros(4, 64, 1, 584, dtype=torch.float16)), {}, "uint8 or float8_e4m3fn"),
    ("cache width", dict(kv_cache=torch.zeros(4, 64, 1, 576, dtype=torch.uint8)), {}, "[num_blocks, P, 1, 584]"),
    ("cache stride", dict(kv_cache=torch.as_strided(torch.zeros(4 * 37384, dtype=torch.uint8), (4, 64, 1, 584),
                                                    (37384, 584, 584, 1))), {}, "not a multiple of 16"),
    ("cache bytes strided", dict(kv_cache=torch.zeros(4, 64, 1, 1168, dtype=torch.uint8)[..., ::2]), {},
     "must be contiguous"),
    ("cache blocks overlap", dict(kv_cache=torch.as_strided(torch.zeros(4 * 37376, dtype=torch.uint8),
                                                            (4, 64, 1, 584), (37360, 584, 584, 1))), {},
     "smaller than a block"),
    ("cache on meta", dict(kv_cache=torch.zeros(4, 64, 1, 584, dtype=torch.uint8, device="meta")), {},
     "kv_cache is on meta, expected cpu"),
    ("extra cache alone", {}, dict(extra_kv_cache=make_cache(2, 64, device="cpu")), "pass both or neither"),
    ("extra indices alone", {}, dict(extra_indices=torch.zeros(2, 64, dtype=torch.int32)), "pass both or neither"),
    ("extra length alone", {}, dict(extra_topk_length=torch.zeros(2, dtype=torch.int32)), "without extra_kv_cache"),
    ("extra indices int64", {}, dict(extra_kv_cache=make_cache(2, 64, device="cpu"),
                                     extra_indices=torch.zeros(2, 64, dtype=torch.int64)), "extra_indices must be int32"),
    ("extra cache bad", {}, dict(extra_kv_cache=torch.zeros(2, 100, dtype=torch.uint8),
                                 extra_indices=torch.zeros(2, 64, dtype=torch.int32)), "extra_kv_cache of shape"),
    ("length int64", {}, dict(topk_length=torch.zeros(2, dtype=torch.int64)), "topk_length must be int32"),
    ("length shape", {}, dict(topk_length=torch.zeros(2, 1, dtype=torch.int32)), "topk_length has shape [2, 1]"),
    ("length rows strided", _BATCHED, dict(topk_length=_STRIDED_ROWS), "topk_length must be contiguous"),
    ("extra length shape", {}, dict(extra_kv_cache=make_cache(2, 64, device="cpu"),
                                    extra_indices=torch.zeros(2, 64, dtype=torch.int32),
                                    extra_topk_length=torch.zeros(3, dtype=torch.int32)), "extra_topk_length has shape"),
    ("extra length rows strided", _BATCHED, dict(extra_kv_cache=make_cache(2, 64, device="cpu"),
                                                 extra_indices=torch.zeros(4, 64, dtype=torch.int32),
                                                 extra_topk_length=_STRIDED_ROWS),
     "extra_topk_length must be contiguous"),
    ("sink shape", {}, dict(attn_sink=torch.zeros(8)), "attn_sink has shape [8], expected [16]"),
    ("sink dtype", {}, dict(attn_sink=torch.zeros(16, dtype=torch.bfloat16)), "attn_sink must be float32"),
    ("sm_scale nan", {}, dict(sm_scale=math.nan), "sm_scale must be a finite"),
    ("sm_scale inf", {}, dict(sm_scale=math.inf), "sm_scale must be a finite"),
    ("sm_scale tensor", {}, dict(sm_scale=torch.tensor(0.1)), "sm_scale must be a finite"),
    ("out dtype", {}, dict(out=torch.empty(2, 16, 512)), "out must be bfloat16"),
    ("out shape", {}, dict(out=torch.empty(2, 16, 448, dtype=torch.bfloat16)), "out has shape [2, 16, 448]"),
    ("lse dtype", {}, dict(lse=torch.empty(2, 16, dtype=torch.bfloat16)), "lse must be float32"),
    ("lse shape", {}, dict(lse=torch.empty(16, 2)), "lse has shape [16, 2], expected [2, 16]"),
    ("lse convention", {}, dict(lse_convention="log10"), "lse_convention must be one of ('natural', 'log2_with_sink')"),
    ("precision unknown", {}, dict(precision="fp16"), "precision must be one of ('bf16', 'f16', 'fp8', 'mxf8')"),
    ("valid but on cpu", {}, {}, "the kernels run on CUDA devices only"),
]


@pytest.mark.parametrize("name,overrides,kwargs,message", BAD, ids=[b[0] for b in BAD])
def test_invalid_input_is_refused_with_the_call_shape(name, overrides, kwargs, message):
    with pytest.raises(InvalidDecodeInput) as info:
        _call(overrides, **kwargs)
    text = str(info.value)
    assert message in text
    assert text.startswith(MODEL_TYPE)
    for field in ("num_tokens=", "num_heads=", "topk=", "d_qk=", "page_block_size=", "extra_topk="):
        assert field in text
    assert isinstance(info.value, ValueError)


def test_message_names_the_actual_shape():
    with pytest.raises(InvalidDecodeInput) as info:
        _call(dict(q=torch.randn(3, 24, 512), indices=make_indices(3, 192, 256, device="cpu")))
    assert ("num_tokens=3, num_heads=24, topk=192, d_qk=512, page_block_size=64, extra_topk=0"
            in str(info.value))


def test_docs_table_lists_every_refusal():
    """The table of refused inputs in docs/api.md and this file's cases are the same list."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| `") and ln.count("|") == 4]
    table = {ln.split("|")[2].strip(): ln.split("|")[3].strip().strip("`") for ln in rows}
    assert table == {name: message for name, _, _, message in BAD}


def test_every_supported_arch_has_its_shared_memory_per_sm():
    from cute_kernels.arch import SMEM_PER_SM_BY_ARCH, SUPPORTED_ARCHS

    assert set(SMEM_PER_SM_BY_ARCH) == set(SUPPORTED_ARCHS)
    for arch in SUPPORTED_ARCHS:  # the 128-register variants only where an SM holds two CTAs
        held = any(v.kind == "partial" and v.config.two_ctas_per_sm for v in variant_space(arch))
        assert held == (arch == "sm_90a")


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
    with pytest.raises(ValueError, match="for the \"f16\" kernel"):
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
        counts = {p: sum(1 for v in variant_space(arch) if v.kind == "partial" and v.config.precision == p)
                  for p in precisions_for(arch)}
        # every precision serves every call shape (2 groups x 12), and on the H200 the "f16"
        # kernels of both groups also held to two CTAs per SM (24 more)
        assert counts == {p: 24 + (24 if p == "f16" and arch == "sm_90a" else 0) for p in precisions_for(arch)}


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


def test_split_plan_refuses_an_empty_grid():
    cfg = partial_shape_config(16, 1, 188, topk=128, smem_per_sm=SM120_SMEM_PER_SM)
    with pytest.raises(ValueError, match="at least one token and one head"):
        plan_splits(0, 16, 128, 0, cfg=cfg, num_sms=188, smem_per_sm=SM120_SMEM_PER_SM)


def test_a_plan_of_no_token_is_refused():
    from dispatch import plan_sparse_mla_decode

    base = _inputs(T=0)
    with pytest.raises(InvalidDecodeInput, match="a plan needs at least one token; sparse_mla_decode returns at once"):
        plan_sparse_mla_decode(base["q"], base["kv_cache"], base["indices"])


@pytest.mark.parametrize("adapter", ["flash_mla", "trtllm", "trtllm_no_lse"])
def test_adapters_refuse_an_unknown_lse_convention_first(adapter):
    """Before any device work (the CPU inputs would be refused next) and whether or not an lse
    is returned."""
    from dispatch import adapters

    base = _inputs()
    with pytest.raises(InvalidDecodeInput, match="lse_convention must be one of") as info:
        if adapter == "flash_mla":
            adapters.flash_mla_with_kvcache(base["q"][None], base["kv_cache"], indices=base["indices"][None],
                                            is_fp8_kvcache=True, lse_convention="log10")
        else:
            adapters.trtllm_batch_decode_sparse_mla_dsv4(base["q"], base["kv_cache"], None, base["indices"],
                                                         return_lse=adapter == "trtllm", lse_convention="log10")
    assert info.value.metadata.num_heads == 16


# ---------------------------------------------------------------------- plans on CPU tensors
def _cpu_plan(monkeypatch, precision="f16", **kwargs):
    """A plan built on CPU tensors for sm_120a (``validate_call``'s ``_target``), with its
    kernels stubbed: its checks run, nothing is compiled or launched."""
    from dispatch import loader
    from dispatch.api import validate_call
    from dispatch.plan import DecodePlan

    monkeypatch.setattr(loader, "get_compiled", lambda variant: None)
    monkeypatch.setattr(DecodePlan, "_make_kernels", lambda self, values: [])
    base = _inputs()
    base.update(kwargs)
    call = validate_call(base.pop("q"), base.pop("kv_cache"), base.pop("indices"), precision=precision,
                         _target=("sm_120a", 188, SM120_SMEM_PER_SM), **base)
    return DecodePlan(call), call


def _misaligned(t: torch.Tensor, offset_bytes: int) -> torch.Tensor:
    """A view of ``t``'s shape and strides whose address is ``offset_bytes`` past an aligned one."""
    step = offset_bytes // t.element_size()
    buf = torch.zeros(t.numel() + 512 // t.element_size(), dtype=t.dtype)
    start = (-buf.data_ptr() % 256) // t.element_size() + step
    return torch.as_strided(buf, t.shape, t.stride(), start)


def test_plan_run_refuses_a_misaligned_tensor(monkeypatch):
    plan, call = _cpu_plan(monkeypatch)
    kw = dict(out=call.out, lse=call.lse, scratch=torch.empty(plan.scratch_bytes, dtype=torch.uint8))
    plan._checked_values("run", (call.q, call.kv_cache, call.indices, None, None, call.out, call.lse, None, None,
                                 None), None, kw["scratch"])  # the planned tensors pass
    for name, offset, align in (("q", 8, 16), ("out", 4, 8)):
        tensors = dict(q=call.q, out=call.out)
        tensors[name] = _misaligned(tensors[name], offset)
        assert tensors[name].stride() == getattr(call, name).stride()
        for caller in ("run", "bind"):
            with pytest.raises(ValueError, match=rf"DecodePlan.{caller}: {name} starts at address 0x[0-9a-f]+, "
                                                 rf"not {align}-byte aligned"):
                getattr(plan, caller)(tensors["q"], call.kv_cache, call.indices, out=tensors["out"], lse=call.lse,
                                      scratch=kw["scratch"])


def test_plan_alignment_comes_from_the_kernel_argument_schema(monkeypatch):
    from cute_kernels.sparse_mla_decode.kernel_args import PARTIAL_ARGS
    from dispatch.plan import _RUN_TENSORS

    plan, _ = _cpu_plan(monkeypatch, topk_length=torch.zeros(2, dtype=torch.int32))
    schema = {a.name: a.align for a in PARTIAL_ARGS}
    aligns = dict(zip((name for name, _ in _RUN_TENSORS), plan._aligns))
    assert aligns["q"] == schema["q"] == 16 and aligns["kv_cache"] == schema["main_cache"] == 16
    assert aligns["out"] == schema["out"] == 8 and aligns["topk_length"] == schema["main_len"] == 4


def test_plan_run_refuses_lengths_that_are_not_one_int_per_token_in_order(monkeypatch):
    plan, call = _cpu_plan(monkeypatch, topk_length=torch.zeros(2, 2, dtype=torch.int32), **_BATCHED)
    scratch = torch.empty(plan.scratch_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"DecodePlan.run: topk_length has shape \[2, 2\], strides \[4, 1\]"):
        plan.run(call.q, call.kv_cache, call.indices, out=call.out, lse=call.lse, scratch=scratch,
                 topk_length=_STRIDED_ROWS)


def test_run_and_bind_take_the_planned_tensors_by_name():
    import inspect

    from dispatch.plan import _RUN_TENSORS, DecodePlan

    for method in (DecodePlan.run, DecodePlan.bind):
        params = inspect.signature(method).parameters
        assert all(name in params for name, _ in _RUN_TENSORS), method


def test_kernel_params_take_the_schema_and_at_most_the_stream():
    from cute_kernels.sparse_mla_decode.kernel_args import MERGE_ARGS, KernelParams

    n = len(MERGE_ARGS)  # the stream last
    p = KernelParams(MERGE_ARGS, list(range(n)))  # a launcher's arguments, the stream's dropped
    assert p.num_heads == 4 and not hasattr(p, "stream")
    assert KernelParams(MERGE_ARGS, list(range(n - 1))).lse_stride_h == n - 2  # without the stream
    for count in (n + 1, n - 2):
        with pytest.raises(ValueError, match=f"{n - 1} kernel arguments expected"):
            KernelParams(MERGE_ARGS, list(range(count)))


def test_the_bf16_dequantize_width_cannot_be_tuned_away_from_its_loads(monkeypatch):
    from cute_kernels.sparse_mla_decode import tuning

    PartialConfig(precision="bf16").check()
    monkeypatch.setattr(tuning, "DEQUANT_VALUES", 8)
    with pytest.raises(ValueError, match="DEQUANT_VALUES is 8"):
        PartialConfig(precision="bf16").check()
    PartialConfig(precision="f16").check()  # the other paths do not use it
