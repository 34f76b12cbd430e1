"""Time bench shapes with the split count forced, to tune ``dispatch/policy/splits.py`` by measurement.

    python -m scripts.split_sweep [--head-groups G] [--precision P] [--plan-only]
                                  [--valid N] [--splits S,S,..] [--bounds] [SHAPE ...]
    # SHAPE = TxHxTOPK[+EXTRA[@PAGE]]; default: T=1, 8

``--head-groups 1`` or ``2`` forces 16-head or 32-head CTAs (where the dispatch would pick the
other); ``--precision`` times that compute path (default: the dispatch's); ``--plan-only``
times only the split count the dispatch picks (to compare head-group counts each at its
own plan). ``--valid N``: the call passes length tensors, as DeepSeek-V4's engines do: the
main list's at its width, the extra list's N (vLLM 0.34's ratio-128 rows: 8192 wide, about
context / 128 valid; ``vllm/models/deepseek_v4/common/ops/cache_utils.py`` l. 669-671), so
that the kernels deal the live chunks across the splits.
``--splits``: time only these split counts (and the plan's; a count that equal chunk ranges
cannot give is left out); ``--bounds`` (the "f16" path of a format whose kernel can be held to
128 registers): time each count both ways, held to 128 registers (``b``, two CTAs per SM) and
not (``u``).

For every shape: the split the dispatch picks for the call on this GPU
(``dispatch.policy.selection.select_kernels``, with the head groups ``--head-groups`` forces), then
the planned call timed (bench's method: CUDA-graph replay, ``do_bench`` median with its L2
clear) with the split count forced to each candidate (every count that equal chunk ranges
give, ``split_candidates``, up to ``MAX_SPLITS``) by ``dispatch.PlanOverrides``; the kernels
are the shipped ones. Prints one line per shape: us per split count (with ``--bounds`` per
count and bound), the best marked with *.
"""

from __future__ import annotations

import argparse
import sys

import torch


from dispatch import PlanOverrides, validate_call
from dispatch.policy.selection import select_for_call
from dispatch.policy.splits import MAX_SPLITS
from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT
from scripts.bench import Caches, call_inputs, graph_time_us, inputs, length_tensors, list_lengths, plan_runner


def split_candidates(num_chunks: int) -> set:
    """Every split count that equal chunk ranges give (``PlanOverrides.num_splits``): ceil(chunks / per) for
    every chunks-per-split ``per``, up to ``MAX_SPLITS``."""
    return {-(-num_chunks // per) for per in range(1, num_chunks + 1)} & set(range(1, MAX_SPLITS + 1))


def length_kwargs(shape: str, T: int, valid: int) -> dict:
    """The length tensors of a call whose main list is valid to its width and whose extra list
    (``shape`` must have one) to ``valid`` entries."""
    topk, extra_topk = list_lengths(shape)
    if not extra_topk or not 0 <= valid <= extra_topk:
        raise SystemExit(f"--valid {valid}: shape {shape} needs an extra list of at least {valid} entries")
    return length_tensors(T, topk, extra_topk, valid)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.split_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-groups", type=int, choices=(1, 2))
    ap.add_argument("--precision")
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--valid", type=int, help="length tensors: the extra list's valid entries")
    ap.add_argument("--splits", help="comma-separated split counts to time (and the plan's)")
    ap.add_argument("--bounds", action="store_true", help="time each count held to 128 registers and not")
    ap.add_argument("shapes", nargs="*")
    args = ap.parse_args(argv)
    groups, precision = args.head_groups, args.precision
    only = None if args.splits is None else {int(s) for s in args.splits.split(",")}
    specs = args.shapes or [f"{T}x{H}x{s}" for T in (1, 8) for H in (16, 64, 128)
                            for s in ("128", "512", "1024", "128+512")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    caches = Caches(cpu_gen)
    for spec in specs:
        T, H, shape = spec.split("x", 2)
        T, H = int(T), int(H)
        q, idx, e_idx, _ = inputs(T, H, shape, gen)
        cache, kw = call_inputs(shape, caches, DEFAULT_FORMAT, e_idx)
        if args.valid is not None:
            kw.update(length_kwargs(shape, T, args.valid))
        call = validate_call(q, cache, idx, precision=precision, **kw)
        selection = select_for_call(call, PlanOverrides(head_groups=groups))
        chosen = selection.split
        candidates = split_candidates(chosen.num_chunks)
        if only is not None:
            candidates &= only
        candidates = {chosen.num_splits} if args.plan_only else candidates | {chosen.num_splits}
        bounds = (False, True) if args.bounds else (None,)
        times = {}
        for s in sorted(candidates):
            for b in bounds:
                over = PlanOverrides(head_groups=groups, num_splits=s, two_ctas_per_sm=b)
                times[s, b] = graph_time_us(plan_runner(q, cache, idx, kw=kw, precision=precision, overrides=over))
        best = min(times, key=times.get)
        plan = (chosen.num_splits, selection.two_ctas_per_sm if args.bounds else None)
        cells = " ".join(f"{s}{'' if b is None else 'b' if b else 'u'}:{us:.1f}{'*' if (s, b) == best else ''}"
                         for (s, b), us in times.items())
        label = f"{spec} g{selection.head_groups}" + ("" if args.valid is None else f" @{args.valid}")
        print(f"{label:>17} chosen {chosen.num_splits:>3}{'' if plan[1] is None else 'b' if plan[1] else 'u'} "
              f"({times[plan]:.1f} us)  {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
