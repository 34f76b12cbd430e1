"""Refusals outside the table of ``docs/api.md`` (which ``tests/test_validation.py`` raises row by
row): the float32 class of ``sm_scale``, the overlap of outputs with other tensors as the
plans check it on every launch, the rule an output's own elements follow, the scalar types,
the caller's argument names, ``overrides`` of the wrong type, and the commands' refusals on a
machine without a GPU (CPU)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from cute_kernels.sparse_mla_decode.kv_format import MODEL1_FP8
from dispatch import InvalidDecodeInput, PlanOverrides, plan_sparse_mla_decode
from dispatch.runtime.decode_inputs import (
    FLT_MIN, DecodeTensors, byte_span, caller_names, overlapping_output, scalar_problem, scale_log2,
    self_overlap_problem,
)
from dispatch.tools.sample_inputs import make_cache, make_indices

LOG2_E = 1.4426950408889634


@pytest.mark.parametrize("sm_scale,ok", [(0.0442, True), (0.0, True), (-0.5, True), (1e30, True),
                                         (3e38, False), (1e300, False), (1e-38, True), (5e-39, False), (1e-50, False),
                                         (math.inf, False), (math.nan, False), (True, False), ("0.1", False),
                                         (2, True), (10**400, False), (-(2**1100), False), (0.1j, False)])
def test_scale_log2_takes_what_the_kernels_float32_holds(sm_scale, ok):
    """0, or a normal float32 once times log2(e): a value finite in Python can be inf (3e38 x
    1.44 > FLT_MAX), 0 or subnormal (below FLT_MIN) as the kernels' float32."""
    value = scale_log2(sm_scale, 0.1)
    assert (value is not None) == ok
    if ok:
        assert value == sm_scale * LOG2_E and (value == 0 or abs(value) >= FLT_MIN)


@pytest.mark.parametrize("shape,strides,overlaps", [
    ((2, 16, 512), (8192, 512, 1), False),  # contiguous
    ((2, 16, 512), (8704, 516, 1), False),  # padded rows
    ((2, 16, 512), (512, 1024, 1), False),  # heads outermost
    ((2, 1, 512), (512, 0, 1), False),  # a stride of 0 over one element steps nowhere
    ((2, 16, 512), (8192, 508, 1), True),  # rows closer than their 512 elements
    ((2, 16, 512), (8000, 512, 1), True),  # tokens closer than their 16 rows
    ((2, 16, 512), (0, 512, 1), True),  # every token on one
    ((3, 2), (2, 3), True),  # disjoint elements, interleaved: not a layout any kernel writes
    ((2, 16), (1, 1), True),
    ((2, 16), (1, 2), False),  # tokens interleaved in steps of one, heads of two: nested
])
def test_an_output_s_elements_each_have_an_address_of_their_own(shape, strides, overlaps):
    """The rule ``validate_call`` applies to out and lse: sorted by stride, each dimension's
    stride at least the span of those inside it (a stride of 0 over more than one element
    worded on its own)."""
    t = torch.as_strided(torch.empty(20000), shape, strides)
    problem = self_overlap_problem(t, "out")
    assert (problem is not None) == overlaps, problem
    if overlaps and 0 in [s for n, s in zip(shape, strides) if n > 1]:
        assert problem.startswith("out has a stride of 0")
    elif overlaps:
        assert problem.startswith(f"out of shape {list(shape)} and strides {list(strides)} overlaps itself")


@pytest.mark.parametrize("value,kind,refused", [
    (3, "int", None), (True, "int", "must be a Python int, got True (bool)"), (3.0, "int", "got 3.0 (float)"),
    ("3", "int", "got '3' (str)"), (torch.tensor(3), "int", "got a Tensor"), (0.5, "number", None), (2, "number", None),
    (False, "number", "must be a real Python number (int or float), got False (bool)"), ("0.5", "number", "got '0.5'"),
    (True, "flag", None), ("False", "flag", "must be True or False, got 'False' (str)"), (1, "flag", "got 1 (int)"),
])
def test_a_scalar_is_of_exactly_its_documented_type(value, kind, refused):
    """``scalar_problem``, the rule an adapter's scalars follow: a bool is no number, a float
    no int, a string or a tensor neither, and a flag is a bool (a truthy string is refused)."""
    problem = scalar_problem(value, "arg", kind)
    assert (problem is None) == (refused is None), problem
    if refused:
        assert problem.startswith("arg must be ") and refused in problem


def test_caller_names_map_only_the_decodes_arguments():
    names = caller_names({"q": "query", "sm_scale": "bmm1_scale"})
    assert (names["q"], names["sm_scale"], names["indices"]) == ("query", "bmm1_scale", "indices")
    assert caller_names(names) is names and caller_names(None)["lse"] == "lse"
    for bad in ({"query": "q"}, {"q": 0}, {"kv_format": "kv_cache_format"}):
        with pytest.raises(TypeError, match="names must map arguments of the decode"):
            caller_names(bad)


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
