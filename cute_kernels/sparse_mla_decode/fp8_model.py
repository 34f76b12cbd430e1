"""The rounding of the FP8 compute path ("fp8", "mxf8"), modelled in torch.

The oracle of the FP8 kernels' own arithmetic: the GPU tests bound each FP8 kernel's error on a
case by twice this model's error on the same case (``tests/tolerances.py``), so the bound
follows from the arithmetic, not from what a kernel happened to produce.

Rounding steps, per query token t and head h (everything else is exact or float32), for every
cache format (``kv_format``; its nope dims in scale groups g with scale s_g):
1. Q's nope dims with one power-of-two scale per head, sq = 2**ceil(log2(amax / 448)) over the
   nope dims, as two e4m3 terms: hi = e4m3(q / sq), lo = e4m3(16 (q / sq - hi)) / 16 (about 8
   significant bits, bf16's); the rope dims stay bf16 (they already are).
2. s_j = sm_scale * (sum_g s_g[j] * <q8_g, k8_j,g> + <q_rope, k_rope_j>), f32 accumulation;
   k8 and the scales are the cache's bytes: no rounding.
3. p_j = exp(s_j - m), m the max over the valid entries (the kernel's online softmax reaches
   the same normalized values; its intermediate maxima are not modelled).
4. Per chunk of ``block_n`` entries (main chunks, then extra chunks, as the kernel walks them)
   and scale group g: P' = e4m3(p_j * s_g[j] / R_g * 2**8), R_g the running maximum over the
   chunks so far of the group's scale over the valid entries (one split; the kernel's R is
   per split; FP32 scales: at least 2**-126, the kernel's floor); out_nope_g = sum_j P'_j
   v8_j,g * R_g / 2**8; where V has the rope dims, their part uses p_j rounded to bf16 (the
   bf16 MMA).
5. out = (sum of the above) / sum_j p_j (f32), sink and empty rows as the reference.

Why this form (``docs/design.md``, "Precision"): Q as one e4m3 term costs far more than as two
(the score error grows with the scores); requantizing P to e4m3 costs 1-2% of out, which is
the path's error.
"""

from __future__ import annotations

import torch

from .cache_readers import gather_slot_parts
from .cache_view import extra_format_of, read_cache_view
from .kv_format import FLT_MIN
from .kv_format import FP8_E4M3_MAX
from .reference import apply_sink_and_empty, valid_entries

P_HEADROOM = 2.0**-8  # P' = P * s / R * 2**8: the running max R times 2**8 of headroom


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bf16, back in float32 (the bf16 MMA operands)."""
    return x.to(torch.bfloat16).float()


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to e4m3 (nearest even; callers keep it within +-448), back in float32."""
    return x.to(torch.float8_e4m3fn).float()


def round_q_two_terms(x: torch.Tensor, terms: int = 2) -> torch.Tensor:
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


def _list_parts(q, cache, kv_format, indices, topk_length, sm_scale):
    """Scores [T, H, k] (invalid: -inf) and the stored value parts of one list: e4m3 values
    [T, k, groups, group], their scales [T, k, groups], rope [T, k, rope_dims]."""
    view = read_cache_view(cache, kv_format)
    fmt = view.fmt
    valid = valid_entries(indices, view.num_slots, topk_length)
    k8, factor, rope = gather_slot_parts(view, torch.where(valid, indices.long(), 0))
    T, H, _ = q.shape
    q8 = round_q_two_terms(q[..., :fmt.nope_dims]).reshape(T, H, fmt.num_scales, fmt.scale_group)
    nope = torch.einsum("thid,tkid->thki", q8, k8) * factor[:, None, :, :]  # per scale group, scaled
    scores = (nope.sum(-1) + torch.einsum("thd,tkd->thk", q[..., fmt.nope_dims:], rope)) * sm_scale
    return scores.masked_fill(~valid[:, None, :], float("-inf")), k8, factor, rope


def _chunked(x: torch.Tensor, block_n: int) -> torch.Tensor:
    """[T, k, ...] -> [T, chunks, block_n, ...], zero-padded at the end."""
    pad = -x.shape[1] % block_n
    if pad:
        x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)
    return x.reshape(x.shape[0], x.shape[1] // block_n, block_n, *x.shape[2:])


def _running_scale_max(lists, block_n: int, fp32_scales: bool) -> torch.Tensor:
    """[T, chunks of all lists, groups]: per scale group, the running maximum over the chunks
    (main, then extra) of the valid entries' value scale (UE8M0: 1 until a chunk has one;
    FP32: at least 2**-126, as the kernel keeps it)."""
    per_chunk = []
    for scores_l, _, factor, _ in lists:
        valid = torch.isfinite(scores_l[:, 0])  # [T, k]: the same for every head
        per_chunk.append(_chunked(torch.where(valid[..., None], factor, 0.0), block_n).amax(dim=2))
    running = torch.cummax(torch.cat(per_chunk, dim=1), dim=1).values
    if fp32_scales:
        return running.clamp_min(FLT_MIN)
    return torch.where(running > 0, running, 1.0)


CALL_ARGS = ("sm_scale", "topk_length", "attn_sink", "extra_kv_cache", "extra_indices", "extra_topk_length",
             "kv_format", "extra_kv_format")


def fp8_path_decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, *, block_n: int = 32, **call):
    """``(out float32 [T, H, d_v], lse float32 [T, H])`` as the FP8 path rounds them (module
    docstring). ``call``: the keyword arguments of ``reference.reference_decode``
    (``CALL_ARGS``), with its semantics. CPU tensors."""
    unknown = set(call) - set(CALL_ARGS)
    if unknown:
        raise TypeError(f"fp8_path_decode got unexpected arguments {sorted(unknown)}")
    fmt = read_cache_view(kv_cache, call.get("kv_format")).fmt
    if fmt.e2m1:
        raise ValueError(f"the FP8 paths do not read {fmt.name} caches (e2m1 values): nothing to model")
    sm_scale = fmt.default_sm_scale if call.get("sm_scale") is None else call["sm_scale"]
    extra_kv_cache, extra_indices = call.get("extra_kv_cache"), call.get("extra_indices")
    T, H, _ = q.shape
    qf = q.float()
    lists = [_list_parts(qf, kv_cache, fmt.name, indices, call.get("topk_length"), sm_scale)]
    if extra_kv_cache is not None and extra_indices is not None and extra_indices.shape[-1] > 0:
        extra_fmt = extra_format_of(extra_kv_cache, fmt, call.get("extra_kv_format"))  # as the API reads it
        if extra_fmt.e2m1:
            raise ValueError(f"the FP8 paths do not read {extra_fmt.name} caches (e2m1 values): nothing to model")
        lists.append(_list_parts(qf, extra_kv_cache, extra_fmt.name, extra_indices, call.get("extra_topk_length"),
                                 sm_scale))
    scores = torch.cat([s for s, *_ in lists], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    m = torch.where(empty, 0.0, scores.amax(dim=-1))
    out_nope = torch.zeros(T, H, fmt.num_scales, fmt.scale_group)
    out_rope = torch.zeros(T, H, fmt.rope_dims)
    total = torch.zeros(T, H)
    running = _running_scale_max(lists, block_n, fmt.fp32_scales)
    c0 = 0
    for scores_l, k8, factor, rope in lists:  # each list's chunks: the kernel's chunks
        p = torch.exp(scores_l - m[..., None])  # [T, H, k], 0 for invalid entries
        total += p.sum(-1)
        pc = _chunked(p.transpose(1, 2), block_n)  # [T, C, n, H]
        pv = pc[..., None] * _chunked(factor, block_n)[:, :, :, None, :]  # [T, C, n, H, groups]
        r = running[:, c0:c0 + pc.shape[1], None, None, :] * P_HEADROOM  # [T, C, 1, 1, groups]
        pv8 = round_e4m3(pv / r) * r
        c0 += pc.shape[1]
        out_nope += torch.einsum("tcnhi,tcnid->thid", pv8, _chunked(k8, block_n))
        out_rope += torch.einsum("tcnh,tcnd->thd", round_bf16(pc), _chunked(rope, block_n))
    out = out_nope.reshape(T, H, fmt.nope_dims)
    if fmt.rope_in_v:
        out = torch.cat([out, out_rope], dim=-1)
    out = out / torch.where(empty, 1.0, total)[..., None]
    return apply_sink_and_empty(out, lse, call.get("attn_sink"))
