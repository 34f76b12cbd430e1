"""A plan's kernel arguments (CPU): the values it binds (row strides, pages, splits), the
alignment and layout ``run`` and ``bind`` check, and the argument schema both follow."""

import dataclasses
import types

import pytest
import torch

from cute_kernels.sparse_mla_decode.cache_view import page_division_magic, read_cache_view
from cute_kernels.sparse_mla_decode.kernel_args import PARTIAL_ARGS
from cute_kernels.sparse_mla_decode.kv_format import FORMATS, GLM_NOPE_FP8, V32_FP8, V41_FP8
from dispatch.api import ValidatedCall
from dispatch.policy.splits import SplitPlan
from dispatch.runtime.decode_inputs import DecodeTensors
from dispatch.runtime.plan import DecodePlan
from dispatch.tools.sample_inputs import make_cache
from tests.dispatch_inputs import (
    GLM_CACHE, GLM_POOL_CACHE, MODEL1, V32_CACHE, V41_CACHE, V41_INLINE_PADDED_CACHE, _BATCHED, _STRIDED_ROWS,
    _cpu_plan, _misaligned,
)


def _validated(cache, kv_format, **fields) -> ValidatedCall:
    """A ValidatedCall of a cache view and nothing else (what the plan's
    argument values read), built on CPU: ``validate_call`` itself needs a CUDA device."""
    empty = {f.name: None for f in dataclasses.fields(ValidatedCall)}
    view = read_cache_view(cache, kv_format)
    return ValidatedCall(**{**empty, "main": view, "extra": view, "tensors": DecodeTensors(None, cache, None),
                            "device_index": 0, "precision": "f16", **fields})


@pytest.mark.parametrize("kv_format,cache,index_page", [
    (MODEL1, None, 64), (V32_FP8.name, V32_CACHE, 64), (GLM_NOPE_FP8.name, GLM_CACHE, 64),
    (GLM_NOPE_FP8.name, GLM_POOL_CACHE, 64), (V41_FP8.name, V41_CACHE, 64),
    ("v41_fp8_inline", V41_INLINE_PADDED_CACHE, 66),
])
def test_plan_binds_every_kernel_argument_and_the_row_strides(kv_format, cache, index_page):
    """The plan gives every argument of the partial kernel's schema a value, the row strides
    those of the cache views (MODEL1: its packed 584-byte rows; GLM-5.3: 528 or 656), the page
    what an index is divided by (``CacheView.index_page``: P, or for flat rows the rows a
    block stride holds), and a final-mode launch one split and no partial outputs."""
    cache = make_cache(4, 64, device="cpu") if cache is None else cache
    strides = dict(q_t=0, q_h=0, idx_t=0, extra_idx_t=0, main_block=1, main_row=0, main_slots=1, extra_block=1,
                   extra_row=0, extra_slots=1, out_t=0, out_h=0, lse_t=0, lse_h=0)
    call = _validated(cache, kv_format)
    strides.update(main_row=call.main.row_stride, extra_row=call.extra.row_stride)
    call.strides = strides
    plan = types.SimpleNamespace(final=True, num_tokens=1, num_heads=16, topk=32, extra_topk=0,
                                 split=SplitPlan(1, 1, 1), num_splits=1, _o_part_bytes=0)
    values = DecodePlan._argument_values(plan, call, present={"q", "main", "indices", "out", "lse"})
    assert set(values) == {a.name for a in PARTIAL_ARGS}
    expected = FORMATS[kv_format].bytes_per_token if kv_format == MODEL1 else cache.stride(1)
    assert values["main_row_stride"] == values["extra_row_stride"] == expected
    assert call.main.index_page == index_page and call.main.page_block_size == 64
    assert values["main_page"] == values["extra_page"] == index_page, values["main_page"]
    assert values["main_page_magic"] == page_division_magic(index_page)
    assert (values["num_splits"], values["launch_splits"], values["o_part"], values["lse_part"]) == (1, 1, 0, 0)


def test_plan_alignment_comes_from_the_kernel_argument_schema(monkeypatch):
    from cute_kernels.sparse_mla_decode.kernel_args import PARTIAL_ARGS
    from dispatch.runtime.decode_inputs import DecodeTensors

    plan, _ = _cpu_plan(monkeypatch, topk_length=torch.zeros(2, dtype=torch.int32))
    schema = {a.name: a.align for a in PARTIAL_ARGS}
    aligns = dict(zip((name for name in DecodeTensors._fields), plan._aligns))
    assert aligns["q"] == schema["q"] == 16 and aligns["kv_cache"] == schema["main_cache"] == 16
    assert aligns["out"] == schema["out"] == 8 and aligns["topk_length"] == schema["main_len"] == 4


def test_plan_run_refuses_a_misaligned_tensor(monkeypatch):
    plan, call = _cpu_plan(monkeypatch)
    t = call.tensors
    kw = dict(out=t.out, lse=t.lse, scratch=torch.empty(plan.scratch_bytes, dtype=torch.uint8))
    plan._checked_values("run", t, None, kw["scratch"])  # the planned tensors pass
    for name, offset, align in (("q", 8, 16), ("out", 4, 8)):
        tensors = dict(q=t.q, out=t.out)
        tensors[name] = _misaligned(tensors[name], offset)
        assert tensors[name].stride() == getattr(t, name).stride()
        for caller in ("run", "bind"):
            with pytest.raises(ValueError, match=rf"DecodePlan.{caller}: {name} data pointer must be {align}-byte "
                                                 rf"aligned \(the kernels' loads assume it\), got 0x[0-9a-f]+"):
                getattr(plan, caller)(tensors["q"], t.kv_cache, t.indices, out=tensors["out"], lse=t.lse,
                                      scratch=kw["scratch"])


def test_plan_run_refuses_lengths_that_are_not_one_int_per_token_in_order(monkeypatch):
    plan, call = _cpu_plan(monkeypatch, topk_length=torch.zeros(2, 2, dtype=torch.int32), **_BATCHED)
    scratch = torch.empty(plan.scratch_bytes, dtype=torch.uint8)
    t = call.tensors
    with pytest.raises(ValueError, match=r"DecodePlan.run: topk_length has shape \[2, 2\], strides \[4, 1\]"):
        plan.run(t.q, t.kv_cache, t.indices, out=t.out, lse=t.lse, scratch=scratch, topk_length=_STRIDED_ROWS)


def test_run_and_bind_take_the_planned_tensors_by_name():
    import inspect

    from dispatch.runtime.decode_inputs import DecodeTensors
    from dispatch.runtime.plan import DecodePlan

    for method in (DecodePlan.run, DecodePlan.bind):
        params = inspect.signature(method).parameters
        assert all(name in params for name in DecodeTensors._fields), method


def test_kernel_params_take_the_schema_and_at_most_the_stream():
    from cute_kernels.sparse_mla_decode.kernel_args import MERGE_ARGS, KernelParams

    n = len(MERGE_ARGS)  # the stream last
    p = KernelParams(MERGE_ARGS, list(range(n)))  # a launcher's arguments, the stream's dropped
    assert p.num_heads == 4 and not hasattr(p, "stream")
    assert KernelParams(MERGE_ARGS, list(range(n - 1))).lse_stride_h == n - 2  # without the stream
    for count in (n + 1, n - 2):
        with pytest.raises(ValueError, match=f"{n - 1} kernel arguments expected"):
            KernelParams(MERGE_ARGS, list(range(count)))


def test_validation_checks_the_alignment_the_plan_binds(monkeypatch):
    """Every tensor's alignment that validation and the plan check (``POINTER_ALIGN``) is the
    largest alignment of the pointer arguments the plan binds it to, for a call with every
    optional input (one format, and two): no kernel assumes more of an address than every
    path checks, nor is a tensor held to more than its kernels assume."""
    from cute_kernels.sparse_mla_decode.kernel_args import MERGE_ARGS, PARTIAL_ARGS
    from dispatch.runtime.decode_inputs import BIND_KEYS, POINTER_ALIGN
    from dispatch.runtime.plan import Bind
    from tests.dispatch_inputs import NVFP4_CACHE

    for extra_cache in (make_cache(2, 64, device="cpu"), NVFP4_CACHE):  # one format, and two
        plan, _ = _cpu_plan(monkeypatch, topk_length=torch.zeros(2, dtype=torch.int32), attn_sink=torch.zeros(16),
                            extra_kv_cache=extra_cache, extra_indices=torch.zeros(2, 64, dtype=torch.int32),
                            extra_topk_length=torch.zeros(2, dtype=torch.int32))
        schemas = {1: (PARTIAL_ARGS,), 2: (PARTIAL_ARGS, MERGE_ARGS), 3: (PARTIAL_ARGS, PARTIAL_ARGS, MERGE_ARGS)}[len(plan._args)]
        bound = {}
        for schema, args in zip(schemas, plan._args):
            for a, v in zip(schema, args):
                if isinstance(v, Bind) and a.kind == "ptr":
                    bound[v.key] = max(bound.get(v.key, 1), a.align)
        assert {field: bound[key] for field, key in BIND_KEYS.items()} == POINTER_ALIGN
        assert dict(zip(DecodeTensors._fields, plan._aligns)) == POINTER_ALIGN


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_plan_run_refuses_a_sparse_tensor_by_name(monkeypatch):
    """A sparse tensor (COO strides read as 0, CSR has none, neither has a data pointer) is
    refused as such, not as a torch error on its strides or address."""
    plan, call = _cpu_plan(monkeypatch, attn_sink=torch.zeros(16))
    t = call.tensors
    scratch = torch.empty(plan.scratch_bytes, dtype=torch.uint8)
    for name, sparse in (("attn_sink", t.attn_sink.to_sparse()), ("lse", t.lse.to_sparse_csr()),
                         ("q", t.q.to_sparse())):
        given = {**t._asdict(), name: sparse}
        with pytest.raises(ValueError, match=rf"DecodePlan.run: {name} is a sparse tensor \(layout torch.sparse_"):
            plan.run(given.pop("q"), given.pop("kv_cache"), given.pop("indices"), scratch=scratch, **given)


def test_a_plan_refuses_an_int32_argument_it_cannot_pack(monkeypatch):
    """The launcher packs an "i32" argument into a C int32 slot (its low 32 bits): a value
    outside int32 is refused by name (``plan.int32_problem``), checked on every plan."""
    from cute_kernels.sparse_mla_decode.kernel_args import MERGE_ARGS
    from dispatch.runtime.plan import int32_problem

    plan, _ = _cpu_plan(monkeypatch)
    schemas = (PARTIAL_ARGS, MERGE_ARGS)[:len(plan.variants)]
    assert int32_problem(schemas, plan._args) is None
    position = [a.name for a in PARTIAL_ARGS].index("main_topk")
    for value in (2**31, -2**31 - 1):
        args = [list(plan._args[0])] + plan._args[1:]
        args[0][position] = value
        assert int32_problem(schemas, args) == f"the kernels' int32 argument main_topk would be {value:,}, outside int32"
