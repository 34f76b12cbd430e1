"""What the engine call shapes share: a refusal naming what can be read of the call, the
cache format a call's cache is read as, the lse convention and FlashInfer's two scales."""

from __future__ import annotations

import math
from typing import NoReturn

import torch

from cute_kernels.sparse_mla_decode.cache_view import format_of
from cute_kernels.sparse_mla_decode.kv_format import KvFormat

from ..policy.call_metadata import DecodeMetadata, InvalidDecodeInput
from ..runtime.decode_inputs import scalar_problem
from ..runtime.lse import check_convention


def refuse(problem: str, q, kv_format: str | None = None) -> NoReturn:
    """Raise ``InvalidDecodeInput`` for ``problem``, naming what can be read of the call."""
    shaped = isinstance(q, torch.Tensor) and q.dim() >= 3
    md = DecodeMetadata(num_tokens=math.prod(q.shape[:-2]) if shaped else None,
                        num_heads=q.shape[-2] if shaped else None,
                        d_qk=q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() >= 1 else None,
                        kv_format=kv_format)
    raise InvalidDecodeInput(md, problem)


def known_format(cache, kv_format: str | None) -> KvFormat | None:
    """The format ``cache`` is read as (``kv_format``, or its width), None where that cannot
    be told: ``sparse_mla_decode`` then refuses the cache with the reason."""
    try:
        return format_of(cache, kv_format)
    except Exception:
        return None


def check_lse_convention(convention, q) -> None:
    """Refuse an unknown lse convention before any GPU work (whether or not an lse is returned)."""
    try:
        check_convention(convention)
    except ValueError as err:
        refuse(str(err), q)


def flashinfer_scale_problem(bmm1_scale, bmm2_scale) -> str | None:
    """What FlashInfer's two scales ask that the kernels do not do (None: nothing), for both
    FlashInfer call shapes. (A tensor scale: FlashInfer 0.7.4's SM120 V3.2 / GLM path refuses
    it too, ``flashinfer/mla/_core.py`` l. 634-636.) Any other ``bmm1_scale`` is the API's ``sm_scale``, refused by its
    rule (``SCALE_RULE``) where it is not a usable number."""
    for name, value in (("bmm1_scale", bmm1_scale), ("bmm2_scale", bmm2_scale)):
        if isinstance(value, torch.Tensor):
            return (f"{name} must be a real Python number, not a tensor: it would be read back to the host (a "
                    f"synchronization, wrong under CUDA-graph capture; FlashInfer's SM120 V3.2 / GLM path refuses "
                    f"it too)")
    if scalar_problem(bmm2_scale, "bmm2_scale", "number") is not None or bmm2_scale != 1.0:
        return f"bmm2_scale must be 1.0 (the FP8 cache carries its own scales), got {bmm2_scale!r}"
    return None


def flags_problem(*flags: tuple[str, object, bool]) -> str | None:
    """The first of ``(name, value, none_ok)`` that is not True or False (or None where
    ``none_ok``: FlashInfer's default), in ``scalar_problem``'s words; None: all are."""
    for name, value, none_ok in flags:
        if value is True or value is False or (none_ok and value is None):
            continue  # the common call: no message built
        problem = scalar_problem(value, name, "flag", none_ok=none_ok)
        if problem is not None:
            return problem
    return None


def valid_heads(q, out, sink, num_valid_heads, kv_format):
    """The first ``num_valid_heads`` heads of ``q``, ``out`` and ``sink`` (views): an engine
    that pads the query heads for another kernel says how many are real, and only those are
    read and computed; the padded rows of ``out`` are left as they are."""
    if scalar_problem(num_valid_heads, "num_valid_heads", "int") is not None or not (
            isinstance(q, torch.Tensor) and q.dim() >= 3 and 1 <= num_valid_heads <= q.shape[-2]):
        refuse(f"num_valid_heads must be an int in [1, num_heads], got {num_valid_heads!r}", q, kv_format)
    if not isinstance(out, torch.Tensor) or out.dim() != q.dim():
        refuse("num_valid_heads needs out (the padded heads' rows are left as they are)", q, kv_format)
    if isinstance(sink, torch.Tensor) and sink.dim() == 1 and sink.shape[0] == q.shape[-2]:
        sink = sink[:num_valid_heads]
    return q[..., :num_valid_heads, :], out[..., :num_valid_heads, :], sink
