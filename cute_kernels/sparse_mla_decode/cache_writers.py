"""The engines' cache writers, as torch recipes: how each writer quantizes a latent into a
format's bytes (``WRITERS``: per format, per writer, its scale recipe), and ``pack_latent``,
which lays the result out as a cache view (``cache_view``) the kernels and the engines read."""

from __future__ import annotations

import torch

from .cache_view import ALIGN, block_used_bytes, default_block_stride, flat_row_block_error
from .e2m1 import E2M1_MAX, e2m1_decode, e2m1_encode, pack_nibbles
from .kv_format import FLT_MIN, FORMATS, FP8_E4M3_MAX, UE8M0_BIAS, KvFormat, get_format


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to e4m3 (nearest even) as every GPU writer's satfinite conversion does:
    clamped to +-448 first; NaN stays NaN."""
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def _pow2_ceil(ratio: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(ratio)) for positive float32 ``ratio``, exactly (from frexp); infinity
    and NaN stay as they are (frexp has no exponent for them)."""
    mant, exp = torch.frexp(ratio)
    pow2 = torch.ldexp(torch.ones_like(ratio), torch.where(mant == 0.5, exp - 1, exp))
    return torch.where(torch.isfinite(ratio), pow2, ratio)


def _flashmla_pow2(groups: torch.Tensor):
    """FlashMLA's reference: s = 2**ceil(log2(max(amax / 448, 1e-4))), codes e4m3(x / s)."""
    amax = groups.abs().amax(dim=-1)
    scale = _pow2_ceil(torch.clamp(amax / FP8_E4M3_MAX, min=1e-4))
    return scale, _e4m3(groups / scale[..., None])


def _vllm_pow2(groups: torch.Tensor):
    """vLLM's DeepSeek-V4 compressor: s = 2**ceil(log2(max(amax, 1e-4) / 448))."""
    amax = groups.abs().amax(dim=-1).clamp_min(1e-4)
    scale = _pow2_ceil(amax / FP8_E4M3_MAX)
    return scale, _e4m3(groups / scale[..., None])


def _vllm_fp32(groups: torch.Tensor):
    """vLLM's ``fp8_ds_mla`` writer: s = max(amax / 448, FLT_MIN), codes satfinite(x / s)."""
    amax = groups.abs().amax(dim=-1)
    scale = torch.clamp(amax / FP8_E4M3_MAX, min=FLT_MIN)
    return scale, _e4m3(groups / scale[..., None])


def _sglang_fp32(groups: torch.Tensor):
    """SGLang's DSA writer: s = amax / 448 (no floor), codes e4m3(clamp(x * (1 / s))); an
    all-zero group has s = 0 and NaN codes (0 * inf), as that writer leaves it."""
    amax = groups.abs().amax(dim=-1)
    scale = amax / FP8_E4M3_MAX
    return scale, _e4m3(groups * (1.0 / scale)[..., None])


def _b12x_glm_next(groups: torch.Tensor):
    """b12x's GLM-5.3 (``GLM_NEXT``) writer: s = amax * fl32(1 / 448), or 1 for an all-zero
    group; codes e4m3(x * (1 / s)) (its GPU reciprocal is ``rcp.approx``, within an ulp of this)."""
    amax = groups.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax * torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32), 1.0)
    return scale, _e4m3(groups * (1.0 / scale)[..., None])


def _flashinfer_nvfp4(groups: torch.Tensor):
    """FlashInfer's DeepSeek-V4 NVFP4 writer (group 16, no global scale): the scale
    s = e4m3_satfinite(amax / 6) (amax over the group, float32), the codes
    e2m1_satfinite(x * (1 / s)) (a float32 reciprocal, then the product, round to nearest
    even); every code of a group with s == 0 is +0. Returns (s as float32: an e4m3 value,
    the codes as float32 values of the e2m1 grid, signed zeros kept)."""
    amax = groups.abs().amax(dim=-1)
    scale = _e4m3(amax / E2M1_MAX).float()
    codes = e2m1_decode(e2m1_encode(groups * (1.0 / scale)[..., None]))
    return scale, torch.where((scale == 0)[..., None], 0.0, codes)


E4M3_NAN = 0x7F  # the e4m3 byte every GPU writer's conversion gives NaN (satfinite: NaN -> 0x7F)


def _flashinfer_v41_fp8(groups: torch.Tensor):
    """FlashInfer's DeepSeek-V4.1 FP8 writer (``dsv41_fp8_quantize_{pack,append}``, group 32):
    a finite group as FlashMLA's reference (``_flashmla_pow2``: it clamps amax at 1e-4 as well,
    but the ratio floor dominates, so the bytes are the same); a group holding a NaN: scale
    byte 0xFF (2**128, infinity as a float32) and every code 0x7F; a group holding an infinity
    and no NaN: scale byte 0xFF, code 0x7F for each infinite element and +-0 (the element's
    sign) for the rest. Either group reads as NaN throughout (inf x NaN, inf x 0)."""
    nan = torch.isnan(groups)
    poisoned = (~torch.isfinite(groups)).any(dim=-1)
    scale, codes = _flashmla_pow2(torch.where(torch.isfinite(groups), groups, 0.0))
    marks = torch.where(nan.any(dim=-1, keepdim=True) | torch.isinf(groups), E4M3_NAN,
                        torch.signbit(groups).to(torch.uint8) << 7).to(torch.uint8)
    codes = torch.where(poisoned[..., None], marks, codes.view(torch.uint8)).view(torch.float8_e4m3fn)
    return torch.where(poisoned, torch.inf, scale), codes


def _b12x_v41_fp8(groups: torch.Tensor):
    """b12x's DeepSeek-V4.1 SWA writer: s = pow2_ceil(max(amax, 1e-4) * fl32(1 / 448)) (an
    amax floor: the smallest scale is 2**-22), codes e4m3(x * (1 / s)) (its ``rcp.approx`` of a
    power of two is exact). The recipe is for finite groups."""
    amax = groups.abs().amax(dim=-1).clamp_min(1e-4)
    scale = _pow2_ceil(amax * torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32))
    return scale, _e4m3(groups * (1.0 / scale)[..., None])


E4M3_MIN_SUBNORMAL = 2.0**-9


def _flashinfer_v41_nvfp4(groups: torch.Tensor):
    """FlashInfer's DeepSeek-V4.1 FP4 writer (``dsv41_fp4_quantize_{pack,append}``, group 16):
    s = e4m3_rn(clamp(amax / 6, 2**-9, 448)) (never 0: an all-zero group has the smallest
    subnormal scale and zero codes), codes e2m1_satfinite(x / s) with a float32 division; a
    group holding a NaN or an infinity: every code +0 and scale byte 0x7F (NaN), so that it
    reads as NaN throughout. Returns (s as float32, NaN for such a group; the codes as
    float32 values of the e2m1 grid, signed zeros kept)."""
    amax = groups.abs().amax(dim=-1)
    scale = _e4m3(torch.clamp(amax / E2M1_MAX, E4M3_MIN_SUBNORMAL, FP8_E4M3_MAX)).float()
    codes = e2m1_decode(e2m1_encode(groups / scale[..., None]))
    poisoned = (~torch.isfinite(groups)).any(dim=-1)
    return torch.where(poisoned, torch.nan, scale), torch.where(poisoned[..., None], 0.0, codes)


def _b12x_v41_nvfp4(groups: torch.Tensor):
    """b12x's DeepSeek-V4.1 FP4 writer (``dsv41=True``): amax clamped below at 6 * 2**-9
    first, then s = e4m3(amax / 6) (at least 2**-9), codes e2m1_satfinite(x * (1 / s)). The
    recipe is for finite groups."""
    amax = groups.abs().amax(dim=-1).clamp_min(E2M1_MAX * E4M3_MIN_SUBNORMAL)
    scale = _e4m3(amax / E2M1_MAX).float()
    return scale, e2m1_decode(e2m1_encode(groups * (1.0 / scale)[..., None]))


# per format: writer name -> recipe; the first is the packer's default
WRITERS = {
    "model1_fp8": {"vllm": _vllm_pow2, "flashmla": _flashmla_pow2},
    "v32_fp8": {"flashmla": _flashmla_pow2, "vllm": _vllm_fp32, "sglang": _sglang_fp32},
    # vLLM keeps GLM-5.3 in its 656-byte pool rows, rope zero: the same recipe, read as 528-byte rows
    "glm_nope_fp8": {"vllm": _vllm_fp32, "b12x": _b12x_glm_next},
    # FlashInfer's nvfp4_quantize_pack / _append_sparse_mla_cache (dsv4_nvfp4_cache_ops.cu)
    "model1_nvfp4": {"flashinfer": _flashinfer_nvfp4},
    # DeepSeek-V4.1: FlashInfer's writers (footer by default, or inline) and b12x's (inline records)
    "v41_fp8": {"flashinfer": _flashinfer_v41_fp8, "b12x": _b12x_v41_fp8},
    "v41_fp8_inline": {"flashinfer": _flashinfer_v41_fp8, "b12x": _b12x_v41_fp8},
    "v41_nvfp4": {"flashinfer": _flashinfer_v41_nvfp4, "b12x": _b12x_v41_nvfp4},
    "v41_nvfp4_inline": {"flashinfer": _flashinfer_v41_nvfp4, "b12x": _b12x_v41_nvfp4},
}


# the recipes that encode a group holding NaN or Inf as their writer does (FlashInfer's V4.1
# writers define it); the others' arithmetic on such a group is not a writer's behaviour
NON_FINITE_RECIPES = frozenset({_flashinfer_v41_fp8, _flashinfer_v41_nvfp4})


def writer_encodes_non_finite(kv_format: str, writer: str | None = None) -> bool:
    """Whether ``writer`` (default: the format's first) of ``kv_format`` encodes NaN / Inf in
    the nope dims as the real writer does (``NON_FINITE_RECIPES``)."""
    recipes = WRITERS[get_format(kv_format).name]
    return recipes.get(writer or next(iter(recipes))) in NON_FINITE_RECIPES


def check_non_finite(latent: torch.Tensor, kv_format: str, writer: str | None = None) -> None:
    """Raise ValueError naming the first NaN or Inf in ``latent``'s nope dims (its index in
    ``latent``, and its scale group) unless ``writer`` (default: the format's first) encodes
    them as the real writer does (``writer_encodes_non_finite``): the other recipes are for
    finite groups, and their arithmetic would store the element's whole group as NaN without
    a word. The rope dims are stored as given (bf16), so they are not checked."""
    fmt = get_format(kv_format)
    if writer_encodes_non_finite(fmt.name, writer):
        return
    nope = latent[..., :fmt.nope_dims]
    finite = torch.isfinite(nope)
    if finite.all():
        return
    bad = (~finite).nonzero()[0].tolist()
    first = bad[-1] // fmt.scale_group * fmt.scale_group
    raise ValueError(f"latent{bad} is {nope[tuple(bad)].item()}: {fmt.name}'s "
                     f"{writer or next(iter(WRITERS[fmt.name]))!r} writer has no encoding of NaN or Inf in the nope "
                     f"dims (its scale group, dims {first}..{first + fmt.scale_group - 1}, would be stored as NaN); "
                     f"FlashInfer's V4.1 writers have one: writer='flashinfer' of the v41 formats")


def _is_int(value) -> bool:
    """A Python int and not a bool: what every packer option that counts bytes must be (a
    float, a string or a tensor is refused, never converted)."""
    return isinstance(value, int) and not isinstance(value, bool)


# the latents a packer takes, by their dimensions (d: the format's d_qk)
_LATENT_FORMS = {2: "[num_tokens, {d}]", 3: "[num_blocks, P, {d}]"}


def check_latent(latent, fmt: KvFormat, dims: tuple[int, ...] = (3,)) -> None:
    """Raise ValueError for a latent the packers do not take: not a dense floating-point
    tensor, not of ``dims`` dimensions (``_LATENT_FORMS``) and ``fmt``'s d_qk, or holding no
    token."""
    if not isinstance(latent, torch.Tensor) or not latent.dtype.is_floating_point:
        raise ValueError(f"latent must be a floating-point torch.Tensor, got "
                         f"{getattr(latent, 'dtype', type(latent).__name__)}")
    if latent.layout is not torch.strided:
        raise ValueError(f"latent is a sparse tensor (layout {latent.layout}): pack a dense one (latent.to_dense())")
    if latent.dim() not in dims or latent.shape[-1] != fmt.d_qk:
        forms = " or ".join(_LATENT_FORMS[n].format(d=fmt.d_qk) for n in dims)
        raise ValueError(f"latent of shape {list(latent.shape)}: a {fmt.name} latent is {forms} "
                         f"({fmt.nope_dims} nope + {fmt.rope_dims} rope dims)")
    if latent.numel() == 0:
        raise ValueError(f"latent of shape {list(latent.shape)} holds no token")


def _writer_problem(fmt: KvFormat, writer) -> str | None:
    """Why ``writer`` names none of ``fmt``'s writers (None: the default, or one of them)."""
    if writer is None or (isinstance(writer, str) and writer in WRITERS[fmt.name]):
        return None
    return f"writer must be one of {tuple(WRITERS[fmt.name])} for {fmt.name}, got {writer!r}"


def check_pack_options(fmt: KvFormat, writer, block_stride, row_stride, fill) -> None:
    """Raise ValueError for a packer option that is not a value it takes or does not apply to
    ``fmt`` (one rule for ``pack_latent`` and ``dispatch.kv_formats.pack``): ``writer`` None
    or one of ``fmt``'s (``WRITERS``); ``fill`` a byte (an int in [0, 255]); ``block_stride``
    and ``row_stride`` None or a positive int (bytes; their other bounds depend on the block:
    ``pack_latent``); ``row_stride`` only for the formats with scales inline in the row (a
    footer format's rows are packed)."""
    problem = _writer_problem(fmt, writer)
    if problem is not None:
        raise ValueError(problem)
    if not _is_int(fill) or not 0 <= fill <= 255:
        raise ValueError(f"fill must be an int in [0, 255] (the byte written where no data is), got {fill!r}")
    for name, value in (("block_stride", block_stride), ("row_stride", row_stride)):
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"{name} must be None (the format's default) or a positive int (bytes), got {value!r} "
                             f"({type(value).__name__})")
    if row_stride is not None and not fmt.inline:
        raise ValueError(f"row_stride applies to the formats with scales inline in the row "
                         f"({[name for name, f in FORMATS.items() if f.inline]}); {fmt.name}'s rows are packed, "
                         f"then its scale footer: pass block_stride to pad its blocks")


def quantize_latent(latent: torch.Tensor, kv_format: str = "model1_fp8", writer: str | None = None):
    """Quantize ``[..., d_qk]`` latent rows as ``writer`` (``WRITERS``) writes ``kv_format``.

    Returns ``(nope codes [..., nope], scales [..., groups] float32, rope [..., rope] bf16)``;
    the scales are the values the format stores (UE8M0 formats: powers of two, inf for byte
    0xFF; E4M3 scales: e4m3 values, NaN for byte 0x7F: what the V4.1 writers store for a group
    holding NaN or Inf). The codes: float8_e4m3fn for an e4m3 format; for an e2m1 format float32
    values of the e2m1 grid (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, the sign of a zero kept: -0.0
    is nibble 8), one per nope dim (``e2m1_encode`` gives the nibbles, ``pack_nibbles`` the
    bytes). Either way ``codes.float() * scale`` (per group) is the dequantized nope part.
    NaN or Inf in the nope dims: encoded as FlashInfer's V4.1 writers do, refused naming the
    element for every other writer (``check_non_finite``)."""
    fmt = get_format(kv_format)
    problem = _writer_problem(fmt, writer)
    if problem is not None:
        raise ValueError(problem)
    recipes = WRITERS[fmt.name]
    recipe = recipes[writer or next(iter(recipes))]
    if latent.shape[-1] != fmt.d_qk:
        raise ValueError(f"{fmt.name} latent rows must be {fmt.d_qk} wide, got {latent.shape[-1]}")
    check_non_finite(latent, fmt.name, writer)
    x = latent.float()
    groups = x[..., :fmt.nope_dims].reshape(*x.shape[:-1], fmt.num_scales, fmt.scale_group)
    scale, codes = recipe(groups)
    rope = latent[..., fmt.nope_dims:].to(torch.bfloat16)
    return codes.reshape(*x.shape[:-1], fmt.nope_dims), scale, rope


def _scale_record(fmt: KvFormat, scale: torch.Tensor) -> torch.Tensor:
    """The stored scale bytes [..., scale_bytes] (uint8) of float32 scales [..., groups]. A
    UE8M0 scale past float32's range (inf: byte 0xFF is 2**128, a V4.1 writer's mark of a group
    holding NaN or Inf; NaN alike) is 0xFF; a NaN E4M3 scale is 0x7F, as the writers'
    satfinite conversion gives it; so either round-trips through ``decode_scales``."""
    if fmt.scale_type == "ue8m0":
        finite = torch.isfinite(scale)
        byte = torch.log2(torch.where(finite, scale, 1.0)) + UE8M0_BIAS
        return torch.where(finite, byte.round(), 0xFF).to(torch.uint8)
    if fmt.scale_type == "e4m3":  # e4m3 values: exact
        byte = scale.float().to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.where(torch.isnan(scale), E4M3_NAN, byte).to(torch.uint8)
    return scale.contiguous().view(torch.uint8).reshape(*scale.shape[:-1], fmt.scale_bytes)


def pack_latent(latent: torch.Tensor, kv_format: str = "model1_fp8", *, writer: str | None = None,
                block_stride: int | None = None, row_stride: int | None = None, fill: int = 0) -> torch.Tensor:
    """Pack a latent ``[num_blocks, P, d_qk]`` into a ``kv_format`` cache ``[num_blocks, P, 1, W]``
    (NHD; W: the format's bytes per token, or the row stride of an inline format), as ``writer``
    (``WRITERS``; default the first) writes it.

    ``block_stride`` (bytes, a multiple of 16; for a flat-row format with P > 1 a whole
    number of rows) defaults to ``default_block_stride``; ``row_stride`` (inline formats) to
    the format's default pitch. A footer format's block is its P data rows, then P footer
    records; an inline format's its P rows ``[data | scales]``, ``row_stride`` apart. Bytes
    that hold no data (padding, the rows a flat-row block holds past its P tokens, MODEL1's
    pad byte, the unused tail of a wide row) are ``fill``; the 4 pad bytes of an NVFP4
    footer record are 0 whatever ``fill`` (its specification). Token t of block b is slot
    b * P + t, or for flat rows index b * R + t (R = block_stride / row_stride: the same
    where blocks are unpadded). The result is a uint8 view of a ``[num_blocks, block_stride]``
    buffer on the latent's device. Refused (ValueError): a latent that is not a dense
    floating-point ``[num_blocks, P, d_qk]`` tensor holding a token (``check_latent``), a
    ``fill`` that is not a byte, a ``block_stride`` or ``row_stride`` that is not a positive
    int, a ``row_stride`` for a footer format (``check_pack_options``), NaN or Inf in the
    nope dims where the writer has no encoding of them (``check_non_finite``)."""
    fmt = get_format(kv_format)
    check_latent(latent, fmt)
    check_pack_options(fmt, writer, block_stride, row_stride, fill)
    num_blocks, page, _ = latent.shape
    pitch = fmt.bytes_per_token if not fmt.inline else (fmt.row_pitches[0] if row_stride is None else row_stride)
    if fmt.inline and (pitch < fmt.row_bytes or pitch % ALIGN):
        raise ValueError(f"row_stride {pitch} must be a multiple of {ALIGN} and at least {fmt.row_bytes}")
    used = block_used_bytes(fmt, page, pitch)
    stride = default_block_stride(fmt, page, pitch) if block_stride is None else block_stride
    if stride < used or stride % ALIGN != 0:
        raise ValueError(f"block_stride {stride} must be >= {used} (P={page} tokens of {fmt.name}) and a multiple "
                         f"of {ALIGN}")
    flat_row_error = flat_row_block_error(fmt, page, stride, pitch)
    if flat_row_error:
        raise ValueError(f"block_stride: {flat_row_error}")
    codes, scale, rope = quantize_latent(latent, fmt.name, writer)
    # a row's worth of storage past the last block: the view of a wide last row stays inside it
    storage = torch.full((num_blocks * stride + pitch,), fill, dtype=torch.uint8, device=latent.device)
    row_pitch = pitch if fmt.inline else fmt.row_bytes  # footer formats: rows packed, then the footer
    rows = torch.as_strided(storage, (num_blocks, page, fmt.row_bytes), (stride, row_pitch, 1))
    if fmt.e2m1:
        rows[..., :fmt.nope_bytes] = pack_nibbles(e2m1_encode(codes))
    else:
        rows[..., :fmt.nope_bytes] = codes.view(torch.uint8)
    rows[..., fmt.rope_offset:] = rope.contiguous().view(torch.uint8).view(num_blocks, page, 2 * fmt.rope_dims)
    record = _scale_record(fmt, scale)
    if fmt.inline:
        rows[..., fmt.scale_offset:fmt.scale_offset + fmt.scale_bytes] = record
    else:
        if fmt.e2m1:  # the whole record: its pad bytes 0
            record = torch.cat([record, record.new_zeros(*record.shape[:-1], fmt.footer_pad)], dim=-1)
        footer = torch.as_strided(storage, (num_blocks, page, record.shape[-1]), (stride, fmt.footer_bytes, 1),
                                  page * fmt.row_bytes)
        footer.copy_(record)
    width = pitch if not fmt.inline else max(w for w in fmt.view_widths if w <= pitch)
    return torch.as_strided(storage, (num_blocks, page, 1, width), (stride, pitch, pitch, 1))
