"""Check, on a GPU, that an AOT build serves the whole deployment registry with no compile:
``dsv4-mla-check-aot``.

    dsv4-mla-aot-build --out build/aot                       # once, on any machine (sm_120a, sm_121a)
    dsv4-mla-check-aot --aot-dir build/aot                   # on the GPU, a fresh process
    dsv4-mla-check-aot                                       # the manifest of an installed wheel

Runs every shape of ``dispatch.registry.DEPLOYMENT_SHAPES`` at one token and at 300 tokens
(one split and several), cycling through the optional inputs so that every registry variant
is used, with compiling switched off (a missing variant raises). Prints the number of
compiles (must be 0), how many variants were loaded, the time of the first call, and the
worst relative error against the float32 reference. ``--disk-cache`` instead checks that a
variant JIT-compiled by one process is loaded from the disk cache by the next.
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


def serve_registry(aot_dir: str | None) -> int:
    import torch

    from cute_kernels.sparse_mla_decode.reference import reference_decode

    from . import loader, sparse_mla_decode
    from .registry import DEPLOYMENT_SHAPES
    from .testing import make_cache

    if aot_dir is not None:
        loader.set_aot_dir(aot_dir)
    loader.set_require_aot(True)  # any compile would raise MissingAotVariant
    gen = torch.Generator().manual_seed(0)
    pages = sorted({s.page_block_size for s in DEPLOYMENT_SHAPES} |
                   {s.extra_page_block_size for s in DEPLOYMENT_SHAPES if s.extra_page_block_size})
    caches = {p: make_cache(max(16384 // p, 4), p, device="cuda", gen=gen) for p in pages}
    flags = itertools.cycle(itertools.product((False, True), repeat=3))
    worst, first_call, calls, used = 0.0, None, 0, set()
    for shape in DEPLOYMENT_SHAPES:
        has_len, has_extra_len, has_sink = next(flags)  # the same options at one split and at several
        for T in (1, 300):
            slots = caches[shape.page_block_size].shape[0] * shape.page_block_size
            q = torch.randn(T, shape.num_heads, 512, device="cuda").to(torch.bfloat16)
            idx = torch.randint(-1, slots, (T, shape.topk), device="cuda", dtype=torch.int32)
            kw = {}
            if has_len:
                kw["topk_length"] = torch.randint(0, shape.topk + 1, (T,), device="cuda", dtype=torch.int32)
            if has_sink:
                kw["attn_sink"] = torch.randn(shape.num_heads, device="cuda")
            if shape.extra_topk:
                extra = caches[shape.extra_page_block_size]
                e_slots = extra.shape[0] * shape.extra_page_block_size
                kw["extra_kv_cache"] = extra
                kw["extra_indices"] = torch.randint(-1, e_slots, (T, shape.extra_topk), device="cuda",
                                                    dtype=torch.int32)
                if has_extra_len:
                    kw["extra_topk_length"] = torch.randint(0, shape.extra_topk + 1, (T,), device="cuda",
                                                            dtype=torch.int32)
            t0 = time.perf_counter()
            out, lse = sparse_mla_decode(q, caches[shape.page_block_size], idx, **kw)
            torch.cuda.synchronize()
            if first_call is None:
                first_call = time.perf_counter() - t0
            calls += 1
            used.update(v.name for v in loader._compiled)
            if calls % 16 == 1:  # spot-check against the reference
                ref, _ = reference_decode(q, caches[shape.page_block_size], idx, **kw)
                rel = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                worst = max(worst, rel)
    print(json.dumps({"calls": calls, "compiles": loader.stats["compiled"], "aot_loaded": loader.stats["aot_loaded"],
                      "variants_used": len(used), "first_call_seconds": round(first_call, 4),
                      "worst_rel_l2_spot_checks": worst}))
    return 0 if loader.stats["compiled"] == 0 else 1


_ONE = """
import json
import torch
from dispatch import loader, sparse_mla_decode
from dispatch.testing import make_cache
loader.set_aot_dir({empty!r})
loader.PACKAGE_AOT_DIR = loader.Path({empty!r})
cache = make_cache(8, 64, device="cuda")
q = torch.randn(2, 16, 512, device="cuda").to(torch.bfloat16)
idx = torch.randint(0, 512, (2, 100), device="cuda", dtype=torch.int32)
sparse_mla_decode(q, cache, idx); torch.cuda.synchronize()
print(json.dumps(loader.stats))
"""


def disk_cache() -> int:
    cache_dir, empty = tempfile.mkdtemp(), tempfile.mkdtemp()
    env = {**os.environ, "DSV4_MLA_CACHE_DIR": cache_dir}
    script = _ONE.format(empty=empty)
    results = []
    for _ in range(2):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        results.append({**json.loads(out.stdout.strip().splitlines()[-1]), "process_seconds": round(time.perf_counter() - t0, 2)})
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
    if args.disk_cache:
        return disk_cache()
    return serve_registry(args.aot_dir)


if __name__ == "__main__":
    sys.exit(main())
