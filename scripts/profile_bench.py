"""Time the Ampere / Ada arch profiles against this GPU's own build on the bench shapes, in one
process (``docs/performance.md``, "The 8.x profiles on the test GPU").

    python -m scripts.profile_bench [--profiles sm_80,sm_86,sm_89] [--kv-format NAME] [--precision P]
                                    [--tokens 1,64] [--jobs N] [--json out.json]

An arch profile (``cute_kernels.arch.profile``) is the code an 8.x target runs (no PDL; on
sm_80 / sm_86 the e4m3 and e2m1 bytes turned into f16 by integer operations; the target's
compute paths, shared memory and CTAs per SM) compiled for this GPU. Its time against this
GPU's own build on the same inputs is what those choices cost here; it is not an 8.x GPU's
time (the forecast, ``scripts/forecast_8x.py``, estimates that).

Every kernel the runs need is compiled first, in ``--jobs`` parallel processes into the JIT
disk cache (``dispatch.runtime.loader``), then each shape is timed for every target in turn,
on ``scripts.bench``'s inputs and by its method (``dispatch.tools.timing.graph_time_us``: the
planned call in a CUDA graph, L2 cleared before every replay, the median). Run it without
``DSV4_MLA_ARCH_PROFILE``: the profiles are planned here by name.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import statistics
import sys
from pathlib import Path

import torch

from cute_kernels.arch import PROFILE_ARCHS, PROFILE_ENV, arch_facts, profile
from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT, FORMATS, get_format
from dispatch.api import device_target, validate_tensors
from dispatch.policy.precision import precisions_for
from dispatch.policy.selection import select_for_call
from dispatch.runtime import loader
from dispatch.runtime.decode_inputs import DecodeTensors
from dispatch.runtime.plan import DecodePlan
from dispatch.tools.timing import graph_time_us
from scripts.bench import QUICK_TOKENS, Caches, call_inputs, grid_for, inputs


def validated(target: str, q, cache, idx, kw, *, precision, kv_format, extra_kv_format, out, lse):
    """The call validated for ``target`` (this GPU's arch or a profile's name) on this GPU's SMs."""
    _, num_sms, smem_per_sm = device_target(q.device.index)
    given = DecodeTensors(q=q, kv_cache=cache, indices=idx, out=out, lse=lse, **kw)
    return validate_tensors(given, precision=precision, kv_format=kv_format,
                            extra_kv_format=extra_kv_format if kw else None, for_plan=True,
                            _target=(target, num_sms, smem_per_sm))


def _compile(variant) -> str:
    """A worker's job: compile ``variant`` into the JIT disk cache (no GPU work)."""
    loader.get_compiled(variant)
    return variant.name


def compile_all(variants, jobs: int) -> None:
    """Compile every variant not in the JIT disk cache yet, ``jobs`` processes at a time."""
    todo = sorted(variants, key=lambda v: v.name)
    print(f"compiling {len(todo)} kernel variants ({jobs} processes; those in the JIT disk cache load at once)",
          file=sys.stderr, flush=True)
    with cf.ProcessPoolExecutor(max_workers=max(1, min(jobs, len(todo))), mp_context=mp.get_context("spawn")) as pool:
        for n, name in enumerate(pool.map(_compile, todo), 1):
            print(f"[{n}/{len(todo)}] {name}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default=",".join(PROFILE_ARCHS),
                    help="comma-separated targets whose profiles to time (default: %(default)s)")
    ap.add_argument("--kv-format", default=DEFAULT_FORMAT, choices=sorted(f for f in FORMATS if FORMATS[f].main),
                    help="the caches' format, and with it the grid (scripts.bench.grid_for; default: %(default)s)")
    ap.add_argument("--precision", choices=("bf16", "f16", "fp8"),
                    help="the compute path (default: the dispatch's); one every profile has")
    ap.add_argument("--tokens", help="comma-separated T values of the grid (default: all; --quick: 1,64)")
    ap.add_argument("--quick", action="store_true", help=f"T={','.join(map(str, QUICK_TOKENS))} only")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile processes")
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    args = ap.parse_args(argv)
    if os.environ.get(PROFILE_ENV):
        ap.error(f"unset {PROFILE_ENV}: this script plans each profile by name beside this GPU's own build")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    own = device_target(device.index)[0]
    if own is None:
        ap.error(f"{torch.cuda.get_device_name()} is not a GPU these kernels run on")
    try:
        targets = [own] + [profile(p.strip(), own).name for p in args.profiles.split(",") if p.strip()]
    except ValueError as err:
        ap.error(str(err))
    lacking = [arch_facts(t).label for t in targets if args.precision and args.precision not in precisions_for(t)]
    if lacking:
        ap.error(f"--precision {args.precision}: not a compute path of {', '.join(lacking)}")
    fmt = get_format(args.kv_format)
    tokens = ({int(t) for t in args.tokens.split(",")} if args.tokens
              else set(QUICK_TOKENS) if args.quick else None)
    grid = [row for row in grid_for(fmt.name) if tokens is None or row[0] in tokens]
    gen = torch.Generator(device="cuda").manual_seed(0)
    caches = Caches(torch.Generator().manual_seed(0))
    shapes = []
    for T, H, shape in grid:
        q, idx, e_idx, _ = inputs(T, H, shape, gen, fmt.name)
        cache, kw = call_inputs(shape, caches, fmt.name, e_idx)
        out = torch.empty(T, H, fmt.d_v, dtype=torch.bfloat16, device=device)
        lse = torch.empty(T, H, dtype=torch.float32, device=device)
        shapes.append(((T, H, shape), dict(q=q, cache=cache, idx=idx, kw=kw, out=out, lse=lse)))

    def call_of(target, t):
        return validated(target, t["q"], t["cache"], t["idx"], t["kw"], precision=args.precision,
                         kv_format=fmt.name, extra_kv_format=fmt.name, out=t["out"], lse=t["lse"])

    # every kernel first (a compile never lands inside a timing), then the times
    compile_all({v for _, t in shapes for target in targets for v in select_for_call(call_of(target, t)).variants},
                args.jobs)
    rows = []
    for n, ((T, H, shape), t) in enumerate(shapes):
        us = {}
        for target in targets:
            plan = DecodePlan(call_of(target, t))
            scratch = plan.new_scratch()
            us[target] = graph_time_us(lambda: plan.run(t["q"], t["cache"], t["idx"], out=t["out"], lse=t["lse"],
                                                        scratch=scratch, **t["kw"]))
        rows.append(dict(T=T, H=H, topk=shape, us=us))
        print(f"[{n + 1}/{len(shapes)}] T={T} H={H} topk={shape}: "
              + ", ".join(f"{arch_facts(k).label} {v:.1f} us" for k, v in us.items()), file=sys.stderr, flush=True)
    print_table(rows, targets, torch.cuda.get_device_name(), fmt.name, args.precision)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), kv_format=fmt.name,
                                                   precision=args.precision, targets=targets, rows=rows), indent=1))
    return 0


def print_table(rows: list, targets: list, device: str, kv_format: str, precision) -> None:
    """One row per shape: this GPU's build's time, then each profile's and its ratio to it
    (profile / own: above 1, the profile is slower); the geometric mean of each ratio last."""
    own, profiles = targets[0], targets[1:]
    print(f"{device}, {kv_format} caches, precision {precision or 'default'}: us per call; "
          f"x = profile time / {own} time")
    print(f"{'T':>4} {'H':>4} {'topk':>8} {own:>9}" + "".join(f" {arch_facts(p).profile_of:>9} {'x':>6}"
                                                        for p in profiles))
    for r in rows:
        print(f"{r['T']:>4} {r['H']:>4} {r['topk']:>8} {r['us'][own]:>9.1f}"
              + "".join(f" {r['us'][p]:>9.1f} {r['us'][p] / r['us'][own]:>6.2f}" for p in profiles))
    if rows:
        print(f"{'geomean':>18} {'':>9}" + "".join(
            f" {'':>9} {statistics.geometric_mean(r['us'][p] / r['us'][own] for r in rows):>6.2f}"
            for p in profiles))


if __name__ == "__main__":
    sys.exit(main())
