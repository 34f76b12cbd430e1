"""The engine plugins (``dispatch.engines``): declared entry points, opt-in by one environment
variable, what they patch on each GPU family, what they log and how they refuse, against
stand-in engine modules (the names the plugins patch, nothing else): the plugins' own logic,
checked everywhere. ``tests/test_real_engines.py`` checks them against the released engines."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from dispatch import InvalidDecodeInput
from dispatch.engines import flashinfer_dsv4, flashinfer_mla, plugin_mode, sglang_plugin, sm90_route, vllm_plugin
from dispatch.engines.plugin_mode import ENV
from dispatch.engines.sites import SITE, site, within_site
from dispatch.policy import sm90_policy

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {"vllm.general_plugins": "dispatch.engines.vllm_plugin:register",
                "sglang.srt.plugins": "dispatch.engines.sglang_plugin:register"}


def _declared_entry_points() -> dict:
    """{group: {name: value}} of pyproject.toml's [project.entry-points.*] tables."""
    groups, current = {}, None
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        header = re.fullmatch(r'\[project\.entry-points\."([^"]+)"\]', line.strip())
        if header:
            current = groups.setdefault(header.group(1), {})
        elif line.startswith("["):
            current = None
        elif current is not None and "=" in line:
            name, value = (part.strip().strip('"') for part in line.split("=", 1))
            current[name] = value
    return groups


def test_entry_points_are_declared_and_resolve():
    declared = _declared_entry_points()
    for group, target in ENTRY_POINTS.items():
        assert declared[group] == {"dsv4_sparse_mla": target}, group
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func))
    try:  # an installed distribution (CI's editable install) exposes them to the engines' loaders
        importlib.metadata.distribution("dsv4-sparse-mla")
    except importlib.metadata.PackageNotFoundError:
        return
    for group, target in ENTRY_POINTS.items():
        assert target in [ep.value for ep in importlib.metadata.entry_points(group=group)], group


@pytest.mark.parametrize("value,mode", [(None, None), ("", None), ("0", None), ("off", None), ("1", "auto"),
                                        ("yes", "auto"), ("sm120", "sm120"), ("SM90", "sm90")])
def test_the_variable_names_the_mode(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert plugin_mode.requested_mode() == mode


@pytest.mark.parametrize("value", ["force", "sometimes", "2"])
def test_an_unknown_value_is_refused_naming_the_values(monkeypatch, caplog, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=r"use 1 \(this GPU's route: .*\), sm120 or sm90 \(that route only\), or 0"):
        vllm_plugin.register(capability=lambda: (12, 0))
    assert "dsv4-sparse-mla:" in caplog.text


@pytest.mark.parametrize("mode,capability,family", [
    ("1", (12, 0), "sm120"), ("1", (12, 1), "sm120"), ("1", (9, 0), "sm90"), ("1", (8, 0), None),
    ("1", (10, 0), None), ("1", None, None), ("sm120", (9, 0), None), ("sm90", (9, 0), "sm90"),
    ("sm90", (12, 0), None), ("0", (12, 0), None),
])
def test_each_gpu_family_gets_its_own_route_only(monkeypatch, caplog, mode, capability, family):
    monkeypatch.setenv(ENV, mode)
    with caplog.at_level("WARNING"):
        got = plugin_mode.family_to_install(vllm_plugin.LOG, "vLLM", lambda: capability)
    assert got == family
    if family is None and mode != "0":  # said once, at WARNING, in words that say nothing runs through this library
        lines = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(lines) == 1 and "nothing patched" in lines[0].getMessage()
        assert "replaced" not in lines[0].getMessage()


def test_an_unreadable_gpu_leaves_the_engine_alone(monkeypatch, caplog):
    def broken():
        raise RuntimeError("NVML unavailable")

    monkeypatch.setenv(ENV, "1")
    with caplog.at_level("WARNING"):
        assert plugin_mode.family_to_install(vllm_plugin.LOG, "vLLM", broken) is None
    assert "cannot be read (RuntimeError: NVML unavailable)" in caplog.text


# ---------------------------------------------------------------------- stand-in vLLM
def _module(monkeypatch, name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _original(*args, **kwargs):
    return "the engine's own kernel"


def _stand_in_vllm_sm120(monkeypatch, with_binding=True, loaded_callers=()):
    _module(monkeypatch, "vllm", __version__="0.0.test", __path__=[])
    _module(monkeypatch, "vllm.utils", __path__=[])
    names = {name: _original for name, _, _ in vllm_plugin.SM120_BINDINGS}
    if not with_binding:
        names.pop(vllm_plugin.SM120_BINDINGS[0][0])
    binding = _module(monkeypatch, vllm_plugin.FLASHINFER_BINDINGS, **names,
                      **{vllm_plugin.SM120_SHAPE_CHECK: lambda num_q_heads, top_k: False})
    callers = [_module(monkeypatch, name, **{vllm_plugin.SM120_BINDINGS[0][0]: _original}) for name in loaded_callers]
    return binding, callers


def test_vllm_plugin_does_nothing_unless_enabled(monkeypatch):
    binding, _ = _stand_in_vllm_sm120(monkeypatch)
    monkeypatch.delenv(ENV, raising=False)
    vllm_plugin.register(capability=lambda: (12, 0))
    assert all(getattr(binding, name) is _original for name, _, _ in vllm_plugin.SM120_BINDINGS)


@pytest.mark.parametrize("capability", [(9, 0), (8, 9), (10, 0)])
def test_vllm_plugin_never_patches_the_sm120_functions_off_sm120(monkeypatch, capability):
    """vLLM calls its SM120 binding on other GPUs too (``DeepseekV4FlashInferMLAAttention`` with
    ``--attention-backend FLASHINFER_MLA_SPARSE_DSV4``, storage-offset indices this library does
    not read): off SM120 it stays FlashInfer's whatever the variable says."""
    binding, _ = _stand_in_vllm_sm120(monkeypatch)
    for value in ("1", "sm120") if capability[0] != 9 else ("sm120",):  # "1" on sm_90 takes its own route
        monkeypatch.setenv(ENV, value)
        vllm_plugin.register(capability=lambda: capability)
        assert all(getattr(binding, name) is _original for name, _, _ in vllm_plugin.SM120_BINDINGS)


def test_vllm_plugin_replaces_the_sm120_bindings_and_loaded_callers(monkeypatch, caplog):
    binding, callers = _stand_in_vllm_sm120(monkeypatch, loaded_callers=vllm_plugin.SM120_BINDINGS[0][2][:1])
    monkeypatch.setenv(ENV, "1")
    with caplog.at_level("WARNING", logger=vllm_plugin.LOG.name):
        vllm_plugin.register(capability=lambda: (12, 0))
    dsv4, mla = (getattr(binding, name) for name, _, _ in vllm_plugin.SM120_BINDINGS)
    assert dsv4.__wrapped__ is flashinfer_dsv4.trtllm_batch_decode_sparse_mla_dsv4
    assert mla.__wrapped__ is flashinfer_mla.trtllm_batch_decode_with_kv_cache_mla
    assert getattr(callers[0], vllm_plugin.SM120_BINDINGS[0][0]) is dsv4
    assert getattr(binding, vllm_plugin.SM120_SHAPE_CHECK)(24, 1152)  # every (heads, top-k) is served
    lines = [r.getMessage() for r in caplog.records if r.name == vllm_plugin.LOG.name]
    assert len(lines) == 1 and "DeepSeek-V3.2 / GLM-5 decode now call this library" in lines[0]
    assert f"{vllm_plugin.SM120_BINDINGS[0][2][0]}.{vllm_plugin.SM120_BINDINGS[0][0]}" in lines[0]
    # the first call in this process says so (a forked worker inherits the patch, not the start-up line)
    caplog.clear()
    with caplog.at_level("WARNING", logger=vllm_plugin.LOG.name), pytest.raises(InvalidDecodeInput):
        dsv4(torch.zeros(1, 8, 512).to(torch.bfloat16), torch.zeros(4, 64, 1, 584, dtype=torch.uint8), None,
             torch.zeros(1, 8, dtype=torch.int32), kv_layout="NHD")
    with pytest.raises(InvalidDecodeInput):
        dsv4(torch.zeros(1, 8, 512).to(torch.bfloat16), torch.zeros(4, 64, 1, 584, dtype=torch.uint8), None,
             torch.zeros(1, 8, dtype=torch.int32), kv_layout="NHD")
    first = [r.getMessage() for r in caplog.records if "first call" in r.getMessage()]
    assert len(first) == 1 and "served by dispatch.engines.flashinfer_dsv4" in first[0]


def test_vllm_plugin_refuses_loudly_when_a_function_moved(monkeypatch):
    _stand_in_vllm_sm120(monkeypatch, with_binding=False)
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(RuntimeError, match=r"vLLM .* has no vllm\.utils\.flashinfer\.flashinfer_trtllm_batch_decode_"
                                           r"sparse_mla_dsv4: this plugin was written against vLLM 0\.34\.0"):
        vllm_plugin.register(capability=lambda: (12, 0))


def test_vllm_plugin_patches_all_or_nothing(monkeypatch):
    binding, (caller,) = _stand_in_vllm_sm120(monkeypatch, loaded_callers=vllm_plugin.SM120_BINDINGS[0][2][1:])
    delattr(caller, vllm_plugin.SM120_BINDINGS[0][0])
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(RuntimeError, match="has no vllm.models.deepseek_v41"):
        vllm_plugin.register(capability=lambda: (12, 0))
    assert all(getattr(binding, name) is _original for name, _, _ in vllm_plugin.SM120_BINDINGS)


class _Layer:
    """A stand-in of vLLM's FlashMLA attention layer: its decode calls FlashMLA's function by
    the module's name with the query padded to 64 heads."""

    n_local_heads = 16

    def __init__(self, module):
        self.module = module

    def _forward_decode(self, q, **kwargs):
        return self.module.flash_mla_with_kvcache(q=q, **kwargs)


def _stand_in_vllm_sm90(monkeypatch):
    calls = []

    def flashmla(*args, **kwargs):
        calls.append(kwargs)
        return "FlashMLA", None

    _module(monkeypatch, "vllm", __version__="0.0.test", __path__=[])
    ops = _module(monkeypatch, vllm_plugin.SM90_FLASHMLA[0], flash_mla_with_kvcache=flashmla)
    modules = {name: _module(monkeypatch, name, flash_mla_with_kvcache=flashmla) for name in vllm_plugin.SM90_CALLERS}
    for module_name, cls_name, method, *_ in vllm_plugin.SM90_SITES:
        layer_cls = type(cls_name, (_Layer,), {})
        if method != "_forward_decode":
            setattr(layer_cls, method, _Layer._forward_decode)
        setattr(modules[module_name], cls_name, layer_cls)
    return ops, modules, calls


def test_vllm_plugin_routes_flashmla_per_shape_on_sm90(monkeypatch, caplog):
    ops, modules, calls = _stand_in_vllm_sm90(monkeypatch)
    rows = (sm90_policy.RouteRow("model1", 16, 8, 640, 10.0, 20.0), sm90_policy.RouteRow("model1", 16, 64, 640, 30.0,
                                                                                           20.0))
    monkeypatch.setattr(sm90_policy, "SHIPPED", sm90_policy.RouteTable(rows, "test rows"))
    served = []
    monkeypatch.setattr(sm90_route.flashmla, "flash_mla_with_kvcache",
                        lambda *a, **kw: served.append(kw) or ("library", None))
    monkeypatch.setenv(ENV, "1")
    with caplog.at_level("WARNING", logger=vllm_plugin.LOG.name):
        vllm_plugin.register(capability=lambda: (9, 0))
    route = ops.flash_mla_with_kvcache
    assert all(m.flash_mla_with_kvcache is route for m in modules.values())
    assert "routed per shape between this library and FlashMLA" in caplog.text
    layer = getattr(modules[vllm_plugin.SM90_SITES[0][0]], vllm_plugin.SM90_SITES[0][1])(
        modules[vllm_plugin.SM90_SITES[0][0]])
    cache = torch.zeros(4, 64, 1, 584, dtype=torch.uint8)

    def decode(tokens):
        return layer._forward_decode(torch.zeros(tokens, 1, 64, 512).to(torch.bfloat16), k_cache=cache,
                                     is_fp8_kvcache=True, indices=torch.zeros(tokens, 1, 128, dtype=torch.int32),
                                     extra_k_cache=cache,
                                     extra_indices_in_kvcache=torch.zeros(tokens, 1, 512, dtype=torch.int32),
                                     out=torch.empty(tokens, 1, 64, 512, dtype=torch.bfloat16))

    assert decode(4)[0] == "library" and served[-1]["num_valid_heads"] == 16 and served[-1]["kv_format"] == "model1_fp8"
    assert served[-1]["return_lse"] is False  # vLLM drops the lse of this call
    assert decode(64)[0] == "FlashMLA" and len(calls) == 1 and calls[0]["q"].shape[-2] == 64
    # outside a known site (another model's FlashMLA call): the engine's function, unchanged
    assert route(q=torch.zeros(2, 1, 64, 512), k_cache=cache, indices=None)[0] == "FlashMLA"
    lines = [r.getMessage() for r in caplog.records if "first call routed" in r.getMessage()]
    assert len(lines) == 2 and "routed to this library" in lines[0] and "routed to vLLM's FlashMLA" in lines[1]


def test_the_route_hands_calls_it_does_not_read_to_flashmla(monkeypatch, caplog):
    calls = []
    table = sm90_policy.RouteTable((sm90_policy.RouteRow("model1", 64, 256, 4096, 1.0, 2.0),), "test rows")
    route = sm90_route.make_route(lambda *a, **kw: calls.append(kw) or ("FlashMLA", None), vllm_plugin.LOG, "vLLM",
                                  table=table)
    base = dict(q=torch.zeros(2, 1, 64, 512), k_cache=torch.zeros(4, 64, 1, 584, dtype=torch.uint8),
                indices=torch.zeros(2, 1, 128, dtype=torch.int32), is_fp8_kvcache=True)
    where = site("test site", 16, False)
    for odd in (dict(enable_batch_invariant=True), dict(descale_q=torch.ones(1)), dict(is_fp8_kvcache=False),
                dict(k_cache=torch.zeros(4, 64, 1, 528, dtype=torch.uint8)), dict(a_new_keyword=1)):
        with caplog.at_level("WARNING"):
            assert within_site(where, route, **{**base, **odd})[0] == "FlashMLA"
    assert len(calls) == 5 and "passes a_new_keyword, which this library's route does not know" in caplog.text
    with caplog.at_level("WARNING"):  # the engines pass keywords only: a positional call is said, then passed on
        assert within_site(where, route, base["q"], **{k: v for k, v in base.items() if k != "q"})[0] == "FlashMLA"
    assert len(calls) == 6 and "passes 1 positional arguments, which this library's route does not read" in caplog.text


def test_route_policy_takes_a_call_only_where_every_measured_shape_around_it_agrees():
    rows = tuple(sm90_policy.RouteRow("model1", h, t, 640, lib, 20.0)
                 for h, t, lib in ((16, 8, 10.0), (16, 64, 15.0), (16, 256, 25.0), (64, 8, 18.0), (64, 64, 40.0),
                                   (64, 256, 50.0)))
    table = sm90_policy.RouteTable(rows, "test rows")
    assert table.choose("model1", 8, 1, 128) == sm90_policy.LIBRARY  # below every measured value: the nearest rows
    assert table.choose("model1", 16, 64, 640) == sm90_policy.LIBRARY  # measured: 15 < 20
    assert table.choose("model1", 16, 65, 640) == sm90_policy.FLASHMLA  # between 64 (15) and 256 (25 > 20)
    assert table.choose("model1", 16, 9, 640) == sm90_policy.LIBRARY  # between 8 and 64: both faster
    assert table.choose("model1", 17, 8, 640) == sm90_policy.LIBRARY  # between 16 and 64 heads: 10 and 18 < 20
    assert table.choose("model1", 17, 9, 640) == sm90_policy.FLASHMLA  # around it, 64 heads x 64 tokens: 40 > 20
    assert table.choose("model1", 128, 4096, 9999) == sm90_policy.FLASHMLA  # beyond all: the largest
    assert table.choose("v32", 16, 1, 2048) == sm90_policy.FLASHMLA  # no row of the family: the engine's kernel


def test_route_tables_round_trip_and_bad_files_are_refused(tmp_path):
    rows = (sm90_policy.RouteRow("v32", 16, 4, 2048, 9.5, 19.0),)
    path = tmp_path / "route.json"
    path.write_text(sm90_policy.to_json(rows, "test GPU"))
    table = sm90_policy.load_table(path)
    assert table.rows == rows and table.source == "test GPU"
    for bad, problem in (('"family": "v4", "heads": 16', "family 'v4' is not one of"),
                         ('"family": "v32", "heads": "16"', "heads, tokens and entries must be positive ints"),
                         ('"family": "v32", "heads": 8.5', "heads, tokens and entries must be positive ints")):
        path.write_text('{"rows": [{' + bad + ', "tokens": 1, "entries": 1, "library_us": 1, "flashmla_us": 1}]}')
        with pytest.raises(ValueError, match=problem):
            sm90_policy.load_table(path)
    with pytest.raises(ValueError, match="not a route table"):
        sm90_policy.load_table(tmp_path / "missing.json")


# ---------------------------------------------------------------------- stand-in SGLang
def _stand_in_sglang(monkeypatch, with_target=True, with_hooks=True):
    registered = []

    class HookRegistry:
        @classmethod
        def register(cls, target, hook, hook_type="after", *, source=None):
            registered.append((target, hook, hook_type))

    hook_type = types.SimpleNamespace(REPLACE="replace", AROUND="around")
    _module(monkeypatch, "sglang", __version__="0.0.test", __path__=[])
    if with_hooks:
        _module(monkeypatch, sglang_plugin.HOOKS, HookRegistry=HookRegistry, HookType=hook_type)
    else:
        monkeypatch.setitem(sys.modules, sglang_plugin.HOOKS, None)  # import fails
    targets = {}
    for path in (sglang_plugin.SM120_TARGET, sglang_plugin.SM120_GLM_TARGET, sglang_plugin.SM90_TARGET):
        module_name, name = path.rsplit(".", 1)
        targets.setdefault(module_name, {})[name] = _original
    for module_name, names in targets.items():
        _module(monkeypatch, module_name, **(names if with_target else {}))
    for path, *_ in sglang_plugin.SITE_HOOKS:
        module_name, cls_name, _ = path.rsplit(".", 2)
        _module(monkeypatch, module_name, **{cls_name: type(cls_name, (), {path.rsplit(".", 1)[1]: _original})})
    return registered


@pytest.mark.parametrize("capability,targets,kind", [
    ((12, 0), (sglang_plugin.SM120_TARGET, sglang_plugin.SM120_GLM_TARGET), "replace"),
    ((9, 0), (sglang_plugin.SM90_TARGET,), "around")])
def test_sglang_plugin_registers_its_gpus_hooks(monkeypatch, caplog, capability, targets, kind):
    registered = _stand_in_sglang(monkeypatch)
    monkeypatch.delenv(ENV, raising=False)
    sglang_plugin.register(capability=lambda: capability)
    assert registered == []
    monkeypatch.setenv(ENV, "1")
    with caplog.at_level("WARNING", logger=sglang_plugin.LOG.name):
        sglang_plugin.register(capability=lambda: capability)
    assert [(t, k) for t, _, k in registered] == ([(t, kind) for t in targets]
                                                  + [(p, "around") for p, *_ in sglang_plugin.SITE_HOOKS])
    assert all(t in caplog.text for t in targets) and "the real heads of each layer from" in caplog.text


def test_sglang_sm120_call_computes_the_real_heads_of_its_site(monkeypatch):
    seen = {}
    monkeypatch.setattr("dispatch.engines.flashmla.flash_mla_with_kvcache_sm120", lambda **kw: seen.update(kw))
    q = torch.zeros(2, 1, 64, 512)
    sglang_plugin.sm120_call(q=q)
    assert "num_valid_heads" not in seen
    within_site(site("layer", 16, False), sglang_plugin.sm120_call, q=q)
    assert seen["num_valid_heads"] == 16
    # the site hook reads the layer's tp_q_head_num from the method's arguments
    hook = sglang_plugin._site_around("test", 3, False)
    layer = types.SimpleNamespace(tp_q_head_num=8)
    assert hook(lambda self, *a, **kw: SITE.get().real_heads, object(), "q", "k", "v", layer, "batch") == 8


def test_sglang_site_hook_says_when_a_layer_has_no_head_count(caplog):
    hook = sglang_plugin._site_around("no-heads test", 3, False)
    layer = types.SimpleNamespace(tp_q_head_num=None)
    with caplog.at_level("WARNING", logger=sglang_plugin.LOG.name):
        for _ in range(2):
            assert hook(lambda self, *a, **kw: SITE.get(), object(), "q", "k", "v", layer, "batch") is None
    lines = [r.getMessage() for r in caplog.records if "no int tp_q_head_num" in r.getMessage()]
    assert len(lines) == 1 and "no-heads test" in lines[0], lines


@pytest.mark.parametrize("missing", ["target", "hooks"])
def test_sglang_plugin_refuses_loudly_when_a_function_moved(monkeypatch, caplog, missing):
    _stand_in_sglang(monkeypatch, with_target=missing != "target", with_hooks=missing != "hooks")
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(RuntimeError, match="this plugin was written against SGLang 0.5.23"):
        sglang_plugin.register(capability=lambda: (12, 0))
    assert "ERROR" in caplog.text  # logged too: SGLang's loader only logs a plugin's exception


@pytest.mark.parametrize("visible,expected", [
    (None, (9, 0)),  # unset: every GPU visible, the first is GPU 0
    ("1", (12, 0)), ("1,0", (12, 0)), ("GPU-b", (12, 0)),
    ("", None), ("-1", None), ("5", None),  # set but empty, or first entry not a GPU: no GPU visible
])
def test_the_plugins_read_the_first_gpu_this_process_sees(monkeypatch, visible, expected):
    """``plugin_mode.gpu_capability`` by NVML (a stand-in of two GPUs, sm_90 and sm_120):
    the GPU ``CUDA_VISIBLE_DEVICES`` puts first, none where it leaves the process none."""
    caps, uuids = {0: (9, 0), 1: (12, 0)}, {"GPU-a": 0, "GPU-b": 1}
    nvml = types.SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
                                 nvmlDeviceGetHandleByIndex=lambda i: i,
                                 nvmlDeviceGetHandleByUUID=lambda u: uuids[u],
                                 nvmlDeviceGetCudaComputeCapability=lambda h: caps[h])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert plugin_mode.gpu_capability() == expected


def test_the_route_check_states_its_verdict():
    """``sm90_route_table --check``'s summary: the shapes where the routed call took at most
    FlashMLA's time, the range, and the 16-head T <= 8 geometric mean (the speed target's
    shapes)."""
    from dispatch.tools.sm90_route_table import check_summary

    checks = [dict(heads=16, tokens=1, flashmla_us=18.0, routed_us=10.0),
              dict(heads=16, tokens=8, flashmla_us=20.0, routed_us=12.5),
              dict(heads=16, tokens=64, flashmla_us=40.0, routed_us=20.0),
              dict(heads=32, tokens=2, flashmla_us=9.0, routed_us=10.0)]
    assert check_summary(checks).splitlines() == [
        "routed <= FlashMLA on 3 of 4 shapes; FlashMLA / routed 0.90-2.00",
        "16 heads, T <= 8 (2 shapes): geometric mean 1.697, 1.60-1.80"]
