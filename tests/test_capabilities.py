"""What each cache format is served with lives on its ``KvFormat`` entry (``extras`` and ``main``
declared, ``paths`` from its layout by ``kv_format.path_problem``), and every reader takes it from
there: a format built from existing parts is served by adding its entry and its writers, nothing
else (CPU)."""

import dataclasses

import pytest
import torch

from cute_kernels.sparse_mla_decode import cache_writers, kv_format
from cute_kernels.sparse_mla_decode.config import PATH_NEEDS, PartialConfig
from cute_kernels.sparse_mla_decode.kv_format import (
    EXTRA_FORMATS, FORMATS, PRECISIONS, V41_FP8, V41_NVFP4, formats_of_width, path_problem,
)
from dispatch import InvalidDecodeInput
from dispatch.engines.flashinfer_dsv4 import DSV4_KV_CACHE_FORMATS
from dispatch.api import validate_call
from dispatch.policy.precision import check_format_precision, format_precisions, precisions_for
from dispatch.policy.variant_space import variant_space
from dispatch.runtime import plan as plan_module
from dispatch.runtime.plan import DecodePlan
from dispatch.tools.sample_inputs import make_cache, make_indices

from .dispatch_inputs import SM120_TARGET, _stub_kernels


def test_each_format_is_read_by_the_paths_its_layout_allows():
    assert {name: f.paths for name, f in FORMATS.items()} == {
        "model1_fp8": ("bf16", "f16", "fp8", "mxf8"), "model1_nvfp4": ("f16",),
        "v32_fp8": ("bf16", "f16", "fp8"), "glm_nope_fp8": ("bf16", "f16", "fp8"),
        "v41_fp8": ("bf16", "f16"), "v41_fp8_inline": ("bf16", "f16"), "v41_nvfp4": ("f16",),
        "v41_nvfp4_inline": ("f16",)}
    for fmt in FORMATS.values():
        assert set(fmt.extras) <= set(FORMATS) and (not fmt.extras or fmt.main)
        if not fmt.main:  # read only as an extra cache: some main format pairs with it
            assert any(fmt.name in m.extras for m in FORMATS.values())


def test_path_problem_names_what_a_kernel_cannot_read():
    assert "f16" in path_problem("bf16", FORMATS["model1_nvfp4"])
    assert "per 32 dims" in path_problem("fp8", V41_FP8) and "per 32 dims" in path_problem("mxf8", V41_FP8)
    assert "fp32 scales" in path_problem("mxf8", FORMATS["v32_fp8"])
    assert path_problem("fp8", FORMATS["v32_fp8"]) is None  # an FP32 scale per 128 dims: applied per 64-dim unit
    assert "not one of" in path_problem("f32", V41_FP8)
    assert PRECISIONS == ("bf16", "f16", "fp8", "mxf8")


def test_a_path_a_format_cannot_read_is_refused_by_its_kernel_config():
    with pytest.raises(ValueError, match=r"precision 'fp8' does not read v41_fp8 caches \(the FP8 paths apply one "
                                         r"UE8M0 scale per 64-dim MMA unit, not per 32 dims\)"):
        PartialConfig(kv_format=V41_FP8.name, precision="fp8").check()
    PartialConfig(kv_format=V41_FP8.name, precision="bf16").check()


def test_the_pairings_are_the_models_combinations():
    assert EXTRA_FORMATS == {"model1_fp8": ("model1_fp8", "model1_nvfp4"),
                             "model1_nvfp4": ("model1_nvfp4", "model1_fp8"),
                             "v41_fp8": ("v41_fp8", "v41_nvfp4"),
                             "v41_fp8_inline": ("v41_fp8_inline", "v41_nvfp4_inline")}
    assert sorted(f.name for f in FORMATS.values() if not f.main) == ["v41_nvfp4", "v41_nvfp4_inline"]
    for main, extra in DSV4_KV_CACHE_FORMATS.values():  # the adapter's kv_cache_format names: declared pairs
        assert extra in FORMATS[main].extras, (main, extra)


def test_each_path_is_compiled_only_where_its_instruction_is():
    """"mxf8" needs the block-scaled MMA (sm_120a / sm_121a), "fp8" the e4m3 MMA (sm_89 and
    later); "bf16" and "f16" run everywhere; a profile has its target's paths."""
    assert precisions_for("sm_80") == precisions_for("sm_86") == ("bf16", "f16")
    assert precisions_for("sm_89") == precisions_for("sm_90a") == ("bf16", "f16", "fp8")
    assert precisions_for("sm_120a") == precisions_for("sm_121a") == ("bf16", "f16", "fp8", "mxf8")
    assert precisions_for("sm_80_on_sm_90a") == ("bf16", "f16")
    assert PATH_NEEDS == {"fp8": "e4m3_mma", "mxf8": "block_scaled_mma"}


def test_a_new_format_from_existing_parts_is_one_entry_and_its_writers(monkeypatch):
    """V4.1's FP8 record under a new name, paired with V4.1's NVFP4 record: with its entry in
    ``FORMATS`` and its writers in ``WRITERS`` (nothing else changed; here added at run time,
    so the plan's cached variant-space set is bypassed), the width lookup, the precision
    policy, the variant space, validation (its pairing and its paths) and a plan (kernels
    stubbed) all serve it."""
    new = dataclasses.replace(V41_FP8, name="test_fp8_record", model_type="Test model (528 B FP8 rows)",
                              extras=("test_fp8_record", V41_NVFP4.name))
    monkeypatch.setitem(kv_format.FORMATS, new.name, new)
    monkeypatch.setitem(cache_writers.WRITERS, new.name, cache_writers.WRITERS[V41_FP8.name])
    monkeypatch.setattr(plan_module, "_variant_space_set", plan_module._variant_space_set.__wrapped__)
    _stub_kernels(monkeypatch)

    assert new.name in formats_of_width(528)
    assert format_precisions("sm_120a", new.name) == ("bf16", "f16")
    check_format_precision("bf16", new.name)
    with pytest.raises(ValueError, match="'mxf8' does not read test_fp8_record caches"):
        check_format_precision("mxf8", new.name)
    ours = [v.config for v in variant_space("sm_120a") if v.kind == "partial" and v.config.kv_format == new.name]
    base = [v.config for v in variant_space("sm_120a") if v.kind == "partial" and v.config.kv_format == V41_FP8.name]
    assert ours and [dataclasses.replace(c, kv_format=V41_FP8.name) for c in ours] == base

    gen = torch.Generator().manual_seed(34)
    cache = make_cache(4, 64, device="cpu", kv_format=new.name, gen=gen)
    extra = make_cache(2, 64, device="cpu", kv_format=V41_NVFP4.name, gen=gen)
    q = torch.randn(2, 16, new.d_qk, generator=gen).to(torch.bfloat16)
    kw = dict(kv_format=new.name, extra_kv_cache=extra, extra_indices=make_indices(2, 64, 128, device="cpu"),
              extra_kv_format=V41_NVFP4.name, _target=SM120_TARGET)
    call = validate_call(q, cache, make_indices(2, 128, 256, device="cpu"), for_plan=True, **kw)
    assert call.fmt is new and call.extra.fmt.name == V41_NVFP4.name and call.precision == "f16"
    plan = DecodePlan(call)
    assert plan.kv_format == new.name and plan.extra_kv_format == V41_NVFP4.name
    with pytest.raises(InvalidDecodeInput, match="does not read test_fp8_record caches .the FP8 paths"):
        validate_call(q, cache, make_indices(2, 128, 256, device="cpu"), precision="fp8", **kw)
