"""dsv4-mla-selftest: check this library on your own GPU, the accuracy and speed of its
deployment shapes, against the float64 reference and beside the other libraries that run there.

    dsv4-mla-selftest                                    # every model at 64 query heads per GPU
    dsv4-mla-selftest --model deepseek-v4-flash --tp 4   # one deployment: 16 query heads per GPU
    dsv4-mla-selftest --model glm-5.3 --quick --out report/

What runs: the deployment shapes of ``dispatch.policy.registry`` for the deployment named by
--model / --tp (every shape the model is served with at that head count: each cache format
and main / extra cache pairing, each top-k and page size; without --tp every head count of the
model; without --model every model at 64 query heads per GPU, the one head count all of them
are deployed with; a model is named in any case: deepseek-v4-flash, V4-Flash, v4-flash),
restricted to one cache format by --format, at 1, 8 and 64 tokens per call (--tokens; --quick:
1 and 64, and one page size per shape), on random caches and queries (those of
dsv4-mla-check-aot: slots with -1 among them, every list full, a sink per head where the model
has one), in every compute path this GPU has for the shape's cache formats ("f16", the
default, "bf16", "fp8" from sm_89 on, and "mxf8" on sm_120 / sm_121 for UE8M0-scaled caches;
--precision narrows).

Accuracy: each call's out against the float64 reference on up to 16 of its tokens, with the
bound dsv4-mla-check-aot and the tests apply (dispatch.tools.accuracy: per token, the relative L2
error at most twice the rounding floor of the case); reported: the worst error over its bound.

Speed (unless --no-timing): each call captured in a CUDA graph and replayed with L2 cleared
before every replay, the median (dispatch.tools.timing: the method of docs/performance.md; needs
triton), in each path, and the same inputs through the other libraries where they run, called
as vLLM calls them: FlashInfer's SM120 sparse MLA (trtllm_batch_decode_sparse_mla_dsv4; for
DeepSeek-V3.2 / GLM rows trtllm_batch_decode_with_kv_cache_mla; sm_120 / sm_121 only) and
FlashMLA's sparse FP8 decode (flash_mla_with_kvcache; sm_90; MODEL1 and V3.2 caches), query
heads zero-padded as the engines pad them. A library that does not run says why.

Kernels: before the calls, where each kernel variant they need will come from (an AOT build:
its directory, or the installed package's; the JIT disk cache; or a compile now, which takes
a while: dsv4-mla-aot-build makes them ahead); after, where each came from.

Outputs, in --out (default: the current directory): dsv4-mla-selftest.json (every result),
dsv4-mla-selftest.md (the report and its table) and dsv4-mla-selftest.png (time per shape,
one bar per path and library; needs matplotlib: pip install 'dsv4-sparse-mla[plot]'). The
table and a one-line summary are printed.

Exit status: 0 every call within its bound; 1 an accuracy failure (a call above its bound,
or one that raised); 2 a usage error; 3 no CUDA GPU is visible (one line says so); 4 a GPU
these kernels do not run on (they run on compute capability 8.0, 8.6, 8.7, 8.9, 9.0, 12.0 and
12.1: ``cute_kernels.arch``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import time

from cute_kernels.sparse_mla_decode.kv_format import FORMATS, PRECISIONS
from cute_kernels.sparse_mla_decode.tuning import DEFAULT_PRECISION

from ..policy.registry import MODELS, DeploymentShape
from .selftest_report import PROG
from .selftest_shapes import Deployment, SelfTestShape, UsageError, default_heads, select_deployment

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU, EXIT_UNSUPPORTED_GPU = 0, 1, 2, 3, 4
TOKENS = (1, 8, 64)  # tokens per call: one request's step, a few (drafts, small batches), a batch
QUICK_TOKENS = (1, 64)


# ---------------------------------------------------------------------- the arguments
def parse_tokens(text: str) -> tuple[int, ...]:
    """``--tokens 1,8,64``: positive token counts, in the order given, each once."""
    try:
        values = [int(t) for t in text.replace(" ", ",").split(",") if t]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated positive token counts, e.g. 1,8,64")
    return tuple(dict.fromkeys(values))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help=f"the model deployed (any case): {', '.join(MODELS)} (default: every model at "
                                    f"{default_heads()} query heads per GPU)")
    tps = "; ".join(f"{key} {','.join(map(str, model.tps))}" for key, model in MODELS.items())
    ap.add_argument("--tp", type=int, help=f"its tensor parallelism: query heads per GPU = the model's query heads / "
                                           f"tp ({tps}; default: every one)")
    ap.add_argument("--format", dest="kv_format", choices=list(FORMATS), metavar="KV_FORMAT",
                    help=f"only the shapes whose main cache is of this format ({', '.join(FORMATS)}; a format read "
                         f"only as an extra cache: whose extra cache is)")
    ap.add_argument("--precision", action="append", choices=PRECISIONS, metavar="PATH",
                    help=f"a compute path to run, repeatable ({', '.join(path_order(PRECISIONS))}; default: every "
                         f"path this GPU has for each shape)")
    ap.add_argument("--tokens", type=parse_tokens,
                    help=f"tokens per call, comma-separated (default {','.join(map(str, TOKENS))}; with --quick "
                         f"{','.join(map(str, QUICK_TOKENS))})")
    ap.add_argument("--out", default=".", help="the directory of the JSON, Markdown and PNG files (default: the "
                                               "current directory; created where missing)")
    ap.add_argument("--quick", action="store_true", help=f"fewer calls: tokens {','.join(map(str, QUICK_TOKENS))}, "
                                                         f"one page size per shape")
    ap.add_argument("--no-timing", action="store_true", help="accuracy only: no timing, no other libraries")
    ap.add_argument("--seed", type=int, default=0, help="the seed of the random caches and queries (default 0)")
    ap.add_argument("--route-table", metavar="FILE", help="on sm_90 with FlashMLA installed (its module: "
                    "--flashmla): then measure the Hopper route's table for this GPU into FILE, which "
                    "DSV4_MLA_SM90_ROUTE_TABLE=FILE makes the engine plugins use (dispatch.tools.sm90_route_table)")
    ap.add_argument("--flashmla", default="flash_mla", help="the module with FlashMLA's flash_mla_with_kvcache, "
                    "for --route-table (default flash_mla; vLLM's: vllm.v1.attention.ops.flashmla)")
    return ap


# ---------------------------------------------------------------------- the GPU and its paths
def find_gpu() -> tuple[dict | None, int | None, str | None]:
    """(the GPU's name, capability, arch and SM count; None, exit status, one line) where no
    CUDA GPU is visible or the visible one is not one these kernels run on."""
    import torch

    from cute_kernels.arch import SUPPORTED_ARCHS

    if not torch.cuda.is_available():
        return None, EXIT_NO_GPU, (f"{PROG}: no CUDA GPU is visible (torch.cuda.is_available() is False): run it on "
                                   f"the machine with the GPU (exit status {EXIT_NO_GPU})")
    from ..api import device_target

    capability = torch.cuda.get_device_capability()
    arch, sms, _ = device_target(torch.cuda.current_device())
    gpu = {"name": torch.cuda.get_device_name(), "capability": list(capability), "arch": arch, "sms": sms}
    if gpu["arch"] is None:
        cc = ".".join(map(str, capability))
        return None, EXIT_UNSUPPORTED_GPU, (f"{PROG}: {gpu['name']} (compute capability {cc}) is not a GPU these "
                                            f"kernels run on ({', '.join(SUPPORTED_ARCHS)})")
    return gpu, None, None


def path_order(paths) -> list[str]:
    """The default path first, then the others in ``PRECISIONS`` order."""
    return sorted(paths, key=lambda p: (p != DEFAULT_PRECISION, PRECISIONS.index(p)))


def shape_paths(arch: str, shape: DeploymentShape, wanted=None) -> list[str]:
    """The compute paths that read both of ``shape``'s cache formats on ``arch`` (of ``wanted``)."""
    from .check_aot import extra_format
    from ..policy.precision import format_precisions

    both = set(format_precisions(arch, shape.kv_format)) & set(format_precisions(arch, extra_format(shape)))
    return path_order(p for p in both if wanted is None or p in wanted)


# ---------------------------------------------------------------------- the calls
@dataclasses.dataclass
class Case:
    """One call: a shape at a token count, its tensors and ``sparse_mla_decode``'s keywords."""

    shape: SelfTestShape
    num_tokens: int
    q: object
    cache: object
    indices: object
    kw: dict
    paths: list[str]

    def row(self) -> dict:
        s = self.shape.shape
        return {"shape": self.shape.label, "models": list(self.shape.models), "num_heads": s.num_heads,
                "topk": s.topk, "page_block_size": s.page_block_size, "extra_topk": s.extra_topk,
                "extra_page_block_size": s.extra_page_block_size, "kv_format": s.kv_format,
                "extra_kv_format": s.extra_kv_format, "attn_sink": self.shape.attn_sink,
                "num_tokens": self.num_tokens, "paths": {}, "peers": {}}


def make_cases(deployment: Deployment, *, tokens, arch: str, wanted, seed: int, device="cuda") -> list[Case]:
    """The calls of the deployment at each token count, on random caches (``check_aot``'s
    inputs) with every list full: a decode step whose context is longer than its lists."""
    import torch

    from .check_aot import deployment_inputs, shape_caches

    caches = shape_caches([st.shape for st in deployment.shapes], torch.Generator().manual_seed(seed), device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    cases = []
    for st in deployment.shapes:
        paths = shape_paths(arch, st.shape, wanted)
        for T in tokens:
            q, cache, idx, kw = deployment_inputs(st.shape, T, caches, has_len=True,
                                                  has_extra_len=st.shape.extra_topk > 0, has_sink=st.attn_sink, gen=gen,
                                                  device=device)
            kw["topk_length"].fill_(st.shape.topk)
            if st.shape.extra_topk:
                kw["extra_topk_length"].fill_(st.shape.extra_topk)
            cases.append(Case(st, T, q, cache, idx, kw, paths))
    return cases


def planned_variants(case: Case, precision: str, _target=None) -> tuple:
    """The kernel variants the call in ``precision`` runs, as a plan selects them (no GPU work;
    none where the call is refused: running it reports why). ``_target``: ``validate_call``'s
    testing aid, (arch, SMs, shared memory per SM) to plan CPU tensors for."""
    from ..api import validate_call
    from ..policy.call_metadata import InvalidDecodeInput
    from ..policy.selection import select_for_call

    try:
        call = validate_call(case.q, case.cache, case.indices, precision=precision, for_plan=True, _target=_target,
                             **case.kw)
    except InvalidDecodeInput:
        return ()
    return select_for_call(call).variants


def expected_source(variant) -> str:
    """Where the loader will take ``variant`` from, read without loading anything, in the words
    of ``loader.sources``: "aot <directory>" (the first manifest of ``loader.aot_dirs()`` with
    an up-to-date entry), "jit disk cache <directory>", or "compile" (it is compiled now)."""
    from ..runtime import loader
    from ..runtime.fingerprint import fingerprint, fingerprint_id, mismatches

    expected = fingerprint(variant)
    for directory in loader.aot_dirs():
        manifest = loader.read_manifest(directory)
        entry = manifest["entries"].get(variant.name) if manifest is not None else None
        if entry and not mismatches(expected, entry.get("fingerprint", {})) \
                and (directory / entry.get("object", "")).is_file():
            return f"aot {directory}"
    if (loader.jit_cache_dir() / fingerprint_id(expected) / "meta.json").is_file():
        return f"jit disk cache {loader.jit_cache_dir()}"
    return "compile"


def check_path(case: Case, precision: str) -> dict:
    """The call's out in ``precision`` against the float64 reference (``check_aot.spot_check``,
    the bound of ``dispatch.tools.accuracy``)."""
    from .. import sparse_mla_decode
    from .check_aot import spot_check

    try:
        out, _ = sparse_mla_decode(case.q, case.cache, case.indices, precision=precision, **case.kw)
        ratio, bad = spot_check(precision, case.q, cache=case.cache, idx=case.indices, kw=case.kw, out=out)
    except Exception as err:  # a call that raises is a failure of the run, reported with the others
        return {"status": "error", "error": f"{type(err).__name__}: {err}"[:500]}
    return {"status": "fail" if bad else "pass", "error_over_bound": ratio, "bad_tokens": bad}


def time_path(case: Case, precision: str, timer) -> dict:
    """``{"us": ...}`` of the planned call in ``precision``, or ``{"time_error": ...}``."""
    from .timing import plan_runner

    kw = {k: v for k, v in case.kw.items() if k not in ("kv_format", "extra_kv_format")}
    try:
        us = timer(plan_runner(case.q, case.cache, case.indices, kw=kw, precision=precision, overrides=None,
                               kv_format=case.kw["kv_format"], extra_kv_format=case.kw.get("extra_kv_format")))
    except Exception as err:
        return {"us": None, "time_error": f"{type(err).__name__}: {err}"[:500]}
    return {"us": us}


def timing_unavailable() -> str | None:
    """Why calls cannot be timed here (the method needs triton's ``do_bench``), or None."""
    try:
        import triton.testing  # noqa: F401
    except ImportError as err:
        return f"not available: the timing method needs triton ({err})"
    return None


def _progress(entry: dict) -> str:
    """A path's result in a few words: "pass 0.41x its bound, 10.2 us"."""
    from .selftest_report import times_text

    text = entry["status"] + (f" ({entry['error'][:160]})" if entry.get("error") else "")
    if entry.get("error_over_bound") is not None:
        text += f" {times_text(entry['error_over_bound'])} its bound"
    return text + (f", {entry['us']:.1f} us" if entry.get("us") else "")


def run_cases(cases: list[Case], arch: str, timer=None, log=print) -> list[dict]:
    """Every case: each path's accuracy (and time), then each peer's time on the same inputs."""
    from .selftest_peers import new_workspace, peer_calls, time_peer

    workspace = None
    rows = []
    for n, case in enumerate(cases, 1):
        row = case.row()
        for precision in case.paths:
            entry = check_path(case, precision)
            if timer is not None:
                entry.update(time_path(case, precision, timer))
                if entry.get("time_error") and entry["status"] == "pass":  # a planned call that fails fails the run
                    entry.update(status="error", error=entry["time_error"])
            row["paths"][precision] = entry
        if timer is not None:
            workspace = workspace if workspace is not None else new_workspace(case.q.device)
            for call in peer_calls(case.q, case.cache, case.indices, kw=case.kw, arch=arch, workspace=workspace):
                row["peers"][call.peer] = time_peer(call, timer)
        log(f"[{n}/{len(cases)}] {row['shape']} T={case.num_tokens}: "
            + "; ".join(f"{p} {_progress(e)}" for p, e in row["paths"].items()), file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def software() -> dict:
    import torch

    from ..runtime.fingerprint import PROJECT_VERSION, dsl_version
    from .selftest_peers import version_of

    return {"dsv4-sparse-mla": PROJECT_VERSION, "torch": torch.__version__, "nvidia-cutlass-dsl": dsl_version(),
            "flashinfer": version_of("flashinfer"), "flash_mla": version_of("flash_mla")}


def run(args, deployment: Deployment, gpu: dict) -> tuple[dict, int]:
    """The self-test on the GPU: the result (``selftest_report``) and the exit status."""
    from ..runtime import loader
    from .selftest_report import counts_text, source_counts
    from .timing import graph_time_us
    from ..policy.precision import precisions_for

    arch = gpu["arch"]
    unknown = [p for p in args.precision or () if p not in precisions_for(arch)]
    if unknown:
        print(f"{PROG}: --precision {', '.join(unknown)}: not a compute path of {arch} (its paths: "
              f"{', '.join(path_order(precisions_for(arch)))})", file=sys.stderr)
        return {}, EXIT_USAGE
    tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    cases = [c for c in make_cases(deployment, tokens=tokens, arch=arch, wanted=args.precision,
                                   seed=args.seed) if c.paths]
    if not cases:
        print(f"{PROG}: no shape of {deployment.description} has a path among --precision "
              f"{', '.join(args.precision)} on {arch}", file=sys.stderr)
        return {}, EXIT_USAGE
    variants = {v.name: v for c in cases for p in c.paths for v in planned_variants(c, p)}
    expected = {name: expected_source(v) for name, v in sorted(variants.items())}
    print(f"{PROG}: {len(cases)} calls on {gpu['name']} ({arch}, {gpu['sms']} SMs) need {len(variants)} kernel "
          f"variants: {counts_text(source_counts(expected))}", file=sys.stderr, flush=True)
    to_compile = sum(s == "compile" for s in expected.values())
    if to_compile:
        print(f"{PROG}: {to_compile} of them are compiled first (JIT), which takes a while; dsv4-mla-aot-build "
              f"--arch {arch} --out DIR builds them ahead (then DSV4_MLA_AOT_DIR=DIR)", file=sys.stderr, flush=True)
    unavailable = None if args.no_timing else timing_unavailable()
    timer = graph_time_us if not args.no_timing and unavailable is None else None
    start = time.perf_counter()
    rows = run_cases(cases, arch, timer)
    used = {name: loader.sources.get(name, "not loaded") for name in expected}
    result = {"tool": PROG, "gpu": gpu, "software": software(),
              "deployment": {"description": deployment.description, "model": deployment.model, "tp": deployment.tp,
                             "kv_format": deployment.kv_format},
              "tokens": list(tokens), "paths": path_order({p for c in cases for p in c.paths}), "seed": args.seed,
              "timing": {"enabled": timer is not None, "unavailable": unavailable,
                         "method": "CUDA graph replay, L2 cleared before every replay, median (dispatch.tools.timing)"},
              "rows": rows, "kernels": {"expected": expected, "used": used},
              "seconds": round(time.perf_counter() - start, 1)}
    status = EXIT_FAILED if any(e["status"] != "pass" for row in rows for e in row["paths"].values()) else EXIT_OK
    result["exit_status"] = status
    compiled = [n for n, s in used.items() if s == "compiled"]
    if compiled:
        print(f"{PROG}: compiled {len(compiled)} kernel variants in this run (JIT): {', '.join(compiled)}",
              file=sys.stderr)
    return result, status


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        deployment = select_deployment(args.model, args.tp, args.kv_format, quick=args.quick)
    except UsageError as err:
        ap.error(str(err))  # exit status 2
    gpu, status, line = find_gpu()
    if gpu is None:
        print(line, file=sys.stderr)
        return status
    from .selftest_peers import FLASHMLA_ARCHS

    if args.route_table and gpu["arch"] not in FLASHMLA_ARCHS:  # before the self-test, not after it
        ap.error(f"--route-table: the Hopper route's table is measured against FlashMLA, whose sparse decode runs on "
                 f"{', '.join(FLASHMLA_ARCHS)}; this GPU runs {gpu['arch']}")
    if args.route_table and importlib.util.find_spec(args.flashmla.split(".")[0]) is None:
        ap.error(f"--route-table: no module {args.flashmla!r} here (--flashmla names FlashMLA's module: flash_mla "
                 f"built from source, or vLLM's vllm.v1.attention.ops.flashmla)")
    result, status = run(args, deployment, gpu)
    if not result:
        return status
    from .selftest_report import results_table, summary_line, write_reports

    written = write_reports(result, args.out)
    print(results_table(result))
    print()
    for what, path in written.items():
        print(f"{PROG}: {what}: {path}", file=sys.stderr)
    print(summary_line(result))
    if args.route_table:
        from .sm90_route_table import main as route_table

        route_status = route_table(["--json", args.route_table, "--flashmla", args.flashmla, "--seed",
                                    str(args.seed)] + (["--quick"] if args.quick else []))
        print(f"{PROG}: route table: {args.route_table} (DSV4_MLA_SM90_ROUTE_TABLE={args.route_table} makes the "
              f"engine plugins use it)", file=sys.stderr)
        status = max(status, route_status)
    return status


if __name__ == "__main__":
    sys.exit(main())
