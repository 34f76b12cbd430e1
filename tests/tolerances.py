"""The accuracy bounds of the GPU tests, in one place, and the check that applies them.

The out bound and the rounding floors it is relative to are the package's
(``dispatch/tools/accuracy.py``, shared with ``dsv4-mla-check-aot``):

- out ("bf16", "f16"): per query token, the relative L2 error of out against the float64
  reference at most ``OUT_FLOOR_FACTOR`` times the error that rounding the reference itself
  to bf16 has (the floor: the kernels return bf16). A token whose reference is exactly
  representable (a single entry, duplicates of one entry) must then come out exact.
- out ("fp8", "mxf8"): these paths round P to e4m3 by design (1-2% of out); their floor is
  the error of their own modelled rounding on the same case (``fp8_model.fp8_path_decode``,
  then to bf16), and the bound ``OUT_FLOOR_FACTOR`` times that.
- lse (every path: its scores are f32 sums of exactly dequantized values): absolute error
  at most ``LSE_TOL`` times max(1, |lse|), +inf exactly where the reference is +inf.
"""

from __future__ import annotations

import zlib

import torch

from dispatch.tools.accuracy import (  # noqa: F401  (the bounds the GPU tests import from here)
    OUT_FLOOR_FACTOR, bf16_floor, out_error_and_bound, rel_l2_per_token, rounding_floor,
)

LSE_TOL = 1e-5
ACCURACY = []  # (case, out rel L2, lse error, error / floor): printed in the terminal summary (conftest.py)


def seed_for(name: str) -> int:
    """The fixed seed of a test case: every run draws the same inputs (printed on failure)."""
    return zlib.crc32(name.encode())


def check_against_reference(out, lse, ref_out, ref_lse, *, floor, seed, what=""):
    """Assert out / lse against the reference with the module's bounds; ``floor``: the
    per-token rounding floor (``bf16_floor``, or the FP8 model's). Returns (worst relative
    out error, worst lse error relative to max(1, |lse|), worst out error / floor)."""
    tag = f"[seed {seed}] {what}"
    out, lse, ref_lse = out.cpu(), lse.cpu(), ref_lse.cpu().double()
    ref_out, floor = ref_out.cpu(), floor.cpu()
    assert torch.isfinite(out).all(), f"{tag}: out has NaN/inf (an unwritten or poisoned element?)"
    err, scale = rel_l2_per_token(out, ref_out)
    zero = scale == 0
    assert (err[zero] == 0).all(), f"{tag}: tokens whose reference output is 0 must be exactly 0"
    rel, bound = out_error_and_bound(out, ref_out, floor)
    bad = (rel > bound).nonzero().flatten()
    assert bad.numel() == 0, (f"{tag}: out relative L2 error above {OUT_FLOOR_FACTOR} x the rounding floor at tokens "
                              f"{bad[:5].tolist()}: {rel[bad[:5]].tolist()} > {bound[bad[:5]].tolist()}")
    inf_ref = torch.isposinf(ref_lse)
    assert torch.equal(torch.isposinf(lse), inf_ref), f"{tag}: lse must be +inf exactly for tokens with no valid entry"
    assert not torch.isnan(lse).any(), f"{tag}: lse has NaN"
    fin = ~inf_ref
    lse_rel = ((lse.double()[fin] - ref_lse[fin]).abs() / ref_lse[fin].abs().clamp_min(1.0))
    worst_lse = lse_rel.max().item() if lse_rel.numel() else 0.0
    assert worst_lse <= LSE_TOL, f"{tag}: lse error {worst_lse:.3e} x max(1, |lse|) > {LSE_TOL}"
    ratio = torch.where(bound > 0, rel / bound.clamp_min(1e-300), torch.zeros_like(rel))
    worst = rel.max().item() if rel.numel() else 0.0
    return worst, worst_lse, (OUT_FLOOR_FACTOR * ratio.max().item()) if ratio.numel() else 0.0
