"""Drop-in call shapes of other libraries, each a thin layer over ``sparse_mla_decode``.

Every adapter states its log-sum-exp convention as an explicit ``lse_convention`` argument
(``dispatch.lse``: "natural", FlashMLA's and this library's; "log2_with_sink", FlashInfer's).
"""

from __future__ import annotations

import math

import torch

from .api import sparse_mla_decode
from .lse import check_convention, convert_lse
from .metadata import DecodeMetadata, InvalidDecodeInput


def _refuse(problem: str, q) -> None:
    md = DecodeMetadata(num_tokens=None if not isinstance(q, torch.Tensor) else math.prod(q.shape[:-2]),
                        num_heads=None if not isinstance(q, torch.Tensor) else q.shape[-2],
                        d_qk=None if not isinstance(q, torch.Tensor) else q.shape[-1])
    raise InvalidDecodeInput(md, problem)


def _check_convention(convention, q) -> None:
    """Refuse an unknown lse convention before any GPU work (whether or not an lse is returned)."""
    try:
        check_convention(convention)
    except ValueError as err:
        _refuse(str(err), q)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    head_dim_v: int = 512,
    tile_scheduler_metadata=None,
    num_splits=None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    *,
    lse_convention: str = "natural",
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's ``flash_mla_with_kvcache`` call shape, sparse FP8 decode only.

    ``q [B, S, H, 512]``, ``indices [B, S, topk]``; returns ``out [B, S, H, 512]`` bf16 and
    ``softmax_lse [B, H, S]`` float32, as FlashMLA lays them out. ``tile_scheduler_metadata``
    and ``num_splits`` are accepted and not needed (this library plans its own split).
    """
    _check_convention(lse_convention, q)
    if indices is None or not is_fp8_kvcache:
        _refuse("only the sparse FP8 decode path is served: pass indices and is_fp8_kvcache=True", q)
    if block_table is not None or cache_seqlens is not None or causal:
        _refuse("sparse decode takes no block_table, cache_seqlens or causal (the indices select the slots)", q)
    if head_dim_v != 512:
        _refuse(f"head_dim_v must be 512, got {head_dim_v}", q)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        _refuse(f"q must be [batch, seq_q, num_heads, 512], got {getattr(q, 'shape', type(q).__name__)}", q)
    out, lse = sparse_mla_decode(q, k_cache, indices, sm_scale=softmax_scale, topk_length=topk_length,
                                 attn_sink=attn_sink, extra_kv_cache=extra_k_cache,
                                 extra_indices=extra_indices_in_kvcache, extra_topk_length=extra_topk_length)
    return out, convert_lse(lse, attn_sink, lse_convention).transpose(1, 2)


def trtllm_batch_decode_sparse_mla_dsv4(
    query: torch.Tensor,
    swa_kv_cache: torch.Tensor,
    workspace_buffer: torch.Tensor | None,
    sparse_indices: torch.Tensor,
    compressed_kv_cache: torch.Tensor | None = None,
    sparse_topk_lens: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    bmm1_scale: float = 1.0,
    bmm2_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
    kv_layout: str = "HND",
    cum_seq_lens_q: torch.Tensor | None = None,
    max_q_len: int | None = None,
    enable_pdl: bool | None = None,
    swa_topk_lens: torch.Tensor | None = None,
    extra_sparse_indices: torch.Tensor | None = None,
    extra_sparse_topk_lens: torch.Tensor | None = None,
    *,
    return_lse: bool = False,
    lse_convention: str = "log2_with_sink",
):
    """FlashInfer's ``trtllm_batch_decode_sparse_mla_dsv4`` call shape (its SM120 segment form).

    ``query [B, S, H, 512]`` or ``[B, H, 512]``; the main list is ``sparse_indices`` into
    ``swa_kv_cache`` with lengths ``swa_topk_lens`` (``sparse_topk_lens`` is accepted as the
    same thing; not both); the extra list is ``extra_sparse_indices`` into
    ``compressed_kv_cache`` with ``extra_sparse_topk_lens``. ``bmm1_scale`` is the softmax
    scale; ``bmm2_scale`` must be 1 (the cache carries its own scales). ``seq_lens``,
    ``max_q_len``, ``enable_pdl`` and ``workspace_buffer`` are accepted and not needed.
    Returns ``out`` (and, with ``return_lse``, the lse in ``lse_convention``, by default
    FlashInfer's log2 with the sink folded in, shaped like ``out`` without its last dim).
    """
    _check_convention(lse_convention, query)
    if cum_seq_lens_q is not None:
        _refuse("cum_seq_lens_q (ragged query lengths) is not served: pass [batch, seq_q, heads, 512]", query)
    if bmm2_scale != 1.0:
        _refuse(f"bmm2_scale must be 1.0 (the FP8 cache carries its own scales), got {bmm2_scale}", query)
    if sparse_topk_lens is not None and swa_topk_lens is not None:
        _refuse("pass the main list's lengths once: sparse_topk_lens or swa_topk_lens, not both", query)
    if kv_layout not in ("HND", "NHD"):
        _refuse(f"kv_layout must be 'HND' or 'NHD', got {kv_layout!r}", query)
    for name, cache in (("swa_kv_cache", swa_kv_cache), ("compressed_kv_cache", compressed_kv_cache)):
        if isinstance(cache, torch.Tensor) and cache.dim() == 4:
            head_axis = 1 if kv_layout == "HND" else 2  # [nb, 1, P, 584] or [nb, P, 1, 584]
            if cache.shape[head_axis] != 1:
                _refuse(f"{name} of shape {list(cache.shape)} is not laid out as kv_layout={kv_layout!r}", query)
    if (compressed_kv_cache is None) != (extra_sparse_indices is None):
        _refuse("compressed_kv_cache and extra_sparse_indices go together: pass both or neither", query)
    lengths = swa_topk_lens if swa_topk_lens is not None else sparse_topk_lens
    squeeze = isinstance(query, torch.Tensor) and query.dim() == 3
    q = query.unsqueeze(1) if squeeze else query
    idx = sparse_indices.unsqueeze(1) if squeeze and sparse_indices.dim() == 2 else sparse_indices
    e_idx = extra_sparse_indices
    if squeeze and e_idx is not None and e_idx.dim() == 2:
        e_idx = e_idx.unsqueeze(1)
    o = None if out is None else (out.unsqueeze(1) if squeeze else out)
    result, lse = sparse_mla_decode(q, swa_kv_cache, idx, sm_scale=float(bmm1_scale), topk_length=lengths,
                                    attn_sink=sinks, extra_kv_cache=compressed_kv_cache, extra_indices=e_idx,
                                    extra_topk_length=extra_sparse_topk_lens, out=o)
    if squeeze:
        result, lse = result.squeeze(1), lse.squeeze(1)
    if not return_lse:
        return result
    return result, convert_lse(lse, sinks, lse_convention)
