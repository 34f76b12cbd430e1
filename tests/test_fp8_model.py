"""The FP8 compute path's rounding model (``fp8_model``), the oracle of the FP8 kernels'
bounds, on the CPU: with every rounding step turned off it is the reference (so the chunking,
the scale folding and the sink / empty handling are right, and what remains is rounding);
its Q operands hold about bf16's precision; its error is the path's known 1-2%.
"""

from __future__ import annotations

import math

import pytest
import torch

import cute_kernels.sparse_mla_decode.fp8_model as fp8_model
from cute_kernels.sparse_mla_decode.reference import reference_decode
from dispatch.tools.sample_inputs import make_cache, make_indices


@pytest.mark.parametrize("extra", [False, True])
def test_fp8_model_without_rounding_is_the_reference(monkeypatch, extra):
    monkeypatch.setattr(fp8_model, "round_e4m3", lambda x: x)
    monkeypatch.setattr(fp8_model, "round_bf16", lambda x: x)
    gen = torch.Generator().manual_seed(5 + extra)
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
    out, lse = fp8_model.fp8_path_decode(q, cache, idx, **kw)
    ref_out, ref_lse = ref_out.float(), ref_lse.float()
    assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and torch.equal(ref_lse[~finite], lse[~finite])
    assert torch.allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    assert not extra or torch.isposinf(ref_lse[3]).sum() < H  # token 3 has extra entries when extra is given


def test_head_scaled_two_terms_hold_about_8_bits():
    """The kernel's Q operands: hi + lo / 16 per head is within 2**-8 of the row's largest
    magnitude of every element (one term: only 2**-4), for rows spanning many binades."""
    gen = torch.Generator().manual_seed(32)
    x = torch.randn(32, 448, generator=gen) * torch.exp2(torch.randint(-20, 20, (32, 1), generator=gen).float())
    x = x.bfloat16().float()  # the kernel's input is bf16
    amax = x.abs().amax(-1, keepdim=True)
    one = fp8_model.round_q_two_terms(x, terms=1)
    two = fp8_model.round_q_two_terms(x, terms=2)
    assert torch.all((two - x).abs() <= amax * 2.0**-8)
    assert torch.any((one - x).abs() > amax * 2.0**-8)


def test_model_error_is_the_fp8_paths_1_to_2_percent():
    """The model's error against the float64 reference on random inputs is what the FP8 path
    is known for (README, "Precision"): 0.5-3% of out (P in e4m3), lse f32-sized; the GPU
    tests bound the FP8 kernels by twice the model's error on each case."""
    gen = torch.Generator().manual_seed(77)
    cache = make_cache(64, 64, device="cpu", gen=gen)
    for topk, q_scale in ((100, 1.0), (512, 1.0), (512, 8.0)):
        q = (torch.randn(4, 16, 512, generator=gen) * q_scale).bfloat16()
        idx = make_indices(4, topk, 64 * 64, device="cpu", invalid_frac=0.1, gen=gen)
        ref_out, ref_lse = reference_decode(q, cache, idx)
        out, lse = fp8_model.fp8_path_decode(q, cache, idx)
        rel = ((out.double() - ref_out).norm(dim=(1, 2)) / ref_out.norm(dim=(1, 2)))
        assert 2e-3 <= rel.min().item() and rel.max().item() <= 3e-2, rel  # rounded, and by about e4m3
        assert ((lse.double() - ref_lse).abs() / ref_lse.abs().clamp_min(1)).max().item() <= 1e-5
