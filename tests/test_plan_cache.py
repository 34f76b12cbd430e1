"""The one-shot call's plan cache (CPU): layout keys and the order of the tensors keyed, the caps
on entries and buffer bytes, the discarded lse's views, thread safety, and a cache hit that
launches what ``DecodePlan.run`` launches."""

import math
import threading
import types

import pytest
import torch

from cute_kernels.sparse_mla_decode.kernel_args import LOG2_E
from cute_kernels.sparse_mla_decode.kv_format import MODEL1_NVFP4
from dispatch import InvalidDecodeInput, sparse_mla_decode
from dispatch.runtime.decode_inputs import DecodeTensors
from dispatch.runtime.plan_cache import PlanCache, layout_key
from dispatch.tools.sample_inputs import make_cache, make_indices
from tests.dispatch_inputs import MODEL1, _cpu_plan, _misaligned


def test_layout_keys_tell_every_layout_apart():
    """The one-shot call's plan cache (``dispatch.runtime.plan_cache``) keys a call by its layout:
    tensors that differ only in a stride, a dtype, a device or an optional input, and calls
    that differ only in the formats or precision they name, never share a key (so never a
    plan); new values in new tensors of the same layout do."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(4, 16, 512, generator=gen).bfloat16()
    cache = make_cache(4, 64, device="cpu", gen=gen)
    idx = make_indices(4, 128, 256, device="cpu", gen=gen)
    out, lse = torch.empty(4, 16, 512, dtype=torch.bfloat16), torch.empty(4, 16)
    lens = torch.full((4,), 100, dtype=torch.int32)

    def key(q=q, cache=cache, idx=idx, lens=None, out=out, kv_format=None, extra_kv_format=None, precision=None):
        return layout_key((q, cache, idx, lens, None, out, lse, None, None, None), (kv_format, extra_kv_format,
                                                                                    precision))

    base = key()
    assert base == key(q=q.clone(), cache=make_cache(4, 64, device="cpu", gen=gen), idx=idx.clone(), out=out.clone())
    variants = {
        "strides": key(q=torch.empty(4, 16, 1024, dtype=torch.bfloat16)[..., :512]),
        "dtype": key(idx=idx.long()),
        "device": key(q=q.to("meta")),
        "optional input": key(lens=lens),
        "out allocated by the call": key(out=None),
        "shape": key(idx=idx[:, :64]),
        "named format": key(kv_format=MODEL1),
        "named extra format": key(extra_kv_format=MODEL1_NVFP4.name),
        "precision": key(precision="bf16"),
    }
    for what, k in variants.items():
        assert k != base, what
    assert len(set(variants.values())) == len(variants)
    with pytest.raises(AttributeError):  # not a tensor: the call is validated in full, which refuses it
        key(q=[1.0])


def test_the_one_shot_call_keys_its_tensors_in_run_order(monkeypatch):
    """``sparse_mla_decode`` builds its ``DecodeTensors`` by position (its hot path): the record
    the one-shot call keys and launches must hold each tensor in its own field."""
    from dispatch import api
    from dispatch.runtime import plan_cache

    seen = []

    def capture(tensors, names):
        seen.append(tensors)
        raise AttributeError("captured")  # then the full validation, which refuses the markers

    monkeypatch.setattr(api, "layout_key", capture)
    markers = {name: object() for name in DecodeTensors._fields}
    with pytest.raises(InvalidDecodeInput):
        sparse_mla_decode(markers["q"], markers["kv_cache"], markers["indices"],
                          **{name: m for name, m in markers.items() if name not in ("q", "kv_cache", "indices")})
    assert seen and all(t is markers[name] for t, name in zip(seen[0], DecodeTensors._fields))
    assert len(seen[0]) == len(DecodeTensors._fields) and plan_cache.layout_key is not capture


def test_plan_cache_caps_come_from_the_environment(monkeypatch):
    from dispatch.runtime.plan_cache import BYTES_ENV, DEFAULT_BYTES, DEFAULT_ENTRIES, ENTRIES_ENV

    monkeypatch.delenv(ENTRIES_ENV, raising=False)
    monkeypatch.delenv(BYTES_ENV, raising=False)
    assert (PlanCache().capacity, PlanCache().byte_cap) == (DEFAULT_ENTRIES, DEFAULT_BYTES)
    monkeypatch.setenv(ENTRIES_ENV, "12")
    monkeypatch.setenv(BYTES_ENV, "0")  # keep no buffer: every call gets its own
    assert (PlanCache().capacity, PlanCache().byte_cap) == (12, 0)
    info = PlanCache().info()
    assert info == {"entries": 0, "capacity": 12, "buffer_bytes": 0, "byte_cap": 0, "scratch_bytes": 0,
                    "lse_bytes": 0, "buffers": 0}
    for value in ("0", "-1", "many"):
        monkeypatch.setenv(ENTRIES_ENV, value)
        with pytest.raises(ValueError, match=f"{ENTRIES_ENV}={value!r}: expected an int of at least 1"):
            PlanCache()


def test_plan_cache_keeps_buffers_within_its_byte_cap(monkeypatch):
    """One buffer per kind and stream, grown to the largest need while the kept buffers fit the
    byte cap; a need past it gets a buffer of its own that the cache does not keep."""
    import dispatch.runtime.plan_cache as pc

    monkeypatch.setattr(pc, "_capturing", lambda: False)
    monkeypatch.setattr(pc, "raw_stream", lambda index: 7)
    cache = PlanCache(capacity=4, byte_cap=1000)

    def alloc(n):
        return lambda: torch.empty(n, dtype=torch.uint8)

    first = cache._buffer("scratch", 0, 300, alloc(300))[0]
    assert cache._buffer("scratch", 0, 200, alloc(200))[0] is first  # big enough: reused
    grown = cache._buffer("scratch", 0, 600, alloc(600))[0]
    assert grown is not first and cache.info()["scratch_bytes"] == 600
    lse = cache._buffer("lse", 0, 400, alloc(400))[0]
    assert cache.info()["buffer_bytes"] == 1000 and cache.info()["lse_bytes"] == 400
    own, own_views = cache._buffer("lse", 0, 500, alloc(500))  # 600 + 500 > 1000: the call's own, no views
    assert own is not lse and own_views is None and cache.info()["lse_bytes"] == 400
    assert cache._buffer("lse", 0, 100, alloc(100))[0] is lse
    assert cache.info()["buffer_bytes"] <= cache.byte_cap
    cache.clear()
    assert cache.info()["buffers"] == 0


def test_discarded_lse_is_one_view_per_layout_of_the_kept_buffer(monkeypatch):
    """A call that wants no lse gets a view of the stream's kept lse buffer: the same view
    while that buffer is kept; the views go with a buffer that grows (the old one is freed),
    and none is kept of a call served past the byte cap (its own buffer is not kept)."""
    import dispatch.runtime.plan_cache as pc

    monkeypatch.setattr(pc, "_capturing", lambda: False)
    monkeypatch.setattr(pc, "raw_stream", lambda index: 7)
    cache = PlanCache(capacity=4, byte_cap=400)
    plan = types.SimpleNamespace(device_index=0, device=torch.device("cpu"))

    def entry(tokens, heads):
        e = pc.CachedPlan(plan, torch.empty(tokens, heads, 8), torch.empty(tokens, heads))
        cache.put((tokens, heads), e)
        return e

    small, large, huge = entry(2, 16), entry(4, 16), entry(8, 16)
    first = cache.discarded_lse(small)
    assert first.shape == (2, 16) and cache.discarded_lse(small) is first  # repeated: the same view
    kept = first._base
    grown = cache.discarded_lse(large)  # 256 bytes: the buffer grows, the old views are dropped
    (_, _, views), = cache._buffers.values()
    assert grown._base is not kept and list(views) == [(4, 16)]  # the old buffer's views are gone with it
    again = cache.discarded_lse(small)
    assert again._base is grown._base and again.shape == (2, 16)
    own = cache.discarded_lse(huge)  # 512 bytes > the 400-byte cap: the call's own buffer
    assert own.shape == (8, 16) and own._base is not grown._base and (8, 16) not in views
    assert cache.discarded_lse(small) is again and cache.info()["lse_bytes"] == 256


def test_plan_cache_is_bounded_and_thread_safe():
    cache = PlanCache(capacity=3)
    for k in "abc":
        cache.put(k, k.upper())
    cache.put("d", "D")  # the oldest goes
    assert cache.get("a") is None and [cache.get(k) for k in "bcd"] == ["B", "C", "D"] and len(cache) == 3
    assert cache.put("b", "other") == "B"  # the first plan of a key is kept (two threads planning at once)

    shared = PlanCache(capacity=16)
    errors = []

    def worker(offset):
        for i in range(2000):
            k = (offset + i) % 40
            got = shared.get(k)
            if got is None:
                got = shared.put(k, ("plan", k))
            if got != ("plan", k):
                errors.append((k, got))

    threads = [threading.Thread(target=worker, args=(7 * n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(shared) == 16
    shared.clear()
    assert len(shared) == 0


def test_a_cache_hit_launches_what_plan_run_launches(monkeypatch):
    """The one-shot call's cache hit (``launch_laid_out``: the layout already compared) writes
    the same kernel arguments as ``plan.run``, and declines (returns False, launching nothing)
    a misaligned address or a scale ``validate_call`` would refuse."""
    plan, call = _cpu_plan(monkeypatch, topk_length=torch.zeros(2, dtype=torch.int32))
    launched = []
    monkeypatch.setattr(plan, "_bind_and_launch", launched.append)
    scratch = torch.empty(plan.scratch_bytes, dtype=torch.uint8) if plan.scratch_bytes else None
    t = call.tensors
    plan.run(t.q, t.kv_cache, t.indices, out=t.out, lse=t.lse, scratch=scratch, topk_length=t.topk_length, sm_scale=0.05)
    given = call.tensors
    assert plan.launch_laid_out(given, 0.05, scratch) and launched[0] == launched[1]
    assert plan.launch_laid_out(given, 1, scratch) and launched[2][len(given)] == 1 * LOG2_E
    for scale in (math.nan, math.inf, True, torch.tensor(0.05), "0.05"):
        assert not plan.launch_laid_out(given, scale, scratch)
    q = _misaligned(call.tensors.q, 2)
    assert q.stride() == call.tensors.q.stride() and not plan.launch_laid_out((q,) + given[1:], 0.05, scratch)
    assert len(launched) == 3
    # the overlap check remembers the last addresses it passed, never a refusal: an out laid over
    # q (same shape and dtype) is declined after a clean call, then the clean call launches again
    aliased = given._replace(out=given.q)
    assert not plan.launch_laid_out(aliased, 0.05, scratch) and len(launched) == 3
    with pytest.raises(ValueError, match="out overlaps q in memory"):
        plan.run(t.q, t.kv_cache, t.indices, out=t.q, lse=t.lse, scratch=scratch, topk_length=t.topk_length)
    assert plan.launch_laid_out(given, 0.05, scratch) and len(launched) == 4
    assert not plan.launch_laid_out(aliased, 0.05, scratch) and len(launched) == 4
