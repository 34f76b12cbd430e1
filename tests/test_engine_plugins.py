"""The engine plugins (``dispatch.engine_plugins``): declared entry points, opt-in by one
environment variable, what they replace and how they refuse.

The first tests run the plugins against stand-in engine modules (the names the plugins patch,
nothing else), so the plugins' own logic is checked everywhere; the last ones load each plugin
through the real engine's plugin loader and are skipped where that engine is not installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from dispatch import InvalidDecodeInput, adapters, engine_plugins
from dispatch.engine_plugins import ENV, SGLANG_TARGET, VLLM_BINDING, VLLM_CALLERS

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {"vllm.general_plugins": "dispatch.engine_plugins:register_vllm",
                "sglang.srt.plugins": "dispatch.engine_plugins:register_sglang"}


def _declared_entry_points() -> dict:
    """{group: {name: value}} of pyproject.toml's [project.entry-points.*] tables."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: read the tables' lines
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
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]


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


@pytest.mark.parametrize("value,mode", [(None, None), ("", None), ("0", None), ("1", "sm120"), ("force", "force")])
def test_the_variable_names_the_mode(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert engine_plugins.requested_mode() == mode


def test_an_unknown_value_is_refused(monkeypatch):
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(ValueError, match="use 1 .* force .* or 0"):
        engine_plugins.register_vllm()


# ---------------------------------------------------------------------- stand-in engines
def _module(monkeypatch, name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _original(*args, **kwargs):
    return "the engine's own kernel"


def _stand_in_vllm(monkeypatch, capability=(12, 0), with_binding=True, loaded_callers=()):
    cap = None if capability is None else types.SimpleNamespace(major=capability[0], minor=capability[1])
    platform = types.SimpleNamespace(get_device_capability=lambda: cap)
    _module(monkeypatch, "vllm", __version__="0.0.test", __path__=[])
    _module(monkeypatch, "vllm.platforms", current_platform=platform)
    _module(monkeypatch, "vllm.utils", __path__=[])
    binding = _module(monkeypatch, VLLM_BINDING[0], **({VLLM_BINDING[1]: _original} if with_binding else {}),
                      **{engine_plugins.VLLM_SHAPE_CHECK: lambda num_q_heads, top_k: False})
    callers = [_module(monkeypatch, name, **{VLLM_BINDING[1]: _original}) for name in loaded_callers]
    return binding, callers


def test_vllm_plugin_does_nothing_unless_enabled(monkeypatch):
    binding, _ = _stand_in_vllm(monkeypatch)
    monkeypatch.delenv(ENV, raising=False)
    engine_plugins.register_vllm()
    assert getattr(binding, VLLM_BINDING[1]) is _original


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), None])
def test_vllm_plugin_leaves_other_gpus_alone_unless_forced(monkeypatch, caplog, capability):
    binding, _ = _stand_in_vllm(monkeypatch, capability=capability)
    monkeypatch.setenv(ENV, "1")
    with caplog.at_level("INFO", logger=engine_plugins.VLLM_LOG.name):
        engine_plugins.register_vllm()
    assert getattr(binding, VLLM_BINDING[1]) is _original
    assert "left in place" in caplog.text and f"{ENV}=1" in caplog.text
    monkeypatch.setenv(ENV, "force")
    engine_plugins.register_vllm()
    assert getattr(binding, VLLM_BINDING[1]) is adapters.trtllm_batch_decode_sparse_mla_dsv4


@pytest.mark.parametrize("capability", [(12, 0), (12, 1)])
def test_vllm_plugin_replaces_the_binding_and_loaded_callers(monkeypatch, caplog, capability):
    binding, callers = _stand_in_vllm(monkeypatch, capability=capability, loaded_callers=VLLM_CALLERS[:1])
    monkeypatch.setenv(ENV, "1")
    with caplog.at_level("INFO", logger=engine_plugins.VLLM_LOG.name):
        engine_plugins.register_vllm()
    for module in (binding, *callers):
        assert getattr(module, VLLM_BINDING[1]) is adapters.trtllm_batch_decode_sparse_mla_dsv4
    assert getattr(binding, engine_plugins.VLLM_SHAPE_CHECK)(24, 1152)  # every (heads, top-k) is served
    lines = [r for r in caplog.records if r.name == engine_plugins.VLLM_LOG.name]
    assert len(lines) == 1 and f"{VLLM_CALLERS[0]}.{VLLM_BINDING[1]}" in lines[0].getMessage()


def test_vllm_plugin_refuses_loudly_when_the_function_moved(monkeypatch):
    _stand_in_vllm(monkeypatch, with_binding=False)
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(RuntimeError, match=r"vLLM .* has no vllm\.utils\.flashinfer\.flashinfer_trtllm_batch_decode_"
                                           r"sparse_mla_dsv4: this plugin was written against vLLM 0\.34\.0"):
        engine_plugins.register_vllm()


def test_vllm_plugin_patches_all_or_nothing(monkeypatch):
    binding, (caller,) = _stand_in_vllm(monkeypatch, loaded_callers=VLLM_CALLERS[1:])
    delattr(caller, VLLM_BINDING[1])
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(RuntimeError, match=re.escape(f"has no {VLLM_CALLERS[1]}.{VLLM_BINDING[1]}")):
        engine_plugins.register_vllm()
    assert getattr(binding, VLLM_BINDING[1]) is _original


def test_vllm_plugin_leaves_the_engine_alone_when_the_gpu_cannot_be_read(monkeypatch, caplog):
    binding, _ = _stand_in_vllm(monkeypatch)

    def broken():
        raise RuntimeError("NVML unavailable")

    monkeypatch.setattr(sys.modules["vllm.platforms"], "current_platform",
                        types.SimpleNamespace(get_device_capability=broken))
    monkeypatch.setenv(ENV, "1")
    with caplog.at_level("WARNING", logger=engine_plugins.VLLM_LOG.name):
        engine_plugins.register_vllm()
    assert getattr(binding, VLLM_BINDING[1]) is _original
    assert "cannot be read (RuntimeError: NVML unavailable)" in caplog.text


def _stand_in_sglang(monkeypatch, with_target=True, with_hooks=True):
    registered = []

    class HookRegistry:
        @classmethod
        def register(cls, target, hook, hook_type="after", *, source=None):
            registered.append((target, hook, hook_type))

    hook_type = types.SimpleNamespace(REPLACE="replace")
    _module(monkeypatch, "sglang", __version__="0.0.test", __path__=[])
    if with_hooks:
        _module(monkeypatch, engine_plugins.SGLANG_HOOKS, HookRegistry=HookRegistry, HookType=hook_type)
    else:
        monkeypatch.setitem(sys.modules, engine_plugins.SGLANG_HOOKS, None)  # import fails
    module_name, name = SGLANG_TARGET.rsplit(".", 1)
    _module(monkeypatch, module_name, **({name: _original} if with_target else {}))
    return registered


def test_sglang_plugin_registers_a_replace_hook(monkeypatch, caplog):
    monkeypatch.setattr(engine_plugins, "_gpu_capability", lambda: (12, 0))
    registered = _stand_in_sglang(monkeypatch)
    monkeypatch.delenv(ENV, raising=False)
    engine_plugins.register_sglang()
    assert registered == []
    monkeypatch.setenv(ENV, "1")
    with caplog.at_level("INFO", logger=engine_plugins.SGLANG_LOG.name):
        engine_plugins.register_sglang()
    assert registered == [(SGLANG_TARGET, adapters.flash_mla_with_kvcache_sm120, "replace")]
    assert SGLANG_TARGET in caplog.text


@pytest.mark.parametrize("missing", ["target", "hooks"])
def test_sglang_plugin_refuses_loudly_when_the_function_moved(monkeypatch, caplog, missing):
    monkeypatch.setattr(engine_plugins, "_gpu_capability", lambda: (12, 0))
    _stand_in_sglang(monkeypatch, with_target=missing != "target", with_hooks=missing != "hooks")
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(RuntimeError, match="this plugin was written against SGLang 0.5.23"):
        engine_plugins.register_sglang()
    assert "ERROR" in caplog.text  # logged too: SGLang's loader only logs a plugin's exception


# ---------------------------------------------------------------------- the real engines
def _cpu_dsv4_inputs():
    q = torch.randn(2, 16, 512).to(torch.bfloat16)
    cache = torch.zeros(4, 64, 1, 584, dtype=torch.uint8)
    return q, cache, torch.zeros(2, 32, dtype=torch.int32)


def test_vllm_loads_the_plugin_and_its_attention_calls_this_library(monkeypatch):
    pytest.importorskip("vllm")
    import vllm.plugins

    monkeypatch.setenv(ENV, "force")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False, raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    vllm.plugins.load_general_plugins()
    for caller in VLLM_CALLERS:
        module = importlib.import_module(caller)
        assert getattr(module, VLLM_BINDING[1]) is adapters.trtllm_batch_decode_sparse_mla_dsv4, caller
    shape_check = getattr(importlib.import_module(VLLM_BINDING[0]), engine_plugins.VLLM_SHAPE_CHECK)
    assert shape_check(24, 1152)  # the layers' start-up check: FlashInfer's table no longer decides
    q, cache, idx = _cpu_dsv4_inputs()
    with pytest.raises(InvalidDecodeInput, match="CUDA devices only"):  # this library's refusal, not FlashInfer's
        getattr(importlib.import_module(VLLM_CALLERS[0]), VLLM_BINDING[1])(
            query=q, swa_kv_cache=cache, workspace_buffer=None, sparse_indices=idx, kv_layout="NHD")


def test_sglang_loads_the_plugin_and_its_backend_calls_this_library(monkeypatch):
    pytest.importorskip("sglang")
    plugins = importlib.import_module("sglang.srt.plugins")
    hooks = importlib.import_module(engine_plugins.SGLANG_HOOKS)
    module_name, name = SGLANG_TARGET.rsplit(".", 1)
    target = importlib.import_module(module_name)
    original = getattr(target, name)
    monkeypatch.setenv(ENV, "force")
    monkeypatch.setattr(plugins, "_plugins_loaded", False, raising=False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    try:
        plugins.load_plugins()
        q, cache, idx = _cpu_dsv4_inputs()
        with pytest.raises(InvalidDecodeInput, match="CUDA devices only"):
            getattr(target, name)(q=q[:, None], k_cache=cache, indices=idx[:, None], head_dim_v=512)
    finally:
        hooks.HookRegistry.reset()
        setattr(target, name, original)
