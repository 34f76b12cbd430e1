"""The self-test a user runs on their own GPU: ``dsv4-mla-selftest``.

    dsv4-mla-selftest [--model NAME] [--tp N] [--format KV_FORMAT] [--precision P ...]
                      [--tokens 1,8,64] [--out DIR] [--quick] [--no-timing] [--seed N]

For a deployment of the registry (``dispatch.registry.MODELS``: ``--model`` and ``--tp``; every
model at ``--tp`` by default), it runs the deployment shapes of every cache format and pairing
of that deployment (``--format`` keeps those reading that format) at a few token counts,
in every compute path the GPU has for the format (``--precision`` picks some), and for
each:

- checks the result against the float64 reference on a sample of its tokens with the bound
  the tests use (``dispatch.accuracy``: per token, out error at most twice the rounding
  floor of the case), and prints it as error / bound;
- times the call (captured in a CUDA graph, L2 flushed before each replay, the median of
  ``REPEATS``), and times the same inputs through the peers installed beside it:
  FlashInfer's SM120 sparse MLA (``trtllm_batch_decode_sparse_mla_dsv4``, the call vLLM
  makes; sm_120 / sm_121 only) and FlashMLA's sparse decode (Hopper and datacenter
  Blackwell only). A peer that cannot run says why ("not available: ...").

It writes ``dsv4-mla-selftest.json``, ``.md`` and, where matplotlib is installed, ``.png``
(time per shape and path) into ``--out``, prints the Markdown table and a summary line, and
says where every kernel it used came from: the AOT build (which directory), the JIT disk
cache, or a compile in this process (``dispatch.loader.sources``): it never compiles
silently.

Exit status: 0 when every check passed, 1 when an accuracy check failed, 2 for a wrong
argument, 3 when no CUDA GPU is visible or the GPU is not one the library serves.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .registry import DEPLOYMENT_SHAPES, MODELS

EXIT_ACCURACY, EXIT_USAGE, EXIT_NO_GPU = 1, 2, 3
REPEATS = 30  # timed graph replays per call (the median is reported)
L2_FLUSH_BYTES = 256 << 20  # written before each timed replay: more than any GPU's L2
DEFAULT_TP = 4
TOKENS, QUICK_TOKENS = (1, 8, 64), (1, 64)
STEM = "dsv4-mla-selftest"
# the heads FlashInfer's SM120 decode and FlashMLA's sparse decode take
FLASHINFER_HEADS = (8, 16, 32, 64, 128)
FLASHMLA_HEADS = (64, 128)


@dataclass
class Row:
    """One (shape, token count, compute path) of the self-test."""

    model: str
    num_heads: int
    kv_format: str
    extra_kv_format: str | None
    topk: int
    extra_topk: int
    page: int
    extra_page: int | None
    tokens: int
    precision: str
    error_over_bound: float = math.nan
    passed: bool = False
    us: float | None = None
    peers: dict = field(default_factory=dict)  # peer -> microseconds, or "not available: why"

    @property
    def label(self) -> str:
        lists = f"{self.topk}" + (f"+{self.extra_topk}" if self.extra_topk else "")
        fmt = self.kv_format + (f"+{self.extra_kv_format}" if self.extra_kv_format else "")
        return f"{fmt} T={self.tokens} H={self.num_heads} topk={lists}"


# ---------------------------------------------------------------------- what to run
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=STEM, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), help="one model of the registry (default: every model)")
    ap.add_argument("--tp", type=int, default=DEFAULT_TP,
                    help="tensor-parallel degree: heads per GPU = the model's heads / tp (default %(default)s)")
    ap.add_argument("--format", dest="kv_format", help="only the shapes that read this cache format")
    ap.add_argument("--precision", action="append", choices=("f16", "bf16", "fp8", "mxf8"),
                    help="compute path(s) to run (repeatable; default: every one the GPU has for the format)")
    ap.add_argument("--tokens", help="comma-separated token counts (default 1,8,64; --quick 1,64)")
    ap.add_argument("--out", default=".", help="directory for the JSON, Markdown and PNG reports (default: .)")
    ap.add_argument("--quick", action="store_true", help="one shape per format pairing, two token counts")
    ap.add_argument("--no-timing", action="store_true", help="accuracy only")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default %(default)s)")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = _parser()
    args = ap.parse_args(argv)
    models = [args.model] if args.model else sorted(MODELS)
    for name in models:
        model = MODELS[name]
        if args.tp not in model.tps:
            ap.error(f"--tp {args.tp}: {name} ({model.heads} query heads) is deployed at tp {list(model.tps)}")
    try:
        args.token_counts = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else (
            QUICK_TOKENS if args.quick else TOKENS)
    except ValueError:
        ap.error(f"--tokens {args.tokens!r}: expected comma-separated positive ints")
    if any(t < 1 for t in args.token_counts):
        ap.error(f"--tokens {args.tokens!r}: expected comma-separated positive ints")
    args.models = models
    if args.kv_format is not None and not any(_reads(s, args.kv_format) for s in shapes_for(models, args.tp)):
        ap.error(f"--format {args.kv_format}: none of the shapes of {', '.join(models)} at tp {args.tp} reads it")
    return args


def _reads(shape, kv_format: str) -> bool:
    return kv_format in (shape.kv_format, shape.extra_kv_format)


def shapes_for(models, tp: int, kv_format: str | None = None, quick: bool = False) -> list:
    """The registry's deployment shapes of ``models`` at ``tp`` (``--format``: those reading
    ``kv_format``), one per (formats, list lengths) (the page sizes run the same kernels); with
    ``quick`` one per format pairing and whether there is an extra list."""
    out, seen = [], set()
    for name in models:
        model = MODELS[name]
        for s in DEPLOYMENT_SHAPES:
            if s.model != model.name or s.num_heads != model.heads // tp or (kv_format and not _reads(s, kv_format)):
                continue
            key = (s.model, s.kv_format, s.extra_kv_format) + ((s.extra_topk > 0,) if quick else (s.topk, s.extra_topk))
            if key not in seen:
                seen.add(key)
                out.append(s)
    return out


# ---------------------------------------------------------------------- peers
def flashinfer_call(q, cache, idx, kw, out, sm_scale: float):
    """The keyword arguments of FlashInfer's ``trtllm_batch_decode_sparse_mla_dsv4`` for these
    inputs, as vLLM calls it on SM120; or a string saying why FlashInfer does not take them."""
    from .adapters import DSV4_KV_CACHE_FORMATS

    pair = (kw["kv_format"], kw.get("extra_kv_format", kw["kv_format"]))
    names = [name for name, formats in DSV4_KV_CACHE_FORMATS.items() if formats == pair]
    if not names:
        return f"not available: FlashInfer's DeepSeek-V4 call reads no {'+'.join(pair)} caches"
    if q.shape[-2] not in FLASHINFER_HEADS:
        return f"not available: FlashInfer takes {FLASHINFER_HEADS} heads, not {q.shape[-2]}"
    T = q.shape[0]
    full = lambda n: idx.new_full((T,), n)  # noqa: E731
    call = dict(query=q, swa_kv_cache=cache, workspace_buffer=cache.new_empty(128 << 20), sparse_indices=idx,
                swa_topk_lens=kw.get("topk_length", full(idx.shape[-1])), out=out, bmm1_scale=sm_scale,
                sinks=kw.get("attn_sink"), kv_layout="NHD", kv_cache_format=names[0])
    if "extra_kv_cache" in kw:
        call.update(compressed_kv_cache=kw["extra_kv_cache"], extra_sparse_indices=kw["extra_indices"],
                    extra_sparse_topk_lens=kw.get("extra_topk_length", full(kw["extra_indices"].shape[-1])))
    return call


def flashmla_call(q, cache, idx, kw, sm_scale: float):
    """The arguments of FlashMLA's ``flash_mla_with_kvcache`` (sparse FP8 decode) for these
    inputs; or a string saying why FlashMLA does not take them."""
    if kw["kv_format"] != "model1_fp8" or kw.get("extra_kv_format", "model1_fp8") != "model1_fp8":
        return "not available: FlashMLA's sparse decode reads MODEL1 FP8 caches only"
    if q.shape[-2] not in FLASHMLA_HEADS:
        return f"not available: FlashMLA takes {FLASHMLA_HEADS} heads, not {q.shape[-2]}"
    call = dict(q=q.unsqueeze(1), k_cache=cache, block_table=None, cache_seqlens=None, head_dim_v=512,
                tile_scheduler_metadata=None, num_splits=None, softmax_scale=sm_scale, causal=False,
                is_fp8_kvcache=True, indices=idx.unsqueeze(1), attn_sink=kw.get("attn_sink"),
                topk_length=kw.get("topk_length"))
    if "extra_kv_cache" in kw:
        call.update(extra_k_cache=kw["extra_kv_cache"], extra_indices_in_kvcache=kw["extra_indices"].unsqueeze(1),
                    extra_topk_length=kw.get("extra_topk_length"))
    return call


def peer_functions(arch: str) -> dict:
    """peer name -> (the function to call, or None) and why not, for this GPU's arch."""
    peers = {}
    try:
        from flashinfer.decode import trtllm_batch_decode_sparse_mla_dsv4 as fi
    except Exception as err:  # not installed, or it fails to import
        peers["FlashInfer"] = (None, f"not available: flashinfer does not import ({type(err).__name__}: {err})")
    else:
        ok = arch in ("sm_120a", "sm_121a")
        peers["FlashInfer"] = (fi if ok else None, None if ok else
                               f"not available: FlashInfer's SM120 sparse MLA kernels run on sm_120 / sm_121, not {arch}")
    try:
        from flash_mla import flash_mla_with_kvcache as fm
    except Exception as err:
        peers["FlashMLA"] = (None, f"not available: flash_mla does not import ({type(err).__name__}: {err})")
    else:
        ok = arch == "sm_90a"
        peers["FlashMLA"] = (fm if ok else None, None if ok else
                             f"not available: FlashMLA's sparse decode runs on Hopper / datacenter Blackwell, not {arch}")
    return peers


# ---------------------------------------------------------------------- timing
def time_us(fn) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph, the L2 flushed before each."""
    import torch

    fn()  # load / compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(REPEATS):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def _time_peer(name: str, fn, call) -> float | str:
    if isinstance(call, str):
        return call
    try:
        if name == "FlashMLA":  # its scheduler metadata first, as FlashMLA's callers make it
            from flash_mla import get_mla_metadata

            call["tile_scheduler_metadata"], call["num_splits"] = get_mla_metadata()
        return time_us(lambda: fn(**call))
    except Exception as err:  # a peer's refusal of the shape is its answer, not a self-test failure
        return f"not available: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"


# ---------------------------------------------------------------------- the run
def run(args) -> tuple[dict, list[Row]]:
    import torch

    from cute_kernels.arch import arch_for_capability
    from cute_kernels.sparse_mla_decode.kv_format import get_format

    from . import loader, sparse_mla_decode
    from .check_aot import deployment_inputs, extra_format, shape_caches, spot_check
    from .variants import format_precisions

    arch = arch_for_capability(torch.cuda.get_device_capability())
    props = torch.cuda.get_device_properties(0)
    shapes = shapes_for(args.models, args.tp, args.kv_format, args.quick)
    caches = shape_caches(shapes, torch.Generator().manual_seed(args.seed))
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    peers = {} if args.no_timing else peer_functions(arch)
    rows = []
    for shape in shapes:
        fmts = (shape.kv_format, extra_format(shape))
        paths = [p for p in format_precisions(arch, shape.kv_format) if p in format_precisions(arch, fmts[1])]
        paths = [p for p in paths if p in args.precision] if args.precision else paths
        for T in args.token_counts:
            q, cache, idx, kw = deployment_inputs(shape, T, caches, has_len=True, has_extra_len=bool(shape.extra_topk),
                                                  has_sink=True, gen=gen)
            sm_scale = get_format(shape.kv_format).default_sm_scale
            peer_times = {}
            for name, (fn, why) in peers.items():
                if fn is None:
                    peer_times[name] = why
                else:
                    out = torch.empty(T, shape.num_heads, 512, dtype=torch.bfloat16, device="cuda")
                    call = (flashinfer_call(q, cache, idx, kw, out, sm_scale) if name == "FlashInfer"
                            else flashmla_call(q, cache, idx, kw, sm_scale))
                    peer_times[name] = _time_peer(name, fn, call)
            for precision in paths:
                out, _ = sparse_mla_decode(q, cache, idx, precision=precision, **kw)
                ratio, bad = spot_check(precision, q, cache, idx, kw, out)
                row = Row(shape.model, shape.num_heads, shape.kv_format, shape.extra_kv_format, shape.topk,
                          shape.extra_topk, shape.page_block_size, shape.extra_page_block_size, T, precision,
                          error_over_bound=ratio, passed=not bad, peers=peer_times)
                if not args.no_timing:
                    o = torch.empty_like(out)
                    row.us = time_us(lambda: sparse_mla_decode(q, cache, idx, precision=precision, out=o, **kw))
                rows.append(row)
                print(f"{'ok  ' if row.passed else 'FAIL'} {row.label} {precision}: error {ratio:.2f} x bound"
                      + (f", {row.us:.1f} us" if row.us is not None else ""), flush=True)
    from_where = {}
    for name, source in sorted(loader.sources.items()):
        from_where.setdefault(source, []).append(name)
    env = {"gpu": props.name, "arch": arch, "sms": props.multi_processor_count, "torch": torch.__version__,
           "cuda": torch.version.cuda, "dsl": _dsl_version(), "python": platform.python_version(),
           "deployment": f"{', '.join(args.models)} at tp {args.tp}", "kernels": from_where}
    return env, rows


def _dsl_version() -> str:
    from .fingerprint import dsl_libs, dsl_version

    return f"nvidia-cutlass-dsl {dsl_version()} ({dsl_libs()})"


# ---------------------------------------------------------------------- reports
def summary(env: dict, rows: list[Row]) -> str:
    """The one-line verdict."""
    failed = [r for r in rows if not r.passed]
    worst = max((r.error_over_bound for r in rows), default=math.nan)
    verdict = f"accuracy FAIL on {len(failed)} of {len(rows)}" if failed else f"accuracy PASS on all {len(rows)}"
    compiled = len(env["kernels"].get("compiled", []))
    peers = sorted({p for r in rows for p in r.peers})
    peer_text = "; ".join(
        f"{p} " + (f"timed on {sum(isinstance(r.peers.get(p), float) for r in rows)} rows"
                   if any(isinstance(r.peers.get(p), float) for r in rows)
                   else next(str(r.peers[p]) for r in rows if p in r.peers)) for p in peers)
    return (f"{STEM}: {env['gpu']} ({env['arch']}, {env['sms']} SMs), {env['deployment']}: {verdict} "
            f"(worst out error {worst:.2f} x its bound); kernels: {sum(len(v) for v in env['kernels'].values())} used, "
            f"{compiled} compiled in this process" + (f"; peers: {peer_text}" if peer_text else ""))


def markdown(env: dict, rows: list[Row]) -> str:
    peers = sorted({p for r in rows for p in r.peers})
    lines = [f"# {STEM}", "", f"{summary(env, rows)}", "",
             "| " + " | ".join(f"{k}" for k in ("gpu", "arch", "sms", "torch", "cuda", "dsl", "python")) + " |",
             "|" + " --- |" * 7,
             "| " + " | ".join(str(env[k]) for k in ("gpu", "arch", "sms", "torch", "cuda", "dsl", "python")) + " |",
             "", "Kernels by where they came from:", ""]
    lines += [f"- {source}: {len(names)}" for source, names in sorted(env["kernels"].items())]
    lines += ["", "| shape | path | error / bound | accuracy | us | " + " | ".join(f"{p} us" for p in peers) + " |",
              "| --- | --- | --- | --- | --- |" + " --- |" * len(peers)]
    for r in rows:
        peer_cells = [f"{r.peers[p]:.1f}" if isinstance(r.peers.get(p), float) else "n/a" for p in peers]
        lines.append(f"| {r.label} | {r.precision} | {r.error_over_bound:.2f} | {'pass' if r.passed else 'FAIL'} | "
                     + (f"{r.us:.1f}" if r.us is not None else "-") + " | " + " | ".join(peer_cells) + " |")
    reasons = sorted({f"{p}: {v}" for r in rows for p, v in r.peers.items() if isinstance(v, str)})
    if reasons:
        lines += ["", "Peers without a time:", ""] + [f"- {reason}" for reason in reasons]
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path) -> bool:
    """A bar chart of the times per shape and path (and peer); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    timed = [r for r in rows if r.us is not None]
    if not timed:
        return False
    labels = sorted({r.label for r in timed}, key=lambda lab: [r.label for r in timed].index(lab))
    series = {}
    for r in timed:
        series.setdefault(f"dsv4-sparse-mla {r.precision}", {})[r.label] = r.us
        for p, v in r.peers.items():
            if isinstance(v, float):
                series.setdefault(p, {})[r.label] = v
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(labels) * max(1, len(series))), 5))
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        xs = [i + k * width for i, lab in enumerate(labels) if lab in values]
        ax.bar(xs, [values[lab] for lab in labels if lab in values], width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("microseconds per call (CUDA graph, L2 flushed)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_reports(env: dict, rows: list[Row], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / f"{STEM}.json", out_dir / f"{STEM}.md"]
    written[0].write_text(json.dumps({"environment": env, "summary": summary(env, rows),
                                      "rows": [asdict(r) for r in rows]}, indent=1))
    written[1].write_text(markdown(env, rows))
    if plot(rows, out_dir / f"{STEM}.png"):
        written.append(out_dir / f"{STEM}.png")
    return written


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from cute_kernels.arch import SUPPORTED_ARCHS, arch_for_capability

    if not torch.cuda.is_available():
        print(f"{STEM}: no CUDA GPU is visible (torch.cuda.is_available() is False): run it on the GPU server",
              file=sys.stderr)
        return EXIT_NO_GPU
    if arch_for_capability(torch.cuda.get_device_capability()) is None:
        print(f"{STEM}: {torch.cuda.get_device_name()} is not a GPU this library serves ({', '.join(SUPPORTED_ARCHS)})",
              file=sys.stderr)
        return EXIT_NO_GPU
    env, rows = run(args)
    written = write_reports(env, rows, Path(args.out))
    print(markdown(env, rows))
    print(f"reports: {', '.join(str(p) for p in written)}")
    print(summary(env, rows))
    return 0 if all(r.passed for r in rows) else EXIT_ACCURACY


if __name__ == "__main__":
    sys.exit(main())
