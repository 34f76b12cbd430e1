"""Refusals outside the table of ``docs/api.md`` (which ``tests/test_validation.py`` raises row by
row): the float32 class of ``sm_scale``, the overlap of outputs with other tensors as the
plans check it on every launch, ``overrides`` of the wrong type, and the commands' refusals on
a machine without a GPU (CPU)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from cute_kernels.sparse_mla_decode.kv_format import MODEL1_FP8
from dispatch import InvalidDecodeInput, PlanOverrides, plan_sparse_mla_decode
from dispatch.runtime.decode_inputs import FLT_MIN, DecodeTensors, byte_span, overlapping_output, scale_log2
from dispatch.tools.sample_inputs import make_cache, make_indices

LOG2_E = 1.4426950408889634


@pytest.mark.parametrize("sm_scale,ok", [(0.0442, True), (0.0, True), (-0.5, True), (1e30, True),
                                         (3e38, False), (1e300, False), (1e-38, True), (5e-39, False), (1e-50, False),
                                         (math.inf, False), (math.nan, False), (True, False), ("0.1", False)])
def test_scale_log2_takes_what_the_kernels_float32_holds(sm_scale, ok):
    """0, or a normal float32 once times log2(e): a value finite in Python can be inf (3e38 x
    1.44 > FLT_MAX), 0 or subnormal (below FLT_MIN) as the kernels' float32."""
    value = scale_log2(sm_scale, 0.1)
    assert (value is not None) == ok
    if ok:
        assert value == sm_scale * LOG2_E and (value == 0 or abs(value) >= FLT_MIN)


def test_byte_span():
    t = torch.empty(4, 16, 512, dtype=torch.bfloat16)
    assert byte_span(t) == t.numel() * 2
    assert byte_span(t[:, :, :256]) == ((3 * 16 * 512 + 15 * 512 + 255) + 1) * 2
    assert byte_span(t[:0]) == 0
    assert byte_span(torch.empty(1, 16).expand(4, 16)) == 16 * 4


def _spans(**tensors):
    """Addresses, spans and the present indices of named tensors in ``DecodeTensors`` order."""
    names = [name for name in DecodeTensors._fields]
    given = [tensors.get(name) for name in names]
    addresses = tuple(0 if t is None else t.data_ptr() for t in given)
    spans = tuple(0 if t is None else byte_span(t) for t in given)
    return addresses, spans, tuple(i for i, n in enumerate(spans) if n)


def test_overlapping_output_names_the_first_pair():
    buf = torch.empty(4096, dtype=torch.uint8)
    q, out, lse = buf[:1024], buf[2048:3072], buf[3072:3200]
    assert overlapping_output(*_spans(q=q, out=out, lse=lse, kv_cache=buf[1024:2048])) is None
    assert overlapping_output(*_spans(q=q, out=buf[1000:2024], lse=lse)) == ("out", "q")
    assert overlapping_output(*_spans(q=q, out=out, lse=buf[3000:3100])) == ("out", "lse")
    assert overlapping_output(*_spans(q=q, out=out, lse=lse, attn_sink=buf[3199:3201])) == ("lse", "attn_sink")
    # touching is not overlapping: [0, 1024) and [1024, 2048)
    assert overlapping_output(*_spans(q=q, out=buf[1024:2048], lse=lse)) is None


@pytest.mark.parametrize("overrides,message", [
    ({"num_splits": 2}, "overrides must be a dispatch.PlanOverrides (e.g. PlanOverrides(num_splits=2)) or None, "
                        "got dict"),
    ("num_splits=2", "overrides must be a dispatch.PlanOverrides"),
    (PlanOverrides(num_splits=2.0), "overrides.num_splits must be an int or None, got 2.0 (float)"),
    (PlanOverrides(head_groups=True), "overrides.head_groups must be an int or None, got True (bool)"),
])
def test_plan_overrides_errors_come_before_the_device_check(overrides, message):
    """A wrong ``overrides`` is refused as an ``InvalidDecodeInput`` naming the call, before the
    inputs' device is looked at (these are CPU tensors, which the device check refuses)."""
    q = torch.randn(2, 16, 512).to(torch.bfloat16)
    with pytest.raises(InvalidDecodeInput, match=re.escape(message)) as info:
        plan_sparse_mla_decode(q, make_cache(4, 64, device="cpu"), make_indices(2, 128, 256, device="cpu"),
                               overrides=overrides)
    assert str(info.value).startswith(MODEL1_FP8.model_type + ": num_tokens=2, num_heads=16")


def test_check_aot_without_a_gpu_says_so_in_one_line(capsys, monkeypatch):
    from dispatch.tools.check_aot import NO_GPU, main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without one
    assert main([]) == NO_GPU
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA GPU is visible" in err[0]
