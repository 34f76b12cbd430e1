"""Benchmark sparse-MLA decode on a GPU (``docs/performance.md`` has the method and the results).

    python -m scripts.bench [--kv-format NAME] [--extra-kv-format NAME] [--vs-kv-format NAME] [--long-context]
                            [--json out.json]
                            [--quick] [--precision P ...] [--tokens 1,64] [--head-groups G] [--stages S]
                            [--no-torch]

``--kv-format`` (default model1_fp8; ``dispatch.kv_formats.FORMATS``) picks the cache format
and with it the grid (``grid_for``): a format with an extra cache (DeepSeek-V4's and V4.1's)
runs T {1, 8, 64, 256} x H {16, 64, 128} x topk {128, 512, 1024, 128 + 512 extra}, the
shapes FlashMLA was measured on (FlashMLA's times: MODEL1 caches only); a format without an
extra cache runs T {1, 8, 64, 256} x H {16, 64, 128} x the top-k its models use in the
deployment registry (``dispatch.policy.registry``: 2048 for v32_fp8, 2176 for glm_nope_fp8).

``--vs-kv-format NAME`` also times every shape on caches of format NAME (same slots, same q,
the first precision) and adds the columns "us NAME" and "x NAME" (NAME's time / this one's):
two formats in the same run, for example ``--kv-format model1_nvfp4 --vs-kv-format
model1_fp8``. ``--extra-kv-format NAME`` reads the extra cache in NAME (a format the main
one pairs with: ``KvFormat.extras``), for example ``--kv-format v41_fp8
--extra-kv-format v41_nvfp4 --vs-kv-format v41_fp8``. ``--long-context`` adds the 1M-context decode shape of DeepSeek-V4, T=8, H=64,
main 128 + extra 8192 from a cache of 2-token pages ("128+8192@2"; C128 compression of a
million tokens), to a grid with an extra list.

``--precision`` (repeatable: bf16, f16, fp8, default) times each listed compute path; the
table's main columns are the first one's (default: the path the dispatch picks), the others
get a "us <precision>" column each. ``--head-groups`` / ``--stages`` force those choices on
every plan (``dispatch.PlanOverrides``).

Method: caches of 4096 page blocks x 64 tokens (262,144 tokens) in the format's layout, with
its default block stride (MODEL1: 37,440 bytes) and row pitch; q = randn bf16, d_qk wide;
sm_scale = the format's d_qk**-0.5. Single-cache shapes gather uniform random slots;
"128+512" shapes take main = the last 128 tokens of a sequence through a random block table
and extra = 512 random slots of a second cache ("128+8192@2": 8192 of a cache of the same
262,144 tokens in 2-token pages). Each call is captured in one CUDA graph and
replayed; time = median of ``triton.testing.do_bench`` (which clears L2 before every call;
``dispatch.tools.timing``, shared with ``dsv4-mla-selftest``).
GB/s counts T x (topk x the main format's + extra_topk x the extra format's bytes per token:
584, 384, 528, 288, 656). The copy
ceiling is measured in the same run (a 4 GiB device-to-device copy, bytes read + written).
"%mma" is the call's tensor work (``tensor_flops``: QK over d_qk dims and PV over d_v
columns per head and entry) per second
against the GPU's ``mma.sync`` f16 rate, also measured in the same run
(``scripts/mma_ceiling.py``): what bounds the many-head shapes is the MMAs and the
instructions around them, not the gather. The header line and the JSON (``conv_tflops``)
also give that rate with the "f16" kernel's operand work (e4m3 bytes converted in registers,
each used by 16 or 32 heads: ``converted_ceiling_tflops``), the most any kernel of that
design can reach. The torch column times the float32 reference (gather, dequantize, attention)
captured the same way. FlashMLA's times are its SM90 sparse FP8 decode measured on an H200
by the same method on MODEL1 caches (``docs/performance.md``); other formats have none.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from cute_kernels.sparse_mla_decode.kv_format import (
    DEFAULT_FORMAT, FORMATS, KvFormat, get_format,
)
from cute_kernels.sparse_mla_decode.reference import reference_decode
from dispatch import PlanOverrides
from dispatch.policy.registry import DEPLOYMENT_SHAPES
from dispatch.tools.sample_inputs import make_cache
from dispatch.tools.timing import graph_time_us, plan_runner

NUM_BLOCKS, PAGE = 4096, 64
# FlashMLA SM90 times (us) on an H200 by this method: (T, H, shape) -> us; the source of the
# FlashMLA table of docs/performance.md (tests/test_packaging.py checks that they agree)
FLASHMLA_US = {
    (1, 16, "128"): 15.1, (1, 16, "512"): 17.0, (1, 16, "1024"): 19.0,
    (1, 64, "128"): 15.5, (1, 64, "512"): 17.1, (1, 64, "1024"): 18.9,
    (1, 128, "128"): 14.5, (1, 128, "512"): 16.1, (1, 128, "1024"): 18.2,
    (8, 16, "128"): 15.8, (8, 16, "512"): 18.6, (8, 16, "1024"): 22.1,
    (8, 64, "128"): 16.0, (8, 64, "512"): 18.8, (8, 64, "1024"): 22.0,
    (8, 128, "128"): 15.7, (8, 128, "512"): 19.0, (8, 128, "1024"): 22.9,
    (64, 16, "128"): 18.2, (64, 16, "512"): 43.1, (64, 16, "1024"): 60.9,
    (64, 64, "128"): 18.1, (64, 64, "512"): 43.5, (64, 64, "1024"): 60.8,
    (64, 128, "128"): 18.2, (64, 128, "512"): 32.3, (64, 128, "1024"): 51.1,
    (1, 16, "128+512"): 17.2, (1, 64, "128+512"): 17.2, (1, 128, "128+512"): 16.4,
    (8, 16, "128+512"): 19.2, (8, 64, "128+512"): 19.2, (8, 128, "128+512"): 20.3,
    (64, 16, "128+512"): 47.8, (64, 64, "128+512"): 47.9, (64, 128, "128+512"): 39.5,
    (256, 16, "128"): 35.0, (256, 16, "512"): 78.5, (256, 16, "1024"): 132.2, (256, 16, "128+512"): 91.5,
    (256, 64, "128"): 34.9, (256, 64, "512"): 78.9, (256, 64, "1024"): 132.0, (256, 64, "128+512"): 91.0,
    (256, 128, "128"): 51.2, (256, 128, "512"): 105.8, (256, 128, "1024"): 178.4, (256, 128, "128+512"): 128.7,
}


def tensor_flops(T: int, H: int, shape: str, fmt: KvFormat = FORMATS[DEFAULT_FORMAT]) -> int:
    """The tensor work of a call in FLOPs: QK (d_qk dims) and PV (d_v value columns) per head
    and entry (without the kernels' padding of heads to 16 and of entries to 32)."""
    return 2 * T * H * sum(list_lengths(shape)) * (fmt.d_qk + fmt.d_v)


def copy_ceiling_gbs() -> float:
    from triton.testing import do_bench

    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * (4 << 30) / (ms * 1e-3) / 1e9


# (T, H, shape): "128+512" is a 128-entry main window plus 512 entries of the extra cache
GRID = [(T, H, s) for T in (1, 8, 64, 256) for H in (16, 64, 128) for s in ("128", "512", "1024", "128+512")]
QUICK_TOKENS = (1, 64)


LONG_CONTEXT = (8, 64, "128+8192@2")  # --long-context: 1M tokens of context, C128-compressed


def grid_for(kv_format: str) -> list[tuple[int, int, str]]:
    """The bench grid of a format: a format with an extra cache (DeepSeek-V4's and V4.1's) runs
    ``GRID`` (FlashMLA's times are for MODEL1's); a format without one runs the same tokens and
    heads at each top-k its models use in the deployment registry (one source for both)."""
    if get_format(kv_format).extras:
        return GRID
    topks = sorted({s.topk for s in DEPLOYMENT_SHAPES if s.kv_format == kv_format and not s.extra_topk})
    return [(T, H, str(k)) for T in (1, 8, 64, 256) for H in (16, 64, 128) for k in topks]


def list_lengths(shape: str) -> tuple[int, int]:
    """(topk, extra_topk) of a grid shape."""
    topk, _, extra = shape.partition("+")
    return int(topk), int(extra.partition("@")[0] or 0)


def length_tensors(num_tokens: int, topk: int, extra_topk: int, extra_valid: int | None = None) -> dict:
    """``topk_length`` with every token's main list at its full width, and where there is an
    extra list ``extra_topk_length`` at ``extra_valid`` entries (default: its full width)."""
    lengths = {"topk_length": torch.full((num_tokens,), topk, dtype=torch.int32, device="cuda")}
    if extra_topk:
        valid = extra_topk if extra_valid is None else extra_valid
        lengths["extra_topk_length"] = torch.full((num_tokens,), valid, dtype=torch.int32, device="cuda")
    return lengths


def extra_page_of(shape: str) -> int:
    """The extra cache's page size of a grid shape ("128+8192@2": 2; default ``PAGE``)."""
    return int(shape.partition("@")[2] or PAGE)


class Caches:
    """The bench's caches, built on first use: per (format, role, page), 4096 x 64 tokens."""

    def __init__(self, gen: torch.Generator):
        self.gen, self.built = gen, {}

    def get(self, kv_format: str, role: str, page: int = PAGE) -> torch.Tensor:
        key = (kv_format, role, page)
        if key not in self.built:
            self.built[key] = make_cache(NUM_BLOCKS * PAGE // page, page, device="cuda", kv_format=kv_format,
                                         gen=self.gen)
        return self.built[key]


def inputs(T, H, shape, gen, kv_format: str = DEFAULT_FORMAT):
    """q, the main slots, the extra slots (or None) and the entries per token of a grid shape
    (``kv_format``: the caches' format, for q's width)."""
    q = torch.randn(T, H, get_format(kv_format).d_qk, generator=gen, device="cuda").to(torch.bfloat16)
    topk, extra_topk = list_lengths(shape)
    if extra_topk:  # main: the last `topk` tokens of each sequence through a random block table
        table = torch.randperm(NUM_BLOCKS, generator=gen, device="cuda")
        end = torch.randint(topk, NUM_BLOCKS * PAGE, (T, 1), generator=gen, device="cuda")
        pos = end - topk + torch.arange(topk, device="cuda")
        idx = (table[pos // PAGE] * PAGE + pos % PAGE).to(torch.int32)
        e_idx = torch.randint(0, NUM_BLOCKS * PAGE, (T, extra_topk), generator=gen, device="cuda", dtype=torch.int32)
        return q, idx, e_idx, topk + extra_topk
    idx = torch.randint(0, NUM_BLOCKS * PAGE, (T, topk), generator=gen, device="cuda", dtype=torch.int32)
    return q, idx, None, topk


def call_inputs(shape: str, caches: Caches, kv_format: str, e_idx, extra_kv_format: str | None = None):
    """The main cache and the extra cache's keyword arguments of a grid shape in ``kv_format``
    (the extra cache in ``extra_kv_format``, default the main's)."""
    kw = {} if e_idx is None else dict(
        extra_kv_cache=caches.get(extra_kv_format or kv_format, "extra", extra_page_of(shape)), extra_indices=e_idx)
    return caches.get(kv_format, "main"), kw


def print_table(rows: list, precisions: list) -> None:
    """The bench table (``FLASHMLA_US`` as this module has it, also for an older JSON's rows)."""
    vs = rows[0].get("vs_kv_format") if rows else None
    print(f"{'T':>4} {'H':>4} {'topk':>10} {'us':>8} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>7} {'%mma':>6} "
          f"{'torch us':>9} {'x torch':>8} "
          f"{'FlashMLA us':>11} {'x FlashMLA':>10}" + "".join(f" {'us ' + p:>9}" for p in precisions[1:])
          + (f" {'us ' + vs:>17} {'x ' + vs:>16}" if vs else ""))
    for r in rows:
        # an older JSON's rows are MODEL1's; FlashMLA's times are for MODEL1 caches alone
        model1 = (r.get("kv_format", DEFAULT_FORMAT) == DEFAULT_FORMAT
                  and r.get("extra_kv_format") in (None, DEFAULT_FORMAT))
        fm = FLASHMLA_US.get((r["T"], r["H"], r["topk"])) if model1 else None
        fm = f"{fm:>11.1f} {fm / r['us']:>10.2f}" if fm else f"{'-':>11} {'-':>10}"
        print(f"{r['T']:>4} {r['H']:>4} {r['topk']:>10} {r['us']:>8.1f} {r['gbs']:>7.0f} {100 * r['frac_copy']:>5.1f}% "
              f"{r['tflops']:>7.0f} {100 * r['frac_mma']:>5.1f}% "
              f"{r['torch_us']:>9.1f} {r['speedup_vs_torch']:>8.1f} {fm}"
              + "".join(f" {r['us_by_precision'][p]:>9.1f}" for p in precisions[1:])
              + (f" {r['vs_us']:>17.1f} {r['vs_us'] / r['us']:>16.2f}" if vs else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-format", default=DEFAULT_FORMAT, choices=sorted(FORMATS),
                    help="the caches' format, and with it the grid (default: %(default)s)")
    ap.add_argument("--extra-kv-format", choices=sorted(FORMATS),
                    help="the extra cache's format (default: the main cache's; KvFormat.extras lists the pairs)")
    ap.add_argument("--vs-kv-format", choices=sorted(FORMATS),
                    help="also time every shape on caches of this format, for both caches (same slots and q), "
                         "and compare")
    ap.add_argument("--long-context", action="store_true",
                    help="add the 1M-context shape T=8 H=64 128+8192 (extra cache in 2-token pages)")
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    ap.add_argument("--from-json", help="print the table of an earlier --json run and exit (no GPU needed)")
    ap.add_argument("--quick", action="store_true", help="T=1 and 64 only, no torch reference")
    ap.add_argument("--precision", action="append", choices=("default", "bf16", "f16", "fp8", "mxf8"),
                    help="compute path(s) to time (repeatable; default: the dispatch's choice)")
    ap.add_argument("--tokens", help="comma-separated T values of the grid to run (default: all)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch reference timing")
    ap.add_argument("--head-groups", type=int, choices=(1, 2),
                    help="force 16-head (1) or 32-head (2) CTAs on every call")
    ap.add_argument("--stages", type=int, choices=(2, 3),
                    help="force every partial kernel's raw row stages (default: the dispatch's)")
    args = ap.parse_args(argv)
    if args.from_json:
        rows = json.loads(Path(args.from_json).read_text())["rows"]
        print_table(rows, [rows[0]["precision"], *[p for p in rows[0]["us_by_precision"] if p != rows[0]["precision"]]])
        return 0
    precisions = args.precision or ["default"]
    overrides = PlanOverrides(head_groups=args.head_groups, num_stages=args.stages)
    fmt = get_format(args.kv_format)
    full_grid = grid_for(fmt.name)
    vs = get_format(args.vs_kv_format) if args.vs_kv_format else None
    if vs is not None and (vs.d_qk != fmt.d_qk or grid_for(vs.name) != full_grid):
        ap.error(f"--vs-kv-format {vs.name}: not the same grid and query width as {fmt.name}")
    for f in [fmt] + ([vs] if vs is not None else []):
        for p in precisions if f is fmt else precisions[:1]:
            if p != "default" and p not in f.paths:
                ap.error(f"--precision {p} does not read {f.name} caches (one of {f.paths})")
    if not fmt.main:
        ap.error(f"--kv-format {fmt.name} is read only as an extra cache: pass it as --extra-kv-format")
    extra_fmt = args.extra_kv_format
    if extra_fmt is not None and extra_fmt not in fmt.extras:
        ap.error(f"--extra-kv-format {extra_fmt}: a {fmt.name} main cache pairs with {fmt.extras}")
    if extra_fmt is not None:
        for p in precisions:
            if p != "default" and p not in get_format(extra_fmt).paths:
                ap.error(f"--precision {p} does not read {extra_fmt} caches (one of {get_format(extra_fmt).paths})")
    if args.long_context:
        if not fmt.extras:
            ap.error(f"--long-context: {fmt.name} has no extra cache")
        full_grid = full_grid + [LONG_CONTEXT]
    # the MMA ceilings build CuTe DSL kernels: imported by a run only, so that the grid and the
    # table import anywhere (scripts.sm120_forecast, --from-json)
    from scripts.mma_ceiling import HEAD_GROUPS, converted_ceiling_tflops, mma_ceiling_tflops

    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    caches = Caches(cpu_gen)
    ceiling = copy_ceiling_gbs()
    mma_tflops = mma_ceiling_tflops()
    conv_tflops = {16 * g: converted_ceiling_tflops(g) for g in HEAD_GROUPS}  # heads per operand -> TFLOP/s
    print(f"{fmt.name} caches ({fmt.bytes_per_token} B per token, d_qk {fmt.d_qk}, d_v {fmt.d_v})"
          + (f", extra caches {extra_fmt}" if extra_fmt else "") + "; "
          f"device {torch.cuda.get_device_name()}, copy ceiling {ceiling:.0f} GB/s, "
          f"mma.sync f16 ceiling {mma_tflops:.0f} TFLOP/s; with e4m3 operands converted in registers "
          + ", ".join(f"{r:.0f} ({h} heads each)" for h, r in conv_tflops.items()), flush=True)
    tokens = {int(t) for t in args.tokens.split(",")} if args.tokens else None
    grid = [row for row in full_grid
            if (not args.quick or row[0] in QUICK_TOKENS) and (tokens is None or row[0] in tokens)]
    rows = []
    for n, (T, H, shape) in enumerate(grid):
        q, idx, e_idx, _ = inputs(T, H, shape, gen, fmt.name)
        cache, kw = call_inputs(shape, caches, fmt.name, e_idx, extra_fmt)
        times = {p: graph_time_us(plan_runner(q, cache, idx, kw=kw, precision=None if p == "default" else p,
                                              overrides=overrides, kv_format=fmt.name, extra_kv_format=extra_fmt))
                 for p in precisions}
        vs_us = None
        if vs is not None:
            vs_cache, vs_kw = call_inputs(shape, caches, vs.name, e_idx)
            first = None if precisions[0] == "default" else precisions[0]
            vs_us = graph_time_us(plan_runner(q, vs_cache, idx, kw=vs_kw, precision=first, overrides=overrides,
                                              kv_format=vs.name))
        us = times[precisions[0]]
        ref_us = (math.nan if args.quick or args.no_torch
                  else graph_time_us(lambda: reference_decode(q, cache, idx, dtype=torch.float32, kv_format=fmt.name,
                                                              extra_kv_format=extra_fmt if kw else None, **kw)))
        topk, extra_topk = list_lengths(shape)
        extra_bpt = get_format(extra_fmt).bytes_per_token if extra_fmt else fmt.bytes_per_token
        gbs = T * (topk * fmt.bytes_per_token + extra_topk * extra_bpt) / (us * 1e-6) / 1e9
        fm = FLASHMLA_US.get((T, H, shape)) if fmt.name == DEFAULT_FORMAT and extra_fmt in (None,
                                                                                            DEFAULT_FORMAT) else None
        tflops = tensor_flops(T, H, shape, fmt) / (us * 1e-6) / 1e12
        row = dict(kv_format=fmt.name, extra_kv_format=extra_fmt, T=T, H=H, topk=shape, us=us, gbs=gbs, frac_copy=gbs / ceiling, tflops=tflops,
                   frac_mma=tflops / mma_tflops, torch_us=ref_us,
                   speedup_vs_torch=ref_us / us, flashmla_us=fm, vs_flashmla=(fm / us) if fm else None,
                   precision=precisions[0], us_by_precision=times,
                   vs_kv_format=vs.name if vs else None, vs_us=vs_us)
        rows.append(row)
        print(f"[{n + 1}/{len(grid)}] T={T} H={H} topk={shape}: {us:.1f} us"
              + (f", {vs.name} {vs_us:.1f} us" if vs else ""), file=sys.stderr, flush=True)
    print_table(rows, precisions)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), kv_format=fmt.name,
                                                   extra_kv_format=extra_fmt,
                                                   copy_gbs=ceiling,
                                                   mma_tflops=mma_tflops, conv_tflops=conv_tflops, rows=rows),
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
