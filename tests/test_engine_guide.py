"""docs/engines.md and the links of the docs: every command of the guide that runs without a
GPU (its ```shell blocks) runs and succeeds; the names it tells users to type exist in the
code; every relative link in README.md and docs/ points to a file (CPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "engines.md"


def _shell_commands() -> list[str]:
    blocks = re.findall(r"```shell\n(.*?)```", GUIDE.read_text(), re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_the_guide_has_commands_to_run():
    assert len(_shell_commands()) >= 4


@pytest.mark.parametrize("command", _shell_commands())
def test_every_cpu_command_of_the_guide_runs(command):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    if "requested_mode" in command:
        assert done.stdout.strip().splitlines()[-1] == "sm120"


def test_the_names_the_guide_gives_exist():
    from dispatch import engine_plugins

    text = GUIDE.read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    for command in set(re.findall(r"\b(dsv4-mla-[a-z-]+)", text)):
        assert f"{command} = " in pyproject, command
    assert engine_plugins.ENV in text and engine_plugins.SGLANG_TARGET in text
    for variable in set(re.findall(r"\b(DSV4_MLA_[A-Z_]+)", text)):
        assert any(variable in p.read_text() for p in (ROOT / "dispatch").rglob("*.py")), variable
    plugins = (ROOT / "dispatch" / "engine_plugins.py").read_text()
    for logged in ("replaced by dispatch.adapters.trtllm_batch_decode_sparse_mla_dsv4",
                   "replaced by dispatch.adapters.flash_mla_with_kvcache_sm120"):
        assert logged in plugins and logged.split(" by ")[1] in text
    for engine, version in (("vllm", "0.34.0"), ("sglang", "0.5.23")):
        assert engine_plugins.CHECKED[engine].startswith(version) and version in text


def test_every_relative_link_resolves():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name}: {target}"
        for target in re.findall(r"`((?:docs|dispatch|tests|scripts|cute_kernels)/[\w/.-]+\.(?:md|py))`",
                                 page.read_text()):
            assert (ROOT / target).exists(), f"{page.name}: {target}"
