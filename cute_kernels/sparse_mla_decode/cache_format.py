"""Read, pack and unpack sparse-MLA caches of every format (``kv_format.FORMATS``) with torch.

Accepted cache views (uint8 or float8_e4m3fn, one byte per element), W the last dimension:

- ``[num_blocks, P, 1, W]`` ("NHD") and ``[num_blocks, 1, P, W]`` ("HND");
- ``[num_blocks, P * W]`` (a block as bytes; any padding lives in the block stride).

A footer format (MODEL1, NVFP4, the V4.1 footer formats) has W = its bytes per token and
packed rows (token stride W); an inline format has W at least its row bytes (a wider W, such
as GLM-5.3 rows in 656-byte pool rows, holds bytes that are never read) and any token stride
(the row stride) that is a multiple of 16 and at least its row bytes; a 2-D view has the
format's default row pitch (``flat_pitch``; a view whose width more than one format has, and
an e2m1 format's 2-D view, is read only where ``kv_format`` names it: ``format_of``; an extra
cache's view is first read as its main cache's format where its width fits it:
``extra_format_of``).
The block stride may exceed the block's bytes and must be a multiple of 16, as must the data
pointer; a flat-row format's (``KvFormat.flat_rows``) must be a whole number of rows.
``CacheLayoutError`` says what a view lacks.

How an index finds its bytes (``kv_format`` module docstring): paged, slot s is row s % P of
block s // P; flat rows, index r is row r % R of block r // R with R = block_stride /
row_stride, so that the rows a padded block holds past its P tokens are indices too (their
bytes, whatever the allocator left there, are read as they are). ``CacheView.index_page``
is the divisor either way (P or R), and the readers here use it as the kernels do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .kv_format import (
    DEFAULT_FORMAT, EXTRA_FORMATS, FORMAT_BY_WIDTH, FORMATS, FP8_E4M3_MAX, MODEL1_FP8, UE8M0_BIAS, KvFormat,
    formats_of_width, get_format,
)

E2M1_MAX = 6.0
# the e2m1 nibble s ee m: codes 0..7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign (8 is -0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

CACHE_DTYPES = (torch.uint8, torch.float8_e4m3fn)
ALIGN = 16  # block and row strides and the data pointer: the row copies are 16-byte cp.async
FLT_MIN = 2.0**-126


class CacheLayoutError(ValueError):
    """The cache tensor is not a view of the format this library reads."""


@dataclass(frozen=True)
class CacheView:
    """A validated cache: its blocks as a 2-D uint8 view ``[num_blocks, block_used_bytes]``.

    An index names a row by ``index_page``: block ``i // index_page``, row ``i % index_page``
    at ``row_stride`` bytes into it. Paged formats divide by the page block size P; a
    flat-row format (``KvFormat.flat_rows``: FlashInfer's addressing of DeepSeek-V4.1's inline
    records) by R = block_stride / row_stride, the rows a block stride holds, so that index r
    is row r of the whole cache viewed as rows ``row_stride`` apart. The two agree when blocks
    carry no padding (block_stride == P * row_stride); b12x's paged addressing of the same
    records, ``(s // P) * block_stride + (s % P) * row_stride``, differs from the flat rows only
    for padded blocks."""

    blocks: torch.Tensor  # uint8 [num_blocks, used], stride (block_stride, 1)
    fmt: KvFormat
    page_block_size: int
    block_stride: int  # bytes between consecutive blocks
    row_stride: int  # bytes between consecutive tokens' rows inside a block

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def index_page(self) -> int:
        """What the kernels divide an index by to find its block: P, or for flat rows R."""
        return self.block_stride // self.row_stride if self.fmt.flat_rows else self.page_block_size

    @property
    def num_slots(self) -> int:
        """The indices that name a row inside the tensor's storage: ``num_blocks * P`` for
        paged formats; for flat rows ``(num_blocks - 1) * R + P``, the rows R - P past the
        tokens of every block but the last included (a padded block's padding bytes, read as
        they are, as FlashInfer's reader does)."""
        return (self.num_blocks - 1) * self.index_page + self.page_block_size

    @property
    def span(self) -> torch.Tensor:
        """Every byte from the first block's start to the last block's data end, as one 1-D
        uint8 view: a flat row may lie in a block's padding, which ``blocks`` leaves out."""
        size = (self.num_blocks - 1) * self.block_stride + self.blocks.shape[1]
        return torch.as_strided(self.blocks, (size,), (1,))


def block_used_bytes(fmt: KvFormat, page: int, row_stride: int) -> int:
    """The bytes of a block of ``page`` tokens that hold data (the rest is padding)."""
    if fmt.inline:
        return (page - 1) * row_stride + fmt.row_bytes
    return page * fmt.bytes_per_token


def page_division_magic(page_block_size: int) -> int:
    """The kernels' argument for dividing a cache slot by the page block size without a
    division instruction: ``m | (s << 32)`` with ``slot // page == (slot * m) >> s`` for
    every slot in [0, 2**31) (Granlund-Montgomery: l = ceil(log2(page)), s = 31 + l,
    m = ceil(2**s / page) < 2**32, and m * page - 2**s < page <= 2**l). On the GPU the
    quotient is one 32 x 32 -> 64-bit multiply and a shift, where a division by a runtime
    value is a dozen instructions per row located (``gather.ChunkGather.row_location``)."""
    if not isinstance(page_block_size, int) or isinstance(page_block_size, bool) or page_block_size < 1:
        raise ValueError(f"page_block_size must be a positive int, got {page_block_size!r}")
    shift = 31 + (page_block_size - 1).bit_length()
    magic = -(-(1 << shift) // page_block_size)
    assert magic < 1 << 32
    return magic | (shift << 32)


def default_block_stride(fmt: KvFormat, page_block_size: int, row_stride: int | None = None) -> int:
    """The packers' block stride: MODEL1 as FlashMLA allocates it (P * 584 rounded up to a
    multiple of 576); every other footer format as FlashInfer allocates it, tight (P * bytes
    per token, a multiple of 16 by the record sizes); an inline format's rows back to back
    (P * pitch, a multiple of 16 by the pitch and a whole number of rows for flat rows)."""
    if fmt.inline:
        return page_block_size * (row_stride or fmt.row_pitches[0])
    used = page_block_size * fmt.bytes_per_token
    if fmt.name != MODEL1_FP8.name:
        return used
    return fmt.row_bytes * math.ceil(used / fmt.row_bytes)


def flat_pitch(fmt: KvFormat) -> int:
    """The bytes per token a 2-D (``[num_blocks, P * W]``) view of ``fmt`` implies: a footer
    format's bytes per token, an inline format's default row pitch."""
    return fmt.row_pitches[0] if fmt.inline else fmt.bytes_per_token


def _width_fits(fmt: KvFormat, dim: int, width: int) -> bool:
    """Whether a ``dim``-D view whose last dimension is ``width`` can be a ``fmt`` cache."""
    if dim == 2:
        return width > 0 and width % flat_pitch(fmt) == 0
    return width in fmt.view_widths


def _flat_row_block_error(fmt: KvFormat, page: int, block_stride: int, row_stride: int) -> str | None:
    """Why a flat-row cache's block stride cannot be read (None: it can): an index counts
    rows of the whole cache, so a block (of more than one row) must hold a whole number."""
    if not fmt.flat_rows or page == 1 or block_stride % row_stride == 0:
        return None
    return (f"block stride {block_stride} bytes is not a whole number of {row_stride}-byte rows: {fmt.name} "
            f"indices count rows of the whole cache (block r // R, row r % R, R = block stride / row stride), so "
            f"pad blocks to a multiple of the row stride (e.g. {-(-block_stride // row_stride) * row_stride} bytes)")


def format_of(cache, kv_format: str | None) -> KvFormat:
    """The format a cache is read as: ``kv_format`` when given, else the one its last
    dimension's width names (``FORMAT_BY_WIDTH``); CacheLayoutError for an ambiguous width."""
    if kv_format is not None:
        try:
            return get_format(kv_format)
        except ValueError as err:
            raise CacheLayoutError(str(err)) from None
    if not isinstance(cache, torch.Tensor) or cache.dim() not in (2, 4):
        shown = list(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
        raise CacheLayoutError(f"a cache is a 2-D or 4-D byte tensor, got {shown}")
    width = cache.shape[-1]
    if cache.dim() == 2 and width:
        fits = sorted(f.name for f in FORMATS.values() if _width_fits(f, 2, width))
        # an e2m1 format's 2-D view is read only by name (its writer makes 4-D views): a MODEL1
        # block of P * 584 bytes that is also a whole number of 384-byte tokens (P a multiple
        # of 48) reads as MODEL1 without kv_format, as before that format existed
        inferred = [name for name in fits if not FORMATS[name].e2m1]
        if inferred == [DEFAULT_FORMAT]:
            return FORMATS[DEFAULT_FORMAT]
        if inferred:
            raise CacheLayoutError(f"a 2-D cache is read as {DEFAULT_FORMAT} unless kv_format= names its format "
                                   f"(its {width} bytes per block fit {fits})")
        if fits:
            raise CacheLayoutError(f"a 2-D cache of {width} bytes per block is read as {fits} only where kv_format= "
                                   f"names it")
        raise CacheLayoutError(f"no cache format has blocks of {width} bytes (a whole number of rows): pass "
                               f"kv_format= (one of {sorted(FORMATS)}) or a 4-D view")
    if cache.dim() == 4 and width in FORMAT_BY_WIDTH:
        return FORMATS[FORMAT_BY_WIDTH[width]]
    candidates = formats_of_width(width)
    if candidates:
        raise CacheLayoutError(f"a cache whose rows are {width} bytes wide is ambiguous: pass kv_format= "
                               f"(one of {candidates})")
    raise CacheLayoutError(f"no cache format has {width}-byte rows: pass kv_format= (one of {sorted(FORMATS)})")


def extra_format_of(extra_cache, main_fmt: KvFormat, extra_kv_format: str | None) -> KvFormat:
    """The format an extra (compressed) cache next to a ``main_fmt`` main cache is read as:
    ``extra_kv_format`` when given; else ``main_fmt`` where the extra cache's width is one a
    ``main_fmt`` view has (a 4-D view's last dimension among its ``view_widths``, a 2-D
    view's a whole number of its ``flat_pitch``); else the format its own width names
    (``format_of``), or where that is ambiguous the one format a ``main_fmt`` main cache
    combines with (``EXTRA_FORMATS``) that the width fits (V4.1's 288-byte rows beside a
    footer or an inline FP8 main cache). CacheLayoutError where the width still leaves the
    format open, naming the paired formats that the width fits."""
    if extra_kv_format is not None:
        try:
            return get_format(extra_kv_format)
        except ValueError:
            raise CacheLayoutError(f"extra_kv_format must be one of {sorted(FORMATS)}, got {extra_kv_format!r}") \
                from None
    if isinstance(extra_cache, torch.Tensor) and extra_cache.dim() in (2, 4) \
            and _width_fits(main_fmt, extra_cache.dim(), extra_cache.shape[-1]):
        return main_fmt
    try:
        return format_of(extra_cache, None)
    except CacheLayoutError as err:
        paired = EXTRA_FORMATS.get(main_fmt.name, ())
        if not paired or not isinstance(extra_cache, torch.Tensor) or extra_cache.dim() not in (2, 4):
            raise
        width, dim = extra_cache.shape[-1], extra_cache.dim()
        what = f"{width}-byte rows" if dim == 4 else f"{width} bytes per block"
        fits = [name for name in paired if _width_fits(FORMATS[name], dim, width)]
        if len(fits) == 1:
            return FORMATS[fits[0]]
        if fits:
            raise CacheLayoutError(f"an extra cache of {what} next to a {main_fmt.name} main cache may be any of "
                                   f"{fits}: pass extra_kv_format= (one of {fits})") from None
        raise CacheLayoutError(f"an extra cache of {what} fits none of the formats a {main_fmt.name} main cache "
                               f"combines with ({list(paired)})") from None


def read_cache_view(cache: torch.Tensor, kv_format: str | None = None, name: str = "kv_cache") -> CacheView:
    """Validate a cache tensor as ``kv_format`` (None: by its width) and return its blocks as
    bytes. Raises ``CacheLayoutError``. A flat-row format's one-token blocks have the block
    stride for their row stride (R = 1, as FlashInfer takes the pitch of one-row pages)."""
    if not isinstance(cache, torch.Tensor):
        raise CacheLayoutError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype not in CACHE_DTYPES:
        raise CacheLayoutError(f"{name} must be uint8 or float8_e4m3fn (the cache as bytes), got {cache.dtype}")
    fmt = format_of(cache, kv_format)
    shape, stride = tuple(cache.shape), tuple(cache.stride())
    bpt = fmt.bytes_per_token
    widths = fmt.view_widths
    shown = " or ".join(map(str, widths))
    if cache.dim() == 4 and shape[2] == 1 and shape[3] in widths:  # NHD
        page, tok_stride, byte_stride = shape[1], stride[1], stride[3]
    elif cache.dim() == 4 and shape[1] == 1 and shape[3] in widths:  # HND
        page, tok_stride, byte_stride = shape[2], stride[2], stride[3]
    elif cache.dim() == 2:
        pitch = flat_pitch(fmt)
        if shape[1] == 0 or shape[1] % pitch != 0:
            raise CacheLayoutError(f"{name} of shape {list(shape)}: a 2-D {fmt.name} cache must be "
                                   f"[num_blocks, P*{pitch}] (the padding of a block belongs in its stride, not its size)")
        page, tok_stride, byte_stride = shape[1] // pitch, pitch, stride[1]
    else:
        raise CacheLayoutError(f"{name} of shape {list(shape)}: expected [num_blocks, P, 1, {shown}] (NHD), "
                               f"[num_blocks, 1, P, {shown}] (HND) or [num_blocks, P*{widths[0]}] ({fmt.name})")
    if page < 1 or shape[0] < 1:
        raise CacheLayoutError(f"{name} of shape {list(shape)} holds no token")
    row_stride = tok_stride if page > 1 else (fmt.row_pitches[0] if fmt.inline else bpt)
    if fmt.flat_rows and page == 1 and shape[0] > 1:
        row_stride = stride[0]  # one row per block: the rows are the blocks (FlashInfer's pitch)
    if byte_stride != 1:
        raise CacheLayoutError(f"{name} with strides {list(stride)}: a token's bytes must be contiguous (byte stride 1)")
    if not fmt.inline and page > 1 and tok_stride != bpt:
        raise CacheLayoutError(f"{name} with strides {list(stride)}: the {page * bpt} bytes of a block must be "
                               f"contiguous (token stride {bpt}, byte stride 1)")
    if fmt.inline and (row_stride < fmt.row_bytes or row_stride % ALIGN != 0):
        raise CacheLayoutError(f"{name} with strides {list(stride)}: the row stride {row_stride} must be a multiple "
                               f"of {ALIGN} bytes and at least the {fmt.row_bytes} bytes of a {fmt.name} row")
    used = block_used_bytes(fmt, page, row_stride)
    block_stride = stride[0] if shape[0] > 1 else max(stride[0], used)
    if shape[0] == 1 and fmt.flat_rows:  # a lone block's stride is no distance: a whole number of its rows
        block_stride = -(-block_stride // row_stride) * row_stride
    if shape[0] > 1 and block_stride < used:
        raise CacheLayoutError(f"{name}: block stride {block_stride} bytes is smaller than a block of P={page} tokens "
                               f"({used} bytes)")
    flat_row_error = _flat_row_block_error(fmt, page, block_stride, row_stride)
    if flat_row_error:
        raise CacheLayoutError(f"{name} with strides {list(stride)}: {flat_row_error}")
    if block_stride % ALIGN != 0:
        raise CacheLayoutError(f"{name}: block stride {block_stride} bytes is not a multiple of {ALIGN}")
    if cache.data_ptr() % ALIGN != 0:
        raise CacheLayoutError(f"{name}: data pointer is not {ALIGN}-byte aligned")
    flat = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    blocks = torch.as_strided(flat, (shape[0], used), (block_stride, 1), flat.storage_offset())
    return CacheView(blocks=blocks, fmt=fmt, page_block_size=page, block_stride=block_stride, row_stride=row_stride)


# ---------------------------------------------------------------------- writers (scale recipes)
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


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """The e2m1 nibbles (uint8 0..15, ``E2M1_VALUES``) of float32 ``x`` as a satfinite
    round-to-nearest-even conversion (``cvt.rn.satfinite.e2m1x2.f32``) writes them: ties to the
    even code, given as values (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4),
    magnitudes past 6 (infinities included) saturated to 6, the sign of a zero kept (-0 and
    negatives that round to 0 are code 8); NaN is +6 (code 7: e2m1 has no NaN)."""
    x = x.float()
    a = x.abs()
    # the code of |x| is the number of rounding boundaries it passes; at a boundary (a tie) the
    # even code wins: "> b" where the code below is even, ">= b" where the code above is
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
            + (a > 5.0))
    code = torch.where(torch.isnan(x), 7, code + torch.signbit(x).to(torch.uint8) * 8)
    return code.to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of e2m1 nibbles (any integer dtype, 0..15; ``E2M1_VALUES``)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles [..., 2n] -> bytes [..., n]: element 2i in the low nibble of byte i."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> nibbles uint8 [..., 2n] (``pack_nibbles``' inverse)."""
    data = data.to(torch.uint8)
    return torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2)


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


def check_pack_options(fmt: KvFormat, row_stride, fill) -> None:
    """Raise ValueError for a packer option that is not a value it takes or does not apply to
    ``fmt``: ``fill`` must be a byte (an int in [0, 255]); ``row_stride`` applies to the
    formats with scales inline in the row (a footer format's rows are packed)."""
    if isinstance(fill, bool) or not isinstance(fill, int) or not 0 <= fill <= 255:
        raise ValueError(f"fill must be an int in [0, 255] (the byte written where no data is), got {fill!r}")
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
    recipes = WRITERS[fmt.name]
    recipe = recipes[writer or next(iter(recipes))] if (writer or next(iter(recipes))) in recipes else None
    if recipe is None:
        raise ValueError(f"writer must be one of {sorted(recipes)} for {fmt.name}, got {writer!r}")
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
    buffer on the latent's device. Refused (ValueError): a ``fill`` that is not a byte, a
    ``row_stride`` for a footer format (``check_pack_options``), NaN or Inf in the nope dims
    where the writer has no encoding of them (``check_non_finite``)."""
    fmt = get_format(kv_format)
    if latent.dim() != 3 or latent.shape[-1] != fmt.d_qk:
        raise ValueError(f"latent must be [num_blocks, P, {fmt.d_qk}] for {fmt.name}, got {list(latent.shape)}")
    check_pack_options(fmt, row_stride, fill)
    num_blocks, page, _ = latent.shape
    pitch = fmt.bytes_per_token if not fmt.inline else (row_stride or fmt.row_pitches[0])
    if fmt.inline and (pitch < fmt.row_bytes or pitch % ALIGN):
        raise ValueError(f"row_stride {pitch} must be a multiple of {ALIGN} and at least {fmt.row_bytes}")
    used = block_used_bytes(fmt, page, pitch)
    stride = default_block_stride(fmt, page, pitch) if block_stride is None else int(block_stride)
    if stride < used or stride % ALIGN != 0:
        raise ValueError(f"block_stride {stride} must be >= {used} (P={page} tokens of {fmt.name}) and a multiple "
                         f"of {ALIGN}")
    flat_row_error = _flat_row_block_error(fmt, page, stride, pitch)
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


# ---------------------------------------------------------------------- readers
def _gather_raw(view: CacheView, slots: torch.Tensor):
    """The row bytes (uint8 [n, row_bytes]) and scale records (uint8 [n, scale_bytes]) of
    ``slots`` (flattened, every one in ``[0, num_slots)``), addressed as the kernels do: block
    ``slot // index_page``, row ``slot % index_page`` (``CacheView``), in the bytes of the
    whole cache (a flat row may lie in a block's padding)."""
    fmt, span = view.fmt, view.span
    flat = slots.reshape(-1).long()
    block_start = (flat // view.index_page * view.block_stride)[:, None]
    offset = (flat % view.index_page)[:, None]
    dev = span.device
    row_start = block_start + offset * (view.row_stride if fmt.inline else fmt.row_bytes)
    rows = span[row_start + torch.arange(fmt.row_bytes, device=dev)]
    if fmt.inline:
        records = rows[:, fmt.scale_offset:fmt.scale_offset + fmt.scale_bytes]
    else:
        records = span[block_start + view.page_block_size * fmt.row_bytes + offset * fmt.footer_bytes
                       + torch.arange(fmt.scale_bytes, device=dev)]
    return rows, records


def decode_scales(fmt: KvFormat, records: torch.Tensor) -> torch.Tensor:
    """float32 scale factors [..., groups] of stored scale records [..., scale_bytes]: a UE8M0
    byte b is 2**(b - 127) (byte 0 is 2**-127, not 0); an E4M3 byte is its e4m3 value (0 is 0,
    0x7F and 0xFF NaN); an FP32 scale is read as it is."""
    if fmt.scale_type == "ue8m0":
        return torch.exp2(records.float() - UE8M0_BIAS)
    if fmt.scale_type == "e4m3":
        return records.contiguous().view(torch.float8_e4m3fn).float()
    return records.contiguous().view(torch.float32)


def _row_parts(fmt: KvFormat, rows: torch.Tensor, records: torch.Tensor):
    """(nope values as float32 [..., groups, group], their scale factors [..., groups], rope
    float32 [..., rope_dims]) of raw rows and scale records. The nope values are the stored
    elements' own: e4m3 values, or e2m1 values (element 2i from the low nibble of byte i)."""
    if fmt.e2m1:
        nope = e2m1_decode(unpack_nibbles(rows[..., :fmt.nope_bytes]))
    else:
        nope = rows[..., :fmt.nope_bytes].contiguous().view(torch.float8_e4m3fn).float()
    nope = nope.reshape(*nope.shape[:-1], fmt.num_scales, fmt.scale_group)
    rope = rows[..., fmt.rope_offset:fmt.row_bytes].contiguous().view(torch.bfloat16).float()
    return nope, decode_scales(fmt, records), rope


def gather_slot_parts(view: CacheView, slots: torch.Tensor):
    """The rows of ``slots`` as stored: (nope values float32 [..., groups, group], their scale
    factors [..., groups], rope float32 [..., rope_dims]); ``gather_slots`` is their product."""
    nope, factor, rope = _row_parts(view.fmt, *_gather_raw(view, slots))
    return (nope.reshape(*slots.shape, *nope.shape[1:]), factor.reshape(*slots.shape, factor.shape[-1]),
            rope.reshape(*slots.shape, rope.shape[-1]))


def gather_slots(view: CacheView, slots: torch.Tensor) -> torch.Tensor:
    """The dequantized latent (float32 ``[..., d_qk]``) of ``slots`` (int64, every one in
    ``[0, num_slots)``). Reads only the selected rows: it scales to caches far larger than
    the gathered set."""
    nope, factor, rope = gather_slot_parts(view, slots)
    nope = (nope * factor[..., None]).reshape(*slots.shape, view.fmt.nope_dims)
    return torch.cat([nope, rope], dim=-1)


def unpack_cache(cache: torch.Tensor, kv_format: str | None = None) -> torch.Tensor:
    """Dequantize a whole cache view back to float32 ``[num_blocks, P, d_qk]``: each block's P
    tokens (a flat-row format's block b, row t is index b * R + t; the rows a padded block
    holds past its tokens are left out)."""
    view = read_cache_view(cache, kv_format)
    dev = view.blocks.device
    slots = (torch.arange(view.num_blocks, device=dev)[:, None] * view.index_page
             + torch.arange(view.page_block_size, device=dev)[None, :])
    return gather_slots(view, slots)
