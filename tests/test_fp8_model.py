"""The FP8 compute path's arithmetic model (cute_kernels/sparse_mla_decode/fp8_model.py), on the CPU.

Two properties that can fail: its rounding primitive keeps e4m3's bounds, and with every
rounding step turned off the model is the float32 reference (so the chunking, the scale
folding and the sink/empty handling are right, and what remains is rounding only). Its
measured accuracy is printed by scripts/fp8_accuracy.py and recorded in the README.
"""

from __future__ import annotations

import math

import pytest
import torch

import cute_kernels.sparse_mla_decode.fp8_model as fp8_model
from cute_kernels.sparse_mla_decode.reference import reference_decode
from tests.dsv4_inputs import make_cache, make_indices


def test_round_e4m3_pow2_keeps_e4m3_bounds():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    magnitudes = torch.exp2(torch.randint(-60, 60, (64, 1), generator=gen).float())
    x = torch.randn(64, 48, generator=gen) * magnitudes
    x[3] = 0.0  # an all-zero slice
    r = fp8_model.round_e4m3_pow2(x, dim=-1)
    amax = x.abs().amax(-1, keepdim=True)
    scale = r.abs().amax(-1, keepdim=True) / 448
    assert torch.equal(r[3], torch.zeros(48))
    rows = amax[:, 0] > 0
    # one power-of-two scale per slice: the largest element lands in (224, 448]
    exponent = torch.ceil(torch.log2(amax[rows] / 448))
    assert torch.all(x[rows].abs().amax(-1, keepdim=True) / torch.exp2(exponent) <= 448)
    assert torch.all(r[rows].abs() <= 448 * torch.exp2(exponent))
    # e4m3 normals (>= 2**-6 of the scale) are within half an ulp: 2**-4 relative
    normal = x.abs() >= torch.exp2(torch.ceil(torch.log2(torch.where(amax > 0, amax, 1.0) / 448)) - 6)
    err = (r - x).abs()
    assert torch.all(err[normal] <= x.abs()[normal] * 2.0**-4 + 1e-30)
    assert scale.shape == (64, 1)


@pytest.mark.parametrize("extra,form", [
    (False, dict(q_terms=1, p_format="e4m3")), (True, dict(q_terms=1, p_format="e4m3")),
    (True, dict(q_terms=2, p_format="e4m3")), (True, dict(q_terms=2, p_format="bf16")),
    (False, fp8_model.KERNEL_FORM), (True, fp8_model.KERNEL_FORM),
])
def test_fp8_model_without_rounding_is_the_reference(monkeypatch, extra, form):
    monkeypatch.setattr(fp8_model, "round_e4m3", lambda x: x)
    monkeypatch.setattr(fp8_model, "round_bf16", lambda x: x)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    T, H, topk = 5, 8, 100  # 100: not a multiple of the 32-entry chunk
    cache = make_cache(16, 64, device="cpu", gen=gen)
    q = torch.randn(T, H, 512, generator=gen).bfloat16()
    idx = make_indices(T, topk, 16 * 64, device="cpu", invalid_frac=0.2, gen=gen)
    kw = dict(topk_length=torch.tensor([0, 100, 37, -5, 1000], dtype=torch.int32),
              attn_sink=torch.tensor([0.0, 1.0, -2.0, math.inf, -math.inf, 3.0, 0.5, -0.5]), sm_scale=0.07)
    if extra:
        kw.update(extra_kv_cache=make_cache(40, 2, device="cpu", gen=gen),
                  extra_indices=make_indices(T, 70, 80, device="cpu", invalid_frac=0.1, gen=gen),
                  extra_topk_length=torch.tensor([70, 0, 12, 70, 33], dtype=torch.int32))
    ref_out, ref_lse = reference_decode(q, cache, idx, **kw)
    out, lse = fp8_model.fp8_path_decode(q, cache, idx, **form, **kw)
    assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and torch.equal(ref_lse[~finite], lse[~finite])
    assert torch.allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    assert not extra or torch.isposinf(ref_lse[3]).sum() < H  # token 3 has extra entries when extra is given


def test_fp8_model_refuses_unknown_forms():
    q = torch.zeros(1, 1, 512).bfloat16()
    cache = make_cache(1, 64, device="cpu")
    idx = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="q_terms must be 1 or 2"):
        fp8_model.fp8_path_decode(q, cache, idx, q_terms=3)
    with pytest.raises(ValueError, match="p_format"):
        fp8_model.fp8_path_decode(q, cache, idx, p_format="e5m2")
    with pytest.raises(ValueError, match="q_scale"):
        fp8_model.fp8_path_decode(q, cache, idx, q_scale="row")


def test_two_q_terms_are_closer_than_one():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(16, 7, 64, generator=gen) * 3
    one = fp8_model.round_e4m3_pow2(x, dim=-1)
    two = one + fp8_model.round_e4m3_pow2(x - one, dim=-1)
    assert (two - x).norm() < (one - x).norm() / 8  # the second term holds ~4 more bits


def test_head_scaled_two_terms_hold_about_8_bits():
    """The kernel's Q operands: hi + lo / 16 per head is within 2**-8 of the row's largest
    magnitude of every element (one term: only 2**-4), for rows spanning many binades."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(32, 448, generator=gen) * torch.exp2(torch.randint(-20, 20, (32, 1), generator=gen).float())
    x = x.bfloat16().float()  # the kernel's input is bf16
    amax = x.abs().amax(-1, keepdim=True)
    one = fp8_model.round_e4m3_head_two_terms(x, terms=1)
    two = fp8_model.round_e4m3_head_two_terms(x, terms=2)
    assert torch.all((two - x).abs() <= amax * 2.0**-8)
    assert torch.any((one - x).abs() > amax * 2.0**-8)


def test_kernel_form_accuracy_is_inside_the_gpu_tolerance():
    """The FP8 kernels are tested against OUT_REL_L2_MAX["fp8"] / LSE_ABS_MAX["fp8"]: the
    model of their rounding must sit well inside those bounds on random inputs (this ties
    the tolerance to the arithmetic, not to what a kernel happened to produce)."""
    from tests.tolerances import LSE_ABS_MAX, OUT_REL_L2_MAX

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    cache = make_cache(64, 64, device="cpu", gen=gen)
    for topk, q_scale in ((100, 1.0), (512, 1.0), (512, 8.0)):
        q = (torch.randn(4, 16, 512, generator=gen) * q_scale).bfloat16()
        idx = make_indices(4, topk, 64 * 64, device="cpu", invalid_frac=0.1, gen=gen)
        ref_out, ref_lse = reference_decode(q, cache, idx)
        out, lse = fp8_model.fp8_path_decode(q, cache, idx, **fp8_model.KERNEL_FORM)
        rel = ((out - ref_out).norm(dim=(1, 2)) / ref_out.norm(dim=(1, 2))).max().item()
        assert rel <= OUT_REL_L2_MAX["fp8"] / 2, rel
        assert (lse - ref_lse).abs().max().item() <= LSE_ABS_MAX["fp8"] / 10
