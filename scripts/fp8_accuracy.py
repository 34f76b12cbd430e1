"""Accuracy of the FP8 compute path's rounding against the float32 reference (CPU, no kernel).

    python scripts/fp8_accuracy.py [--seed 0]

Runs ``cute_kernels.sparse_mla_decode.fp8_model.fp8_path_decode`` (the FP8 path's rounding,
modelled in torch) on random DSV4 inputs and prints, per case, the worst token's relative
L2 error of out and the worst absolute error of lse, for these forms: the path as the issue
words it ("fp8": every rounding step), its two parts alone ("Q e4m3 only": P kept exact;
"P e4m3 only": Q kept exact), and two alternatives of ``fp8_path_decode``: Q as two e4m3
terms ("Q 2 terms"), and that with the probabilities in bf16 against the value dequantized
to bf16 ("Q 2 terms, P bf16"); and the form the FP8 kernels implement ("kernel":
``fp8_model.KERNEL_FORM``, Q per head as two terms, P requantized against a running scale
maximum; the GPU suite measures the kernels themselves). q = randn * q_scale: a larger q_scale makes the softmax
sharper (the scores grow with it), which is where the errors of the Q quantization show.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cute_kernels.sparse_mla_decode.fp8_model as fp8_model  # noqa: E402
from cute_kernels.sparse_mla_decode.reference import reference_decode  # noqa: E402
from tests.dsv4_inputs import make_cache, make_indices  # noqa: E402

# (T, H, topk, extra_topk, q_scale)
CASES = [(8, 16, 128, 0, 1.0), (8, 64, 512, 0, 1.0), (8, 16, 1024, 0, 1.0), (8, 16, 128, 512, 1.0),
         (8, 16, 512, 0, 4.0), (8, 16, 512, 0, 8.0), (8, 16, 2048, 0, 8.0)]


def _errors(out, lse, ref_out, ref_lse):
    rel = ((out - ref_out).norm(dim=(1, 2)) / ref_out.norm(dim=(1, 2)).clamp_min(1e-30)).max().item()
    finite = torch.isfinite(ref_lse)
    return rel, (lse[finite] - ref_lse[finite]).abs().max().item()


FORMS = (("fp8", "both", {}), ("Q e4m3 only", "q", {}), ("P e4m3 only", "p", {}),
         ("Q 2 terms", "both", {"q_terms": 2}), ("Q 2 terms, P bf16", "both", {"q_terms": 2, "p_format": "bf16"}),
         ("kernel", "both", fp8_model.KERNEL_FORM))


def run(keep: str, form: dict, q, cache, idx, kw, ref):
    """``keep``: which e4m3 rounding steps stay on ("both", "q", "p")."""
    rounding = fp8_model.round_e4m3_pow2

    def selective(x, dim):
        is_q = x.dim() == 4  # q: [T, H, tiles, 64]; probabilities: [T, chunks, n, H, tiles]
        return rounding(x, dim) if keep == "both" or (keep == "q") == is_q else x

    if keep == "both":
        return _errors(*fp8_model.fp8_path_decode(q, cache, idx, **form, **kw), *ref)

    fp8_model.round_e4m3_pow2 = selective
    try:
        return _errors(*fp8_model.fp8_path_decode(q, cache, idx, **form, **kw), *ref)
    finally:
        fp8_model.round_e4m3_pow2 = rounding


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    cache = make_cache(256, 64, device="cpu", gen=gen)
    extra_cache = make_cache(512, 2, device="cpu", gen=gen)
    print("out rel L2 / lse abs (worst token) against the float32 reference")
    print(f"{'T':>3} {'H':>4} {'topk':>9} {'q_scale':>7}" + "".join(f" {name:>18}" for name, _, _ in FORMS))
    for T, H, topk, extra, q_scale in CASES:
        q = (torch.randn(T, H, 512, generator=gen) * q_scale).bfloat16()
        idx = make_indices(T, topk, 256 * 64, device="cpu", gen=gen)
        kw = {}
        if extra:
            kw = dict(extra_kv_cache=extra_cache, extra_indices=make_indices(T, extra, 1024, device="cpu", gen=gen))
        ref = reference_decode(q, cache, idx, **kw)
        cols = [run(keep, form, q, cache, idx, kw, ref) for _, keep, form in FORMS]
        shape = f"{topk}" + (f"+{extra}" if extra else "")
        print(f"{T:>3} {H:>4} {shape:>9} {q_scale:>7.1f}" + "".join(f" {o:>8.1e} / {e:>7.1e}" for o, e in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
