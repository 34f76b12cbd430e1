import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# the tests never write into the user's JIT cache
os.environ.setdefault("DSV4_MLA_CACHE_DIR", tempfile.mkdtemp(prefix="dsv4_mla_test_jit_"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    mod = sys.modules.get("tests.test_decode_gpu")
    rows = getattr(mod, "ACCURACY", None)
    if not rows:
        return
    terminalreporter.write_sep("-", "accuracy against the float32 reference (worst token)")
    for case, rel, lse_err in rows:
        terminalreporter.write_line(f"out rel L2 {rel:.2e}  lse abs {lse_err:.2e}  {case}")
