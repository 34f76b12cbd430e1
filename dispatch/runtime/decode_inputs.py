"""A decode call's tensors as one record, and the rules every path checks them by.

``DecodeTensors`` is the one list of a call's tensor arguments: the public functions take
them by keyword (``sparse_mla_decode``, ``DecodePlan.run``, the adapters) and pass this
record on (validation, the one-shot call, the plan cache, the plan's launch). Its field order
is the order of every per-call value list the plan writes into the kernels' arguments.

The rules here are shared by ``dispatch.api.validate_call`` (which refuses a call naming
its shape) and the plan's per-call checks (``DecodePlan.run`` / ``bind`` and the plan
cache's hit), so that each says the same thing of the same input.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cute_kernels.sparse_mla_decode.kernel_args import LOG2_E
from cute_kernels.sparse_mla_decode.kv_format import FLT_MIN


class DecodeTensors(NamedTuple):
    """A decode call's tensors (None: an optional input not given; ``out`` / ``lse`` None:
    to be allocated). A tuple subclass: its fields are read by index on the hot paths, where
    it is built from a tuple in field order (``DecodeTensors._make``), a third of the cost of
    a keyword call."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    indices: torch.Tensor
    topk_length: torch.Tensor | None = None
    attn_sink: torch.Tensor | None = None
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    extra_kv_cache: torch.Tensor | None = None
    extra_indices: torch.Tensor | None = None
    extra_topk_length: torch.Tensor | None = None


# per field, the key the kernels' argument bindings name its address by (``plan.Bind``)
BIND_KEYS = dict(q="q", kv_cache="main", indices="indices", topk_length="topk_length", attn_sink="attn_sink",
                 out="out", lse="lse", extra_kv_cache="extra", extra_indices="extra_indices",
                 extra_topk_length="extra_topk_length")
assert tuple(BIND_KEYS) == DecodeTensors._fields
OUT, LSE, ATTN_SINK = (DecodeTensors._fields.index(name) for name in ("out", "lse", "attn_sink"))
assert LSE == OUT + 1  # the outputs are one slice of the record: the one-shot call replaces them together


def layout_signature(t):
    """What a plan fixes about a tensor: shape, strides, dtype and device (None for an absent
    input). ``plan_cache.layout_key`` is the same per tensor, inlined on its hot path."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def byte_span(t: torch.Tensor) -> int:
    """The bytes from ``t``'s first element to one past its last (0 for an empty tensor):
    what two tensors must not share for one to be written while the other is read."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def overlapping_output(addresses, spans, present) -> tuple[str, str] | None:
    """(output, other) names of the first output (out, lse) whose bytes overlap another
    tensor's (any input, or the other output), None when none does: the kernels write the
    outputs while they read the inputs. ``addresses`` / ``spans``: per ``DecodeTensors``
    field (``byte_span``); ``present``: the indices of the tensors given."""
    for o in (OUT, LSE):
        low = addresses[o]
        high = low + spans[o]
        for i in present:
            if i != o and addresses[i] < high and low < addresses[i] + spans[i]:
                return DecodeTensors._fields[o], DecodeTensors._fields[i]
    return None


def overlap_problem(overlap: tuple[str, str]) -> str:
    """The refusal of an ``overlapping_output`` finding, as every path words it."""
    written, other = overlap
    return (f"{written} overlaps {other} in memory; the kernels write {written} while they read the inputs: give "
            f"it memory of its own")


FLT_MAX = 3.4028234663852886e38  # the largest finite float32
# what an sm_scale must be, as every refusal of one says it (``scale_log2``)
SCALE_RULE = ("sm_scale must be a real Python number whose product with log2(e) is 0 or a normal float32 (the "
              "kernels' argument: finite, at least 1.2e-38 in magnitude)")


def scale_log2(sm_scale, default: float) -> float | None:
    """``sm_scale`` (None: ``default``) times log2(e), the kernels' float32 argument; None
    unless it is a real Python number (not a bool) whose product is 0 or a normal float32
    (an ``sm_scale`` finite as a Python float can still become inf, 0 or a subnormal as the
    kernels' float32: 1e300, 1e-50), what ``validate_call`` accepts."""
    if sm_scale is None:
        sm_scale = default
    elif type(sm_scale) is not float:
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
            return None
        sm_scale = float(sm_scale)
    value = sm_scale * LOG2_E
    if value != 0.0 and not FLT_MIN <= abs(value) <= FLT_MAX:  # NaN fails both comparisons
        return None
    return value
