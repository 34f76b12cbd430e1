"""Run a few decode calls per shape, for a profiler to attach to (ncu, compute-sanitizer).

    ncu --clock-control none --metrics gpu__time_duration.sum python -m scripts.profile_kernels 1x16x128 64x128x512
    DSV4_PRECISION=fp8 python -m scripts.profile_kernels ...   # the FP8 path (default: the dispatch's choice)
    DSV4_KV_FORMAT=v32_fp8 python -m scripts.profile_kernels 1x64x2048   # another cache format (default MODEL1)
    DSV4_LENGTHS=1 python -m scripts.profile_kernels 1x16x128+512   # with length tensors, as the engines call

Each SHAPE is TxHxTOPK[+EXTRA] (+EXTRA: formats with an extra cache only); caches and inputs
as in scripts.bench (262,144 tokens).
"""

from __future__ import annotations

import os
import sys

import torch


from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT, get_format
from dispatch import sparse_mla_decode
from dispatch.tools.sample_inputs import make_cache
from scripts.bench import length_tensors


def main(argv=None) -> int:
    shapes = (argv if argv is not None else sys.argv[1:]) or ["1x16x128"]
    fmt = get_format(os.environ.get("DSV4_KV_FORMAT") or DEFAULT_FORMAT)
    gen = torch.Generator().manual_seed(0)
    cache = make_cache(4096, 64, device="cuda", kv_format=fmt.name, gen=gen)
    for spec in shapes:
        T, H, rest = spec.split("x")
        topk, _, extra = rest.partition("+")
        T, H, topk, extra = int(T), int(H), int(topk), int(extra or 0)
        q = torch.randn(T, H, fmt.d_qk, device="cuda").bfloat16()
        idx = torch.randint(0, 4096 * 64, (T, topk), device="cuda", dtype=torch.int32)
        kw = {"precision": os.environ.get("DSV4_PRECISION") or None, "kv_format": fmt.name}
        if extra:
            kw.update(extra_kv_cache=cache,
                      extra_indices=torch.randint(0, 4096 * 64, (T, extra), device="cuda", dtype=torch.int32))
        if os.environ.get("DSV4_LENGTHS") == "1":  # every list at its full width (the kernels' length variants)
            kw.update(length_tensors(T, topk, extra))
        for _ in range(3):
            sparse_mla_decode(q, cache, idx, **kw)
        torch.cuda.synchronize()
        print(spec, "done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
