"""Host overhead per decode call on the GPU: eager calls minus CUDA-graph replays.

    python -m scripts.host_overhead [--calls 3000]

For a T=1 shape (H=16, topk=128) and a T=8 dual-cache shape, times back-to-back calls
of (a) the one-shot ``sparse_mla_decode`` (validation + plan lookup + launch), (b) a held
``DecodePlan.run``, (d) ``BoundDecode.run`` (``plan.bind``: tensors fixed, launch only) and
(c) the replay of a CUDA graph of ``DecodePlan.run``. Wall time per call of (a)/(b)/(d)
minus (c) is the host overhead the call adds beyond the GPU work; the
host time of one call (no synchronization) is printed too, and how it divides between
the bare kernel launches and run()'s input checks and argument binding.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT, get_format
from dispatch import plan_sparse_mla_decode, sparse_mla_decode
from dispatch.testing import make_cache, make_indices

FORMAT = get_format(DEFAULT_FORMAT)  # MODEL1 caches: the shapes include an extra cache


def per_call_us(fn, calls: int) -> tuple[float, float]:
    """(wall time per call with the GPU work included, host time per call)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return wall / calls * 1e6, host / calls * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    cache = make_cache(64, 64, device="cuda", gen=gen)
    extra = make_cache(64, 64, device="cuda", gen=gen)
    rows = []
    for T, H, topk, extra_topk in ((1, 16, 128, 0), (8, 64, 128, 512)):
        q = torch.randn(T, H, FORMAT.d_qk, generator=gen).bfloat16().cuda()
        idx = make_indices(T, topk, 4096, device="cuda", gen=gen)
        kw = {}
        if extra_topk:
            kw = dict(extra_kv_cache=extra, extra_indices=make_indices(T, extra_topk, 4096, device="cuda", gen=gen))
        out = torch.empty(T, H, FORMAT.d_v, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(T, H, device="cuda")
        plan = plan_sparse_mla_decode(q, cache, idx, out=out, lse=lse, **kw)
        scratch = plan.new_scratch()

        def run():
            plan.run(q, cache, idx, out=out, lse=lse, scratch=scratch, **kw)

        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        one_shot = per_call_us(lambda: sparse_mla_decode(q, cache, idx, out=out, lse=lse, **kw), args.calls)
        planned = per_call_us(run, args.calls)
        bound = plan.bind(q, cache, idx, out=out, lse=lse, scratch=scratch, **kw)
        bound_run = per_call_us(bound.run, args.calls)
        replay = per_call_us(graph.replay, args.calls)
        # where plan.run's host time goes: the bare launches alone, and the checks + binding alone
        launches = per_call_us(lambda: [k[0].launch() for k in plan._kernels], args.calls)[1]
        real = plan._bind_and_launch
        plan._bind_and_launch = lambda values: None
        checks = per_call_us(run, args.calls)[1]
        plan._bind_and_launch = real
        name = f"T={T} H={H} topk={topk}" + (f"+{extra_topk}" if extra_topk else "")
        rows.append((name, one_shot, planned, bound_run, replay, launches, checks, len(plan._kernels)))
    print("per call, microseconds: wall time of back-to-back calls (GPU work included) / host time of a call")
    print(f"{'shape':<24} {'one-shot':>13} {'plan.run':>13} {'bound.run':>13} {'graph':>6} "
          f"{'overhead: one-shot':>19} {'plan.run':>9} {'bound.run':>10} {'launches':>9} {'host: launches':>15} "
          f"{'run checks':>11}")
    for name, a, b, d, c, launch_host, check_host, n in rows:
        print(f"{name:<24} {a[0]:>6.1f} /{a[1]:>5.1f} {b[0]:>6.1f} /{b[1]:>5.1f} {d[0]:>6.1f} /{d[1]:>5.1f} "
              f"{c[0]:>6.1f} {a[0] - c[0]:>19.1f} {b[0] - c[0]:>9.1f} {d[0] - c[0]:>10.1f} {n:>9} "
              f"{launch_host:>15.1f} {check_host:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
