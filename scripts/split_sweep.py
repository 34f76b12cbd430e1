"""Time bench shapes with the split count forced, to tune ``dispatch/policy/splits.py`` by measurement.

    python -m scripts.split_sweep [--head-groups G] [--precision P] [--plan-only] [SHAPE ...]
    # SHAPE = TxHxTOPK[+EXTRA]; default: T=1, 8

``--head-groups 1`` or ``2`` forces 16-head or 32-head CTAs (where the dispatch would pick the
other); ``--precision`` times that compute path (default: the dispatch's); ``--plan-only``
times only the split count the dispatch picks (to compare head-group counts each at its
own plan).

For every shape: the split the dispatch picks for the call on this GPU
(``dispatch.policy.selection.select_kernels``, with the head groups ``--head-groups`` forces), then
the planned call timed (bench's method: CUDA-graph replay, ``do_bench`` median with its L2
clear) with the split count forced to each candidate (every count that equal chunk ranges
give, ``split_candidates``, up to ``MAX_SPLITS``) by ``dispatch.PlanOverrides``; the kernels
are the shipped ones. Prints one line per shape: us per split count, the best marked with *.
"""

from __future__ import annotations

import sys

import torch


from dispatch import PlanOverrides, validate_call
from dispatch.policy.selection import select_for_call
from dispatch.policy.splits import MAX_SPLITS
from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT
from scripts.bench import Caches, call_inputs, graph_time_us, inputs, plan_runner


def split_candidates(num_chunks: int) -> set:
    """Every split count that equal chunk ranges give (``PlanOverrides.num_splits``): ceil(chunks / per) for
    every chunks-per-split ``per``, up to ``MAX_SPLITS``."""
    return {-(-num_chunks // per) for per in range(1, num_chunks + 1)} & set(range(1, MAX_SPLITS + 1))


def main(argv=None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    groups, precision, plan_only = None, None, False
    while argv[:1] in (["--head-groups"], ["--precision"], ["--plan-only"]):
        if argv[0] == "--plan-only":
            plan_only = True
            argv = argv[1:]
            continue
        if argv[0] == "--head-groups":
            groups = int(argv[1])
        else:
            precision = argv[1]
        argv = argv[2:]
    specs = argv or [f"{T}x{H}x{s}" for T in (1, 8) for H in (16, 64, 128) for s in ("128", "512", "1024", "128+512")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    caches = Caches(cpu_gen)
    for spec in specs:
        T, H, shape = spec.split("x", 2)
        T, H = int(T), int(H)
        q, idx, e_idx, _ = inputs(T, H, shape, gen)
        cache, kw = call_inputs(shape, caches, DEFAULT_FORMAT, e_idx)
        call = validate_call(q, cache, idx, precision=precision, **kw)
        selection = select_for_call(call, PlanOverrides(head_groups=groups))
        chosen = selection.split
        candidates = {chosen.num_splits} if plan_only else split_candidates(chosen.num_chunks) | {chosen.num_splits}
        times = {}
        for s in sorted(candidates):
            times[s] = graph_time_us(plan_runner(q, cache, idx, kw=kw, precision=precision,
                                                 overrides=PlanOverrides(head_groups=groups, num_splits=s)))
        best = min(times, key=times.get)
        cells = " ".join(f"{s}:{us:.1f}{'*' if s == best else ''}" for s, us in times.items())
        label = f"{spec} g{selection.head_groups}"
        print(f"{label:>17} chosen {chosen.num_splits:>3} ({times[chosen.num_splits]:.1f} us)  {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
