"""Where the time of a small decode call goes, on the GPU (a measurement aid for T=1 / T=8).

    python -m scripts.call_floor [--lengths] [SHAPE ...]   # SHAPE = TxHxTOPK[+EXTRA] of bench.py's grid

Prints (1) the floor of the bench's method itself: a CUDA graph of one trivial kernel, and of
two, timed exactly as scripts.bench times a call (graph replay, ``do_bench`` median with its
L2 clear); (2) per shape, the bench time of the call and, from ``torch.profiler`` over graph
replays each after a 256 MB L2 flush, the median GPU duration of each kernel it launches (the
merge kernel is a programmatic dependent launch: it starts while the partial kernel runs, so
the two durations overlap and do not add up), and the merge's tail: how long after the partial
kernel's end the merge ends; (3) where the call merges, the bench time of the same plan with
its merge launch left out (the partial kernel alone: an incomplete result, timed only), and
the difference: what the merge kernel adds to the call as the bench sees it, the most that
doing the merge inside the partial kernel could save.

``--lengths`` passes length tensors (every list at its full width), as the engines call: the
kernels' length variants, which bound each token's chunks on the device.
"""

from __future__ import annotations

import sys
from statistics import median_high

import torch


from scripts.bench import Caches, call_inputs, graph_time_us, inputs, length_tensors, plan_runner
from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT

DEFAULT_SHAPES = ["1x16x128", "1x64x1024", "1x128x1024", "1x128x128+512", "8x16x128", "8x128x1024"]


def kernel_durations_us(fn, replays: int = 20) -> dict:
    """Median GPU duration (us) of each kernel of ``fn``, graph-replayed after an L2 flush, and of
    the merge's tail (key "merge end - partial end") where it launches one of each."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            flush.zero_()
            graph.replay()
        torch.cuda.synchronize()
    spans = {}  # kernel name: (start, end) of each replay's launch, in replay order
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and "sparse_mla" in ev.name:
            spans.setdefault(ev.name, []).append((ev.time_range.start, ev.time_range.end))
    durations = {name: median_high([end - start for start, end in s]) for name, s in spans.items()}
    partial = [s for name, s in spans.items() if "partial" in name]
    merge = [s for name, s in spans.items() if "merge" in name]
    if len(partial) == 1 and len(merge) == 1 and len(partial[0]) == len(merge[0]):
        # the merge's tail: how long after the partial kernel's end the call's last kernel ends
        durations["merge end - partial end"] = median_high([m[1] - p[1] for p, m in zip(sorted(partial[0]),
                                                                                   sorted(merge[0]))])
    return durations


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    with_lengths = "--lengths" in args
    shapes = [a for a in args if a != "--lengths"] or DEFAULT_SHAPES
    x = torch.zeros(16, device="cuda")
    print(f"graph of one trivial kernel: {graph_time_us(lambda: x.add_(1.0)):.2f} us; "
          f"of two: {graph_time_us(lambda: (x.add_(1.0), x.mul_(1.0))):.2f} us")
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    caches = Caches(cpu_gen)
    for spec in shapes:
        T, H, shape = spec.split("x")
        q, idx, e_idx, _ = inputs(int(T), int(H), shape, gen)
        cache, kw = call_inputs(shape, caches, DEFAULT_FORMAT, e_idx)
        if with_lengths:
            kw.update(length_tensors(int(T), idx.shape[-1], 0 if e_idx is None else e_idx.shape[-1]))
        fn = plan_runner(q, cache, idx, kw=kw, precision=None, overrides=None)
        plan = fn.plan
        call_us = graph_time_us(fn)
        print(f"{spec}{' (lengths)' if with_lengths else ''}: bench {call_us:.1f} us, {plan.num_splits} splits")
        for name, us in kernel_durations_us(fn).items():
            label = name if name.startswith("merge end") else "partial" if "partial" in name else \
                "merge" if "merge" in name else name[:60]
            print(f"    {label}: {us:.1f} us")
        kernels = plan._kernels  # (the plan's launches in order: the partial kernel(s), then the merge)
        if len(kernels) == 2:  # one partial kernel and the merge: time the partial kernel alone
            plan._kernels = kernels[:1]
            try:
                alone_us = graph_time_us(fn)
            finally:
                plan._kernels = kernels
            print(f"    bench without the merge launch: {alone_us:.1f} us (the merge adds {call_us - alone_us:.1f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
