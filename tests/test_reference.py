"""The float64 reference against an independent brute-force loop (CPU)."""

import math

import pytest
import torch

from cute_kernels.sparse_mla_decode.cache_format import unpack_cache
from cute_kernels.sparse_mla_decode.layout import DEFAULT_SM_SCALE
from cute_kernels.sparse_mla_decode.reference import reference_decode
from dispatch.testing import make_cache, make_indices


def brute_force(q, cache, idx, sm_scale, lengths=None, sink=None, extra=None, extra_idx=None, extra_lengths=None):
    """One token, one head, one entry at a time, in float64."""
    rows = unpack_cache(cache).reshape(-1, 512).double()
    extra_rows = unpack_cache(extra).reshape(-1, 512).double() if extra is not None else None
    T, H, _ = q.shape
    out = torch.zeros(T, H, 512, dtype=torch.float64)
    lse = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        picked = []
        for table, lists, lens in ((rows, idx, lengths), (extra_rows, extra_idx, extra_lengths)):
            if table is None:
                continue
            n = lists.shape[1] if lens is None else min(max(int(lens[t]), 0), lists.shape[1])
            for j in range(n):
                s = int(lists[t, j])
                if 0 <= s < table.shape[0]:
                    picked.append(table[s])
        for h in range(H):
            if not picked:
                lse[t, h] = math.inf
                continue
            scores = [sm_scale * float(q[t, h].double() @ k) for k in picked]
            m = max(scores)
            weights = [math.exp(s - m) for s in scores]
            total = sum(weights)
            lse[t, h] = m + math.log(total)
            o = sum(w * k for w, k in zip(weights, picked)) / total
            if sink is not None:
                o = o * (1.0 / (1.0 + math.exp(float(sink[h]) - lse[t, h]))) if not math.isinf(sink[h]) else \
                    (o * 0.0 if sink[h] > 0 else o)
            out[t, h] = o
    return out, lse


@pytest.mark.parametrize("with_extra", [False, True])
def test_reference_matches_brute_force(with_extra):
    gen = torch.Generator().manual_seed(1234)
    T, H, topk = 4, 3, 20
    cache = make_cache(3, 16, device="cpu", gen=gen)
    idx = make_indices(T, topk, 48, device="cpu", invalid_frac=0.3, gen=gen)
    idx[2] = -1  # a token with nothing valid in the main list
    lengths = torch.tensor([20, 7, 0, 25], dtype=torch.int32)
    sink = torch.tensor([0.5, math.inf, -math.inf])
    q = torch.randn(T, H, 512, generator=gen).to(torch.bfloat16)
    kw = dict(topk_length=lengths, attn_sink=sink, sm_scale=0.05)
    bf_kw = dict(lengths=lengths, sink=sink)
    if with_extra:
        extra = make_cache(5, 2, device="cpu", gen=gen)
        e_idx = make_indices(T, 6, 10, device="cpu", invalid_frac=0.2, gen=gen)
        e_len = torch.tensor([6, -3, 4, 100], dtype=torch.int32)
        kw.update(extra_kv_cache=extra, extra_indices=e_idx, extra_topk_length=e_len)
        bf_kw.update(extra=extra, extra_idx=e_idx, extra_lengths=e_len)
    out, lse = reference_decode(q, cache, idx, **kw)
    bout, blse = brute_force(q, cache, idx, 0.05, **bf_kw)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(blse))
    if not with_extra:
        assert torch.isposinf(lse[2]).all() and (out[2] == 0).all()  # empty token: lse +inf, out 0
    fin = torch.isfinite(blse)
    assert out.dtype == lse.dtype == torch.float64
    assert torch.allclose(lse[fin], blse[fin], rtol=1e-12, atol=1e-12)
    assert torch.allclose(out, bout, rtol=1e-10, atol=1e-12)
    assert (out[:, 1] == 0).all()  # sink +inf silences the head


def test_duplicates_count_twice():
    gen = torch.Generator().manual_seed(7)
    cache = make_cache(2, 8, device="cpu", gen=gen)
    q = torch.randn(1, 2, 512, generator=gen).to(torch.bfloat16)
    once, lse1 = reference_decode(q, cache, torch.tensor([[3, 5]], dtype=torch.int32))
    twice, lse2 = reference_decode(q, cache, torch.tensor([[3, 3, 5]], dtype=torch.int32))
    assert not torch.allclose(once, twice)
    bout, blse = brute_force(q, cache, torch.tensor([[3, 3, 5]], dtype=torch.int32), DEFAULT_SM_SCALE)
    assert torch.allclose(twice, bout, rtol=1e-10, atol=1e-12) and torch.allclose(lse2, blse, rtol=1e-12)
