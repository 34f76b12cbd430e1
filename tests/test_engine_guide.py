"""The user's first pages against the code (CPU): every command of docs/engines.md and
docs/deployment.md that runs without a GPU (their ```shell blocks) runs and prints what the
page says; the names the pages tell users to type (console commands, options, environment
variables, self-test models and options, loggers, log lines, the names the engine plugins
patch, fingerprint parts) exist in the code; the README's first screen says what ran where and
stays short; every relative link of README.md and docs/ points to a file and, with an anchor,
to a heading of it."""

from __future__ import annotations

import ast
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


def _engines_route(gpu: str) -> str:
    """What ``DSV4_MLA_ENGINE_KERNELS=1 dsv4-mla-engines --gpu GPU`` says the route is."""
    from dispatch.engines import plugin_mode, status

    cap = status.GPU_CHOICES[gpu]
    family = None if cap is None else plugin_mode.FAMILY_BY_MAJOR.get(cap[0])
    return ("route: " + plugin_mode.DESCRIBED[family] if family is not None
            else "route: none (nothing is patched on this GPU with this setting)")


def _expected_output(command: str) -> list[str]:
    """What the page says ``command`` prints (substrings of its output)."""
    from dispatch.engines import status
    from dispatch.runtime import fingerprint

    if "entry_points" in command:
        return ([target for _, target in status.ENTRY_POINTS.values()] if _installed() else ["[]"])
    if "fingerprint" in command:
        return [fingerprint.dsl_version(), fingerprint.dsl_libs(), fingerprint.PROJECT_VERSION,
                fingerprint.source_hash()]
    engines = re.fullmatch(r"DSV4_MLA_ENGINE_KERNELS=1 dsv4-mla-engines --gpu (\S+)", command.strip())
    if engines:
        gpu = engines.group(1)
        return [f"GPU: {gpu} (--gpu); mode: auto", _engines_route(gpu)] + (["route table:"] if gpu == "sm_90" else [])
    helped = re.fullmatch(r"(dsv4-mla-[a-z-]+|python -m [\w.]+) --help", command.strip())
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
    if "dsv4-mla-engines --gpu" in command or "entry_points" in command:  # ... and the page says so
        for expected in _expected_output(command)[1 if "--gpu" in command else 0:]:
            assert expected in _flat(GUIDE) or expected == "[]", f"{page} does not say {command} prints {expected!r}"


# ---------------------------------------------------------------------- names the pages give
def _pages_text() -> str:
    return "\n".join(p.read_text() for p in [README, GUIDE, DEPLOYMENT])


def test_the_commands_and_variables_the_pages_name_exist():
    text = _pages_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    for command in set(re.findall(r"\b(dsv4-mla-[a-z-]+)", text)):
        assert f"{command} = " in pyproject, command
    code = "\n".join(p.read_text() for p in (ROOT / "dispatch").rglob("*.py"))
    variables = set(re.findall(r"\b(DSV4_MLA_[A-Z0-9_]+)", text))
    assert {"DSV4_MLA_ENGINE_KERNELS", "DSV4_MLA_REQUIRE_AOT", "DSV4_MLA_AOT_DIR", "DSV4_MLA_CACHE_DIR"} <= variables
    for variable in variables:
        assert f'"{variable}"' in code, variable  # read from the environment under that name


def test_the_engine_tools_the_guide_names_take_its_options():
    from dispatch.engines import status

    text = GUIDE.read_text()
    listed = re.search(r"\(`--gpu (.*?) shows", text, re.S)  # the values the guide lists, then those it runs
    assert listed, "the guide lists the values of dsv4-mla-engines --gpu"
    gpus = re.findall(r"(sm_\d+|none)`", listed.group(1)) + re.findall(r"dsv4-mla-engines --gpu (\S+)", text)
    assert set(gpus) == set(status.GPU_CHOICES), gpus
    calls = re.findall(r"python -m (dispatch\.tools\.[\w.]+)((?: --?[\w-]+(?: [^\s-][^\s]*)?)*)", text)
    assert calls
    for module, args in calls:
        done = _run(f"python -m {module} --help")
        assert done.returncode == 0, done.stderr[-2000:]
        for option in re.findall(r"(--[a-z-]+)", args):
            assert option in done.stdout, (module, option)


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


PREFIX = "dsv4-sparse-mla: "


def _plugin_log_formats() -> set[str]:
    """Every format string the engine plugins log (``dispatch/engines/``), read from the source:
    a logger call's first argument, or the message a route passes to its ``tell``, which adds the
    prefix. The bare ``PREFIX + "%s"`` (an exception's text, quoted by the guide as the error) is
    left out."""
    formats = set()
    for path in sorted((ROOT / "dispatch" / "engines").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("debug", "info", "warning", "error", "exception"):
                given = node.args[0] if node.args else None
                prefix = ""
            elif isinstance(func, ast.Name) and func.id == "tell":
                given = node.args[1] if len(node.args) > 1 else None
                prefix = PREFIX
            else:
                continue
            if isinstance(given, ast.Constant) and isinstance(given.value, str):
                formats.add(prefix + given.value)
    return {f for f in formats if f.startswith(PREFIX) and f != PREFIX + "%s"}


def test_the_guide_quotes_every_log_line_of_the_plugins_as_the_code_writes_it():
    code = _plugin_log_formats()
    quoted = set(re.findall(r"`(" + re.escape(PREFIX) + r"[^`]+)`", GUIDE.read_text()))
    assert len(code) >= 8, code
    assert quoted == code, f"quoted, not logged: {sorted(quoted - code)}; logged, not quoted: {sorted(code - quoted)}"


def test_the_guide_names_what_the_plugins_patch_and_say(monkeypatch, tmp_path):
    from dispatch.engines import flashinfer_dsv4, plugin_mode, sglang_plugin, vllm_plugin
    from dispatch.policy import sm90_policy
    from dispatch.runtime import loader

    guide = _flat(GUIDE)
    for logger in (vllm_plugin.LOG, sglang_plugin.LOG, loader.log):
        assert f"logger {logger.name}" in guide.lower(), logger.name
    # every engine name the plugins patch or hook, on each GPU family
    patched = [f"{vllm_plugin.FLASHINFER_BINDINGS}.{name}" for name, _, _ in vllm_plugin.SM120_BINDINGS]
    patched += [f"{vllm_plugin.FLASHINFER_BINDINGS}.{vllm_plugin.SM120_SHAPE_CHECK}", ".".join(vllm_plugin.SM90_FLASHMLA)]
    patched += [f"{m}.{c}.{f}" for m, c, f, *_ in vllm_plugin.SM90_SITES]
    patched += [sglang_plugin.SM120_TARGET, sglang_plugin.SM120_GLM_TARGET, sglang_plugin.SM90_TARGET]
    patched += [path for path, *_ in sglang_plugin.SITE_HOOKS]
    for name in patched:
        assert name in guide, name
    # what fills the lines' %s: the first-call texts and SGLang's two descriptions
    source = (ROOT / "dispatch" / "engines" / "sglang_plugin.py").read_text()
    for name, target, _ in vllm_plugin.SM120_BINDINGS:
        assert f"vLLM's {name} served by dispatch.engines.{target}" in guide, name
    for said in ("SGLang's flash_mla_with_kvcache_sm120 served by dispatch.engines.flashmla",
                 "SGLang's flashinfer_sparse_mla_forward served by dispatch.engines.flashinfer_mla",
                 "DeepSeek-V4 / V4.1 and GLM-5 decode now call this library",
                 "routed per shape between this library and FlashMLA"):
        assert said in source and said in guide, said
    # the refusals, as the code words them
    monkeypatch.setenv(plugin_mode.ENV, "2")
    with pytest.raises(ValueError) as refused:
        plugin_mode.requested_mode()
    assert f"ValueError: {refused.value}" in guide, str(refused.value)
    moved = str(plugin_mode.missing(vllm_plugin.LOG, "vLLM", "vllm", "x"))
    assert moved.split(" has no")[0].rsplit(" ", 1)[0] + " X has no" in guide, moved
    bad = tmp_path / "FILE"
    bad.write_text("{}")
    with pytest.raises(ValueError) as not_a_table:
        sm90_policy.load_table(bad)
    said = str(not_a_table.value).split(" (")[0].replace(str(bad), "FILE")
    assert f"ValueError: {said} (" in guide, said
    # the releases the plugins and call shapes were checked against
    for engine, version in (("vllm", "0.34.0"), ("sglang", "0.5.23")):
        assert plugin_mode.CHECKED[engine].startswith(version) and version in guide
    assert flashinfer_dsv4.FLASHINFER_CHECKED in guide


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
