"""The engine plugins against the released engines (CPU): vLLM 0.34.0 and SGLang 0.5.23 load this
package's plugin through their own plugin loaders on each GPU family, and their own call sites,
run with CPU tensors, reach this library (refused at the device check: "the kernels run on CUDA
devices only") or the engine's own kernel; the keywords each call site passes (read from the
engine's source) are parameters of what it now reaches; FlashInfer 0.7.4's and 0.7.2's
signatures are the call shapes'. ``tests/test_engine_plugins.py`` checks the plugins' own logic
against stand-in engines, everywhere.

The wheels: ``DSV4_MLA_ENGINE_WHEELS`` names a folder holding them, in it or in any folder below
it, as ``pip download --no-deps`` leaves them::

    pip download --no-deps -d "$DIR" vllm==0.34.0 sglang==0.5.23 flashinfer-python==0.7.4 sgl-flash-mla==1.0.0
    pip download --no-deps -d "$DIR/fi072" flashinfer-python==0.7.2

Unset, the module is skipped; a wheel absent, the tests that need it skip, naming it
(``sgl-flash-mla``, which SGLang requires, for SGLang's Hopper tests and the sm_90 command).

How they run. Each wheel (but its compiled libraries, which need CUDA) is unpacked once
into pytest's cache (``.pytest_cache/d/dsv4-engine-wheels``). Each engine and GPU family runs in a
process of its own, ``tests/engine_probe.py`` (the engines' imports and the plugins' patches never
reach this process), with the engine ahead of the environment on ``PYTHONPATH``,
``DSV4_MLA_ENGINE_KERNELS=1`` and the GPU faked where the plugin reads it (vLLM's
``current_platform.get_device_capability``, this package's ``plugin_mode.gpu_capability`` for
SGLang). The environment running pytest must have this package installed (its entry points are
what the engines' loaders find) and the engines' pure-Python dependencies: one missing skips that
engine's tests, naming it. Two compiled libraries that cannot load without CUDA have stand-ins in
the probe (its docstring): torchvision's operator schemas, and the extension loader of
``flash_mla`` (sgl-flash-mla's own Python is what SGLang imports). The engines' call sites and
FlashInfer's signatures are read with ``ast`` from the wheels, in this process.

What vLLM 0.34 picks for DeepSeek-V4 / V4.1 (``_select_dsv4_attn_cls``), as asserted below: on 12.x
``DeepseekV4FlashInferSM120Attention`` (the class whose FlashInfer calls the plugin takes);
on 8.x, 9.x and 10.x ``DeepseekV4FlashMLAAttention``, and with ``--attention-backend
FLASHINFER_MLA_SPARSE_DSV4`` ``DeepseekV4FlashInferMLAAttention`` (storage-offset indices, which
this library does not read: the plugin leaves its binding alone there). V4.1 on 10.x takes
``DeepseekV4MegaAttnAttention`` only where vLLM's FlashMLA build has the mega-attention ops
(``is_available_for``); without them, as here, ``DeepseekV4FlashMLAAttention``.
"""

from __future__ import annotations

import ast
import concurrent.futures
import inspect
import json
import os
import re
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from dispatch.engines import flashinfer_dsv4, flashinfer_mla, flashmla, sglang_plugin, sm90_route, vllm_plugin
from dispatch.engines.plugin_mode import ENV
from dispatch.policy import sm90_policy
from tests.engine_probe import vllm_names

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "engine_probe.py"
WHEELS_ENV = "DSV4_MLA_ENGINE_WHEELS"
WHEELS = {"vllm": "vllm-0.34.0-*.whl", "sglang": "sglang-0.5.23-*.whl",
          "flashinfer 0.7.4": "flashinfer_python-0.7.4-*.whl", "flashinfer 0.7.2": "flashinfer_python-0.7.2-*.whl",
          "sgl-flash-mla": "sgl_flash_mla-1.0.0-*.whl"}
# what is not unpacked: compiled libraries (none loads without CUDA; SGLang wants its kernel
# sources and headers present, which it compiles at run time)
COMPILED = {".so", ".a", ".o", ".cubin", ".fatbin"}
LARGEST_UNPACKED = 16 << 20  # bytes (vLLM's wheel carries a 64 MB executable without a suffix)
DEVICE_REFUSAL = "the kernels run on CUDA devices only"
FLASHINFER_CORE = "flashinfer/mla/_core.py"
NO_DEFAULT = "<no default>"

# the route table the Hopper probes run with: this library up to 8 tokens, FlashMLA from 64, at
# 16 real heads, for the entries of each probe call (V4 / V4.1 in vLLM: 128 + 128, SGLang's V4:
# 128 + 512; V3.2: 2048); the probes call at 4 and 64 tokens
ROUTE_ROWS = tuple(sm90_policy.RouteRow(family, 16, tokens, entries, 10.0 if tokens <= 8 else 30.0, 20.0)
                   for family, entries in (("model1", 256), ("model1", 640), ("v32", 2048)) for tokens in (8, 64))
LIBRARY_TOKENS, FLASHMLA_TOKENS = 4, 64

pytestmark = pytest.mark.skipif(not os.environ.get(WHEELS_ENV), reason=f"{WHEELS_ENV} is not set: it names the "
                                "folder of the engines' wheels (module docstring)")


# ---------------------------------------------------------------------- the wheels
class EngineWheels:
    """The wheels in ``DSV4_MLA_ENGINE_WHEELS``: found by name, read in place, unpacked once."""

    def __init__(self, folder: Path, cache: Path):
        self.folder, self.cache = folder, cache
        self.lock = threading.Lock()  # the probes unpack from two threads

    def path(self, key: str) -> Path:
        found = sorted(self.folder.rglob(WHEELS[key]))
        if not found:
            pytest.skip(f"no {WHEELS[key]} in {WHEELS_ENV}={self.folder} (module docstring: pip download --no-deps)")
        return found[0]

    def source(self, key: str, member: str) -> str:
        with zipfile.ZipFile(self.path(key)) as wheel:
            return wheel.read(member).decode()

    def root(self, key: str) -> Path:
        """The wheel unpacked but its compiled libraries (once per wheel file: its name and size)."""
        wheel = self.path(key)
        target = self.cache / f"{wheel.stem}-{wheel.stat().st_size}"
        done = target / ".unpacked"
        with self.lock:
            if not done.exists():
                with zipfile.ZipFile(wheel) as archive:
                    for info in archive.infolist():
                        if not (info.is_dir() or Path(info.filename).suffix in COMPILED
                                or info.file_size > LARGEST_UNPACKED):
                            archive.extract(info, target)
                done.write_text(wheel.name)
        return target


@pytest.fixture(scope="session")
def wheels(request, tmp_path_factory) -> EngineWheels:
    folder = Path(os.environ[WHEELS_ENV])
    if not folder.is_dir():
        pytest.fail(f"{WHEELS_ENV}={folder} is not a folder")
    cache = getattr(request.config, "cache", None)
    return EngineWheels(folder, cache.mkdir("dsv4-engine-wheels") if cache is not None
                        else tmp_path_factory.mktemp("engine-wheels"))


@pytest.fixture(scope="session")
def route_table(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("route") / "route.json"
    path.write_text(sm90_policy.to_json(ROUTE_ROWS, "tests/test_real_engines.py"))
    return path


# the probe processes (tests/engine_probe.py): key -> (the wheels on PYTHONPATH, its arguments)
PROBES = {
    "vllm 12": (("vllm",), ("vllm", "--gpu", "12.0")),
    "vllm 9": (("vllm",), ("vllm", "--gpu", "9.0")),
    "vllm 8 10": (("vllm",), ("vllm", "--gpu", "8.0", "--gpu", "10.0", "--attention-classes")),
    "sglang 12": (("sglang",), ("sglang", "--gpu", "12.0")),
    "sglang 9": (("sglang", "sgl-flash-mla"), ("sglang", "--gpu", "9.0", "--flash-mla")),
    "status sm_120": (("vllm", "sglang"), ("status", "--", "--gpu", "sm_120")),
    "status sm_90": (("vllm", "sglang", "sgl-flash-mla"), ("status", "--flash-mla", "--", "--gpu", "sm_90")),
}
CONCURRENT_PROBES = 2


def uses(*keys: str):
    """Mark a test as reading these probes (started, two at a time, when the session's first
    probe is asked for)."""
    def mark(test):
        test.probes = keys
        return test

    return mark


class Probes:
    """The probe processes of the selected tests: each run once, its JSON (or, for ``status``,
    its completed process) shared."""

    def __init__(self, wheels: EngineWheels, route_table: Path, scratch: Path, wanted):
        self.wheels, self.route_table, self.scratch, self.wanted = wheels, route_table, scratch, wanted
        self.pool = concurrent.futures.ThreadPoolExecutor(CONCURRENT_PROBES)
        self.futures: dict[str, concurrent.futures.Future] = {}
        self.lock = threading.Lock()

    def __call__(self, key: str):
        with self.lock:
            for wanted in [key, *self.wanted]:
                if wanted not in self.futures:
                    self.futures[wanted] = self.pool.submit(self._run, wanted)
        return self.futures[key].result()

    def _run(self, key: str):
        engines, args = PROBES[key]
        roots = [self.wheels.root(engine) for engine in engines]
        args, out = list(args), self.scratch / (key.replace(" ", "-") + ".json")
        args[1:1] = ["--out", str(out)]
        env = {**os.environ, ENV: "1", sm90_route.ROUTE_TABLE_ENV: str(self.route_table),
               "PYTHONPATH": os.pathsep.join([*map(str, roots), str(ROOT), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, str(PROBE), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)
        seen = json.loads(out.read_text()) if out.exists() else {}
        if "missing_package" in seen:
            pytest.skip(f"{', '.join(engines)}: a module needs a package this environment lacks: "
                        f"{seen['missing_package']}")
        if done.returncode != 0:
            pytest.fail(f"{PROBE.name} {' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                        f"{done.stderr[-6000:]}")
        if not seen["entry_point"]:
            pytest.skip(f"dsv4-sparse-mla is not installed in this environment ({sys.executable}): the engines' "
                        f"plugin loaders find no dsv4_sparse_mla entry point (pip install -e .)")
        return done if args[0] == "status" else seen


@pytest.fixture(scope="session")
def probe(request, wheels, route_table, tmp_path_factory):
    """``probe(key)``: what the probe process ``PROBES[key]`` saw."""
    wanted = dict.fromkeys(key for item in request.session.items
                           for key in getattr(getattr(item, "function", None), "probes", ()))
    probes = Probes(wheels, route_table, tmp_path_factory.mktemp("probes"), wanted)
    yield probes
    probes.pool.shutdown(cancel_futures=True)


# ---------------------------------------------------------------------- reading the engines' source
def _tree(wheels, key: str, member: str) -> ast.Module:
    return ast.parse(wheels.source(key, member))


def _function(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    """The function at ``qualname`` ("f" or "Class.method") of a module's tree."""
    body = tree.body
    *classes, name = qualname.split(".")
    for cls in classes:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    found = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"no {qualname} in the engine's source"
    return found[0]


def _calls(function: ast.FunctionDef, callee: str) -> list[ast.Call]:
    """The calls of ``callee`` (a bare name, as the call sites bind it) in ``function``."""
    calls = [n for n in ast.walk(function) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == callee]
    assert calls, f"{function.name} calls no {callee}: the call site moved"
    return calls


def _keywords(call: ast.Call) -> dict:
    """{keyword: its value's source} of a call made by keywords only (as every call site below is)."""
    assert not call.args and all(k.arg is not None for k in call.keywords), ast.unparse(call)
    return {k.arg: ast.unparse(k.value) for k in call.keywords}


def _site_keywords(wheels, key: str, member: str, qualname: str, callee: str) -> list[dict]:
    return [_keywords(c) for c in _calls(_function(_tree(wheels, key, member), qualname), callee)]


def _named_parameters(fn) -> set[str]:
    """The parameters of ``fn`` a keyword lands in by name (not a ``**`` catch-all)."""
    return {p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _ast_signature(tree: ast.Module, name: str) -> tuple[list[tuple[str, object]], dict]:
    """([(name, default)] of the positional parameters, {name: default} of the keyword-only ones)
    of a module-level function, defaults as literals (``NO_DEFAULT`` where there is none)."""
    args = _function(tree, name).args
    positional = args.posonlyargs + args.args
    defaults = [NO_DEFAULT] * (len(positional) - len(args.defaults)) + [ast.literal_eval(d) for d in args.defaults]
    keyword_only = {a.arg: NO_DEFAULT if d is None else ast.literal_eval(d)
                    for a, d in zip(args.kwonlyargs, args.kw_defaults)}
    return [(p.arg, d) for p, d in zip(positional, defaults)], keyword_only


def _signature(fn) -> tuple[list[tuple[str, object]], dict]:
    params = inspect.signature(fn).parameters.values()
    default = lambda p: NO_DEFAULT if p.default is p.empty else p.default  # noqa: E731
    return ([(p.name, default(p)) for p in params if p.kind == p.POSITIONAL_OR_KEYWORD],
            {p.name: default(p) for p in params if p.kind == p.KEYWORD_ONLY})


def _same_value(a, b) -> bool:
    return type(a) is type(b) and a == b


# ---------------------------------------------------------------------- what the probes saw
def _reached_library(call: dict, function, label: str, engine_frame: tuple[str, str] | None = None) -> None:
    """The call raised this library's device refusal from inside ``function`` (after the engine's
    own ``engine_frame``, (file suffix, function), where given)."""
    assert call["raised"] is not None and call["invalid_decode_input"], f"{label}: {call}"
    assert call["message"].endswith(DEVICE_REFUSAL), f"{label}: {call['message']}"
    frames = [(Path(f), name) for f, name in call["frames"]]
    source = Path(inspect.getsourcefile(function)).resolve()
    at = [i for i, (f, name) in enumerate(frames) if f == source and name == function.__name__]
    assert at, f"{label}: the refusal did not pass through {function.__module__}.{function.__name__}: {frames}"
    if engine_frame is not None:
        engine = [i for i, (f, name) in enumerate(frames) if str(f).endswith(engine_frame[0])
                  and name == engine_frame[1]]
        assert engine and engine[0] < at[0], f"{label}: not called from the engine's {engine_frame}: {frames}"


def _reached_engine(call: dict, label: str, engine_file: str) -> None:
    """The call went to the engine's own kernel: its error (no kernel on this CPU machine), raised
    in ``engine_file``, not this library's."""
    assert call["raised"] is not None and not call["invalid_decode_input"], f"{label}: {call}"
    assert str(call["frames"][-1][0]).endswith(engine_file), f"{label}: raised in {call['frames'][-1]}"


def _warnings(logs: list[dict], start: str = "dsv4-sparse-mla:") -> list[str]:
    return [line["message"] for line in logs if line["level"] == "WARNING" and line["message"].startswith(start)]


# ---------------------------------------------------------------------- vLLM on sm_120
@uses("vllm 12")
def test_vllm_sm120_names_resolve_to_this_library(probe):
    seen = probe("vllm 12")
    names = seen["late_import"]
    for name, target, modules in vllm_plugin.SM120_BINDINGS:
        for path in [f"{vllm_plugin.FLASHINFER_BINDINGS}.{name}"] + [f"{m}.{name}" for m in modules]:
            assert names[path]["wraps_library"] == f"dispatch.engines.{target}", (path, names[path])
    # the two modules vLLM's SM120 class runs in: V4's imported before vLLM's loader ran (patched
    # in place), V4.1's after (binding what the loader left in vllm.utils.flashinfer)
    v4, v41 = "vllm.models.deepseek_v4.nvidia.flashinfer_sparse", "vllm.models.deepseek_v41.nvidia.flashinfer_sparse"
    assert v4 in seen["imported_before_loader"] and v41 not in seen["imported_before_loader"]
    for module in (v4, v41):
        assert names[f"{module}.flashinfer_trtllm_batch_decode_sparse_mla_dsv4"]["wraps_library"] == \
            "dispatch.engines.flashinfer_dsv4.trtllm_batch_decode_sparse_mla_dsv4", module
    assert names["vllm.utils.flashinfer.flashinfer_trtllm_batch_decode_with_kv_cache_mla"]["wraps_library"] == \
        "dispatch.engines.flashinfer_mla.trtllm_batch_decode_with_kv_cache_mla"
    # each layer's start-up check (has_flashinfer_sparse_mla_sm120_config) passes for every (heads, top-k)
    assert names[f"{vllm_plugin.FLASHINFER_BINDINGS}.{vllm_plugin.SM120_SHAPE_CHECK}"]["now"] == \
        "dispatch.engines.vllm_plugin.serves_sm120_shape"
    assert seen["shape_check"] and all(ok is True for _, _, ok in seen["shape_check"]), seen["shape_check"]
    lines = _warnings(seen["runs"]["12.0"]["logs"])
    assert len(lines) == 1 and "now call this library" in lines[0], lines


@uses("vllm 12")
def test_vllm_sm120_call_sites_reach_this_library(probe):
    """vLLM's own methods (``DeepseekV4FlashInferSM120Attention._forward_decode`` /
    ``_forward_prefill`` of V4 and V4.1, ``FlashInferMLASparseSM120Impl._run_mqa_kernel`` for
    V3.2, GLM-5 and GLM-5.3) called with CPU tensors shaped as vLLM makes them: each call is
    this library's, refused at the device check only."""
    seen = probe("vllm 12")
    calls = seen["calls"]
    dsv4 = flashinfer_dsv4.trtllm_batch_decode_sparse_mla_dsv4
    mla = flashinfer_mla.trtllm_batch_decode_with_kv_cache_mla
    for label, frame in (("v4 decode", ("deepseek_v4/nvidia/flashinfer_sparse.py", "_forward_decode")),
                         ("v4 prefill", ("deepseek_v4/nvidia/flashinfer_sparse.py", "_forward_prefill")),
                         ("v4.1 decode", ("deepseek_v41/nvidia/flashinfer_sparse.py", "_forward_decode"))):
        _reached_library(calls[label], dsv4, label, frame)
    for label, scale_format in (("v3.2 decode", "pow2_fp32"), ("glm-5 decode", "arbitrary_fp32"),
                                ("glm-5.3 nope decode", "arbitrary_fp32")):
        _reached_library(calls[label], mla, label, ("mla/flashinfer_mla_sparse_sm120.py", "_run_mqa_kernel"))
        assert calls[label]["kv_scale_format"] == scale_format, calls[label]
    assert "rope-free" in calls["glm-5.3 nope decode"]["message"]
    # each replaced function says so at its first call in the process, once
    first = [m for m in _warnings(seen["call_logs"]) if "first call" in m]
    assert len(first) == len(vllm_plugin.SM120_BINDINGS), first
    for _, target, _ in vllm_plugin.SM120_BINDINGS:
        assert sum(f"served by dispatch.engines.{target} " in m for m in first) == 1, (target, first)


def test_vllm_sm120_call_site_keywords_are_parameters_of_what_they_reach(wheels):
    """Every keyword vLLM's SM120 call sites pass (read from its source) lands in a named
    parameter of the function the plugin gives them, and the values whose meaning the
    function documents are ones it serves."""
    dsv4 = _named_parameters(flashinfer_dsv4.trtllm_batch_decode_sparse_mla_dsv4)
    for member in ("vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py",
                   "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py"):
        for method in ("_forward_decode", "_forward_prefill"):
            for call in _site_keywords(wheels, "vllm", member, f"DeepseekV4FlashInferSM120Attention.{method}",
                                       "flashinfer_trtllm_batch_decode_sparse_mla_dsv4"):
                assert call.keys() <= dsv4, (member, method, call.keys() - dsv4)
                # [num_blocks, P, 1, 584] caches (_as_sparse_cache), the default FP8 record of V4 and V4.1 on SM120
                assert call["kv_layout"] == "'NHD'" and "kv_cache_format" not in call, (member, method, call)
                assert {"sparse_indices_are_storage_offsets", "sparse_topk_lens", "cum_seq_lens_q"}.isdisjoint(call)
    member = "vllm/v1/attention/backends/mla/flashinfer_mla_sparse_sm120.py"
    (call,) = _site_keywords(wheels, "vllm", member, "FlashInferMLASparseSM120Impl._run_mqa_kernel",
                             "flashinfer_trtllm_batch_decode_with_kv_cache_mla")
    mla = _named_parameters(flashinfer_mla.trtllm_batch_decode_with_kv_cache_mla)
    assert call.keys() <= mla, call.keys() - mla
    assert call["kv_scale_format"] == "self.kv_scale_format" and call["bmm2_scale"] == "1.0"
    assert call["sparse_mla_top_k"] == call["max_seq_len"] == "sparse_capacity" and call["seq_lens"] == "None"
    # self.kv_scale_format: what vLLM's _kv_scale_format_for_model returns (DeepSeek-V3.2 / GLM)
    rule = _function(_tree(wheels, "vllm", member), "_kv_scale_format_for_model")
    returned = {ast.literal_eval(n.value) for n in ast.walk(rule) if isinstance(n, ast.Return)}
    assert returned == {"pow2_fp32", "arbitrary_fp32"} and returned <= set(flashinfer_mla.FP32_SCALE_FORMATS)


def _importers(wheels, package: str, source: str, name: str) -> dict[str, bool]:
    """{module: whether at its top level} of the modules of the ``package`` wheel that import
    ``name`` from the module ``source`` (a function-level import resolves at each call)."""
    found = {}
    with zipfile.ZipFile(wheels.path(package)) as wheel:
        for member in wheel.namelist():
            if not member.endswith(".py"):
                continue
            text = wheel.read(member).decode()
            if name not in text:
                continue
            tree, module = ast.parse(text), member[:-3].replace("/", ".")
            top = {id(n) for n in tree.body}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == source and name in {a.name for a in node.names}:
                    found[module] = found.get(module, False) or id(node) in top
    return found


def test_vllm_sm120_bindings_reach_every_module_that_binds_them(wheels):
    """The modules of vLLM that import the SM120 bindings by name at their top level are the
    plugin's callers (patched where imported before the loader ran), but the V4.1 specialized
    decode of ``DeepseekV4FlashInferMLAAttention`` (storage-offset indices, the class vLLM never
    picks on 12.x, ``test_vllm_attention_class_per_gpu_family``); the MLA binding is imported
    inside ``_run_mqa_kernel``, at each call."""
    not_on_sm120 = {"vllm.models.deepseek_v41.nvidia.specialized_decode.attention.sparse_mla"}
    (dsv4, _, dsv4_callers), (mla, _, mla_callers) = vllm_plugin.SM120_BINDINGS
    found = _importers(wheels, "vllm", vllm_plugin.FLASHINFER_BINDINGS, dsv4)
    assert {module for module, top in found.items() if top} == set(dsv4_callers) | not_on_sm120, found
    found = _importers(wheels, "vllm", vllm_plugin.FLASHINFER_BINDINGS, mla)
    assert found == {"vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120": False} and not mla_callers, found


# ---------------------------------------------------------------------- vLLM on sm_90
@uses("vllm 9")
def test_vllm_sm90_installs_the_route(probe):
    run = probe("vllm 9")["runs"]["9.0"]
    names = run["names"]
    ops = ".".join(vllm_plugin.SM90_FLASHMLA)
    for path in [ops] + [f"{c}.{vllm_plugin.SM90_FLASHMLA[1]}" for c in vllm_plugin.SM90_CALLERS]:
        # the route (sm90_route.make_route), its __wrapped__ vLLM's function as the module held it
        assert names[path]["now"].startswith("dispatch.engines.sm90_route."), (path, names[path])
        assert names[path]["wraps_original"] and names[path]["wraps"] == names[ops]["wraps"], (path, names[path])
    for module, cls, method, *_ in vllm_plugin.SM90_SITES:
        path = f"{module}.{cls}.{method}"
        assert names[path]["wraps_original"] and names[path]["now"].startswith("dispatch.engines.vllm_plugin."), \
            (path, names[path])
    lines = _warnings(run["logs"])
    assert len(lines) == 1 and "routed per shape between this library and FlashMLA" in lines[0], lines


@uses("vllm 9")
def test_vllm_sm90_route_serves_or_hands_over_by_the_table(probe):
    """vLLM's own Hopper methods (the plugin's site wrappers on them) with a route table that
    gives 4 tokens to this library and 64 to FlashMLA: the first reach this library (on the
    layer's 16 real heads of vLLM's 64), the others vLLM's FlashMLA function."""
    seen = probe("vllm 9")
    calls = seen["calls"]
    sites = {"v4": ("deepseek_v4/nvidia/flashmla.py", "_forward_decode"),
             "v4.1": ("deepseek_v41/nvidia/flashmla.py", "_forward_decode"),
             "v3.2": ("mla/flashmla_sparse.py", "_fp8_flash_mla_kernel")}
    for model, frame in sites.items():
        served = calls[f"{model} decode, {LIBRARY_TOKENS} tokens"]
        _reached_library(served, flashmla.flash_mla_with_kvcache, model, frame)
        assert f"num_tokens={LIBRARY_TOKENS}, num_heads=16," in served["message"], served["message"]
        _reached_engine(calls[f"{model} decode, {FLASHMLA_TOKENS} tokens"], model, "vllm/v1/attention/ops/flashmla.py")
    told = [m for m in _warnings(seen["call_logs"]) if "first call routed" in m]
    assert sum("routed to this library" in m for m in told) == 3 and sum("routed to vLLM's FlashMLA" in m
                                                                         for m in told) == 3, told


def test_vllm_sm90_call_site_keywords_are_known_to_the_route(wheels):
    sites = (("vllm/models/deepseek_v4/nvidia/flashmla.py", "DeepseekV4FlashMLAAttention._forward_decode"),
             ("vllm/models/deepseek_v41/nvidia/flashmla.py", "DeepseekV4FlashMLAAttention._forward_decode"),
             ("vllm/v1/attention/backends/mla/flashmla_sparse.py", "FlashMLASparseImpl._fp8_flash_mla_kernel"))
    for member, method in sites:
        (call,) = _site_keywords(wheels, "vllm", member, method, "flash_mla_with_kvcache")
        assert call.keys() <= sm90_route.FLASHMLA_KEYWORDS, (method, call.keys() - sm90_route.FLASHMLA_KEYWORDS)
        assert call["is_fp8_kvcache"] == "True" and "indices" in call, (member, call)  # the sparse FP8 decode


# ---------------------------------------------------------------------- each family its own, others nothing
@uses("vllm 12", "vllm 9")
def test_vllm_each_gpu_family_patches_only_its_own(probe):
    sm120 = probe("vllm 12")
    for path in vllm_names("sm90"):  # no route on sm_120: as vLLM held them, or (imported later) vLLM's own
        state = sm120["late_import"][path]
        assert state["unchanged"] if state["loaded_before"] else (
            state["wraps"] is None and not state["now"].startswith("dispatch.")), (path, state)
    sm90 = probe("vllm 9")["runs"]["9.0"]["names"]
    for path in vllm_names("sm120"):  # FlashInfer's bindings stay FlashInfer's on sm_90 (storage-offset calls there)
        assert sm90[path]["unchanged"], (path, sm90[path])
    assert sm90["vllm.models.deepseek_v4.nvidia.flashinfer_sparse.flashinfer_trtllm_batch_decode_sparse_mla_dsv4"][
        "now"] == "vllm.utils.flashinfer._lazy_import_wrapper.<locals>.wrapper"


@uses("vllm 8 10")
@pytest.mark.parametrize("gpu", ["8.0", "10.0"])
def test_vllm_patches_nothing_where_it_makes_none_of_the_calls(probe, gpu):
    run = probe("vllm 8 10")["runs"][gpu]
    assert len(run["names"]) == len(vllm_names("sm120")) + len(vllm_names("sm90"))
    assert all(state["unchanged"] for state in run["names"].values()), run["names"]
    lines = _warnings(run["logs"])
    assert len(lines) == 1 and "nothing patched" in lines[0] and f"sm_{gpu.replace('.', '')}" in lines[0], lines
    assert not [line for line in run["logs"] if line["level"] in ("ERROR", "CRITICAL")], run["logs"]


@uses("vllm 8 10")
def test_vllm_attention_class_per_gpu_family(probe):
    seen = probe("vllm 8 10")["attention_classes"]
    sm120, flashmla_cls = "flashinfer_sparse.DeepseekV4FlashInferSM120Attention", "flashmla.DeepseekV4FlashMLAAttention"
    storage_offsets = "flashinfer_sparse.DeepseekV4FlashInferMLAAttention"
    expected = {}
    for gpu in ("12.0", "9.0", "8.0", "10.0"):
        on_12 = gpu == "12.0"
        expected[f"{gpu} default"] = sm120 if on_12 else flashmla_cls
        expected[f"{gpu} FLASHINFER_MLA_SPARSE_DSV4"] = sm120 if on_12 else storage_offsets
        expected[f"{gpu} FLASHMLA_SPARSE"] = flashmla_cls
    for model, package in (("v4", "deepseek_v4"), ("v4.1", "deepseek_v41")):
        for key, cls in expected.items():
            assert seen["classes"][f"{model} {key}"] == f"vllm.models.{package}.nvidia.{cls}", (model, key)
    # V4.1's default on 10.x: FlashMLA's mega attention where vLLM's FlashMLA has its ops, refused by
    # capability on every other family; not built here
    for gpu in ("12.0", "9.0", "8.0"):
        assert seen["mega_attention"][gpu] == [False, "FlashMLA mega attention requires sm_10x GPUs."]
    assert seen["mega_attention"]["10.0"][0] is False and "sm_10x" not in seen["mega_attention"]["10.0"][1]
    assert seen["mega_attention_here"][0] is False


# ---------------------------------------------------------------------- SGLang
@uses("sglang 12")
def test_sglang_sm120_hooks_reach_this_library(probe):
    seen = probe("sglang 12")
    names = seen["names"]
    hooked = (sglang_plugin.SM120_TARGET, sglang_plugin.SM120_GLM_TARGET, *(p for p, *_ in sglang_plugin.SITE_HOOKS))
    for path in hooked:
        assert names[path]["wraps_original"], (path, names[path])  # SGLang's HookRegistry wrapper of its own function
    assert not [line for line in seen["logs"] if line["level"] in ("ERROR", "CRITICAL")], seen["logs"]
    lines = _warnings(seen["logs"])
    assert len(lines) == 1 and sglang_plugin.SM120_TARGET in lines[0], lines
    calls = seen["calls"]
    sm120 = flashmla.flash_mla_with_kvcache_sm120
    _reached_library(calls["v4 decode, native heads"], sm120, "native heads")
    # SGLang's V4 query padded to 64 heads (uninitialised) inside a site of 16: the 16 are computed
    _reached_library(calls["v4 decode, padded heads"], sm120, "padded heads")
    assert "num_heads=16," in calls["v4 decode, padded heads"]["message"]
    for label in ("glm-5 decode", "glm-5.3 nope decode"):
        _reached_library(calls[label], flashinfer_mla.flashinfer_sparse_mla_forward, label,
                         ("attention/dsa_backend.py", "_forward_flashinfer_sparse_mla"))


def test_sglang_site_hooks_find_the_layer_where_sglang_passes_it(wheels):
    """Each hooked backend method takes ``layer`` where ``SITE_HOOKS`` says (after self), and
    every call SGLang makes of it passes the layer there or by name."""
    for path, _, layer_at, _ in sglang_plugin.SITE_HOOKS:
        module, cls, method = path.rsplit(".", 2)
        tree = _tree(wheels, "sglang", module.replace(".", "/") + ".py")
        assert _function(tree, f"{cls}.{method}").args.args[1 + layer_at].arg == "layer", path
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == f"self.{method}"]
        assert calls, f"SGLang calls {method} nowhere in {module}"
        for call in calls:
            by_name = [ast.unparse(k.value) for k in call.keywords if k.arg == "layer"]
            at = call.args[layer_at] if len(call.args) > layer_at else None
            assert by_name == ["layer"] or (not by_name and isinstance(at, ast.Name) and at.id == "layer"), \
                (path, ast.unparse(call))


def test_sglang_sm120_call_site_keywords_are_parameters_of_what_they_reach(wheels):
    backend = "sglang/srt/layers/attention/deepseek_v4_backend.py"
    (call,) = _site_keywords(wheels, "sglang", backend, "DeepseekV4AttnBackend._forward_attention",
                             "flash_mla_with_kvcache_sm120")
    named = _named_parameters(flashmla.flash_mla_with_kvcache_sm120)
    assert call.keys() <= named, call.keys() - named  # not one left to the **unknown refusal
    (call,) = _site_keywords(wheels, "sglang", "sglang/srt/layers/attention/dsa_backend.py",
                             "DeepseekSparseAttnBackend._forward_flashinfer_sparse_mla",
                             "flashinfer_sparse_mla_forward")
    replaced = flashinfer_mla.flashinfer_sparse_mla_forward
    assert call.keys() <= _named_parameters(replaced), call.keys() - _named_parameters(replaced)
    # the replacement takes SGLang's function's parameters: names, order, which are keyword-only
    theirs = _ast_signature(_tree(wheels, "sglang", "sglang/kernels/ops/attention/flash_mla_sm120.py"),
                            "flashinfer_sparse_mla_forward")
    ours = _signature(replaced)
    assert [n for n, _ in ours[0]] == [n for n, _ in theirs[0]] and list(ours[1]) == list(theirs[1])


@uses("sglang 9")
def test_sglang_sm90_hooks_route_per_shape(probe):
    seen = probe("sglang 9")
    names = seen["names"]
    for path in (sglang_plugin.SM90_TARGET, *(p for p, *_ in sglang_plugin.SITE_HOOKS)):
        assert names[path]["wraps_original"], (path, names[path])
    assert not [line for line in seen["logs"] if line["level"] in ("ERROR", "CRITICAL")], seen["logs"]
    calls = seen["calls"]
    interface = "sglang/kernels/ops/attention/flash_mla_interface.py"
    for model, frame in (("v4", None), ("v3.2", ("attention/dsa_backend.py", "_forward_flashmla_kv"))):
        served = calls[f"{model} decode, {LIBRARY_TOKENS} tokens"]
        _reached_library(served, flashmla.flash_mla_with_kvcache, model, frame)
        assert f"num_tokens={LIBRARY_TOKENS}, num_heads=16," in served["message"], served["message"]
        handed = calls[f"{model} decode, {FLASHMLA_TOKENS} tokens"]
        assert not handed["invalid_decode_input"] and any(f.endswith(interface) for f, _ in handed["frames"]), handed
        assert handed["frames"][-1][0].endswith("tests/engine_probe.py"), handed  # flash_mla's (stand-in) kernels
    told = [m for m in _warnings(seen["call_logs"]) if "first call routed" in m]
    assert sum("routed to this library" in m for m in told) == 2 and sum("routed to SGLang's FlashMLA" in m
                                                                         for m in told) == 2, told


def test_sglang_sm90_call_site_keywords_are_known_to_the_route(wheels):
    known = sm90_route.FLASHMLA_KEYWORDS | sm90_route.SGLANG_KEYWORDS
    # SGLang's flash_mla_interface.flash_mla_with_kvcache: every parameter known, SGLang's own among them
    positional, keyword_only = _ast_signature(_tree(wheels, "sglang", "sglang/kernels/ops/attention/"
                                                    "flash_mla_interface.py"), "flash_mla_with_kvcache")
    parameters = {n for n, _ in positional} | set(keyword_only)
    assert parameters <= known and sm90_route.SGLANG_KEYWORDS <= parameters, parameters ^ known
    backend = "sglang/srt/layers/attention/deepseek_v4_backend.py"
    tree = _tree(wheels, "sglang", backend)
    (call,) = [_keywords(c) for c in _calls(_function(tree, "DeepseekV4AttnBackend._forward_attention"),
                                            "flash_mla_with_kvcache")]
    # the keywords of the functools.partial the backend binds in __init__ (use_legacy=)
    partials = [c for c in ast.walk(_function(tree, "DeepseekV4AttnBackend.__init__")) if isinstance(c, ast.Call)
                and ast.unparse(c.func) == "functools.partial"
                and ast.unparse(c.args[0]) == "flash_mla_interface.flash_mla_with_kvcache"]
    assert len(partials) == 1, "the backend binds FlashMLA's function elsewhere now"
    bound = {k.arg for k in partials[0].keywords}
    assert bound == {"use_legacy"} and (call.keys() | bound) <= known, (call.keys() | bound) - known
    (call,) = _site_keywords(wheels, "sglang", "sglang/srt/layers/attention/dsa_backend.py",
                             "DeepseekSparseAttnBackend._forward_flashmla_kv", "flash_mla_with_kvcache")
    assert call.keys() <= known, call.keys() - known
    assert call["kv_format"] == "self.flashmla_kv_format" and call["is_fp8_kvcache"] == "True"
    # the DSA backend's names for FlashMLA's 656-byte formats are the route's
    init = _function(_tree(wheels, "sglang", "sglang/srt/layers/attention/dsa_backend.py"),
                     "DeepseekSparseAttnBackend.__init__")
    formats = {ast.literal_eval(n) for a in ast.walk(init) if isinstance(a, ast.Assign)
               and ast.unparse(a.targets[0]) == "self.flashmla_kv_format" for n in ast.walk(a.value)
               if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert formats == {"V32", "V32_NO_ROPE"} and formats <= set(sm90_route.SGLANG_KV_FORMATS), formats


# ---------------------------------------------------------------------- FlashInfer and FlashMLA signatures
@pytest.mark.parametrize("release", ["0.7.4", "0.7.2"])
@pytest.mark.parametrize("name,ours", [("trtllm_batch_decode_sparse_mla_dsv4", flashinfer_dsv4),
                                       ("trtllm_batch_decode_with_kv_cache_mla", flashinfer_mla)])
def test_flashinfer_positional_parameters_are_the_call_shapes(wheels, release, name, ours):
    theirs = _ast_signature(_tree(wheels, f"flashinfer {release}", FLASHINFER_CORE), name)
    mine = _signature(getattr(ours, name))
    assert [n for n, _ in mine[0]] == [n for n, _ in theirs[0]]
    for (param, default), (_, their_default) in zip(mine[0], theirs[0]):
        assert _same_value(default, their_default), (param, default, their_default)
    for param, default in theirs[1].items():  # FlashInfer's keyword-only ones (kv_cache_format)
        assert _same_value(mine[1].get(param, NO_DEFAULT), default), (param, mine[1].get(param), default)


def test_flashinfer_kv_cache_formats_are_the_call_shapes(wheels):
    formats = {}
    for release in ("0.7.4", "0.7.2"):
        tree = _tree(wheels, f"flashinfer {release}", FLASHINFER_CORE)
        assert "kv_cache_format" in _ast_signature(tree, "trtllm_batch_decode_sparse_mla_dsv4")[1], release
        annotated = [a.annotation for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                     for a in f.args.args + f.args.kwonlyargs if a.arg == "kv_cache_format" and a.annotation]
        tuples = [a.value for a in tree.body if isinstance(a, ast.Assign)
                  and re.fullmatch(r"_DSV4\w*_KV_CACHE_FORMATS", ast.unparse(a.targets[0]))]
        assert annotated and tuples, release
        formats[release] = {n.value for node in annotated + tuples for n in ast.walk(node)
                            if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert formats[release] <= flashinfer_dsv4.DSV4_KV_CACHE_FORMATS.keys(), (
            release, formats[release] - flashinfer_dsv4.DSV4_KV_CACHE_FORMATS.keys())
    assert formats["0.7.2"] < formats["0.7.4"] == set(flashinfer_dsv4.DSV4_KV_CACHE_FORMATS)


def test_vllms_flashmla_positional_parameters_are_the_call_shapes(wheels):
    theirs = _ast_signature(_tree(wheels, "vllm", "vllm/third_party/flashmla/flash_mla_interface.py"),
                            "flash_mla_with_kvcache")
    assert [n for n, _ in _signature(flashmla.flash_mla_with_kvcache)[0]] == [n for n, _ in theirs[0]]
    assert {n for n, _ in theirs[0]} | set(theirs[1]) == sm90_route.FLASHMLA_KEYWORDS


# ---------------------------------------------------------------------- dsv4-mla-engines
@uses("status sm_120", "status sm_90")
@pytest.mark.parametrize("gpu", ["sm_120", "sm_90"])
def test_the_engines_command_finds_every_name_patched(probe, gpu):
    """``dsv4-mla-engines --gpu`` (its main, in a probe process) with both engines installed."""
    done = probe(f"status {gpu}")
    lines = re.findall(r"^    (\S+): (patched|NOT patched) -> (.+)$", done.stdout, re.M)
    assert "plugin raised" not in done.stdout and lines, done.stdout
    assert all(state == "patched" for _, state, _ in lines), done.stdout
    printed = {name for name, _, _ in lines}
    primary = ({vllm_plugin.FLASHINFER_BINDINGS + "." + n for n, _, _ in vllm_plugin.SM120_BINDINGS}
               | {sglang_plugin.SM120_TARGET, sglang_plugin.SM120_GLM_TARGET} if gpu == "sm_120"
               else {".".join(vllm_plugin.SM90_FLASHMLA), sglang_plugin.SM90_TARGET})
    assert primary <= printed, primary - printed
    assert re.search(r"^  vllm 0\.34\.0: entry point", done.stdout, re.M) and \
        re.search(r"^  sglang 0\.5\.23: entry point", done.stdout, re.M), done.stdout
