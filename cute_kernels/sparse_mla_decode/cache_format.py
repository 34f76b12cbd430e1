"""Pack, unpack and read the DSV4 FP8 cache ("MODEL1" layout) with torch, on CPU or GPU.

Accepted cache views (uint8 or float8_e4m3fn, one byte per element):

- ``[num_blocks, P, 1, 584]`` ("NHD"),
- ``[num_blocks, 1, P, 584]`` ("HND"),
- ``[num_blocks, P*584]`` (blocks as bytes; any padding lives in the block stride).

Inside a block the P*584 bytes must be contiguous; the block stride (``stride(0)``) may be
larger than P*584 (FlashMLA pads each block to a multiple of 576 bytes) and must be a
multiple of 16 bytes, as must the data pointer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .layout import (
    BLOCK_STRIDE_ALIGN,
    D_NOPE,
    D_QK,
    D_ROPE,
    FP8_E4M3_MAX,
    NUM_TILES,
    ROW_BYTES,
    SCALE_BYTES,
    TILE,
    TOKEN_BYTES,
    UE8M0_BIAS,
)

CACHE_DTYPES = (torch.uint8, torch.float8_e4m3fn)


class CacheLayoutError(ValueError):
    """The cache tensor is not a view of the DSV4 FP8 layout this library reads."""


@dataclass(frozen=True)
class CacheView:
    """A validated cache: its byte blocks as a 2-D uint8 view ``[num_blocks, P*584]``."""

    blocks: torch.Tensor  # uint8 [num_blocks, P*584], stride (block_stride, 1)
    page_block_size: int
    block_stride: int  # bytes between consecutive blocks

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.page_block_size


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


def default_block_stride(page_block_size: int) -> int:
    """FlashMLA's allocation: P*584 bytes rounded up to a multiple of 576."""
    used = page_block_size * TOKEN_BYTES
    return ROW_BYTES * math.ceil(used / ROW_BYTES)


def read_cache_view(cache: torch.Tensor, name: str = "kv_cache") -> CacheView:
    """Validate a cache tensor and return its blocks as bytes. Raises ``CacheLayoutError``."""
    if not isinstance(cache, torch.Tensor):
        raise CacheLayoutError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype not in CACHE_DTYPES:
        raise CacheLayoutError(
            f"{name} must be uint8 or float8_e4m3fn (the DSV4 FP8 cache as bytes), got {cache.dtype}"
        )
    shape, stride = tuple(cache.shape), tuple(cache.stride())
    if cache.dim() == 4 and shape[2] == 1 and shape[3] == TOKEN_BYTES:  # NHD
        page, tok_stride, byte_stride = shape[1], stride[1], stride[3]
    elif cache.dim() == 4 and shape[1] == 1 and shape[3] == TOKEN_BYTES:  # HND
        page, tok_stride, byte_stride = shape[2], stride[2], stride[3]
    elif cache.dim() == 2:
        if shape[1] == 0 or shape[1] % TOKEN_BYTES != 0:
            raise CacheLayoutError(
                f"{name} of shape {list(shape)}: a 2-D cache must be [num_blocks, P*{TOKEN_BYTES}] "
                f"(the padding of a block belongs in its stride, not its size)"
            )
        page, tok_stride, byte_stride = shape[1] // TOKEN_BYTES, TOKEN_BYTES, stride[1]
    else:
        raise CacheLayoutError(
            f"{name} of shape {list(shape)}: expected [num_blocks, P, 1, {TOKEN_BYTES}] (NHD), "
            f"[num_blocks, 1, P, {TOKEN_BYTES}] (HND) or [num_blocks, P*{TOKEN_BYTES}]"
        )
    if page < 1 or shape[0] < 1:
        raise CacheLayoutError(f"{name} of shape {list(shape)} holds no token")
    used = page * TOKEN_BYTES
    if byte_stride != 1 or (page > 1 and tok_stride != TOKEN_BYTES):
        raise CacheLayoutError(
            f"{name} with strides {list(stride)}: the {used} bytes of a block must be contiguous "
            f"(token stride {TOKEN_BYTES}, byte stride 1)"
        )
    block_stride = stride[0] if shape[0] > 1 else max(stride[0], used)
    if shape[0] > 1 and block_stride < used:
        raise CacheLayoutError(
            f"{name}: block stride {block_stride} bytes is smaller than a block of P={page} tokens "
            f"({used} bytes)"
        )
    if block_stride % BLOCK_STRIDE_ALIGN != 0:
        raise CacheLayoutError(
            f"{name}: block stride {block_stride} bytes is not a multiple of {BLOCK_STRIDE_ALIGN}"
        )
    if cache.data_ptr() % BLOCK_STRIDE_ALIGN != 0:
        raise CacheLayoutError(f"{name}: data pointer is not {BLOCK_STRIDE_ALIGN}-byte aligned")
    flat = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    blocks = torch.as_strided(flat, (shape[0], used), (block_stride, 1), flat.storage_offset())
    return CacheView(blocks=blocks, page_block_size=page, block_stride=block_stride)


def quantize_latent(latent: torch.Tensor):
    """Quantize ``[..., 512]`` latent rows as the model writes them.

    Returns ``(nope_fp8 [..., 448] float8_e4m3fn, scale_bytes [..., 7] uint8, rope [..., 64] bf16)``.
    Per token and 64-wide tile: scale = 2**ceil(log2(amax / 448)) with amax clamped below at 1e-4.
    """
    if latent.shape[-1] != D_QK:
        raise ValueError(f"latent rows must be {D_QK} wide, got {latent.shape[-1]}")
    x = latent.float()
    nope = x[..., :D_NOPE].reshape(*x.shape[:-1], NUM_TILES, TILE)
    amax = nope.abs().amax(dim=-1).clamp_min(1e-4)
    exponent = torch.ceil(torch.log2(amax / FP8_E4M3_MAX))
    scaled = (nope / torch.exp2(exponent)[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    nope_fp8 = scaled.to(torch.float8_e4m3fn).reshape(*x.shape[:-1], D_NOPE)
    scale_bytes = (exponent + UE8M0_BIAS).to(torch.uint8)
    rope = latent[..., D_NOPE:].to(torch.bfloat16)
    return nope_fp8, scale_bytes, rope


def pack_latent(latent: torch.Tensor, block_stride: int | None = None) -> torch.Tensor:
    """Pack a latent ``[num_blocks, P, 512]`` into a DSV4 FP8 cache ``[num_blocks, P, 1, 584]`` (NHD).

    ``block_stride`` (bytes, a multiple of 16 and at least P*584) defaults to FlashMLA's
    padding; the bytes of the padding are left 0. The result is a uint8 view of a
    ``[num_blocks, block_stride]`` buffer on the latent's device.
    """
    if latent.dim() != 3 or latent.shape[-1] != D_QK:
        raise ValueError(f"latent must be [num_blocks, P, {D_QK}], got {list(latent.shape)}")
    num_blocks, page, _ = latent.shape
    used = page * TOKEN_BYTES
    stride = default_block_stride(page) if block_stride is None else int(block_stride)
    if stride < used or stride % BLOCK_STRIDE_ALIGN != 0:
        raise ValueError(
            f"block_stride {stride} must be >= P*{TOKEN_BYTES} = {used} and a multiple of {BLOCK_STRIDE_ALIGN}"
        )
    nope_fp8, scale_bytes, rope = quantize_latent(latent)
    buf = torch.zeros(num_blocks, stride, dtype=torch.uint8, device=latent.device)
    rows = buf[:, : page * ROW_BYTES].view(num_blocks, page, ROW_BYTES)
    rows[..., :D_NOPE] = nope_fp8.view(torch.uint8)
    rows[..., D_NOPE:] = rope.contiguous().view(torch.uint8).view(num_blocks, page, 2 * D_ROPE)
    footer = buf[:, page * ROW_BYTES : used].view(num_blocks, page, SCALE_BYTES)
    footer[..., :NUM_TILES] = scale_bytes
    return torch.as_strided(buf, (num_blocks, page, 1, TOKEN_BYTES), (stride, TOKEN_BYTES, TOKEN_BYTES, 1))


def _row_parts(data: torch.Tensor, scales: torch.Tensor):
    """``data`` uint8 [..., 576], ``scales`` uint8 [..., 7] -> (the FP8 nope values as float32
    [..., 7, 64], their scale factors 2**(byte - 127) [..., 7], the rope as float32 [..., 64])."""
    nope = data[..., :D_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    nope = nope.reshape(*nope.shape[:-1], NUM_TILES, TILE)
    factor = torch.exp2(scales.float() - UE8M0_BIAS)
    rope = data[..., D_NOPE:].contiguous().view(torch.bfloat16).float()
    return nope, factor, rope


def _decode_rows(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``data`` uint8 [..., 576], ``scales`` uint8 [..., 7] -> float32 [..., 512]."""
    nope, factor, rope = _row_parts(data, scales)
    nope = (nope * factor[..., None]).reshape(*nope.shape[:-2], D_NOPE)
    return torch.cat([nope, rope], dim=-1)


def unpack_cache(cache: torch.Tensor) -> torch.Tensor:
    """Dequantize a whole cache view back to float32 ``[num_blocks, P, 512]``."""
    view = read_cache_view(cache)
    page = view.page_block_size
    data = view.blocks[:, : page * ROW_BYTES].reshape(view.num_blocks, page, ROW_BYTES)
    footer = view.blocks[:, page * ROW_BYTES :].reshape(view.num_blocks, page, SCALE_BYTES)
    return _decode_rows(data, footer[..., :NUM_TILES])


def _gather_raw(view: CacheView, slots: torch.Tensor):
    """The raw bytes (uint8 [n, 576]) and scale bytes (uint8 [n, 7]) of ``slots`` (flattened)."""
    page = view.page_block_size
    flat_slots = slots.reshape(-1).long()
    block = (flat_slots // page)[:, None]
    offset = (flat_slots % page)[:, None]
    dev = view.blocks.device
    data = view.blocks[block, offset * ROW_BYTES + torch.arange(ROW_BYTES, device=dev)]
    scales = view.blocks[block, page * ROW_BYTES + offset * SCALE_BYTES + torch.arange(NUM_TILES, device=dev)]
    return data, scales


def gather_slots(view: CacheView, slots: torch.Tensor) -> torch.Tensor:
    """Dequantize the rows of ``slots`` (int64, every one in ``[0, num_slots)``) to float32 ``[..., 512]``.

    Reads only the selected rows, so it scales to caches far larger than the gathered set.
    """
    return _decode_rows(*_gather_raw(view, slots)).reshape(*slots.shape, D_QK)


def gather_slot_parts(view: CacheView, slots: torch.Tensor):
    """The rows of ``slots`` as stored: (FP8 nope values as float32 [..., 7, 64], their scale
    factors [..., 7], rope float32 [..., 64]); ``gather_slots`` is their product and concat."""
    nope, factor, rope = _row_parts(*_gather_raw(view, slots))
    return (nope.reshape(*slots.shape, NUM_TILES, TILE), factor.reshape(*slots.shape, NUM_TILES),
            rope.reshape(*slots.shape, rope.shape[-1]))
