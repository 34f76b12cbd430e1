"""Check, on a GPU, that an AOT build serves the whole deployment registry with no compile and
correct results: ``dsv4-mla-check-aot``.

    dsv4-mla-aot-build --out build/aot                       # once, on any machine (sm_120a, sm_121a;
                                                             # --arch sm_80 --arch sm_86 --arch sm_89: 8.x)
    dsv4-mla-check-aot --aot-dir build/aot                   # on the GPU, a fresh process
    dsv4-mla-check-aot                                       # the manifest of an installed wheel

Runs every shape of ``dispatch.policy.registry.DEPLOYMENT_SHAPES`` (every cache format, each on a
cache of its format) at one token and at 300 tokens (one split and several) in every compute
path the GPU's arch has for the shape's format (``format_precisions``: "mxf8" only for UE8M0
scales and where the block-scaled MMA exists), cycling through the optional inputs so that
every registry variant is used, with compiling switched off (a missing variant raises). Every
``SPOT_EVERY``-th shape is spot-checked at both token counts (up to ``SPOT_TOKENS`` of its
tokens) against the float64 reference, with the bound the tests use (``dispatch.tools.accuracy``:
per token, the relative L2 error of out at most twice the rounding floor of the case). Prints
one JSON line: calls, compiles, variants loaded, the time of the first call, the spot checks
and the worst error / bound among them. Exits 1 when anything was compiled or a spot check
exceeds its bound (naming it), 2 on a GPU it does not serve or with no CUDA GPU at all (one
line says which). ``--disk-cache`` instead checks
that a variant JIT-compiled by one process is loaded from the disk cache by the next.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

SPOT_EVERY = 8  # spot-check every 8th deployment shape (at both token counts)
SPOT_TOKENS = 16  # of a call's tokens, at most this many (evenly spaced) are checked


def _token_subset(T: int, kw: dict):
    """The indices of the checked tokens of a T-token call, and ``kw`` restricted to them."""
    import torch

    rows = torch.linspace(0, T - 1, min(T, SPOT_TOKENS)).round().long().unique()
    per_token = ("topk_length", "extra_indices", "extra_topk_length")
    return rows, {k: (v[rows.to(v.device)] if k in per_token else v) for k, v in kw.items()}


def spot_check(precision: str, q, *, cache, idx, kw, out) -> tuple[float, list[int]]:
    """``out`` of a call against the float64 reference on a subset of its tokens: (worst
    error / bound, the tokens above their bound)."""
    import torch

    from cute_kernels.sparse_mla_decode.reference import reference_decode

    from .accuracy import out_error_and_bound, rounding_floor

    rows, sub = _token_subset(q.shape[0], kw)
    rows_dev = rows.to(q.device)
    qs, idxs = q[rows_dev], idx[rows_dev]
    ref_out, _ = reference_decode(qs, cache, idxs, **sub)
    floor = rounding_floor(precision, qs, cache=cache, idx=idxs, kw=sub, ref_out=ref_out)
    rel, bound = out_error_and_bound(out[rows_dev], ref_out, floor)
    ratio = torch.where(bound > 0, rel / bound.clamp_min(1e-300), torch.where(rel > 0, torch.inf, 0.0))
    return ratio.max().item(), rows[rel > bound].tolist()


def extra_format(shape) -> str:
    """The format of a deployment shape's extra cache: the shape's, or the main cache's."""
    return shape.extra_kv_format or shape.kv_format


def shape_caches(shapes, gen, device="cuda") -> dict:
    """A random cache per (format, page) the ``shapes`` read (main and extra caches), each of
    16384 tokens (at least 4 blocks)."""
    from .sample_inputs import make_cache

    needed = ({(s.kv_format, s.page_block_size) for s in shapes} |
              {(extra_format(s), s.extra_page_block_size) for s in shapes if s.extra_topk})
    return {(f, p): make_cache(max(16384 // p, 4), p, device=device, kv_format=f, gen=gen) for f, p in sorted(needed)}


def deployment_inputs(shape, T: int, caches: dict, *, has_len=False, has_extra_len=False, has_sink=False,
                      gen=None, device="cuda"):
    """(q, main cache, indices, the call's keyword arguments) of ``shape`` at ``T`` tokens on
    ``caches`` (``shape_caches``): random q, slots (-1 among them), lengths and sink where asked."""
    import torch

    from cute_kernels.sparse_mla_decode.kv_format import get_format

    cache = caches[shape.kv_format, shape.page_block_size]
    slots = cache.shape[0] * shape.page_block_size
    q = torch.randn(T, shape.num_heads, get_format(shape.kv_format).d_qk, device=device, generator=gen)
    q = q.to(torch.bfloat16)
    idx = torch.randint(-1, slots, (T, shape.topk), device=device, dtype=torch.int32, generator=gen)
    kw = {"kv_format": shape.kv_format}
    if has_len:
        kw["topk_length"] = torch.randint(0, shape.topk + 1, (T,), device=device, dtype=torch.int32, generator=gen)
    if has_sink:
        kw["attn_sink"] = torch.randn(shape.num_heads, device=device, generator=gen)
    if shape.extra_topk:
        extra = caches[extra_format(shape), shape.extra_page_block_size]
        e_slots = extra.shape[0] * shape.extra_page_block_size
        kw["extra_kv_cache"] = extra
        kw["extra_kv_format"] = extra_format(shape)
        kw["extra_indices"] = torch.randint(-1, e_slots, (T, shape.extra_topk), device=device, dtype=torch.int32,
                                            generator=gen)
        if has_extra_len:
            kw["extra_topk_length"] = torch.randint(0, shape.extra_topk + 1, (T,), device=device, dtype=torch.int32,
                                                    generator=gen)
    return q, cache, idx, kw


def serve_registry(aot_dir: str | None) -> int:
    import torch

    from ..api import device_target
    from ..runtime import loader
    from .. import sparse_mla_decode
    from ..policy.registry import DEPLOYMENT_SHAPES
    from ..policy.precision import format_precisions, precisions_for

    arch, _, _ = device_target(torch.cuda.current_device())
    if arch is None:
        print(f"dsv4-mla-check-aot: {torch.cuda.get_device_name()} is not a supported GPU", file=sys.stderr)
        return 2
    if aot_dir is not None:
        loader.set_aot_dir(aot_dir)
    loader.set_require_aot(True)  # any compile would raise MissingAotVariant
    caches = shape_caches(DEPLOYMENT_SHAPES, torch.Generator().manual_seed(0))
    first_call, calls, checks, worst, used, failures = None, 0, 0, 0.0, set(), []
    for precision in precisions_for(arch):
        flags = itertools.cycle(itertools.product((False, True), repeat=3))
        for i, shape in enumerate(DEPLOYMENT_SHAPES):
            has_len, has_extra_len, has_sink = next(flags)  # the same options at one split and at several
            if any(precision not in format_precisions(arch, f) for f in (shape.kv_format, extra_format(shape))):
                continue
            for T in (1, 300):
                q, cache, idx, kw = deployment_inputs(shape, T, caches, has_len=has_len, has_extra_len=has_extra_len,
                                                      has_sink=has_sink)
                t0 = time.perf_counter()
                out, lse = sparse_mla_decode(q, cache, idx, precision=precision, **kw)
                torch.cuda.synchronize()
                if first_call is None:
                    first_call = time.perf_counter() - t0
                calls += 1
                used.update(v.name for v in loader._compiled)
                if i % SPOT_EVERY == 0:
                    ratio, bad = spot_check(precision, q, cache=cache, idx=idx, kw=kw, out=out)
                    checks += 1
                    worst = max(worst, ratio)
                    if bad:
                        failures.append(f"{precision} {shape} T={T}: out error above the bound at tokens {bad[:5]}")
    print(json.dumps({"arch": arch, "precisions": list(precisions_for(arch)), "calls": calls,
                      "compiles": loader.stats["compiled"], "aot_loaded": loader.stats["aot_loaded"],
                      "variants_used": len(used), "first_call_seconds": round(first_call, 4), "spot_checks": checks,
                      "worst_out_error_over_bound": worst}))
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    if loader.stats["compiled"]:
        print(f"FAILED {loader.stats['compiled']} variants were compiled", file=sys.stderr)
    return 0 if loader.stats["compiled"] == 0 and not failures else 1


_ONE = """
import json
import torch
from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT, get_format
from dispatch import sparse_mla_decode
from dispatch.runtime import loader
from dispatch.tools.sample_inputs import make_cache
loader.set_aot_dir({empty!r})
loader.PACKAGE_AOT_DIR = loader.Path({empty!r})
cache = make_cache(8, 64, device="cuda")
q = torch.randn(2, 16, get_format(DEFAULT_FORMAT).d_qk, device="cuda").to(torch.bfloat16)
idx = torch.randint(0, 512, (2, 100), device="cuda", dtype=torch.int32)
sparse_mla_decode(q, cache, idx); torch.cuda.synchronize()
print(json.dumps(loader.stats))
"""


NO_GPU = 2  # the exit status without a CUDA GPU (1: a check failed)


def disk_cache() -> int:
    cache_dir, empty = tempfile.mkdtemp(), tempfile.mkdtemp()
    env = {**os.environ, "DSV4_MLA_CACHE_DIR": cache_dir}
    script = _ONE.format(empty=empty)
    results = []
    for _ in range(2):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        results.append({**json.loads(out.stdout.strip().splitlines()[-1]),
                        "process_seconds": round(time.perf_counter() - t0, 2)})
    print(json.dumps({"first_process": results[0], "second_process": results[1]}))
    ok = results[0]["compiled"] >= 1 and results[1]["compiled"] == 0 and results[1]["disk_loaded"] >= 1
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4-mla-check-aot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aot-dir", help="serve the registry from this AOT manifest with compiling off "
                                      "(default: $DSV4_MLA_AOT_DIR, then the installed package's)")
    ap.add_argument("--disk-cache", action="store_true", help="check the JIT disk cache across two processes")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():  # both checks launch kernels
        print("dsv4-mla-check-aot: no CUDA GPU is visible (torch.cuda.is_available() is False): it serves the "
              "registry's kernels on a GPU; run it on the server", file=sys.stderr)
        return NO_GPU
    if args.disk_cache:
        return disk_cache()
    return serve_registry(args.aot_dir)


if __name__ == "__main__":
    sys.exit(main())
