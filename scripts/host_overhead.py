"""Host overhead per decode call on the GPU: eager calls minus CUDA-graph replays.

    python -m scripts.host_overhead [--calls 3000]

For a T=1 shape (H=16, topk=128) and a T=8 dual-cache shape, times back-to-back calls
of (a) the one-shot ``sparse_mla_decode`` (after its first call: the layout key, the plan
cache lookup and the launch), (v) the vLLM adapter ``trtllm_batch_decode_sparse_mla_dsv4``
as vLLM calls it (``out`` given, no lse), (b) a held ``DecodePlan.run``, (d)
``BoundDecode.run`` (``plan.bind``: tensors fixed, launch only) and (c) the replay of a
CUDA graph of ``DecodePlan.run``. Per call it prints the wall time (GPU work included) and
the host time (no synchronization); the last columns are the host time of (a) and (v) beyond
``plan.run``'s, and how ``plan.run``'s divides between the bare kernel launches and its
input checks and argument binding.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT, get_format
from dispatch import plan_sparse_mla_decode, sparse_mla_decode
from dispatch.engines.flashinfer_dsv4 import trtllm_batch_decode_sparse_mla_dsv4
from dispatch.tools.sample_inputs import make_cache, make_indices

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
        vllm_kw = dict(query=q, swa_kv_cache=cache, workspace_buffer=None, sparse_indices=idx, out=out,
                       bmm1_scale=FORMAT.default_sm_scale, kv_layout="NHD")
        if extra_topk:
            vllm_kw.update(compressed_kv_cache=extra, extra_sparse_indices=kw["extra_indices"])
        vllm = per_call_us(lambda: trtllm_batch_decode_sparse_mla_dsv4(**vllm_kw), args.calls)
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
        rows.append((name, one_shot, vllm, planned, bound_run, replay, launches, checks, len(plan._kernels)))
    print("per call, microseconds: wall time of back-to-back calls (GPU work included) / host time of a call")
    print(f"{'shape':<24} {'one-shot':>13} {'vLLM adapter':>13} {'plan.run':>13} {'bound.run':>13} {'graph':>6} "
          f"{'kernels':>7} | {'host beyond plan.run: one-shot':>30} {'vLLM':>6} | {'plan.run host: launches':>23} "
          f"{'checks':>7}")
    for name, a, v, b, d, c, launch_host, check_host, n in rows:
        print(f"{name:<24} {a[0]:>6.1f} /{a[1]:>5.1f} {v[0]:>6.1f} /{v[1]:>5.1f} {b[0]:>6.1f} /{b[1]:>5.1f} "
              f"{d[0]:>6.1f} /{d[1]:>5.1f} {c[0]:>6.1f} {n:>7} | {a[1] - b[1]:>30.1f} {v[1] - b[1]:>6.1f} | "
              f"{launch_host:>23.1f} {check_host:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
