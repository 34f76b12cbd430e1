"""The user's first pages against the code (CPU): every command of docs/engines.md and
docs/deployment.md that runs without a GPU (their ```shell blocks) runs and prints what the
page says; the names the pages tell users to type (console commands, environment variables,
self-test models and options, loggers, log lines, fingerprint parts) exist in the code; the
README's first screen says what ran where and stays short; every relative link of README.md and
docs/ points to a file and, with an anchor, to a heading of it."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "engines.md"
DEPLOYMENT = ROOT / "docs" / "deployment.md"
RUNNABLE = (GUIDE, DEPLOYMENT)  # the pages whose ```shell blocks run without a GPU
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 8000  # bytes: docs/contributing.md's tree rule


def _shell_commands() -> list[tuple[str, str]]:
    commands = []
    for page in RUNNABLE:
        for block in re.findall(r"```shell\n(.*?)```", page.read_text(), re.S):
            commands += [(page.name, line) for line in block.splitlines() if line.strip() and not line.startswith("#")]
    return commands


def _run(command: str) -> subprocess.CompletedProcess:
    """``command`` as a user types it: this interpreter's scripts first on PATH, the checkout
    importable."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _installed() -> bool:
    try:
        importlib.metadata.distribution("dsv4-sparse-mla")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _expected_output(command: str) -> list[str]:
    """What the page says ``command`` prints (substrings of its output)."""
    from dispatch.runtime import fingerprint

    if "requested_mode" in command:
        return ["sm120"]  # the value of DSV4_MLA_ENGINE_KERNELS=1, as the guide says
    if "entry_points" in command:
        return (["dispatch.engine_plugins:register_vllm", "dispatch.engine_plugins:register_sglang"]
                if _installed() else ["[]"])
    if "fingerprint" in command:
        return [fingerprint.dsl_version(), fingerprint.dsl_libs(), fingerprint.PROJECT_VERSION,
                fingerprint.source_hash()]
    helped = re.fullmatch(r"(dsv4-mla-[a-z-]+) --help", command.strip())
    if helped:
        return [f"usage: {helped.group(1)}"]
    raise AssertionError(f"no expected output known for {command!r}: say in this test what it prints")


def test_the_pages_have_commands_to_run():
    pages = {page for page, _ in _shell_commands()}
    assert pages == {p.name for p in RUNNABLE} and len(_shell_commands()) >= 5


@pytest.mark.parametrize("page,command", _shell_commands())
def test_every_cpu_command_runs_and_prints_what_the_page_says(page, command):
    done = _run(command)
    assert done.returncode == 0, f"{page}: {command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    for expected in _expected_output(command):
        assert expected in done.stdout, f"{page}: {command} printed\n{done.stdout[-2000:]}\nwithout {expected!r}"


# ---------------------------------------------------------------------- names the pages give
def _pages_text() -> str:
    return "\n".join(p.read_text() for p in [README, GUIDE, DEPLOYMENT])


def test_the_commands_and_variables_the_pages_name_exist():
    text = _pages_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    for command in set(re.findall(r"\b(dsv4-mla-[a-z-]+)", text)):
        assert f"{command} = " in pyproject, command
    code = "\n".join(p.read_text() for p in (ROOT / "dispatch").rglob("*.py"))
    variables = set(re.findall(r"\b(DSV4_MLA_[A-Z_]+)", text))
    assert {"DSV4_MLA_ENGINE_KERNELS", "DSV4_MLA_REQUIRE_AOT", "DSV4_MLA_AOT_DIR", "DSV4_MLA_CACHE_DIR"} <= variables
    for variable in variables:
        assert f'"{variable}"' in code, variable  # read from the environment under that name


@functools.lru_cache(maxsize=None)
def _selftest_help() -> str:
    done = _run("dsv4-mla-selftest --help")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_selftest_calls_of_the_pages_name_real_models_degrees_and_options():
    from dispatch.policy.registry import MODELS

    calls = []
    for page in PAGES:
        calls += [(page.name, c) for c in re.findall(r"dsv4-mla-selftest((?: --?[\w.-]+(?: [\w./-]+)?)+)",
                                                     page.read_text())]
    assert len(calls) >= 4
    for page, args in calls:
        for option in re.findall(r"(--[a-z-]+)", args):
            assert option in _selftest_help(), (page, option)
        model = re.search(r"--model ([\w.-]+)", args)
        tp = re.search(r"--tp (\d+)", args)
        if model:
            assert model.group(1) in MODELS, (page, args)
            if tp:
                assert int(tp.group(1)) in MODELS[model.group(1)].tps, (page, args)
    for name in MODELS:  # the README lists every model the self-test takes, and the guide routes each
        assert f"`{name}`" in README.read_text() and f"`{name}`" in GUIDE.read_text(), name


def _flat(page: Path) -> str:
    """The page's text with its line breaks and backticks gone (a quote may wrap)."""
    return " ".join(page.read_text().replace("`", "").split())


def test_the_guide_quotes_the_plugins_and_the_loader(monkeypatch, caplog):
    from cute_kernels.arch import SUPPORTED_ARCHS
    from dispatch import adapters, engine_plugins
    from dispatch.runtime import loader

    guide = _flat(GUIDE)
    for logger in (engine_plugins.VLLM_LOG, engine_plugins.SGLANG_LOG, loader.log):
        assert f"logger {logger.name}" in guide.lower(), logger.name
    assert engine_plugins.SGLANG_TARGET in guide
    assert ".".join(engine_plugins.VLLM_BINDING) in guide and engine_plugins.VLLM_SHAPE_CHECK in guide
    plugins = (ROOT / "dispatch" / "engine_plugins.py").read_text()
    for replaced in ("dsv4-sparse-mla: vLLM %s: %s replaced by dispatch.adapters.trtllm_batch_decode_sparse_mla_dsv4",
                     "dsv4-sparse-mla: SGLang %s: %s replaced by dispatch.adapters.flash_mla_with_kvcache_sm120"):
        assert replaced in plugins  # the line the plugin logs ...
        assert replaced.split(" %s:")[0] in guide and replaced.split("%s ")[-1] in guide  # ... as the guide quotes it
    # the other lines, as the plugin says them
    monkeypatch.setenv(engine_plugins.ENV, "1")
    with caplog.at_level("INFO", logger=engine_plugins.VLLM_LOG.name):
        assert not engine_plugins._wanted(engine_plugins.VLLM_LOG, "vLLM", lambda: (9, 0))
    assert "the GPU is sm_90, not sm_120 / sm_121: vLLM's kernels are left in place" in caplog.text
    assert "the GPU is sm_XY, not sm_120 / sm_121: vLLM's kernels are left in place" in guide
    moved = str(engine_plugins._missing(engine_plugins.VLLM_LOG, "vLLM", "vllm", "x"))
    assert moved.split(" has no")[0].rsplit(" ", 1)[0] + " X has no" in guide, moved
    monkeypatch.setenv(engine_plugins.ENV, "maybe")
    with pytest.raises(ValueError) as refused:
        engine_plugins.requested_mode()
    assert str(refused.value).startswith(f"{engine_plugins.ENV}='maybe': use 1 ")
    assert f"ValueError: {engine_plugins.ENV}='...': use 1 " in guide
    api = " ".join((ROOT / "dispatch" / "api.py").read_text().split())
    assert "is not a supported target; \" f\"supported: {', '.join(SUPPORTED_ARCHS)}\"" in api
    assert f"is not a supported target; supported: {', '.join(SUPPORTED_ARCHS)}" in guide
    for engine, version in (("vllm", "0.34.0"), ("sglang", "0.5.23")):
        assert engine_plugins.CHECKED[engine].startswith(version) and version in guide
    assert adapters.FLASHINFER_CHECKED in guide


def test_the_pages_quote_the_loaders_words(isolated_loader, monkeypatch, tmp_path, caplog):
    """The loader's lines the pages quote, as a server whose DSL has the cu13 libs says them of a
    wheel built beside cu12 only, and of a wheel without this GPU's arch."""
    import json

    from dispatch.policy.variant_space import variant_space
    from dispatch.runtime import fingerprint as fp

    loader = isolated_loader
    monkeypatch.setattr(fp, "dsl_libs", lambda: "cu13+cu12")  # the server's environment
    monkeypatch.setattr(loader, "compile_variant", lambda variant: f"compiled {variant.name}")
    monkeypatch.setattr(loader, "_store_on_disk", lambda compiled, variant, entry_dir: None)
    built, other_arch = (next(v for v in variant_space(arch) if v.kind == "partial") for arch in ("sm_120a", "sm_121a"))
    aot = tmp_path / "aot"
    aot.mkdir()
    entry = {"fingerprint": {**fp.fingerprint(built), "dsl_libs": "cu12"}, "object": "x.o", "object_sha256": "0" * 64}
    (aot / loader.MANIFEST).write_text(json.dumps({"format": loader.MANIFEST_FORMAT, "entries": {built.name: entry}}))
    loader.set_aot_dir(aot)
    with caplog.at_level("WARNING", logger=loader.log.name):
        for variant in (built, other_arch):
            assert loader.get_compiled(variant) == f"compiled {variant.name}"
    flavour = ("do not match this environment (built with nvidia-cutlass-dsl-libs-cu12, this environment has "
               "nvidia-cutlass-dsl-libs-cu13+cu12")
    no_arch = "(archs: sm_120a) has no entry for"
    for said in (flavour, no_arch):
        assert said in caplog.text, said
    assert flavour in _flat(GUIDE) and flavour in _flat(DEPLOYMENT) and no_arch in _flat(GUIDE)


def test_the_deployment_page_names_every_fingerprint_part():
    from dispatch.runtime import fingerprint

    text = DEPLOYMENT.read_text()
    for field in fingerprint.FIELDS:
        assert f"`{field}`" in text, field
    for source in fingerprint._SOURCES:
        assert f"`{source}" in text, source
    for flavour in ("cu12", "cu13"):
        assert flavour in text and flavour in README.read_text()


# ---------------------------------------------------------------------- the README's first screen
def test_the_readme_first_screen_says_what_ran_where_and_stays_short():
    text = README.read_text()
    assert len(text.encode()) < README_LIMIT, len(text.encode())
    first_screen = "\n".join(text.splitlines()[:45])
    for said in ("H200", "sm_120", "sm_121", "not yet", "dsv4-mla-selftest", "docs/engines.md",
                 "docs/deployment.md"):
        assert said in first_screen, said
    performance = " ".join(text.split("## Performance")[1].split("\n## ")[0].split())
    assert "H200" in performance and "Nothing has been measured on an SM120 GPU" in performance
    # CI runs the first ```bash block: the self-test block before it must not be one
    assert text.index("```bash") > text.index("## Build and test")


# ---------------------------------------------------------------------- links
def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", page.read_text(), re.M)}


def test_every_relative_link_resolves():
    for page in PAGES:
        text = page.read_text()
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            linked = page.parent / target if target else page
            assert linked.exists(), f"{page.name}: {target}"
            if anchor:
                assert anchor in _anchors(linked), f"{page.name}: {target}#{anchor}"
        for target in re.findall(r"`((?:docs|dispatch|tests|scripts|cute_kernels)/[\w/.-]+\.(?:md|py))`", text):
            assert (ROOT / target).exists(), f"{page.name}: {target}"
