"""The cache formats' helpers (CPU): every format's packer against bytes computed here from the
byte-level specification (pure Python: struct and exact e4m3 rounding, none of the packer's
helpers), round trips, the views ``read_cache_view`` accepts and refuses, and the test inputs
``dispatch.testing`` makes."""

import math
import struct
from bisect import bisect_left
from fractions import Fraction

import pytest
import torch

from cute_kernels.sparse_mla_decode.cache_format import (
    WRITERS, CacheLayoutError, decode_scales, default_block_stride, format_of, gather_slot_parts, gather_slots,
    pack_latent, page_division_magic, quantize_latent, read_cache_view, unpack_cache,
)
from cute_kernels.sparse_mla_decode.kv_format import FORMATS, get_format
from dispatch.testing import make_cache, view_width
from tests.fp_spec import e4m3_value, f32
from tests.tolerances import seed_for

MODEL1_TOKEN_BYTES = 584
FILL = 0xA5  # the packer's filler in the byte tests: no data byte of the test latents is checked against it


# ---------------------------------------------------------------------- the specification, in plain Python
_E4M3_POSITIVE = [e4m3_value(c) for c in range(0x7F)]  # codes 0..0x7E: increasing, 0 .. 448


def e4m3_code(x: float) -> int:
    """The e4m3fn byte of ``x`` as a satfinite round-to-nearest-even conversion writes it."""
    if math.isnan(x):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = min(abs(x), 448.0)
    i = bisect_left(_E4M3_POSITIVE, a)
    if i < len(_E4M3_POSITIVE) and _E4M3_POSITIVE[i] == a:
        return sign | i
    lo, hi = i - 1, i  # _E4M3_POSITIVE[lo] < a < _E4M3_POSITIVE[hi]
    d_lo, d_hi = Fraction(a) - Fraction(_E4M3_POSITIVE[lo]), Fraction(_E4M3_POSITIVE[hi]) - Fraction(a)
    return sign | (lo if d_lo < d_hi or (d_lo == d_hi and lo % 2 == 0) else hi)


def pow2_ceil(r: float) -> float:
    """2**ceil(log2(r)) for r > 0, exactly."""
    m, e = math.frexp(r)  # r = m * 2**e, m in [0.5, 1)
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


def expected_group(kv_format: str, writer: str, xs: list):
    """(stored scale bytes, e4m3 codes; None for a NaN code of either sign) of one scale group of
    float32 values ``xs`` as ``writer`` writes ``kv_format`` (the recipes of the formats' note:
    FlashMLA pow2-ceil with the ratio floor, vLLM's V4 compressor pow2-ceil with the amax floor,
    vLLM's fp8_ds_mla max(amax / 448, FLT_MIN) and x / s, SGLang amax / 448 and x * (1 / s), b12x's
    GLM-5.3 writer amax * fl32(1 / 448) (1 for an all-zero group) and x * (1 / s))."""
    amax = max(abs(x) for x in xs)
    fmt = get_format(kv_format)
    if writer == "flashmla":
        s = pow2_ceil(max(f32(amax / 448), f32(1e-4)))
    elif writer == "vllm" and fmt.scale_type == "ue8m0":
        s = pow2_ceil(f32(max(amax, f32(1e-4)) / 448))
    elif writer == "vllm":
        s = max(f32(amax / 448), 2.0**-126)
    elif writer == "sglang":
        s = f32(amax / 448)
    elif writer == "b12x":
        s = f32(amax * f32(1 / 448)) if amax > 0 else 1.0
    else:
        raise AssertionError(writer)
    if writer in ("sglang", "b12x"):
        codes = [None] * len(xs) if s == 0 else [e4m3_code(f32(x * f32(1 / s))) for x in xs]
    else:
        codes = [e4m3_code(f32(x / s)) for x in xs]
    if fmt.scale_type == "ue8m0":
        m, e = math.frexp(s)
        assert m == 0.5
        scale = bytes([e - 1 + 127])
    else:
        scale = struct.pack("<f", s)
    return scale, codes


def bf16_bytes(x: float) -> bytes:
    """The little-endian bf16 of ``x`` (a bf16 value)."""
    b = struct.pack("<f", x)
    assert b[:2] == b"\0\0", x
    return b[2:]


def special_groups(group: int, count: int, gen: torch.Generator) -> list:
    """``count`` scale groups of ``group`` float32 values, cycling through the cases the writers
    treat differently: all zeros; amax exactly 448 with e4m3 ties after a scale of 1 (17 between
    16 and 18, 19 between 18 and 20, 2**-10 between 0 and 2**-9); amax 450 and amax one float32
    below 448 (non-power-of-two scales a hair from 1); a negative amax; amax 1e-6 (every floor);
    float32 subnormals (FLT_MIN, vLLM's floor); values over 40 binades; values whose quotient by
    a scale that is not a power of two falls on or next to an e4m3 tie (where x / s and
    x * (1 / s) part)."""
    out = []
    s_odd = f32(f32(300.7) / 448)
    near_ties = [f32(c * s_odd * (1 + d * 2.0**-23)) for c in (17, 19, 9.5, 35, 72, 136, 2.5 * 2.0**-9, 0.1875)
                 for d in (-2, -1, 0, 1, 2)]
    for i in range(count):
        rnd = (torch.randn(group, generator=gen) * torch.exp2(torch.randint(-6, 7, (1,), generator=gen).float()))
        rnd = [f32(v) for v in rnd.tolist()]
        kind = i % 9
        if kind == 0:
            g = [0.0] * group
        elif kind == 1:
            g = [448.0, 17.0, 19.0, -17.0, 2.0**-10, 3 * 2.0**-10, -5 * 2.0**-10, 0.0] + [v / 4 for v in rnd[8:]]
        elif kind == 2:
            g = [450.0] + rnd[1:]
        elif kind == 3:
            g = [448.0 - 2.0**-15] + rnd[1:]  # the float32 below 448
        elif kind == 4:
            g = [v / 8 for v in rnd[:-1]] + [-300.0]
        elif kind == 5:
            top = max(abs(v) for v in rnd)
            g = [f32(v / top * 1e-6) for v in rnd]
        elif kind == 6:
            g = [f32(v * 1e-40) for v in rnd]
        elif kind == 7:
            g = [f32(v * 2.0 ** (j % 41 - 30)) for j, v in enumerate(rnd)]
        else:
            g = [f32(300.7)] + near_ties + [v / 16 for v in rnd[1 + len(near_ties):]]
        out.append(g[:group])
    return out


def make_test_latent(kv_format: str, num_blocks: int, page: int, gen: torch.Generator) -> torch.Tensor:
    """A float32 latent ``[num_blocks, P, d_qk]`` of ``special_groups`` (sglang's all-zero group
    included) and bf16 rope values."""
    fmt = get_format(kv_format)
    groups = special_groups(fmt.scale_group, num_blocks * page * fmt.num_scales, gen)
    nope = torch.tensor(groups, dtype=torch.float32).reshape(num_blocks, page, fmt.nope_dims)
    rope = (torch.randn(num_blocks, page, fmt.rope_dims, generator=gen) * 3).bfloat16().float()
    return torch.cat([nope, rope], dim=-1)


def expected_bytes(latent: torch.Tensor, kv_format: str, writer: str, block_stride: int, row_stride: int | None):
    """(the bytes of the packed buffer, the positions whose byte must be an e4m3 NaN of either
    sign) computed from the specification."""
    fmt = get_format(kv_format)
    nb, page, _ = latent.shape
    pitch = row_stride or (fmt.row_pitches[0] if fmt.inline else MODEL1_TOKEN_BYTES)
    buf = bytearray([FILL]) * (nb * block_stride)
    nan_at = []
    for b in range(nb):
        for t in range(page):
            x = latent[b, t].tolist()
            if fmt.inline:
                row = b * block_stride + t * pitch
                nope_at, scale_at, rope_at = row, row + 512, row + 528
            else:  # MODEL1: data row t at t * 576, its footer record at P * 576 + 8 t
                row = b * block_stride + t * 576
                nope_at, scale_at, rope_at = row, b * block_stride + page * 576 + 8 * t, row + 448
            for g in range(fmt.num_scales):
                xs = x[g * fmt.scale_group:(g + 1) * fmt.scale_group]
                scale, codes = expected_group(kv_format, writer, xs)
                at = scale_at + g * len(scale)
                buf[at:at + len(scale)] = scale
                for j, c in enumerate(codes):
                    pos = nope_at + g * fmt.scale_group + j
                    if c is None:
                        nan_at.append(pos)
                    else:
                        buf[pos] = c
            for r in range(fmt.rope_dims):
                buf[rope_at + 2 * r:rope_at + 2 * r + 2] = bf16_bytes(x[fmt.nope_dims + r])
    return buf, nan_at


def storage_bytes(cache: torch.Tensor) -> bytes:
    return bytes(cache.untyped_storage().cpu())


WRITER_CASES = [(f, w) for f in FORMATS for w in WRITERS[f]]
STRIDE_CASES = {  # (row stride, extra bytes of block padding); None: the format's default
    "model1_fp8": [(None, 0), (None, 48)],
    "v32_fp8": [(None, 0), (672, 32), (1024, 0)],
    "glm_nope_fp8": [(None, 0), (528, 16), (656, 0), (656, 160), (672, 0)],
}


# ---------------------------------------------------------------------- packers against the specification
@pytest.mark.parametrize("kv_format,writer", WRITER_CASES)
def test_packer_bytes_match_the_specification(kv_format, writer):
    """Every byte of a packed buffer (data, scales, rope, filler of padding, pad bytes and wide
    rows) as the specification writes it, for every writer's recipe, the row strides and block
    paddings of the format, and groups of all zeros, amax at and around 448, ties, floors."""
    fmt = get_format(kv_format)
    gen = torch.Generator().manual_seed(seed_for(f"packer bytes {kv_format} {writer}"))
    page = 9
    latent = make_test_latent(kv_format, 2, page, gen)
    for row_stride, pad in STRIDE_CASES[kv_format]:
        pitch = row_stride or (fmt.row_pitches[0] if fmt.inline else MODEL1_TOKEN_BYTES)
        if fmt.inline:
            used = (page - 1) * pitch + fmt.row_bytes
        else:
            used = page * MODEL1_TOKEN_BYTES
        block_stride = -(-used // 16) * 16 + pad
        cache = pack_latent(latent, kv_format, writer=writer, block_stride=block_stride, row_stride=row_stride,
                            fill=FILL)
        want, nan_at = expected_bytes(latent, kv_format, writer, block_stride, row_stride)
        got = bytearray(storage_bytes(cache))
        assert len(got) >= len(want) and all(b == FILL for b in got[len(want):]), "bytes past the last block"
        for pos in nan_at:
            assert got[pos] & 0x7F == 0x7F, f"byte {pos}: an e4m3 NaN expected, got {got[pos]:#x}"
            got[pos] = want[pos]
        diff = [i for i in range(len(want)) if got[i] != want[i]]
        assert not diff, (f"{kv_format} {writer} row_stride={row_stride} block_stride={block_stride}: bytes differ "
                          f"at {diff[:8]}: got {[got[i] for i in diff[:8]]}, want {[want[i] for i in diff[:8]]}")
        assert (writer == "sglang") == bool(nan_at)  # only SGLang's recipe turns an all-zero group into NaN


def test_the_test_groups_reach_every_recipe_branch():
    """The byte test's groups do reach what they are there for (else it could pass vacuously)."""
    gen = torch.Generator().manual_seed(seed_for("groups reach"))
    groups = special_groups(128, 16, gen)
    zero = groups[0]
    assert expected_group("v32_fp8", "vllm", zero)[0] == struct.pack("<f", 2.0**-126)  # FLT_MIN floor
    assert expected_group("v32_fp8", "flashmla", zero)[0] == struct.pack("<f", 2.0**-13)  # ratio floor 1e-4
    assert expected_group("model1_fp8", "vllm", zero[:64])[0] == bytes([127 - 22])  # amax floor 1e-4
    assert expected_group("model1_fp8", "flashmla", zero[:64])[0] == bytes([127 - 13])
    assert expected_group("v32_fp8", "sglang", zero) == (b"\0\0\0\0", [None] * 128)
    ties = groups[1]
    for w in ("vllm", "sglang", "flashmla"):
        scale, codes = expected_group("v32_fp8", w, ties)
        assert struct.unpack("<f", scale)[0] == 1.0
        assert codes[:8] == [0x7E, 0x58, 0x5A, 0xD8, 0x00, 0x02, 0x82, 0x00]  # 448, 16, 20, -16, 0, 2^-8, -2^-8, 0
    s450 = struct.unpack("<f", expected_group("v32_fp8", "vllm", groups[2])[0])[0]
    assert s450 == f32(450 / 448) and s450 != 1.0 and expected_group("v32_fp8", "vllm", groups[2])[1][0] == 0x7E
    assert expected_group("v32_fp8", "flashmla", groups[2])[0] == struct.pack("<f", 2.0)
    assert 0 < struct.unpack("<f", expected_group("v32_fp8", "vllm", groups[3])[0])[0] < 1.0
    tiny_vllm = struct.unpack("<f", expected_group("v32_fp8", "vllm", groups[6])[0])[0]
    assert tiny_vllm == 2.0**-126  # subnormal inputs: the FLT_MIN floor
    assert 0 < struct.unpack("<f", expected_group("v32_fp8", "sglang", groups[6])[0])[0] < 2.0**-126  # no floor
    near = groups[8]  # the same scale for both recipes, codes that part x / s from x * (1 / s)
    assert expected_group("v32_fp8", "vllm", near)[0] == expected_group("v32_fp8", "sglang", near)[0]
    assert expected_group("v32_fp8", "vllm", near)[1] != expected_group("v32_fp8", "sglang", near)[1]


def test_quantize_latent_refuses_unknown_writers_and_widths():
    with pytest.raises(ValueError, match="writer must be one of"):
        quantize_latent(torch.zeros(2, 576), "v32_fp8", writer="b13x")
    with pytest.raises(ValueError, match="model1_fp8 latent rows must be 512"):
        quantize_latent(torch.zeros(2, 576), "model1_fp8")
    with pytest.raises(ValueError, match="kv_format must be one of"):
        quantize_latent(torch.zeros(2, 512), "v4_nvfp4")


@pytest.mark.parametrize("kv_format", sorted(FORMATS))
def test_pack_latent_refuses_bad_strides(kv_format):
    fmt = get_format(kv_format)
    latent = torch.zeros(2, 4, fmt.d_qk)
    if fmt.inline:
        with pytest.raises(ValueError, match="row_stride"):
            pack_latent(latent, kv_format, row_stride=fmt.row_bytes + 8)
        with pytest.raises(ValueError, match="row_stride"):
            pack_latent(latent, kv_format, row_stride=fmt.row_bytes - 16)
    used = 3 * (fmt.row_pitches[0] if fmt.inline else 0) + (fmt.row_bytes if fmt.inline else 4 * 584)
    with pytest.raises(ValueError, match="block_stride"):
        pack_latent(latent, kv_format, block_stride=used - 16)
    with pytest.raises(ValueError, match="block_stride"):
        pack_latent(latent, kv_format, block_stride=used + 8)


def test_scale_records_decode_as_specified():
    """UE8M0 byte b is 2**(b - 127) (byte 0: 2**-127, not 0; 255: 2**128, infinity as a
    float32); FP32 scales are little-endian float32 read as they are (a subnormal one included)."""
    ue = torch.tensor([[0, 1, 126, 127, 128, 254, 255]], dtype=torch.uint8)
    want = [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127, math.inf]
    assert decode_scales(get_format("model1_fp8"), ue).tolist() == [want]
    vals = [1.0, 2.0**-126, 1.5e-39, 448.0 / 3]
    raw = torch.tensor([list(struct.pack("<4f", *vals))], dtype=torch.uint8)
    assert decode_scales(get_format("v32_fp8"), raw).tolist() == [[f32(v) for v in vals]]


# ---------------------------------------------------------------------- round trips
def _unpacked_from_the_spec(latent, kv_format, writer):
    """(float64 [nb, P, d_qk]: each element's code decoded times its scale, exact in float64,
    NaN where the writer writes NaN; the scales [nb, P, groups]) from the specification's recipes."""
    fmt = get_format(kv_format)
    out = torch.empty(latent.shape, dtype=torch.float64)
    scales = torch.empty(*latent.shape[:2], fmt.num_scales, dtype=torch.float64)
    for b in range(latent.shape[0]):
        for t in range(latent.shape[1]):
            x = latent[b, t].tolist()
            for g in range(fmt.num_scales):
                scale, codes = expected_group(kv_format, writer, x[g * fmt.scale_group:(g + 1) * fmt.scale_group])
                s = 2.0 ** (scale[0] - 127) if len(scale) == 1 else struct.unpack("<f", scale)[0]
                scales[b, t, g] = s
                for j, c in enumerate(codes):
                    out[b, t, g * fmt.scale_group + j] = math.nan if c is None else e4m3_value(c) * s
            out[b, t, fmt.nope_dims:] = torch.tensor(x[fmt.nope_dims:], dtype=torch.float64)
    return out, scales


@pytest.mark.parametrize("kv_format,writer", WRITER_CASES)
def test_round_trip_every_writer_and_stride(kv_format, writer):
    """unpack(pack(latent)) is the specification's dequantization (float32 of code x scale),
    whatever the row and block strides; within e4m3's half step of the latent; the rope exact."""
    fmt = get_format(kv_format)
    gen = torch.Generator().manual_seed(seed_for(f"round trip {kv_format} {writer}"))
    latent = (torch.randn(3, 5, fmt.d_qk, generator=gen)
              * torch.exp2(torch.randint(-10, 11, (3, 5, 1), generator=gen).float())).bfloat16().float()
    want, scales = _unpacked_from_the_spec(latent, kv_format, writer)
    for row_stride, pad in STRIDE_CASES[kv_format]:
        pitch = row_stride or (fmt.row_pitches[0] if fmt.inline else None)
        block_stride = default_block_stride(fmt, 5, pitch) + pad
        packed = pack_latent(latent, kv_format, writer=writer, row_stride=row_stride, block_stride=block_stride)
        step = pitch or fmt.bytes_per_token  # the view of the rows (the packer's own: test_the_packers_own_view_reads_back)
        cache = torch.as_strided(packed, (3, 5, 1, view_width(kv_format, step)), (block_stride, step, step, 1))
        back = unpack_cache(cache, kv_format)
        assert back.dtype == torch.float32 and back.shape == latent.shape
        # float32 code x scale: exact for power-of-two scales, one float32 rounding otherwise
        assert torch.allclose(back.double(), want, rtol=2.0**-24, atol=0), (row_stride, pad)
        assert torch.equal(back[..., fmt.nope_dims:], latent[..., fmt.nope_dims:])
        nope, x = back[..., :fmt.nope_dims].double(), latent[..., :fmt.nope_dims].double()
        groups = x.reshape(3, 5, fmt.num_scales, fmt.scale_group)
        half_step = scales[..., None] * 2.0**-10  # half of e4m3's subnormal step, scaled
        err = (nope - x).abs().reshape(groups.shape)
        assert (err <= (groups.abs() * 2.0**-4 + half_step) * (1 + 2.0**-20)).all()


@pytest.mark.parametrize("kv_format", sorted(FORMATS))
def test_group_amax_uses_the_range(kv_format):
    """Each group's largest code: exactly 448 for the arbitrary FP32 scales (amax / 448), in
    [224, 448] for the power-of-two ones."""
    fmt = get_format(kv_format)
    gen = torch.Generator().manual_seed(seed_for(f"amax {kv_format}"))
    latent = (torch.randn(4, 16, fmt.d_qk, generator=gen) * 3).bfloat16()
    for writer in WRITERS[kv_format]:
        codes, scales, _ = quantize_latent(latent, kv_format, writer)
        top = codes.float().abs().reshape(4, 16, fmt.num_scales, fmt.scale_group).amax(-1)
        if writer in ("vllm", "sglang", "b12x") and fmt.scale_type == "fp32":
            assert (top == 448).all()
            assert (torch.frexp(scales).mantissa != 0.5).any()  # not powers of two
        else:
            assert ((top >= 224) & (top <= 448)).all()
            assert (torch.frexp(scales).mantissa == 0.5).all()


# ---------------------------------------------------------------------- views
def _same_latent_caches(kv_format, gen_seed, **kw):
    return make_cache(5, 16, device="cpu", kv_format=kv_format, gen=torch.Generator().manual_seed(gen_seed), **kw)


@pytest.mark.parametrize("kv_format", sorted(FORMATS))
@pytest.mark.parametrize("layout", ["nhd", "hnd", "flat", "fp8"])
def test_every_view_of_every_format_reads_the_same(kv_format, layout):
    fmt = get_format(kv_format)
    seed = seed_for(f"views {kv_format}")
    ref = unpack_cache(_same_latent_caches(kv_format, seed), kv_format)
    view = _same_latent_caches(kv_format, seed, layout=layout)
    assert torch.equal(unpack_cache(view, kv_format), ref)
    info = read_cache_view(view, kv_format)
    assert info.fmt is fmt and info.page_block_size == 16 and info.num_slots == 80
    assert info.block_stride == default_block_stride(fmt, 16)
    assert info.row_stride == (fmt.row_pitches[0] if fmt.inline else fmt.bytes_per_token)


@pytest.mark.parametrize("kv_format,row_stride,gap", [
    ("v32_fp8", 656, 0), ("v32_fp8", 672, 0), ("v32_fp8", 672, 48), ("v32_fp8", 1024, 4096),
    ("glm_nope_fp8", 528, 0), ("glm_nope_fp8", 528, 16), ("glm_nope_fp8", 656, 0), ("glm_nope_fp8", 656, 400),
    ("glm_nope_fp8", 672, 32), ("model1_fp8", None, 0), ("model1_fp8", None, 1024),
])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_padded_rows_and_page_gaps_read_the_same(kv_format, row_stride, gap, layout):
    """Wide pitches (GLM-5.3's 528-byte rows in 656-byte pool rows), padded rows and page gaps
    (block stride past the block's bytes) read as the packed cache; every byte that is not data
    is 0xFF (NaN) in ``make_cache``, so a reader that touched one would return NaN."""
    fmt = get_format(kv_format)
    seed = seed_for(f"strides {kv_format}")
    ref = unpack_cache(_same_latent_caches(kv_format, seed), kv_format)
    pitch = row_stride or fmt.bytes_per_token
    block_stride = default_block_stride(fmt, 16, row_stride) + gap
    cache = _same_latent_caches(kv_format, seed, row_stride=row_stride, block_stride=block_stride, layout=layout)
    assert cache.shape[-1] == view_width(kv_format, pitch)
    view = read_cache_view(cache, kv_format)
    assert (view.block_stride, view.row_stride, view.page_block_size) == (block_stride, pitch, 16)
    back = unpack_cache(cache, kv_format)
    assert torch.isfinite(back).all() and torch.equal(back, ref)
    slots = torch.tensor([[0, 79, 16], [15, 17, 17]])
    assert torch.equal(gather_slots(view, slots), ref.reshape(80, fmt.d_qk)[slots])


@pytest.mark.parametrize("kv_format,row_stride", [("v32_fp8", 656), ("v32_fp8", 672), ("glm_nope_fp8", 528),
                                                   ("glm_nope_fp8", 656), ("glm_nope_fp8", 672),
                                                   ("model1_fp8", None)])
def test_the_packers_own_view_reads_back(kv_format, row_stride):
    """``pack_latent``'s result (``[num_blocks, P, 1, W]``, W its row stride) is a cache view
    ``read_cache_view`` accepts, as its docstring says."""
    fmt = get_format(kv_format)
    latent = torch.randn(2, 4, fmt.d_qk, generator=torch.Generator().manual_seed(3)).bfloat16()
    cache = pack_latent(latent, kv_format, row_stride=row_stride)
    ref = unpack_cache(pack_latent(latent, kv_format), kv_format)
    assert torch.equal(unpack_cache(cache, kv_format), ref)


def test_glm_pool_rows_are_read_as_528_byte_rows():
    """GLM-5.3 rows in a 656-byte pool: a [.., 656] view and a [.., 528] view of the same
    bytes (token stride 656) read the same; the 128 bytes past each row are never read."""
    cache = make_cache(3, 8, device="cpu", kv_format="glm_nope_fp8", row_stride=656,
                       gen=torch.Generator().manual_seed(seed_for("glm pool")))
    assert cache.shape[-1] == 656
    buf = torch.as_strided(cache, (3 * 8 * 656,), (1,))
    assert (torch.as_strided(cache, (3, 8, 128), (8 * 656, 656, 1), 528) == 0xFF).all()  # the tails: NaN
    narrow = torch.as_strided(buf, (3, 8, 1, 528), (8 * 656, 656, 656, 1))
    assert torch.equal(unpack_cache(narrow, "glm_nope_fp8"), unpack_cache(cache, "glm_nope_fp8"))
    assert torch.isfinite(unpack_cache(cache, "glm_nope_fp8")).all()


def test_format_of_names_or_refuses_by_width():
    assert format_of(torch.zeros(2, 4, 1, 584, dtype=torch.uint8), None).name == "model1_fp8"
    assert format_of(torch.zeros(2, 4, 1, 656, dtype=torch.uint8), None).name == "v32_fp8"
    assert format_of(torch.zeros(2, 1, 4, 656, dtype=torch.uint8), None).name == "v32_fp8"
    assert format_of(torch.zeros(2, 4, 1, 656, dtype=torch.uint8), "glm_nope_fp8").name == "glm_nope_fp8"
    with pytest.raises(CacheLayoutError, match=r"528 bytes wide is ambiguous: pass kv_format= .*glm_nope_fp8"):
        format_of(torch.zeros(2, 4, 1, 528, dtype=torch.uint8), None)
    with pytest.raises(CacheLayoutError, match=r"no cache format has 600-byte rows: pass kv_format= "
                                               r"\(one of \['glm_nope_fp8', 'model1_fp8', 'v32_fp8'\]\)"):
        format_of(torch.zeros(2, 4, 1, 600, dtype=torch.uint8), None)
    # MODEL1's 576 data bytes per row are no view width (its views are 584 wide): not ambiguous
    with pytest.raises(CacheLayoutError, match="no cache format has 576-byte rows"):
        format_of(torch.zeros(2, 4, 1, 576, dtype=torch.uint8), None)
    with pytest.raises(CacheLayoutError, match=r"no cache format has blocks of 577 bytes"):
        format_of(torch.zeros(2, 577, dtype=torch.uint8), None)
    with pytest.raises(CacheLayoutError, match="kv_format must be one of"):
        format_of(torch.zeros(2, 4, 1, 584, dtype=torch.uint8), "dsv4_nvfp4")


def test_a_flat_model1_cache_needs_no_format_name():
    """The MODEL1 2-D view ``[num_blocks, P*584]`` reads without ``kv_format``, as before
    the library had other formats (its callers pass none)."""
    cache = make_cache(4, 64, device="cpu", layout="flat", gen=torch.Generator().manual_seed(11))
    assert read_cache_view(cache).fmt.name == "model1_fp8"
    assert torch.equal(unpack_cache(cache), unpack_cache(cache, "model1_fp8"))


def _strided(size, shape, stride, offset=0, dtype=torch.uint8):
    return torch.as_strided(torch.zeros(size, dtype=dtype), shape, stride, offset)


@pytest.mark.parametrize("kv_format,make,message", [
    ("v32_fp8", lambda: torch.zeros(4, 8, 1, 656, dtype=torch.float16), "uint8 or float8_e4m3fn"),
    (None, lambda: torch.zeros(4, 8, 1, 528, dtype=torch.uint8), "ambiguous: pass kv_format="),
    (None, lambda: torch.zeros(4, 8, 1, 672, dtype=torch.uint8), "no cache format has 672-byte rows"),
    ("glm_nope_fp8", lambda: torch.zeros(4, 8, 1, 584, dtype=torch.uint8), "expected [num_blocks, P, 1, 528 or 656]"),
    ("glm_nope_fp8", lambda: torch.zeros(4, 8, 1, 512, dtype=torch.uint8), "expected [num_blocks, P, 1, 528 or 656]"),
    ("v32_fp8", lambda: torch.zeros(4, 8, 1, 528, dtype=torch.uint8), "expected [num_blocks, P, 1, 656]"),
    ("model1_fp8", lambda: torch.zeros(4, 8, 1, 656, dtype=torch.uint8), "expected [num_blocks, P, 1, 584]"),
    ("v32_fp8", lambda: torch.zeros(4, 1000, dtype=torch.uint8), "[num_blocks, P*656]"),
    ("glm_nope_fp8", lambda: torch.zeros(4, 8 * 656, dtype=torch.uint8), "[num_blocks, P*528]"),
    # row strides: not a multiple of 16, narrower than the row
    ("v32_fp8", lambda: _strided(4 * 8 * 664, (4, 8, 1, 656), (8 * 664, 664, 664, 1)), "row stride 664 must be a multiple of 16"),
    ("glm_nope_fp8", lambda: _strided(4 * 8 * 656, (4, 8, 1, 656), (8 * 512, 512, 512, 1)), "at least the 528 bytes"),
    ("glm_nope_fp8", lambda: _strided(4 * 8 * 656, (4, 1, 8, 528), (8 * 528, 528, 520, 1)), "multiple of 16"),
    # block strides: not a multiple of 16, smaller than a block
    ("v32_fp8", lambda: _strided(4 * 5256, (4, 8, 1, 656), (5256, 656, 656, 1)), "not a multiple of 16"),
    ("glm_nope_fp8", lambda: _strided(4 * 8 * 656, (4, 8, 1, 656), (7 * 656, 656, 656, 1)), "smaller than a block"),
    ("model1_fp8", lambda: _strided(4 * 8 * 584, (4, 8, 1, 584), (8 * 584 - 16, 584, 584, 1)), "smaller than a block"),
    # bytes not contiguous; MODEL1 rows not packed; the data pointer
    ("v32_fp8", lambda: torch.zeros(4, 8, 1, 1312, dtype=torch.uint8)[..., ::2], "byte stride 1"),
    ("model1_fp8", lambda: _strided(4 * 8 * 600, (4, 8, 1, 584), (8 * 600, 600, 600, 1)), "token stride 584"),
    ("v32_fp8", lambda: _strided(4 * 8 * 656 + 8, (4, 8, 1, 656), (8 * 656, 656, 656, 1), 8), "data pointer"),
    ("v32_fp8", lambda: torch.zeros(0, 8, 1, 656, dtype=torch.uint8), "holds no token"),
])
def test_bad_views_are_refused(kv_format, make, message):
    with pytest.raises(CacheLayoutError, match=message.replace("[", r"\[").replace("*", r"\*")):
        read_cache_view(make(), kv_format)


# ---------------------------------------------------------------------- the test inputs (dispatch.testing)
@pytest.mark.parametrize("kv_format,row_stride,layout", [
    ("v32_fp8", 672, "nhd"), ("v32_fp8", None, "flat"), ("glm_nope_fp8", 656, "hnd"), ("glm_nope_fp8", 528, "fp8"),
    ("model1_fp8", None, "nhd"),
])
def test_make_cache_poisons_every_byte_that_is_not_data(kv_format, row_stride, layout):
    fmt = get_format(kv_format)
    page, nb = 8, 6
    pitch = row_stride or (fmt.row_pitches[0] if fmt.inline else fmt.bytes_per_token)
    block_stride = default_block_stride(fmt, page, row_stride) + 64
    cache = make_cache(nb, page, device="cpu", kv_format=kv_format, row_stride=row_stride, block_stride=block_stride,
                       layout=layout, poison_blocks=(0, 4), gen=torch.Generator().manual_seed(5))
    raw = storage_bytes(cache)
    data = set()
    for b in (1, 2, 3, 5):
        base = b * block_stride
        for t in range(page):
            row = base + t * (pitch if fmt.inline else 576)
            data.update(range(row, row + fmt.row_bytes))
            if not fmt.inline:
                data.update(range(base + page * 576 + 8 * t, base + page * 576 + 8 * t + 8))
    for b in range(nb):
        block = raw[b * block_stride:(b + 1) * block_stride]
        if b in (0, 4):
            assert all(v == 0xFF for v in block), f"block {b} must be poisoned"
            continue
        filler = [i for i in range(b * block_stride, (b + 1) * block_stride) if i not in data]
        assert filler and all(raw[i] == 0xFF for i in filler)
        if not fmt.inline:  # MODEL1's pad byte: 0, as before
            assert all(raw[b * block_stride + page * 576 + 8 * t + 7] == 0 for t in range(page))
    back = unpack_cache(cache, kv_format).reshape(nb, page, -1)
    assert torch.isnan(back[[0, 4]]).all() and torch.isfinite(back[[1, 2, 3, 5]]).all()


def test_make_cache_refuses_what_its_views_cannot_hold():
    with pytest.raises(ValueError, match="a flat v32_fp8 view implies rows 656 bytes apart"):
        make_cache(2, 4, device="cpu", kv_format="v32_fp8", row_stride=672, layout="flat")
    with pytest.raises(ValueError, match="multiple of 16"):
        make_cache(2, 4, device="cpu", kv_format="glm_nope_fp8", row_stride=536)
    with pytest.raises(ValueError, match="rows are packed"):
        make_cache(2, 4, device="cpu", row_stride=600)
    with pytest.raises(ValueError, match="layout"):
        make_cache(2, 4, device="cpu", layout="nchw")


@pytest.mark.parametrize("kv_format,writer", [("v32_fp8", "vllm"), ("v32_fp8", "sglang"), ("glm_nope_fp8", "vllm"),
                                              ("glm_nope_fp8", "b12x"), ("v32_fp8", "flashmla"),
                                              ("model1_fp8", None)])
def test_make_cache_scale_spread(kv_format, writer):
    """``scale_spread``: per-group scales over many binades; not powers of two for the
    arbitrary-FP32 writers."""
    fmt = get_format(kv_format)
    cache = make_cache(8, 64, device="cpu", kv_format=kv_format, writer=writer, scale_spread=8,
                       gen=torch.Generator().manual_seed(seed_for(f"spread {kv_format} {writer}")))
    view = read_cache_view(cache, kv_format)
    _, scales, _ = gather_slot_parts(view, torch.arange(view.num_slots))
    binades = torch.log2(scales)
    assert binades.max() - binades.min() >= 14  # 16 binades of factors, plus the data's own
    within_token = binades.amax(-1) - binades.amin(-1)
    assert within_token.max() >= 8  # the groups of one token differ
    pow2 = torch.frexp(scales).mantissa == 0.5
    if writer in ("vllm", "sglang", "b12x"):  # amax / 448 is a power of two only for amax = 1.75 * 2**k (bf16 holds it)
        assert pow2.float().mean() < 0.05
    else:
        assert pow2.all()
    plain = make_cache(8, 64, device="cpu", kv_format=kv_format, writer=writer,
                       gen=torch.Generator().manual_seed(seed_for(f"spread {kv_format} {writer}")))
    assert not torch.equal(unpack_cache(plain, kv_format), unpack_cache(cache, kv_format))


@pytest.mark.parametrize("kv_format", sorted(FORMATS))
def test_make_cache_tiny(kv_format):
    """``tiny``: the bottom of the format's scales and the rope 0 (module doc of dispatch.testing)."""
    fmt = get_format(kv_format)
    cache = make_cache(4, 32, device="cpu", kv_format=kv_format, tiny=True, gen=torch.Generator().manual_seed(9))
    view = read_cache_view(cache, kv_format)
    codes, scales, rope = gather_slot_parts(view, torch.arange(view.num_slots))
    assert (rope == 0).all() and codes.abs().amax() > 100
    if fmt.scale_type == "ue8m0":
        assert set(torch.log2(scales).flatten().tolist()) == {-127.0, -126.0, -125.0}
    else:
        assert (scales >= 2.0**-126).all() and (scales < 2.0**-124).all()
        assert (scales == 2.0**-126).any() and (torch.frexp(scales).mantissa != 0.5).float().mean() > 0.5
    back = unpack_cache(cache, kv_format)
    assert torch.isfinite(back).all() and back[..., :fmt.nope_dims].abs().max() < 2.0**-115


# ---------------------------------------------------------------------- the kernels' slot division
def _quotient(slot: int, page: int) -> int:
    """slot // page the kernels' way (``gather.ChunkGather.row_location``)."""
    magic = page_division_magic(page)
    return (slot * (magic & 0xFFFFFFFF)) >> (magic >> 32)


@pytest.mark.parametrize("page", [*range(1, 130), 192, 255, 256, 257, 1000, 4096, 65535, 65536, 99991,
                                  (1 << 20) + 7, (1 << 30) - 1, 1 << 30, (1 << 31) - 1])
def test_page_division_magic_divides_every_slot(page):
    gen = torch.Generator().manual_seed(page)
    slots = list(range(0, 3 * page + 3)) if page <= 256 else []
    slots += [page * k + d for k in (1, 2, 1000) for d in (-1, 0, 1) if 0 <= page * k + d < 1 << 31]
    slots += torch.randint(0, 1 << 31, (2000,), generator=gen).tolist() + [(1 << 31) - 1, (1 << 31) - 2]
    magic = page_division_magic(page)
    assert magic & 0xFFFFFFFF < 1 << 32 and (magic >> 32) <= 62
    wrong = [s for s in slots if _quotient(s, page) != s // page]
    assert not wrong, f"page {page}: slot // page wrong for slots {wrong[:5]}"
    # the device's product of a slot (< 2**31) and the multiplier (< 2**32) fits a signed int64
    assert ((1 << 31) - 1) * (magic & 0xFFFFFFFF) < 1 << 63


@pytest.mark.parametrize("page", [0, -64, 64.0, True])
def test_page_division_magic_refuses_bad_pages(page):
    with pytest.raises(ValueError, match="page_block_size"):
        page_division_magic(page)


# ---------------------------------------------------------------------- MODEL1 (kept from before the formats)
def test_round_trip_within_fp8_error():
    latent = torch.randn(6, 64, 512, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    back = unpack_cache(pack_latent(latent))
    nope_err = (back[..., :448] - latent[..., :448].float()).norm() / latent[..., :448].float().norm()
    assert nope_err < 0.04  # e4m3 keeps 3 mantissa bits: ~2.5% rms
    assert torch.equal(back[..., 448:], latent[..., 448:].float())  # rope is stored as is


def test_layout_bytes_match_the_spec():
    page = 4
    latent = torch.randn(2, page, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    cache = pack_latent(latent, block_stride=page * MODEL1_TOKEN_BYTES + 32)
    buf = torch.as_strided(cache, (2, page * MODEL1_TOKEN_BYTES + 32), (page * MODEL1_TOKEN_BYTES + 32, 1))
    nope, scales, rope = quantize_latent(latent)
    for b in range(2):
        for t in range(page):
            row = buf[b, t * 576:(t + 1) * 576]
            assert torch.equal(row[:448], nope[b, t].view(torch.uint8))
            assert torch.equal(row[448:], rope[b, t].contiguous().view(torch.uint8))
            foot = buf[b, page * 576 + t * 8: page * 576 + t * 8 + 8]
            assert torch.equal(foot[:7].float(), torch.log2(scales[b, t]) + 127)
            assert foot[7] == 0
    # the scale is 2**ceil(log2(amax / 448)): every tile uses its range without overflow
    amax = (nope.float().abs().reshape(2, page, 7, 64)).amax(-1)
    assert (amax <= 448).all() and (amax >= 224).all()


@pytest.mark.parametrize("layout", ["nhd", "hnd", "flat", "fp8"])
def test_every_view_reads_the_same(layout):
    gen = torch.Generator().manual_seed(0)
    ref = unpack_cache(make_cache(5, 64, device="cpu", gen=gen))
    gen = torch.Generator().manual_seed(0)
    view = make_cache(5, 64, device="cpu", gen=gen, layout=layout)
    assert torch.equal(unpack_cache(view), ref)
    info = read_cache_view(view)
    assert info.page_block_size == 64 and info.block_stride == default_block_stride(info.fmt, 64) == 37440


def test_gather_slots_matches_unpack():
    cache = make_cache(4, 32, device="cpu", block_stride=32 * MODEL1_TOKEN_BYTES + 48)
    full = unpack_cache(cache).reshape(-1, 512)
    slots = torch.tensor([[0, 127, 5], [64, 64, 31]])
    assert torch.equal(gather_slots(read_cache_view(cache), slots), full[slots])


@pytest.mark.parametrize("make, message", [
    (lambda: torch.zeros(4, 64, 1, 584, dtype=torch.float16), "uint8 or float8_e4m3fn"),
    (lambda: torch.zeros(4, 64, 1, 580, dtype=torch.uint8), "no cache format has 580-byte rows"),
    (lambda: torch.zeros(4, 1000, dtype=torch.uint8), "pass kv_format="),
    (lambda: torch.as_strided(torch.zeros(4 * 37384, dtype=torch.uint8), (4, 64, 1, 584), (37384, 584, 584, 1)),
     "not a multiple of 16"),
    (lambda: torch.as_strided(torch.zeros(4 * 37376, dtype=torch.uint8), (4, 64, 1, 584), (37000, 584, 584, 1)),
     "smaller than a block"),
    (lambda: torch.zeros(4, 64, 1, 1168, dtype=torch.uint8)[..., ::2], "byte stride 1"),
])
def test_bad_model1_views_are_refused(make, message):
    with pytest.raises(CacheLayoutError, match=message.replace("[", r"\[").replace("*", r"\*")):
        read_cache_view(make())
