"""Where the time of a small decode call goes, on the GPU (a measurement aid for T=1 / T=8).

    python -m scripts.call_floor [SHAPE ...]   # SHAPE = TxHxTOPK[+EXTRA] of bench.py's grid

Prints (1) the floor of the bench's method itself: a CUDA graph of one trivial kernel, and of
two, timed exactly as scripts.bench times a call (graph replay, ``do_bench`` median with its
L2 clear); (2) per shape, the bench time of the call and, from ``torch.profiler`` over graph
replays each after a 256 MB L2 flush, the median GPU duration of each kernel it launches (the
merge kernel is a programmatic dependent launch: it starts while the partial kernel runs, so
the two durations overlap and do not add up), and the merge's tail: how long after the partial
kernel's end the merge ends.
"""

from __future__ import annotations

import sys
from statistics import median_high

import torch


from dispatch import sparse_mla_decode
from scripts.bench import Caches, call_inputs, graph_time_us, inputs
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
    shapes = (argv if argv is not None else sys.argv[1:]) or DEFAULT_SHAPES
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
        fn = lambda: sparse_mla_decode(q, cache, idx, **kw)  # noqa: E731
        print(f"{spec}: bench {graph_time_us(fn):.1f} us")
        for name, us in kernel_durations_us(fn).items():
            label = name if name.startswith("merge end") else "partial" if "partial" in name else \
                "merge" if "merge" in name else name[:60]
            print(f"    {label}: {us:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
