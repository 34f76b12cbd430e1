"""The loader's word on an AOT directory built for another environment (CPU, nothing compiled):
a manifest whose entries differ from this process's fingerprint only in the DSL libs flavour
(a wheel built beside nvidia-cutlass-dsl-libs-cu12, installed beside -cu13) is named once, with
both flavours, the directory and the remedy, however many kernels the process then needs."""

from __future__ import annotations

import json
import logging

import pytest

from dispatch.policy.variant_space import variant_space
from dispatch.runtime import loader
from dispatch.runtime.fingerprint import fingerprint

OTHER = "cu11"  # a flavour no environment has, so the entries differ whatever this one's is


@pytest.fixture(autouse=True)
def _isolated(isolated_loader, monkeypatch):
    """No package manifest, a private JIT cache, a fresh loader; compiling is a stand-in that
    counts (the stale entries' report is what is tested, not a kernel)."""
    monkeypatch.setattr(loader, "compile_variant", lambda variant: f"compiled {variant.name}")
    monkeypatch.setattr(loader, "_store_on_disk", lambda compiled, variant, entry_dir: None)


def _other_flavour_manifest(directory, variants):
    """A manifest of ``variants`` whose fingerprints are this process's but for the libs flavour."""
    directory.mkdir()
    entries = {}
    for v in variants:
        entries[v.name] = {"fingerprint": {**fingerprint(v), "dsl_libs": OTHER}, "object": f"{v.name}.o",
                           "object_sha256": "0" * 64}
    (directory / loader.MANIFEST).write_text(json.dumps({"format": loader.MANIFEST_FORMAT, "entries": entries}))


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if f"nvidia-cutlass-dsl-libs-{OTHER}" in r.getMessage()]


def test_a_wheel_of_another_libs_flavour_is_named_once_then_compiled(tmp_path, caplog):
    variants = [v for v in variant_space("sm_120a") if v.kind == "partial"][:3]
    aot = tmp_path / "aot"
    _other_flavour_manifest(aot, variants)
    loader.set_aot_dir(aot)
    with caplog.at_level(logging.WARNING, logger="dsv4_mla"):
        for v in variants:
            assert loader.get_compiled(v) == f"compiled {v.name}"
    assert loader.stats == {"compiled": 3, "aot_loaded": 0, "disk_loaded": 0}
    lines = _lines(caplog)
    assert len(lines) == 1, lines
    here = fingerprint(variants[0])["dsl_libs"]
    assert (f"the AOT kernels in {aot} do not match this environment (built with nvidia-cutlass-dsl-libs-{OTHER}, "
            f"this environment has nvidia-cutlass-dsl-libs-{here}") in lines[0]
    assert "compiled instead, once" in lines[0] and "set DSV4_MLA_REQUIRE_AOT=1 to make this an error" in lines[0]


def test_with_aot_required_the_line_says_each_kernel_is_an_error(tmp_path, caplog):
    variants = [v for v in variant_space("sm_120a") if v.kind == "partial"][:2]
    aot = tmp_path / "aot"
    _other_flavour_manifest(aot, variants)
    loader.set_aot_dir(aot)
    loader.set_require_aot(True)
    with caplog.at_level(logging.WARNING, logger="dsv4_mla"):
        for v in variants:
            with pytest.raises(loader.MissingAotVariant, match=f"{v.name} has no up-to-date entry.*{aot}: stale"):
                loader.get_compiled(v)
    assert loader.stats["compiled"] == 0
    lines = _lines(caplog)
    assert len(lines) == 1 and "is an error (MissingAotVariant)" in lines[0] and "compiled instead" not in lines[0]


def test_an_entry_that_matches_but_for_its_object_is_not_called_stale(tmp_path, caplog):
    """The flavour's line is only for a fingerprint that differs: an entry of this environment's
    fingerprint whose object is missing is reported as corrupt, not as built elsewhere."""
    v = next(v for v in variant_space("sm_120a") if v.kind == "partial")
    aot = tmp_path / "aot"
    aot.mkdir()
    entry = {"fingerprint": fingerprint(v), "object": f"{v.name}.o", "object_sha256": "0" * 64}
    (aot / loader.MANIFEST).write_text(json.dumps({"format": loader.MANIFEST_FORMAT, "entries": {v.name: entry}}))
    loader.set_aot_dir(aot)
    with caplog.at_level(logging.WARNING, logger="dsv4_mla"):
        assert loader.get_compiled(v) == f"compiled {v.name}"
    assert "do not match this environment" not in caplog.text and f"AOT entry {v.name} in {aot} is corrupt" in caplog.text
