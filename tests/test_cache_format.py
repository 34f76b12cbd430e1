"""The cache formats' helpers (CPU): every format's packer against bytes computed here from the
byte-level specification (pure Python: struct and exact e4m3 rounding, none of the packer's
helpers), round trips, the views ``read_cache_view`` accepts and refuses, and the test inputs
``dispatch.tools.sample_inputs`` makes."""

import math
import re
import struct
from bisect import bisect_left
from fractions import Fraction

import pytest
import torch

from cute_kernels.sparse_mla_decode.cache_readers import decode_scales, gather_slot_parts, gather_slots, unpack_cache
from cute_kernels.sparse_mla_decode.cache_view import (
    CacheLayoutError, default_block_stride, extra_format_of, format_of, page_division_magic, read_cache_view,
)
from cute_kernels.sparse_mla_decode.cache_writers import (
    WRITERS, pack_latent, quantize_latent, writer_encodes_non_finite,
)
from cute_kernels.sparse_mla_decode.e2m1 import e2m1_decode, e2m1_encode
from cute_kernels.sparse_mla_decode.kv_format import FORMATS, get_format
from dispatch.tools.sample_inputs import make_cache, view_width
from tests.fp_spec import e4m3_value, f32
from tests.tolerances import seed_for

MODEL1_TOKEN_BYTES = 584
# MODEL1 NVFP4 (FlashInfer's DeepSeek-V4 NVFP4 cache): per block of P tokens, token t's 224 bytes
# of e2m1 pairs then 64 bf16 rope values at t * 352, its footer record at P * 352 + 32 t: 28
# E4M3 scale bytes (byte g scales dims 16g..16g+15), then 4 bytes that are 0
NVFP4_TOKEN_BYTES, NVFP4_ROW, NVFP4_RECORD, NVFP4_NOPE_BYTES = 384, 352, 32, 224
# DeepSeek-V4.1 (FlashInfer's dsv41 layouts): 512 dims, all quantized, no rope. FP8: 512 e4m3
# bytes and 16 UE8M0 bytes (byte g scales dims 32g..32g+31); FP4: 256 bytes of e2m1 pairs and 32
# E4M3 bytes (byte g scales dims 16g..16g+15). Footer: token t's data at t * data, its scales at
# P * data + t * scales, no pad; inline: record [data | scales] at the row (flat-row indices)
V41_LAYOUT = {  # name: (e2m1, data bytes, scale bytes, footer)
    "v41_fp8": (False, 512, 16, True), "v41_fp8_inline": (False, 512, 16, False),
    "v41_nvfp4": (True, 256, 32, True), "v41_nvfp4_inline": (True, 256, 32, False),
}
TOKEN_BYTES = {"model1_fp8": MODEL1_TOKEN_BYTES, "model1_nvfp4": NVFP4_TOKEN_BYTES, "v41_fp8": 528, "v41_nvfp4": 288}
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


def e2m1_value(code: int) -> float:
    """The value of an e2m1 nibble s ee m: exponent bias 1, e == 0 subnormal m / 2."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m / 2 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


_E2M1_POSITIVE = [e2m1_value(c) for c in range(8)]  # 0, 0.5, 1, 1.5, 2, 3, 4, 6


def e2m1_code(x: float) -> int:
    """The e2m1 nibble of ``x`` as a satfinite round-to-nearest-even conversion writes it
    (saturating at 6, the sign of a zero kept, NaN +6)."""
    if math.isnan(x):
        return 7
    sign = 8 if math.copysign(1.0, x) < 0 else 0
    a = Fraction(min(abs(x), 6.0))
    dist = [abs(a - Fraction(v)) for v in _E2M1_POSITIVE]
    best = min(range(8), key=lambda i: (dist[i], i % 2))  # nearest; on a tie the even code
    return sign | best


def f32_step(x: float, k: int) -> float:
    """The float32 ``k`` steps from float32 ``x`` > 0 (k < 0: below)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return struct.unpack("<f", struct.pack("<I", bits + k))[0]


def pow2_ceil(r: float) -> float:
    """2**ceil(log2(r)) for r > 0, exactly."""
    m, e = math.frexp(r)  # r = m * 2**e, m in [0.5, 1)
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


def expected_group(kv_format: str, writer: str, xs: list):
    """(stored scale bytes, e4m3 codes; None for a NaN code of either sign) of one scale group of
    float32 values ``xs`` as ``writer`` writes ``kv_format`` (the recipes of the formats' note:
    FlashMLA pow2-ceil with the ratio floor, vLLM's V4 compressor pow2-ceil with the amax floor,
    vLLM's fp8_ds_mla max(amax / 448, FLT_MIN) and x / s, SGLang amax / 448 and x * (1 / s), b12x's
    GLM-5.3 writer amax * fl32(1 / 448) (1 for an all-zero group) and x * (1 / s); FlashInfer's
    NVFP4 writer: the E4M3 byte of amax / 6, e2m1 codes of x * (1 / s), all 0 where s is 0)."""
    if kv_format in V41_LAYOUT:
        return expected_v41_group(kv_format, writer, xs)
    amax = max(abs(x) for x in xs)
    fmt = get_format(kv_format)
    if writer == "flashinfer":
        sb = e4m3_code(f32(amax / 6))
        s = e4m3_value(sb)
        return bytes([sb]), [0] * len(xs) if s == 0 else [e2m1_code(f32(x * f32(1 / s))) for x in xs]
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


def expected_v41_group(kv_format: str, writer: str, xs: list):
    """(scale byte, codes: e4m3 bytes or e2m1 nibbles) of one DeepSeek-V4.1 group of float32
    ``xs`` (the formats' note, 1.2 and 3.3-3.4). FP8, FlashInfer: a NaN in the group gives scale
    0xFF and every code 0x7F; an Inf (no NaN) scale 0xFF, 0x7F for the Inf elements and +-0 for
    the rest; else FlashMLA's pow2-ceil with the 1e-4 ratio floor and x / s. FP8, b12x:
    pow2_ceil(max(amax, 1e-4) * fl32(1 / 448)) and x * (1 / s). FP4, FlashInfer: a NaN or Inf
    gives scale 0x7F and codes 0; else e4m3(clamp(amax / 6, 2**-9, 448)) and x / s. FP4, b12x:
    amax clamped at 6 * 2**-9, e4m3(amax / 6) and x * (1 / s)."""
    e2m1 = V41_LAYOUT[kv_format][0]
    finite = all(math.isfinite(x) for x in xs)
    if writer == "flashinfer" and not finite:
        if e2m1:
            return b"\x7f", [0] * len(xs)
        if any(math.isnan(x) for x in xs):
            return b"\xff", [0x7F] * len(xs)
        return b"\xff", [0x7F if math.isinf(x) else (0x80 if math.copysign(1.0, x) < 0 else 0) for x in xs]
    amax = max(abs(x) for x in xs)
    if e2m1:
        if writer == "flashinfer":
            sb = e4m3_code(min(max(f32(amax / 6), 2.0**-9), 448.0))
            return bytes([sb]), [e2m1_code(f32(x / e4m3_value(sb))) for x in xs]
        assert writer == "b12x", writer
        sb = e4m3_code(f32(max(amax, 6 * 2.0**-9) / 6))
        return bytes([sb]), [e2m1_code(f32(x * f32(1 / e4m3_value(sb)))) for x in xs]
    if writer == "flashinfer":
        s = pow2_ceil(max(f32(amax / 448), f32(1e-4)))
        codes = [e4m3_code(f32(x / s)) for x in xs]
    else:
        assert writer == "b12x", writer
        s = pow2_ceil(f32(max(amax, f32(1e-4)) * f32(1 / 448)))
        codes = [e4m3_code(f32(x * f32(1 / s))) for x in xs]
    m, e = math.frexp(s)
    assert m == 0.5
    return bytes([e - 1 + 127]), codes


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


# an E4M3 scale whose float32 reciprocal is above 1 / s, and values at e2m1 ties times it that
# x * (1 / s) rounds one code above x / s (FlashInfer's recipe against exact division)
S_0F = e4m3_value(0x0F)  # 15/8 * 2**-6 = 0.029296875
RECIPROCAL_SPLITS = [1.25 * S_0F, 2.5 * S_0F, 5.0 * S_0F]  # codes 3, 5, 7 (x / s: 2, 4, 6)


def nvfp4_special_groups(count: int, gen: torch.Generator) -> list:
    """``count`` groups of 16 float32 values cycling through the cases of FlashInfer's NVFP4
    recipe: all zeros; s = 1 with every e2m1 tie of either sign and a -0; s = 1 with values one
    float32 step on either side of the ties; amax / 6 at the e4m3 tie 2**-10 (s = 0: codes 0);
    amax / 6 a step above it (s = 2**-9, the smallest subnormal); amax far past 6 * 448 (s =
    448, codes saturated); s = 0x0F, whose float32 reciprocal splits x * (1 / s) from x / s;
    random values with non-power-of-two scales; values over 30 binades (most below a code's
    reach)."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    out = []
    for i in range(count):
        rnd = [f32(v) for v in torch.randn(16, generator=gen).tolist()]
        kind = i % 9
        if kind == 0:
            g = [0.0] * 16
        elif kind == 1:
            g = [6.0] + ties + [-t for t in ties] + [-0.0]
        elif kind == 2:
            g = [6.0] + [f32_step(t, d) for t in ties for d in (-1, 1)] + [-f32_step(5.0, 1)]
        elif kind == 3:
            g = [6 * 2.0**-10] + [v * 2.0**-14 for v in rnd[1:]]
        elif kind == 4:
            g = [f32_step(6 * 2.0**-10, 1)] + [v * 2.0**-14 for v in rnd[1:]]
        elif kind == 5:
            g = [1e6, -3000.0, 2688.0, 448.0] + [v * 100 for v in rnd[4:]]
        elif kind == 6:
            g = [6 * S_0F] + RECIPROCAL_SPLITS + [-v for v in RECIPROCAL_SPLITS] + [v * S_0F for v in rnd[7:]]
        elif kind == 7:
            g = [f32(v * (0.3 + abs(rnd[0]))) for v in rnd]
        else:
            g = [f32(v * 2.0 ** (j * 2 - 15)) for j, v in enumerate(rnd)]
        out.append(g[:16])
    return out


def make_test_latent(kv_format: str, num_blocks: int, page: int, gen: torch.Generator) -> torch.Tensor:
    """A float32 latent ``[num_blocks, P, d_qk]`` of ``special_groups`` (sglang's all-zero group
    included; ``nvfp4_special_groups`` for an e2m1 format) and bf16 rope values."""
    fmt = get_format(kv_format)
    count = num_blocks * page * fmt.num_scales
    groups = nvfp4_special_groups(count, gen) if fmt.e2m1 else special_groups(fmt.scale_group, count, gen)
    nope = torch.tensor(groups, dtype=torch.float32).reshape(num_blocks, page, fmt.nope_dims)
    rope = (torch.randn(num_blocks, page, fmt.rope_dims, generator=gen) * 3).bfloat16().float()
    return torch.cat([nope, rope], dim=-1)


def expected_bytes(latent: torch.Tensor, kv_format: str, writer: str, block_stride: int, row_stride: int | None):
    """(the bytes of the packed buffer, the positions whose byte must be an e4m3 NaN of either
    sign) computed from the specification."""
    fmt = get_format(kv_format)
    nb, page, _ = latent.shape
    if kv_format in V41_LAYOUT:
        return expected_v41_bytes(latent, kv_format, writer, block_stride, row_stride), []
    if fmt.e2m1:
        return expected_nvfp4_bytes(latent, block_stride), []
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


def expected_nvfp4_bytes(latent: torch.Tensor, block_stride: int) -> bytearray:
    """The bytes of a MODEL1 NVFP4 buffer (FlashInfer's writer) from the specification: the
    nibbles of element 2i (low) and 2i + 1 (high) in byte i, the E4M3 scale bytes, 4 zero pad
    bytes per record, the rope's bf16 bytes; FILL elsewhere."""
    nb, page, _ = latent.shape
    buf = bytearray([FILL]) * (nb * block_stride)
    for b in range(nb):
        for t in range(page):
            x = latent[b, t].tolist()
            row = b * block_stride + t * NVFP4_ROW
            record = b * block_stride + page * NVFP4_ROW + t * NVFP4_RECORD
            codes = []
            for g in range(28):
                scale, group_codes = expected_group("model1_nvfp4", "flashinfer", x[16 * g:16 * g + 16])
                buf[record + g] = scale[0]
                codes += group_codes
            buf[record + 28:record + 32] = bytes(4)
            for i in range(NVFP4_NOPE_BYTES):
                buf[row + i] = codes[2 * i] | codes[2 * i + 1] << 4
            for r in range(64):
                buf[row + NVFP4_NOPE_BYTES + 2 * r:row + NVFP4_NOPE_BYTES + 2 * r + 2] = bf16_bytes(x[448 + r])
    return buf


def expected_v41_bytes(latent: torch.Tensor, kv_format: str, writer: str, block_stride: int,
                       row_stride: int | None) -> bytearray:
    """The bytes of a DeepSeek-V4.1 buffer from the specification (``V41_LAYOUT``): block b's
    token t at b * block_stride, its data and scale bytes where the layout puts them (an
    inline record at t * row_stride, default its 528 / 288 bytes), e2m1 element 2i in the low
    nibble of byte i; FILL elsewhere (block padding, a flat-row block's rows past its tokens,
    the tail of a wide row)."""
    e2m1, data, scales, footer = V41_LAYOUT[kv_format]
    group = 16 if e2m1 else 32
    nb, page, _ = latent.shape
    pitch = row_stride or data + scales
    buf = bytearray([FILL]) * (nb * block_stride)
    for b in range(nb):
        for t in range(page):
            x = latent[b, t].tolist()
            base = b * block_stride
            row = base + t * (data if footer else pitch)
            scale_at = base + page * data + t * scales if footer else row + data
            codes = []
            for g in range(512 // group):
                scale, group_codes = expected_v41_group(kv_format, writer, x[g * group:(g + 1) * group])
                buf[scale_at + g] = scale[0]
                codes += group_codes
            if e2m1:
                codes = [codes[2 * i] | codes[2 * i + 1] << 4 for i in range(data)]
            buf[row:row + data] = bytes(codes)
    return buf


def v41_value(kv_format: str, raw: bytes, row: int, scale_at: int) -> list:
    """The 512 dequantized values (Python floats, exact) of the V4.1 token whose data starts
    at byte ``row`` and whose scale bytes start at ``scale_at`` of ``raw``."""
    e2m1 = V41_LAYOUT[kv_format][0]
    if e2m1:
        return [e2m1_value(raw[row + i // 2] >> 4 if i % 2 else raw[row + i // 2] & 0xF)
                * e4m3_value(raw[scale_at + i // 16]) for i in range(512)]
    return [e4m3_value(raw[row + i]) * 2.0 ** (raw[scale_at + i // 32] - 127) for i in range(512)]


def storage_bytes(cache: torch.Tensor) -> bytes:
    return bytes(cache.untyped_storage().cpu())


WRITER_CASES = [(f, w) for f in FORMATS for w in WRITERS[f]]
STRIDE_CASES = {  # (row stride, extra bytes of block padding); None: the format's default
    "model1_fp8": [(None, 0), (None, 48)],
    "model1_nvfp4": [(None, 0), (None, 48)],
    "v32_fp8": [(None, 0), (672, 32), (1024, 0)],
    "glm_nope_fp8": [(None, 0), (528, 16), (656, 0), (656, 160), (672, 0)],
    "v41_fp8": [(None, 0), (None, 48)],
    "v41_nvfp4": [(None, 0), (None, 48)],
    # flat rows: a padded block is a whole number of rows (two rows of padding here)
    "v41_fp8_inline": [(None, 0), (None, 2 * 528), (544, 0), (544, 2 * 544)],
    "v41_nvfp4_inline": [(None, 0), (None, 2 * 288), (320, 0), (320, 2 * 320)],
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
        pitch = row_stride or (fmt.row_pitches[0] if fmt.inline else TOKEN_BYTES[kv_format])
        if fmt.inline:
            used = (page - 1) * pitch + fmt.row_bytes
        else:
            used = page * TOKEN_BYTES[kv_format]
        unit = pitch if fmt.flat_rows else 16  # the smallest block stride: 16-byte aligned, whole rows
        block_stride = -(-used // unit) * unit + pad
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
    # DeepSeek-V4.1 FP8 (groups of 32): FlashInfer's ratio floor, b12x's amax floor (all zeros,
    # amax 1e-6); the same scale 1 and ties at amax 448, a binade up past it
    groups32 = special_groups(32, 9, gen)
    for g in (groups32[0], groups32[5]):
        assert expected_group("v41_fp8", "flashinfer", g)[0] == bytes([127 - 13])
        assert expected_group("v41_fp8", "b12x", g)[0] == bytes([127 - 22])
    assert expected_group("v41_fp8", "flashinfer", groups32[0])[1] == [0] * 32
    for w in ("flashinfer", "b12x"):
        scale, codes = expected_group("v41_fp8", w, groups32[1])
        assert scale == bytes([127]) and codes[:8] == [0x7E, 0x58, 0x5A, 0xD8, 0x00, 0x02, 0x82, 0x00]
        assert expected_group("v41_fp8", w, groups32[2])[0] == bytes([128])  # amax 450
    # DeepSeek-V4.1 FP4: the 2**-9 scale floor where MODEL1's writer gives scale 0, and the
    # division (FlashInfer) against the reciprocal (b12x) at the s = 0x0F ties
    fp4 = nvfp4_special_groups(9, gen)
    assert expected_group("model1_nvfp4", "flashinfer", fp4[3]) == (b"\0", [0] * 16)
    for w in ("flashinfer", "b12x"):
        assert expected_group("v41_nvfp4", w, fp4[0]) == (b"\x01", [0] * 16)
        assert expected_group("v41_nvfp4", w, fp4[3])[0] == b"\x01"
    assert expected_group("v41_nvfp4", "flashinfer", fp4[6])[0] == expected_group("v41_nvfp4", "b12x", fp4[6])[0]
    assert expected_group("v41_nvfp4", "flashinfer", fp4[6])[1][1:4] == [2, 4, 6]  # x / s: the ties to even
    assert expected_group("v41_nvfp4", "b12x", fp4[6])[1][1:4] == [3, 5, 7]  # x * (1 / s): a code above


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
    used = 3 * (fmt.row_pitches[0] if fmt.inline else 0) + (fmt.row_bytes if fmt.inline else 4 * fmt.bytes_per_token)
    with pytest.raises(ValueError, match="block_stride"):
        pack_latent(latent, kv_format, block_stride=used - 16)
    with pytest.raises(ValueError, match="block_stride"):
        pack_latent(latent, kv_format, block_stride=used + 8)


@pytest.mark.parametrize("fill", [300, -1, 1.5, True, "0"])
def test_pack_latent_refuses_a_fill_that_is_not_a_byte(fill):
    with pytest.raises(ValueError, match=re.escape(f"fill must be an int in [0, 255] (the byte written where no "
                                                   f"data is), got {fill!r}")):
        pack_latent(torch.zeros(1, 4, 512), "model1_fp8", fill=fill)


@pytest.mark.parametrize("kv_format", [f for f in sorted(FORMATS) if not FORMATS[f].inline])
def test_pack_latent_refuses_a_row_stride_for_a_footer_format(kv_format):
    """A footer format's rows are packed: a row stride would be ignored, so it is refused."""
    fmt = get_format(kv_format)
    with pytest.raises(ValueError, match=re.escape(f"row_stride applies to the formats with scales inline in the "
                                                   f"row ({[f for f in FORMATS if FORMATS[f].inline]}); "
                                                   f"{kv_format}'s rows are packed")):
        pack_latent(torch.zeros(1, 4, fmt.d_qk), kv_format, row_stride=fmt.bytes_per_token)


NON_FINITE_REFUSED = [(f, w) for f in sorted(WRITERS) for w in WRITERS[f] if not writer_encodes_non_finite(f, w)]


@pytest.mark.parametrize("kv_format,writer", NON_FINITE_REFUSED)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_packers_refuse_nan_and_inf_where_the_writer_has_no_encoding(kv_format, writer, value):
    """Every writer but FlashInfer's V4.1 ones is specified for finite groups: ``quantize_latent``
    and ``pack_latent`` refuse a NaN / Inf in the nope dims naming the element and its scale
    group (their arithmetic stored the group as NaN); one in the rope dims is stored as given."""
    fmt = get_format(kv_format)
    latent = torch.randn(2, 4, fmt.d_qk, generator=torch.Generator().manual_seed(seed_for(kv_format + writer)))
    dim = fmt.nope_dims - 3
    latent[1, 2, dim] = value
    first = dim // fmt.scale_group * fmt.scale_group
    message = (f"latent[1, 2, {dim}] is {value}: {kv_format}'s {writer!r} writer has no encoding of NaN or Inf in the "
               f"nope dims (its scale group, dims {first}..{first + fmt.scale_group - 1}, would be stored as NaN)")
    for pack_or_quantize in (pack_latent, quantize_latent):
        with pytest.raises(ValueError, match=re.escape(message)):
            pack_or_quantize(latent, kv_format, writer=writer)
    if fmt.rope_dims:  # the rope dims are bf16 as given
        latent[1, 2, dim] = 0.0
        latent[1, 2, fmt.nope_dims + 1] = value
        back = unpack_cache(pack_latent(latent, kv_format, writer=writer), kv_format)
        assert torch.isnan(back[1, 2, fmt.nope_dims + 1]) if math.isnan(value) else back[1, 2,
                                                                                         fmt.nope_dims + 1] == value
        assert torch.isfinite(back[1, 2, :fmt.nope_dims]).all()


def test_every_format_has_a_writer_of_each_kind_of_non_finite_handling():
    """FlashInfer's V4.1 writers (the default of the four v41 formats) encode NaN / Inf; no other."""
    encoding = {(f, w) for f in WRITERS for w in WRITERS[f] if writer_encodes_non_finite(f, w)}
    assert encoding == {(f, "flashinfer") for f in WRITERS if f.startswith("v41_")}
    assert all(writer_encodes_non_finite(f) for f in WRITERS if f.startswith("v41_"))


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
                if fmt.e2m1:
                    s, value = e4m3_value(scale[0]), e2m1_value
                else:
                    s, value = 2.0 ** (scale[0] - 127) if len(scale) == 1 else struct.unpack("<f", scale)[0], e4m3_value
                scales[b, t, g] = s
                for j, c in enumerate(codes):
                    out[b, t, g * fmt.scale_group + j] = math.nan if c is None else value(c) * s
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
        err = (nope - x).abs().reshape(groups.shape)
        if fmt.e2m1:  # half of e2m1's step (0.25 below 1, a quarter of the value above), or saturated at 6 s
            bound = groups.abs() * 2.0**-2 + scales[..., None] * 2.0**-2
            bound = torch.maximum(bound, groups.abs() - 6 * scales[..., None])
            assert (err <= bound * (1 + 2.0**-20)).all()
            continue
        half_step = scales[..., None] * 2.0**-10  # half of e4m3's subnormal step, scaled
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
        if fmt.e2m1:  # s = e4m3(amax / 6), within 2**-4 of amax / 6: amax / s rounds to 6
            assert (top == 6).all() and codes.dtype == torch.float32
            assert (torch.frexp(scales).mantissa != 0.5).any()
        elif writer in ("vllm", "sglang", "b12x") and fmt.fp32_scales:
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
    ("v41_fp8", None, 0), ("v41_fp8", None, 1024), ("v41_nvfp4", None, 208),
    ("v41_fp8_inline", 528, 0), ("v41_fp8_inline", 528, 3 * 528), ("v41_fp8_inline", 544, 544),
    ("v41_nvfp4_inline", 288, 0), ("v41_nvfp4_inline", 288, 5 * 288), ("v41_nvfp4_inline", 320, 2 * 320),
])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_padded_rows_and_page_gaps_read_the_same(kv_format, row_stride, gap, layout):
    """Wide pitches (GLM-5.3's 528-byte rows in 656-byte pool rows), padded rows and page gaps
    (block stride past the block's bytes) read as the packed cache; every byte that is not data
    is 0xFF (NaN) in ``make_cache``, so a reader that touched one would return NaN. A flat-row
    format's gap is whole rows, and its token t of block b is index b * R + t."""
    fmt = get_format(kv_format)
    seed = seed_for(f"strides {kv_format}")
    ref = unpack_cache(_same_latent_caches(kv_format, seed), kv_format)
    pitch = row_stride or fmt.bytes_per_token
    block_stride = default_block_stride(fmt, 16, row_stride) + gap
    cache = _same_latent_caches(kv_format, seed, row_stride=row_stride, block_stride=block_stride, layout=layout)
    assert cache.shape[-1] == view_width(kv_format, pitch)
    view = read_cache_view(cache, kv_format)
    assert (view.block_stride, view.row_stride, view.page_block_size) == (block_stride, pitch, 16)
    rows_per_block = block_stride // pitch if fmt.flat_rows else 16
    assert view.index_page == rows_per_block and view.num_slots == 4 * rows_per_block + 16
    back = unpack_cache(cache, kv_format)
    assert torch.isfinite(back).all() and torch.equal(back, ref)
    tokens = torch.tensor([[0, 79, 16], [15, 17, 17]])
    slots = tokens // 16 * rows_per_block + tokens % 16
    assert torch.equal(gather_slots(view, slots), ref.reshape(80, fmt.d_qk)[tokens])


@pytest.mark.parametrize("kv_format,row_stride", [("v32_fp8", 656), ("v32_fp8", 672), ("glm_nope_fp8", 528),
                                                   ("glm_nope_fp8", 656), ("glm_nope_fp8", 672),
                                                   ("model1_fp8", None), ("model1_nvfp4", None), ("v41_fp8", None),
                                                   ("v41_nvfp4", None), ("v41_fp8_inline", 528),
                                                   ("v41_fp8_inline", 560), ("v41_nvfp4_inline", 288),
                                                   ("v41_nvfp4_inline", 304)])
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
                                               r"\(one of \['glm_nope_fp8', 'model1_fp8', 'model1_nvfp4', "
                                               r"'v32_fp8', 'v41_fp8', 'v41_fp8_inline', 'v41_nvfp4', "
                                               r"'v41_nvfp4_inline'\]\)"):
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
    ("v32_fp8", lambda: _strided(4 * 8 * 664, (4, 8, 1, 656), (8 * 664, 664, 664, 1)),
     "row stride 664 must be a multiple of 16"),
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
    # flat rows: a block stride that is no whole number of rows (16-byte aligned, past the block)
    ("v41_fp8_inline", lambda: _strided(4 * 4240, (4, 8, 1, 528), (8 * 528 + 16, 528, 528, 1)),
     "block stride 4240 bytes is not a whole number of 528-byte rows"),
    ("v41_nvfp4_inline", lambda: _strided(4 * 8 * 320, (4, 1, 8, 288), (8 * 320 - 32, 320, 320, 1)),
     "block stride 2528 bytes is not a whole number of 320-byte rows"),
    ("v41_nvfp4_inline", lambda: _strided(4 * 2448, (4, 8 * 288), (8 * 288 + 144, 1)),
     "block stride 2448 bytes is not a whole number of 288-byte rows"),
    # V4.1 footer rows packed
    ("v41_fp8", lambda: _strided(4 * 8 * 544, (4, 8, 1, 528), (8 * 544, 544, 544, 1)), "token stride 528"),
    ("v41_nvfp4", lambda: torch.zeros(4, 8, 1, 528, dtype=torch.uint8), "expected [num_blocks, P, 1, 288]"),
])
def test_bad_views_are_refused(kv_format, make, message):
    with pytest.raises(CacheLayoutError, match=message.replace("[", r"\[").replace("*", r"\*")):
        read_cache_view(make(), kv_format)


# ---------------------------------------------------------------------- the test inputs (dispatch.tools.sample_inputs)
@pytest.mark.parametrize("kv_format,row_stride,layout", [
    ("v32_fp8", 672, "nhd"), ("v32_fp8", None, "flat"), ("glm_nope_fp8", 656, "hnd"), ("glm_nope_fp8", 528, "fp8"),
    ("model1_fp8", None, "nhd"), ("model1_nvfp4", None, "nhd"), ("model1_nvfp4", None, "flat"),
    ("v41_fp8", None, "nhd"), ("v41_fp8", None, "flat"), ("v41_nvfp4", None, "hnd"), ("v41_fp8_inline", None, "fp8"),
    ("v41_fp8_inline", 544, "hnd"), ("v41_nvfp4_inline", None, "flat"), ("v41_nvfp4_inline", 304, "nhd"),
])
def test_make_cache_poisons_every_byte_that_is_not_data(kv_format, row_stride, layout):
    """0xFF in every byte that is no token's data (block padding, a flat-row block's rows past
    its tokens, wide rows' tails) and in the poisoned blocks, which read as NaN; the pad bytes
    of the footer records that have them are 0."""
    fmt = get_format(kv_format)
    page, nb = 8, 6
    pitch = row_stride or (fmt.row_pitches[0] if fmt.inline else fmt.bytes_per_token)
    # padding: 64 bytes, or for flat rows two whole rows
    block_stride = default_block_stride(fmt, page, row_stride) + (2 * pitch if fmt.flat_rows else 64)
    cache = make_cache(nb, page, device="cpu", kv_format=kv_format, row_stride=row_stride, block_stride=block_stride,
                       layout=layout, poison_blocks=(0, 4), gen=torch.Generator().manual_seed(5))
    raw = storage_bytes(cache)
    row_bytes, record = {"model1_fp8": (576, 8), "model1_nvfp4": (NVFP4_ROW, NVFP4_RECORD), "v41_fp8": (512, 16),
                         "v41_nvfp4": (256, 32)}.get(kv_format, (None, 0))
    data = set()
    for b in (1, 2, 3, 5):
        base = b * block_stride
        for t in range(page):
            row = base + t * (pitch if fmt.inline else row_bytes)
            data.update(range(row, row + fmt.row_bytes))
            if not fmt.inline:
                at = base + page * row_bytes + record * t
                data.update(range(at, at + record))
    for b in range(nb):
        block = raw[b * block_stride:(b + 1) * block_stride]
        if b in (0, 4):
            assert all(v == 0xFF for v in block), f"block {b} must be poisoned"
            continue
        filler = [i for i in range(b * block_stride, (b + 1) * block_stride) if i not in data]
        assert filler and all(raw[i] == 0xFF for i in filler)
        if kv_format == "model1_fp8":  # MODEL1's pad byte: 0, as before
            assert all(raw[b * block_stride + page * 576 + 8 * t + 7] == 0 for t in range(page))
        if kv_format == "model1_nvfp4":  # NVFP4's 4 pad bytes: 0 (its specification)
            at = b * block_stride + page * NVFP4_ROW
            assert all(raw[at + NVFP4_RECORD * t + 28:at + NVFP4_RECORD * t + 32] == bytes(4) for t in range(page))
    back = unpack_cache(cache, kv_format).reshape(nb, page, -1)
    assert torch.isnan(back[[0, 4]]).all() and torch.isfinite(back[[1, 2, 3, 5]]).all()
    if fmt.flat_rows:  # the rows past a block's tokens are indices, and read as the 0xFF they hold
        view = read_cache_view(cache, kv_format)
        assert view.index_page == page + 2 and view.num_slots == 5 * (page + 2) + page
        pad_rows = torch.tensor([page, page + 1, 2 * (page + 2) + page + 1])
        assert torch.isnan(gather_slots(view, pad_rows)).all()


def test_make_cache_refuses_what_its_views_cannot_hold():
    with pytest.raises(ValueError, match="a flat v32_fp8 view implies rows 656 bytes apart"):
        make_cache(2, 4, device="cpu", kv_format="v32_fp8", row_stride=672, layout="flat")
    with pytest.raises(ValueError, match="multiple of 16"):
        make_cache(2, 4, device="cpu", kv_format="glm_nope_fp8", row_stride=536)
    with pytest.raises(ValueError, match="rows are packed"):
        make_cache(2, 4, device="cpu", row_stride=600)
    with pytest.raises(ValueError, match="layout"):
        make_cache(2, 4, device="cpu", layout="nchw")
    with pytest.raises(ValueError, match="not a whole number of 528-byte rows"):
        make_cache(2, 4, device="cpu", kv_format="v41_fp8_inline", block_stride=4 * 528 + 16)


@pytest.mark.parametrize("kv_format,writer", [("v32_fp8", "vllm"), ("v32_fp8", "sglang"), ("glm_nope_fp8", "vllm"),
                                              ("glm_nope_fp8", "b12x"), ("v32_fp8", "flashmla"),
                                              ("model1_fp8", None), ("model1_nvfp4", "flashinfer"),
                                              ("v41_fp8", "flashinfer"), ("v41_fp8_inline", "b12x"),
                                              ("v41_nvfp4", "flashinfer"), ("v41_nvfp4_inline", "b12x")])
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
    if fmt.e2m1:  # e4m3 scales: 4 significant bits, so powers of two ~1/8 of them; never NaN
        assert pow2.float().mean() < 0.3 and not torch.isnan(scales).any()
        nonzero = binades[scales > 0]  # (a group 2**-8 times the data may round to scale 0)
        assert nonzero.max() - nonzero.min() >= 14 and (scales > 0).float().mean() > 0.99
    elif fmt.fp32_scales and writer in ("vllm", "sglang", "b12x"):
        assert pow2.float().mean() < 0.05  # amax / 448 is a power of two only for amax = 1.75 * 2**k (bf16 holds it)
    else:
        assert pow2.all()
    plain = make_cache(8, 64, device="cpu", kv_format=kv_format, writer=writer,
                       gen=torch.Generator().manual_seed(seed_for(f"spread {kv_format} {writer}")))
    assert not torch.equal(unpack_cache(plain, kv_format), unpack_cache(cache, kv_format))


@pytest.mark.parametrize("kv_format", sorted(FORMATS))
def test_make_cache_tiny(kv_format):
    """``tiny``: the bottom of the format's scales and the rope 0 (module doc of dispatch.tools.sample_inputs)."""
    fmt = get_format(kv_format)
    cache = make_cache(4, 32, device="cpu", kv_format=kv_format, tiny=True, gen=torch.Generator().manual_seed(9))
    view = read_cache_view(cache, kv_format)
    codes, scales, rope = gather_slot_parts(view, torch.arange(view.num_slots))
    assert (rope == 0).all() and (codes.abs().amax() == 6 if fmt.e2m1 else codes.abs().amax() > 100)
    if fmt.scale_type == "e4m3":  # the e4m3 subnormals m * 2**-9 and the smallest normal 2**-6
        assert set((scales * 2**9).flatten().tolist()) == set(range(1, 9))
        back = unpack_cache(cache, kv_format)
        assert torch.isfinite(back).all() and 0 < back[..., :fmt.nope_dims].abs().max() <= 6 * 2.0**-6
        return
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


# ---------------------------------------------------------------------- MODEL1 NVFP4 (e2m1 values, E4M3 scales)
def _nvfp4_block(nope_bytes: list, scale_bytes: list, rope: list | None = None, pad: bytes = bytes(4)) -> torch.Tensor:
    """A one-block, one-token MODEL1 NVFP4 cache ``[1, 1, 1, 384]`` from its bytes (224 nope
    bytes, 28 scale bytes, 64 rope values; the record's 4 pad bytes)."""
    rope = rope or [0.0] * 64
    raw = bytes(nope_bytes) + b"".join(bf16_bytes(v) for v in rope) + bytes(scale_bytes) + pad
    assert len(raw) == NVFP4_TOKEN_BYTES
    return torch.tensor(list(raw), dtype=torch.uint8).view(1, 1, 1, NVFP4_TOKEN_BYTES)


def test_nvfp4_nibble_order_is_low_nibble_first():
    """Element 2i sits in the low nibble of byte i, element 2i + 1 in the high one: in the
    packer's bytes and in the reader's values."""
    latent = torch.zeros(1, 1, 512)
    latent[0, 0, 0], latent[0, 0, 1] = 6.0, 0.5  # s = 1: codes 7 and 1
    latent[0, 0, 2], latent[0, 0, 3] = -1.0, 3.0  # codes 0xA and 5
    raw = storage_bytes(pack_latent(latent, "model1_nvfp4"))
    assert raw[0] == 0x17 and raw[1] == 0x5A and raw[2:NVFP4_NOPE_BYTES] == bytes(NVFP4_NOPE_BYTES - 2)
    assert raw[NVFP4_ROW] == 0x38  # e4m3 1.0
    nope = [0] * NVFP4_NOPE_BYTES
    nope[0], nope[1] = 0x17, 0xA5
    back = unpack_cache(_nvfp4_block(nope, [0x38] * 28)).flatten()
    assert back[:4].tolist() == [6.0, 0.5, 3.0, -1.0] and (back[4:] == 0).all()


def test_every_e2m1_code_decodes_to_its_value():
    """The 16 nibbles read as +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} (code 8 is -0), through the
    decoder and through the cache reader (nibble pairs 0..15 in 8 bytes, scale 1)."""
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert [e2m1_value(c) for c in range(16)] == want
    got = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert got.tolist() == want and torch.equal(torch.signbit(got), torch.arange(16) >= 8)
    nope = [(2 * i) | (2 * i + 1) << 4 for i in range(8)] + [0] * (NVFP4_NOPE_BYTES - 8)
    back = unpack_cache(_nvfp4_block(nope, [0x38] * 28)).flatten()
    assert back[:16].tolist() == want and torch.equal(torch.signbit(back[:16]), torch.arange(16) >= 8)
    assert torch.equal(e2m1_encode(got), torch.arange(16, dtype=torch.uint8))  # each value encodes to its code


def test_e2m1_encoder_rounds_ties_to_even_and_saturates():
    """Ties go to the even code, given as values (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
    5 -> 4), a float32 step off a tie to the nearer value; past 6 (infinity included) is 6;
    the sign of a zero is kept; and every float32 of a seeded sample over 40 binades encodes as
    the pure-Python specification's round-to-nearest-even does."""
    ties = {0.25: (0, 1), 0.75: (1, 2), 1.25: (2, 3), 1.75: (3, 4), 2.5: (4, 5), 3.5: (5, 6), 5.0: (6, 7)}
    xs, want = [], []
    for t, (lo, hi) in ties.items():  # the tie to the even code of the two; a step off it to the nearer
        even = lo if lo % 2 == 0 else hi
        xs += [t, -t, f32_step(t, -1), f32_step(t, 1), -f32_step(t, 1)]
        want += [even, even | 8, lo, hi, hi | 8]
    xs += [6.0, f32_step(6.0, 1), 7.0, 1e30, math.inf, -math.inf, -7.0, 0.0, -0.0, -1e-30, 1e-30, -0.25]
    want += [7, 7, 7, 7, 7, 15, 15, 0, 8, 8, 0, 8]
    got = e2m1_encode(torch.tensor(xs, dtype=torch.float32)).tolist()
    assert got == want, [(x, g, w) for x, g, w in zip(xs, got, want) if g != w]
    assert [e2m1_code(x) for x in xs] == want  # the specification agrees with the table above
    gen = torch.Generator().manual_seed(seed_for("e2m1 encoder"))
    sample = torch.randn(4000, generator=gen) * torch.exp2(torch.randint(-20, 21, (4000,), generator=gen).float())
    sample = torch.cat([sample, torch.tensor([t * k for t in ties for k in (1, -1, 2, 0.5)])])
    got = e2m1_encode(sample).tolist()
    assert got == [e2m1_code(x) for x in sample.tolist()]


def test_nvfp4_scale_edge_values():
    """E4M3 scale bytes 0 (the group reads 0 whatever its codes), 0x01 (2**-9, the smallest
    subnormal), 0x7E (448, the largest), 0x38 (1), 0x08 (2**-6, the smallest normal); and the
    writer reaching them: amax / 6 at the e4m3 tie 2**-10 rounds to 0 (every code 0), a
    float32 above it to 2**-9, amax 6 * 448 and past it to 448 (codes saturated at 6)."""
    fmt = get_format("model1_nvfp4")
    records = [0x00, 0x01, 0x7E, 0x38, 0x08] + [0x38] * 23
    assert decode_scales(fmt, torch.tensor([records], dtype=torch.uint8))[0, :5].tolist() == \
        [0.0, 2.0**-9, 448.0, 1.0, 2.0**-6]
    groups = unpack_cache(_nvfp4_block([0x77] * NVFP4_NOPE_BYTES, records)).flatten()[:448].view(28, 16)  # codes 6
    assert (groups[0] == 0).all() and (groups[1] == 6 * 2.0**-9).all() and (groups[2] == 2688.0).all()
    assert (groups[3] == 6.0).all() and (groups[4] == 6 * 2.0**-6).all()

    latent = torch.zeros(1, 1, 512)
    latent[0, 0, 0:2] = torch.tensor([6 * 2.0**-10, -2.0**-12])  # amax / 6 = 2**-10: the tie, to 0
    latent[0, 0, 16] = f32_step(6 * 2.0**-10, 1)  # a float32 above: 2**-9, and x * 512 = 3.0000002 -> 3
    latent[0, 0, 32:34] = torch.tensor([2688.0, -2.0])  # amax / 6 = 448; -2 / 448 -> -0
    latent[0, 0, 48:50] = torch.tensor([-1e6, 2000.0])  # amax / 6 saturates at 448; -1e6 / 448 at -6
    raw = storage_bytes(pack_latent(latent, "model1_nvfp4", fill=FILL))
    assert list(raw[NVFP4_ROW:NVFP4_ROW + 5]) == [0x00, 0x01, 0x7E, 0x7E, 0x00]
    assert raw[0:8] == bytes(8)  # s = 0: every code +0, the negative value's too
    assert raw[8] == 0x05 and raw[16] == 0x87 and raw[24] == 0x6F  # (3, 0), (6, -0), (-6, 4)
    codes, scales, _ = quantize_latent(latent[0, 0], "model1_nvfp4")
    assert scales[:4].tolist() == [0.0, 2.0**-9, 448.0, 448.0] and codes.dtype == torch.float32
    assert codes[[16, 32, 48, 49]].tolist() == [3.0, 6.0, -6.0, 4.0] and torch.signbit(codes[33])
    back = unpack_cache(pack_latent(latent, "model1_nvfp4")).flatten()
    assert (back[:16] == 0).all() and back[16] == 3 * 2.0**-9 and back[48] == -2688.0


def test_nvfp4_all_zero_group_is_scale_zero_and_codes_zero():
    """An all-zero group (and one of -0s and one whose amax / 6 rounds to scale 0): scale byte
    0 and every nibble +0 (the writer's "all codes 0 when s == 0"); it reads back as 0."""
    latent = torch.randn(1, 2, 512, generator=torch.Generator().manual_seed(seed_for("nvfp4 zero group")))
    latent[0, 0, 16:32] = 0.0
    latent[0, 0, 32:48] = -0.0
    latent[0, 1, 0:16] = -2.0**-13  # amax / 6 below 2**-10: scale 0
    raw = storage_bytes(pack_latent(latent, "model1_nvfp4", fill=FILL))
    footer = 2 * NVFP4_ROW
    assert raw[footer + 1] == 0 and raw[footer + 2] == 0 and raw[footer + NVFP4_RECORD] == 0
    assert raw[8:24] == bytes(16) and raw[NVFP4_ROW:NVFP4_ROW + 8] == bytes(8)
    assert raw[footer] != 0 and raw[footer + 3] != 0  # the neighbouring groups: nonzero scales
    back = unpack_cache(pack_latent(latent, "model1_nvfp4")).reshape(2, 512)
    assert (back[0, 16:48] == 0).all() and (back[1, :16] == 0).all() and not torch.signbit(back[0, 16:48]).any()


def test_nvfp4_footer_pad_bytes_are_zero():
    """Bytes 28..31 of every footer record are 0: whatever the packer's ``fill`` (which the
    block padding does take), and in ``make_cache``'s caches (whose non-data bytes are 0xFF)."""
    gen = torch.Generator().manual_seed(seed_for("nvfp4 pad"))
    page, block_stride = 5, 5 * NVFP4_TOKEN_BYTES + 32
    latent = torch.randn(3, page, 512, generator=gen) * 1e3
    raw = storage_bytes(pack_latent(latent, "model1_nvfp4", block_stride=block_stride, fill=0xFF))
    for b in range(3):
        for t in range(page):
            at = b * block_stride + page * NVFP4_ROW + t * NVFP4_RECORD
            assert raw[at + 28:at + 32] == bytes(4) and 0 not in raw[at:at + 28]
        assert raw[(b + 1) * block_stride - 32:(b + 1) * block_stride] == b"\xff" * 32  # padding: fill
    cache = make_cache(3, page, device="cpu", kv_format="model1_nvfp4", gen=gen)
    raw = storage_bytes(cache)
    stride = default_block_stride(get_format("model1_nvfp4"), page)
    assert stride == page * NVFP4_TOKEN_BYTES  # FlashInfer's tight blocks
    assert all(raw[b * stride + page * NVFP4_ROW + t * NVFP4_RECORD + 28:][:4] == bytes(4)
               for b in range(3) for t in range(page))


def _dequantize_nvfp4_bytes(raw: bytes, num_blocks: int, page: int, block_stride: int) -> torch.Tensor:
    """float64 ``[num_blocks, P, 512]`` from a MODEL1 NVFP4 buffer's bytes, by the
    specification alone: e2m1 nibble (low first) times its group's E4M3 byte, the rope bf16."""
    out = torch.empty(num_blocks, page, 512, dtype=torch.float64)
    for b in range(num_blocks):
        for t in range(page):
            row = b * block_stride + t * NVFP4_ROW
            record = b * block_stride + page * NVFP4_ROW + t * NVFP4_RECORD
            vals = []
            for i in range(448):
                byte = raw[row + i // 2]
                vals.append(e2m1_value(byte >> 4 if i % 2 else byte & 0xF) * e4m3_value(raw[record + i // 16]))
            for r in range(64):
                at = row + NVFP4_NOPE_BYTES + 2 * r
                vals.append(struct.unpack("<f", b"\0\0" + raw[at:at + 2])[0])
            out[b, t] = torch.tensor(vals, dtype=torch.float64)
    return out


def test_nvfp4_round_trip_equals_the_dequantized_bytes():
    """unpack(pack(latent)) equals, exactly, the float64 dequantization of the packed bytes
    (code x scale is exact in float32); ``gather_slots`` and ``gather_slot_parts`` agree with
    it; the float64 reference decode reads the same values."""
    gen = torch.Generator().manual_seed(seed_for("nvfp4 round trip bytes"))
    latent = (torch.randn(2, 6, 512, generator=gen)
              * torch.exp2(torch.randint(-12, 9, (2, 6, 1), generator=gen).float())).bfloat16()
    cache = pack_latent(latent, "model1_nvfp4")
    want = _dequantize_nvfp4_bytes(storage_bytes(cache), 2, 6, 6 * NVFP4_TOKEN_BYTES)
    back = unpack_cache(cache)
    assert back.dtype == torch.float32 and torch.equal(back.double(), want)
    assert torch.equal(back[..., 448:], latent[..., 448:].float())
    view = read_cache_view(cache)
    slots = torch.tensor([[11, 0, 7], [3, 3, 6]])
    assert torch.equal(gather_slots(view, slots), back.reshape(12, 512)[slots])
    nope, factor, rope = gather_slot_parts(view, slots)
    assert nope.shape == (2, 3, 28, 16) and factor.shape == (2, 3, 28) and rope.shape == (2, 3, 64)
    assert set(nope.abs().unique().tolist()) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
    assert torch.equal((nope * factor[..., None]).flatten(-2).double(), want.reshape(12, 512)[slots, :448])
    from cute_kernels.sparse_mla_decode.reference import reference_decode
    q = torch.randn(2, 4, 512, generator=gen, dtype=torch.float64)
    out, lse = reference_decode(q, cache, slots.int(), sm_scale=0.1)
    rows = want.reshape(12, 512)[slots]  # [T, k, 512]
    scores = torch.einsum("thd,tkd->thk", q, rows) * 0.1
    assert torch.allclose(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)
    assert torch.allclose(out, torch.einsum("thk,tkd->thd", torch.softmax(scores, -1), rows), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["nhd", "hnd", "flat"])
def test_nvfp4_unpack_of_a_padded_block_stride(layout):
    """A block stride past the block's P * 384 bytes (padding 0xFF in ``make_cache``; what
    FlashMLA-style allocations leave) reads as the tight blocks; the view's geometry is the
    cache's."""
    seed = seed_for("nvfp4 padded stride")
    tight = make_cache(4, 8, device="cpu", kv_format="model1_nvfp4", gen=torch.Generator().manual_seed(seed))
    stride = 8 * NVFP4_TOKEN_BYTES + 208
    padded = make_cache(4, 8, device="cpu", kv_format="model1_nvfp4", block_stride=stride, layout=layout,
                        gen=torch.Generator().manual_seed(seed))
    view = read_cache_view(padded, "model1_nvfp4")
    assert (view.block_stride, view.row_stride, view.page_block_size) == (stride, NVFP4_TOKEN_BYTES, 8)
    assert (torch.as_strided(padded, (4, 208), (stride, 1), 8 * NVFP4_TOKEN_BYTES).view(torch.uint8) == 0xFF).all()
    back = unpack_cache(padded, "model1_nvfp4")
    assert torch.isfinite(back).all() and torch.equal(back, unpack_cache(tight))
    want = _dequantize_nvfp4_bytes(storage_bytes(padded), 4, 8, stride)
    assert torch.equal(back.double(), want)


def test_width_384_names_model1_nvfp4():
    """A 4-D view 384 bytes wide is MODEL1 NVFP4 without ``kv_format`` (NHD and HND); a 2-D
    view of whole 384-byte tokens is read only where ``kv_format`` names it, and a 2-D MODEL1
    view whose blocks are also whole 384-byte tokens (P a multiple of 48) still reads as MODEL1."""
    assert format_of(torch.zeros(2, 4, 1, 384, dtype=torch.uint8), None).name == "model1_nvfp4"
    assert format_of(torch.zeros(2, 1, 4, 384, dtype=torch.uint8), None).name == "model1_nvfp4"
    cache = make_cache(3, 4, device="cpu", kv_format="model1_nvfp4", layout="hnd",
                       gen=torch.Generator().manual_seed(seed_for("width 384")))
    assert read_cache_view(cache).fmt.name == "model1_nvfp4"
    assert torch.equal(unpack_cache(cache), unpack_cache(cache, "model1_nvfp4"))
    flat = torch.as_strided(cache, (3, 4 * 384), (4 * 384, 1))
    with pytest.raises(CacheLayoutError, match=r"1536 bytes per block is read as \['model1_nvfp4'\] only where "
                                               r"kv_format= names it"):
        read_cache_view(flat)
    assert torch.equal(unpack_cache(flat, "model1_nvfp4"), unpack_cache(cache))
    assert format_of(torch.zeros(2, 48 * 584, dtype=torch.uint8), None).name == "model1_fp8"
    with pytest.raises(CacheLayoutError, match="expected \\[num_blocks, P, 1, 384\\]"):
        read_cache_view(torch.zeros(2, 4, 1, 584, dtype=torch.uint8), "model1_nvfp4")
    with pytest.raises(CacheLayoutError, match="token stride 384"):
        read_cache_view(torch.as_strided(torch.zeros(4 * 400 * 2, dtype=torch.uint8), (2, 4, 1, 384),
                                         (1600, 400, 400, 1)), "model1_nvfp4")


def test_nvfp4_packer_reproduces_the_writer_recipe_by_hand():
    """One token's bytes worked out by hand from FlashInfer's recipe. Group 0: amax 12, s = e4m3(2)
    = 0x40, 1 / s exact: x / 2 = 6, -6, 0.25 (tie: 0), 0.3125 (0.5), 0.75 (tie: 1), 1.25 (tie: 1),
    1.75 (tie: 2), 2.5 (tie: 2), 3.5 (tie: 4), 5 (tie: 4), 5.5 (6), -0 (-0), -0.2 (-0), -1.5,
    0, 3. Group 1: amax 6 * 0x0F's value, s = 0.029296875 = 0x0F, whose float32 reciprocal
    34.133335 is above 1 / s: x = 1.25 s, 2.5 s, 5 s (ties that x / s rounds down) come out one
    code up (1.5, 3, 6). Groups 2..27: 0 (scale 0, codes 0). Rope copied bit for bit."""
    xs0 = [12.0, -12.0, 0.5, 0.625, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0, 11.0, -0.0, -0.4, -3.0, 0.0, 6.0]
    s1 = 0.029296875
    xs1 = [6 * s1, 1.25 * s1, 2.5 * s1, 5.0 * s1, -1.25 * s1] + [0.0] * 11
    rope = [1.5, -2.0, 0.0078125, -0.0, 2.0**100, -(2.0**-130)] + [0.25 * k - 3 for k in range(58)]
    latent = torch.tensor([[xs0 + xs1 + [0.0] * 416 + rope]], dtype=torch.float32)
    raw = storage_bytes(pack_latent(latent, "model1_nvfp4", fill=FILL))
    assert len(raw) >= NVFP4_TOKEN_BYTES
    # group 0 nibbles 7, F, 0, 1, 2, 2, 4, 4, 6, 6, 7, 8, 8, B, 0, 5 -> bytes (high << 4 | low)
    assert list(raw[0:8]) == [0xF7, 0x10, 0x22, 0x44, 0x66, 0x87, 0xB8, 0x50]
    # group 1 nibbles 7, 3, 5, 7, B, 0...
    assert list(raw[8:16]) == [0x37, 0x75, 0x0B, 0, 0, 0, 0, 0]
    assert raw[16:NVFP4_NOPE_BYTES] == bytes(NVFP4_NOPE_BYTES - 16)
    assert raw[NVFP4_NOPE_BYTES:NVFP4_ROW] == b"".join(bf16_bytes(v) for v in rope)
    assert list(raw[NVFP4_ROW:NVFP4_ROW + NVFP4_RECORD]) == [0x40, 0x0F] + [0] * 30
    # the specification's helpers agree (the byte test's source of truth)
    assert expected_group("model1_nvfp4", "flashinfer", xs0) == (b"\x40", [7, 15, 0, 1, 2, 2, 4, 4, 6, 6, 7, 8, 8,
                                                                           11, 0, 5])
    assert expected_group("model1_nvfp4", "flashinfer", [f32(v) for v in xs1])[1][:5] == [7, 3, 5, 7, 11]


# ---------------------------------------------------------------------- DeepSeek-V4.1 (FP8, NVFP4; footer, inline)
V41_FP8_FORMATS = ("v41_fp8", "v41_fp8_inline")
V41_NVFP4_FORMATS = ("v41_nvfp4", "v41_nvfp4_inline")
INLINE_OF = {"v41_fp8": "v41_fp8_inline", "v41_nvfp4": "v41_nvfp4_inline"}


def v41_block(kv_format: str, tokens: list) -> torch.Tensor:
    """A one-block V4.1 cache ``[1, P, 1, W]`` from its tokens' bytes, each (data, scale bytes),
    laid out as the specification says (``V41_LAYOUT``): footer, the P data rows then the P
    scale records; inline, P records [data | scales] back to back."""
    _, data, scales, footer = V41_LAYOUT[kv_format]
    assert all(len(d) == data and len(sc) == scales for d, sc in tokens)
    if footer:
        raw = b"".join(bytes(d) for d, _ in tokens) + b"".join(bytes(sc) for _, sc in tokens)
    else:
        raw = b"".join(bytes(d) + bytes(sc) for d, sc in tokens)
    return torch.tensor(list(raw), dtype=torch.uint8).view(1, len(tokens), 1, data + scales)


def v41_token_at(kv_format: str, page: int, block_stride: int, row_stride: int, block: int, t: int):
    """(data byte, scale byte) offsets of row ``t`` of ``block`` by the specification."""
    _, data, scales, footer = V41_LAYOUT[kv_format]
    base = block * block_stride
    if footer:
        return base + t * data, base + page * data + t * scales
    return base + t * row_stride, base + t * row_stride + data


@pytest.mark.parametrize("kv_format,writer", [(f, w) for f in V41_LAYOUT for w in WRITERS[f]])
def test_v41_round_trip_is_the_writers_dequantized_values(kv_format, writer):
    """unpack(pack(latent)) is exactly the writer's codes x scales (``quantize_latent``) and the
    specification's dequantization of the packed bytes, for the default and padded strides."""
    fmt = get_format(kv_format)
    seed = seed_for(f"v41 round trip {kv_format} {writer}")
    gen = torch.Generator().manual_seed(seed)
    latent = (torch.randn(3, 6, 512, generator=gen)
              * torch.exp2(torch.randint(-14, 12, (3, 6, 1), generator=gen).float())).bfloat16().float()
    codes, scales, rope = quantize_latent(latent, kv_format, writer)
    assert scales.dtype == torch.float32 and rope.shape == (3, 6, 0)
    want = (codes.float().reshape(3, 6, fmt.num_scales, fmt.scale_group) * scales[..., None]).reshape(3, 6, 512)
    assert torch.isfinite(want).all(), f"[seed {seed}]"
    for row_stride, pad in STRIDE_CASES[kv_format]:
        pitch = row_stride or TOKEN_BYTES.get(kv_format) or fmt.row_pitches[0]
        block_stride = default_block_stride(fmt, 6, row_stride) + pad
        cache = pack_latent(latent, kv_format, writer=writer, row_stride=row_stride, block_stride=block_stride)
        back = unpack_cache(cache, kv_format)
        assert torch.equal(back, want), f"[seed {seed}] row_stride={row_stride} pad={pad}"
        raw = storage_bytes(cache)
        spec = torch.tensor([v41_value(kv_format, raw, *v41_token_at(kv_format, 6, block_stride, pitch, b, t))
                             for b in range(3) for t in range(6)], dtype=torch.float64).view(3, 6, 512)
        assert torch.equal(back.double(), spec), f"[seed {seed}] row_stride={row_stride} pad={pad}"


def test_v41_default_block_strides():
    """FlashInfer's tight footer blocks (P * 528, P * 288) and inline records back to back."""
    for page in (1, 2, 7, 64):
        assert default_block_stride(get_format("v41_fp8"), page) == page * 528
        assert default_block_stride(get_format("v41_nvfp4"), page) == page * 288
        assert default_block_stride(get_format("v41_fp8_inline"), page) == page * 528
        assert default_block_stride(get_format("v41_nvfp4_inline"), page, 320) == page * 320


@pytest.mark.parametrize("kv_format", V41_NVFP4_FORMATS)
def test_v41_nvfp4_nibble_order_is_low_nibble_first(kv_format):
    """Element 2i in the low nibble of byte i, 2i + 1 in the high one: in the packer's bytes of
    token 1 (where the layout puts its data) and in the reader's values of a hand-made block."""
    latent = torch.zeros(1, 2, 512)
    latent[0, 1, :4] = torch.tensor([6.0, 0.5, -1.0, 3.0])  # s = e4m3(6 / 6) = 1: codes 7, 1, 0xA, 5
    for writer in WRITERS[kv_format]:
        raw = storage_bytes(pack_latent(latent, kv_format, writer=writer, fill=FILL))
        row, scale_at = v41_token_at(kv_format, 2, 2 * 288, 288, 0, 1)
        assert raw[row:row + 2] == bytes([0x17, 0x5A]) and raw[row + 2:row + 256] == bytes(254), writer
        assert raw[scale_at] == 0x38 and raw[scale_at + 1:scale_at + 32] == b"\x01" * 31, writer  # 1; zeros: 2**-9
    data = bytes([0x17, 0xA5]) + bytes(254)
    cache = v41_block(kv_format, [(bytes(256), b"\x38" * 32), (data, b"\x38" * 32)])
    back = unpack_cache(cache, kv_format)[0, 1]
    assert back[:4].tolist() == [6.0, 0.5, 3.0, -1.0] and (back[4:] == 0).all()


@pytest.mark.parametrize("kv_format", V41_NVFP4_FORMATS)
def test_every_e2m1_code_decodes_in_v41_rows(kv_format):
    """The 16 nibbles (pairs 0..15 in 8 bytes) read as +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} times the
    group's scale (1 in token 0, 2 in token 1), -0 kept."""
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    data = bytes([(2 * i) | (2 * i + 1) << 4 for i in range(8)]) + bytes(248)
    cache = v41_block(kv_format, [(data, b"\x38" * 32), (data, b"\x40" * 32)])
    back = unpack_cache(cache, kv_format)[0]
    for t, s in ((0, 1.0), (1, 2.0)):
        assert back[t, :16].tolist() == [v * s for v in want]
        assert torch.equal(torch.signbit(back[t, :16]), torch.arange(16) >= 8)
        assert (back[t, 16:] == 0).all()


@pytest.mark.parametrize("kv_format", V41_NVFP4_FORMATS)
def test_v41_nvfp4_scale_edge_values(kv_format):
    """E4M3 scale bytes 0 (the group reads 0), 0x01 (2**-9, the smallest subnormal), 0x7E (448)
    decode exactly; and the V4.1 writers reach 2**-9 where amax / 6 is below it (the clamp: no
    scale 0) and 448 at and past amax 6 * 448 (codes saturated at 6)."""
    fmt = get_format(kv_format)
    records = bytes([0x00, 0x01, 0x7E]) + b"\x38" * 29
    assert decode_scales(fmt, torch.tensor([list(records)], dtype=torch.uint8))[0, :3].tolist() == [0.0, 2.0**-9,
                                                                                                    448.0]
    groups = unpack_cache(v41_block(kv_format, [(b"\x77" * 256, records)]), kv_format).view(32, 16)  # codes 6
    assert (groups[0] == 0).all() and (groups[1] == 6 * 2.0**-9).all() and (groups[2] == 2688.0).all()
    assert (groups[3:] == 6.0).all()

    latent = torch.zeros(1, 1, 512)
    latent[0, 0, 0:2] = torch.tensor([6 * 2.0**-10, -2.0**-12])  # amax / 6 = 2**-10 < 2**-9: clamped
    latent[0, 0, 16:18] = torch.tensor([2688.0, -2.0])  # amax / 6 = 448
    latent[0, 0, 32:34] = torch.tensor([-1e6, 2000.0])  # past 448: 448, codes -6 and 4
    for writer in WRITERS[kv_format]:
        raw = storage_bytes(pack_latent(latent, kv_format, writer=writer, fill=FILL))
        assert list(raw[256:259]) == [0x01, 0x7E, 0x7E], writer
        # 2**-10 * 6 / 2**-9 = 3 (code 5), -2**-12 / 2**-9 = -0.125 (-0: 8); 2688 / 448 = 6, -2 / 448 -> -0;
        # -1e6 / 448 saturates at -6 (0xF), 2000 / 448 = 4.46 -> 4 (6)
        assert raw[0] == 0x85 and raw[8] == 0x87 and raw[16] == 0x6F, writer
        codes, scales, _ = quantize_latent(latent[0, 0], kv_format, writer)
        assert scales[:3].tolist() == [2.0**-9, 448.0, 448.0] and (scales[3:] == 2.0**-9).all(), writer
        back = unpack_cache(pack_latent(latent, kv_format, writer=writer), kv_format).flatten()
        assert back[[0, 1, 16, 32, 33]].tolist() == [3 * 2.0**-9, -0.0, 2688.0, -2688.0, 1792.0], writer


@pytest.mark.parametrize("kv_format", list(V41_LAYOUT))
def test_v41_all_zero_groups(kv_format):
    """An all-zero group: FP8, the smallest scale of the writer's floor (FlashInfer 2**-13,
    byte 114; b12x 2**-22, byte 105) and zero codes; FP4, scale byte 0x01 (the 2**-9 clamp)
    and zero codes. A group of -0s keeps the sign of each zero (e4m3 0x80, e2m1 nibble 8). Each
    reads back as zeros; the neighbouring groups are untouched."""
    fmt = get_format(kv_format)
    seed = seed_for(f"v41 zero groups {kv_format}")
    latent = torch.randn(1, 1, 512, generator=torch.Generator().manual_seed(seed)) * 10
    g = fmt.scale_group
    latent[0, 0, g:2 * g] = 0.0
    latent[0, 0, 2 * g:3 * g] = -0.0
    floors = {"flashinfer": 114, "b12x": 105}
    for writer in WRITERS[kv_format]:
        raw = storage_bytes(pack_latent(latent, kv_format, writer=writer, fill=FILL))
        row, scale_at = v41_token_at(kv_format, 1, 0, 0, 0, 0)
        zero_scale = 0x01 if fmt.e2m1 else floors[writer]
        assert raw[scale_at + 1] == raw[scale_at + 2] == zero_scale, f"[seed {seed}] {writer}"
        assert raw[scale_at] != zero_scale and raw[scale_at + 3] != zero_scale, f"[seed {seed}] {writer}"
        width = g // 2 if fmt.e2m1 else g  # bytes per group
        assert raw[row + width:row + 2 * width] == bytes(width), f"[seed {seed}] {writer}"
        assert raw[row + 2 * width:row + 3 * width] == (b"\x88" if fmt.e2m1 else b"\x80") * width, writer
        back = unpack_cache(pack_latent(latent, kv_format, writer=writer), kv_format).flatten()
        assert (back[g:3 * g] == 0).all() and torch.signbit(back[2 * g:3 * g]).all(), f"[seed {seed}] {writer}"
        assert not torch.signbit(back[g:2 * g]).any() and (back[:g] != 0).any()


@pytest.mark.parametrize("kv_format", list(V41_LAYOUT))
def test_v41_nan_and_inf_groups(kv_format):
    """FlashInfer's V4.1 writers poison a group that holds NaN or Inf. FP8: a NaN gives scale
    byte 0xFF and every code 0x7F; an Inf (no NaN) scale byte 0xFF, code 0x7F for each Inf
    element (of either sign) and +-0 for the rest. FP4: scale byte 0x7F and every code 0. The
    scales round-trip (inf, NaN), each such group reads back as NaN throughout, and the other
    groups are as for a finite latent."""
    fmt = get_format(kv_format)
    seed = seed_for(f"v41 nan inf {kv_format}")
    latent = torch.randn(1, 2, 512, generator=torch.Generator().manual_seed(seed)) * 3
    g = fmt.scale_group
    latent[0, 1, g + 3] = math.nan  # group 1: a NaN
    latent[0, 1, 2 * g] = math.inf  # group 2: +Inf and -Inf among finite values of either sign
    latent[0, 1, 2 * g + 5] = -math.inf
    latent[0, 1, 2 * g + 1] = -0.0
    latent[0, 1, 3 * g + 1] = -math.inf  # group 3: Inf and NaN
    latent[0, 1, 3 * g + 2] = math.nan
    bad = [1, 2, 3]
    finite = latent.clone()
    finite[0, 1, g:4 * g] = 1.0
    raw = storage_bytes(pack_latent(latent, kv_format, fill=FILL))
    ref_raw = storage_bytes(pack_latent(finite, kv_format, fill=FILL))
    row, scale_at = v41_token_at(kv_format, 2, 2 * TOKEN_BYTES.get(kv_format, fmt.row_bytes), fmt.row_bytes, 0, 1)
    width = g // 2 if fmt.e2m1 else g
    x = latent[0, 1].tolist()
    for k in bad:
        data = raw[row + k * width:row + (k + 1) * width]
        spec_scale, spec_codes = expected_group(kv_format, "flashinfer", x[k * g:(k + 1) * g])
        if fmt.e2m1:
            assert raw[scale_at + k] == 0x7F and data == bytes(width), f"[seed {seed}] group {k}"
            assert spec_scale == b"\x7f" and spec_codes == [0] * g
        elif k == 2:
            want = [0x7F if math.isinf(v) else (0x80 if math.copysign(1, v) < 0 else 0) for v in x[k * g:(k + 1) * g]]
            assert raw[scale_at + k] == 0xFF and list(data) == want == spec_codes, f"[seed {seed}]"
            assert data[0] == data[5] == 0x7F and data[1] == 0x80 and 0 in data and 0x80 in data[2:]
        else:
            assert raw[scale_at + k] == 0xFF and data == b"\x7f" * width, f"[seed {seed}] group {k}"
            assert spec_codes == [0x7F] * g
        assert raw[scale_at + k] == spec_scale[0]
    good = [k for k in range(fmt.num_scales) if k not in bad]
    for k in good:  # untouched: the bytes of the finite latent
        assert raw[scale_at + k] == ref_raw[scale_at + k]
        assert raw[row + k * width:row + (k + 1) * width] == ref_raw[row + k * width:row + (k + 1) * width]
    _, scales, _ = quantize_latent(latent, kv_format)
    if fmt.e2m1:
        assert torch.isnan(scales[0, 1, bad]).all()
    else:
        assert torch.isposinf(scales[0, 1, bad]).all()
    back = unpack_cache(pack_latent(latent, kv_format), kv_format).reshape(2, fmt.num_scales, g)
    assert torch.isnan(back[1, bad]).all(), f"[seed {seed}]"
    assert torch.isfinite(back[1, good]).all() and torch.isfinite(back[0]).all()
    assert torch.equal(back[1, good], unpack_cache(pack_latent(finite, kv_format), kv_format).reshape(
        2, fmt.num_scales, g)[1, good])


@pytest.mark.parametrize("footer", list(INLINE_OF))
def test_v41_inline_and_footer_read_back_identically(footer):
    """The same latent packed with footer scales and with inline records (rows 528 / 288 apart
    and wider) reads back the same, by every writer, through ``unpack_cache`` and ``gather_slots``."""
    inline = INLINE_OF[footer]
    seed = seed_for(f"v41 inline footer {footer}")
    gen = torch.Generator().manual_seed(seed)
    latent = (torch.randn(4, 8, 512, generator=gen)
              * torch.exp2(torch.randint(-8, 8, (4, 8, 1), generator=gen).float())).bfloat16()
    pitch = get_format(inline).row_pitches[0]
    slots = torch.randint(0, 32, (5, 7), generator=gen)
    for writer in WRITERS[footer]:
        a = unpack_cache(pack_latent(latent, footer, writer=writer), footer)
        for row_stride in (pitch, pitch + 32):
            packed = pack_latent(latent, inline, writer=writer, row_stride=row_stride)
            assert torch.equal(unpack_cache(packed, inline), a), f"[seed {seed}] {writer} {row_stride}"
        packed = pack_latent(latent, inline, writer=writer)
        got = gather_slots(read_cache_view(packed, inline), slots)
        assert torch.equal(got, gather_slots(read_cache_view(pack_latent(latent, footer, writer=writer), footer),
                                             slots)), f"[seed {seed}] {writer}"
        assert torch.equal(got, a.reshape(32, 512)[slots])


@pytest.mark.parametrize("kv_format,row_stride", [("v41_fp8_inline", 528), ("v41_fp8_inline", 544),
                                                  ("v41_nvfp4_inline", 288), ("v41_nvfp4_inline", 320)])
def test_flat_rows_address_rows_of_the_whole_cache(kv_format, row_stride):
    """Blocks of P = 5 tokens padded to R = 8 rows: index r reads block r // R, row r % R, the
    bytes at (r // R) * block_stride + (r % R) * row_stride (checked against the bytes decoded
    by the specification), the padding rows of every block but the last included (num_slots
    = (num_blocks - 1) * R + P); b12x's paged slot s, at (s // P) * block_stride + (s % P) *
    row_stride, is another row there. Unpadded (block_stride = P * row_stride), the flat
    index and the paged slot name the same bytes."""
    fmt = get_format(kv_format)
    seed = seed_for(f"flat rows {kv_format} {row_stride}")
    gen = torch.Generator().manual_seed(seed)
    nb, page, rows_per_block = 3, 5, 8
    block_stride = rows_per_block * row_stride
    # every row of the storage, padding rows included, holds a token: pack R rows per block and
    # view the first P of each block as the cache's tokens
    latent = (torch.randn(nb, rows_per_block, 512, generator=gen)
              * torch.exp2(torch.randint(-6, 6, (nb, rows_per_block, 1), generator=gen).float()))
    full = pack_latent(latent, kv_format, row_stride=row_stride)
    cache = torch.as_strided(full, (nb, page, 1, fmt.row_bytes), (block_stride, row_stride, row_stride, 1))
    view = read_cache_view(cache, kv_format)
    assert (view.page_block_size, view.index_page, view.block_stride, view.row_stride) == (page, 8, block_stride,
                                                                                           row_stride)
    assert view.num_slots == (nb - 1) * rows_per_block + page == 21
    raw = storage_bytes(cache)
    data = V41_LAYOUT[kv_format][1]

    def at(address):
        return torch.tensor(v41_value(kv_format, raw, address, address + data), dtype=torch.float32)

    got = gather_slots(view, torch.arange(view.num_slots))
    for r in range(view.num_slots):
        flat = (r // rows_per_block) * block_stride + (r % rows_per_block) * row_stride
        assert torch.equal(got[r], at(flat)), f"[seed {seed}] index {r}"
    assert torch.equal(got, unpack_cache(full, kv_format).reshape(-1, 512)[:21])
    paged = (page // page) * block_stride + (page % page) * row_stride  # b12x's slot P: block 1, row 0
    assert torch.equal(got[page], at(page * row_stride)) and not torch.equal(got[page], at(paged))
    assert torch.equal(got[rows_per_block], at(paged))  # block 1, row 0 is flat row R
    # the tokens: block b, row t < P, in unpack_cache's [num_blocks, P] order
    assert torch.equal(unpack_cache(cache, kv_format), unpack_cache(full, kv_format)[:, :page])

    tight = pack_latent(latent[:, :page], kv_format, row_stride=row_stride)
    view = read_cache_view(tight, kv_format)
    assert (view.index_page, view.num_slots, view.block_stride) == (page, nb * page, page * row_stride)
    raw = storage_bytes(tight)
    got = gather_slots(view, torch.arange(nb * page))
    for s in range(nb * page):
        assert torch.equal(got[s], at((s // page) * page * row_stride + (s % page) * row_stride)), f"[seed {seed}]"


def test_flat_row_blocks_must_be_whole_rows():
    """A flat-row cache whose block stride is no whole number of its rows is refused (reader and
    packer) with the stride to pad to; one-token blocks are rows themselves (R = 1, the row
    stride is the block stride, as FlashInfer takes the pitch of one-row pages); a lone
    block's stride is no distance and is taken as whole rows."""
    base = torch.zeros(3 * 4 * 528 + 64, dtype=torch.uint8)
    bad = torch.as_strided(base, (3, 4, 1, 528), (4 * 528 + 16, 528, 528, 1))
    with pytest.raises(CacheLayoutError, match=r"block stride 2128 bytes is not a whole number of 528-byte rows: "
                                               r"v41_fp8_inline indices count rows of the whole cache .* pad blocks to "
                                               r"a multiple of the row stride \(e\.g\. 2640 bytes\)"):
        read_cache_view(bad, "v41_fp8_inline")
    assert read_cache_view(bad, "glm_nope_fp8").index_page == 4  # paged addressing takes any stride
    with pytest.raises(ValueError, match="block_stride: block stride 2128 bytes is not a whole number"):
        pack_latent(torch.zeros(3, 4, 512), "v41_fp8_inline", block_stride=4 * 528 + 16)
    with pytest.raises(ValueError, match="not a whole number of 320-byte rows"):
        pack_latent(torch.zeros(3, 4, 512), "v41_nvfp4_inline", row_stride=320, block_stride=5 * 288)

    gen = torch.Generator().manual_seed(seed_for("flat rows one-token blocks"))
    latent = torch.randn(4, 1, 512, generator=gen)
    one = pack_latent(latent, "v41_nvfp4_inline", block_stride=304)  # 304: no whole number of 288-byte rows
    view = read_cache_view(one, "v41_nvfp4_inline")
    assert (view.row_stride, view.block_stride, view.index_page, view.num_slots) == (304, 304, 1, 4)
    assert torch.equal(gather_slots(view, torch.arange(4)), unpack_cache(pack_latent(latent, "v41_nvfp4_inline"),
                                                                         "v41_nvfp4_inline").reshape(4, 512))
    lone = torch.as_strided(torch.zeros(3 * 528 + 16, dtype=torch.uint8), (1, 3, 1, 528), (3 * 528 + 16, 528, 528, 1))
    view = read_cache_view(lone, "v41_fp8_inline")
    assert (view.block_stride, view.index_page, view.num_slots) == (4 * 528, 4, 3)


def test_widths_528_and_288_need_the_format_named():
    """528 bytes (GLM-5.3, V4.1 FP8 footer or inline) and 288 (V4.1 NVFP4 footer or inline) are
    refused without ``kv_format``, naming the candidates, in 4-D and 2-D views; 384 still reads
    as MODEL1 NVFP4."""
    with pytest.raises(CacheLayoutError, match=re.escape("528 bytes wide is ambiguous: pass kv_format= (one of "
                                                         "['glm_nope_fp8', 'v41_fp8', 'v41_fp8_inline'])")):
        format_of(torch.zeros(2, 4, 1, 528, dtype=torch.uint8), None)
    with pytest.raises(CacheLayoutError, match=re.escape("288 bytes wide is ambiguous: pass kv_format= (one of "
                                                         "['v41_nvfp4', 'v41_nvfp4_inline'])")):
        format_of(torch.zeros(2, 1, 4, 288, dtype=torch.uint8), None)
    with pytest.raises(CacheLayoutError, match=re.escape("its 2112 bytes per block fit ['glm_nope_fp8', 'v41_fp8', "
                                                         "'v41_fp8_inline']")):
        read_cache_view(torch.zeros(2, 4 * 528, dtype=torch.uint8))
    with pytest.raises(CacheLayoutError, match=re.escape("1440 bytes per block is read as ['v41_nvfp4', "
                                                         "'v41_nvfp4_inline'] only where kv_format= names it")):
        read_cache_view(torch.zeros(2, 5 * 288, dtype=torch.uint8))
    assert format_of(torch.zeros(2, 4, 1, 384, dtype=torch.uint8), None).name == "model1_nvfp4"
    for name in V41_LAYOUT:
        assert format_of(torch.zeros(2, 4, 1, get_format(name).view_widths[0], dtype=torch.uint8), name).name == name


def test_extra_format_of():
    """The extra cache's format: named (and checked), else the main's own where the width is
    one of its views', else what its own width names, else the one paired format that fits
    (V4.1's 288-byte rows: footer beside footer, inline beside inline); widths still ambiguous
    refused naming the formats the main combines with that fit."""
    def cache(width, dim=4):
        return torch.zeros(2, 4, 1, width, dtype=torch.uint8) if dim == 4 else torch.zeros(2, 4 * width,
                                                                                           dtype=torch.uint8)
    fmt = get_format
    assert extra_format_of(cache(528), fmt("v41_fp8"), None).name == "v41_fp8"  # same format
    assert extra_format_of(cache(528), fmt("v41_fp8_inline"), None).name == "v41_fp8_inline"
    assert extra_format_of(cache(528, 2), fmt("v41_fp8"), None).name == "v41_fp8"
    assert extra_format_of(cache(584), fmt("model1_fp8"), None).name == "model1_fp8"
    assert extra_format_of(cache(384), fmt("model1_fp8"), None).name == "model1_nvfp4"  # by its own width
    assert extra_format_of(cache(584), fmt("model1_nvfp4"), None).name == "model1_fp8"
    assert extra_format_of(cache(528), fmt("v41_fp8"), "v41_fp8_inline").name == "v41_fp8_inline"  # named
    assert extra_format_of(cache(528), fmt("v41_fp8_inline"), "v41_fp8").name == "v41_fp8"
    for main, paired in (("v41_fp8", "v41_nvfp4"), ("v41_fp8_inline", "v41_nvfp4_inline")):
        assert extra_format_of(cache(288), fmt(main), "v41_nvfp4_inline").name == "v41_nvfp4_inline"
        assert extra_format_of(cache(288, 2), fmt(main), "v41_nvfp4").name == "v41_nvfp4"
        for dim in (4, 2):  # the one NVFP4 record of the main's scale placement
            assert extra_format_of(cache(288, dim), fmt(main), None).name == paired
    with pytest.raises(CacheLayoutError, match="extra_kv_format must be one of"):
        extra_format_of(cache(288), fmt("v41_fp8"), "v41_fp4")
    with pytest.raises(CacheLayoutError, match=re.escape("an extra cache of 528-byte rows fits none of the formats a "
                                                         "model1_fp8 main cache combines with (['model1_fp8', "
                                                         "'model1_nvfp4'])")):
        extra_format_of(cache(528), fmt("model1_fp8"), None)
    with pytest.raises(CacheLayoutError, match="528 bytes wide is ambiguous: pass kv_format="):
        extra_format_of(cache(528), fmt("v32_fp8"), None)  # a format no model pairs: as format_of
