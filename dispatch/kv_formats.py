"""The cache formats the decode reads, as a public registry, and their packer and unpacker.

``FORMATS`` maps each format's name to its description (a ``KvFormat``: ``bytes_per_token``,
``d_qk``, ``d_v``, ``model_type``, where its scales sit, ...); ``sparse_mla_decode(...,
kv_format=NAME)`` reads a cache of that format:

| name | model | bytes per token | d_qk | d_v |
| --- | --- | --- | --- | --- |
| ``model1_fp8`` | DeepSeek-V4 (the default) | 584 | 512 | 512 |
| ``model1_nvfp4`` | DeepSeek-V4 NVFP4 | 384 | 512 | 512 |
| ``v32_fp8`` | DeepSeek-V3.2, GLM-5.x | 656 | 576 | 512 |
| ``glm_nope_fp8`` | GLM-5.3 | 528 (rows 528 or 656 apart) | 512 | 512 |
| ``v41_fp8`` | DeepSeek-V4.1 (footer scales) | 528 | 512 | 512 |
| ``v41_fp8_inline`` | DeepSeek-V4.1 (inline scales, flat-row indices) | 528 | 512 | 512 |
| ``v41_nvfp4`` | DeepSeek-V4.1 NVFP4, extra cache only (footer scales) | 288 | 512 | 512 |
| ``v41_nvfp4_inline`` | DeepSeek-V4.1 NVFP4, extra cache only (inline scales, flat-row indices) | 288 | 512 | 512 |

``pack`` quantizes a latent into a cache view the API accepts, as a named serving engine's
writer does (``writers``); ``unpack`` dequantizes a cache back. Both are plain torch and run
on CPU or GPU tensors: thin, validating layers over ``cute_kernels.sparse_mla_decode.cache_writers`` / ``cache_readers``.
"""

from __future__ import annotations

import torch

from cute_kernels.sparse_mla_decode.cache_readers import unpack_cache
from cute_kernels.sparse_mla_decode.cache_writers import (
    WRITERS, check_latent, check_non_finite, check_pack_options, pack_latent,
)
from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT, EXTRA_FORMATS, FORMATS, KvFormat, get_format

from .runtime.decode_inputs import scalar_problem

__all__ = ["FORMATS", "DEFAULT_FORMAT", "EXTRA_FORMATS", "KvFormat", "get_format", "writers", "pack", "unpack"]


def writers(kv_format: str) -> tuple[str, ...]:
    """The writers (scale recipes) ``pack`` can imitate for ``kv_format``, its default first."""
    return tuple(WRITERS[get_format(kv_format).name])


def _positive_int(value, what: str) -> int:
    if scalar_problem(value, what, "int") is not None or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def pack(latent: torch.Tensor, kv_format: str, page_block_size: int, *, writer: str | None = None,
         block_stride: int | None = None, row_stride: int | None = None, fill: int = 0) -> torch.Tensor:
    """Quantize ``latent`` into a ``kv_format`` cache: a uint8 view ``[num_blocks, P, 1, W]``
    (NHD) that ``sparse_mla_decode(..., kv_format=kv_format)`` reads, on the latent's device.

    ``latent``: floating point, ``[num_tokens, d_qk]`` (token s goes to slot s: block s // P,
    row s % P; for a flat-row format with a padded ``block_stride`` its index is then
    (s // P) * R + s % P, R = block_stride / row_stride) or ``[num_blocks, P, d_qk]``. A ``[num_tokens, d_qk]`` latent is padded with zero tokens to
    whole blocks of ``page_block_size`` (``ceil(num_tokens / P)`` blocks): the padding slots
    hold a zero latent as the writer quantizes it (a writer without a scale floor may leave an
    all-zero group NaN, as it does in a pool); no slot below num_tokens is affected. A 3-D
    latent's P must be ``page_block_size``.
    ``writer``: whose scale recipe (``writers(kv_format)``; default the first).
    ``block_stride`` (an int: bytes, a multiple of 16), ``row_stride`` (an int; inline-scale
    formats: bytes between a block's rows, a multiple of 16 and at least the row) and ``fill``
    (the bytes that hold no data: an int in [0, 255]) as ``cache_writers.pack_latent``, which
    refuses what this refuses (``check_latent``, ``check_pack_options``); ``row_stride`` is
    refused for a footer format (its rows are packed); a float, a string or a bool for any of
    them is refused, never converted.
    NaN or Inf in the nope dims: encoded as the writer does where it defines it (FlashInfer's
    V4.1 writers: ``cache_writers.NON_FINITE_RECIPES``), refused naming the element and its
    scale group otherwise (``cache_writers.check_non_finite``); the rope dims are stored as
    they are (bf16).
    Raises ValueError naming what is wrong."""
    fmt = get_format(kv_format)
    page = _positive_int(page_block_size, "page_block_size")
    check_latent(latent, fmt, dims=(2, 3))
    if latent.dim() == 3 and latent.shape[1] != page:
        raise ValueError(f"latent of shape {list(latent.shape)} has blocks of {latent.shape[1]} tokens, "
                         f"page_block_size is {page}")
    check_pack_options(fmt, writer, block_stride, row_stride, fill)  # before the latent is padded
    check_non_finite(latent, fmt.name, writer)  # here, to name the element by the latent's own index
    if latent.dim() == 2:
        num_blocks = -(-latent.shape[0] // page)
        blocks = latent.new_zeros(num_blocks * page, fmt.d_qk)
        blocks[:latent.shape[0]] = latent
        latent = blocks.view(num_blocks, page, fmt.d_qk)
    return pack_latent(latent, fmt.name, writer=writer, block_stride=block_stride, row_stride=row_stride, fill=fill)


def unpack(cache: torch.Tensor, kv_format: str | None = None) -> torch.Tensor:
    """Dequantize a whole cache to float32 ``[num_blocks, P, d_qk]`` (``reshape(-1, d_qk)``:
    slot order; block b's token t is index b * R + t of a flat-row format, R =
    ``CacheView.index_page``). ``kv_format``: the format's name, or None for the one the cache's width
    names. Raises ``CacheLayoutError`` (a ValueError) for a view that is not such a cache."""
    return unpack_cache(cache, kv_format)
