"""The log-sum-exp conventions a caller can ask for, and the conversion between them.

The kernels return this library's convention, ``"natural"``; every other convention is
derived here, on the device, from it and the sink:

- ``"natural"``: ln(sum_j exp(s_j)) with the sink NOT folded in (FlashMLA's, and this
  library's); +inf for a token with no valid entry.
- ``"log2_with_sink"``: log2(sum_j exp(s_j) + exp(sink_h)) (FlashInfer's sparse MLA decode,
  its default, and ``SparseMLASm120Wrapper.run(..., return_lse=True)``'s); for a token with
  no valid entry that is sink_h * log2(e), or -inf without a sink.
- ``"natural_with_sink"``: ln(sum_j exp(s_j) + exp(sink_h)) (FlashInfer's with
  ``return_lse_base="basee"``, and the wrapper's with ``lse_scale=math.log(2)``); for a token
  with no valid entry sink_h, or -inf without a sink.

Mixing conventions has caused bugs in serving engines, so the API never implies one: every
entry point that returns an lse names its convention in an argument.
"""

from __future__ import annotations

import math

import torch

from cute_kernels.sparse_mla_decode.kernel_args import LOG2_E

LSE_CONVENTIONS = ("natural", "log2_with_sink", "natural_with_sink")


def check_convention(convention: str) -> None:
    """Raise ValueError unless ``convention`` is one of ``LSE_CONVENTIONS``."""
    if convention not in LSE_CONVENTIONS:
        raise ValueError(f"lse_convention must be one of {LSE_CONVENTIONS}, got {convention!r}")


def convert_lse(lse: torch.Tensor, attn_sink: torch.Tensor | None, convention: str) -> torch.Tensor:
    """This library's lse (natural, sink not folded in, +inf when empty) in ``convention``."""
    check_convention(convention)
    if convention == "natural":
        return lse
    total = torch.where(torch.isposinf(lse), torch.full_like(lse, -math.inf), lse)  # empty: ln(0) = -inf
    if attn_sink is not None:
        total = torch.logaddexp(total, attn_sink.float().expand_as(total))
    return total * LOG2_E if convention == "log2_with_sink" else total
