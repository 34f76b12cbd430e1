"""Drop-in call shapes of other libraries, each a thin layer over ``sparse_mla_decode``.

- ``flash_mla_with_kvcache``: FlashMLA's sparse FP8 decode, on DeepSeek-V4's MODEL1 cache and
  on DeepSeek-V3.2's 656-byte rows (the format from the cache's width);
- ``flash_mla_with_kvcache_sm120``: SGLang's SM120 DeepSeek-V4 call (FlashMLA's keyword
  names, SGLang's 256-token pages read in place);
- ``trtllm_batch_decode_sparse_mla_dsv4``: FlashInfer's DeepSeek-V4 call (MODEL1 caches), the
  one vLLM's DeepSeek-V4 / V4.1 attention makes on SM12x;
- ``trtllm_batch_decode_with_kv_cache_mla``: FlashInfer's MLA decode in the sparse form its
  SM120 backend serves for the FP32-scale formats (DeepSeek-V3.2 and GLM-5.x's 656-byte rows,
  GLM-5.3's rope-free rows), the call vLLM's SM120 sparse backend makes for these models.

Every adapter states its log-sum-exp convention as an explicit ``lse_convention`` argument
(``dispatch.runtime.lse``: "natural", FlashMLA's and this library's; "log2_with_sink" and
"natural_with_sink", FlashInfer's). What an adapter does not serve is refused with an
``InvalidDecodeInput`` naming it, before any GPU work.
"""

from __future__ import annotations

import math

import torch

from cute_kernels.sparse_mla_decode.cache_view import format_of
from cute_kernels.sparse_mla_decode.kv_format import D_V, FORMATS, MODEL1_FP8, KvFormat

from .api import one_shot_decode, sparse_mla_decode
from .policy.call_metadata import DecodeMetadata, InvalidDecodeInput
from .runtime.decode_inputs import DecodeTensors
from .runtime.lse import LSE_CONVENTIONS, check_convention, convert_lse

# the engine releases whose keywords the adapters take
FLASHINFER_CHECKED = "flashinfer-python 0.7.4"
SGLANG_CHECKED = "SGLang 0.5.23"


def _refuse(problem: str, q, kv_format: str | None = None) -> None:
    """Raise ``InvalidDecodeInput`` for ``problem``, naming what can be read of the call."""
    shaped = isinstance(q, torch.Tensor) and q.dim() >= 3
    md = DecodeMetadata(num_tokens=math.prod(q.shape[:-2]) if shaped else None,
                        num_heads=q.shape[-2] if shaped else None,
                        d_qk=q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() >= 1 else None,
                        kv_format=kv_format)
    raise InvalidDecodeInput(md, problem)


def _known_format(cache, kv_format: str | None) -> KvFormat | None:
    """The format ``cache`` is read as (``kv_format``, or its width), None where that cannot
    be told: ``sparse_mla_decode`` then refuses the cache with the reason."""
    try:
        return format_of(cache, kv_format)
    except Exception:
        return None
def _check_convention(convention, q) -> None:
    """Refuse an unknown lse convention before any GPU work (whether or not an lse is returned)."""
    try:
        check_convention(convention)
    except ValueError as err:
        _refuse(str(err), q)


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
    *,
    lse_convention: str = "natural",
    kv_format: str | None = None,
    extra_kv_format: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's ``flash_mla_with_kvcache`` call shape, sparse FP8 decode only.

    DeepSeek-V4: ``q [B, S, H, 512]`` on a MODEL1 cache ``[num_blocks, P, 1, 584]`` (and its
    extra cache); DeepSeek-V3.2: ``q [B, S, H, 576]`` on ``[num_blocks, P, 1, 656]``. The
    format comes from the cache's width (``kv_format`` names it where the width does not;
    ``extra_kv_format`` the extra cache's, as ``sparse_mla_decode``); ``head_dim_v`` must be
    its value width (512). ``indices [B, S, topk]``. Returns
    ``out [B, S, H, 512]`` bf16 and ``softmax_lse [B, H, S]`` float32, as FlashMLA lays them
    out. ``tile_scheduler_metadata`` and ``num_splits`` are accepted and not needed (this
    library plans its own split).
    """
    _check_convention(lse_convention, q)
    fmt = _known_format(k_cache, kv_format)
    name = None if fmt is None else fmt.name
    if indices is None or not is_fp8_kvcache:
        _refuse("only the sparse FP8 decode path is served: pass indices and is_fp8_kvcache=True", q, name)
    if block_table is not None or cache_seqlens is not None or causal:
        _refuse("sparse decode takes no block_table, cache_seqlens or causal (the indices select the slots)", q, name)
    if fmt is not None and head_dim_v != fmt.d_v:
        _refuse(f"head_dim_v must be {fmt.d_v} (the value width of {fmt.name} caches), got {head_dim_v}", q, name)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        width = "d_qk" if fmt is None else fmt.d_qk
        _refuse(f"q must be [batch, seq_q, num_heads, {width}], got {getattr(q, 'shape', type(q).__name__)}", q,
                name)
    out, lse = sparse_mla_decode(q, k_cache, indices, sm_scale=softmax_scale, topk_length=topk_length,
                                 attn_sink=attn_sink, extra_kv_cache=extra_k_cache,
                                 extra_indices=extra_indices_in_kvcache, extra_topk_length=extra_topk_length,
                                 kv_format=kv_format, extra_kv_format=extra_kv_format)
    return out, convert_lse(lse, attn_sink, lse_convention).transpose(1, 2)


def flash_mla_with_kvcache_sm120(
    *,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float | None = None,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    lse_convention: str = "natural",
    kv_format: str | None = None,
    extra_kv_format: str | None = None,
    **unknown,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's ``flash_mla_with_kvcache_sm120`` (``sglang.kernels.ops.attention.flash_mla_sm120``,
    read in SGLang 0.5.23's released wheel): keyword arguments only, FlashMLA's
    names, as SGLang's DeepSeek-V4 backend calls it on SM120.

    ``q [T, 1, H, 512]`` bf16 (SGLang pads decode heads to 64: every head given is served);
    ``k_cache`` SGLang's SWA pool on its own 256-token pages, ``[num_pages, 256, 1, 584]``
    over a ``[num_pages, page_bytes]`` buffer (read in place: no page split, no copy);
    ``indices [T, 1, topk]`` int32 pool slots (page * 256 + offset, -1: none);
    ``topk_length [T]``; ``attn_sink [H]`` float32; the compressed cache
    ``extra_k_cache [num_pages, 64 or 2, 1, 584]`` with ``extra_indices_in_kvcache
    [T, 1, extra_topk]`` and ``extra_topk_length [T]``. ``softmax_scale`` None is
    ``d_qk ** -0.5``, as SGLang's function defaults it. Returns ``(out [T, 1, H, 512] bf16,
    lse [T, H, 1] float32)`` (FlashMLA's layouts; SGLang's FlashInfer path returns no lse),
    the lse in ``lse_convention``. ``flash_mla_with_kvcache`` with these keyword names.
    SGLang's own function takes ``**kwargs``: a keyword it may pass after 0.5.23 is refused
    naming it (an ``InvalidDecodeInput``), not Python's TypeError at the first decode.
    """
    if unknown:
        _refuse(f"{', '.join(sorted(unknown))}: not a keyword of SGLang's flash_mla_with_kvcache_sm120 this "
                f"adapter serves (checked against {SGLANG_CHECKED})", q, kv_format)
    return flash_mla_with_kvcache(q, k_cache, None, None, head_dim_v, softmax_scale=softmax_scale,
                                  is_fp8_kvcache=True, indices=indices, attn_sink=attn_sink,
                                  extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices_in_kvcache,
                                  topk_length=topk_length, extra_topk_length=extra_topk_length,
                                  lse_convention=lse_convention, kv_format=kv_format,
                                  extra_kv_format=extra_kv_format)


# FlashInfer's kv_cache_format values (flashinfer-python 0.7.4's trtllm_batch_decode_sparse_mla_dsv4)
# as (main cache format, compressed cache format); "fp8" is its default, the record vLLM's
# DeepSeek-V4 and V4.1 attention keeps on SM120
DSV4_KV_CACHE_FORMATS = {
    "fp8": ("model1_fp8", "model1_fp8"),
    "nvfp4": ("model1_nvfp4", "model1_nvfp4"),
    "fp8_dsv41": ("v41_fp8", "v41_fp8"),
    "fp8_dsv41_inline": ("v41_fp8_inline", "v41_fp8_inline"),
    "fp8_dsv41_fp4_ca": ("v41_fp8", "v41_nvfp4"),
    "fp8_dsv41_inline_fp4_ca": ("v41_fp8_inline", "v41_nvfp4_inline"),
}
_DSV4_FORMAT = MODEL1_FP8.name  # what a refusal names before kv_cache_format is read
# FlashInfer's kernel families on SM120: this library's kernels serve each ("trtllm-gen" is SM100's)
_DSV4_BACKENDS = ("auto", "sparse", "cake")


def trtllm_batch_decode_sparse_mla_dsv4(
    query: torch.Tensor,
    swa_kv_cache: torch.Tensor,
    workspace_buffer: torch.Tensor | None,
    sparse_indices: torch.Tensor | None = None,
    compressed_kv_cache: torch.Tensor | None = None,
    sparse_topk_lens: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    bmm1_scale: float = 1.0,
    bmm2_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
    kv_layout: str = "HND",
    cum_seq_lens_q: torch.Tensor | None = None,
    max_q_len: int | None = None,
    enable_pdl: bool | None = None,
    swa_topk_lens: torch.Tensor | None = None,
    extra_sparse_indices: torch.Tensor | None = None,
    extra_sparse_topk_lens: torch.Tensor | None = None,
    backend: str = "auto",
    hca_swa_indices: torch.Tensor | None = None,
    hca_compressed_block_tables: torch.Tensor | None = None,
    hca_seq_lens: torch.Tensor | None = None,
    hca_is_causal: bool = True,
    hca_use_persistent: bool = False,
    hca_sparse_indices_format: str | None = None,
    sparse_indices_are_storage_offsets: bool = False,
    sparse_topk_lens_offset: int = 0,
    *,
    kv_cache_format: str = "fp8",
    dsv4_output_scale: torch.Tensor | None = None,
    dsv4_inv_rope_cos_sin_cache: torch.Tensor | None = None,
    num_valid_heads: int | None = None,
    return_lse: bool = False,
    lse_convention: str = "log2_with_sink",
    **unknown,
):
    """FlashInfer's ``trtllm_batch_decode_sparse_mla_dsv4`` (``flashinfer.decode``; the keywords of
    flashinfer-python 0.7.4, ``flashinfer/mla/_core.py``) in its SM120 form: the function
    vLLM's DeepSeek-V4 and V4.1 attention calls on SM12x
    (``DeepseekV4FlashInferSM120Attention._forward_decode`` / ``_forward_prefill`` in
    ``vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py`` and ``deepseek_v41/nvidia/``,
    read in vLLM 0.34.0's released wheel; ``dispatch.engine_plugins`` switches vLLM to
    this function).

    vLLM's call: ``query [T, H, 512]`` bf16 (heads zero-padded to 8/16/32/64/128),
    ``swa_kv_cache [num_blocks, 64, 1, 584]`` uint8 (page 64, blocks 37,440 bytes apart),
    ``sparse_indices [T, window]`` int32 slots with ``swa_topk_lens [T]``,
    ``compressed_kv_cache [num_blocks, 64 or 2, 1, 584]`` with ``extra_sparse_indices
    [T, 1, K]`` global slots (the ratio-128 layers at the full buffer width, e.g. 8192, the
    real count in ``extra_sparse_topk_lens [T]``), ``out [T, H, 512]``, ``bmm1_scale`` the
    softmax scale, ``sinks [H]`` float32, ``kv_layout="NHD"``. The caches are read in the
    format ``kv_cache_format`` names (``DSV4_KV_CACHE_FORMATS``: "fp8", the default, both
    MODEL1 FP8; "nvfp4" both MODEL1 NVFP4; "fp8_dsv41" / "fp8_dsv41_inline" V4.1's FP8
    record, footer or inline scales; "fp8_dsv41_fp4_ca" / "fp8_dsv41_inline_fp4_ca" that
    record with V4.1's NVFP4 compressed record); ``[num_blocks, P, 1, W]`` for "NHD",
    ``[num_blocks, 1, P, W]`` for "HND"; a ``[B, S, H, 512]`` query takes ``[B, S, topk]``
    lists.

    Lengths follow FlashInfer's SM120 meaning: ``swa_topk_lens`` is the main (SWA) list's,
    ``extra_sparse_topk_lens`` the compressed list's. ``sparse_topk_lens`` (with
    ``sparse_topk_lens_offset``) is FlashInfer's SM100 length of one combined table, its 128
    SWA entries included, which its SM120 path does not read: refused, as anything but an
    offset of 0. ``bmm1_scale`` must be a Python number (a tensor would be read back to the
    host, a synchronization that is wrong under CUDA-graph capture; FlashInfer's SM120 path
    refuses it too); ``bmm2_scale`` must be 1 (the cache carries its own scales).
    ``seq_lens``, ``max_q_len``, ``enable_pdl``, ``hca_is_causal`` and ``workspace_buffer``
    are accepted and not needed (this library plans its own split and scratch); ``backend``
    must be "auto", "sparse" or "cake" (FlashInfer's SM120 kernel families: these kernels
    serve every one). Refused by name: ragged queries (``cum_seq_lens_q``), the ``hca_*``
    inputs, storage-offset indices (``sparse_indices_are_storage_offsets=True``), the FP8
    output of vLLM's SM100 path (``dsv4_output_scale``, ``dsv4_inv_rope_cos_sin_cache``) and
    any keyword FlashInfer may add after 0.7.4 (``**unknown``: a named refusal instead of
    Python's TypeError).

    ``num_valid_heads`` (not FlashInfer's): the caller says that only the first
    ``num_valid_heads`` query heads are real and the rest padding; those are neither read
    nor computed, and their rows of ``out`` are left as they are. By default every head is
    served as given.

    Returns ``out`` (and, with ``return_lse``, the lse in ``lse_convention``, by default
    FlashInfer's log2 with the sink folded in, shaped like ``out`` without its last dim, and
    ``num_valid_heads`` wide when that is given).
    """
    if lse_convention not in LSE_CONVENTIONS:
        _check_convention(lse_convention, query)
    formats = DSV4_KV_CACHE_FORMATS.get(kv_cache_format) if isinstance(kv_cache_format, str) else None
    problem = _dsv4_refusal(cum_seq_lens_q, bmm1_scale, bmm2_scale, kv_layout, sparse_topk_lens,
                            sparse_topk_lens_offset, sparse_indices, compressed_kv_cache, extra_sparse_indices, backend,
                            kv_cache_format, formats, unknown, hca_swa_indices, hca_compressed_block_tables,
                            hca_seq_lens, hca_use_persistent, hca_sparse_indices_format,
                            sparse_indices_are_storage_offsets, dsv4_output_scale, dsv4_inv_rope_cos_sin_cache)
    if problem is not None:
        _refuse(problem, query, _DSV4_FORMAT if formats is None else formats[0])
    main_format, extra_format = formats
    q, o, sink = query, out, sinks
    if num_valid_heads is not None:
        q, o, sink = _valid_heads(query, out, sinks, num_valid_heads, main_format)
    # q, kv_cache, indices, topk_length, attn_sink, out, lse, extra_kv_cache, extra_indices,
    # extra_topk_length: the record from a tuple in its fields' order (a keyword call costs
    # three times as much on this hot path; the order is tested in tests/test_adapters.py)
    given = DecodeTensors._make((q, swa_kv_cache, sparse_indices, swa_topk_lens, sink, o, None, compressed_kv_cache,
                                 extra_sparse_indices, extra_sparse_topk_lens))
    result, lse = one_shot_decode(given, sm_scale=bmm1_scale, lse_convention="natural", precision=None,
                                  kv_format=main_format, keep_lse=return_lse, caller_tag=kv_layout,
                                  extra_kv_format=None if compressed_kv_cache is None else extra_format,
                                  caller_check=lambda: _check_kv_layout(query, kv_layout, main_format,
                                                                        swa_kv_cache=swa_kv_cache,
                                                                        compressed_kv_cache=compressed_kv_cache))
    if o is not out:
        result = out
    if not return_lse:
        return result
    return result, convert_lse(lse, sink, lse_convention)


def _check_kv_layout(query, kv_layout, kv_format, **caches) -> None:
    """Refuse a 4-D cache not laid out as ``kv_layout`` says (checked with the call's layout:
    the plan cache's key holds ``kv_layout`` and the caches' shapes)."""
    head_axis = 2 if kv_layout == "NHD" else 1  # [nb, P, 1, W] or [nb, 1, P, W]
    for name, cache in caches.items():
        if isinstance(cache, torch.Tensor) and cache.dim() == 4 and cache.shape[head_axis] != 1:
            _refuse(f"{name} of shape {list(cache.shape)} is not laid out as kv_layout={kv_layout!r} "
                    f"({'[num_blocks, P, 1, W]' if kv_layout == 'NHD' else '[num_blocks, 1, P, W]'})", query,
                    kv_format)


def _valid_heads(query, out, sinks, num_valid_heads, kv_format):
    """The first ``num_valid_heads`` heads of ``query``, ``out`` and ``sinks`` (views; ``out``
    is required)."""
    if isinstance(num_valid_heads, bool) or not isinstance(num_valid_heads, int) or not (
            isinstance(query, torch.Tensor) and query.dim() >= 3 and 1 <= num_valid_heads <= query.shape[-2]):
        _refuse(f"num_valid_heads must be an int in [1, num_heads], got {num_valid_heads!r}", query, kv_format)
    if not isinstance(out, torch.Tensor) or out.dim() != query.dim():
        _refuse("num_valid_heads needs out (the padded heads' rows are left as they are)", query, kv_format)
    if isinstance(sinks, torch.Tensor) and sinks.dim() == 1 and sinks.shape[0] == query.shape[-2]:
        sinks = sinks[:num_valid_heads]
    return query[..., :num_valid_heads, :], out[..., :num_valid_heads, :], sinks


# hca_swa_indices ... hca_sparse_indices_format, sparse_indices_are_storage_offsets, dsv4_output_scale,
# dsv4_inv_rope_cos_sin_cache
_UNSERVED_DEFAULTS = (None, None, None, False, None, False, None, None)
_UNSERVED_NAMES = ("hca_swa_indices", "hca_compressed_block_tables", "hca_seq_lens", "hca_use_persistent",
                   "hca_sparse_indices_format", "sparse_indices_are_storage_offsets", "dsv4_output_scale",
                   "dsv4_inv_rope_cos_sin_cache")


def _dsv4_refusal(cum_seq_lens_q, bmm1_scale, bmm2_scale, kv_layout, sparse_topk_lens, sparse_topk_lens_offset,
                  sparse_indices, compressed_kv_cache, extra_sparse_indices, backend, kv_cache_format, formats,
                  unknown, *unserved) -> str | None:
    """Why a ``trtllm_batch_decode_sparse_mla_dsv4`` call is not served (None: nothing found);
    ``formats``: ``kv_cache_format``'s pair in ``DSV4_KV_CACHE_FORMATS`` (None: not one),
    ``unknown``: the keywords no FlashInfer release this adapter follows has. Every call runs
    it: the common case is a handful of comparisons."""
    if cum_seq_lens_q is not None:
        d_qk = FORMATS[_DSV4_FORMAT].d_qk
        return (f"cum_seq_lens_q (ragged query lengths) is not served: pass [batch, seq_q, heads, {d_qk}] or "
                f"[tokens, heads, {d_qk}]")
    problem = _scale_problem(bmm1_scale, bmm2_scale)
    if problem is not None:
        return problem
    if kv_layout != "NHD" and kv_layout != "HND":
        return f"kv_layout must be 'HND' or 'NHD', got {kv_layout!r}"
    if sparse_topk_lens is not None:
        return ("sparse_topk_lens is FlashInfer's SM100 length of one combined table (its 128 SWA entries "
                "included), which its SM120 path does not read: pass the main list's lengths as swa_topk_lens and "
                "the compressed list's as extra_sparse_topk_lens")
    if sparse_indices is None:
        return "sparse_indices is required (the main cache's slots per token)"
    if (compressed_kv_cache is None) != (extra_sparse_indices is None):
        return "compressed_kv_cache and extra_sparse_indices go together: pass both or neither"
    if backend not in _DSV4_BACKENDS:
        return f"backend must be one of {_DSV4_BACKENDS} (this library's kernels), got {backend!r}"
    if unserved != _UNSERVED_DEFAULTS:
        given = [name for name, value, default in zip(_UNSERVED_NAMES, unserved, _UNSERVED_DEFAULTS)
                 if value is not default]
        return (f"{', '.join(given)}: not served (FlashInfer's HCA inputs; storage-offset indices and the FP8 "
                f"output with a fused inverse RoPE, which vLLM passes only on SM100)")
    if unknown:
        return (f"{', '.join(sorted(unknown))}: not a keyword of FlashInfer's trtllm_batch_decode_sparse_mla_dsv4 "
                f"this adapter serves (checked against {FLASHINFER_CHECKED})")
    if sparse_topk_lens_offset != 0:
        return (f"sparse_topk_lens_offset must be 0 (it offsets sparse_topk_lens, FlashInfer's SM100 length), "
                f"got {sparse_topk_lens_offset!r}")
    if formats is None:
        return f"kv_cache_format must be one of {sorted(DSV4_KV_CACHE_FORMATS)}, got {kv_cache_format!r}"
    return None


def _scale_problem(bmm1_scale, bmm2_scale) -> str | None:
    """What FlashInfer's two scales ask that the kernels do not do (None: nothing), for both
    FlashInfer adapters. Any other ``bmm1_scale`` is the API's ``sm_scale``, refused by its
    rule (``SCALE_RULE``) where it is not a usable number."""
    if isinstance(bmm1_scale, torch.Tensor) or isinstance(bmm2_scale, torch.Tensor):
        return ("bmm1_scale and bmm2_scale must be Python numbers: a tensor would be read back to the host (a "
                "synchronization, wrong under CUDA-graph capture; FlashInfer's SM120 path refuses it too)")
    if bmm2_scale != 1.0:
        return f"bmm2_scale must be 1.0 (the FP8 cache carries its own scales), got {bmm2_scale}"
    return None


# FlashInfer's kv_scale_format values for its packed FP32-scale sparse backend ("auto" and
# "pow2_fp32": DeepSeek-V3.2's power-of-two scales; "arbitrary_fp32": GLM's). The kernels here
# apply any FP32 scale exactly, so each only has to name an FP32-scale format.
FP32_SCALE_FORMATS = ("auto", "pow2_fp32", "arbitrary_fp32")
# what FlashInfer's return_lse_base asks for, as this library's lse conventions
_LSE_BASES = {None: "log2_with_sink", "base2": "log2_with_sink", "basee": "natural_with_sink"}


def _fp32_scale_format(kv_lora_rank, qk_rope_head_dim) -> KvFormat | None:
    """The inline FP32-scale format of these widths: V3.2's rows (512 + 64, which GLM-5.x
    uses too), GLM-5.3's (512 + 0); None for any other pair."""
    found = [f for f in FORMATS.values()
             if f.fp32_scales and (f.nope_dims, f.rope_dims) == (kv_lora_rank, qk_rope_head_dim)]
    return found[0] if len(found) == 1 else None


def _served_formats() -> str:
    return ", ".join(f"{f.name} ({f.nope_dims} + {f.rope_dims})" for f in FORMATS.values() if f.fp32_scales)


def _per_token_lengths(seq_lens, top_k_lens, batch: int, seq_q: int, refuse):
    """The main list's lengths, one per query token, from FlashInfer's arguments: ``seq_lens``
    shaped ``[B, S]`` or ``[B*S]`` (as its sparse backend reads them; ``[B]`` with S > 1,
    per-request sequence lengths that bound no list, is ignored as it ignores it), or
    ``sparse_mla_top_k_lens [B*S]`` (which FlashInfer takes for the rope-free layout; here
    for either); not both."""
    flat = None
    if seq_lens is not None:
        if not isinstance(seq_lens, torch.Tensor):
            refuse(f"seq_lens must be a torch.Tensor or None, got {type(seq_lens).__name__}")
        if tuple(seq_lens.shape) == (batch, seq_q) or tuple(seq_lens.shape) == (batch * seq_q,):
            flat = seq_lens.reshape(batch * seq_q)
        elif tuple(seq_lens.shape) != (batch,):
            refuse(f"seq_lens has shape {list(seq_lens.shape)}, expected [{batch}], [{batch * seq_q}] or "
                   f"[{batch}, {seq_q}]")
    if top_k_lens is not None:
        if flat is not None:
            refuse("pass the per-token lengths once: seq_lens or sparse_mla_top_k_lens, not both")
        flat = top_k_lens
    return flat


def trtllm_batch_decode_with_kv_cache_mla(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    workspace_buffer: torch.Tensor | None,
    qk_nope_head_dim: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor | None,
    max_seq_len: int,
    sparse_mla_top_k: int = 0,
    out: torch.Tensor | None = None,
    bmm1_scale: float = 1.0,
    bmm2_scale: float = 1.0,
    sinks=None,
    skip_softmax_threshold_scale_factor: float | None = None,
    enable_pdl: bool | None = None,
    backend: str = "auto",
    is_var_seq: bool = True,
    uses_shared_paged_kv_idx: bool = True,
    lse: torch.Tensor | None = None,
    return_lse: bool = False,
    cute_dsl_impl: str = "auto",
    kv_scale_format: str = "auto",
    cum_seq_lens_q: torch.Tensor | None = None,
    max_q_len: int | None = None,
    multi_ctas_kv_counter_buffer: torch.Tensor | None = None,
    sparse_mla_top_k_lens: torch.Tensor | None = None,
    enable_dcp: bool = False,
    cp_world: int = 1,
    cp_rank: int = 0,
    causal_seqlens_kv_global: torch.Tensor | None = None,
    use_fp16_softmax: bool | None = None,
    return_lse_base: str | None = None,
    *,
    lse_convention: str | None = None,
):
    """FlashInfer's ``trtllm_batch_decode_with_kv_cache_mla`` in its sparse form (the call
    vLLM's SM120 sparse MLA backend makes for DeepSeek-V3.2 and GLM-5.x), for the FP32-scale
    formats: ``kv_lora_rank=512, qk_rope_head_dim=64`` reads V3.2 / GLM-5.x 656-byte rows
    (``v32_fp8``), ``kv_lora_rank=512, qk_rope_head_dim=0`` GLM-5.3's rope-free rows
    (``glm_nope_fp8``, 528- or 656-byte pitch). ``kv_scale_format`` ("auto", "pow2_fp32",
    "arbitrary_fp32") must name FP32 scales: each is applied exactly, whatever its value.

    ``query [B, S, H, d_qk]`` bf16; ``kv_cache`` ``[num_pages, 1, P, W]`` or
    ``[num_pages, P, W]`` (uint8); ``block_tables [B, S, sparse_mla_top_k]`` int32 cache slots
    (-1: none); ``sparse_mla_top_k > 0``. Per-token lengths: ``seq_lens`` shaped ``[B, S]`` or
    ``[B*S]`` (``[B]`` with S > 1 is ignored, as FlashInfer's sparse backend ignores it), or
    ``sparse_mla_top_k_lens [B*S]``. ``bmm1_scale`` is the softmax scale (a float);
    ``bmm2_scale`` must be 1. ``sinks``: a ``[H]`` tensor or a list holding one.
    ``workspace_buffer``, ``qk_nope_head_dim``, ``max_seq_len``, ``enable_pdl``,
    ``is_var_seq`` and ``cute_dsl_impl`` are accepted and not needed; ``backend`` must be
    "auto" or "sparse". Refused: dense decode, ragged queries (``cum_seq_lens_q``), context
    parallelism, skip-softmax, separate K/V page indices, a counter buffer, fp16 softmax.

    Returns ``out [B, S, H, 512]``; with ``return_lse`` also the lse ``[B*S, H]`` (or written
    into ``lse``, ``[B*S, H]`` or ``[B, S, H]`` float32) in ``lse_convention``: by default
    the one ``return_lse_base`` names (None or "base2": "log2_with_sink", FlashInfer's
    sparse default; "basee": "natural_with_sink"); any of ``dispatch.runtime.lse.LSE_CONVENTIONS``.
    """
    fmt = _fp32_scale_format(kv_lora_rank, qk_rope_head_dim)

    def refuse(problem: str) -> None:
        _refuse(problem, query, None if fmt is None else fmt.name)

    if fmt is None:
        refuse(f"kv_lora_rank={kv_lora_rank}, qk_rope_head_dim={qk_rope_head_dim} name no FP32-scale cache format "
               f"this call serves (kv_lora_rank + qk_rope_head_dim: {_served_formats()}); DeepSeek-V4's MODEL1 "
               f"cache goes through trtllm_batch_decode_sparse_mla_dsv4")
    scale_format = str(kv_scale_format).lower().replace("-", "_")
    if scale_format not in FP32_SCALE_FORMATS:
        refuse(f"kv_scale_format must be one of {FP32_SCALE_FORMATS} (FP32 scales), got {kv_scale_format!r}")
    if not isinstance(sparse_mla_top_k, int) or sparse_mla_top_k <= 0:
        refuse(f"sparse_mla_top_k must be a positive int (dense MLA decode is not served), got {sparse_mla_top_k!r}")
    if backend not in ("auto", "sparse"):
        refuse(f"backend must be 'auto' or 'sparse' (the SM120 sparse backend), got {backend!r}")
    for given, what in ((skip_softmax_threshold_scale_factor is not None, "skip_softmax_threshold_scale_factor"),
                        (not uses_shared_paged_kv_idx, "uses_shared_paged_kv_idx=False (separate K/V page indices)"),
                        (cum_seq_lens_q is not None or max_q_len is not None,
                         "cum_seq_lens_q / max_q_len (ragged query lengths)"),
                        (multi_ctas_kv_counter_buffer is not None, "multi_ctas_kv_counter_buffer"),
                        (enable_dcp or cp_world != 1 or cp_rank != 0 or causal_seqlens_kv_global is not None,
                         "decode context parallelism (enable_dcp, cp_world, cp_rank, causal_seqlens_kv_global)"),
                        (bool(use_fp16_softmax), "use_fp16_softmax")):
        if given:
            refuse(f"{what} is not served by the sparse decode")
    problem = _scale_problem(bmm1_scale, bmm2_scale)
    if problem is not None:
        refuse(problem)
    if return_lse_base not in _LSE_BASES:
        refuse(f"return_lse_base must be 'basee', 'base2' or None, got {return_lse_base!r}")
    convention = _LSE_BASES[return_lse_base] if lse_convention is None else lse_convention
    if convention not in LSE_CONVENTIONS:
        refuse(f"lse_convention must be one of {LSE_CONVENTIONS}, got {lse_convention!r}")
    if return_lse_base is not None and convention != _LSE_BASES[return_lse_base]:
        refuse(f"return_lse_base={return_lse_base!r} asks for {_LSE_BASES[return_lse_base]!r}, "
               f"lse_convention={lse_convention!r} for another: pass one")
    if lse is not None and not return_lse:
        refuse("lse was given without return_lse=True")
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        got = getattr(query, "shape", type(query).__name__)
        refuse(f"query must be [batch, seq_q, num_heads, {fmt.d_qk}], got {got}")
    batch, seq_q, num_heads = query.shape[:3]
    if not isinstance(block_tables, torch.Tensor) or tuple(block_tables.shape) != (batch, seq_q, sparse_mla_top_k):
        refuse(f"block_tables has shape {list(getattr(block_tables, 'shape', []))}, expected "
               f"[{batch}, {seq_q}, {sparse_mla_top_k}] ([batch, seq_q, sparse_mla_top_k] cache slots)")
    if isinstance(sinks, (list, tuple)):
        if len(sinks) != 1:
            refuse(f"sinks must be one [num_heads] tensor or a list holding one, got a list of {len(sinks)}")
        sinks = sinks[0]
    lengths = _per_token_lengths(seq_lens, sparse_mla_top_k_lens, batch, seq_q, refuse)
    cache = kv_cache.unsqueeze(1) if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 3 else kv_cache
    if lse is not None and (not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32
                            or tuple(lse.shape) not in ((batch * seq_q, num_heads), (batch, seq_q, num_heads))):
        refuse(f"lse must be float32 [{batch * seq_q}, {num_heads}] or [{batch}, {seq_q}, {num_heads}], got "
               f"{getattr(lse, 'dtype', type(lse).__name__)} {list(getattr(lse, 'shape', []))}")
    result, natural = sparse_mla_decode(query, cache, block_tables, sm_scale=bmm1_scale, topk_length=lengths,
                                        attn_sink=sinks, out=out, kv_format=fmt.name)
    if not return_lse:
        return result
    converted = convert_lse(natural, sinks, convention).reshape(batch * seq_q, num_heads)
    if lse is None:
        return result, converted
    lse.copy_(converted.view(lse.shape))
    return result, lse
