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
from cute_kernels.sparse_mla_decode.kv_format import FORMATS, PRECISIONS
from dispatch.policy.registry import DEPLOYMENT_SHAPES, registry_variants
from dispatch.policy.variant_space import variant_space
from dispatch.runtime import loader
from dispatch.runtime.fingerprint import FIELDS, PROJECT_VERSION
from dispatch.tools import aot_build

ROOT = Path(__file__).resolve().parents[1]
SLICE = "merge_t128_b8|model1_fp8_f16_g1x16.*len11_final1_sink1"  # two merge variants (batch 8) and one partial variant
# one "f16" partial variant of each inline-scale format
FORMAT_SLICE = "partial_(v32_fp8|glm_nope_fp8)_f16_g1x16.*len00_final1_sink0"


@pytest.fixture(autouse=True)
def _isolated(isolated_loader):
    """No package manifest, a private JIT cache, and a fresh loader for every test."""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot")
    assert aot_build.main(["--arch", "sm_120a", "--only", SLICE, "--out", str(out), "--jobs", "2"]) == 0
    return out


@pytest.fixture(scope="module")
def built_formats(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot_formats")
    assert aot_build.main(["--arch", "sm_120a", "--only", FORMAT_SLICE, "--out", str(out), "--jobs", "2"]) == 0
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


def test_the_build_builds_the_registry_and_the_registry_is_the_variant_space():
    """What the build plans is the registry (the registry is what plans select:
    ``tests/test_registry.py::test_registry_is_what_plans_select``), which on the deployment
    archs is the whole variant space."""
    for arch in ("sm_120a", "sm_121a"):
        planned = aot_build.planned_variants([arch])
        assert planned == registry_variants(arch)
        # every variant the dispatch can generate serves some deployment shape, and no other is built
        assert set(planned) == set(variant_space(arch))
        for kv_format in FORMATS:  # every format's kernels, selected by the name the variants carry
            # (the format then the precision: "v41_fp8" is also the start of "v41_fp8_inline")
            mine = aot_build.planned_variants([arch], f"_{kv_format}_(?:{'|'.join(PRECISIONS)})_")
            assert mine and {v.config.kv_format for v in mine} == {kv_format}


def test_deployment_grid_holds_every_format():
    """The models served per format: DeepSeek-V4 (MODEL1 FP8; V4-Flash and V4-Pro also NVFP4,
    on the same shapes, and either record for either cache), DeepSeek-V4.1-Flash (V4's FP8
    record, and its own records: FP8 main caches with NVFP4 extra caches), DeepSeek-V3.2 and
    GLM-5.x (656-byte rows, topk 2048), GLM-5.3 (rope-free rows, topk 2176, with 16 heads at
    TP4: the one-group final-mode kernels are reached only below 17 heads), all on page 64
    without an extra cache."""
    by_model = {}
    for s in DEPLOYMENT_SHAPES:
        by_model.setdefault((s.model, s.kv_format), set()).add((s.num_heads, s.topk, s.page_block_size, s.extra_topk))
    assert by_model[("DeepSeek-V3.2", "v32_fp8")] == {(h, 2048, 64, 0) for h in (128, 64, 32, 16, 8)}
    assert by_model[("GLM-5.x", "v32_fp8")] == {(h, 2048, 64, 0) for h in (64, 32, 16, 8, 4)}
    assert by_model[("GLM-5.3", "glm_nope_fp8")] == {(h, 2176, 64, 0) for h in (64, 32, 16)}
    # every format, as a main cache or (V4.1's NVFP4 records) as an extra cache only
    assert {f for s in DEPLOYMENT_SHAPES for f in (s.kv_format, s.extra_kv_format) if f} == set(FORMATS)
    assert {f for m, f in by_model if m in ("V4-Flash", "V4-Pro")} == {"model1_fp8", "model1_nvfp4"}
    assert {f for m, f in by_model if m == "V4.1-Flash"} == {"model1_fp8", "v41_fp8", "v41_fp8_inline"}
    pairs = {(s.model, s.kv_format, s.extra_kv_format) for s in DEPLOYMENT_SHAPES if s.extra_kv_format}
    assert pairs == {(m, "model1_fp8", "model1_nvfp4") for m in ("V4-Flash", "V4-Pro")} | {
        (m, "model1_nvfp4", "model1_fp8") for m in ("V4-Flash", "V4-Pro")} | {
        ("V4.1-Flash", "v41_fp8", "v41_nvfp4"), ("V4.1-Flash", "v41_fp8_inline", "v41_nvfp4_inline")}
    for model in ("V4-Flash", "V4-Pro"):
        assert by_model[(model, "model1_nvfp4")] == by_model[(model, "model1_fp8")]
    assert ("V4.1-Flash", "model1_nvfp4") not in by_model  # vLLM keeps V4.1 in the FP8 record


def test_inline_formats_build_without_spills(built_formats):
    """The AOT build compiles, SASS-checks and exports the inline-scale formats' kernels (their
    key holds the format); the rope-free GLM-5.3 kernel has no bf16 rope MMA, V3.2's has."""
    manifest = json.loads((built_formats / "manifest.json").read_text())
    entries = manifest["entries"]
    assert {e["key"]["kv_format"] for e in entries.values()} == {"v32_fp8", "glm_nope_fp8"}
    for name, e in entries.items():
        r = e["resources"]
        assert r["local_bytes"] == 0 and r["local_memory_instructions"] == 0
        assert r["launch_smem_bytes"] == r["plan_smem_bytes"] <= SMEM_PER_CTA_MAX
        has_rope_mma = any("BF16" in kind for kind in r["mma"])
        assert has_rope_mma == (e["key"]["kv_format"] == "v32_fp8"), (name, r["mma"])
    loader.set_aot_dir(built_formats)
    for v in aot_build.planned_variants(["sm_120a"], FORMAT_SLICE):
        assert loader.get_compiled(v) is not None
    assert loader.stats == {"compiled": 0, "aot_loaded": 2, "disk_loaded": 0}


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
    reason = {"dsl_libs": "built with nvidia-cutlass-dsl-libs-something else, this environment has",
              "dsl_version": "built with nvidia-cutlass-dsl something else, this environment has",
              "source_hash": "built from other kernel sources", "project_version": "built from other kernel sources"}
    assert "do not match this environment" in caplog.text
    assert reason.get(field, f"{field}: 'something else'") in caplog.text


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
    from dispatch.policy.registry import registry_variants
    from dispatch.runtime import loader
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


# ---------------------------------------------------------------------- lookup order
def _altered_copy(built, tmp_path, name, how):
    """A copy of ``built`` whose every entry is stale (``how="stale"``) or whose objects are
    truncated (``how="corrupt"``)."""
    copy = tmp_path / name
    shutil.copytree(built, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for entry in manifest["entries"].values():
        if how == "stale":
            entry["fingerprint"]["source_hash"] = "an older source"
        else:
            obj = copy / entry["object"]
            obj.write_bytes(obj.read_bytes()[:100])
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize("require", [False, True])
@pytest.mark.parametrize("how", ["stale", "corrupt"])
def test_a_bad_entry_never_hides_an_up_to_date_one_further_on(built, tmp_path, monkeypatch, caplog, how, require):
    """$DSV4_MLA_AOT_DIR holding a stale or corrupt entry, the installed package a valid one:
    the valid one loads, compiling on or off, and nothing says a compile happens."""
    monkeypatch.setenv("DSV4_MLA_AOT_DIR", str(_altered_copy(built, tmp_path, "env_dir", how)))
    monkeypatch.setattr(loader, "PACKAGE_AOT_DIR", built)
    loader.set_require_aot(require)
    with caplog.at_level(logging.WARNING, logger="dsv4_mla"):
        for v in aot_build.planned_variants(["sm_120a"], SLICE):
            assert loader.get_compiled(v) is not None
    assert loader.stats == {"compiled": 0, "aot_loaded": 3, "disk_loaded": 0}
    assert f"is {how}" in caplog.text and "skipped" in caplog.text and "compil" not in caplog.text


def test_no_jit_switch_names_the_stale_entries_it_skipped(built, tmp_path, caplog):
    loader.set_aot_dir(_altered_copy(built, tmp_path, "stale", "stale"))
    loader.set_require_aot(True)
    (v,) = aot_build.planned_variants(["sm_120a"], "merge_t128_b8_sink0")
    with caplog.at_level(logging.WARNING, logger="dsv4_mla"), pytest.raises(loader.MissingAotVariant) as info:
        loader.get_compiled(v)
    assert "has no up-to-date entry" in str(info.value) and "stale: stale" in str(info.value)
    assert "compiling it" not in caplog.text and loader.stats["compiled"] == 0


# ---------------------------------------------------------------------- what a build keeps and ships
def _fake_entry(out, variant, fp=None):
    from dispatch.runtime.fingerprint import fingerprint

    obj = out / f"{variant.name}.o"
    obj.write_bytes(variant.name.encode())
    (out / f"{variant.name}.h").write_text("")
    return {"fingerprint": fp or fingerprint(variant), "object": obj.name, "object_sha256": loader.sha256_file(obj)}


def test_build_drops_the_entries_its_archs_no_longer_plan(tmp_path, monkeypatch):
    import cute_kernels.sass_check as sass_check
    from dispatch.policy.variant_space import KernelVariant
    from cute_kernels.sparse_mla_decode.config import MergeConfig

    monkeypatch.setattr(sass_check, "require_sass_tools", lambda: None)
    (planned,) = aot_build.planned_variants(["sm_120a"], "merge_t128_b8_sink0")
    gone_120 = KernelVariant(MergeConfig(num_threads=256), "sm_120a")  # outside the registry
    other_arch = KernelVariant(MergeConfig(num_threads=256), "sm_90a")
    entries = {v.name: _fake_entry(tmp_path, v) for v in (planned, gone_120, other_arch)}
    aot_build._write_manifest(tmp_path, entries)
    assert aot_build.build(["sm_120a"], tmp_path, jobs=1, only="^none$") == []  # compiles nothing
    assert set(loader.read_manifest(tmp_path)["entries"]) == {planned.name, other_arch.name}
    assert not (tmp_path / f"{gone_120.name}.o").exists() and not (tmp_path / f"{gone_120.name}.h").exists()
    assert (tmp_path / f"{other_arch.name}.o").exists() and (tmp_path / f"{planned.name}.o").exists()


def test_the_wheel_ships_only_up_to_date_entries_of_the_planned_variants(tmp_path):
    from dispatch.policy.variant_space import KernelVariant
    from dispatch.runtime.fingerprint import fingerprint
    from cute_kernels.sparse_mla_decode.config import MergeConfig

    good, stale = aot_build.planned_variants(["sm_120a"], "merge_t128_b8_sink")
    (other_arch,) = aot_build.planned_variants(["sm_121a"], "merge_t128_b8_sink0")
    unplanned = KernelVariant(MergeConfig(num_threads=256), "sm_120a")
    entries = {v.name: _fake_entry(tmp_path, v) for v in (good, other_arch, unplanned)}
    entries[stale.name] = _fake_entry(tmp_path, stale, {**fingerprint(stale), "source_hash": "an older source"})
    aot_build._write_manifest(tmp_path, entries)
    assert set(aot_build.wheel_entries(tmp_path, ["sm_120a"])) == {good.name}
    assert set(aot_build.wheel_entries(tmp_path, ["sm_120a", "sm_121a"])) == {good.name, other_arch.name}


def test_the_command_line_refuses_an_unknown_arch(capsys):
    with pytest.raises(SystemExit) as info:
        aot_build.main(["--arch", "sm_100a"])
    assert info.value.code == 2 and "invalid choice: 'sm_100a'" in capsys.readouterr().err


def test_wheel_needs_a_source_checkout_before_any_build(monkeypatch, tmp_path):
    def installed():
        raise SystemExit("--wheel packages a source checkout")

    monkeypatch.setattr(aot_build, "source_checkout", installed)
    monkeypatch.setattr(aot_build, "build", lambda *a, **k: pytest.fail("built before checking for a source checkout"))
    with pytest.raises(SystemExit, match="source checkout"):
        aot_build.main(["--out", str(tmp_path / "aot"), "--wheel", str(tmp_path / "wheels")])


def test_build_leaves_no_cubin_dump_behind(tmp_path, monkeypatch):
    """The build's temporary directories (its own and its workers', which inherit TMPDIR) are gone after it."""
    import tempfile

    monkeypatch.delenv("CUTE_DSL_DUMP_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    (tmp_path / "tmp").mkdir()
    assert aot_build.main(["--arch", "sm_121a", "--only", "merge_t128_b8_sink0", "--out", str(tmp_path / "aot"),
                           "--jobs", "1"]) == 0
    assert list((tmp_path / "tmp").glob("dsv4_mla_cubin_*")) == []  # (the DSL keeps its own cache there)


def test_project_version_falls_back_to_the_installed_metadata(monkeypatch, tmp_path):
    from importlib import metadata

    from dispatch.runtime import fingerprint as fp

    monkeypatch.setattr(fp, "ROOT", tmp_path)  # no pyproject.toml: an installed wheel
    monkeypatch.setattr(metadata, "version", lambda dist: {fp.DISTRIBUTION: "9.8.7"}[dist])
    assert fp._project_version() == "9.8.7"


# ---------------------------------------------------------------------- dsv4-mla-check-aot's bound
def test_check_aot_spot_check_fails_an_error_above_twice_the_floor():
    import torch

    from cute_kernels.sparse_mla_decode.reference import reference_decode
    from dispatch.tools.check_aot import spot_check
    from dispatch.tools.sample_inputs import make_cache, make_indices

    gen = torch.Generator().manual_seed(0)
    cache = make_cache(8, 64, device="cpu", gen=gen)
    q = torch.randn(40, 16, 512, generator=gen).bfloat16()
    idx = make_indices(40, 100, 512, device="cpu", gen=gen)
    kw = {"topk_length": torch.randint(0, 101, (40,), generator=gen, dtype=torch.int32)}
    ref, _ = reference_decode(q, cache, idx, **kw)
    rounded = ref.to(torch.bfloat16)  # exactly the floor: half the bound
    for precision in ("f16", "fp8"):
        ratio, bad = spot_check(precision, q, cache=cache, idx=idx, kw=kw, out=rounded)
        assert bad == [] and ratio <= 0.5 + 1e-9, (precision, ratio)
    wrong = rounded.clone()
    wrong[5] *= 1.01  # a token 1% off (one of the 16 checked)
    ratio, bad = spot_check("f16", q, cache=cache, idx=idx, kw=kw, out=wrong)
    assert bad == [5] and ratio > 1
