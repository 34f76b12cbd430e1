"""Reading a cache back with torch: the stored values and scales of selected slots, addressed
as the kernels address them (``cache_view.CacheView``), their dequantized latent, and a whole
cache unpacked. The float64 reference and the tests read caches through these."""

from __future__ import annotations

import torch

from .cache_view import CacheView, read_cache_view
from .e2m1 import e2m1_decode, unpack_nibbles
from .kv_format import UE8M0_BIAS, KvFormat


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
