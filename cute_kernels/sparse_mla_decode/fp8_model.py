"""The arithmetic of the FP8 compute path, in torch: the design space and the kernel's form.

Issue "Fast", item 2: QK over the nope dims in FP8 with the cache's own scales, Q quantized
per 64-wide tile to e4m3 with a power-of-two scale, the probabilities requantized to FP8
for the value product with the value scales folded in, the rope dims in bf16. This module
computes exactly that rounding in float32 torch, so that

- the accuracy of the FP8 precision against the float32 reference is known before (and
  independently of) any kernel: ``tests/test_fp8_model.py`` measures it;
- the FP8 kernels, when written, have an oracle for their own rounding.

Rounding steps, per query token t and head h (everything else is exact or float32):
1. q nope, per 64-wide tile i: scale_q = 2**ceil(log2(amax / 448)), q8 = e4m3(q / scale_q)
   (the rule the model uses for the cache); q rope stays bf16 (it already is).
2. s_j = sm_scale * (sum_i scale_q[i] * k_scale[j, i] * <q8_i, k8_j,i> + <q_rope, k_rope_j>),
   f32 accumulation; k8 and k_scale are the cache's bytes: no rounding.
3. p_j = exp(s_j - m), m the max over the valid entries (the kernel's online softmax reaches
   the same normalized values; its intermediate maxima are not modelled).
4. Per chunk of ``block_n`` list entries (main chunks, then extra chunks, as the kernel
   walks them) and value tile i: p'_j = p_j * v_scale[j, i], requantized per (h, chunk, i)
   with a power-of-two scale to e4m3; out_nope_i = sum_j e4m3(p'_j) * v8_j,i; the rope part
   of the value uses p_j rounded to bf16 (the bf16 MMA).
5. out = (sum of the above) / sum_j p_j (f32), sink and empty rows as the reference.

The kernel (``partial_fp8.py``) is ``KERNEL_FORM``: Q with one power-of-two scale per head
over all 448 nope dims, as two terms (hi = e4m3(q / sq), lo = e4m3(16 (q / sq - hi)) / 16),
and P' = e4m3(p_j * 2**(b_j - R + 8)) with R the running maximum, over the chunks so far,
of the tile's scale byte b over the valid entries (one split; the kernel's running R is
per split and its p uses the running softmax max, which this model does not follow).
"""

from __future__ import annotations

import math

import torch

from .cache_format import gather_slot_parts, read_cache_view
from .layout import D_NOPE, D_QK, FP8_E4M3_MAX, NUM_TILES, TILE
from .reference import apply_sink_and_empty, valid_entries


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bf16, back in float32 (the bf16 MMA operands)."""
    return x.to(torch.bfloat16).float()


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to e4m3 (nearest even; callers keep it within +-448), back in float32."""
    return x.to(torch.float8_e4m3fn).float()


def round_e4m3_pow2(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` rounded to e4m3 with one power-of-two scale per slice along ``dim`` (amax -> at
    most 448): the value the FP8 operand holds, back in float32. All-zero slices stay 0."""
    amax = x.abs().amax(dim=dim, keepdim=True)
    exponent = torch.ceil(torch.log2(torch.where(amax > 0, amax, 1.0) / FP8_E4M3_MAX))
    scale = torch.exp2(exponent)
    return round_e4m3((x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)) * scale


def round_e4m3_head_two_terms(x: torch.Tensor, terms: int = 2) -> torch.Tensor:
    """``x`` [..., D] with one power-of-two scale per row, 2**ceil(log2(amax / 448)) (from
    frexp: exact), as ``terms`` e4m3 terms: hi = e4m3(x / s), lo = e4m3(16 (x / s - hi)) / 16
    (the kernel's Q operands), back in float32."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    mant, exp = torch.frexp(amax / FP8_E4M3_MAX)  # amax / 448 = mant * 2**exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)
    e = torch.where(amax > 0, e, 0).clamp(-126, 127)
    scale = torch.exp2(e.float())
    y = x / scale
    hi = round_e4m3(y)
    if terms == 1:
        return hi * scale
    lo = round_e4m3((y - hi) * 16) / 16
    return (hi + lo) * scale


def _list_parts(q8, q_rope, cache, indices, topk_length, sm_scale):
    """Scores [T, H, k] (invalid: -inf) and the stored value parts of one list."""
    view = read_cache_view(cache)
    valid = valid_entries(indices, view.num_slots, topk_length)
    k8, factor, rope = gather_slot_parts(view, torch.where(valid, indices.long(), 0))  # [T,k,7,64] [T,k,7] [T,k,64]
    nope = torch.einsum("thid,tkid->thki", q8, k8) * factor[:, None, :, :]  # per tile, scaled
    scores = (nope.sum(-1) + torch.einsum("thd,tkd->thk", q_rope, rope)) * sm_scale
    return scores.masked_fill(~valid[:, None, :], float("-inf")), k8, factor, rope


def _chunked(x: torch.Tensor, block_n: int) -> torch.Tensor:
    """[T, k, ...] -> [T, chunks, block_n, ...], zero-padded at the end."""
    pad = -x.shape[1] % block_n
    if pad:
        x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)
    return x.reshape(x.shape[0], -1, block_n, *x.shape[2:])


P_FORMATS = ("e4m3", "e4m3_running_max", "bf16")
KERNEL_FORM = dict(q_terms=2, q_scale="head", p_format="e4m3_running_max")


def _running_scale_max(lists, block_n: int) -> torch.Tensor:
    """[T, chunks of all lists, 7]: per tile, the running maximum over the chunks (main, then
    extra) of the valid entries' value scale (1 until a chunk has one)."""
    per_chunk = []
    for scores_l, _, factor, _ in lists:
        valid = torch.isfinite(scores_l[:, 0])  # [T, k]: the same for every head
        per_chunk.append(_chunked(torch.where(valid[..., None], factor, 0.0), block_n).amax(dim=2))
    running = torch.cummax(torch.cat(per_chunk, dim=1), dim=1).values
    return torch.where(running > 0, running, 1.0)


def fp8_path_decode(
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
    block_n: int = 32,
    q_terms: int = 1,
    p_format: str = "e4m3",
    q_scale: str = "tile",
):
    """``(out float32 [T, H, 512], lse float32 [T, H])`` as the FP8 path rounds them; the
    arguments and semantics are those of ``reference.reference_decode``.

    Two design alternatives, to compare before writing a kernel: ``q_terms=2`` holds the Q
    nope tile as the sum of two e4m3 terms (the second quantizes what the first missed; two
    FP8 QK MMAs), ``p_format="bf16"`` multiplies the probabilities in bf16 against the value
    dequantized to bf16 (exact: e4m3 times a power of two) instead of requantizing them.
    The kernel's form (``KERNEL_FORM``): ``q_scale="head"`` (one scale per head, the second
    term scaled by 16 within it), ``p_format="e4m3_running_max"`` (module docstring)."""
    if q_terms not in (1, 2) or p_format not in P_FORMATS or q_scale not in ("tile", "head"):
        raise ValueError(f"q_terms must be 1 or 2, p_format one of {P_FORMATS} and q_scale 'tile' or 'head', "
                         f"got {q_terms}, {p_format!r}, {q_scale!r}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D_QK)
    T, H, _ = q.shape
    qf = q.float()
    q_nope = qf[..., :D_NOPE].reshape(T, H, NUM_TILES, TILE)
    if q_scale == "head":
        q8 = round_e4m3_head_two_terms(qf[..., :D_NOPE], q_terms).reshape(T, H, NUM_TILES, TILE)
    else:
        q8 = round_e4m3_pow2(q_nope, dim=-1)
        if q_terms == 2:
            q8 = q8 + round_e4m3_pow2(q_nope - q8, dim=-1)
    q_rope = qf[..., D_NOPE:]
    lists = [_list_parts(q8, q_rope, kv_cache, indices, topk_length, sm_scale)]
    if extra_kv_cache is not None and extra_indices is not None and extra_indices.shape[-1] > 0:
        lists.append(_list_parts(q8, q_rope, extra_kv_cache, extra_indices, extra_topk_length, sm_scale))
    scores = torch.cat([s for s, *_ in lists], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    m = torch.where(empty, 0.0, scores.amax(dim=-1))
    out_nope = torch.zeros(T, H, NUM_TILES, TILE)
    out_rope = torch.zeros(T, H, D_QK - D_NOPE)
    total = torch.zeros(T, H)
    running = _running_scale_max(lists, block_n) if p_format == "e4m3_running_max" else None
    c0 = 0
    for scores_l, k8, factor, rope in lists:  # each list's chunks: the kernel's chunks
        p = torch.exp(scores_l - m[..., None])  # [T, H, k], 0 for invalid entries
        total += p.sum(-1)
        pc = _chunked(p.transpose(1, 2), block_n)  # [T, C, n, H]
        pv = pc[..., None] * _chunked(factor, block_n)[:, :, :, None, :]  # [T, C, n, H, 7]
        if p_format == "e4m3":
            pv8 = round_e4m3_pow2(pv, dim=2)  # one scale per (token, chunk, head, tile)
        elif p_format == "e4m3_running_max":
            r = running[:, c0:c0 + pc.shape[1], None, None, :] * 2.0**-8  # [T, C, 1, 1, 7]
            pv8 = round_e4m3(pv / r) * r
            c0 += pc.shape[1]
        else:
            pv8 = round_bf16(pc)[..., None] * _chunked(factor, block_n)[:, :, :, None, :]
        out_nope += torch.einsum("tcnhi,tcnid->thid", pv8, _chunked(k8, block_n))
        p_bf16 = round_bf16(pc)
        out_rope += torch.einsum("tcnh,tcnd->thd", p_bf16, _chunked(rope, block_n))
    out = torch.cat([out_nope.reshape(T, H, D_NOPE), out_rope], dim=-1) / torch.where(empty, 1.0, total)[..., None]
    return apply_sink_and_empty(out, lse, attn_sink)
