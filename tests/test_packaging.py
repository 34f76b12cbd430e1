"""The project as users get it (CPU): the wheel, its prebuilt kernels, the commands, the tree.

- ``dsv4-mla-aot-build --wheel`` makes a wheel holding ``cute_kernels`` and ``dispatch`` only,
  with the main job's kernels; installed outside the source tree, it imports, its
  ``dsv4-mla-aot-build`` reports its own manifest (``--report``, no compile), both commands
  answer ``--help``, and with ``DSV4_MLA_REQUIRE_AOT=1`` every variant a deployment shape
  plans loads from its manifest with no compile.
- The README's two commands are what CI runs; shipped code imports neither ``tests`` nor
  ``scripts`` and nothing touches ``sys.path`` (nor ``site.addsitedir``); ``dispatch`` has no
  import cycle.
- The docs speak of the project only and the README stays short; their numbers agree with the
  tables they quote.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("cute_kernels", "dispatch")

_SERVE_REGISTRY = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import dispatch
    from dispatch.runtime import loader
    from cute_kernels.arch import arch_facts
    from dispatch.policy.registry import deployment_calls
    from dispatch.policy.selection import select_kernels
    from dispatch.policy.precision import precisions_for
    assert Path(dispatch.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), dispatch.__file__
    assert loader.require_aot()
    planned = set()
    for arch in ("sm_120a", "sm_121a"):
        for precision in precisions_for(arch):
            for md, sms in deployment_calls(precision, arch):  # each call's kernels, as a plan selects them
                chosen = select_kernels(md, arch, num_sms=sms, smem_per_sm=arch_facts(arch).smem_per_sm,
                                        precision=precision)
                planned.update(chosen.variants)
    for v in sorted(planned, key=lambda v: v.name):
        loader.get_compiled(v)  # MissingAotVariant if the wheel lacks it
    print(json.dumps({"planned": len(planned), **loader.stats}))
""")


def test_wheel_holds_the_library_and_serves_every_deployment_shape_without_compiling(deployment_build, tmp_path):
    out_dir, entries = deployment_build
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    env = {**os.environ, "PYTHONPATH": str(site), "DSV4_MLA_REQUIRE_AOT": "1",
           "DSV4_MLA_CACHE_DIR": str(tmp_path / "jit")}
    env.pop("DSV4_MLA_AOT_DIR", None)
    subprocess.run([sys.executable, "-m", "dispatch.tools.aot_build", "--out", str(out_dir), "--wheel", str(wheels)],
                   check=True, cwd=ROOT, capture_output=True)
    (wheel,) = wheels.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == set(LIBRARY), top
    objects = [n for n in names if n.startswith("dispatch/aot_data/") and n.endswith(".o")]
    assert len(objects) == len(entries) and "dispatch/aot_data/manifest.json" in names
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True)
    run = subprocess.run([sys.executable, "-c", _SERVE_REGISTRY, str(site)], env=env, cwd=tmp_path,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    stats = json.loads(run.stdout.strip().splitlines()[-1])
    assert stats["compiled"] == 0 and stats["disk_loaded"] == 0
    assert stats["aot_loaded"] == stats["planned"] == len(entries)
    for command in ("dsv4-mla-aot-build", "dsv4-mla-check-aot", "dsv4-mla-selftest"):
        helped = subprocess.run([str(site / "bin" / command), "--help"], env=env, cwd=tmp_path, capture_output=True,
                                text=True)
        assert helped.returncode == 0 and f"usage: {command}" in helped.stdout, helped.stderr[-2000:]
    # the installed command at work (no compile, no GPU): the report of the wheel's own manifest
    reported = subprocess.run([str(site / "bin" / "dsv4-mla-aot-build"), "--report", "--out",
                               str(site / "dispatch" / "aot_data")], env=env, cwd=tmp_path, capture_output=True,
                              text=True)
    assert reported.returncode == 0, reported.stderr[-2000:]
    for arch in sorted({e["fingerprint"]["arch"] for e in entries.values()}):
        count = sum(1 for e in entries.values() if e["fingerprint"]["arch"] == arch)
        assert f"{arch}: {count} variants; 0 spill; 0 over" in reported.stdout, reported.stdout[-2000:]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readme_commands():
    commands = _readme_commands()
    assert len(commands) == 3
    assert "dsv4-mla-aot-build --arch sm_120a --arch sm_121a" in commands[0]  # the main job
    assert "pytest" in commands[1]
    # then the same build and tests under the lowest nvidia-cutlass-dsl the package accepts
    lowest = re.search(r'"nvidia-cutlass-dsl>=([\d.]+),', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"'nvidia-cutlass-dsl=={lowest}'" in commands[2] and "dsv4-mla-aot-build" in commands[2] \
        and "pytest" in commands[2]
    assert not any("torch==" in c for c in commands)  # the user's own torch; CI pins its own
    ci = (ROOT / ".ci" / "run").read_text()
    assert "README.md" in ci and "bash -euxo pipefail -c" in ci  # .ci/run runs the README's block itself
    assert "pip install -q torch==" in ci


def _sources(*parts):
    for part in parts:
        yield from sorted((ROOT / part).rglob("*.py"))


def _import_path_uses(tree: ast.AST) -> list[int]:
    """The lines that touch the import path: any use of ``sys.path`` (``sys.path.insert``,
    ``sys.path += ...``, ``sys.path[:0] = ...``, ``sys.path = ...``, also through ``import sys
    as s``), ``from sys import path`` and ``site.addsitedir`` (attribute or import)."""
    modules = {"sys": {"sys"}, "site": {"site"}}  # the names each module is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    modules[a.name].add(a.asname or a.name)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (
                (node.value.id in modules["sys"] and node.attr == "path")
                or (node.value.id in modules["site"] and node.attr == "addsitedir")):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (
                (node.module == "sys" and any(a.name in ("path", "*") for a in node.names))
                or (node.module == "site" and any(a.name in ("addsitedir", "*") for a in node.names))):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("code", [
    "import sys\nsys.path.insert(0, 'x')", "import sys\nsys.path += ['x']", "import sys\nsys.path[:0] = ['x']",
    "import sys\nsys.path = ['x']", "from sys import path", "from sys import *", "import sys as s\ns.path.append('x')",
    "import site\nsite.addsitedir('x')", "from site import addsitedir",
])
def test_the_import_path_rule_catches_every_form(code):
    assert _import_path_uses(ast.parse(code)), code


def test_the_import_path_rule_passes_other_uses():
    assert not _import_path_uses(ast.parse("import sys, os.path\nsys.argv\nos.path.join('a')\nfrom sys import argv"))


def test_shipped_code_imports_neither_tests_nor_scripts_and_nothing_edits_sys_path():
    for path in _sources(*LIBRARY, "scripts", "tests"):
        tree = ast.parse(path.read_text())
        lines = _import_path_uses(tree)
        assert not lines, f"{path}:{lines} touches the import path (sys.path / site.addsitedir)"
        if path.parts[len(ROOT.parts)] in LIBRARY:
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n.split(".")[0] in ("tests", "scripts") for n in names), (path, names)


def _module_name(path: Path) -> str:
    """The dotted name of a source file (a package's ``__init__.py`` is the package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _internal_imports(folder: str) -> dict:
    """module -> the modules of the package in ``folder`` it imports (anywhere in its code),
    by dotted name; ``from package import name`` counts the submodule ``name`` where there is
    one, else the package."""
    paths = list(_sources(folder))
    modules = {_module_name(p) for p in paths}
    graph = {}
    for path in paths:
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):  # import dispatch.runtime.plan: the module and its packages
                for a in node.names:
                    parts = a.name.split(".")
                    deps.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
                continue
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                deps.add(sub if sub in modules else target)
        graph[name] = {d for d in deps if d in modules} - {name}
    return graph


def test_no_import_cycle_in_dispatch_or_the_kernels():
    for folder in ("dispatch", "cute_kernels/sparse_mla_decode"):
        graph = _internal_imports(folder)
        done, path = set(), []

        def visit(m):
            assert m not in path, f"import cycle in {folder}: {' -> '.join(path[path.index(m):] + [m])}"
            if m in done:
                return
            path.append(m)
            for d in sorted(graph[m]):
                visit(d)
            path.pop()
            done.add(m)

        for m in sorted(graph):
            visit(m)


# dispatch's wings, lowest first: a module imports only from its own wing and those below it.
# "" is the public surface, the modules directly in dispatch/ (the API, kv_formats, the torch op)
# and the package itself; "engines" the engines' call shapes and plugins, above it.
DISPATCH_WINGS = ("policy", "runtime", "", "engines", "tools")


def _wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in DISPATCH_WINGS) else ""


def _upward_imports(graph: dict) -> list:
    """(module, its wing, the modules it imports from a wing above its own)."""
    found = []
    for module, deps in sorted(graph.items()):
        rank = DISPATCH_WINGS.index(_wing(module))
        upward = sorted(d for d in deps if DISPATCH_WINGS.index(_wing(d)) > rank)
        if upward:
            found.append((module, _wing(module), upward))
    return found


def test_dispatch_wings_import_downward_only():
    graph = _internal_imports("dispatch")
    wings = {_wing(m) for m in graph}
    assert wings == set(DISPATCH_WINGS), f"dispatch/ has wings {sorted(wings)}; DISPATCH_WINGS names {DISPATCH_WINGS}"
    assert graph["dispatch.api"] >= {"dispatch.runtime.plan", "dispatch.policy.selection"}  # the graph is read
    for module, wing, upward in _upward_imports(graph):
        raise AssertionError(f"{module} (wing {wing!r}) imports {upward} from a wing above it")


def test_the_wing_rule_catches_an_upward_import(tmp_path, monkeypatch):
    """The rule on a made-up package: policy importing the runtime (relative) and the package
    itself (absolute: its __init__ is the public surface) are both found."""
    pkg = tmp_path / "dispatch"
    files = {"policy/__init__.py": "", "policy/mod.py": "from ..runtime.plan import x\nfrom dispatch import api\n",
             "policy/other.py": "def f():\n    import dispatch.tools.cli\n",
             "runtime/__init__.py": "", "runtime/plan.py": "from ..policy import mod\n", "__init__.py": "",
             "api.py": "from .runtime import plan\n", "tools/__init__.py": "", "tools/cli.py": "from .. import api\n"}
    for name, body in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(body)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = _internal_imports("dispatch")
    assert graph["dispatch.runtime.plan"] == {"dispatch.policy.mod"} and graph["dispatch.tools.cli"] == {"dispatch.api"}
    assert _upward_imports(graph) == [("dispatch.policy.mod", "policy", ["dispatch.api", "dispatch.runtime.plan"]),
                                      ("dispatch.policy.other", "policy", ["dispatch", "dispatch.tools",
                                                                           "dispatch.tools.cli"])]


# ---------------------------------------------------------------------- the docs' numbers
def _bench_flashmla_us() -> dict:
    """``FLASHMLA_US`` of scripts/bench.py, read without importing the script."""
    tree = ast.parse((ROOT / "scripts" / "bench.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FLASHMLA_US" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("no FLASHMLA_US in scripts/bench.py")


def _h200_results() -> list[dict]:
    """The rows of the H200 results table of docs/performance.md."""
    text = (ROOT / "docs" / "performance.md").read_text()
    section = text.split("<!-- BEGIN H200 RESULTS")[1].split("<!-- END H200 RESULTS")[0]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    head, *lines = block.splitlines()
    rows = []
    for line in lines:
        T, H, shape, us, *_, torch_us, x_torch, flashmla_us, x_flashmla = line.split()
        rows.append(dict(T=int(T), H=int(H), shape=shape, us=float(us), x_torch=float(x_torch),
                         flashmla_us=float(flashmla_us), x_flashmla=float(x_flashmla)))
    return rows


def test_the_flashmla_times_are_the_bench_table():
    bench = _bench_flashmla_us()
    text = (ROOT / "docs" / "performance.md").read_text()
    peer = text.split("FlashMLA SM90 on the H200")[1].split("<!-- BEGIN")[0]
    quoted = {}
    for line in peer.splitlines():
        if re.match(r"\| \d", line):
            T, H, *times = (c.strip() for c in line.strip().strip("|").split("|"))
            quoted.update({(int(T), int(H), shape): float(us) for shape, us in zip(("128", "512", "1024", "128+512"),
                                                                                   times)})
    assert quoted == bench
    rows = _h200_results()
    assert len(rows) == 48 and {(r["T"], r["H"], r["shape"]): r["flashmla_us"] for r in rows} == bench


def test_the_docs_summaries_match_the_results_table():
    rows = _h200_results()
    faster = sum(1 for r in rows if r["x_flashmla"] >= 1.0)
    performance = (ROOT / "docs" / "performance.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert f"faster on {faster} of the {len(rows)} shapes" in performance
    assert f"Faster on {faster} of {len(rows)} shapes" in readme
    assert f"at least {min(r['x_torch'] for r in rows)}x faster than the float32 torch reference" in performance
    by_shape = {(r["T"], r["H"], r["shape"]): r for r in rows}
    for line in readme.splitlines():  # the README's excerpt of the table
        cells = re.match(r"\| (\d+) x (\d+) \|(.*)\|$", line)
        if cells:
            T, H = int(cells.group(1)), int(cells.group(2))
            for shape, cell in zip(("128", "1024", "128+512"), cells.group(3).split("|")):
                r = by_shape[(T, H, shape)]
                assert cell.strip() == f"{r['us']} ({r['x_flashmla']:.2f}x)", (T, H, shape, cell)


def _markdown_rows(section: str) -> list[list[str]]:
    """The cells of the rows of the markdown tables in ``section`` that start with a number."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if re.match(r"\| \d", line)]


def _rounding(ratio: float, *times: str) -> float:
    """How far a ratio of times printed to one decimal can be from the ratio of the printed
    times: each time up to 0.05 off, the ratio printed to two decimals."""
    return ratio * sum(0.05 / float(t) for t in times) + 0.005


def _span(values, fmt: str = ".2f") -> str:
    """``values``' range as the docs write it: "0.52-0.81"."""
    return f"{min(values):{fmt}}-{max(values):{fmt}}"


def test_the_side_by_side_table_is_consistent():
    bench = _bench_flashmla_us()
    text = (ROOT / "docs" / "performance.md").read_text()
    section = text.split("### Side by side with FlashMLA, in one process")[1].split("### ")[0]
    prose = " ".join(section.split())
    rows = []
    for T, H, shape, g_this, g_fm, g_ratio, f_this, f_fm, f_ratio in _markdown_rows(section):
        for method, this, fm, ratio in (("graph", g_this, g_fm, g_ratio), ("flush", f_this, f_fm, f_ratio)):
            assert abs(float(fm) / float(this) - float(ratio)) <= _rounding(float(ratio), this, fm), (T, H, shape,
                                                                                                  method)
        rows.append(dict(T=int(T), H=int(H), shape=shape, graph=float(g_ratio), flush=float(f_ratio),
                         fm_flush=float(f_fm)))
    assert len(rows) == 60  # the 48 bench shapes and 12 prefill-sized ones
    grid = [r for r in rows if r["T"] <= 256]
    assert len(grid) == 48
    for method, stated in (("graph", "1.290"), ("flush", "1.257")):
        assert f"{math.exp(sum(math.log(r[method]) for r in grid) / 48):.3f}" == stated, method
        assert f"{stated} ({method})" in prose
    vs_table = [r["fm_flush"] / bench[(r["T"], r["H"], r["shape"])] for r in grid]
    assert f"are {_span(vs_table)}x its `FLASHMLA_US` ones" in prose
    assert f"with 16 heads ({_span([x for r in rows if r['H'] == 16 for x in (r['graph'], r['flush'])])}x)" in prose
    assert f"one token ({min(x for r in rows if r['T'] == 1 for x in (r['graph'], r['flush'])):.2f}x and more)" in prose
    many = [x for r in rows if r["T"] >= 64 and r["H"] == 128 for x in (r["graph"], r["flush"])]
    wide = [x for r in rows if r["T"] >= 256 and r["H"] == 64 for x in (r["graph"], r["flush"])]
    assert f"T >= 64 and H = 128 ({_span(many)}x)" in prose and f"T >= 256 and H = 64 ({_span(wide)}x)" in prose
    slower_both = {(r["T"], r["H"], r["shape"]) for r in rows if r["graph"] < 1 and r["flush"] < 1}
    assert slower_both == {(r["T"], r["H"], r["shape"]) for r in rows if (r["T"] >= 64 and r["H"] == 128) or
                           (r["T"] >= 256 and r["H"] == 64) or (r["T"], r["H"], r["shape"]) == (8, 128, "1024")}
    assert {(r["T"], r["H"], r["shape"]) for r in rows if (r["graph"] < 1) != (r["flush"] < 1)} == {
        (64, 64, "128"), (8, 128, "128+512")}


def test_the_loop_ceilings_table_is_consistent():
    bench = _bench_flashmla_us()
    text = (ROOT / "docs" / "performance.md").read_text()
    section = text.split("`python -m scripts.loop_ceilings` times")[1].split("### ")[0]
    table, prose = section.split("At the dispatch's")
    prose = " ".join(prose.split())
    rows = []
    for T, H, shape, *us, fm in _markdown_rows(table):
        assert float(fm) == bench[(int(T), int(H), shape)]
        rows.append(dict(T=int(T), H=int(H), fm=float(fm), **dict(zip(
            ("shipped", "no_sm", "no_cvt", "shipped_one", "no_sm_one", "no_bar_one"), map(float, us)))))
    assert len(rows) == 16
    softmax = [100 * (1 - r["no_sm"] / r["shipped"]) for r in rows]
    conversions = [100 * (1 - r["no_cvt"] / r["no_sm"]) for r in rows]
    assert f"softmax takes {_span(softmax, '.0f')}% of these calls" in prose
    assert f"once it is gone, {_span(conversions, '.0f')}%" in prose
    assert f"only {_span([r['fm'] / r['no_sm'] for r in rows if r['H'] == 128])}x FlashMLA at 128 heads" in prose
    assert f"{_span([r['fm'] / r['no_sm'] for r in rows if (r['T'], r['H']) == (256, 64)])}x at 256 x 64" in prose
    assert f"takes {_span([r['shipped_one'] / r['shipped'] for r in rows])}x its two-per-SM time" in prose
    assert f"leaves {_span([r['no_bar_one'] / r['shipped_one'] for r in rows])}x of it" in prose
    assert f"({_span([r['no_bar_one'] / r['shipped'] for r in rows])}x its time)" in prose


def test_every_tuning_anchor_has_its_entry():
    tuning = (ROOT / "cute_kernels" / "sparse_mla_decode" / "tuning.py").read_text()
    headings = set(re.findall(r"^### (\S+)$", (ROOT / "docs" / "tuning.md").read_text(), re.M))
    anchors = set(re.findall(r"#.*\[([a-z0-9_]+)\]\s*$", tuning, re.M))
    assert anchors and anchors <= headings, sorted(anchors - headings)


# ---------------------------------------------------------------------- the public names
PUBLIC_NAMES = {
    "dispatch": ("sparse_mla_decode", "plan_sparse_mla_decode", "validate_call", "DecodeMetadata",
                 "InvalidDecodeInput", "PlanOverrides", "clear_plan_cache", "plan_cache_info", "MissingAotVariant",
                 "LSE_CONVENTIONS", "convert_lse"),
    "dispatch.kv_formats": ("FORMATS", "DEFAULT_FORMAT", "EXTRA_FORMATS", "KvFormat", "get_format", "writers", "pack",
                            "unpack"),
    "dispatch.engines.flashmla": ("flash_mla_with_kvcache", "flash_mla_with_kvcache_sm120"),
    "dispatch.engines.flashinfer_dsv4": ("trtllm_batch_decode_sparse_mla_dsv4", "DSV4_KV_CACHE_FORMATS"),
    "dispatch.engines.flashinfer_mla": ("trtllm_batch_decode_with_kv_cache_mla",),
    "dispatch.engines.vllm_plugin": ("register",),
    "dispatch.engines.sglang_plugin": ("register",),
    "dispatch.engines.status": ("main",),
    "dispatch.tools.sample_inputs": ("make_cache", "make_indices"),
    "cute_kernels.sparse_mla_decode.reference": ("reference_decode",),
    "cute_kernels.sparse_mla_decode.cache_writers": ("pack_latent",),
}


def test_every_public_name_still_imports():
    """The names users and engines import, the torch op, and every console command and engine
    entry point of pyproject.toml resolve (whatever moved inside ``dispatch/``)."""
    import importlib

    import torch

    for module, names in PUBLIC_NAMES.items():
        imported = importlib.import_module(module)
        missing = [n for n in names if not hasattr(imported, n)]
        assert not missing, f"{module} lacks {missing}"
    assert callable(torch.ops.dsv4_mla.sparse_mla_decode)
    text = (ROOT / "pyproject.toml").read_text()
    targets = re.findall(r'^[\w-]+ = "([\w.]+):(\w+)"$', text, re.M)
    assert len(targets) == 6, targets  # four commands, two engine plugins
    for module, attr in targets:
        assert callable(getattr(importlib.import_module(module), attr)), (module, attr)


def test_the_hopper_route_table_is_the_policys():
    """docs/performance.md's table of the Hopper route is the policy's own rows
    (``sm90_policy.EVIDENCE``, one source), with where they were measured."""
    from dispatch.policy.sm90_policy import EVIDENCE, EVIDENCE_SOURCE
    from dispatch.tools.sm90_route_table import evidence_markdown

    section = (ROOT / "docs" / "performance.md").read_text().split("## The Hopper route (sm_90)")[1].split("\n## ")[0]
    assert EVIDENCE and evidence_markdown(EVIDENCE) in section and EVIDENCE_SOURCE in " ".join(section.split())
