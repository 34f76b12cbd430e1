"""FlashMLA's sparse FP8 decode call shape, as the engines make it.

- ``flash_mla_with_kvcache``: FlashMLA's ``flash_mla_with_kvcache`` (the sparse FP8 path,
  ``indices=`` and ``is_fp8_kvcache=True``), its parameters in FlashMLA's order (vLLM 0.34's
  vendored copy, ``vllm/third_party/flashmla/flash_mla_interface.py``): DeepSeek-V4 / V4.1
  (MODEL1 584-byte records) and DeepSeek-V3.2 / GLM-5 (656-byte rows), the calls vLLM's and
  SGLang's attention makes on Hopper;
- ``flash_mla_with_kvcache_sm120``: SGLang's SM120 function of FlashMLA's keyword names.
"""

from __future__ import annotations

import torch

from cute_kernels.sparse_mla_decode.kv_format import D_V

from ..api import one_shot_decode
from ..runtime.decode_inputs import DecodeTensors, caller_names, scalar_problem
from .calls import check_lse_convention, known_format, refuse, valid_heads

# the engine release whose keywords the SGLang SM120 call shape takes
SGLANG_CHECKED = "SGLang 0.5.23"
# FlashMLA's names of the decode's arguments: what a refusal names
FLASHMLA_NAMES = caller_names(dict(kv_cache="k_cache", extra_kv_cache="extra_k_cache",
                                   extra_indices="extra_indices_in_kvcache", sm_scale="softmax_scale"))
_SGLANG_REQUIRED = ("q", "k_cache", "indices", "head_dim_v")


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    head_dim_v: int = D_V,
    tile_scheduler_metadata=None,
    num_splits=None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    enable_batch_invariant: bool = False,
    *,
    lse_convention: str = "natural",
    kv_format: str | None = None,
    extra_kv_format: str | None = None,
    num_valid_heads: int | None = None,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FlashMLA's ``flash_mla_with_kvcache``, sparse FP8 decode only.

    DeepSeek-V4: ``q [B, S, H, 512]`` on a MODEL1 cache ``[num_blocks, P, 1, 584]`` (and its
    extra cache); DeepSeek-V3.2 / GLM-5: ``q [B, S, H, 576]`` on ``[num_blocks, P, 1, 656]``.
    The format comes from the cache's width (``kv_format`` names it where the width does not;
    ``extra_kv_format`` the extra cache's, as ``sparse_mla_decode``); ``head_dim_v`` must be
    its value width (512). ``indices [B, S, topk]`` cache slots (-1: none), ``topk_length`` /
    ``extra_topk_length`` ``[B]`` (one query per batch entry, as the engines call it: each
    token its own entry) or ``[B*S]``. ``out``: written in place when given
    (``[B, S, H, 512]``, any strides the kernels take). Returns ``(out, softmax_lse [B, H, S]
    float32)``, FlashMLA's layouts, the lse in ``lse_convention`` ("natural": FlashMLA's).

    As FlashMLA's sparse path: ``block_table`` and ``cache_seqlens`` are not read (the indices
    select the slots; the engines pass placeholders), ``tile_scheduler_metadata`` and
    ``num_splits`` are accepted and not needed (this library plans its own split). Refused:
    the dense path (no ``indices`` or ``is_fp8_kvcache`` False), ``causal=True`` and
    ``enable_batch_invariant=True`` (the split, and so the rounding, follows the batch size).

    Not FlashMLA's (keyword-only): ``num_valid_heads``, the engine's real heads where it pads
    the query to FlashMLA's 64 or 128: only the first ``num_valid_heads`` are read and
    computed, the padded rows of ``out`` are left as they are (not written when ``out`` is
    allocated here) and the lse returned covers the real heads; ``return_lse=False`` returns
    ``(out, None)`` for a caller that drops the lse.
    """
    check_lse_convention(lse_convention, q)
    fmt = known_format(k_cache, kv_format)
    name = None if fmt is None else fmt.name
    if indices is None or is_fp8_kvcache is not True:
        refuse("only the sparse FP8 decode path is served: pass indices and is_fp8_kvcache=True", q, name)
    if causal is not False:
        refuse(f"causal must be False (sparse decode: the indices select the slots), got {causal!r}", q, name)
    if enable_batch_invariant is not False:
        refuse("enable_batch_invariant=True is not served: the work split, and so the rounding of a token's "
               "result, follows the number of tokens in the call", q, name)
    if fmt is not None and head_dim_v != fmt.d_v:
        refuse(f"head_dim_v must be {fmt.d_v} (the value width of {fmt.name} caches), got {head_dim_v!r}", q, name)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        width = "d_qk" if fmt is None else fmt.d_qk
        refuse(f"q must be [batch, seq_q, num_heads, {width}], got {getattr(q, 'shape', type(q).__name__)}", q,
               name)
    problem = scalar_problem(return_lse, "return_lse", "flag")
    if problem is not None:
        refuse(problem, q, name)
    if out is None and num_valid_heads is not None:
        out = torch.empty(*q.shape[:-1], D_V if fmt is None else fmt.d_v, dtype=torch.bfloat16, device=q.device)
    given_out, sink = out, attn_sink
    if num_valid_heads is not None:
        q, out, sink = valid_heads(q, out, attn_sink, num_valid_heads, name)
    given = DecodeTensors._make((q, k_cache, indices, topk_length, sink, out, None, extra_k_cache,
                                 extra_indices_in_kvcache, extra_topk_length))
    # (no lse returned: none converted; the convention was checked above)
    result, lse = one_shot_decode(given, sm_scale=softmax_scale, lse_convention=lse_convention if return_lse
                                  else "natural", precision=None,
                                  kv_format=kv_format, extra_kv_format=extra_kv_format, keep_lse=return_lse,
                                  names=FLASHMLA_NAMES)
    if given_out is not None:
        result = given_out
    if not return_lse:
        return result, None
    return result, lse.transpose(1, 2)


def flash_mla_with_kvcache_sm120(
    *,
    q: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    head_dim_v: int | None = None,
    softmax_scale: float | None = None,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    lse_convention: str = "natural",
    kv_format: str | None = None,
    extra_kv_format: str | None = None,
    num_valid_heads: int | None = None,
    **unknown,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's ``flash_mla_with_kvcache_sm120`` (``sglang.kernels.ops.attention.flash_mla_sm120``,
    read in SGLang 0.5.23's released wheel): keyword arguments only, FlashMLA's names, as
    SGLang's DeepSeek-V4 / V4.1 backend calls it on SM120.

    ``q [T, 1, H, 512]`` bf16; ``k_cache`` SGLang's SWA pool on its own pages (256 tokens, 64
    with ``SGLANG_OPT_SM120_DIRECT_SWA_KV=1``), ``[num_pages, P, 1, 584]`` over a
    ``[num_pages, page_bytes]`` buffer (read in place: no page split, no copy);
    ``indices [T, 1, topk]`` int32 pool slots (page * P + offset, -1: none);
    ``topk_length [T]``; ``attn_sink [H]`` float32; the compressed cache
    ``extra_k_cache [num_pages, 64 or 2, 1, 584]`` with ``extra_indices_in_kvcache
    [T, 1, extra_topk]`` and ``extra_topk_length [T]``. ``softmax_scale`` None is
    ``d_qk ** -0.5``, as SGLang's function defaults it. ``num_valid_heads``: SGLang's real
    heads where it padded the query (``dispatch.engines.sglang_plugin`` passes the layer's
    ``tp_q_head_num``): the padded heads, uninitialised in SGLang's V4 query, are neither read
    nor computed, and their rows of the returned ``out`` are not written. Returns ``(out
    [T, 1, H, 512] bf16, lse [T, H', 1] float32)`` (FlashMLA's layouts, ``H'`` the heads
    computed; SGLang's FlashInfer path returns no lse), the lse in ``lse_convention``.
    SGLang's own function takes ``**kwargs``: a keyword it may pass after 0.5.23 is refused
    naming it (an ``InvalidDecodeInput``), not Python's TypeError at the first decode.
    """
    if unknown:  # first: a misspelt keyword is named as such, not as the one it should have been
        refuse(f"{', '.join(sorted(unknown))}: not a keyword of SGLang's flash_mla_with_kvcache_sm120 this "
               f"call shape serves (checked against {SGLANG_CHECKED})", q, kv_format)
    missing = [name for name, value in zip(_SGLANG_REQUIRED, (q, k_cache, indices, head_dim_v)) if value is None]
    if missing:
        refuse(f"{', '.join(missing)} required (SGLang's call passes q, k_cache, indices and head_dim_v)", q, kv_format)
    return flash_mla_with_kvcache(q, k_cache, None, None, head_dim_v, softmax_scale=softmax_scale,
                                  is_fp8_kvcache=True, indices=indices, attn_sink=attn_sink,
                                  extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices_in_kvcache,
                                  topk_length=topk_length, extra_topk_length=extra_topk_length,
                                  lse_convention=lse_convention, kv_format=kv_format,
                                  extra_kv_format=extra_kv_format, num_valid_heads=num_valid_heads)
