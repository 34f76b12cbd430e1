"""Reference of sparse MLA decode (FlashMLA's sparse-decode semantics) in torch, every format.

The oracle every test compares against, in float64 by default. Plain torch, no CUTLASS.

For each query token t and head h, over the valid entries j of the main list and of the
extra list together (ONE softmax):

- an entry is valid when it lies before ``topk_length[t]`` (clamped to [0, topk]) and its
  index is in ``[0, num_slots)`` (``cache_view.CacheView``: ``num_blocks * P``, or for a
  flat-row format every row inside the tensor's storage); ``-1`` and any other index are
  ignored, never read;
- s_j = sm_scale * <q[t, h], k_j>; lse = ln(sum_j exp(s_j)); out = sum_j softmax(s)_j * v_j,
  with k_j the dequantized latent of the slot (d_qk dims) and v_j its first d_v dims
  (``kv_format.KvFormat``: all of it, or the nope dims only where V excludes the rope); each
  cache, main and extra, is read in its own format (the extra one's: ``extra_format_of``);
- ``attn_sink[h]`` multiplies out by exp(lse) / (exp(lse) + exp(sink)); lse is unchanged;
- a token with no valid entry gets out = 0 and lse = +inf.
"""

from __future__ import annotations

import torch

from .cache_readers import gather_slot_parts
from .cache_view import extra_format_of, format_of, read_cache_view


def valid_entries(indices: torch.Tensor, num_slots: int, topk_length: torch.Tensor | None) -> torch.Tensor:
    """Bool mask ``[T, topk]`` of the entries that count."""
    pos = torch.arange(indices.shape[-1], device=indices.device)
    valid = (indices >= 0) & (indices.long() < num_slots)
    if topk_length is not None:
        valid &= pos[None, :] < topk_length.long().clamp(0, indices.shape[-1])[:, None]
    return valid


def _scores_and_values(q, cache, fmt, indices, topk_length, sm_scale, dtype):
    """Scores ``[T, H, k]`` (-inf where an entry is not valid) and values ``[T, k, d_v]`` of
    one cache read as ``fmt``."""
    view = read_cache_view(cache, fmt.name)
    valid = valid_entries(indices, view.num_slots, topk_length)
    nope, factor, rope = gather_slot_parts(view, torch.where(valid, indices.long(), 0))
    nope = (nope.to(dtype) * factor.to(dtype)[..., None]).flatten(-2)  # exact in float64 (4 x 24 bits)
    rows = torch.cat([nope, rope.to(dtype)], dim=-1).masked_fill(~valid[..., None], 0.0)  # [T, k, d_qk]
    scores = torch.einsum("thd,tkd->thk", q.to(dtype), rows) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return scores, rows[..., :view.fmt.d_v]


def reference_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    sm_scale: float | None = None,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    kv_format: str | None = None,
    extra_kv_format: str | None = None,
    dtype: torch.dtype = torch.float64,
):
    """Return ``(out [T, H, d_v], lse [T, H])`` in ``dtype`` (float64 by default: the test
    oracle) for ``q [T, H, d_qk]``, ``indices [T, topk]``. ``kv_format``: the main cache's
    format (None: by the cache's width); ``extra_kv_format``: the extra cache's (None: as the
    API reads it, ``cache_view.extra_format_of``: the main's format where the extra
    cache's width is one of its, else the one its width names). The cache values are exact
    in float32, so ``dtype`` decides only the arithmetic's rounding. ``sm_scale`` defaults to
    the main format's."""
    main_fmt = format_of(kv_cache, kv_format)
    if sm_scale is None:
        sm_scale = main_fmt.default_sm_scale
    scores, rows = _scores_and_values(q, kv_cache, main_fmt, indices, topk_length, sm_scale, dtype)
    if extra_kv_cache is not None and extra_indices is not None and extra_indices.shape[-1] > 0:
        extra_fmt = extra_format_of(extra_kv_cache, main_fmt, extra_kv_format)
        if (extra_fmt.d_qk, extra_fmt.d_v) != (main_fmt.d_qk, main_fmt.d_v):
            raise ValueError(f"an extra {extra_fmt.name} cache (d_qk {extra_fmt.d_qk}, d_v {extra_fmt.d_v}) cannot "
                             f"share a softmax with a {main_fmt.name} main cache (d_qk {main_fmt.d_qk}, d_v "
                             f"{main_fmt.d_v})")
        s2, r2 = _scores_and_values(q, extra_kv_cache, extra_fmt, extra_indices, extra_topk_length, sm_scale,
                                    dtype)
        scores = torch.cat([scores, s2], dim=-1)
        rows = torch.cat([rows, r2], dim=1)
    lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is valid
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - torch.where(empty, 0.0, lse)[..., None])
    out = torch.einsum("thk,tkd->thd", probs, rows)
    return apply_sink_and_empty(out, lse, attn_sink)


def apply_sink_and_empty(out: torch.Tensor, lse: torch.Tensor, attn_sink: torch.Tensor | None):
    """The output conventions on a normalized ``out`` and its ``lse`` (-inf: no valid entry):
    the sink gate exp(lse) / (exp(lse) + exp(sink)) on out, and out = 0, lse = +inf for a
    token with no valid entry."""
    empty = torch.isneginf(lse)
    if attn_sink is not None:
        gate = torch.sigmoid(lse - attn_sink.to(lse.dtype)[None, :])
        out = out * torch.where(empty, 0.0, gate)[..., None]
    out = out.masked_fill(empty[..., None], 0.0)
    lse = lse.masked_fill(empty, float("inf"))
    return out, lse
