"""Reference of DeepSeek-V4 sparse MLA decode (FlashMLA's sparse-decode semantics) in torch.

The oracle every test compares against, in float64 by default. Plain torch, no CUTLASS.

For each query token t and head h, over the valid entries j of the main list and of the
extra list together (ONE softmax):

- an entry is valid when it lies before ``topk_length[t]`` (clamped to [0, topk]) and its
  slot is in ``[0, num_blocks * P)``; ``-1`` and any other slot are ignored, never read;
- s_j = sm_scale * <q[t, h], k_j>; lse = ln(sum_j exp(s_j)); out = sum_j softmax(s)_j * v_j,
  with k_j = v_j = the dequantized 512-dim latent of the slot;
- ``attn_sink[h]`` multiplies out by exp(lse) / (exp(lse) + exp(sink)); lse is unchanged;
- a token with no valid entry gets out = 0 and lse = +inf.
"""

from __future__ import annotations

import torch

from .cache_format import gather_slots, read_cache_view
from .layout import DEFAULT_SM_SCALE


def valid_entries(indices: torch.Tensor, num_slots: int, topk_length: torch.Tensor | None) -> torch.Tensor:
    """Bool mask ``[T, topk]`` of the entries that count."""
    pos = torch.arange(indices.shape[-1], device=indices.device)
    valid = (indices >= 0) & (indices.long() < num_slots)
    if topk_length is not None:
        valid &= pos[None, :] < topk_length.long().clamp(0, indices.shape[-1])[:, None]
    return valid


def _scores_and_values(q, cache, indices, topk_length, sm_scale, dtype):
    view = read_cache_view(cache)
    valid = valid_entries(indices, view.num_slots, topk_length)
    rows = gather_slots(view, torch.where(valid, indices.long(), 0)).to(dtype)  # [T, k, 512], exact
    scores = torch.einsum("thd,tkd->thk", q.to(dtype), rows) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return scores, rows


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
    dtype: torch.dtype = torch.float64,
):
    """Return ``(out [T, H, 512], lse [T, H])`` in ``dtype`` (float64 by default: the test
    oracle) for ``q [T, H, 512]``, ``indices [T, topk]``. The cache values are exact in
    float32, so ``dtype`` decides only the arithmetic's rounding."""
    if sm_scale is None:
        sm_scale = DEFAULT_SM_SCALE
    scores, rows = _scores_and_values(q, kv_cache, indices, topk_length, sm_scale, dtype)
    if extra_kv_cache is not None and extra_indices is not None and extra_indices.shape[-1] > 0:
        s2, r2 = _scores_and_values(q, extra_kv_cache, extra_indices, extra_topk_length, sm_scale, dtype)
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
