"""Measure the Hopper route's table (``dispatch.policy.sm90_policy``): this library's routed call
against FlashMLA's SM90 sparse decode, both as the engines call them, on one GPU in one process.

    python -m dispatch.tools.sm90_route_table [--quick] [--flashmla MODULE] [--json out.json]
                                              [--python evidence.py] [--check] [--table FILE]
                                              [--check-only] [--seed N]
    dsv4-mla-selftest ... --route-table out.json       (the same measurement, after the self-test)

For each shape (family, real heads, tokens, lists): the query padded as vLLM and SGLang pad it
for FlashMLA (64 heads up to 64 real ones, else 128; the real heads random, the padded ones
zero, their sinks -inf), caches of 4096 page blocks x 64 tokens in FlashMLA's layouts
(DeepSeek-V4's MODEL1 records; DeepSeek-V3.2's 656-byte rows), random slots, every list at
its full length (the ratio-128 list: 512 valid entries of an 8192-wide row, as vLLM passes
it). FlashMLA: ``flash_mla_with_kvcache(q_padded, ..., tile_scheduler_metadata=<its own>,
out=out_padded)`` (``--flashmla``: the module that has it, default ``flash_mla``; vLLM's
``vllm.v1.attention.ops.flashmla`` is the same interface). This library:
``dispatch.engines.flashmla.flash_mla_with_kvcache`` on the same tensors with
``num_valid_heads`` = the real heads (what the route runs when it picks this library). The two
outputs' real heads must agree (rel L2 < 2e-2) before either is timed; each call is captured
in a CUDA graph and replayed with L2 cleared (``dispatch.tools.timing``).

The file ``--json`` writes is a route table (``sm90_policy.load_table``):
``DSV4_MLA_SM90_ROUTE_TABLE=out.json`` makes the engine plugins route by it on this GPU (an
H20's or an H100's table may differ from the shipped one, measured on an H200); ``--python``
writes the ``EVIDENCE`` literal of the policy module. ``--check`` then times the route itself
(``dispatch.engines.sm90_route``, with the table just measured, or ``--table FILE``; with
``--check-only`` no rows are measured and the shipped table is the default) against FlashMLA
on the registry's Hopper deployments (``CHECK_LISTS`` x ``CHECK_TOKENS``): what a routed engine
call costs.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import itertools
import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from cute_kernels.sparse_mla_decode.kv_format import get_format
from ..engines import flashmla as library
from ..engines import sm90_route
from ..engines.sites import site, within_site
from ..policy import sm90_policy
from .sample_inputs import make_cache, make_indices
from .selftest_peers import FLASHMLA_HEADS
from .timing import graph_time_us

NUM_BLOCKS, PAGE = 4096, 64
HEADS = (8, 16, 32, 64, 128)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUICK_TOKENS = (1, 4, 8, 64, 256)
# (family, main top-k, extra top-k, extra page, extra valid entries): DeepSeek-V4 / V4.1's SWA
# window alone, with a ratio-4 list (V4-Flash 512, V4-Pro 1024) and with a ratio-128 list (an
# 8192-wide row of which 512 are valid); DeepSeek-V3.2 / GLM-5's indexer top-k
LISTS = (("model1", 128, 0, None, 0), ("model1", 128, 512, 64, 512), ("model1", 128, 1024, 64, 1024),
         ("model1", 128, 8192, 2, 512), ("v32", 2048, 0, None, 0))
AGREE = 2e-2  # rel L2 between the two outputs' real heads (FlashMLA's e4m3 rounding against this library's)


@dataclass(frozen=True)
class Shape:
    family: str
    heads: int
    tokens: int
    topk: int
    extra_topk: int
    extra_page: int | None
    extra_valid: int

    @property
    def entries(self) -> int:  # what the route reads: the lists' widths
        return self.topk + self.extra_topk

    @property
    def label(self) -> str:
        extra = f"+{self.extra_topk}" if self.extra_topk else ""
        return f"{self.family} {self.heads}h T={self.tokens} {self.topk}{extra}"


# --check: the registry's Hopper deployments (V4-Flash TP 2 / 4 / 8: 32, 16, 8 heads; V4-Pro TP 4 / 8:
# 32, 16; DeepSeek-V3.2 TP 8: 16; GLM-5 TP 8: 8), their ratio-4 and ratio-128 layers, at the tokens of
# decode with MTP drafts and batches
CHECK_TOKENS = (1, 2, 4, 8, 64, 256)
CHECK_LISTS = ((("model1", 128, 512, 64, 512), (8, 16, 32)), (("model1", 128, 1024, 64, 1024), (16, 32)),
               (("model1", 128, 8192, 2, 512), (8, 16, 32)), (("v32", 2048, 0, None, 0), (8, 16)))


def shapes(quick: bool) -> list[Shape]:
    tokens = QUICK_TOKENS if quick else TOKENS
    return [Shape(f, h, t, k, e, p, v) for (f, k, e, p, v), h, t in itertools.product(LISTS, HEADS, tokens)]


def check_shapes() -> list[Shape]:
    return [Shape(*lists[:1], h, t, *lists[1:]) for lists, heads in CHECK_LISTS
            for h, t in itertools.product(heads, CHECK_TOKENS)]


_CACHES: dict = {}


def cache_of(kv_format: str, page: int, gen: torch.Generator) -> torch.Tensor:
    """The run's cache of ``kv_format`` in ``page``-token blocks (NUM_BLOCKS * PAGE tokens; made once)."""
    if (kv_format, page) not in _CACHES:
        _CACHES[kv_format, page] = make_cache(NUM_BLOCKS * PAGE // page, page, device="cuda", kv_format=kv_format,
                                              gen=gen)
    return _CACHES[kv_format, page]


def call_kwargs(shape: Shape, gen: torch.Generator) -> dict:
    """FlashMLA's keyword arguments for ``shape``, as vLLM passes them (query padded)."""
    fmt = get_format(sm90_policy.FORMAT_OF_FAMILY[shape.family])
    padded = next(h for h in FLASHMLA_HEADS if shape.heads <= h)  # as vLLM pads the query
    T = shape.tokens
    q = torch.zeros(T, 1, padded, fmt.d_qk, dtype=torch.bfloat16, device="cuda")
    q[:, :, :shape.heads] = torch.randn(T, 1, shape.heads, fmt.d_qk, generator=gen).to("cuda", torch.bfloat16)
    cache = cache_of(fmt.name, PAGE, gen)
    kw = dict(q=q, k_cache=cache, block_table=None, cache_seqlens=None, head_dim_v=fmt.d_v,
              softmax_scale=fmt.default_sm_scale, is_fp8_kvcache=True,
              indices=make_indices(T, shape.topk, NUM_BLOCKS * PAGE, device="cuda", gen=gen).view(T, 1, -1),
              out=torch.empty(T, 1, padded, fmt.d_v, dtype=torch.bfloat16, device="cuda"))
    if shape.family == "model1":  # FlashMLA's SM90 kernel takes no topk_length on V3.2 rows (nor does vLLM pass one)
        kw["topk_length"] = torch.full((T,), shape.topk, dtype=torch.int32, device="cuda")
        sink = torch.full((padded,), float("-inf"), device="cuda")
        sink[:shape.heads] = torch.randn(shape.heads, generator=gen).to("cuda")
        kw["attn_sink"] = sink
    if shape.extra_topk:
        kw.update(extra_k_cache=cache_of(fmt.name, shape.extra_page, gen),
                  extra_indices_in_kvcache=make_indices(T, shape.extra_topk, NUM_BLOCKS * PAGE, device="cuda",
                                                        gen=gen).view(T, 1, -1),
                  extra_topk_length=torch.full((T,), shape.extra_valid, dtype=torch.int32, device="cuda"))
    return kw


def runners(fm, shape: Shape, kw: dict, table: sm90_policy.RouteTable | None = None) -> dict:
    """No-argument calls, each returning its output: FlashMLA's, this library's
    (``num_valid_heads``), and with ``table`` the route's (the site's real heads set, as the
    plugins set them). A FlashMLA without ``out=`` (SGLang's sgl-flash-mla) allocates its
    output, as SGLang calls it, and so does every call here then."""
    takes_out = "out" in inspect.signature(fm.flash_mla_with_kvcache).parameters
    base = kw if takes_out else {k: v for k, v in kw.items() if k != "out"}

    def fresh():  # each call its own output buffer
        return dict(base, out=torch.empty_like(kw["out"])) if takes_out else dict(base)

    fm_kw, lib_kw = dict(fresh(), tile_scheduler_metadata=fm.get_mla_metadata()[0]), fresh()
    calls = {"flashmla": lambda: fm.flash_mla_with_kvcache(**fm_kw)[0],
             "library": lambda: library.flash_mla_with_kvcache(**lib_kw, kv_format=sm90_policy.FORMAT_OF_FAMILY[shape.family],
                                                               num_valid_heads=shape.heads, return_lse=False)[0]}
    if table is not None:
        route = sm90_route.make_route(fm.flash_mla_with_kvcache, logging.getLogger("sm90_route_table"), "the engine",
                                      table=table)
        route_kw = dict(fresh(), tile_scheduler_metadata=fm.get_mla_metadata()[0])
        where = site("bench", shape.heads, False)
        calls["routed"] = lambda: within_site(where, route, **route_kw)[0]
    return calls


def agreement(a: torch.Tensor, b: torch.Tensor, heads: int) -> float:
    a, b = a[:, :, :heads].double(), b[:, :, :heads].double()
    return ((a - b).norm() / b.norm()).item()


LIST_NAMES = {("model1", 128): "128 (SWA)", ("model1", 640): "128 + 512", ("model1", 1152): "128 + 1024",
              ("model1", 8320): "128 + 8192 (512 valid)", ("v32", 2048): "2048"}


def evidence_markdown(rows) -> str:
    """``rows`` as the table of ``docs/performance.md`` ("The Hopper route"): FlashMLA's time over
    this library's per shape, a row per (cache, lists, real heads), a column per token count."""
    tokens = sorted({r.tokens for r in rows})
    keys = list(dict.fromkeys((r.family, r.entries, r.heads) for r in rows))
    by = {(r.family, r.entries, r.heads, r.tokens): r for r in rows}
    lines = ["| cache | entries | heads | " + " | ".join(f"T={t}" for t in tokens) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in tokens) + " |"]
    for family, entries, heads in keys:
        cells = [f"{by[family, entries, heads, t].flashmla_us / by[family, entries, heads, t].library_us:.2f}"
                 if (family, entries, heads, t) in by else "" for t in tokens]
        name = {"model1": "MODEL1", "v32": "V3.2"}[family]
        lines.append(f"| {name} | {LIST_NAMES.get((family, entries), entries)} | {heads} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_summary(checks: list) -> str:
    """``--check``'s verdict: on how many deployment shapes the routed call took at most
    FlashMLA's time, the range of FlashMLA / routed, and at 16 heads per GPU with T <= 8
    (decode with MTP drafts) its geometric mean and range."""
    ratios = [c["flashmla_us"] / c["routed_us"] for c in checks]
    small = [r for c, r in zip(checks, ratios) if c["heads"] == 16 and c["tokens"] <= 8]
    lines = [f"routed <= FlashMLA on {sum(r >= 1 for r in ratios)} of {len(ratios)} shapes; FlashMLA / routed "
             f"{min(ratios):.2f}-{max(ratios):.2f}"]
    if small:
        mean = statistics.geometric_mean(small)
        lines.append(f"16 heads, T <= 8 ({len(small)} shapes): geometric mean {mean:.3f}, "
                     f"{min(small):.2f}-{max(small):.2f}")
    return "\n".join(lines)


def source_line() -> str:
    """The GPU, the date and the kernels' sources (their hash, as the loader's fingerprint has it)."""
    from ..runtime.fingerprint import PROJECT_VERSION, source_hash

    return (f"{torch.cuda.get_device_name()}, {datetime.date.today().isoformat()}, dsv4-sparse-mla "
            f"{PROJECT_VERSION}, kernel sources {source_hash()[:12]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dispatch.tools.sm90_route_table", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"tokens {QUICK_TOKENS} only")
    ap.add_argument("--flashmla", default="flash_mla", help="the module with FlashMLA's flash_mla_with_kvcache")
    ap.add_argument("--json", help="write the rows (a route table) here")
    ap.add_argument("--python", help="write the EVIDENCE literal of dispatch/policy/sm90_policy.py here")
    ap.add_argument("--markdown", help="write the rows as docs/performance.md's table here")
    ap.add_argument("--check", action="store_true", help="then time the route itself against FlashMLA")
    ap.add_argument("--table", help="the route table --check uses (default: the rows just measured)")
    ap.add_argument("--check-only", action="store_true", help="no new rows: --check the route with --table (default: "
                    "the shipped table, sm90_policy.EVIDENCE)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    fm = importlib.import_module(args.flashmla)
    gen = torch.Generator().manual_seed(args.seed)
    rows, checks = [], []
    table = sm90_policy.load_table(args.table) if args.table else None
    if args.check_only:
        args.check, table = True, table or sm90_policy.SHIPPED
    else:
        print(f"{'shape':<28} {'library us':>10} {'FlashMLA us':>11} {'FlashMLA/lib':>12} {'agree':>8}")
    for shape in [] if args.check_only else shapes(args.quick):
        kw = call_kwargs(shape, gen)
        calls = runners(fm, shape, kw)
        fm_out, lib_out = calls["flashmla"](), calls["library"]()
        torch.cuda.synchronize()
        err = agreement(lib_out, fm_out, shape.heads)
        if not err < AGREE:
            raise SystemExit(f"{shape.label}: this library and FlashMLA disagree (rel L2 {err:.2e} >= {AGREE}; seed "
                             f"{args.seed})")
        lib_us, fm_us = graph_time_us(calls["library"]), graph_time_us(calls["flashmla"])
        rows.append(sm90_policy.RouteRow(shape.family, shape.heads, shape.tokens, shape.entries, round(lib_us, 2),
                                         round(fm_us, 2)))
        print(f"{shape.label:<28} {lib_us:>10.1f} {fm_us:>11.1f} {fm_us / lib_us:>12.2f} {err:>8.1e}", flush=True)
    source = source_line()
    if args.json and rows:
        Path(args.json).write_text(sm90_policy.to_json(rows, source))
    if args.python:
        lines = [f'EVIDENCE_SOURCE = "{source}"', "EVIDENCE: tuple[RouteRow, ...] = tuple(RouteRow(*r) for r in ("]
        lines += [f'    ("{r.family}", {r.heads}, {r.tokens}, {r.entries}, {r.library_us}, {r.flashmla_us}),'
                  for r in rows]
        Path(args.python).write_text("\n".join(lines + ["))", ""]))
    if args.markdown and rows:
        Path(args.markdown).write_text(evidence_markdown(rows) + "\n")
    if args.check:
        table = table or sm90_policy.RouteTable(rows, f"measured in this run ({source})")
        print(f"\nroute table: {table.source}")
        print(f"\n{'shape':<28} {'routed us':>10} {'FlashMLA us':>11} {'FlashMLA/routed':>15} {'route':>8}")
        for shape in check_shapes():
            kw = call_kwargs(shape, gen)
            calls = runners(fm, shape, kw, table=table)
            routed_us, fm_us = graph_time_us(calls["routed"]), graph_time_us(calls["flashmla"])
            pick = table.choose(shape.family, shape.heads, shape.tokens, shape.entries)
            checks.append(dict(family=shape.family, heads=shape.heads, tokens=shape.tokens, entries=shape.entries,
                               routed_us=round(routed_us, 2), flashmla_us=round(fm_us, 2), route=pick))
            print(f"{shape.label:<28} {routed_us:>10.1f} {fm_us:>11.1f} {fm_us / routed_us:>15.2f} {pick:>8}", flush=True)
        print(check_summary(checks))
        if args.json:
            data = json.loads(Path(args.json).read_text()) if rows else {"source": source}
            Path(args.json).write_text(json.dumps({**data, "check": checks}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
