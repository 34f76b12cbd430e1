"""The engines' Hopper calls through the route (``dispatch.engines.sm90_route``), built the way
the engines build them, against the float64 reference (GPU).

vLLM 0.34's DeepSeek-V4 / V4.1 ``_forward_decode`` (q padded to 64 heads with zeros, sinks of
the padded heads -inf, ``out=`` of the padded shape, a FlashMLASchedMeta shared by the layers),
its DeepSeek-V3.2 ``_fp8_flash_mla_kernel`` (656-byte rows, the lse returned), and SGLang
0.5.23's DeepSeek-V4 backend (256-token pool pages, padded heads uninitialised, padding rows'
slots 0 with length 1, no ``out=``, ``use_legacy``). The route runs within the site the
plugins set (the layer's real heads); the engine's own FlashMLA is a stand-in that records
its calls, so each test also checks which of the two ran against the route table's ``choose``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from dispatch.engines import sm90_route
from dispatch.engines.sites import site, within_site
from dispatch.policy import sm90_policy
from dispatch.tools.sample_inputs import make_cache, make_indices
from tests.test_engine_calls_gpu import POISON, _check, _lengths, _sglang_pool
from tests.tolerances import seed_for

pytestmark = pytest.mark.gpu
DEV = "cuda"
LOG = logging.getLogger("test_hopper_route")


class StandInFlashMLA:
    """The engine's FlashMLA function: records each call (the route handed it over)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return "FlashMLA", None


def _table(family: str, winner: str, heads=(8, 16, 32, 64, 128)):
    """A route table whose every row picks ``winner``."""
    fast, slow = 1.0, 2.0
    lib, fm = (fast, slow) if winner == sm90_policy.LIBRARY else (slow, fast)
    return sm90_policy.RouteTable((sm90_policy.RouteRow(family, h, t, e, lib, fm) for h in heads for t in (1, 4096)
                                   for e in (128, 1 << 16)), f"every call: {winner}")


def _vllm_v4_decode(T, heads, swa_page, extra_topk, extra_page, *, gen):
    """The keyword arguments of vLLM's Hopper ``_forward_decode`` call for one layer."""
    padded = 64 if heads <= 64 else 128
    q = torch.zeros(T, 1, padded, 512, dtype=torch.bfloat16, device=DEV)
    q[:, :, :heads] = torch.randn(T, 1, heads, 512, generator=gen).bfloat16().to(DEV)
    sink = torch.full((padded,), float("-inf"), device=DEV)
    sink[:heads] = (torch.randn(heads, generator=gen) + 2).to(DEV)
    swa = make_cache(40, swa_page, device=DEV, gen=gen)
    indices = make_indices(T, 128, 40 * swa_page, device=DEV, invalid_frac=0.05, gen=gen)
    kw = dict(q=q, k_cache=swa, block_table=None, head_dim_v=512, tile_scheduler_metadata=object(),
              cache_seqlens=None, is_fp8_kvcache=True, indices=indices.view(T, 1, 128),
              topk_length=_lengths(T, 128, gen, low=1), softmax_scale=512 ** -0.5, attn_sink=sink,
              out=torch.full((T, 1, padded, 512), POISON, dtype=torch.bfloat16, device=DEV))
    ref = dict(sm_scale=512 ** -0.5, topk_length=kw["topk_length"], attn_sink=sink[:heads])
    if extra_topk:
        blocks = max(4, -(-extra_topk // extra_page) + 3)
        extra = make_cache(blocks, extra_page, device=DEV, gen=gen)
        extra_idx = make_indices(T, extra_topk, blocks * extra_page, device=DEV, invalid_frac=0.05, gen=gen)
        kw.update(extra_k_cache=extra, extra_indices_in_kvcache=extra_idx.view(T, 1, extra_topk),
                  extra_topk_length=_lengths(T, extra_topk, gen))
        ref.update(extra_kv_cache=extra, extra_indices=extra_idx, extra_topk_length=kw["extra_topk_length"])
    return kw, ref, indices


@pytest.mark.parametrize("T,heads,swa_page,extra_topk,extra_page", [
    (4, 16, 64, 512, 64),  # DeepSeek-V4-Flash at TP 4, a ratio-4 layer
    (2, 8, 64, 0, None),  # V4-Flash at TP 8, an SWA-only layer
    (8, 32, 64, 8192, 2),  # V4-Pro at TP 4, a ratio-128 layer at 1M context
    (3, 16, 32, 512, 64),  # DeepSeek-V4.1 (SWA page 32, compressed page 64)
    (64, 64, 64, 1024, 64),  # no padding (64 real heads)
])
def test_vllm_v4_decode_through_the_route(T, heads, swa_page, extra_topk, extra_page):
    name = f"vllm hopper v4 T={T} H={heads} page={swa_page} extra={extra_topk}@{extra_page}"
    seed = seed_for(name)
    gen = torch.Generator().manual_seed(seed)
    kw, ref, indices = _vllm_v4_decode(T, heads, swa_page, extra_topk, extra_page, gen=gen)
    engine = StandInFlashMLA()
    route = sm90_route.make_route(engine, LOG, "vLLM", table=_table("model1", sm90_policy.LIBRARY))
    out, lse = within_site(site("vLLM _forward_decode", heads, False), route, **kw)
    assert engine.calls == 0 and out is kw["out"] and lse is None
    assert out[:, :, heads:].isnan().all()  # the padded rows: not written (vLLM drops them)
    # the lse of the same call, asked of the call shape directly, for the reference check
    _, lse = sm90_route.flashmla.flash_mla_with_kvcache(**dict(kw, out=out.clone()), num_valid_heads=heads)
    _check(out[:, 0, :heads], lse[:, :, 0], kw["q"][:, 0, :heads], kw["k_cache"], indices, ref, seed, name)
    # a table that picks FlashMLA hands the call over unchanged
    route = sm90_route.make_route(engine, LOG, "vLLM", table=_table("model1", sm90_policy.FLASHMLA))
    assert within_site(site("vLLM _forward_decode", heads, False), route, **kw)[0] == "FlashMLA"
    assert engine.calls == 1


def test_routed_call_replays_in_a_cuda_graph():
    """vLLM captures decode in a full CUDA graph: the route runs at capture, the graph replays
    this library's kernels on the new values of the same tensors."""
    name = "vllm hopper graph"
    seed = seed_for(name)
    gen = torch.Generator().manual_seed(seed)
    kw, ref, indices = _vllm_v4_decode(8, 16, 64, 512, 64, gen=gen)
    route = sm90_route.make_route(StandInFlashMLA(), LOG, "vLLM", table=_table("model1", sm90_policy.LIBRARY))
    where = site("vLLM _forward_decode", 16, False)
    within_site(where, route, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        within_site(where, route, **kw)
    kw["q"][:, :, :16].copy_(torch.randn(8, 1, 16, 512, generator=gen).bfloat16())
    kw["out"].fill_(POISON)
    graph.replay()
    replayed = kw["out"].clone()
    assert replayed[:, :, 16:].isnan().all()  # the padded rows: never written
    _, lse = sm90_route.flashmla.flash_mla_with_kvcache(**dict(kw, out=kw["out"]), num_valid_heads=16)
    assert torch.equal(kw["out"][:, :, :16], replayed[:, :, :16])
    _check(replayed[:, 0, :16], lse[:, :, 0], kw["q"][:, 0, :16], kw["k_cache"], indices, ref, seed, name)


@pytest.mark.parametrize("B,heads,topk", [(4, 16, 2048), (2, 8, 2048), (3, 128, 2048)])
def test_vllm_v32_decode_through_the_route(B, heads, topk):
    """``FlashMLASparseImpl._fp8_flash_mla_kernel``: vLLM pads q with zeros, passes placeholder
    block_table / cache_seqlens and no topk_length, and reads the lse (sliced to the real heads)."""
    name = f"vllm hopper v32 B={B} H={heads}"
    seed = seed_for(name)
    gen = torch.Generator().manual_seed(seed)
    padded = 64 if heads <= 64 else 128
    q = torch.zeros(B, 1, padded, 576, dtype=torch.bfloat16, device=DEV)
    q[:, :, :heads] = torch.randn(B, 1, heads, 576, generator=gen).bfloat16().to(DEV)
    cache = make_cache(64, 64, device=DEV, kv_format="v32_fp8", gen=gen)
    indices = make_indices(B, topk, 64 * 64, device=DEV, invalid_frac=0.1, gen=gen)
    kw = dict(q=q, k_cache=cache, block_table=torch.empty(8, 1, dtype=torch.int32, device=DEV), head_dim_v=512,
              cache_seqlens=torch.full((8,), 4096, dtype=torch.int32, device=DEV), tile_scheduler_metadata=object(),
              is_fp8_kvcache=True, indices=indices.view(B, 1, topk), softmax_scale=576 ** -0.5, topk_length=None)
    engine = StandInFlashMLA()
    route = sm90_route.make_route(engine, LOG, "vLLM", table=_table("v32", sm90_policy.LIBRARY))
    out, lse = within_site(site("vLLM _fp8_flash_mla_kernel", heads, True), route, **kw)
    assert engine.calls == 0 and out.shape == (B, 1, padded, 512) and lse.shape == (B, heads, 1)
    _check(out[:, 0, :heads], lse[:, :, 0], q[:, 0, :heads], cache, indices, dict(sm_scale=576 ** -0.5), seed, name)


@pytest.mark.parametrize("T,heads,ratio,extra_topk", [(4, 16, 4, 512), (3, 8, 128, 64), (2, 32, 0, 0)])
def test_sglang_v4_decode_through_the_route(T, heads, ratio, extra_topk):
    """SGLang's Hopper call: ``functools.partial(flash_mla_with_kvcache, use_legacy=True)`` with
    keywords, heads padded to 64 and left uninitialised (NaN here: never read), padding rows'
    slots 0 with length 1, the result's ``[0]`` used."""
    name = f"sglang hopper v4 T={T} H={heads} ratio={ratio}"
    seed = seed_for(name)
    gen = torch.Generator().manual_seed(seed)
    q = torch.full((T + 1, 1, 64, 512), POISON, dtype=torch.bfloat16, device=DEV)  # one CUDA-graph padding row
    q[:, :, :heads] = torch.randn(T + 1, 1, heads, 512, generator=gen).bfloat16().to(DEV)
    pages = 6
    k_cache = _sglang_pool(pages, 256, gen)
    indices = make_indices(T + 1, 128, pages * 256, device=DEV, invalid_frac=0.05, gen=gen)
    indices[T] = 0
    lengths = _lengths(T + 1, 128, gen, low=1)
    lengths[T] = 1
    sink = torch.zeros(64, device=DEV)
    sink[:heads] = (torch.randn(heads, generator=gen) + 2).to(DEV)
    kw = dict(q=q, k_cache=k_cache, head_dim_v=512, block_table=None, cache_seqlens=None,
              tile_scheduler_metadata=object(), softmax_scale=512 ** -0.5, is_fp8_kvcache=True,
              indices=indices.view(T + 1, 1, 128), topk_length=lengths, attn_sink=sink, extra_k_cache=None,
              extra_indices_in_kvcache=None, extra_topk_length=None, use_legacy=True)
    ref = dict(sm_scale=512 ** -0.5, topk_length=lengths, attn_sink=sink[:heads])
    if ratio:
        page = 256 // ratio
        blocks = max(4, -(-extra_topk // page) + 2)
        extra_cache = _sglang_pool(blocks, page, gen)
        extra = make_indices(T + 1, extra_topk, blocks * page, device=DEV, gen=gen)
        extra_len = _lengths(T + 1, extra_topk, gen)
        extra[torch.arange(extra_topk, device=DEV)[None, :] >= extra_len[:, None]] = -1
        kw.update(extra_k_cache=extra_cache, extra_indices_in_kvcache=extra.view(T + 1, 1, extra_topk),
                  extra_topk_length=extra_len)
        ref.update(extra_kv_cache=extra_cache, extra_indices=extra, extra_topk_length=extra_len)
    engine = StandInFlashMLA()
    route = sm90_route.make_route(engine, LOG, "SGLang", table=_table("model1", sm90_policy.LIBRARY))
    out = within_site(site("SGLang _forward_attention", heads, False), route, **kw)[0]
    assert engine.calls == 0 and out.shape == (T + 1, 1, 64, 512)
    _, lse = sm90_route.flashmla.flash_mla_with_kvcache(**{k: v for k, v in kw.items() if k != "use_legacy"},
                                                        num_valid_heads=heads)
    _check(out[:, 0, :heads], lse[:, :, 0], q[:, 0, :heads], k_cache, indices, ref, seed, name)


def test_the_route_follows_the_policy_on_the_measured_table():
    """With the shipped table (``sm90_policy.SHIPPED``): on the registry's Hopper deployments the
    route runs what it chooses, shape by shape."""
    table = sm90_policy.SHIPPED
    gen = torch.Generator().manual_seed(seed_for("route policy"))
    for heads, T, extra in ((16, 1, 512), (16, 8, 512), (32, 64, 1024), (8, 256, 512), (64, 256, 512)):
        kw, _, _ = _vllm_v4_decode(T, heads, 64, extra, 64, gen=gen)
        engine = StandInFlashMLA()
        route = sm90_route.make_route(engine, LOG, "vLLM", table=table)
        within_site(site("vLLM _forward_decode", heads, False), route, **kw)
        want = table.choose("model1", heads, T, 128 + extra)
        assert engine.calls == (want == sm90_policy.FLASHMLA), (heads, T, extra, want)
