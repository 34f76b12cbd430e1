"""The offline AOT build, the manifest checks, the JIT disk cache and the no-JIT switch (CPU)."""

import json
import logging
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cute_kernels.arch import SMEM_PER_CTA_MAX
from dispatch import aot_build, loader
from dispatch.fingerprint import FIELDS, PROJECT_VERSION
from dispatch.registry import registry_variants
from dispatch.variants import variant_space

ROOT = Path(__file__).resolve().parents[1]
SLICE = "merge_t128_b8|_f16_g1x16.*len11_final1_sink1"  # two merge variants (batch 8) and one partial variant


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No package manifest, a private JIT cache, and a fresh loader for every test."""
    monkeypatch.setattr(loader, "PACKAGE_AOT_DIR", tmp_path / "no_package_aot")
    monkeypatch.setenv("DSV4_MLA_CACHE_DIR", str(tmp_path / "jit"))
    monkeypatch.delenv("DSV4_MLA_AOT_DIR", raising=False)
    monkeypatch.delenv("DSV4_MLA_REQUIRE_AOT", raising=False)
    loader.set_aot_dir(None)
    loader.set_require_aot(None)
    loader.reset_for_tests()
    yield
    loader.set_aot_dir(None)
    loader.set_require_aot(None)
    loader.reset_for_tests()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot")
    assert aot_build.main(["--arch", "sm_120a", "--only", SLICE, "--out", str(out), "--jobs", "2"]) == 0
    return out



def test_missing_sass_tool_is_reported_before_any_compile(monkeypatch, tmp_path, capsys):
    import cute_kernels.sass_check as sass_check

    def missing(name):
        raise sass_check.MissingSassTool(f"{name} not found (it reads the compiled kernels' SASS): "
                                         f"{sass_check.INSTALL_SASS_TOOLS}")

    monkeypatch.setattr(sass_check, "_tool", missing)
    monkeypatch.setattr(aot_build, "build_one", lambda *a, **k: pytest.fail("compiled with a tool missing"))
    assert aot_build.main(["--out", str(tmp_path / "aot")]) == 2
    err = capsys.readouterr().err
    assert "cuobjdump not found" in err and "pip install nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump" in err
    assert not (tmp_path / "aot" / "manifest.json").exists()


def test_registry_is_what_dispatch_selects_and_what_the_build_builds():
    for arch in ("sm_120a", "sm_121a"):
        planned = aot_build.planned_variants([arch])
        assert planned == registry_variants(arch)
        # every variant the dispatch can generate serves some deployment shape, and no other is built
        assert set(planned) == set(variant_space(arch))


def test_project_version_matches_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{PROJECT_VERSION}"' in text


def test_manifest_records_every_field(built):
    manifest = json.loads((built / "manifest.json").read_text())
    assert len(manifest["entries"]) == 3
    for name, entry in manifest["entries"].items():
        assert set(FIELDS) <= set(entry["fingerprint"]) and entry["fingerprint"]["name"] == name
        assert entry["fingerprint"]["arch"] == "sm_120a"
        assert (built / entry["object"]).exists()
        assert entry["resources"]["local_bytes"] == 0 and entry["resources"]["local_memory_instructions"] == 0
        if "partial" in name:
            assert entry["resources"]["mma"] == {"HMMA.16816.F32": 32, "HMMA.16816.F32.BF16": 32}
            assert entry["resources"]["launch_smem_bytes"] <= SMEM_PER_CTA_MAX
    text = aot_build.report(built)
    assert f"3 variants; 0 spill; 0 over {SMEM_PER_CTA_MAX} bytes of shared memory per CTA" in text


def test_rebuild_is_incremental(built, capsys):
    assert aot_build.main(["--arch", "sm_120a", "--only", SLICE, "--out", str(built), "--jobs", "2"]) == 0
    assert "3 up to date, 0 to build" in capsys.readouterr().out


def test_valid_entry_loads_without_compiling(built):
    loader.set_aot_dir(built)
    for v in aot_build.planned_variants(["sm_120a"], SLICE):
        assert loader.get_compiled(v) is not None
    assert loader.stats == {"compiled": 0, "aot_loaded": 3, "disk_loaded": 0}


@pytest.mark.parametrize("field", FIELDS)
def test_mismatched_entry_is_never_loaded(built, tmp_path, caplog, field):
    copy = tmp_path / "aot"
    shutil.copytree(built, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    name = next(n for n in manifest["entries"] if "merge_t128_b8_sink0" in n)
    manifest["entries"][name]["fingerprint"][field] = "something else"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    loader.set_aot_dir(copy)
    (v,) = [v for v in aot_build.planned_variants(["sm_120a"], SLICE) if v.name == name]
    with caplog.at_level(logging.WARNING, logger="dsv4_mla"):
        assert loader.get_compiled(v) is not None
    assert loader.stats["aot_loaded"] == 0 and loader.stats["compiled"] == 1
    assert f"{field}: 'something else'" in caplog.text and "stale" in caplog.text


def test_corrupt_object_is_never_loaded(built, tmp_path, caplog):
    copy = tmp_path / "aot"
    shutil.copytree(built, copy)
    obj = next(copy.glob("*merge_t128_b8_sink1*.o"))
    obj.write_bytes(obj.read_bytes()[:100])
    loader.set_aot_dir(copy)
    (v,) = [v for v in aot_build.planned_variants(["sm_120a"], "merge_t128_b8_sink1")]
    with caplog.at_level(logging.WARNING, logger="dsv4_mla"):
        loader.get_compiled(v)
    assert loader.stats["aot_loaded"] == 0 and loader.stats["compiled"] == 1
    assert "corrupt" in caplog.text


def test_corrupt_manifest_is_ignored(built, tmp_path, caplog):
    copy = tmp_path / "aot"
    shutil.copytree(built, copy)
    (copy / "manifest.json").write_text("{ not json")
    loader.set_aot_dir(copy)
    (v,) = aot_build.planned_variants(["sm_120a"], "merge_t128_b8_sink0")
    with caplog.at_level(logging.WARNING, logger="dsv4_mla"):
        loader.get_compiled(v)
    assert loader.stats["compiled"] == 1 and "corrupt AOT manifest" in caplog.text


def test_no_jit_switch_refuses_a_missing_variant(tmp_path):
    loader.set_aot_dir(tmp_path)
    loader.set_require_aot(True)
    (v,) = aot_build.planned_variants(["sm_120a"], "merge_t128_b8_sink0")
    with pytest.raises(loader.MissingAotVariant) as info:
        loader.get_compiled(v)
    assert v.name in str(info.value)
    assert "dsv4-mla-aot-build --arch sm_120a" in str(info.value)
    assert loader.stats["compiled"] == 0


_WORKER = textwrap.dedent("""
    import json
    from pathlib import Path
    from dispatch import loader
    from dispatch.registry import registry_variants
    loader.PACKAGE_AOT_DIR = Path({none!r})
    (v,) = [v for v in registry_variants("sm_121a") if "merge_t128_b8_sink1" in v.name]
    loader.get_compiled(v)
    print(json.dumps(loader.stats))
""")


def test_concurrent_writers_share_one_disk_cache_entry(tmp_path):
    script = _WORKER.format(none=str(tmp_path / "none"))
    env = {**__import__("os").environ, "DSV4_MLA_CACHE_DIR": str(tmp_path / "jit")}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=tmp_path) for _ in range(3)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
    entries = [d for d in (tmp_path / "jit").iterdir() if d.is_dir()]
    assert len(entries) == 1 and not entries[0].name.startswith(".tmp"), entries
    meta = json.loads((entries[0] / "meta.json").read_text())
    assert meta["fingerprint"]["arch"] == "sm_121a"
    # a later process loads it from disk and compiles nothing
    out, err = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, cwd=tmp_path).communicate(timeout=300)
    assert json.loads(out.strip().splitlines()[-1]) == {"compiled": 0, "aot_loaded": 0, "disk_loaded": 1}, err
