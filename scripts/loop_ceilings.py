"""What bounds the "f16" kernel on the many-head shapes: those shapes timed with parts of its
main loop taken out (GPU; ``docs/performance.md``, "Where the time goes").

    python -m scripts.loop_ceilings [--tokens 64,256] [--heads 64,128] [--one-cta-per-sm] [--json out.json]

Each mode runs in its own process, which takes a part out of the MODEL1 FP8 "f16" kernel
before anything is compiled (``MODES``) and compiles the kernels afresh into a JIT cache
directory of this run's own (no AOT directory and no earlier cache is searched: the loader's
fingerprint does not see a part taken out):
- ``shipped``: the kernels as built (and as the loader finds them);
- ``no_softmax``: ``SpreadSoftmax.step`` reduced to its barriers: the warps still write their
  partial S and wait where the softmax waits, but no score, maximum or P is computed (PV
  multiplies whatever the P rows hold);
- ``no_softmax_no_conversion``: also every e4m3 -> f16 conversion (and the value bytes'
  pairing permute) taken out: the raw bytes go to the MMAs as f16 bits;
- ``no_softmax_no_barriers``: the softmax and every CTA barrier of the call's kernels taken
  out (the softmax's and every ``cute.arch.sync_threads``: the partial kernel's, its
  gather's, and the merge kernel's where a call splits): the warps run free, each on whatever
  its shared memory holds (a gather reading indices before they land may load fewer rows: an
  upper bound).
The outputs of the reduced kernels are meaningless (NaN or garbage); only their times are.
A reduced kernel is the shipped one minus that work, with the same gather, barriers, S
exchange, MMAs and dispatch (splits, head groups, register bound), so its time is what the
rest of the loop costs: how fast the kernel could be if that part were free.
``--one-cta-per-sm`` plans every call without the 128-register bound (``PlanOverrides``),
one CTA per SM: the occupancy an SM120 GPU gives these kernels.

Shapes: ``scripts.bench``'s grid rows with the given T and H (default: the many-head rows,
T 64 / 256 x H 64 / 128), its inputs and its timing (``dispatch.tools.timing``: the planned
call in a CUDA graph, L2 cleared before every call). "FlashMLA" is ``scripts.bench``'s
``FLASHMLA_US``, measured by the same method.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("shipped", "no_softmax", "no_softmax_no_conversion", "no_softmax_no_barriers")


def take_out(mode: str) -> None:
    """Take ``mode``'s part out of the "f16" kernel's main loop (module attributes the kernel
    reads when it is traced: call before any kernel is compiled in this process)."""
    import cutlass.cute as cute
    from cutlass import Int32

    from cute_kernels.sparse_mla_decode import softmax, warp_ops

    if mode in ("no_softmax", "no_softmax_no_conversion"):
        @cute.jit
        def step_barriers_only(self, sm, bases, valid_rows, tidx, step, stage_base):
            return self.step_barriers(step)

        softmax.SpreadSoftmax.step = step_barriers_only
    if mode == "no_softmax_no_conversion":
        def raw_bits(word, selector=None):
            return [word, word]

        # the conversion instruction's call, which ``warp_ops.OperandConversion`` makes on the
        # archs that have it (every one these modes are timed on)
        warp_ops.e4m3x4_to_f16x2 = raw_bits
    if mode == "no_softmax_no_barriers":
        @cute.jit
        def step_nothing(self, sm, bases, valid_rows, tidx, step, stage_base):
            return Int32(0)  # no head's maximum moved: no rescale either

        def no_barrier(*args, **kwargs):
            return None

        softmax.SpreadSoftmax.step = step_nothing
        cute.arch.sync_threads = no_barrier


def reduce_kernels(mode: str) -> None:
    """This process's kernels for ``mode``: ``take_out`` and a loader that only compiles (no AOT
    directory; ``child_env`` gives it an empty JIT cache), even where the environment asks for
    AOT kernels only. Nothing for "shipped"."""
    if mode == "shipped":
        return
    from dispatch.runtime import loader

    take_out(mode)
    loader.aot_dirs = lambda: []
    loader.set_require_aot(False)


def child_env(mode: str, cache_root: str) -> dict:
    """The environment of ``mode``'s process: a reduced mode's JIT cache in ``cache_root``
    (empty: made for this run), the shipped kernels where the loader finds them."""
    env = dict(os.environ)
    if mode != "shipped":
        env["DSV4_MLA_CACHE_DIR"] = str(Path(cache_root) / mode)
    return env


def _time_mode(mode: str, grid: list, out_json: str, one_cta_per_sm: bool) -> None:
    """In this process: ``mode``'s kernels, each grid shape's time into ``out_json``."""
    import torch

    from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT
    from dispatch import PlanOverrides
    from dispatch.tools.timing import graph_time_us, plan_runner
    from scripts.bench import Caches, call_inputs, inputs

    reduce_kernels(mode)
    gen = torch.Generator(device="cuda").manual_seed(0)
    caches = Caches(torch.Generator().manual_seed(0))
    overrides = PlanOverrides(two_ctas_per_sm=False) if one_cta_per_sm else PlanOverrides()
    times = {}
    for T, H, shape in grid:
        q, idx, e_idx, _ = inputs(T, H, shape, gen)
        cache, kw = call_inputs(shape, caches, DEFAULT_FORMAT, e_idx)
        us = graph_time_us(plan_runner(q, cache, idx, kw=kw, precision="f16", overrides=overrides,
                                       kv_format=DEFAULT_FORMAT))
        times[f"{T}x{H}x{shape}"] = us
        print(f"{mode}: T={T} H={H} topk={shape}: {us:.1f} us", file=sys.stderr, flush=True)
    Path(out_json).write_text(json.dumps(times))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="64,256", help="comma-separated T values of the bench grid (default: %(default)s)")
    ap.add_argument("--heads", default="64,128", help="comma-separated H values of the bench grid (default: %(default)s)")
    ap.add_argument("--one-cta-per-sm", action="store_true",
                    help="no 128-register bound: one CTA per SM, as on SM120 (default: the dispatch's choice)")
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # a child process: time this mode only
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from scripts.bench import FLASHMLA_US, GRID

    try:
        tokens = {int(t) for t in args.tokens.split(",")}
        heads = {int(h) for h in args.heads.split(",")}
    except ValueError:
        ap.error(f"--tokens and --heads take comma-separated integers, got {args.tokens!r} and {args.heads!r}")
    grid = [(T, H, s) for T, H, s in GRID if T in tokens and H in heads]
    if not grid:
        ap.error(f"no row of scripts.bench's grid has T in {sorted(tokens)} and H in {sorted(heads)}")
    if args.mode:
        _time_mode(args.mode, grid, args.out, args.one_cta_per_sm)
        return 0

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            out = Path(tmp) / f"{mode}.json"
            subprocess.run([sys.executable, "-m", "scripts.loop_ceilings", "--mode", mode, "--out", str(out),
                            "--tokens", args.tokens, "--heads", args.heads]
                           + (["--one-cta-per-sm"] if args.one_cta_per_sm else []),
                           env=child_env(mode, str(Path(tmp) / "jit")), check=True)
            results[mode] = json.loads(out.read_text())

    rows = []
    print(("one CTA per SM" if args.one_cta_per_sm else "the dispatch's CTAs per SM")
          + "; us per call (no sm: no softmax; cvt: conversions; bar: barriers)")
    print(f"{'T':>4} {'H':>4} {'topk':>8} {'shipped':>8} {'no sm':>8} {'no sm,cvt':>9} {'no sm,bar':>9} "
          f"{'FlashMLA':>8} {'FM/shipped':>10} {'FM/no sm':>8} {'FM/no sm,cvt':>12} {'FM/no sm,bar':>12}")
    for T, H, shape in grid:
        key = f"{T}x{H}x{shape}"
        us = {mode: results[mode][key] for mode in MODES}
        fm = FLASHMLA_US[(T, H, shape)]  # every grid shape has one
        rows.append(dict(T=T, H=H, topk=shape, us=us, flashmla_us=fm))
        ratios = [f"{fm / us[m]:>{w}.2f}" for m, w in zip(MODES, (10, 8, 12, 12))]
        print(f"{T:>4} {H:>4} {shape:>8} {us['shipped']:>8.1f} {us['no_softmax']:>8.1f} "
              f"{us['no_softmax_no_conversion']:>9.1f} {us['no_softmax_no_barriers']:>9.1f} {fm:>8.1f} "
              + " ".join(ratios))
    if args.json:
        import torch

        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                                   one_cta_per_sm=args.one_cta_per_sm, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
