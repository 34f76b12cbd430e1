"""The serving engines' call sites, replayed on a CUDA GPU with the tensors each engine builds
(shapes, dtypes, strides, padding), against the float64 reference.

- vLLM's DeepSeek-V4 / V4.1 SM12x attention (``DeepseekV4FlashInferSM120Attention``, read at
  vLLM 0.34.0) calls FlashInfer's ``trtllm_batch_decode_sparse_mla_dsv4``
  with the query heads zero-padded to 8/16/32/64/128, the SWA cache on 64-token pages 37,440
  bytes apart, the compressed cache on 64-token (ratio 4) or 2-token (ratio 128) pages, extra
  indices ``[T, 1, K]`` of global slots (ratio 128: the full buffer width, 8192 at 1M context,
  with the real count in the lengths) and ``kv_layout="NHD"``; prefill goes through the same
  call in chunks of many tokens.
- SGLang 0.5.23's DeepSeek-V4 backend calls
  ``flash_mla_with_kvcache_sm120`` with q ``[T, 1, H, 512]`` (decode heads padded to 64), its
  SWA pool on 256-token pages viewed from the ``[num_pages, page_bytes]`` buffer, and
  ``[T, 1, K]`` lists of pool slots padded with -1.
"""

from __future__ import annotations

import math

import pytest
import torch

from cute_kernels.sparse_mla_decode.cache_view import default_block_stride
from cute_kernels.sparse_mla_decode.kv_format import MODEL1_FP8
from cute_kernels.sparse_mla_decode.reference import reference_decode
from dispatch.engines.flashinfer_dsv4 import trtllm_batch_decode_sparse_mla_dsv4
from dispatch.engines.flashmla import flash_mla_with_kvcache_sm120
from dispatch.tools.accuracy import rounding_floor
from dispatch.tools.sample_inputs import make_cache, make_indices
from tests.tolerances import check_against_reference, seed_for

pytestmark = pytest.mark.gpu
DEV = "cuda"
VLLM_HEAD_BUCKETS = (8, 16, 32, 64, 128)  # vLLM's _pad_to_supported_q_heads
SGLANG_DECODE_HEADS = 64  # SGLang pads decode queries to 64 heads
POISON = float("nan")


def _padded_heads(num_heads: int) -> int:
    return next(h for h in VLLM_HEAD_BUCKETS if num_heads <= h)


def _check(out, lse, q, cache, idx, kw, seed, what):
    ref_out, ref_lse = reference_decode(q, cache, idx, **kw)
    floor = rounding_floor("f16", q, cache=cache, idx=idx, kw=kw, ref_out=ref_out)
    check_against_reference(out, lse, ref_out, ref_lse, floor=floor, seed=seed, what=what)


def _lengths(T, topk, gen, low=0):
    return torch.randint(low, topk + 1, (T,), generator=gen).int().to(DEV)


def _vllm_call(T, heads, swa_page, ratio, extra_topk, *, gen, window=128):
    """The tensors vLLM's SM12x DeepSeek-V4 attention hands FlashInfer for one layer."""
    padded = _padded_heads(heads)
    query = torch.zeros(T, padded, 512, dtype=torch.bfloat16, device=DEV)  # _prepare_query: zero-padded heads
    query[:, :heads] = torch.randn(T, heads, 512, generator=gen).bfloat16().to(DEV)
    swa_blocks = 48
    swa = make_cache(swa_blocks, swa_page, device=DEV, gen=gen)  # block stride: P * 584 rounded up to 576
    assert swa.stride(0) == default_block_stride(MODEL1_FP8, swa_page)
    swa_indices = make_indices(T, window, swa_blocks * swa_page, device=DEV, invalid_frac=0.05, gen=gen)
    kw = dict(query=query, swa_kv_cache=swa, workspace_buffer=torch.zeros(128 << 20, dtype=torch.uint8, device=DEV),
              sparse_indices=swa_indices, out=torch.full((T, padded, 512), POISON, dtype=torch.bfloat16, device=DEV),
              bmm1_scale=512 ** -0.5, sinks=(torch.randn(padded, generator=gen) + 2).to(DEV), kv_layout="NHD",
              swa_topk_lens=_lengths(T, window, gen, low=1))
    if ratio:
        page = 256 // ratio
        blocks = max(4, -(-extra_topk // page) + 3)
        compressed = make_cache(blocks, page, device=DEV, gen=gen)
        # global slots; past each token's length the buffer holds stale slots (never read)
        extra = make_indices(T, extra_topk, blocks * page, device=DEV, invalid_frac=0.05, gen=gen)
        kw.update(compressed_kv_cache=compressed, extra_sparse_indices=extra.view(T, 1, extra_topk),
                  extra_sparse_topk_lens=_lengths(T, extra_topk, gen))
    return kw


def _vllm_reference_kw(kw):
    ref = dict(sm_scale=kw["bmm1_scale"], topk_length=kw["swa_topk_lens"], attn_sink=kw["sinks"])
    if "compressed_kv_cache" in kw:
        T = kw["query"].shape[0]
        ref.update(extra_kv_cache=kw["compressed_kv_cache"], extra_indices=kw["extra_sparse_indices"].view(T, -1),
                   extra_topk_length=kw["extra_sparse_topk_lens"])
    return ref


@pytest.mark.parametrize("T,heads,swa_page,ratio,extra_topk", [
    (4, 4, 64, 0, 0),  # an SWA-only layer, 4 heads padded to 8 (DeepSeek-V4-Flash at TP16)
    (7, 16, 64, 4, 512),  # a ratio-4 layer: compressed page 64
    (5, 64, 64, 128, 8192),  # a ratio-128 layer at 1M context: the full-width [T, 1, 8192] rows
    (3, 24, 32, 4, 1152),  # DeepSeek-V4.1 (584-byte records on SM120): page 32, topk 1152, 24 heads -> 32
    (130, 32, 64, 4, 512),  # a prefill chunk through the same call
])
def test_vllm_dsv4_call_site(T, heads, swa_page, ratio, extra_topk):
    name = f"vllm dsv4 T={T} H={heads} page={swa_page} ratio={ratio} extra={extra_topk}"
    seed = seed_for(name)
    gen = torch.Generator().manual_seed(seed)
    kw = _vllm_call(T, heads, swa_page, ratio, extra_topk, gen=gen)
    result = trtllm_batch_decode_sparse_mla_dsv4(**kw)
    assert result is kw["out"]
    ref_kw = _vllm_reference_kw(kw)
    # every head is served, the zero-padded ones too (nobody said they are padding): the lse of
    # the natural convention, from the same call asking for it
    out, lse = trtllm_batch_decode_sparse_mla_dsv4(**dict(kw, out=None), return_lse=True, lse_convention="natural")
    assert torch.equal(out, result)
    _check(out, lse, kw["query"], kw["swa_kv_cache"], kw["sparse_indices"], ref_kw, seed, name)
    # the engine says the padding heads are padding: they are neither computed nor written
    if heads < kw["query"].shape[1]:
        kw["out"].fill_(POISON)
        trtllm_batch_decode_sparse_mla_dsv4(**kw, num_valid_heads=heads)
        assert kw["out"][:, heads:].isnan().all()
        sub = dict(ref_kw, attn_sink=kw["sinks"][:heads])
        _, lse_valid = trtllm_batch_decode_sparse_mla_dsv4(**dict(kw, out=kw["out"]), num_valid_heads=heads,
                                                           return_lse=True, lse_convention="natural")
        _check(kw["out"][:, :heads], lse_valid, kw["query"][:, :heads], kw["swa_kv_cache"], kw["sparse_indices"],
               sub, seed, name + " num_valid_heads")


def test_vllm_call_lse_is_flashinfers():
    """With ``return_lse`` the default convention is FlashInfer's: log2, the sink folded in."""
    seed = seed_for("vllm lse")
    gen = torch.Generator().manual_seed(seed)
    kw = _vllm_call(3, 16, 64, 4, 256, gen=gen)
    _, lse2 = trtllm_batch_decode_sparse_mla_dsv4(**kw, return_lse=True)
    _, lse = trtllm_batch_decode_sparse_mla_dsv4(**kw, return_lse=True, lse_convention="natural")
    want = torch.logaddexp(lse.masked_fill(lse.isposinf(), -math.inf), kw["sinks"][None, :]) / math.log(2)
    assert torch.allclose(lse2, want, rtol=1e-6, atol=1e-6)


def _sglang_pool(num_pages, page, gen):
    """SGLang's pool buffer ``[num_pages, page_bytes]`` and the 4-D view its backend makes of it."""
    cache = make_cache(num_pages, page, device=DEV, gen=gen)
    page_bytes = cache.stride(0)
    assert page_bytes == math.ceil(page * 584 / 576) * 576
    buffer = torch.as_strided(cache, (num_pages, page_bytes), (page_bytes, 1))
    return buffer[:, : page * 584].view(num_pages, page, 1, 584)


@pytest.mark.parametrize("T,heads,ratio,extra_topk", [
    (4, 16, 4, 512),  # decode: 16 real heads padded to 64, a c4 layer
    (3, 8, 128, 64),  # a c128 layer (compressed page 2)
    (2, 64, 0, 0),  # an SWA-only layer
    (80, 16, 4, 1024),  # T > 64: SGLang trims the padding heads itself
])
def test_sglang_dsv4_call_site(T, heads, ratio, extra_topk):
    name = f"sglang dsv4 T={T} H={heads} ratio={ratio} extra={extra_topk}"
    seed = seed_for(name)
    gen = torch.Generator().manual_seed(seed)
    padded = SGLANG_DECODE_HEADS if T <= 64 else heads
    q = torch.zeros(T, 1, padded, 512, dtype=torch.bfloat16, device=DEV)
    q[:, :, :heads] = torch.randn(T, 1, heads, 512, generator=gen).bfloat16().to(DEV)
    pages = 6
    k_cache = _sglang_pool(pages, 256, gen)
    indices = make_indices(T, 128, pages * 256, device=DEV, invalid_frac=0.05, gen=gen)
    kw = dict(q=q, k_cache=k_cache, head_dim_v=512, softmax_scale=512 ** -0.5, indices=indices.view(T, 1, 128),
              topk_length=_lengths(T, 128, gen, low=1), attn_sink=(torch.randn(padded, generator=gen) + 2).to(DEV))
    ref_kw = dict(sm_scale=512 ** -0.5, topk_length=kw["topk_length"], attn_sink=kw["attn_sink"])
    if ratio:
        page = 256 // ratio
        blocks = max(4, -(-extra_topk // page) + 2)
        extra_cache = _sglang_pool(blocks, page, gen)
        extra = make_indices(T, extra_topk, blocks * page, device=DEV, gen=gen)
        lengths = _lengths(T, extra_topk, gen)
        extra[torch.arange(extra_topk, device=DEV)[None, :] >= lengths[:, None]] = -1  # SGLang's -1 padding
        kw.update(extra_k_cache=extra_cache, extra_indices_in_kvcache=extra.view(T, 1, extra_topk),
                  extra_topk_length=lengths)
        ref_kw.update(extra_kv_cache=extra_cache, extra_indices=extra, extra_topk_length=lengths)
    out, lse = flash_mla_with_kvcache_sm120(**kw)
    assert out.shape == (T, 1, padded, 512) and lse.shape == (T, padded, 1)
    _check(out.squeeze(1), lse.squeeze(2), q.squeeze(1), k_cache, indices, ref_kw, seed, name)


def test_vllm_call_repeats_and_replays_in_a_cuda_graph():
    """vLLM's steady state: the same call every step (the cached plan, the lse written into the
    plan cache's buffer) and the call captured in a CUDA graph (vLLM captures decode)."""
    seed = seed_for("vllm graph")
    gen = torch.Generator().manual_seed(seed)
    kw = _vllm_call(8, 16, 64, 4, 512, gen=gen)
    trtllm_batch_decode_sparse_mla_dsv4(**kw)
    first = kw["out"].clone()
    kw["out"].fill_(POISON)
    trtllm_batch_decode_sparse_mla_dsv4(**kw)
    assert torch.equal(kw["out"], first)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        trtllm_batch_decode_sparse_mla_dsv4(**kw)
    kw["query"].copy_(torch.randn(kw["query"].shape, generator=gen).bfloat16())
    kw["out"].fill_(POISON)
    graph.replay()
    replayed = kw["out"].clone()
    trtllm_batch_decode_sparse_mla_dsv4(**kw)
    assert torch.equal(kw["out"], replayed)
    _, lse = trtllm_batch_decode_sparse_mla_dsv4(**kw, return_lse=True, lse_convention="natural")
    _check(replayed, lse, kw["query"], kw["swa_kv_cache"], kw["sparse_indices"], _vllm_reference_kw(kw), seed,
           "vllm graph replay")
