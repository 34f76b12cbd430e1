"""Dispatch: variant keys, the split plan, the cache formats, the adapters, and every refusal
of the public API (CPU)."""

import dataclasses
import hashlib
import itertools
import math
import re
import threading
import types

import pytest
import torch

from cute_kernels.arch import SMEM_PER_SM_BY_ARCH
from cute_kernels.sparse_mla_decode.cache_format import e2m1_decode, page_division_magic, read_cache_view
from cute_kernels.sparse_mla_decode.config import MergeConfig, PartialConfig, merge_batch_for
from cute_kernels.sparse_mla_decode.kernel_args import LOG2_E, MERGE_ARGS, PARTIAL_ARGS
from cute_kernels.sparse_mla_decode.kv_format import (
    EXTRA_FORMATS, EXTRA_ONLY_FORMATS, FORMATS, GLM_NOPE_FP8, MODEL1_FP8, MODEL1_NVFP4, V32_FP8, V41_FP8,
    V41_NVFP4, get_format,
)
from dispatch import InvalidDecodeInput, kv_formats, sparse_mla_decode
from dispatch.adapters import (
    DSV4_KV_CACHE_FORMATS, flash_mla_with_kvcache, flash_mla_with_kvcache_sm120, trtllm_batch_decode_sparse_mla_dsv4,
    trtllm_batch_decode_with_kv_cache_mla,
)
from dispatch.api import ValidatedCall
from dispatch.lse import convert_lse
from dispatch.metadata import GENERIC_MODEL_TYPE, DecodeMetadata
from dispatch.plan import RUN_TENSORS, DecodePlan
from dispatch.plan_cache import PlanCache, layout_key
from dispatch.registry import (
    DEPLOYMENT_NUM_TOKENS, DEPLOYMENT_SHAPES, DEPLOYMENT_SM_COUNTS, H200_SMEM_PER_SM, SM120_SMEM_PER_SM,
    deployment_calls, registry_calls, registry_variants,
)
from dispatch.selection import PlanOverrides, select_kernels
from dispatch.splits import MAX_SPLITS, SplitPlan, plan_splits, resident_ctas_per_sm, two_ctas_per_sm
from dispatch.variants import (
    KernelVariant, format_precisions, head_groups_for, partial_shape_config, precisions_for, resolve_precision,
    variant_space, variants_for,
)
from dispatch.testing import make_cache, make_indices

MODEL1 = MODEL1_FP8.name


def _md(kv_format=MODEL1, **kw):
    return DecodeMetadata(kv_format=kv_format, d_qk=FORMATS[kv_format].d_qk, **kw)


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
        assert (final in space) == (kv_format not in EXTRA_ONLY_FORMATS), final.name


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
    md = _md(num_tokens=T, num_heads=H, topk=topk, page_block_size=64, extra_topk=extra)
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
    """The call of ``_inputs`` with ``overrides``, and ``kwargs``; a callable keyword value is
    called with the inputs (an output made of an input's memory)."""
    base = _inputs()
    base.update(overrides)
    kwargs = {k: v(base) if callable(v) else v for k, v in kwargs.items()}
    return sparse_mla_decode(base.pop("q"), base.pop("kv_cache"), base.pop("indices"), **base, **kwargs)


# memory two arguments share: attn_sink and lse, out and lse
_SINK_LSE = torch.zeros(32)
_OUT_LSE = torch.zeros(2, 16, 512, dtype=torch.bfloat16)


_GEN = torch.Generator().manual_seed(0)
V32_CACHE = make_cache(4, 64, device="cpu", kv_format=V32_FP8.name, gen=_GEN)  # [4, 64, 1, 656]
GLM_CACHE = make_cache(4, 64, device="cpu", kv_format=GLM_NOPE_FP8.name, gen=_GEN)  # [4, 64, 1, 528]
GLM_POOL_CACHE = make_cache(4, 64, device="cpu", kv_format=GLM_NOPE_FP8.name, row_stride=656, gen=_GEN)  # 656 wide
Q576 = torch.randn(2, 16, 576).to(torch.bfloat16)
V32 = dict(q=Q576, kv_cache=V32_CACHE)
NVFP4_CACHE = make_cache(4, 64, device="cpu", kv_format="model1_nvfp4", gen=_GEN)  # [4, 64, 1, 384]
NVFP4 = dict(kv_cache=NVFP4_CACHE)
V41_CACHE = make_cache(4, 64, device="cpu", kv_format=V41_FP8.name, gen=_GEN)  # [4, 64, 1, 528]
V41_NVFP4_CACHE = make_cache(2, 64, device="cpu", kv_format=V41_NVFP4.name, gen=_GEN)  # [2, 64, 1, 288]
V41 = dict(kv_cache=V41_CACHE)
_EXTRA_IDX = torch.zeros(2, 64, dtype=torch.int32)
# the refusals whose message starts with another model type than MODEL1's
PREFIX = {
    "q width 512 on V3.2": V32_FP8.model_type, "q width 576 on GLM-5.3": GLM_NOPE_FP8.model_type,
    "out width on V3.2": V32_FP8.model_type, "cache not of the named format": V32_FP8.model_type,
    "cache width": GENERIC_MODEL_TYPE, "cache width 528 without kv_format": GENERIC_MODEL_TYPE,
    "kv_format unknown": GENERIC_MODEL_TYPE, "extra cache with V3.2": V32_FP8.model_type,
    "precision bf16 on NVFP4": MODEL1_NVFP4.model_type, "V4.1 NVFP4 main cache": V41_NVFP4.model_type,
    "V4.1 NVFP4 main cache unnamed": GENERIC_MODEL_TYPE, "GLM-5.3 extra cache with a V4.1 main": V41_FP8.model_type,
    "inline NVFP4 extra cache with a footer V4.1 main": V41_FP8.model_type,
    "precision bf16 with an NVFP4 extra cache": V41_FP8.model_type,
    "precision mxf8 on V3.2": V32_FP8.model_type, "valid V3.2 call on cpu": V32_FP8.model_type,
    "valid GLM-5.3 call on cpu": GLM_NOPE_FP8.model_type,
}

# q [B=2, S=2, H, 512]: 4 tokens whose lengths may come as [2, 2]
_BATCHED = dict(q=torch.randn(2, 2, 16, 512).to(torch.bfloat16), indices=make_indices(4, 128, 256, device="cpu"))
# [2, 2] int32 rows 4 apart: no [4] view of it exists (reshape would copy, and the kernels read the original)
_STRIDED_ROWS = torch.zeros(2, 4, dtype=torch.int32)[:, :2]


BAD = [
    ("q float32", dict(q=torch.randn(2, 16, 512)), {}, "q must be bfloat16"),
    ("q width 576", dict(q=torch.randn(2, 16, 576).to(torch.bfloat16)), {}, "expected d_qk = 512"),
    ("q width 512 on V3.2", dict(kv_cache=V32_CACHE), {},
     "q has QK width 512, expected d_qk = 576 (512 nope + 64 rope dims)"),
    ("q width 576 on GLM-5.3", dict(q=Q576, kv_cache=GLM_CACHE), dict(kv_format="glm_nope_fp8"),
     "q has QK width 576, expected d_qk = 512 (512 nope dims, no rope)"),
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
    ("cache width", dict(kv_cache=torch.zeros(4, 64, 1, 600, dtype=torch.uint8)), {},
     "no cache format has 600-byte rows"),
    ("cache width 528 without kv_format", dict(kv_cache=GLM_CACHE), {},
     "a cache whose rows are 528 bytes wide is ambiguous: pass kv_format= (one of ['glm_nope_fp8', 'v41_fp8', "
     "'v41_fp8_inline'])"),
    ("cache not of the named format", {}, dict(kv_format="v32_fp8"), "expected [num_blocks, P, 1, 656]"),
    ("kv_format unknown", {}, dict(kv_format="fp4"),
     "kv_format must be one of ['glm_nope_fp8', 'model1_fp8', 'model1_nvfp4', 'v32_fp8', 'v41_fp8', 'v41_fp8_inline', "
     "'v41_nvfp4', 'v41_nvfp4_inline'], got 'fp4'"),
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
    ("extra cache bad", {}, dict(extra_kv_cache=torch.zeros(2, 100, dtype=torch.uint8), extra_indices=_EXTRA_IDX),
     "extra_kv_cache: an extra cache of 100 bytes per block fits none of the formats a model1_fp8 main cache "
     "combines with (['model1_fp8', 'model1_nvfp4'])"),
    ("extra cache of another format", {}, dict(extra_kv_cache=V32_CACHE, extra_indices=_EXTRA_IDX),
     "extra_kv_cache reads as v32_fp8: a model1_fp8 main cache combines only with an extra cache of "
     "['model1_fp8', 'model1_nvfp4'] (extra_kv_format= names it)"),
    ("extra cache with V3.2", V32, dict(extra_kv_cache=V32_CACHE, extra_indices=_EXTRA_IDX),
     "an extra_kv_cache is not served with v32_fp8 caches"),
    # the models' pairings only (EXTRA_FORMATS): DeepSeek-V4's two records either way,
    # DeepSeek-V4.1's FP8 main cache with an FP8 or NVFP4 extra cache of its own records
    ("V4.1 NVFP4 extra cache with a MODEL1 main", {},
     dict(extra_kv_cache=V41_NVFP4_CACHE, extra_indices=_EXTRA_IDX, extra_kv_format="v41_nvfp4"),
     "extra_kv_cache reads as v41_nvfp4: a model1_fp8 main cache combines only with an extra cache of "
     "['model1_fp8', 'model1_nvfp4'] (extra_kv_format= names it)"),
    ("288 B extra cache with a MODEL1 main", {}, dict(extra_kv_cache=V41_NVFP4_CACHE, extra_indices=_EXTRA_IDX),
     "extra_kv_cache: an extra cache of 288-byte rows fits none of the formats a model1_fp8 main cache combines "
     "with (['model1_fp8', 'model1_nvfp4'])"),
    ("GLM-5.3 extra cache with a V4.1 main", V41,
     dict(kv_format="v41_fp8", extra_kv_cache=GLM_CACHE, extra_indices=_EXTRA_IDX, extra_kv_format="glm_nope_fp8"),
     "extra_kv_cache reads as glm_nope_fp8: a v41_fp8 main cache combines only with an extra cache of "
     "['v41_fp8', 'v41_nvfp4'] (extra_kv_format= names it)"),
    # the V4.1 pairs keep one scale placement: footer with footer, inline with inline
    ("inline NVFP4 extra cache with a footer V4.1 main", V41,
     dict(kv_format="v41_fp8", extra_kv_cache=V41_NVFP4_CACHE, extra_indices=_EXTRA_IDX,
          extra_kv_format="v41_nvfp4_inline"),
     "extra_kv_cache reads as v41_nvfp4_inline: a v41_fp8 main cache combines only with an extra cache of "
     "['v41_fp8', 'v41_nvfp4'] (extra_kv_format= names it)"),
    ("V4.1 NVFP4 main cache", dict(kv_cache=V41_NVFP4_CACHE), dict(kv_format="v41_nvfp4"),
     "v41_nvfp4 is read only as an extra (compressed) cache: pass it as extra_kv_cache beside a main cache of "
     "['v41_fp8']"),
    ("V4.1 NVFP4 main cache unnamed", dict(kv_cache=V41_NVFP4_CACHE), {},
     "288-byte rows are those of ['v41_nvfp4', 'v41_nvfp4_inline'], read only as an extra (compressed) cache: pass "
     "it as extra_kv_cache beside a main cache of ['v41_fp8', 'v41_fp8_inline']"),
    ("extra_kv_format unknown", {}, dict(extra_kv_cache=make_cache(2, 64, device="cpu"), extra_indices=_EXTRA_IDX,
                                         extra_kv_format="fp4"),
     "extra_kv_cache: extra_kv_format must be one of ['glm_nope_fp8', 'model1_fp8', 'model1_nvfp4', 'v32_fp8', "
     "'v41_fp8', 'v41_fp8_inline', 'v41_nvfp4', 'v41_nvfp4_inline'], got 'fp4'"),
    ("extra_kv_format alone", {}, dict(extra_kv_format="model1_nvfp4"),
     "extra_kv_format was given without extra_kv_cache"),
    ("precision bf16 on NVFP4", NVFP4, dict(precision="bf16"), "precision 'bf16' does not read model1_nvfp4 caches"),
    ("precision bf16 with an NVFP4 extra cache", V41,
     dict(kv_format="v41_fp8", extra_kv_cache=V41_NVFP4_CACHE, extra_indices=_EXTRA_IDX, extra_kv_format="v41_nvfp4",
          precision="bf16"),
     "precision 'bf16' does not read v41_nvfp4 caches (e2m1 values): use one of ('f16',)"),
    ("length int64", {}, dict(topk_length=torch.zeros(2, dtype=torch.int64)), "topk_length must be int32"),
    ("length shape", {}, dict(topk_length=torch.zeros(2, 2, dtype=torch.int32)), "topk_length has shape [2, 2]"),
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
    ("sm_scale nan", {}, dict(sm_scale=math.nan), "sm_scale must be a real Python number"),
    ("sm_scale inf", {}, dict(sm_scale=math.inf), "sm_scale must be a real Python number"),
    ("sm_scale tensor", {}, dict(sm_scale=torch.tensor(0.1)), "sm_scale must be a real Python number"),
    ("sm_scale inf as float32", {}, dict(sm_scale=1e300),
     "sm_scale must be a real Python number whose product with log2(e) is 0 or a normal float32"),
    ("sm_scale subnormal as float32", {}, dict(sm_scale=1e-50),
     "sm_scale must be a real Python number whose product with log2(e) is 0 or a normal float32"),
    ("out is q", {}, dict(out=lambda b: b["q"]), "out overlaps q in memory"),
    ("out over the cache bytes", {},
     dict(out=lambda b: b["kv_cache"][0].view(-1)[:2 * 16 * 512 * 2].view(torch.bfloat16).view(2, 16, 512)),
     "out overlaps kv_cache in memory"),
    ("lse over attn_sink", {}, dict(attn_sink=_SINK_LSE[:16], lse=_SINK_LSE.view(2, 16)),
     "lse overlaps attn_sink in memory"),
    ("out and lse overlap", {}, dict(out=_OUT_LSE, lse=_OUT_LSE.view(-1).view(torch.float32)[:32].view(2, 16)),
     "out overlaps lse in memory"),
    ("out stride 0", {}, dict(out=torch.empty(1, 16, 512, dtype=torch.bfloat16).expand(2, 16, 512)),
     "out has a stride of 0"),
    ("lse stride 0", {}, dict(lse=torch.empty(2, 1).expand(2, 16)), "lse has a stride of 0"),
    ("out dtype", {}, dict(out=torch.empty(2, 16, 512)), "out must be bfloat16"),
    ("out shape", {}, dict(out=torch.empty(2, 16, 448, dtype=torch.bfloat16)), "out has shape [2, 16, 448]"),
    ("out width on V3.2", V32, dict(out=torch.empty(2, 16, 576, dtype=torch.bfloat16)),
     "out has shape [2, 16, 576], expected [2, 16, 512]"),
    ("lse dtype", {}, dict(lse=torch.empty(2, 16, dtype=torch.bfloat16)), "lse must be float32"),
    ("lse shape", {}, dict(lse=torch.empty(16, 2)), "lse has shape [16, 2], expected [2, 16]"),
    ("lse convention", {}, dict(lse_convention="log10"),
     "lse_convention must be one of ('natural', 'log2_with_sink', 'natural_with_sink')"),
    ("precision unknown", {}, dict(precision="fp16"), "precision must be one of ('bf16', 'f16', 'fp8', 'mxf8')"),
    ("precision mxf8 on V3.2", V32, dict(precision="mxf8"),
     "precision 'mxf8' does not read v32_fp8 caches (fp32 scales): use one of ('bf16', 'f16', 'fp8')"),
    ("valid but on cpu", {}, {}, "the kernels run on CUDA devices only"),
    ("valid V3.2 call on cpu", V32, {}, "the kernels run on CUDA devices only"),
    ("valid GLM-5.3 call on cpu", dict(kv_cache=GLM_POOL_CACHE), dict(kv_format="glm_nope_fp8"),
     "the kernels run on CUDA devices only"),
]


@pytest.mark.parametrize("name,overrides,kwargs,message", BAD, ids=[b[0] for b in BAD])
def test_invalid_input_is_refused_with_the_call_shape(name, overrides, kwargs, message):
    with pytest.raises(InvalidDecodeInput) as info:
        _call(overrides, **kwargs)
    text = str(info.value)
    assert message in text
    assert text.startswith(PREFIX.get(name, MODEL1_FP8.model_type) + ": num_tokens=")
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
    text = text[text.index("### Inputs the API refuses"):]
    text = text[:text.index("\n#", 1)]  # that section alone
    rows = [ln for ln in text.splitlines() if ln.startswith("| `") and ln.count("|") == 4]
    table = {ln.split("|")[2].strip(): ln.split("|")[3].strip().strip("`") for ln in rows}
    assert table == {name: message for name, _, _, message in BAD}


def test_every_supported_arch_has_its_shared_memory_per_sm():
    from cute_kernels.arch import SMEM_PER_SM_BY_ARCH, SUPPORTED_ARCHS

    assert set(SMEM_PER_SM_BY_ARCH) == set(SUPPORTED_ARCHS)
    for arch in SUPPORTED_ARCHS:  # the 128-register variants only where an SM holds two CTAs
        held = {v.config.kv_format for v in variant_space(arch) if v.kind == "partial" and v.config.two_ctas_per_sm}
        # only the 256-thread "f16" kernels, MODEL1 FP8's and NVFP4's
        assert held == ({MODEL1, MODEL1_NVFP4.name} if arch == "sm_90a" else set())


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
        want.update({(f, "f16"): 4 for f in EXTRA_ONLY_FORMATS})
        assert counts == want, arch


def test_precision_a_format_lacks_is_refused_naming_it():
    """"mxf8" reads UE8M0 scale bytes: MODEL1's; the FP32-scale formats are refused on every
    arch, with the format named (the arch check comes second)."""
    for arch in ("sm_90a", "sm_120a", "sm_121a"):
        for kv_format in (V32_FP8.name, GLM_NOPE_FP8.name):
            assert resolve_precision(None, arch, kv_format) == "f16"
            assert resolve_precision("fp8", arch, kv_format) == "fp8"
            with pytest.raises(ValueError, match=f"'mxf8' does not read {kv_format} caches"):
                resolve_precision("mxf8", arch, kv_format)
    assert resolve_precision("mxf8", "sm_120a", MODEL1) == "mxf8"


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


# ---------------------------------------------------------------------- formats in the dispatch
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
            assert cfg.precision != "mxf8" or cfg.kv_format == MODEL1
            assert not cfg.has_extra_topk_length or cfg.kv_format in EXTRA_FORMATS
            assert not cfg.two_ctas_per_sm or (cfg.precision == "f16" and cfg.num_threads == 256)
        inline_f16 = [v.config for v in partials if get_format(v.config.kv_format).inline and v.config.precision == "f16"]
        assert inline_f16 and all(cfg.num_threads == 288 and not cfg.two_ctas_per_sm for cfg in inline_f16)


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


def _model1_decisions(arch: str) -> tuple:
    """(calls, digest of every MODEL1 registry call's decisions, variants, digest of their names
    without the format): what the dispatch chose for MODEL1 when it was the only format. The
    calls are those of MODEL1 caches alone (main and any extra cache MODEL1): a call whose
    extra cache is NVFP4 runs a kernel per list (``test_a_mixed_call_*``)."""
    h, n = hashlib.sha256(), 0
    for precision in precisions_for(arch):
        for md, splits, groups, two in registry_calls(precision, arch):
            if md.kv_format == MODEL1 and md.extra_kv_format is None:
                h.update(repr((precision, md.num_tokens, md.num_heads, md.topk, md.page_block_size, md.extra_topk,
                               md.extra_page_block_size, md.has_topk_length, md.has_extra_topk_length, md.has_sink,
                               splits, groups, two)).encode())
                n += 1
    names = sorted(v.name.replace(f"_{MODEL1}", "") for v in registry_variants(arch)
                   if v.kind == "merge" or v.config.kv_format == MODEL1)
    return n, h.hexdigest()[:16], len(names), hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


def test_model1_decisions_are_those_of_the_single_format_dispatch():
    """Adding formats changed no MODEL1 decision: the head groups, splits and register bound of
    every MODEL1 deployment call, and the MODEL1 registry (names less the format), hash to
    what the dispatch gave before formats existed (recorded from it). The names are the whole
    registry's: no call of another format, nor of two formats (a MODEL1 cache beside an NVFP4
    one), adds a MODEL1 or merge kernel. A deliberate change of a MODEL1 rule updates these
    numbers."""
    assert _model1_decisions("sm_120a") == (66048, "030531eb0dc14d9f", 100, "e0c64cd552e91f9f")
    assert _model1_decisions("sm_90a") == (49536, "f787030aff245961", 84, "5e33db607d1e4900")


def _validated(cache, kv_format, **fields) -> ValidatedCall:
    """A ValidatedCall of a cache view and nothing else (what the plan's
    argument values read), built on CPU: ``validate_call`` itself needs a CUDA device."""
    empty = {f.name: None for f in dataclasses.fields(ValidatedCall)}
    view = read_cache_view(cache, kv_format)
    return ValidatedCall(**{**empty, "main": view, "extra": view, "kv_cache": cache, "device_index": 0,
                            "precision": "f16", **fields})


def test_layout_keys_tell_every_layout_apart():
    """The one-shot call's plan cache (``dispatch.plan_cache``) keys a call by its layout:
    tensors that differ only in a stride, a dtype, a device or an optional input, and calls
    that differ only in the formats or precision they name, never share a key (so never a
    plan); new values in new tensors of the same layout do."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(4, 16, 512, generator=gen).bfloat16()
    cache = make_cache(4, 64, device="cpu", gen=gen)
    idx = make_indices(4, 128, 256, device="cpu", gen=gen)
    out, lse = torch.empty(4, 16, 512, dtype=torch.bfloat16), torch.empty(4, 16)
    lens = torch.full((4,), 100, dtype=torch.int32)

    def key(q=q, cache=cache, idx=idx, lens=None, out=out, kv_format=None, extra_kv_format=None, precision=None):
        return layout_key((q, cache, idx, lens, None, out, lse, None, None, None), kv_format, extra_kv_format, precision)

    base = key()
    assert base == key(q=q.clone(), cache=make_cache(4, 64, device="cpu", gen=gen), idx=idx.clone(), out=out.clone())
    variants = {
        "strides": key(q=torch.empty(4, 16, 1024, dtype=torch.bfloat16)[..., :512]),
        "dtype": key(idx=idx.long()),
        "device": key(q=q.to("meta")),
        "optional input": key(lens=lens),
        "out allocated by the call": key(out=None),
        "shape": key(idx=idx[:, :64]),
        "named format": key(kv_format=MODEL1),
        "named extra format": key(extra_kv_format=MODEL1_NVFP4.name),
        "precision": key(precision="bf16"),
    }
    for what, k in variants.items():
        assert k != base, what
    assert len(set(variants.values())) == len(variants)
    with pytest.raises(AttributeError):  # not a tensor: the call is validated in full, which refuses it
        key(q=[1.0])


def test_plan_cache_caps_come_from_the_environment(monkeypatch):
    from dispatch.plan_cache import BYTES_ENV, DEFAULT_BYTES, DEFAULT_ENTRIES, ENTRIES_ENV

    monkeypatch.delenv(ENTRIES_ENV, raising=False)
    monkeypatch.delenv(BYTES_ENV, raising=False)
    assert (PlanCache().capacity, PlanCache().byte_cap) == (DEFAULT_ENTRIES, DEFAULT_BYTES)
    monkeypatch.setenv(ENTRIES_ENV, "12")
    monkeypatch.setenv(BYTES_ENV, "0")  # keep no buffer: every call gets its own
    assert (PlanCache().capacity, PlanCache().byte_cap) == (12, 0)
    info = PlanCache().info()
    assert info == {"entries": 0, "capacity": 12, "buffer_bytes": 0, "byte_cap": 0, "scratch_bytes": 0,
                    "lse_bytes": 0, "buffers": 0}
    for value in ("0", "-1", "many"):
        monkeypatch.setenv(ENTRIES_ENV, value)
        with pytest.raises(ValueError, match=f"{ENTRIES_ENV}={value!r}: expected an int of at least 1"):
            PlanCache()


def test_plan_cache_keeps_buffers_within_its_byte_cap(monkeypatch):
    """One buffer per kind and stream, grown to the largest need while the kept buffers fit the
    byte cap; a need past it gets a buffer of its own that the cache does not keep."""
    import dispatch.plan_cache as pc

    monkeypatch.setattr(pc, "_capturing", lambda: False)
    monkeypatch.setattr(pc, "_raw_stream", lambda index: 7)
    cache = PlanCache(capacity=4, byte_cap=1000)

    def alloc(n):
        return lambda: torch.empty(n, dtype=torch.uint8)

    first = cache._buffer("scratch", 0, 300, alloc(300))
    assert cache._buffer("scratch", 0, 200, alloc(200)) is first  # big enough: reused
    grown = cache._buffer("scratch", 0, 600, alloc(600))
    assert grown is not first and cache.info()["scratch_bytes"] == 600
    lse = cache._buffer("lse", 0, 400, alloc(400))
    assert cache.info()["buffer_bytes"] == 1000 and cache.info()["lse_bytes"] == 400
    own = cache._buffer("lse", 0, 500, alloc(500))  # 600 + 500 > 1000: the call's own
    assert own is not lse and cache.info()["lse_bytes"] == 400 and cache._buffer("lse", 0, 100, alloc(100)) is lse
    assert cache.info()["buffer_bytes"] <= cache.byte_cap
    cache.clear()
    assert cache.info()["buffers"] == 0


def test_discarded_lse_is_one_view_per_layout_of_the_kept_buffer(monkeypatch):
    """A call that wants no lse gets a view of the stream's kept lse buffer: the same view
    while that buffer is kept; none kept once the buffer grows (the old one is freed) or when
    the call is served past the byte cap (its own buffer is not kept)."""
    import dispatch.plan_cache as pc

    monkeypatch.setattr(pc, "_capturing", lambda: False)
    monkeypatch.setattr(pc, "_raw_stream", lambda index: 7)
    cache = PlanCache(capacity=4, byte_cap=400)
    plan = types.SimpleNamespace(device_index=0, device=torch.device("cpu"))

    def entry(tokens, heads):
        e = pc.CachedPlan(plan, torch.empty(tokens, heads, 8), torch.empty(tokens, heads))
        cache.put((tokens, heads), e)
        return e

    small, large, huge = entry(2, 16), entry(4, 16), entry(8, 16)
    first = cache.discarded_lse(small)
    assert first.shape == (2, 16) and cache.discarded_lse(small) is first  # repeated: the same view
    kept = first._base
    grown = cache.discarded_lse(large)  # 256 bytes: the buffer grows, the old views are dropped
    assert grown._base is not kept and small.lse_view is None
    again = cache.discarded_lse(small)
    assert again._base is grown._base and again.shape == (2, 16)
    own = cache.discarded_lse(huge)  # 512 bytes > the 400-byte cap: the call's own buffer
    assert own.shape == (8, 16) and own._base is not grown._base and huge.lse_view is None
    assert cache.discarded_lse(small) is again and cache.info()["lse_bytes"] == 256


def test_plan_cache_is_bounded_and_thread_safe():
    cache = PlanCache(capacity=3)
    for k in "abc":
        cache.put(k, k.upper())
    cache.put("d", "D")  # the oldest goes
    assert cache.get("a") is None and [cache.get(k) for k in "bcd"] == ["B", "C", "D"] and len(cache) == 3
    assert cache.put("b", "other") == "B"  # the first plan of a key is kept (two threads planning at once)

    shared = PlanCache(capacity=16)
    errors = []

    def worker(offset):
        for i in range(2000):
            k = (offset + i) % 40
            got = shared.get(k)
            if got is None:
                got = shared.put(k, ("plan", k))
            if got != ("plan", k):
                errors.append((k, got))

    threads = [threading.Thread(target=worker, args=(7 * n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(shared) == 16
    shared.clear()
    assert len(shared) == 0


# V4.1 inline records in blocks padded by two rows: indices count rows of the whole cache (66 a block)
V41_INLINE_PADDED_CACHE = make_cache(4, 64, device="cpu", kv_format="v41_fp8_inline", block_stride=66 * 528, gen=_GEN)


@pytest.mark.parametrize("kv_format,cache,index_page", [
    (MODEL1, None, 64), (V32_FP8.name, V32_CACHE, 64), (GLM_NOPE_FP8.name, GLM_CACHE, 64),
    (GLM_NOPE_FP8.name, GLM_POOL_CACHE, 64), (V41_FP8.name, V41_CACHE, 64),
    ("v41_fp8_inline", V41_INLINE_PADDED_CACHE, 66),
])
def test_plan_binds_every_kernel_argument_and_the_row_strides(kv_format, cache, index_page):
    """The plan gives every argument of the partial kernel's schema a value, the row strides
    those of the cache views (MODEL1: its packed 584-byte rows; GLM-5.3: 528 or 656), the page
    what an index is divided by (``CacheView.index_page``: P, or for flat rows the rows a
    block stride holds), and a final-mode launch one split and no partial outputs."""
    cache = make_cache(4, 64, device="cpu") if cache is None else cache
    strides = dict(q_t=0, q_h=0, idx_t=0, extra_idx_t=0, main_block=1, main_row=0, main_slots=1, extra_block=1,
                   extra_row=0, extra_slots=1, out_t=0, out_h=0, lse_t=0, lse_h=0)
    call = _validated(cache, kv_format)
    strides.update(main_row=call.main.row_stride, extra_row=call.extra.row_stride)
    call.strides = strides
    plan = types.SimpleNamespace(final=True, num_tokens=1, num_heads=16, topk=32, extra_topk=0,
                                 split=SplitPlan(1, 1, 1), num_splits=1, _o_part_bytes=0)
    values = DecodePlan._argument_values(plan, call, present={"q", "main", "indices", "out", "lse"})
    assert set(values) == {a.name for a in PARTIAL_ARGS}
    expected = FORMATS[kv_format].bytes_per_token if kv_format == MODEL1 else cache.stride(1)
    assert values["main_row_stride"] == values["extra_row_stride"] == expected
    assert call.main.index_page == index_page and call.main.page_block_size == 64
    assert values["main_page"] == values["extra_page"] == index_page, values["main_page"]
    assert values["main_page_magic"] == page_division_magic(index_page)
    assert (values["num_splits"], values["launch_splits"], values["o_part"], values["lse_part"]) == (1, 1, 0, 0)


# ---------------------------------------------------------------------- the kv_formats module
def _exact_latent(fmt, num_tokens, gen):
    """A latent every writer stores exactly: e4m3 values times a power of two per scale group,
    each group's largest magnitude 448 times its scale (so pow2 and amax / 448 scales are the
    same); for an e2m1 format e2m1 values, each group's largest 6 times its scale (amax / 6 is
    the scale); the rope dims bf16 values."""
    if fmt.e2m1:
        codes = e2m1_decode(torch.randint(0, 16, (num_tokens, fmt.num_scales, fmt.scale_group), generator=gen))
        codes[..., 0] = 6.0
    else:
        codes = torch.randn(num_tokens, fmt.num_scales, fmt.scale_group, generator=gen).clamp(-440, 440)
        codes = (codes * 64).to(torch.float8_e4m3fn).float()
        codes[..., 0] = 448.0
    scale = torch.exp2(torch.randint(-8, 4, (num_tokens, fmt.num_scales, 1), generator=gen).float())
    rope = torch.randn(num_tokens, fmt.rope_dims, generator=gen).to(torch.bfloat16).float()
    return torch.cat([(codes * scale).reshape(num_tokens, fmt.nope_dims), rope], dim=-1)


def test_kv_formats_lists_every_format_with_its_widths():
    assert sorted(kv_formats.FORMATS) == ["glm_nope_fp8", "model1_fp8", "model1_nvfp4", "v32_fp8", "v41_fp8",
                                          "v41_fp8_inline", "v41_nvfp4", "v41_nvfp4_inline"]
    widths = {name: (f.bytes_per_token, f.d_qk, f.d_v) for name, f in kv_formats.FORMATS.items()}
    assert widths == {"model1_fp8": (584, 512, 512), "v32_fp8": (656, 576, 512), "glm_nope_fp8": (528, 512, 512),
                      "model1_nvfp4": (384, 512, 512), "v41_fp8": (528, 512, 512), "v41_fp8_inline": (528, 512, 512),
                      "v41_nvfp4": (288, 512, 512), "v41_nvfp4_inline": (288, 512, 512)}
    assert kv_formats.DEFAULT_FORMAT == MODEL1 and kv_formats.FORMATS[MODEL1] is MODEL1_FP8
    assert all(kv_formats.writers(name) for name in kv_formats.FORMATS)  # each packs as some engine writes it
    doc_rows = {ln.split("|")[1].strip().strip("`"): [c.strip() for c in ln.split("|")[3:6]]
                for ln in kv_formats.__doc__.splitlines() if ln.startswith("| ``")}
    assert {n: (int(r[0].split()[0]), int(r[1]), int(r[2])) for n, r in doc_rows.items()} == widths


@pytest.mark.parametrize("kv_format", sorted(FORMATS))
def test_pack_pads_to_whole_blocks_and_unpack_returns_the_latent(kv_format):
    fmt = FORMATS[kv_format]
    gen = torch.Generator().manual_seed(1)
    latent = _exact_latent(fmt, 100, gen)
    cache = kv_formats.pack(latent, kv_format, 16)
    assert cache.dtype == torch.uint8 and cache.shape[:3] == (7, 16, 1)  # ceil(100 / 16) blocks
    assert read_cache_view(cache, kv_format).fmt is fmt
    back = kv_formats.unpack(cache, kv_format).reshape(-1, fmt.d_qk)
    assert torch.equal(back[:100], latent)
    assert torch.equal(back[100:], torch.zeros(12, fmt.d_qk))  # the padding slots: zero tokens
    blocks = kv_formats.pack(latent[:96].reshape(6, 16, fmt.d_qk), kv_format, 16)
    assert torch.equal(kv_formats.unpack(blocks, kv_format).reshape(-1, fmt.d_qk), latent[:96])
    for writer in kv_formats.writers(kv_format):  # every writer stores this latent exactly
        assert torch.equal(kv_formats.unpack(kv_formats.pack(latent, kv_format, 64, writer=writer),
                                             kv_format).reshape(-1, fmt.d_qk)[:100], latent)
    q = torch.randn(1, 16, fmt.d_qk).to(torch.bfloat16)
    idx = torch.zeros(1, 8, dtype=torch.int32)
    if kv_format in EXTRA_ONLY_FORMATS:  # read only as an extra cache, beside a main cache it pairs with
        with pytest.raises(InvalidDecodeInput, match="is read only as an extra"):
            sparse_mla_decode(q, cache, idx, kv_format=kv_format)
        main = next(m for m, extras in EXTRA_FORMATS.items() if kv_format in extras)
        args = (q, kv_formats.pack(_exact_latent(FORMATS[main], 16, gen), main, 16), idx)
        kwargs = dict(kv_format=main, extra_kv_cache=cache, extra_indices=idx, extra_kv_format=kv_format)
    else:
        args, kwargs = (q, cache, idx), dict(kv_format=kv_format)
    with pytest.raises(InvalidDecodeInput, match="the kernels run on CUDA devices only"):  # the API accepts it
        sparse_mla_decode(*args, **kwargs)


def test_pack_pitch_and_unpack_by_width():
    gen = torch.Generator().manual_seed(2)
    latent = _exact_latent(GLM_NOPE_FP8, 64, gen)
    pool = kv_formats.pack(latent, "glm_nope_fp8", 64, row_stride=656)
    assert pool.shape == (1, 64, 1, 656) and pool.stride(1) == 656
    assert torch.equal(kv_formats.unpack(pool, "glm_nope_fp8").reshape(-1, 512), latent)
    v32 = kv_formats.pack(_exact_latent(V32_FP8, 64, gen), "v32_fp8", 64)
    assert kv_formats.unpack(v32).shape == (1, 64, 576)  # 656 bytes: V3.2 by its width
    with pytest.raises(ValueError, match="528 bytes wide is ambiguous"):
        kv_formats.unpack(kv_formats.pack(latent, "glm_nope_fp8", 64))


@pytest.mark.parametrize("args,kwargs,message", [
    ((torch.randn(10, 576), "v32_fp8", 0), {}, "page_block_size must be a positive int, got 0"),
    ((torch.randn(10, 512), "v32_fp8", 16), {}, "a v32_fp8 latent is [num_tokens, 576] or [num_blocks, P, 576]"),
    ((torch.randn(2, 8, 512), "model1_fp8", 16), {}, "has blocks of 8 tokens, page_block_size is 16"),
    ((torch.randn(0, 512), "model1_fp8", 16), {}, "holds no token"),
    ((torch.zeros(10, 512, dtype=torch.int32), "model1_fp8", 16), {}, "must be a floating-point torch.Tensor"),
    ((torch.randn(10, 512), "fp4", 16), {},
     "kv_format must be one of ['glm_nope_fp8', 'model1_fp8', 'model1_nvfp4', 'v32_fp8', 'v41_fp8', 'v41_fp8_inline', "
     "'v41_nvfp4', 'v41_nvfp4_inline']"),
    ((torch.randn(10, 512), "glm_nope_fp8", 16), dict(writer="flashmla"),
     f"writer must be one of {kv_formats.writers('glm_nope_fp8')} for glm_nope_fp8, got 'flashmla'"),
    ((torch.randn(10, 512), "glm_nope_fp8", 16), dict(row_stride=600), "row_stride 600 must be a multiple of 16"),
    ((torch.randn(10, 512), "model1_fp8", 16), dict(fill=300),
     "fill must be an int in [0, 255] (the byte written where no data is), got 300"),
    ((torch.randn(10, 512), "model1_fp8", 16), dict(fill=-1), "fill must be an int in [0, 255]"),
    ((torch.randn(10, 512), "model1_fp8", 16), dict(fill=1.0), "fill must be an int in [0, 255]"),
    ((torch.randn(10, 512), "model1_fp8", 16), dict(row_stride=592),
     "row_stride applies to the formats with scales inline in the row"),
    ((torch.randn(10, 512), "v41_fp8", 16), dict(row_stride=528),
     "row_stride applies to the formats with scales inline in the row"),
    ((torch.randn(10, 512).index_put((torch.tensor([3]), torch.tensor([70])), torch.tensor(math.inf)), "model1_fp8",
      16), {}, "latent[3, 70] is inf: model1_fp8's 'vllm' writer has no encoding of NaN or Inf in the nope dims"),
    ((torch.randn(10, 512).index_put((torch.tensor([9]), torch.tensor([1])), torch.tensor(math.nan)), "model1_nvfp4",
      16), {}, "latent[9, 1] is nan: model1_nvfp4's 'flashinfer' writer has no encoding"),
    ((torch.randn(10, 512).index_put((torch.tensor([0]), torch.tensor([5])), torch.tensor(-math.inf)), "v41_fp8",
      16), dict(writer="b12x"), "latent[0, 5] is -inf: v41_fp8's 'b12x' writer has no encoding"),
])
def test_pack_refuses_with_the_reason(args, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        kv_formats.pack(*args, **kwargs)


@pytest.mark.parametrize("kv_format", ["v41_fp8", "v41_fp8_inline", "v41_nvfp4", "v41_nvfp4_inline"])
def test_pack_encodes_inf_as_flashinfers_v41_writers_do(kv_format):
    """FlashInfer's V4.1 writers define a group holding Inf (FP8: scale byte 0xFF, the Inf
    elements' codes 0x7F; FP4: scale 0x7F, zero codes): ``pack`` writes those bytes, so the
    group reads back NaN throughout, as FlashInfer's cache holds it; the other groups are
    untouched."""
    fmt = FORMATS[kv_format]
    latent = torch.randn(16, fmt.d_qk)
    latent[2, 40] = math.inf
    back = kv_formats.unpack(kv_formats.pack(latent, kv_format, 16), kv_format).reshape(-1, fmt.d_qk)
    group = slice(40 // fmt.scale_group * fmt.scale_group, (40 // fmt.scale_group + 1) * fmt.scale_group)
    assert torch.isnan(back[2, group]).all()
    rest = torch.ones(16, fmt.d_qk, dtype=torch.bool)
    rest[2, group] = False
    assert torch.isfinite(back[rest]).all()
    assert torch.equal(back[rest], kv_formats.unpack(kv_formats.pack(latent.nan_to_num(posinf=0.0), kv_format, 16),
                                                     kv_format).reshape(-1, fmt.d_qk)[rest])


# ---------------------------------------------------------------------- adapters (CPU: up to the device check)
def _refused(fn, *args, **kwargs) -> str:
    with pytest.raises(InvalidDecodeInput) as info:
        fn(*args, **kwargs)
    return str(info.value)


def _vllm_v32_call(**overrides):
    """The call vLLM's SM120 sparse MLA backend makes (q [T, H, 576] unsqueezed to one query
    per request, the [num_blocks, P, 656] cache unsqueezed to HND, indices [T, 1, topk])."""
    T, H, topk = 3, 16, 64
    kw = dict(query=torch.randn(T, 1, H, 576).to(torch.bfloat16), kv_cache=V32_CACHE.squeeze(2).unsqueeze(1),
              workspace_buffer=torch.empty(16, dtype=torch.uint8), qk_nope_head_dim=128, kv_lora_rank=512,
              qk_rope_head_dim=64, block_tables=torch.zeros(T, 1, topk, dtype=torch.int32), seq_lens=None,
              max_seq_len=topk, out=torch.empty(T, 1, H, 512, dtype=torch.bfloat16), bmm1_scale=0.1, bmm2_scale=1.0,
              sparse_mla_top_k=topk, kv_scale_format="pow2_fp32")
    kw.update(overrides)
    return kw


def test_flashinfer_mla_adapter_serves_the_vllm_v32_and_glm_calls():
    for scale_format in ("auto", "pow2_fp32", "arbitrary_fp32"):
        text = _refused(trtllm_batch_decode_with_kv_cache_mla, **_vllm_v32_call(kv_scale_format=scale_format))
        assert text.startswith(V32_FP8.model_type + ": num_tokens=3, num_heads=16, topk=64, d_qk=576")
        assert text.endswith("the kernels run on CUDA devices only")
    # a [num_pages, P, 656] cache, lengths per token
    text = _refused(trtllm_batch_decode_with_kv_cache_mla, **_vllm_v32_call(
        kv_cache=V32_CACHE.squeeze(2), seq_lens=torch.full((3,), 5, dtype=torch.int32)))
    assert text.endswith("the kernels run on CUDA devices only")
    # GLM-5.3 rope-free rows in a 656-byte pool: read as GLM-5.3 (the width alone says V3.2)
    glm = _vllm_v32_call(query=torch.randn(3, 1, 16, 512).to(torch.bfloat16), qk_rope_head_dim=0,
                         kv_cache=GLM_POOL_CACHE.squeeze(2).unsqueeze(1), kv_scale_format="arbitrary_fp32",
                         sparse_mla_top_k_lens=torch.full((3,), 5, dtype=torch.int32))
    text = _refused(trtllm_batch_decode_with_kv_cache_mla, **glm)
    assert text.startswith(GLM_NOPE_FP8.model_type + ": num_tokens=3, num_heads=16, topk=64, d_qk=512")
    assert text.endswith("the kernels run on CUDA devices only")


@pytest.mark.parametrize("overrides,message", [
    (dict(qk_rope_head_dim=32), "kv_lora_rank=512, qk_rope_head_dim=32 name no FP32-scale cache format"),
    (dict(kv_scale_format="ue8m0_g32"), "kv_scale_format must be one of ('auto', 'pow2_fp32', 'arbitrary_fp32')"),
    (dict(sparse_mla_top_k=0), "sparse_mla_top_k must be a positive int (dense MLA decode is not served)"),
    (dict(backend="trtllm-gen"), "backend must be 'auto' or 'sparse'"),
    (dict(cum_seq_lens_q=torch.zeros(4, dtype=torch.int32)), "cum_seq_lens_q / max_q_len (ragged query lengths)"),
    (dict(enable_dcp=True), "decode context parallelism"),
    (dict(skip_softmax_threshold_scale_factor=1.0), "skip_softmax_threshold_scale_factor is not served"),
    (dict(uses_shared_paged_kv_idx=False), "separate K/V page indices"),
    (dict(bmm2_scale=2.0), "bmm2_scale must be 1.0"),
    (dict(bmm1_scale=torch.tensor(0.1)), "must be Python floats"),
    (dict(block_tables=torch.zeros(3, 1, 32, dtype=torch.int32)), "expected [3, 1, 64]"),
    (dict(sinks=[torch.zeros(16), torch.zeros(16)]), "got a list of 2"),
    (dict(lse=torch.empty(3, 16)), "lse was given without return_lse=True"),
    (dict(return_lse=True, lse=torch.empty(16, 3)), "lse must be float32 [3, 16] or [3, 1, 16]"),
    (dict(return_lse_base="base10"), "return_lse_base must be 'basee', 'base2' or None"),
    (dict(return_lse_base="basee", lse_convention="log2_with_sink"), "pass one"),
    (dict(lse_convention="log10"), "lse_convention must be one of"),
    (dict(seq_lens=torch.zeros(2, dtype=torch.int32)), "seq_lens has shape [2], expected [3], [3] or [3, 1]"),
    (dict(seq_lens=torch.zeros(3, dtype=torch.int32), sparse_mla_top_k_lens=torch.zeros(3, dtype=torch.int32)),
     "seq_lens or sparse_mla_top_k_lens, not both"),
    (dict(query=torch.randn(3, 16, 576).to(torch.bfloat16)), "query must be [batch, seq_q, num_heads, 576]"),
    (dict(query=torch.randn(3, 1, 16, 512).to(torch.bfloat16)), "q has QK width 512, expected d_qk = 576"),
    (dict(kv_cache=torch.zeros(4, 1, 64, 584, dtype=torch.uint8)), "expected [num_blocks, P, 1, 656]"),
])
def test_flashinfer_mla_adapter_refuses_what_it_does_not_serve(overrides, message):
    text = _refused(trtllm_batch_decode_with_kv_cache_mla, **_vllm_v32_call(**overrides))
    assert message in text
    prefix = GENERIC_MODEL_TYPE if "qk_rope_head_dim" in overrides else V32_FP8.model_type
    assert text.startswith(prefix + ": ")


def test_flash_mla_adapter_serves_v32_and_refuses_a_wrong_value_width():
    q = torch.randn(2, 1, 16, 576).to(torch.bfloat16)
    idx = torch.zeros(2, 1, 32, dtype=torch.int32)
    text = _refused(flash_mla_with_kvcache, q, V32_CACHE, head_dim_v=512, is_fp8_kvcache=True, indices=idx)
    assert text.startswith(V32_FP8.model_type) and text.endswith("the kernels run on CUDA devices only")
    text = _refused(flash_mla_with_kvcache, q, V32_CACHE, head_dim_v=576, is_fp8_kvcache=True, indices=idx)
    assert text.startswith(V32_FP8.model_type) and "head_dim_v must be 512 (the value width of v32_fp8 caches)" in text
    text = _refused(flash_mla_with_kvcache, q[..., :512], GLM_CACHE, is_fp8_kvcache=True, indices=idx,
                    kv_format="glm_nope_fp8")
    assert text.startswith(GLM_NOPE_FP8.model_type) and text.endswith("the kernels run on CUDA devices only")


def test_dsv4_adapter_reads_model1_caches_only():
    q = torch.randn(2, 16, 512).to(torch.bfloat16)
    text = _refused(trtllm_batch_decode_sparse_mla_dsv4, q, V32_CACHE, None, torch.zeros(2, 32, dtype=torch.int32),
                    kv_layout="NHD")
    assert text.startswith(MODEL1_FP8.model_type) and "expected [num_blocks, P, 1, 584]" in text


def _vllm_dsv4_call(**overrides):
    """The call vLLM's DeepSeek-V4 SM12x attention makes (CPU tensors: refused at the device
    check when everything else is right)."""
    T, H = 3, 8
    cache = make_cache(4, 64, device="cpu", gen=torch.Generator().manual_seed(5))
    kw = dict(query=torch.randn(T, H, 512).to(torch.bfloat16), swa_kv_cache=cache,
              workspace_buffer=torch.empty(16, dtype=torch.uint8), sparse_indices=torch.zeros(T, 128, dtype=torch.int32),
              compressed_kv_cache=cache, out=torch.empty(T, H, 512, dtype=torch.bfloat16), bmm1_scale=0.05,
              sinks=torch.zeros(H), kv_layout="NHD", swa_topk_lens=torch.full((T,), 7, dtype=torch.int32),
              extra_sparse_indices=torch.zeros(T, 1, 8192, dtype=torch.int32),
              extra_sparse_topk_lens=torch.full((T,), 9, dtype=torch.int32))
    kw.update(overrides)
    return kw


@pytest.mark.parametrize("overrides,message", [
    ({}, "the kernels run on CUDA devices only"),
    (dict(num_valid_heads=5), "the kernels run on CUDA devices only"),
    (dict(kv_layout="HND"), "swa_kv_cache of shape [4, 64, 1, 584] is not laid out as kv_layout='HND'"),
    (dict(bmm1_scale=torch.tensor(0.05)), "bmm1_scale must be a Python number: a tensor would be read back to the "
                                          "host"),
    (dict(bmm1_scale=1), "the kernels run on CUDA devices only"),
    (dict(swa_topk_lens=torch.full((3, 1), 7, dtype=torch.int32)), "the kernels run on CUDA devices only"),
    (dict(kv_layout="NDH"), "kv_layout must be 'HND' or 'NHD'"),
    (dict(backend="trtllm-gen"), "backend must be one of ('auto', 'sparse', 'cake')"),
    (dict(backend="cake"), "the kernels run on CUDA devices only"),
    # flashinfer-python 0.7.4's keywords: the cache formats mapped, the rest honoured or refused by name
    (dict(kv_cache_format="fp8"), "the kernels run on CUDA devices only"),
    (dict(kv_cache_format="fp4"), "kv_cache_format must be one of ['fp8', 'fp8_dsv41', 'fp8_dsv41_fp4_ca', "
                                  "'fp8_dsv41_inline', 'fp8_dsv41_inline_fp4_ca', 'nvfp4'], got 'fp4'"),
    (dict(kv_cache_format="nvfp4"), "expected [num_blocks, P, 1, 384]"),  # FP8 caches named NVFP4
    (dict(kv_cache_format="nvfp4", swa_kv_cache=NVFP4_CACHE, compressed_kv_cache=NVFP4_CACHE),
     "the kernels run on CUDA devices only"),
    (dict(kv_cache_format="fp8_dsv41_fp4_ca", swa_kv_cache=V41_CACHE, compressed_kv_cache=V41_NVFP4_CACHE),
     "the kernels run on CUDA devices only"),
    (dict(kv_cache_format="fp8_dsv41", swa_kv_cache=V41_CACHE, compressed_kv_cache=V41_NVFP4_CACHE),
     "[2, 64, 1, 288]: expected [num_blocks, P, 1, 528]"),  # the compressed cache named FP8
    (dict(sparse_topk_lens_offset=2), "sparse_topk_lens_offset must be 0"),
    (dict(dsv4_output_scale=torch.ones(1)), "dsv4_output_scale: not served"),
    (dict(lse_scale=1.0, split_scratch=torch.empty(4)),
     "lse_scale, split_scratch: not a keyword of FlashInfer's trtllm_batch_decode_sparse_mla_dsv4 this adapter serves "
     "(checked against flashinfer-python 0.7.4)"),
    (dict(hca_seq_lens=torch.zeros(3, dtype=torch.int32)), "hca_seq_lens: not served (FlashInfer's HCA inputs"),
    (dict(sparse_indices_are_storage_offsets=True), "sparse_indices_are_storage_offsets: not served"),
    (dict(cum_seq_lens_q=torch.zeros(4, dtype=torch.int32)), "cum_seq_lens_q (ragged query lengths) is not served"),
    (dict(sparse_indices=None), "sparse_indices is required"),
    (dict(sparse_topk_lens=torch.zeros(3, dtype=torch.int32)),
     "sparse_topk_lens is FlashInfer's SM100 length of one combined table"),
    (dict(sparse_topk_lens=torch.zeros(3, dtype=torch.int32), swa_topk_lens=None),
     "pass the main list's lengths as swa_topk_lens"),
    (dict(compressed_kv_cache=None), "compressed_kv_cache and extra_sparse_indices go together"),
    (dict(compressed_kv_cache=None, extra_sparse_indices=None, extra_sparse_topk_lens=None),
     "the kernels run on CUDA devices only"),  # no compressed cache
    # FlashInfer's "fp8" call: the compressed cache is the FP8 record too, never read as NVFP4
    (dict(compressed_kv_cache=make_cache(4, 64, device="cpu", kv_format="model1_nvfp4")),
     "[4, 64, 1, 384]: expected [num_blocks, P, 1, 584]"),
    (dict(bmm2_scale=0.5), "bmm2_scale must be 1.0"),
    (dict(num_valid_heads=9), "num_valid_heads must be an int in [1, num_heads], got 9"),
    (dict(num_valid_heads=4, out=None), "num_valid_heads needs out"),
])
def test_dsv4_adapter_serves_vllms_call_and_refuses_the_rest(overrides, message):
    text = _refused(trtllm_batch_decode_sparse_mla_dsv4, **_vllm_dsv4_call(**overrides))
    main = DSV4_KV_CACHE_FORMATS.get(overrides.get("kv_cache_format", "fp8"), ("model1_fp8",))[0]
    assert text.startswith(FORMATS[main].model_type) and message in text


def test_sglang_adapter_takes_sglangs_keywords():
    q = torch.randn(2, 1, 64, 512).to(torch.bfloat16)
    cache = make_cache(2, 256, device="cpu", gen=torch.Generator().manual_seed(6))
    idx = torch.zeros(2, 1, 128, dtype=torch.int32)
    text = _refused(flash_mla_with_kvcache_sm120, q=q, k_cache=cache, head_dim_v=512, indices=idx,
                    softmax_scale=None, topk_length=torch.full((2,), 3, dtype=torch.int32), attn_sink=torch.zeros(64),
                    extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None)
    assert text.startswith(MODEL1_FP8.model_type + ": num_tokens=2, num_heads=64, topk=128, d_qk=512, "
                                                   "page_block_size=256")
    assert text.endswith("the kernels run on CUDA devices only")
    with pytest.raises(TypeError):  # keywords only, as SGLang calls it
        flash_mla_with_kvcache_sm120(q, cache, idx, 512)
    assert "head_dim_v must be 512" in _refused(flash_mla_with_kvcache_sm120, q=q, k_cache=cache, indices=idx,
                                                 head_dim_v=576)
    # SGLang's function takes **kwargs: a keyword a later SGLang passes is refused by name
    text = _refused(flash_mla_with_kvcache_sm120, q=q, k_cache=cache, head_dim_v=512, indices=idx, causal=False,
                    is_fp8_kvcache=True)
    assert text.endswith("causal, is_fp8_kvcache: not a keyword of SGLang's flash_mla_with_kvcache_sm120 this "
                         "adapter serves (checked against SGLang 0.5.23)")


def test_natural_with_sink_is_the_log2_convention_in_natural_units():
    lse = torch.tensor([[0.5, math.inf], [math.inf, 2.0]])  # [T, H]; +inf: a token with no valid entry
    sink = torch.tensor([1.0, -math.inf])
    natural = convert_lse(lse, sink, "natural_with_sink")
    assert torch.allclose(natural, convert_lse(lse, sink, "log2_with_sink") * math.log(2), rtol=0, atol=1e-6)
    assert natural[1, 0] == 1.0  # empty: the sink alone
    assert natural[0, 1] == -math.inf and natural[1, 1] == 2.0  # a -inf sink: empty stays ln 0, the rest unchanged
    assert torch.allclose(natural[0, 0], torch.logaddexp(torch.tensor(0.5), torch.tensor(1.0)))


def test_torch_op_takes_the_format():
    """The op's schema has kv_format; its fake gives out the format's value width (every
    format's D_V) from q's shape alone, as torch.compile traces it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    schema = str(torch.ops.dsv4_mla.sparse_mla_decode.default._schema)
    assert "str? kv_format=None" in schema
    with FakeTensorMode():
        q = torch.empty(3, 16, 576, dtype=torch.bfloat16)
        out, lse = torch.ops.dsv4_mla.sparse_mla_decode(q, torch.empty(4, 64, 1, 656, dtype=torch.uint8),
                                                        torch.empty(3, 8, dtype=torch.int32), 0.1, kv_format="v32_fp8")
        assert out.shape == (3, 16, V32_FP8.d_v) and lse.shape == (3, 16)
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
def _stub_kernels(monkeypatch):
    """Plans whose kernels are stubbed: their checks run, nothing is compiled or launched."""
    from dispatch import loader

    monkeypatch.setattr(loader, "get_compiled", lambda variant: None)
    monkeypatch.setattr(DecodePlan, "_make_kernels", lambda self, values: [])


def _cpu_plan(monkeypatch, precision="f16", **kwargs):
    """A plan built on CPU tensors for sm_120a (``validate_call``'s ``_target``), with its
    kernels stubbed: its checks run, nothing is compiled or launched."""
    from dispatch.api import validate_call

    _stub_kernels(monkeypatch)
    base = _inputs()
    base.update(kwargs)
    call = validate_call(base.pop("q"), base.pop("kv_cache"), base.pop("indices"), precision=precision,
                         _target=("sm_120a", 188, SM120_SMEM_PER_SM), **base)
    return DecodePlan(call), call


def _deployment_call_inputs(md: DecodeMetadata, caches: dict) -> dict:
    """CPU inputs of the call ``md`` describes, as ``validate_call`` takes them. q and the index
    lists are broadcast views of one row (the layout checks pass them; a plan never reads
    them), out and lse uninitialized (pages never touched), so that a 4096-token call costs
    almost no memory; ``caches``: by (format, page). An
    extra cache of another format is named (``extra_kv_format``), as its width may not say it."""
    fmt = FORMATS[md.kv_format]
    T, H = md.num_tokens, md.num_heads

    def cache(page, kv_format=md.kv_format):
        key = (kv_format, page)
        if key not in caches:
            caches[key] = make_cache(2, page, device="cpu", kv_format=kv_format)
        return caches[key]

    def rows(*shape, dtype):
        return torch.zeros(shape[-1], dtype=dtype).expand(*shape)

    kw = dict(q=rows(T, H, md.d_qk, dtype=torch.bfloat16), kv_cache=cache(md.page_block_size),
              indices=rows(T, md.topk, dtype=torch.int32), out=torch.empty(T, H, fmt.d_v, dtype=torch.bfloat16),
              lse=torch.empty(T, H, dtype=torch.float32), kv_format=md.kv_format)
    if md.has_topk_length:
        kw["topk_length"] = torch.zeros(T, dtype=torch.int32)
    if md.has_sink:
        kw["attn_sink"] = torch.zeros(H, dtype=torch.float32)
    if md.extra_topk:
        kw["extra_kv_cache"] = cache(md.extra_page_block_size, md.extra_kv_format or md.kv_format)
        kw["extra_indices"] = rows(T, md.extra_topk, dtype=torch.int32)
        if md.extra_kv_format is not None:
            kw["extra_kv_format"] = md.extra_kv_format
        if md.has_extra_topk_length:
            kw["extra_topk_length"] = torch.zeros(T, dtype=torch.int32)
    return kw


# every 61st deployment call of each (arch, precision): 61 is prime to the grid's strides (24
# token and SM counts per shape and flags), so the sample walks through the tokens, SM counts,
# optional inputs, shapes and formats alike (the test asserts it reaches all of them)
_REGISTRY_SAMPLE_STRIDE = 61


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
def test_registry_is_what_plans_select(monkeypatch, arch):
    """The AOT registry is what the dispatch selects: for a sample of the deployment calls of
    every compute path, a ``DecodePlan`` built as a call builds it (``validate_call`` on CPU
    tensors of that shape, for ``arch``, each SM count and its shared memory per SM) describes
    the call as the registry does, selects what ``registry_calls`` yields for it and launches
    only variants of ``registry_variants(arch)``. Both go through ``select_kernels``, so what
    this checks is the path from a call's tensors to that function's inputs (the metadata, SM
    count, shared memory); the selection itself is pinned by ``test_model1_decisions_*``, and
    is, for a call of one format, ``variants_for``'s, for a call of two formats
    (``DecodeMetadata.mixed``) ``variants_for``'s for each list in split mode, then a merge of
    all their splits."""
    from dispatch.api import validate_call

    _stub_kernels(monkeypatch)
    smem_per_sm = SMEM_PER_SM_BY_ARCH[arch]
    registry = set(registry_variants(arch))
    caches, seen = {}, set()
    for precision in precisions_for(arch):
        calls = zip(deployment_calls(precision, arch), registry_calls(precision, arch))
        for i, ((md, sms), (registry_md, splits, groups, two)) in enumerate(calls):
            if i % _REGISTRY_SAMPLE_STRIDE:
                continue
            assert registry_md == md
            call = validate_call(**_deployment_call_inputs(md, caches), precision=precision, for_plan=True,
                                 _target=(arch, sms, smem_per_sm))
            assert call.launch_metadata == md, (call.launch_metadata, md)
            plan = DecodePlan(call)
            what = (precision, sms, md)
            selection = select_kernels(md, arch, sms, smem_per_sm, precision)
            assert (plan.num_splits, selection.head_groups, selection.two_ctas_per_sm) == (splits, groups, two), what
            assert plan.split == selection.split and plan.variants == selection.variants, what
            if md.mixed:
                main_md, extra_md = md.list_calls()
                extra = selection.extra
                assert plan.extra_split == extra.split and splits == plan.split.num_splits + extra.split.num_splits
                assert plan.variants == (
                    variants_for(main_md, arch, plan.split.num_splits, groups, precision=precision,
                                 two_ctas_per_sm=two, split_mode=True)[0],
                    variants_for(extra_md, arch, extra.split.num_splits, extra.head_groups, precision=precision,
                                 two_ctas_per_sm=extra.two_ctas_per_sm, split_mode=True)[0],
                    KernelVariant(MergeConfig(has_sink=md.has_sink, split_batch=merge_batch_for(splits)), arch),
                ), what
            else:
                assert plan.extra_split is None and selection.extra is None, what
                assert plan.variants == variants_for(md, arch, splits, groups, precision=precision,
                                                     two_ctas_per_sm=two), what
            assert set(plan.variants) <= registry, what
            seen.update({("format", md.kv_format), ("format", md.extra_kv_format or md.kv_format),
                         ("mixed", md.mixed), ("pair", md.kv_format, md.extra_kv_format), ("precision", precision),
                         ("tokens", md.num_tokens), ("sms", sms), ("len", md.has_topk_length), ("sink", md.has_sink),
                         ("extra", md.extra_topk > 0), ("extra_len", md.has_extra_topk_length),
                         ("splits", splits > 1), ("groups", groups), ("two", two)})
    expected = ({("format", f) for f in FORMATS} | {("precision", p) for p in precisions_for(arch)}
                | {("tokens", t) for t in DEPLOYMENT_NUM_TOKENS} | {("sms", n) for n in DEPLOYMENT_SM_COUNTS}
                | {(flag, b) for flag in ("len", "sink", "extra", "extra_len", "splits", "mixed")
                   for b in (False, True)}
                | {("groups", g) for g in (1, 2)} | {("two", False)}
                | {("pair", s.kv_format, s.extra_kv_format) for s in DEPLOYMENT_SHAPES})
    assert expected <= seen, sorted(expected - seen)
    assert ("two", True) in seen or arch != "sm_90a"  # the H200's bounded "f16" kernels are sampled too


# ---------------------------------------------------------------------- calls of two cache formats
# the models' main + extra pairings of two formats (EXTRA_FORMATS), main first
MIXED_PAIRS = sorted((main, extra) for main, extras in EXTRA_FORMATS.items() for extra in extras if extra != main)
# (T, H, topk, extra_topk): decode batches, and one token against 8192 + 8192 entries
_MIXED_SHAPES = [(1, 16, 128, 64), (4, 64, 1152, 512), (64, 128, 128, 512), (300, 8, 128, 2048), (1, 128, 8192, 8192),
                 (1, 16, 8192, 8192)]
_TARGETS = [("sm_120a", 188, SM120_SMEM_PER_SM), ("sm_90a", 132, H200_SMEM_PER_SM)]


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
            sel = select_kernels(md, arch, sms, smem, precision)
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
    """The extra list's splits are capped at what the main list's leave of ``MAX_SPLITS`` (the
    merge kernel's threads): one token of 16 heads against 8192 + 8192 entries takes every
    split each list alone would, so the cap is what bounds it; one of 128 heads fills the GPU
    once per list well below it."""
    for arch, sms, smem in _TARGETS:
        md = _mixed_md(MODEL1, MODEL1_NVFP4.name, 1, 16, 8192, 8192)
        alone = [select_kernels(list_md, arch, sms, smem, "f16").num_splits for list_md in md.list_calls()]
        assert alone == [MAX_SPLITS, MAX_SPLITS], (arch, alone)
        sel = select_kernels(md, arch, sms, smem, "f16")
        assert sel.split.num_splits <= MAX_SPLITS - 1, (arch, sel.split)
        assert 1 <= sel.extra.split.num_splits <= MAX_SPLITS - sel.split.num_splits, (arch, sel)
        assert sel.num_splits <= MAX_SPLITS, (arch, sel)
        longer = select_kernels(_mixed_md(MODEL1, MODEL1_NVFP4.name, 1, 1, 8192, 65536), arch, sms, smem, "f16")
        assert 1 < longer.extra.split.num_splits and longer.num_splits <= MAX_SPLITS, (arch, longer)
    sel = select_kernels(_mixed_md(MODEL1, MODEL1_NVFP4.name, 1, 128, 8192, 8192), "sm_120a", 188, SM120_SMEM_PER_SM,
                         "f16")
    assert 1 < sel.split.num_splits and 1 < sel.extra.split.num_splits and sel.num_splits <= MAX_SPLITS, sel


def test_a_call_whose_extra_cache_has_the_main_format_is_one_call():
    """An extra cache of the main cache's format (named or not) is the extra list of one
    partial kernel, as before formats could differ."""
    for kv_format in (MODEL1, MODEL1_NVFP4.name, V41_FP8.name, "v41_fp8_inline"):
        for named in (None, kv_format):
            md = _mixed_md(kv_format, named, 4, 64, 128, 512, has_extra_len=True)
            assert not md.mixed
            sel = select_kernels(md, "sm_120a", 188, SM120_SMEM_PER_SM, "f16")
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
        select_kernels(md, "sm_120a", 188, SM120_SMEM_PER_SM, "f16", PlanOverrides(num_splits=2))
    _, call = _cpu_plan(monkeypatch, extra_kv_cache=NVFP4_CACHE, extra_indices=_EXTRA_IDX)
    assert call.launch_metadata.mixed
    with pytest.raises(ValueError, match=re.escape(message)):
        DecodePlan(call, PlanOverrides(num_splits=1))
    sel = select_kernels(md, "sm_120a", 188, SM120_SMEM_PER_SM, "f16", PlanOverrides(head_groups=2, num_stages=2))
    assert sel.head_groups == sel.extra.head_groups == 2
    assert [(v.config.head_groups, v.config.stages) for v in sel.variants[:2]] == [(2, 2), (2, 2)], sel.variants


@pytest.mark.parametrize("arch", ["sm_120a", "sm_121a", "sm_90a"])
def test_every_variant_a_mixed_deployment_call_selects_is_in_the_variant_space(arch):
    """Every deployment call of two formats (each registry pairing, every compute path both
    formats have) selects only variants of ``variant_space(arch)``: the AOT build has them."""
    space, smem, pairs = set(variant_space(arch)), SMEM_PER_SM_BY_ARCH[arch], {}
    for precision in precisions_for(arch):
        for md, sms in deployment_calls(precision, arch):
            if md.mixed:
                variants = select_kernels(md, arch, sms, smem, precision).variants
                assert len(variants) == 3 and set(variants) <= space, (precision, sms, md)
                pairs[md.kv_format, md.extra_kv_format] = pairs.get((md.kv_format, md.extra_kv_format), 0) + 1
    assert set(pairs) == {(s.kv_format, s.extra_kv_format) for s in DEPLOYMENT_SHAPES if s.extra_kv_format}, pairs


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
    from dispatch.plan import RUN_TENSORS

    plan, _ = _cpu_plan(monkeypatch, topk_length=torch.zeros(2, dtype=torch.int32))
    schema = {a.name: a.align for a in PARTIAL_ARGS}
    aligns = dict(zip((name for name, _ in RUN_TENSORS), plan._aligns))
    assert aligns["q"] == schema["q"] == 16 and aligns["kv_cache"] == schema["main_cache"] == 16
    assert aligns["out"] == schema["out"] == 8 and aligns["topk_length"] == schema["main_len"] == 4


def test_a_cache_hit_launches_what_plan_run_launches(monkeypatch):
    """The one-shot call's cache hit (``launch_laid_out``: the layout already compared) writes
    the same kernel arguments as ``plan.run``, and declines (returns False, launching nothing)
    a misaligned address or a scale ``validate_call`` would refuse."""
    plan, call = _cpu_plan(monkeypatch, topk_length=torch.zeros(2, dtype=torch.int32))
    launched = []
    monkeypatch.setattr(plan, "_bind_and_launch", launched.append)
    scratch = torch.empty(plan.scratch_bytes, dtype=torch.uint8) if plan.scratch_bytes else None
    plan.run(call.q, call.kv_cache, call.indices, out=call.out, lse=call.lse, scratch=scratch,
             topk_length=call.topk_length, sm_scale=0.05)
    given = tuple(getattr(call, name) for name, _ in RUN_TENSORS)
    assert plan.launch_laid_out(given, 0.05, scratch) and launched[0] == launched[1]
    assert plan.launch_laid_out(given, 1, scratch) and launched[2][len(given)] == 1 * LOG2_E
    for scale in (math.nan, math.inf, True, torch.tensor(0.05), "0.05"):
        assert not plan.launch_laid_out(given, scale, scratch)
    q = _misaligned(call.q, 2)
    assert q.stride() == call.q.stride() and not plan.launch_laid_out((q,) + given[1:], 0.05, scratch)
    assert len(launched) == 3


def test_the_one_shot_call_keys_its_tensors_in_run_order(monkeypatch):
    """``one_shot_decode`` writes run()'s tensor order out by hand (its hot path): the tuple it
    keys and launches must be ``RUN_TENSORS``' order."""
    from dispatch import api, plan_cache

    seen = []

    def capture(tensors, *names):
        seen.append(tensors)
        raise AttributeError("captured")  # then the full validation, which refuses the markers

    monkeypatch.setattr(api, "layout_key", capture)
    markers = {name: object() for name, _ in RUN_TENSORS}
    with pytest.raises(InvalidDecodeInput):
        sparse_mla_decode(markers["q"], markers["kv_cache"], markers["indices"],
                          **{name: m for name, m in markers.items() if name not in ("q", "kv_cache", "indices")})
    assert seen and all(t is markers[name] for t, (name, _) in zip(seen[0], RUN_TENSORS))
    assert len(seen[0]) == len(RUN_TENSORS) and plan_cache.layout_key is not capture


def test_plan_run_refuses_lengths_that_are_not_one_int_per_token_in_order(monkeypatch):
    plan, call = _cpu_plan(monkeypatch, topk_length=torch.zeros(2, 2, dtype=torch.int32), **_BATCHED)
    scratch = torch.empty(plan.scratch_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"DecodePlan.run: topk_length has shape \[2, 2\], strides \[4, 1\]"):
        plan.run(call.q, call.kv_cache, call.indices, out=call.out, lse=call.lse, scratch=scratch,
                 topk_length=_STRIDED_ROWS)


def test_run_and_bind_take_the_planned_tensors_by_name():
    import inspect

    from dispatch.plan import RUN_TENSORS, DecodePlan

    for method in (DecodePlan.run, DecodePlan.bind):
        params = inspect.signature(method).parameters
        assert all(name in params for name, _ in RUN_TENSORS), method


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
