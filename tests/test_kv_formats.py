"""The public ``dispatch.kv_formats`` module (CPU): its formats and their widths, ``pack`` and
``unpack`` round trips and refusals (``pack_latent`` refusing the same by one rule), and the
Inf encoding of FlashInfer's V4.1 writers."""

import math
import re

import pytest
import torch

from cute_kernels.sparse_mla_decode.cache_view import read_cache_view
from cute_kernels.sparse_mla_decode.cache_writers import pack_latent
from cute_kernels.sparse_mla_decode.e2m1 import e2m1_decode
from cute_kernels.sparse_mla_decode.kv_format import (
    EXTRA_FORMATS, FORMATS, GLM_NOPE_FP8, MODEL1_FP8, V32_FP8,
)
from dispatch import InvalidDecodeInput, kv_formats, sparse_mla_decode
from tests.dispatch_inputs import MODEL1


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
    if not FORMATS[kv_format].main:  # read only as an extra cache, beside a main cache it pairs with
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


# options neither packer takes: (kv_format, option, value, what the refusal says)
_BAD_OPTIONS = [
    ("model1_fp8", "block_stride", 37376.0, "block_stride must be None (the format's default) or a positive int "
                                            "(bytes), got 37376.0 (float)"),
    ("model1_fp8", "block_stride", "37376", "block_stride must be None (the format's default) or a positive int "
                                            "(bytes), got '37376' (str)"),
    ("model1_fp8", "block_stride", True, "block_stride must be None (the format's default) or a positive int (bytes), "
                                         "got True (bool)"),
    ("model1_fp8", "block_stride", 0, "got 0 (int)"),
    ("glm_nope_fp8", "row_stride", 0, "row_stride must be None (the format's default) or a positive int (bytes), got "
                                      "0 (int)"),
    ("glm_nope_fp8", "row_stride", "656", "row_stride must be None (the format's default) or a positive int (bytes), "
                                          "got '656' (str)"),
    ("glm_nope_fp8", "row_stride", 656.0, "got 656.0 (float)"),
    ("glm_nope_fp8", "row_stride", torch.tensor(656), "row_stride must be None (the format's default) or a positive "
                                                      "int (bytes), got tensor(656) (Tensor)"),
    ("model1_fp8", "fill", True, "fill must be an int in [0, 255] (the byte written where no data is), got True"),
    ("model1_fp8", "writer", ["vllm"], "writer must be one of ('vllm', 'flashmla') for model1_fp8, got ['vllm']"),
    ("model1_fp8", "writer", "", "writer must be one of ('vllm', 'flashmla') for model1_fp8, got ''"),
]
# latents neither packer takes: (latent, what the refusal says)
_BAD_LATENTS = [
    (torch.zeros(1, 16, 512, dtype=torch.int32), "latent must be a floating-point torch.Tensor, got torch.int32"),
    (torch.zeros(0, 16, 512), "latent of shape [0, 16, 512] holds no token"),
    (torch.zeros(1, 16, 512).to_sparse(), "latent is a sparse tensor (layout torch.sparse_coo)"),
    ([[0.0] * 512] * 16, "latent must be a floating-point torch.Tensor, got list"),
]
_PACKERS = {"pack": lambda latent, kv_format, **kw: kv_formats.pack(latent, kv_format, 16, **kw),
            "pack_latent": lambda latent, kv_format, **kw: pack_latent(latent, kv_format, **kw)}


@pytest.mark.parametrize("packer", sorted(_PACKERS))
@pytest.mark.parametrize("kv_format,option,value,message", _BAD_OPTIONS)
def test_both_packers_refuse_an_option_by_one_rule(packer, kv_format, option, value, message):
    """``pack`` and ``pack_latent`` refuse the same options with the same words
    (``check_pack_options``): a byte count is a positive int, never a float, a string, a bool
    or a tensor converted; 0 is no row stride (not "the default")."""
    latent = torch.randn(2, 16, FORMATS[kv_format].d_qk)
    with pytest.raises(ValueError) as info:
        _PACKERS[packer](latent, kv_format, **{option: value})
    assert message in str(info.value)


@pytest.mark.parametrize("packer", sorted(_PACKERS))
@pytest.mark.parametrize("latent,message", _BAD_LATENTS, ids=["integer", "empty", "sparse", "list"])
def test_both_packers_refuse_a_latent_by_one_rule(packer, latent, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _PACKERS[packer](latent, "model1_fp8")
