"""Time bench shapes with the split count forced, to tune ``dispatch/splits.py`` by measurement.

    python scripts/split_sweep.py [--head-groups G] [--precision P] [--plan-only] [SHAPE ...]
    # SHAPE = TxHxTOPK[+EXTRA]; default: T=1, 8

``--head-groups 1`` or ``2`` forces 16-head or 32-head CTAs (where the dispatch would pick the
other), with the variant-space check off for the run; ``--precision`` times that compute path
(default: the dispatch's); ``--plan-only`` times only the split count ``plan_splits`` picks
(to compare head-group counts each at its own plan).

For every shape: the split ``plan_splits`` picks, then the call timed (bench.py's method:
CUDA-graph replay, ``do_bench`` median with its L2 clear) with the split count forced to
each candidate (every count that equal chunk ranges give, ``split_candidates``, up to
``MAX_SPLITS``). The forcing replaces ``dispatch.plan.plan_splits`` for the run; the kernels
and everything else are the shipped ones. Prints one line per shape: us per split count,
the best marked with *.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dispatch.api as api  # noqa: E402
import dispatch.plan as plan_mod  # noqa: E402
from dispatch import sparse_mla_decode  # noqa: E402
from dispatch.splits import MAX_SPLITS, SplitPlan, plan_splits  # noqa: E402
from dispatch.variants import DEFAULT_PRECISION, partial_shape_config  # noqa: E402
from scripts.bench import NUM_BLOCKS, PAGE, force_partial_config, graph_time_us, inputs  # noqa: E402
from tests.dsv4_inputs import make_cache  # noqa: E402


def forced(num_splits: int):
    """A ``plan_splits`` that splits every token's chunks ``num_splits`` ways (at most)."""
    def plan(num_tokens, num_heads, topk, extra_topk, *, cfg, num_sms, smem_per_sm):
        chunks = -(-topk // cfg.block_n) + -(-extra_topk // cfg.block_n)
        per = -(-chunks // min(num_splits, chunks))
        return SplitPlan(chunks, per, -(-chunks // per))
    return plan


def split_candidates(num_chunks: int) -> set:
    """Every split count that equal chunk ranges give (``forced``): ceil(chunks / per) for
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
            force_partial_config(head_groups=groups)
        else:
            precision = argv[1]
        argv = argv[2:]
    specs = argv or [f"{T}x{H}x{s}" for T in (1, 8) for H in (16, 64, 128) for s in ("128", "512", "1024", "128+512")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    caches = (make_cache(NUM_BLOCKS, PAGE, device="cuda", gen=cpu_gen),
              make_cache(NUM_BLOCKS, PAGE, device="cuda", gen=cpu_gen))
    props = torch.cuda.get_device_properties(0)
    for spec in specs:
        T, H, shape = spec.split("x", 2)
        T, H = int(T), int(H)
        q, cache, idx, kw, _ = inputs(T, H, shape, caches, gen)
        call = api.validate_call(q, cache, idx, **kw)
        cfg = partial_shape_config(H, T, props.multi_processor_count, precision or DEFAULT_PRECISION,
                                   topk=call.topk, extra_topk=call.extra_topk,
                                   smem_per_sm=props.shared_memory_per_multiprocessor, head_groups=groups)
        chosen = plan_splits(T, H, call.topk, call.extra_topk, cfg=cfg, num_sms=props.multi_processor_count,
                             smem_per_sm=props.shared_memory_per_multiprocessor)
        candidates = {chosen.num_splits} if plan_only else split_candidates(chosen.num_chunks) | {chosen.num_splits}
        times = {}
        for s in sorted(candidates):
            plan_mod.plan_splits = forced(s)
            api._PLANS.clear()
            try:
                times[s] = graph_time_us(lambda: sparse_mla_decode(q, cache, idx, precision=precision, **kw))
            finally:
                plan_mod.plan_splits = plan_splits
                api._PLANS.clear()
        best = min(times, key=times.get)
        cells = " ".join(f"{s}:{us:.1f}{'*' if s == best else ''}" for s, us in times.items())
        label = f"{spec} g{cfg.head_groups}"
        print(f"{label:>17} chosen {chosen.num_splits:>3} ({times[chosen.num_splits]:.1f} us)  {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
