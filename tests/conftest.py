import os
import tempfile
from pathlib import Path

import pytest
import torch

from cute_kernels.arch import BLOCK_SCALED_ARCHS, DEPLOYMENT_ARCHS, arch_for_capability

# the tests never write into the user's JIT cache
os.environ.setdefault("DSV4_MLA_CACHE_DIR", tempfile.mkdtemp(prefix="dsv4_mla_test_jit_"))
from tests.tolerances import ACCURACY

ROOT = Path(__file__).resolve().parents[1]

def pytest_collection_modifyitems(config, items):
    gpu = torch.cuda.is_available()
    block_scaled = gpu and arch_for_capability(torch.cuda.get_device_capability()) in BLOCK_SCALED_ARCHS
    no_gpu = pytest.mark.skip(reason="no CUDA GPU on this machine")
    no_block_scaled = pytest.mark.skip(reason="needs SM120's block-scaled MMA (an sm_120a / sm_121a GPU)")
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(no_gpu)
        elif "block_scaled" in item.keywords and not block_scaled:
            item.add_marker(no_block_scaled)


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
