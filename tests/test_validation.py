"""Validation of a call's inputs (CPU): every input the public API refuses, each refusal's
message starting with the model type and the call's shape, the table of ``docs/api.md`` that
lists them, and a plan of no token."""

import math

import pytest
import torch

from cute_kernels.sparse_mla_decode.kv_format import GLM_NOPE_FP8, MODEL1_FP8, MODEL1_NVFP4, V32_FP8, V41_FP8, V41_NVFP4
from dispatch import InvalidDecodeInput, sparse_mla_decode
from dispatch.policy.call_metadata import GENERIC_MODEL_TYPE
from dispatch.tools.sample_inputs import make_cache, make_indices
from tests.dispatch_inputs import (
    GLM_CACHE, GLM_POOL_CACHE, NVFP4_CACHE, SM120_TARGET, V32_CACHE, V41_CACHE, V41_NVFP4_CACHE, _BATCHED, _EXTRA_IDX,
    _STRIDED_ROWS,
    _inputs, _misaligned,
)


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

Q576 = torch.randn(2, 16, 576).to(torch.bfloat16)
# the other formats' valid inputs, as a case's overrides
V32 = dict(q=Q576, kv_cache=V32_CACHE)
NVFP4 = dict(kv_cache=NVFP4_CACHE)
V41 = dict(kv_cache=V41_CACHE)

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
     "precision 'bf16' does not read v41_nvfp4 caches (e2m1 values are read by the \"f16\" path only): use one of "
     "('f16',)"),
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
    ("out heads overlap", {}, dict(out=torch.empty(2 * 16 * 512, dtype=torch.bfloat16).as_strided((2, 16, 512),
                                                                                                  (8192, 256, 1))),
     "out of shape [2, 16, 512] and strides [8192, 256, 1] overlaps itself"),
    ("lse tokens overlap", {}, dict(lse=torch.empty(17).as_strided((2, 16), (1, 1))),
     "lse of shape [2, 16] and strides [1, 1] overlaps itself"),
    ("indices misaligned", dict(indices=_misaligned(torch.zeros(2, 128, dtype=torch.int32), 2)), {},
     "indices data pointer must be 4-byte aligned"),
    ("length misaligned", {}, dict(topk_length=_misaligned(torch.zeros(2, dtype=torch.int32), 1)),
     "topk_length data pointer must be 4-byte aligned"),
    ("sink misaligned", {}, dict(attn_sink=_misaligned(torch.zeros(16), 3)), "attn_sink data pointer must be 4-byte aligned"),
    ("lse misaligned", {}, dict(lse=_misaligned(torch.zeros(2, 16), 2)), "lse data pointer must be 4-byte aligned"),
    ("q sparse", dict(q=torch.randn(2, 16, 512).to(torch.bfloat16).to_sparse()), {},
     "q is a sparse tensor (layout torch.sparse_coo): the kernels read dense (strided) memory"),
    ("sink sparse", {}, dict(attn_sink=torch.zeros(16).to_sparse()), "attn_sink is a sparse tensor"),
    ("extra cache float16", {}, dict(extra_kv_cache=torch.zeros(2, 64, 1, 292, dtype=torch.float16),
                                     extra_indices=_EXTRA_IDX),
     "extra_kv_cache must be uint8 or float8_e4m3fn, got float16"),
    ("sm_scale bool", {}, dict(sm_scale=True), "sm_scale must be a real Python number"),
    ("sm_scale int past float range", {}, dict(sm_scale=10**400), "sm_scale must be a real Python number"),
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
     "precision 'mxf8' does not read v32_fp8 caches (the block-scaled MMA takes UE8M0 scale bytes, not fp32 scales): "
     "use one of ('bf16', 'f16', 'fp8')"),
    ("valid but on cpu", {}, {}, "the kernels run on CUDA devices only"),
    ("valid V3.2 call on cpu", V32, {}, "the kernels run on CUDA devices only"),
    ("valid GLM-5.3 call on cpu", dict(kv_cache=GLM_POOL_CACHE), dict(kv_format="glm_nope_fp8"),
     "the kernels run on CUDA devices only"),
]


# refusals of a call whose launch the GPU cannot make: valid but for that, so raised here with
# the CPU planning aid (``validate_call``'s ``_target``) instead of the device check
PAST_THE_GPU = [
    ("heads past the merge grid",
     lambda: dict(q=torch.empty(1, 65536, 512, dtype=torch.bfloat16), indices=torch.zeros(1, 128, dtype=torch.int32),
                  extra_kv_cache=NVFP4_CACHE, extra_indices=torch.zeros(1, 64, dtype=torch.int32)),
     "q of shape [1, 65536, 512]: the merge kernel's grid would be (1, 65536, 1), its y the call's heads (65,536), "
     "past CUDA's limit of 65,535 on a grid's y: a call that merges (two cache formats, or more than one split) "
     "takes at most 65,535 heads"),
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


@pytest.mark.parametrize("name,make,message", PAST_THE_GPU, ids=[b[0] for b in PAST_THE_GPU])
def test_a_launch_past_the_gpus_limits_is_refused_with_the_call_shape(name, make, message):
    from dispatch import validate_call

    inputs = _inputs()
    inputs.update(make())
    with pytest.raises(InvalidDecodeInput) as info:
        validate_call(**inputs, _target=SM120_TARGET)
    assert info.value.problem == message
    assert str(info.value).startswith(MODEL1_FP8.model_type + ": num_tokens=")


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
    assert table == {row[0]: row[-1] for row in BAD + PAST_THE_GPU}


def test_a_plan_of_no_token_is_refused():
    from dispatch import plan_sparse_mla_decode

    base = _inputs(T=0)
    with pytest.raises(InvalidDecodeInput, match="a plan needs at least one token; sparse_mla_decode returns at once"):
        plan_sparse_mla_decode(base["q"], base["kv_cache"], base["indices"])
