"""How far a result may be from the float64 reference: the one definition that the tests
(``tests/tolerances.py``) and ``dsv4-mla-check-aot`` share.

Every bound is relative to what rounding alone already costs on the SAME case, so that a
systematic error shows even where it is small. Per query token, the relative L2 error of out
against the float64 reference (``reference.reference_decode``) may be at most
``OUT_FLOOR_FACTOR`` times the case's rounding floor:

- "bf16", "f16": the error of the reference itself rounded to bf16 (the kernels return bf16);
- "fp8", "mxf8": these paths round P to e4m3 by design (1-2% of out); their floor is the
  error of their own modelled rounding on the same case (``fp8_model.fp8_path_decode``, then
  bf16).

A token whose reference is exactly representable (a single entry, duplicates of one entry)
has a floor of 0 and must then come out exact; a token whose reference is 0 must be 0.
"""

from __future__ import annotations

import torch

from cute_kernels.sparse_mla_decode.fp8_model import fp8_path_decode

OUT_FLOOR_FACTOR = 2.0
MODELLED_PRECISIONS = ("fp8", "mxf8")  # the paths whose floor is their own rounding model


def rel_l2_per_token(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(error norm, reference norm) per token of ``[T, H, D]`` tensors, in float64."""
    ref = ref.double()
    return (out.double() - ref).flatten(1).norm(dim=1), ref.flatten(1).norm(dim=1)


def bf16_floor(ref_out: torch.Tensor) -> torch.Tensor:
    """Per token, the relative L2 error of ``ref_out`` rounded to bf16 (0 for a zero token)."""
    err, scale = rel_l2_per_token(ref_out.to(torch.bfloat16), ref_out)
    return torch.where(scale > 0, err / scale.clamp_min(1e-300), torch.zeros_like(err))


def _cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU with its strides kept (a cache view's block stride is part of it)."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage().cpu(), t.storage_offset(), t.shape, t.stride())


def rounding_floor(precision: str, q, *, cache, idx, kw, ref_out) -> torch.Tensor:
    """Per token, what rounding alone costs on this case: the reference rounded to bf16, or
    for the FP8 paths their modelled rounding (computed on the CPU), then bf16."""
    if precision not in MODELLED_PRECISIONS:
        return bf16_floor(ref_out)
    cpu = {k: (_cpu(v) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    model_out, _ = fp8_path_decode(q.cpu(), _cpu(cache), idx.cpu(), **cpu)
    err, scale = rel_l2_per_token(model_out.to(torch.bfloat16), ref_out.cpu())
    return torch.where(scale > 0, err / scale.clamp_min(1e-300), torch.zeros_like(err))


def out_error_and_bound(out: torch.Tensor, ref_out: torch.Tensor, floor: torch.Tensor):
    """Per token (CPU float64): the relative L2 error of ``out`` against ``ref_out`` (for a
    token whose reference is 0: 0 if ``out`` is 0 there, else +inf) and its bound,
    ``OUT_FLOOR_FACTOR`` x ``floor``. A token is within bounds when error <= bound."""
    err, scale = rel_l2_per_token(out.cpu(), ref_out.cpu())
    zero = scale == 0
    rel = torch.where(zero, torch.where(err == 0, 0.0, torch.inf), err / scale.clamp_min(1e-300))
    return rel, OUT_FLOOR_FACTOR * floor.cpu().double()
