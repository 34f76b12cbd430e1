"""How a decode call is timed (``docs/performance.md``, "Method"): the one definition that
``scripts/bench.py`` and ``dsv4-mla-selftest`` share.

The call is captured in one CUDA graph and replayed; its time is the median of
``triton.testing.do_bench``, which clears L2 before every replay (a decode step reads its
cache from memory, not from the previous step's L2). ``plan_runner`` makes the call a serving
engine captures: a planned decode's ``plan.run`` on fixed tensors.
"""

from __future__ import annotations

import torch

from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT, get_format


def plan_runner(q, cache, idx, *, kw, precision, overrides, kv_format: str = DEFAULT_FORMAT,
                extra_kv_format: str | None = None):
    """A no-argument call of the planned decode on these inputs (``plan.run``: what a serving
    engine captures in a CUDA graph); its ``plan`` attribute is the plan. ``kw``: the extra
    cache's and the optional inputs' keyword arguments (``extra_kv_cache``, ``extra_indices``,
    ``topk_length``, ...)."""
    from ..api import plan_sparse_mla_decode

    out = torch.empty(*q.shape[:-1], get_format(kv_format).d_v, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    has_extra = kw.get("extra_kv_cache") is not None
    plan = plan_sparse_mla_decode(q, cache, idx, out=out, lse=lse, precision=precision, overrides=overrides,
                                  kv_format=kv_format, extra_kv_format=extra_kv_format if has_extra else None, **kw)
    scratch = plan.new_scratch()

    def run():
        return plan.run(q, cache, idx, out=out, lse=lse, scratch=scratch, **kw)

    run.plan = plan
    return run


def graph_time_us(fn) -> float:
    """Microseconds per call of ``fn`` (no arguments), replayed from a CUDA graph with L2
    cleared before every replay: the median of ``triton.testing.do_bench``. ``fn`` runs once
    eagerly first (kernels loaded, lazy state built) outside the capture."""
    from triton.testing import do_bench

    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, return_mode="median") * 1e3
