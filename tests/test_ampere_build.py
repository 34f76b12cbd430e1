"""Ampere and Ada (sm_80, sm_86, sm_89) from the same source, on the CPU: a merge and an "f16"
partial variant of each arch built by the AOT build, whose SASS checks (no spills, shared
memory within the arch's per-CTA limit, no instruction the arch lacks) pass; the route each
arch takes (no PDL below sm_90, the e4m3 conversion instruction on sm_89 only); an arch
profile's build, compiled for sm_90a with sm_80's code; the capability map."""

from __future__ import annotations

import re

import pytest

from cute_kernels.arch import (
    ARCH_BY_CAPABILITY, ARCHS, MAX_REGISTERS_PER_THREAD, PROFILE_ENV, arch_facts, arch_for_capability, profile,
)
from cute_kernels.sass_check import disassemble, forbidden_in
from dispatch.policy.registry import registry_variants
from dispatch.runtime.loader import compile_variant, read_manifest
from dispatch.tools import aot_build

ARCHS_8X = ("sm_80", "sm_86", "sm_89")
MERGE = "sparse_mla_merge_t128_b8_sink0"
F16_PARTIAL = "sparse_mla_partial_model1_fp8_f16_g1x16_n32_w4_s3_len00_final0_sink0_occ1"
ONLY = f"^({MERGE}|{F16_PARTIAL})_sm_8[069]$"


@pytest.fixture(scope="module")
def built_8x(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot8x")
    assert aot_build.build(list(ARCHS_8X), out, jobs=2, only=ONLY) == []
    return out, read_manifest(out)["entries"]


def test_each_8x_arch_builds_a_merge_and_an_f16_partial_that_pass_the_sass_checks(built_8x):
    out, entries = built_8x
    assert sorted(entries) == sorted(f"{name}_{arch}" for arch in ARCHS_8X for name in (MERGE, F16_PARTIAL))
    for name, entry in entries.items():
        target = arch_facts(entry["fingerprint"]["arch"])
        res = entry["resources"]
        assert res["local_bytes"] == res["stack_bytes"] == res["local_memory_instructions"] == 0, name
        assert res["launch_smem_bytes"] == res["plan_smem_bytes"] <= target.smem_per_cta, name
        assert res["registers"] <= MAX_REGISTERS_PER_THREAD
        if F16_PARTIAL in name:  # as on sm_120a: 32 f16 MMAs (nope warps), 32 bf16 (rope warp)
            assert res["mma"] == {"HMMA.16816.F32": 32, "HMMA.16816.F32.BF16": 32}, name
            # no MMA of the nope warps' loop waits on the one before it (ptxas for 8.x leaves 4
            # chained bf16 MMAs in the rope warp's loop, which sm_120a's build has none of)
            assert res["chained_mma"][0] == 0 and len(res["chained_mma"]) == 2, name
            # the first copies (indices) are issued before any wait for a global load (this
            # variant has no length tensor: Q's loads)
            assert res["waits_before_first_copy"] == 0, name
    report = aot_build.report(out)
    for arch in ARCHS_8X:
        limit = ARCHS[arch].smem_per_cta
        assert re.search(rf"^{arch}: 2 variants; 0 spill; 0 over {limit} bytes of shared memory per CTA", report, re.M)


@pytest.mark.parametrize("arch,pdl,cvt", [("sm_80", False, False), ("sm_86", False, False), ("sm_89", False, True),
                                          ("sm_90a", True, True)])
def test_each_arch_takes_its_own_route_through_the_same_source(arch, pdl, cvt):
    """The SASS of the split-mode "f16" partial kernel: PDL's instructions (``PREEXIT``: the
    merge's early launch) only from sm_90, the e4m3 conversion (``F2FP ... E4M3``) only from
    sm_89 (sm_80 / sm_86: integer operations), and nothing the arch's list forbids."""
    (variant,) = [v for v in registry_variants(arch) if v.name == f"{F16_PARTIAL}_{arch}"]
    sass = disassemble(compile_variant(variant, keep_cubin=True).artifacts.CUBIN)
    opcodes = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)", sass, re.M)
    assert bool(forbidden_in(opcodes, ("PREEXIT",))) is pdl
    assert bool(forbidden_in(opcodes, ("F2FP.E4M3",))) is cvt
    assert forbidden_in(opcodes, variant.target.forbidden_sass) == []


def test_a_profile_builds_its_targets_code_for_the_gpu_it_runs_on(tmp_path):
    """The sm_80 profile on sm_90a: sm_80's variants (named apart: they never mix with sm_90a's
    in a cache), compiled for sm_90a (an sm_90 cubin), with sm_80's forbidden list checked by
    the build: no PDL and no e4m3 conversion in the SASS the GPU tests then run."""
    name = f"{F16_PARTIAL}_sm_80_on_sm_90a"
    assert [v.name for v in registry_variants("sm_80_on_sm_90a") if v.name.startswith(F16_PARTIAL + "_")] == [name]
    assert {v.name.removesuffix("_on_sm_90a") for v in registry_variants("sm_80_on_sm_90a")} == \
        {v.name for v in registry_variants("sm_80")}
    assert aot_build.main(["--arch", "sm_80_on_sm_90a", "--only", f"^({MERGE}|{F16_PARTIAL})_", "--out",
                           str(tmp_path), "--jobs", "2"]) == 0
    entries = read_manifest(tmp_path)["entries"]
    assert sorted(entries) == sorted([name, f"{MERGE}_sm_80_on_sm_90a"])
    assert entries[name]["fingerprint"]["arch"] == "sm_80_on_sm_90a"
    (variant,) = [v for v in registry_variants("sm_80_on_sm_90a") if v.name == name]
    sass = disassemble(compile_variant(variant, keep_cubin=True).artifacts.CUBIN)
    assert "EF_CUDA_SM90" in sass and "F2FP.F16.E4M3" not in sass and "PREEXIT" not in sass


def test_capabilities_map_to_their_targets(monkeypatch):
    """8.0 and 8.7 (Orin: sm_80's shared memory, and sm_80 SASS runs on 8.7) to sm_80, 8.6 and
    8.9 to their own; with ``DSV4_MLA_ARCH_PROFILE`` the profile on the device's target, or a
    refusal where the device cannot run it; unset or the device's own arch, the arch."""
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    assert {cc: arch_for_capability(cc) for cc in ARCH_BY_CAPABILITY if cc[0] == 8} == {
        (8, 0): "sm_80", (8, 6): "sm_86", (8, 7): "sm_80", (8, 9): "sm_89"}
    assert arch_for_capability((7, 5)) is None and arch_for_capability((10, 0)) is None
    monkeypatch.setenv(PROFILE_ENV, "sm_86")
    assert arch_for_capability((9, 0)) == "sm_86_on_sm_90a" and arch_for_capability((8, 6)) == "sm_86"
    monkeypatch.setenv(PROFILE_ENV, "sm_80")
    with pytest.raises(ValueError, match="sm_80 profile cannot run on sm_120a: sm_120a has 101376 bytes"):
        arch_for_capability((12, 0))
    monkeypatch.setenv(PROFILE_ENV, "sm_75")
    with pytest.raises(ValueError, match="a profile stands for one of sm_80, sm_86, sm_89"):
        arch_for_capability((9, 0))


def test_the_arch_table():
    """The facts each decision reads (``cute_kernels.arch``)."""
    facts = {name: (a.pdl, a.e4m3_cvt, a.e4m3_mma, a.block_scaled_mma, a.smem_per_cta, a.smem_per_sm, a.ships)
             for name, a in ARCHS.items()}
    assert facts == {
        "sm_80": (False, False, False, False, 166912, 167936, True),
        "sm_86": (False, False, False, False, 101376, 102400, True),
        "sm_89": (False, True, True, False, 101376, 102400, True),
        "sm_90a": (True, True, True, False, 232448, 233472, False),
        "sm_120a": (True, True, True, True, 101376, 102400, True),
        "sm_121a": (True, True, True, True, 101376, 102400, True),
    }
    p = profile("sm_89", "sm_90a")
    assert (p.name, p.isa, p.label, p.ships) == ("sm_89_on_sm_90a", "sm_90a", "sm_89 (profile on sm_90a)", False)
    assert (p.pdl, p.e4m3_cvt, p.e4m3_mma, p.smem_per_cta) == (False, True, True, 101376)
    assert set(ARCHS["sm_80"].forbidden_sass) >= {"ACQBULK", "PREEXIT", "F2FP.E4M3", "QMMA", "HMMA.E4M3", "HGMMA"}
    assert "F2FP.E4M3" not in ARCHS["sm_89"].forbidden_sass and "QMMA.SF" in ARCHS["sm_89"].forbidden_sass


def test_the_profile_bench_refuses_a_profile_run_and_prints_each_profile_against_the_gpu(monkeypatch, capsys):
    """``scripts/profile_bench.py`` (CPU parts): under ``DSV4_MLA_ARCH_PROFILE`` it refuses (it
    plans the profiles by name beside the GPU's own build), and its table gives each
    profile's time and its ratio to the GPU's, with the geometric mean of the ratios."""
    from scripts import profile_bench

    monkeypatch.setenv(PROFILE_ENV, "sm_80")
    with pytest.raises(SystemExit) as refused:
        profile_bench.main([])
    assert refused.value.code == 2 and f"unset {PROFILE_ENV}" in capsys.readouterr().err
    rows = [dict(T=1, H=16, topk="128", us={"sm_90a": 10.0, "sm_80_on_sm_90a": 12.0}),
            dict(T=8, H=64, topk="512", us={"sm_90a": 20.0, "sm_80_on_sm_90a": 30.0})]
    profile_bench.print_table(rows, ["sm_90a", "sm_80_on_sm_90a"], "Stand-in H200", "model1_fp8", None)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Stand-in H200, model1_fp8 caches, precision default")
    assert lines[1].split() == ["T", "H", "topk", "sm_90a", "sm_80", "x"]
    assert lines[2].split() == ["1", "16", "128", "10.0", "12.0", "1.20"]
    assert lines[-1].split() == ["geomean", f"{(1.2 * 1.5) ** 0.5:.2f}"]
