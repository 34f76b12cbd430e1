"""FlashInfer's MLA decode call shape in its sparse form, ``trtllm_batch_decode_with_kv_cache_mla``
(``flashinfer.decode``): the call vLLM's SM120 sparse MLA backend makes for DeepSeek-V3.2 and
GLM-5.x (656-byte rows), and for GLM-5.3's rope-free rows."""

from __future__ import annotations

import torch

from cute_kernels.sparse_mla_decode.kv_format import FORMATS, KvFormat

from ..api import one_shot_decode
from ..runtime.decode_inputs import DecodeTensors, caller_names, scalar_problem
from ..runtime.lse import LSE_CONVENTIONS
from .calls import flags_problem, flashinfer_scale_problem, refuse as _refuse

# FlashInfer's names of the decode's arguments (the lengths: as the call gave them)
_MLA_NAMES = {lengths: caller_names(dict(q="query", indices="block_tables", topk_length=lengths, attn_sink="sinks",
                                         sm_scale="bmm1_scale"))
              for lengths in ("seq_lens", "sparse_mla_top_k_lens")}

# FlashInfer's kv_scale_format values for its packed FP32-scale sparse backend ("auto" and
# "pow2_fp32": DeepSeek-V3.2's power-of-two scales; "arbitrary_fp32": GLM's). The kernels here
# apply any FP32 scale exactly, so each only has to name an FP32-scale format.
FP32_SCALE_FORMATS = ("auto", "pow2_fp32", "arbitrary_fp32")
# what FlashInfer's return_lse_base asks for, as this library's lse conventions
_LSE_BASES = {None: "log2_with_sink", "base2": "log2_with_sink", "basee": "natural_with_sink"}


# the inline FP32-scale format of each (nope, rope) width pair: V3.2's rows (512 + 64, which
# GLM-5.x uses too), GLM-5.3's (512 + 0)
_FP32_SCALE_FORMAT_BY_WIDTHS = {(f.nope_dims, f.rope_dims): f for f in FORMATS.values() if f.fp32_scales}
assert len(_FP32_SCALE_FORMAT_BY_WIDTHS) == sum(f.fp32_scales for f in FORMATS.values())


def _fp32_scale_format(kv_lora_rank, qk_rope_head_dim) -> KvFormat | None:
    """The inline FP32-scale format of these widths; None for any other pair."""
    try:
        return _FP32_SCALE_FORMAT_BY_WIDTHS.get((kv_lora_rank, qk_rope_head_dim))
    except TypeError:  # an unhashable width (a tensor, a list) is no format's
        return None


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
    scale_format = kv_scale_format.lower().replace("-", "_") if isinstance(kv_scale_format, str) else None
    if scale_format not in FP32_SCALE_FORMATS:
        refuse(f"kv_scale_format must be one of {FP32_SCALE_FORMATS} (FP32 scales), got {kv_scale_format!r}")
    if scalar_problem(sparse_mla_top_k, "sparse_mla_top_k", "int") is not None or sparse_mla_top_k <= 0:
        refuse(f"sparse_mla_top_k must be a positive int (dense MLA decode is not served), got {sparse_mla_top_k!r}")
    problem = flags_problem(("return_lse", return_lse, False), ("is_var_seq", is_var_seq, False),
                            ("uses_shared_paged_kv_idx", uses_shared_paged_kv_idx, False),
                            ("enable_dcp", enable_dcp, False), ("enable_pdl", enable_pdl, True),
                            ("use_fp16_softmax", use_fp16_softmax, True))
    if problem is not None:
        refuse(problem)
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
    problem = flashinfer_scale_problem(bmm1_scale, bmm2_scale)
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
    lse_out = None
    if lse is not None:
        if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or tuple(lse.shape) not in (
                (batch * seq_q, num_heads), (batch, seq_q, num_heads)):
            refuse(f"lse must be float32 [{batch * seq_q}, {num_heads}] or [{batch}, {seq_q}, {num_heads}], got "
                   f"{getattr(lse, 'dtype', type(lse).__name__)} {list(getattr(lse, 'shape', []))}")
        try:  # written by the call itself, in the convention asked for: checked as any output is
            lse_out = lse.view(batch, seq_q, num_heads)
        except RuntimeError:
            refuse(f"lse of shape {list(lse.shape)} and strides {list(lse.stride())} cannot be viewed as "
                   f"[{batch}, {seq_q}, {num_heads}] without a copy: pass a tensor whose tokens are evenly strided")
    given = DecodeTensors._make((query, cache, block_tables, lengths, sinks, out, lse_out, None, None, None))
    names = _MLA_NAMES["seq_lens" if sparse_mla_top_k_lens is None else "sparse_mla_top_k_lens"]
    result, written = one_shot_decode(given, sm_scale=bmm1_scale, precision=None, kv_format=fmt.name,
                                      extra_kv_format=None, lse_convention=convention if return_lse else "natural",
                                      keep_lse=return_lse, names=names)
    if not return_lse:
        return result
    return result, (written.reshape(batch * seq_q, num_heads) if lse is None else lse)


def flashinfer_sparse_mla_forward(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    seq_lens: torch.Tensor,
    workspace_buffer: torch.Tensor | None,
    *,
    page_size: int,
    kv_cache_dim: int,
    qk_nope_head_dim: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    sm_scale: float,
    skip_softmax_threshold_scale_factor: float | None,
) -> torch.Tensor:
    """SGLang's ``flashinfer_sparse_mla_forward`` (``sglang/kernels/ops/attention/flash_mla_sm120.py``,
    SGLang 0.5.23): its DSA backend's decode of GLM-5 / GLM-5.3 on SM120 with an FP8 cache, the
    call it makes of FlashInfer's MLA decode made here. ``q [T, H, d_qk]``, ``kv_cache`` the
    pool's rows (viewed ``[-1, page_size, kv_cache_dim]``), ``indices [T, topk]`` pool rows
    (-1: none), ``seq_lens [T]`` the valid entries of each row, GLM's arbitrary FP32 scales.
    Returns ``out [T, H, 512]`` bf16. ``skip_softmax_threshold_scale_factor`` (SGLang's
    ``SGLANG_SKIP_SOFTMAX_*_THRESHOLD_SCALE_FACTOR``, unset by default) is refused: it skips
    entries, and the result is no longer the attention."""
    if not isinstance(kv_cache, torch.Tensor) or type(page_size) is not int or type(kv_cache_dim) is not int:
        _refuse(f"kv_cache must be a torch.Tensor and page_size, kv_cache_dim ints, got "
                f"{type(kv_cache).__name__}, {page_size!r}, {kv_cache_dim!r}", q)
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2 or not isinstance(q, torch.Tensor) or q.dim() != 3:
        _refuse(f"q must be [tokens, heads, d_qk] and indices [tokens, topk], got "
                f"{list(getattr(q, 'shape', []))} and {list(getattr(indices, 'shape', []))}", q)
    topk = indices.shape[1]
    rows = kv_cache.view(torch.uint8).view(-1, page_size, kv_cache_dim).unsqueeze(1)
    out = trtllm_batch_decode_with_kv_cache_mla(
        q.unsqueeze(1), rows, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
        indices.unsqueeze(1), seq_lens, topk, sparse_mla_top_k=topk, bmm1_scale=sm_scale,
        kv_scale_format="arbitrary_fp32", skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor)
    return out.squeeze(1)
