"""Cache views of every format (``kv_format.FORMATS``): what a cache tensor may look like, which
format it is read as, and how an index finds its bytes (torch; the writers: ``cache_writers``,
the readers: ``cache_readers``).

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
    DEFAULT_FORMAT, FORMAT_BY_WIDTH, FORMATS, MODEL1_FP8, KvFormat, formats_of_width, get_format,
)

CACHE_DTYPES = (torch.uint8, torch.float8_e4m3fn)
ALIGN = 16  # block and row strides and the data pointer: the row copies are 16-byte cp.async


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


def flat_row_block_error(fmt: KvFormat, page: int, block_stride: int, row_stride: int) -> str | None:
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
    combines with (``KvFormat.extras``) that the width fits (V4.1's 288-byte rows beside a
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
    except CacheLayoutError:
        paired = main_fmt.extras
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
    flat_row_error = flat_row_block_error(fmt, page, block_stride, row_stride)
    if flat_row_error:
        raise CacheLayoutError(f"{name} with strides {list(stride)}: {flat_row_error}")
    if block_stride % ALIGN != 0:
        raise CacheLayoutError(f"{name}: block stride {block_stride} bytes is not a multiple of {ALIGN}")
    if cache.data_ptr() % ALIGN != 0:
        raise CacheLayoutError(f"{name}: data pointer is not {ALIGN}-byte aligned")
    flat = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    blocks = torch.as_strided(flat, (shape[0], used), (block_stride, 1), flat.storage_offset())
    return CacheView(blocks=blocks, fmt=fmt, page_block_size=page, block_stride=block_stride, row_stride=row_stride)
