import os
import tempfile
from pathlib import Path

import pytest
import torch

from cute_kernels.arch import DEPLOYMENT_ARCHS, arch_facts, arch_for_capability

# the tests never write into the user's JIT cache
os.environ.setdefault("DSV4_MLA_CACHE_DIR", tempfile.mkdtemp(prefix="dsv4_mla_test_jit_"))
from tests.tolerances import ACCURACY

ROOT = Path(__file__).resolve().parents[1]

def pytest_configure(config):
    config.addinivalue_line("markers", "e4m3_mma: needs the e4m3 MMA, sm_89 and later (skipped elsewhere, and under "
                                       "the sm_80 / sm_86 arch profiles)")


def gpu_target():
    """The ``cute_kernels.arch.Arch`` the GPU runs (under ``DSV4_MLA_ARCH_PROFILE``, the
    profile), or None without a GPU."""
    if not torch.cuda.is_available():
        return None
    arch = arch_for_capability(torch.cuda.get_device_capability())
    return None if arch is None else arch_facts(arch)


def pytest_collection_modifyitems(config, items):
    gpu = torch.cuda.is_available()
    target = gpu_target()
    no_gpu = pytest.mark.skip(reason="no CUDA GPU on this machine")
    # the paths an arch lacks: their tests skip (marker -> the Arch field that says it has them)
    needs = {"block_scaled": "block_scaled_mma", "e4m3_mma": "e4m3_mma"}
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(no_gpu)
            continue
        for marker, feature in needs.items():
            if marker in item.keywords and (target is None or target.lacks(feature)):
                why = target.lacks(feature) if target is not None else "no supported GPU"
                item.add_marker(pytest.mark.skip(reason=f"needs the {marker} path's instruction: {why}"))


@pytest.fixture(scope="session")
def deployment_build():
    """The AOT build of the deployment archs in ``build/aot`` (the README's main job): built
    here, incrementally, only where it is missing or stale, so that a test run after the main
    job compiles nothing. Returns (directory, the manifest entries of the deployment archs:
    another arch's build in the same directory is not what ships)."""
    from dispatch.runtime.loader import read_manifest
    from dispatch.tools.aot_build import DEFAULT_OUT, build

    out = ROOT / DEFAULT_OUT
    failures = build(list(DEPLOYMENT_ARCHS), out, jobs=os.cpu_count() or 1)
    assert not failures, failures
    entries = read_manifest(out)["entries"]
    return out, {name: e for name, e in entries.items() if e["fingerprint"]["arch"] in DEPLOYMENT_ARCHS}


@pytest.fixture
def isolated_loader(monkeypatch, tmp_path):
    """The loader as a fresh process finds it, with no package build and a private JIT cache:
    what a test of where kernels come from starts from, and leaves behind."""
    from dispatch.runtime import loader

    monkeypatch.setattr(loader, "PACKAGE_AOT_DIR", tmp_path / "no_package_aot")
    monkeypatch.setenv("DSV4_MLA_CACHE_DIR", str(tmp_path / "jit"))
    monkeypatch.delenv("DSV4_MLA_AOT_DIR", raising=False)
    monkeypatch.delenv("DSV4_MLA_REQUIRE_AOT", raising=False)
    loader.set_aot_dir(None)
    loader.set_require_aot(None)
    loader.reset_for_tests()
    yield loader
    loader.set_aot_dir(None)
    loader.set_require_aot(None)
    loader.reset_for_tests()


def pytest_terminal_summary(terminalreporter):
    if not ACCURACY:
        return
    terminalreporter.write_sep("-", "accuracy against the float64 reference (worst token of each case)")
    for case, rel, lse_err, ratio in ACCURACY:
        terminalreporter.write_line(f"out rel L2 {rel:.2e} ({ratio:.2f} x floor)  lse {lse_err:.1e}  {case}")
