"""Random sparse-MLA decode inputs: caches of every format (``kv_format.FORMATS``) and lists of
slots, for trying the kernels, tests and benchmarks (CPU or GPU tensors; the packer is the
package's own, ``cute_kernels.sparse_mla_decode.cache_writers.pack_latent``)."""

from __future__ import annotations

import torch

from cute_kernels.sparse_mla_decode.cache_view import ALIGN, default_block_stride
from cute_kernels.sparse_mla_decode.cache_writers import pack_latent
from cute_kernels.sparse_mla_decode.kv_format import FLT_MIN
from cute_kernels.sparse_mla_decode.kv_format import get_format

from ..api import INT32_MAX

INT32_MIN = -(2**31)
LAYOUTS = ("nhd", "hnd", "flat", "fp8")


def view_width(kv_format: str, row_stride: int) -> int:
    """The last dimension of a 4-D view of an inline format's cache with rows ``row_stride``
    bytes apart: the widest width the format's views have (its row bytes or a pool pitch,
    ``KvFormat.row_pitches``) that fits in the stride; a footer format's bytes per token."""
    fmt = get_format(kv_format)
    if not fmt.inline:
        return fmt.bytes_per_token
    return max(w for w in fmt.view_widths if w <= row_stride)


def make_cache(num_blocks: int, page: int, *, device, kv_format: str = "model1_fp8", block_stride: int | None = None,
               row_stride: int | None = None, poison_blocks=(), layout: str = "nhd",
               gen: torch.Generator | None = None, spread: int = 0, tiny: bool = False, writer: str | None = None,
               scale_spread: float = 0.0) -> torch.Tensor:
    """A random ``kv_format`` cache of ``num_blocks`` page blocks of ``page`` tokens, as ``writer``
    (``cache_writers.WRITERS``; None: the format's default) writes it.

    Every byte that holds no data is 0xFF (NaN as e4m3, bf16 and FP32; UE8M0 scale 2**128), so
    that a kernel that reads one produces NaN: the padding between blocks (``block_stride``
    past the block's bytes; for a flat-row format, ``KvFormat.flat_rows``, that is the rows
    a block holds past its P tokens, which indices do name: they read as NaN), and for an
    inline format the bytes of a row past its data (a ``row_stride`` wider than the row,
    GLM-5.3's 528-byte rows in 656-byte pool rows). Blocks in ``poison_blocks`` are 0xFF
    throughout (an e2m1 format: e2m1 -6 times an e4m3 NaN scale, NaN; V4.1 FP8: e4m3 NaN
    times 2**128). MODEL1's footer pad byte is 0 (as vLLM and FlashInfer write it), and so are
    the 4 pad bytes of an NVFP4 footer record (its specification). An e2m1 cache
    (``model1_nvfp4``, ``v41_nvfp4``, ``v41_nvfp4_inline``) is its writer's: random e2m1
    codes of the random latent, E4M3 scale bytes from amax / 6 of each 16-dim group
    (``spread``, ``scale_spread`` widen them over more binades; never NaN but in a poisoned
    block).

    ``row_stride``: inline formats only, bytes between a block's rows (a multiple of 16, at
    least the row; default the format's first pitch). ``block_stride``: bytes between blocks
    (default ``default_block_stride``; a flat-row format's, a whole number of rows). Token t
    of block b is index b * ``CacheView.index_page`` + t (``make_indices``' ``index_page``).

    ``spread``: each token's latent is multiplied by a random power of two in
    [2**-spread, 2**spread], so the tokens' scales differ by up to 2**(2 * spread).
    ``scale_spread``: each scale group of each token's nope dims is multiplied by 2**u, u
    uniform in [-scale_spread, scale_spread]: scales over 2 * scale_spread binades, and (for
    a writer of arbitrary FP32 scales, "vllm", "sglang" or "b12x") scales that are not powers of two.

    ``tiny``: the smallest scales of the format, below what a model writes, and the rope dims
    0, so that the output is that tiny latent's alone. UE8M0 (MODEL1, V4.1 FP8): every scale
    byte drawn from 0, 1, 2 (2**-127 .. 2**-125): a kernel that takes byte 0 for 0 rather than
    2**-127 gets it wrong. FP32: every scale FLT_MIN = 2**-126 (vLLM's floor) times a factor
    drawn from [1, 4) (a quarter exactly 1): normal FP32 numbers that no narrower float (f16,
    bf16 products of two of them) holds, not powers of two. E4M3 (NVFP4): every scale byte
    drawn from 1..8, the e4m3 subnormals m * 2**-9 (m = 1..7) and the smallest normal 2**-6:
    a kernel that flushes subnormal scales to 0 gets it wrong. The codes stay the writer's.

    ``layout``: "nhd" ``[num_blocks, P, 1, W]``, "hnd" ``[num_blocks, 1, P, W]``, "flat"
    ``[num_blocks, P * W]`` (needs the format's default row pitch; a width that several
    formats share reads only where ``kv_format`` names the format: ``format_of``), "fp8" (NHD
    as float8_e4m3fn); W: ``view_width``. The views share one buffer of ``num_blocks`` blocks."""
    fmt = get_format(kv_format)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if fmt.inline:
        pitch = fmt.row_pitches[0] if row_stride is None else int(row_stride)
        if pitch < fmt.row_bytes or pitch % ALIGN:
            raise ValueError(f"row_stride {pitch} must be a multiple of {ALIGN} and at least the {fmt.row_bytes} "
                             f"bytes of a {fmt.name} row")
        if layout == "flat" and pitch != fmt.row_pitches[0]:
            raise ValueError(f"a flat {fmt.name} view implies rows {fmt.row_pitches[0]} bytes apart, not {pitch}")
    elif row_stride is not None and row_stride != fmt.bytes_per_token:
        raise ValueError(f"{fmt.name} rows are packed: row_stride must be None or {fmt.bytes_per_token}")
    else:
        pitch = fmt.bytes_per_token

    latent = torch.randn(num_blocks, page, fmt.d_qk, generator=gen, device="cpu")
    if spread:
        latent = latent * torch.exp2(torch.randint(-spread, spread + 1, (num_blocks, page, 1), generator=gen).float())
    if scale_spread:
        u = torch.rand(num_blocks, page, fmt.num_scales, 1, generator=gen) * 2 - 1
        nope = latent[..., :fmt.nope_dims].reshape(num_blocks, page, fmt.num_scales, fmt.scale_group)
        nope = nope * torch.exp2(u * scale_spread)
        latent = torch.cat([nope.reshape(num_blocks, page, fmt.nope_dims), latent[..., fmt.nope_dims:]], dim=-1)
    latent = latent.to(torch.bfloat16)
    stride = default_block_stride(fmt, page, pitch if fmt.inline else None) if block_stride is None else block_stride
    cache = pack_latent(latent.to(device), fmt.name, writer=writer, block_stride=stride,
                        row_stride=pitch if fmt.inline else None, fill=0xFF if fmt.inline else 0)
    buf = torch.as_strided(cache, (num_blocks, stride), (stride, 1))
    if fmt.inline:
        rows = torch.as_strided(cache, (num_blocks, page, fmt.row_bytes), (stride, pitch, 1))
    else:
        rows = buf[:, :page * fmt.row_bytes].view(num_blocks, page, fmt.row_bytes)
    if tiny:
        rows[..., fmt.rope_offset:] = 0
        if fmt.inline:
            records = rows[..., fmt.scale_offset:fmt.scale_offset + fmt.scale_bytes]
        else:
            records = buf[:, page * fmt.row_bytes:page * fmt.bytes_per_token].view(
                num_blocks, page, fmt.footer_bytes)[..., :fmt.scale_bytes]
        shape = (num_blocks, page, fmt.num_scales)
        if fmt.scale_type in ("ue8m0", "e4m3"):  # one byte per scale
            low, high = (0, 3) if fmt.scale_type == "ue8m0" else (1, 9)
            records[...] = torch.randint(low, high, shape, generator=gen, dtype=torch.uint8).to(device)
        else:
            factor = torch.where(torch.rand(shape, generator=gen) < 0.25, 1.0, 1.0 + 3.0 * torch.rand(shape,
                                                                                                      generator=gen))
            scales = (FLT_MIN * factor).float()
            records[...] = scales.view(torch.uint8).reshape(num_blocks, page, fmt.scale_bytes).to(device)
    if not fmt.inline:
        buf[:, page * fmt.bytes_per_token:] = 0xFF
    for b in poison_blocks:
        buf[b] = 0xFF
    width = view_width(fmt.name, pitch)
    if layout in ("nhd", "fp8"):
        view = torch.as_strided(cache, (num_blocks, page, 1, width), (stride, pitch, pitch, 1))
        return view.view(torch.float8_e4m3fn) if layout == "fp8" else view
    if layout == "hnd":
        return torch.as_strided(cache, (num_blocks, 1, page, width), (stride, pitch, pitch, 1))
    return torch.as_strided(cache, (num_blocks, page * pitch), (stride, 1))


def make_indices(num_tokens: int, topk: int, num_slots: int, *, device, usable_blocks=None, page: int = 1,
                 index_page: int | None = None, invalid_frac: float = 0.0,
                 gen: torch.Generator | None = None) -> torch.Tensor:
    """Random slots (with duplicates allowed) from all ``num_slots``, or from the ``page``
    tokens of each of ``usable_blocks``: token t of block b is index b * ``index_page`` + t
    (``CacheView.index_page``, default ``page``: it differs for a flat-row format with padded
    blocks); a fraction ``invalid_frac`` of entries replaced by -1, -2, INT32_MIN, INT32_MAX
    or num_slots."""
    if usable_blocks is None:
        slots = torch.randint(0, num_slots, (num_tokens, topk), generator=gen, dtype=torch.int64)
    else:
        blocks = torch.tensor(list(usable_blocks), dtype=torch.int64)
        pick = blocks[torch.randint(0, len(blocks), (num_tokens, topk), generator=gen)]
        slots = pick * (index_page or page) + torch.randint(0, page, (num_tokens, topk), generator=gen)
    if invalid_frac > 0:
        bad_values = torch.tensor([-1, -2, INT32_MIN, INT32_MAX, num_slots], dtype=torch.int64)
        mask = torch.rand(num_tokens, topk, generator=gen) < invalid_frac
        bad = bad_values[torch.randint(0, len(bad_values), (num_tokens, topk), generator=gen)]
        slots = torch.where(mask, bad, slots)
    return slots.to(torch.int32).to(device)
