"""FlashInfer's DeepSeek-V4 sparse MLA call shape, ``trtllm_batch_decode_sparse_mla_dsv4``
(``flashinfer.decode``), in its SM120 form: the function vLLM's DeepSeek-V4 / V4.1 attention
calls on SM12x."""

from __future__ import annotations

import operator

import torch

from cute_kernels.sparse_mla_decode.kv_format import FORMATS, MODEL1_FP8

from ..api import one_shot_decode
from ..runtime.decode_inputs import DecodeTensors, caller_names
from ..runtime.lse import LSE_CONVENTIONS, convert_lse
from .calls import check_lse_convention, flags_problem, flashinfer_scale_problem, refuse, valid_heads

# the FlashInfer releases whose parameters (names, order, defaults) the call shape takes: the
# releases the engines pin (vLLM 0.34.0: 0.7.3, its wheel's METADATA l. 90, not on the package
# index; SGLang 0.5.23: 0.7.2, its METADATA l. 232) and the newest; 0.7.2 and 0.7.4 have the same 31 positional parameters in the same order
FLASHINFER_CHECKED = "flashinfer-python 0.7.2 and 0.7.4"

# FlashInfer's kv_cache_format values as (main cache format, compressed cache format); "fp8"
# is its default, the record vLLM's DeepSeek-V4 and V4.1 attention keeps on SM120; 0.7.2 has
# the first four, 0.7.4 adds the two inline-scale records
DSV4_KV_CACHE_FORMATS = {
    "fp8": ("model1_fp8", "model1_fp8"),
    "nvfp4": ("model1_nvfp4", "model1_nvfp4"),
    "fp8_dsv41": ("v41_fp8", "v41_fp8"),
    "fp8_dsv41_fp4_ca": ("v41_fp8", "v41_nvfp4"),
    "fp8_dsv41_inline": ("v41_fp8_inline", "v41_fp8_inline"),
    "fp8_dsv41_inline_fp4_ca": ("v41_fp8_inline", "v41_nvfp4_inline"),
}
_DSV4_FORMAT = MODEL1_FP8.name  # what a refusal names before kv_cache_format is read
# FlashInfer's names of the decode's arguments: what a refusal names
DSV4_NAMES = caller_names(dict(q="query", kv_cache="swa_kv_cache", indices="sparse_indices",
                               topk_length="swa_topk_lens", attn_sink="sinks", extra_kv_cache="compressed_kv_cache",
                               extra_indices="extra_sparse_indices", extra_topk_length="extra_sparse_topk_lens",
                               sm_scale="bmm1_scale"))
# FlashInfer's kernel families on SM120 ("trtllm-gen" and "cute-dsl" are SM100's: FlashInfer
# 0.7.4 ``flashinfer/mla/_core.py`` l. 1841, 1880-1936): these
# kernels serve each SM120 one
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
    remapped_sparse_indices_buffer: torch.Tensor | None = None,
    sparse_indices_are_storage_offsets: bool | None = None,
    dsv4_inv_rope_cos_sin_cache: torch.Tensor | None = None,
    dsv4_output_scale: torch.Tensor | None = None,
    sparse_topk_lens_offset: int = 0,
    multi_ctas_kv_counter_buffer: torch.Tensor | None = None,
    *,
    kv_cache_format: str = "fp8",
    num_valid_heads: int | None = None,
    return_lse: bool = False,
    lse_convention: str = "log2_with_sink",
    **unknown,
):
    """FlashInfer's ``trtllm_batch_decode_sparse_mla_dsv4`` (``flashinfer/mla/_core.py`` of
    flashinfer-python 0.7.2 and 0.7.4: every parameter, in their positional order, with their
    defaults) in its SM120 form: the function vLLM's DeepSeek-V4 and V4.1 attention calls on
    SM12x (``DeepseekV4FlashInferSM120Attention._forward_decode`` / ``_forward_prefill`` in
    ``vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py`` and ``deepseek_v41/nvidia/``,
    read in vLLM 0.34.0's released wheel; ``dispatch.engines.vllm_plugin`` switches vLLM to
    this function).

    vLLM's call: ``query [T, H, 512]`` bf16 (heads zero-padded to 8/16/32/64/128),
    ``swa_kv_cache [num_blocks, 64, 1, 584]`` uint8 (page 64, blocks 37,440 bytes apart),
    ``sparse_indices [T, 1, window]`` int32 slots (``[T, window]`` too) with ``swa_topk_lens [T]``,
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
    SWA entries included, which its SM120 path does not read: refused, as any
    ``sparse_topk_lens_offset`` but the int 0. ``bmm1_scale`` must be a Python number (a
    tensor would be read back to the host, a synchronization that is wrong under CUDA-graph
    capture; ``calls.flashinfer_scale_problem``); ``bmm2_scale`` must be 1 (the cache
    carries its own scales). Accepted and not needed (this library plans its own split and
    scratch): ``workspace_buffer``, ``seq_lens``, ``max_q_len``, ``enable_pdl``,
    ``hca_is_causal``, and FlashInfer's scratch buffers ``remapped_sparse_indices_buffer`` and
    ``multi_ctas_kv_counter_buffer``. ``backend`` must be "auto", "sparse" or "cake"
    (FlashInfer's SM120 kernel families: these kernels serve every one).
    ``sparse_indices_are_storage_offsets`` None (FlashInfer's default) or False. Refused by
    name: ragged queries (``cum_seq_lens_q``), the ``hca_*`` inputs, storage-offset indices
    (``sparse_indices_are_storage_offsets=True``: the plain-row layout of vLLM's SM100 class),
    the FP8 output of that class (``dsv4_output_scale``, ``dsv4_inv_rope_cos_sin_cache``) and
    any keyword FlashInfer may add after 0.7.4 (``**unknown``: a named refusal instead of
    Python's TypeError).

    ``num_valid_heads`` (not FlashInfer's): the caller says that only the first
    ``num_valid_heads`` query heads are real and the rest padding; those are neither read
    nor computed, and their rows of ``out`` are left as they are. By default every head is
    served as given. ``return_lse`` / ``lse_convention`` (not FlashInfer's either): with
    ``return_lse=True`` the call returns ``(out, lse)``, the lse in ``lse_convention``, by
    default FlashInfer's log2 with the sink folded in, shaped like ``out`` without its last
    dim (``num_valid_heads`` wide when that is given); without it, ``out``.
    """
    if lse_convention not in LSE_CONVENTIONS:
        check_lse_convention(lse_convention, query)
    formats = DSV4_KV_CACHE_FORMATS.get(kv_cache_format) if isinstance(kv_cache_format, str) else None
    problem = _dsv4_refusal(cum_seq_lens_q, bmm1_scale, bmm2_scale, kv_layout, sparse_topk_lens,
                            sparse_topk_lens_offset, sparse_indices, compressed_kv_cache, extra_sparse_indices, backend,
                            kv_cache_format, formats, unknown, return_lse, enable_pdl, hca_is_causal, hca_swa_indices,
                            hca_compressed_block_tables, hca_seq_lens, hca_use_persistent, hca_sparse_indices_format,
                            sparse_indices_are_storage_offsets, dsv4_output_scale, dsv4_inv_rope_cos_sin_cache)
    if problem is not None:
        refuse(problem, query, _DSV4_FORMAT if formats is None else formats[0])
    main_format, extra_format = formats
    q, o, sink = query, out, sinks
    if num_valid_heads is not None:
        q, o, sink = valid_heads(query, out, sinks, num_valid_heads, main_format)
    # q, kv_cache, indices, topk_length, attn_sink, out, lse, extra_kv_cache, extra_indices,
    # extra_topk_length: the record from a tuple in its fields' order (a keyword call costs
    # three times as much on this hot path; the order is tested in tests/test_engine_call_shapes.py)
    given = DecodeTensors._make((q, swa_kv_cache, sparse_indices, swa_topk_lens, sink, o, None, compressed_kv_cache,
                                 extra_sparse_indices, extra_sparse_topk_lens))
    result, lse = one_shot_decode(given, sm_scale=bmm1_scale, lse_convention="natural", precision=None,
                                  kv_format=main_format, keep_lse=return_lse, caller_tag=kv_layout,
                                  extra_kv_format=None if compressed_kv_cache is None else extra_format,
                                  caller_check=lambda: _check_kv_layout(query, kv_layout, main_format,
                                                                        swa_kv_cache=swa_kv_cache,
                                                                        compressed_kv_cache=compressed_kv_cache),
                                  names=DSV4_NAMES)
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
            refuse(f"{name} of shape {list(cache.shape)} is not laid out as kv_layout={kv_layout!r} "
                   f"({'[num_blocks, P, 1, W]' if kv_layout == 'NHD' else '[num_blocks, 1, P, W]'})", query,
                   kv_format)


# hca_swa_indices ... hca_sparse_indices_format, sparse_indices_are_storage_offsets, dsv4_output_scale,
# dsv4_inv_rope_cos_sin_cache: what a served call leaves at FlashInfer's defaults (None and False
# both mean "not storage offsets")
_UNSERVED_NAMES = ("hca_swa_indices", "hca_compressed_block_tables", "hca_seq_lens", "hca_use_persistent",
                   "hca_sparse_indices_format", "sparse_indices_are_storage_offsets", "dsv4_output_scale",
                   "dsv4_inv_rope_cos_sin_cache")
_SERVED_VALUES = ((None,), (None,), (None,), (False,), (None,), (None, False), (None,), (None,))
_DEFAULTS = tuple(values[0] for values in _SERVED_VALUES)


def _dsv4_refusal(cum_seq_lens_q, bmm1_scale, bmm2_scale, kv_layout, sparse_topk_lens, sparse_topk_lens_offset,
                  sparse_indices, compressed_kv_cache, extra_sparse_indices, backend, kv_cache_format, formats,
                  unknown, return_lse, enable_pdl, hca_is_causal, *unserved) -> str | None:
    """Why a ``trtllm_batch_decode_sparse_mla_dsv4`` call is not served (None: nothing found);
    ``formats``: ``kv_cache_format``'s pair in ``DSV4_KV_CACHE_FORMATS`` (None: not one),
    ``unknown``: the keywords no FlashInfer release this call shape follows has (named first:
    a misspelt keyword is named as such, not as the one it should have been). Every call runs
    it: the common case is a handful of comparisons."""
    if unknown:
        return (f"{', '.join(sorted(unknown))}: not a keyword of FlashInfer's trtllm_batch_decode_sparse_mla_dsv4 "
                f"this call shape serves (checked against {FLASHINFER_CHECKED})")
    if cum_seq_lens_q is not None:
        d_qk = FORMATS[_DSV4_FORMAT].d_qk
        return (f"cum_seq_lens_q (ragged query lengths) is not served: pass [batch, seq_q, heads, {d_qk}] or "
                f"[tokens, heads, {d_qk}]")
    problem = flashinfer_scale_problem(bmm1_scale, bmm2_scale)
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
        return (f"backend must be one of {_DSV4_BACKENDS} (FlashInfer's SM120 kernel families; 'trtllm-gen' and "
                f"'cute-dsl' are its SM100 ones), got {backend!r}")
    if not all(map(operator.is_, unserved, _DEFAULTS)):  # the common call leaves them all at the defaults
        given = [name for name, value, served in zip(_UNSERVED_NAMES, unserved, _SERVED_VALUES)
                 if not any(value is s for s in served)]
        if given:
            return (f"{', '.join(given)}: not served (FlashInfer's HCA inputs; storage-offset indices and the FP8 "
                    f"output with a fused inverse RoPE, which vLLM's SM100 class passes)")
    if type(sparse_topk_lens_offset) is not int or sparse_topk_lens_offset != 0:
        return (f"sparse_topk_lens_offset must be the int 0 (it offsets sparse_topk_lens, FlashInfer's SM100 "
                f"length), got {sparse_topk_lens_offset!r}")
    problem = flags_problem(("return_lse", return_lse, False), ("enable_pdl", enable_pdl, True),
                            ("hca_is_causal", hca_is_causal, False))
    if problem is not None:
        return problem
    if formats is None:
        return f"kv_cache_format must be one of {sorted(DSV4_KV_CACHE_FORMATS)}, got {kv_cache_format!r}"
    return None
