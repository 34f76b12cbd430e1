"""The other libraries ``dsv4-mla-selftest`` times on its own inputs, each called as a serving
engine calls it:

- FlashInfer's SM120 sparse MLA (sm_120 / sm_121): ``trtllm_batch_decode_sparse_mla_dsv4``
  for DeepSeek-V4 / V4.1 caches, the call vLLM's DeepSeek-V4 attention makes (its keywords:
  ``dispatch.engines.flashinfer_dsv4``, checked against flashinfer-python 0.7.2 and 0.7.4), and
  ``trtllm_batch_decode_with_kv_cache_mla`` in its sparse form for the FP32-scale rows of
  DeepSeek-V3.2 / GLM-5.x and GLM-5.3, the call vLLM's SM120 sparse MLA backend makes;
- FlashMLA's sparse FP8 decode (``flash_mla_with_kvcache`` with ``is_fp8_kvcache=True`` and
  ``indices=``; sm_90 among the GPUs this library runs on) on MODEL1 and V3.2 caches.

Building a peer's call (``flashinfer_call``, ``flashmla_call``) is kept apart from timing it
(``time_peer``): a ``PeerCall`` holds the function, its arguments and a note, or the reason the
peer cannot run here, and is built from the tensors of a ``sparse_mla_decode`` call with no
GPU work, so that it can be checked against a stand-in module on any machine. Query heads are
zero-padded as the engines pad them (the peer's time is then what the engine pays).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from cute_kernels.sparse_mla_decode.kv_format import get_format

from ..engines.flashinfer_dsv4 import DSV4_KV_CACHE_FORMATS

FLASHINFER, FLASHMLA = "FlashInfer", "FlashMLA"
PEERS = (FLASHINFER, FLASHMLA)
# the archs (of those this library runs on) where each peer's kernels run: FlashInfer's SM120
# sparse MLA on sm_120 / sm_121 only; FlashMLA's sparse decode on sm_90a and sm_100 only
FLASHINFER_ARCHS = ("sm_120a", "sm_121a")
FLASHMLA_ARCHS = ("sm_90a",)
# vLLM pads the query heads it hands FlashInfer's SM120 kernels to one of these
# (``_pad_to_supported_q_heads``); FlashMLA serves 64 or 128 heads (vLLM and SGLang pad to 64)
FLASHINFER_HEADS = (8, 16, 32, 64, 128)
FLASHMLA_HEADS = (64, 128)
# the formats FlashMLA's sparse decode reads (its MODEL1 and V3.2 layouts)
FLASHMLA_FORMATS = ("model1_fp8", "v32_fp8")
# the FP32-scale formats FlashInfer's sparse MLA call reads, with the scales each cache holds
# as ``dispatch.tools.sample_inputs.make_cache`` writes it (the format's first writer,
# ``cache_writers.WRITERS``): FlashMLA's power-of-two scales for V3.2, vLLM's arbitrary FP32
# scales for GLM-5.3
FLASHINFER_MLA_SCALES = {"v32_fp8": "pow2_fp32", "glm_nope_fp8": "arbitrary_fp32"}
WORKSPACE_BYTES = 128 << 20  # FlashInfer's workspace buffer, as vLLM allocates it
DSV4_FUNCTION = "trtllm_batch_decode_sparse_mla_dsv4"
MLA_FUNCTION = "trtllm_batch_decode_with_kv_cache_mla"
FLASHINFER_MODULES = ("flashinfer.decode", "flashinfer.mla", "flashinfer")  # where FlashInfer exposes them


@dataclass
class PeerCall:
    """One peer's call on a case's inputs (``fn(*args, **kwargs)``), or why there is none."""

    peer: str
    function: str = ""  # the qualified name called, e.g. "flashinfer.decode.trtllm_batch_decode_sparse_mla_dsv4"
    fn: Callable | None = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    note: str | None = None  # what differs from this library's call (padded heads)
    unavailable: str | None = None

    def __call__(self):
        return self.fn(*self.args, **self.kwargs)


def _import(module: str):
    """The module, or None where it cannot be imported."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def version_of(package: str) -> str | None:
    """The installed version of ``package`` (an import name), or None where it is not installed."""
    mod = _import(package)
    return None if mod is None else str(getattr(mod, "__version__", "unknown"))


def _find(modules: tuple[str, ...], name: str):
    """(function, qualified name) of the first of ``modules`` that has ``name``, or (None, None)."""
    for module in modules:
        mod = _import(module)
        fn = getattr(mod, name, None) if mod is not None else None
        if callable(fn):
            return fn, f"{module}.{name}"
    return None, None


def _takes(fn, keyword: str) -> bool:
    """Whether ``fn`` accepts ``keyword`` (by name, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _pad_heads(t: torch.Tensor | None, heads: int, dim: int) -> torch.Tensor | None:
    """``t`` zero-padded along ``dim`` to ``heads`` (``t`` itself where it has that many)."""
    if t is None or t.shape[dim] == heads:
        return t
    shape = list(t.shape)
    shape[dim] = heads
    padded = torch.zeros(shape, dtype=t.dtype, device=t.device)
    padded.narrow(dim, 0, t.shape[dim]).copy_(t)
    return padded


def _full_lengths(lengths: torch.Tensor | None, num_tokens: int, width: int, device) -> torch.Tensor:
    """The call's list lengths, or every list full where it has none (FlashInfer's SM120 path
    requires them)."""
    if lengths is not None:
        return lengths
    return torch.full((num_tokens,), width, dtype=torch.int32, device=device)


def _heads_note(heads: int, padded: int, engines: str) -> str | None:
    """What the peer's call computes beyond this library's: ``engines`` says who pads so."""
    return None if heads == padded else f"query heads zero-padded {heads} -> {padded}, as {engines} them"


def new_workspace(device) -> torch.Tensor:
    """The workspace buffer FlashInfer's calls take (zeroed, as vLLM allocates it)."""
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def _peer_module(peer: str, arch: str, archs: tuple, runs_on: str, module: str, install: str):
    """(the peer's module, None), or (None, its "not available" call): first the arch it never
    runs on (installed or not), then its install."""
    if arch not in archs:
        return None, PeerCall(peer, unavailable=f"{runs_on} (this GPU: {arch})")
    imported = _import(module)
    if imported is None:
        return None, PeerCall(peer, unavailable=f"not installed: {install}")
    return imported, None


def flashinfer_call(q, kv_cache, indices, kw: dict, *, arch: str, workspace: torch.Tensor) -> PeerCall:
    """FlashInfer's SM120 sparse MLA on the inputs of ``sparse_mla_decode(q, kv_cache, indices,
    **kw)`` (``kw``: ``kv_format`` and the optional inputs), as vLLM calls it on ``arch``."""
    flashinfer, refusal = _peer_module(FLASHINFER, arch, FLASHINFER_ARCHS,
                                       "FlashInfer's SM120 sparse MLA kernels run on sm_120 / sm_121 only",
                                       "flashinfer", "pip install flashinfer-python")
    if refusal is not None:
        return refusal
    fmt = get_format(kw["kv_format"])
    T, H, _ = q.shape
    padded = next((h for h in FLASHINFER_HEADS if H <= h), None)
    if padded is None:
        return PeerCall(FLASHINFER, unavailable=f"{H} query heads: FlashInfer's SM120 kernels serve at most "
                                                f"{FLASHINFER_HEADS[-1]}")
    if fmt.name in FLASHINFER_MLA_SCALES:
        return _flashinfer_mla_call(q, kv_cache, indices, kw, padded, workspace)
    return _flashinfer_dsv4_call(q, kv_cache, indices, kw, padded, workspace)


def _flashinfer_dsv4_call(q, kv_cache, indices, kw, padded, workspace) -> PeerCall:
    """``trtllm_batch_decode_sparse_mla_dsv4`` for a DeepSeek-V4 / V4.1 cache (and its
    compressed cache): vLLM's keywords, ``kv_cache_format`` naming the pairing."""
    fn, name = _find(FLASHINFER_MODULES, DSV4_FUNCTION)
    version = version_of("flashinfer")
    if fn is None:
        return PeerCall(FLASHINFER, unavailable=f"flashinfer {version} has no {DSV4_FUNCTION}")
    main = kw["kv_format"]
    extra = kw.get("extra_kv_format") or main
    has_extra = kw.get("extra_kv_cache") is not None
    pairing = next((key for key, formats in DSV4_KV_CACHE_FORMATS.items() if formats == (main, extra)), None)
    if pairing is None:
        return PeerCall(FLASHINFER, unavailable=f"FlashInfer has no kv_cache_format for a {main} cache with a {extra} "
                                                f"compressed cache")
    takes_format = _takes(fn, "kv_cache_format")
    if pairing != "fp8" and not takes_format:
        return PeerCall(FLASHINFER, unavailable=f"flashinfer {version}'s {DSV4_FUNCTION} has no kv_cache_format: it "
                                                f"reads MODEL1 FP8 caches only (this shape: {main})")
    T, H, _ = q.shape
    device = q.device
    kwargs = dict(query=_pad_heads(q, padded, 1), swa_kv_cache=kv_cache, workspace_buffer=workspace,
                  sparse_indices=indices,
                  out=torch.empty(T, padded, get_format(main).d_v, dtype=torch.bfloat16, device=device),
                  bmm1_scale=get_format(main).default_sm_scale, sinks=_pad_heads(kw.get("attn_sink"), padded, 0),
                  kv_layout="NHD", swa_topk_lens=_full_lengths(kw.get("topk_length"), T, indices.shape[-1], device))
    if has_extra:
        extra_indices = kw["extra_indices"]
        kwargs.update(compressed_kv_cache=kw["extra_kv_cache"],
                      extra_sparse_indices=extra_indices.view(T, 1, extra_indices.shape[-1]),
                      extra_sparse_topk_lens=_full_lengths(kw.get("extra_topk_length"), T, extra_indices.shape[-1],
                                                           device))
    if takes_format:
        kwargs["kv_cache_format"] = pairing
    return PeerCall(FLASHINFER, name, fn, (), kwargs, note=_heads_note(H, padded, "vLLM pads"))


def _flashinfer_mla_call(q, kv_cache, indices, kw, padded, workspace) -> PeerCall:
    """``trtllm_batch_decode_with_kv_cache_mla`` in its sparse form for an FP32-scale cache
    (V3.2 / GLM-5.x rows, GLM-5.3's rope-free rows): ``[T, 1, H, d_qk]`` queries,
    ``[num_pages, 1, P, W]`` pages, ``[T, 1, topk]`` slots, per-token lengths."""
    fn, name = _find(FLASHINFER_MODULES, MLA_FUNCTION)
    fmt = get_format(kw["kv_format"])
    if fn is None:
        return PeerCall(FLASHINFER, unavailable=f"flashinfer {version_of('flashinfer')} has no {MLA_FUNCTION}")
    T, H, d_qk = q.shape
    topk = indices.shape[-1]
    lengths = _full_lengths(kw.get("topk_length"), T, topk, q.device)
    kwargs = dict(query=_pad_heads(q, padded, 1).view(T, 1, padded, d_qk), kv_cache=kv_cache.transpose(1, 2),
                  workspace_buffer=workspace,
                  qk_nope_head_dim=128,  # the heads' nope width before absorption: read by no sparse kernel
                  kv_lora_rank=fmt.nope_dims, qk_rope_head_dim=fmt.rope_dims,
                  block_tables=indices.view(T, 1, topk), seq_lens=lengths,
                  max_seq_len=kv_cache.shape[0] * kv_cache.shape[1], sparse_mla_top_k=topk,
                  out=torch.empty(T, 1, padded, fmt.d_v, dtype=torch.bfloat16, device=q.device),
                  bmm1_scale=fmt.default_sm_scale)
    if fmt.rope_dims == 0:  # the rope-free layout takes its per-token lengths as sparse_mla_top_k_lens
        kwargs.update(seq_lens=None, sparse_mla_top_k_lens=lengths)
    if kw.get("attn_sink") is not None:
        kwargs["sinks"] = [_pad_heads(kw["attn_sink"], padded, 0)]
    if _takes(fn, "kv_scale_format"):
        kwargs["kv_scale_format"] = FLASHINFER_MLA_SCALES[fmt.name]
    return PeerCall(FLASHINFER, name, fn, (), kwargs, note=_heads_note(H, padded, "vLLM pads"))


def flashmla_call(q, kv_cache, indices, kw: dict, *, arch: str) -> PeerCall:
    """FlashMLA's sparse FP8 decode on the inputs of ``sparse_mla_decode(q, kv_cache, indices,
    **kw)``: ``flash_mla_with_kvcache(q [T, 1, H, d_qk], k_cache, None, None, 512,
    sched_meta, is_fp8_kvcache=True, indices=[T, 1, topk], ...)``, heads padded to 64 or 128."""
    flash_mla, refusal = _peer_module(FLASHMLA, arch, FLASHMLA_ARCHS,
                                      "FlashMLA's sparse decode runs on sm_90 / sm_100 only",
                                      "flash_mla", "FlashMLA is built from github.com/deepseek-ai/FlashMLA")
    if refusal is not None:
        return refusal
    main = kw["kv_format"]
    extra = kw.get("extra_kv_format") or main
    if main not in FLASHMLA_FORMATS or extra != main:
        return PeerCall(FLASHMLA, unavailable=f"FlashMLA reads {' and '.join(FLASHMLA_FORMATS)} caches (an extra cache "
                                              f"of the main cache's format), not {main}"
                                              + (f" + {extra}" if kw.get("extra_kv_cache") is not None else ""))
    T, H, d_qk = q.shape
    padded = next((h for h in FLASHMLA_HEADS if H <= h), None)
    if padded is None:
        return PeerCall(FLASHMLA, unavailable=f"{H} query heads: FlashMLA serves 64 or 128")
    fn, get_metadata = getattr(flash_mla, "flash_mla_with_kvcache", None), getattr(flash_mla, "get_mla_metadata", None)
    if fn is None or get_metadata is None:
        return PeerCall(FLASHMLA, unavailable=f"flash_mla {version_of('flash_mla')} has no flash_mla_with_kvcache / "
                                              f"get_mla_metadata")
    try:
        sched_meta = get_metadata()[0]  # filled by the first call (made before the CUDA-graph capture)
    except TypeError as err:
        return PeerCall(FLASHMLA, unavailable=f"this FlashMLA's get_mla_metadata is the older interface ({err}): the "
                                              f"sparse decode's FlashMLASchedMeta interface is needed")
    topk = indices.shape[-1]
    fmt = get_format(main)
    kwargs = dict(softmax_scale=fmt.default_sm_scale, causal=False, is_fp8_kvcache=True,
                  indices=indices.view(T, 1, topk), attn_sink=_pad_heads(kw.get("attn_sink"), padded, 0),
                  topk_length=kw.get("topk_length"))
    if kw.get("extra_kv_cache") is not None:
        extra_indices = kw["extra_indices"]
        kwargs.update(extra_k_cache=kw["extra_kv_cache"],
                      extra_indices_in_kvcache=extra_indices.view(T, 1, extra_indices.shape[-1]),
                      extra_topk_length=kw.get("extra_topk_length"))
    args = (_pad_heads(q, padded, 1).view(T, 1, padded, d_qk), kv_cache, None, None, fmt.d_v, sched_meta, None)
    return PeerCall(FLASHMLA, "flash_mla.flash_mla_with_kvcache", fn, args, kwargs,
                    note=_heads_note(H, padded, "vLLM and SGLang pad"))


def peer_calls(q, kv_cache, indices, kw: dict, *, arch: str, workspace: torch.Tensor) -> list[PeerCall]:
    """Every peer's call on these inputs, in ``PEERS`` order."""
    return [flashinfer_call(q, kv_cache, indices, kw=kw, arch=arch, workspace=workspace),
            flashmla_call(q, kv_cache, indices, kw=kw, arch=arch)]


def time_peer(call: PeerCall, timer) -> dict:
    """``{"us": time}`` (and the call's note) of ``timer(call)``, or ``{"us": None,
    "not_available": reason}``: the peer's own reason, or what it raised on these inputs."""
    if call.unavailable is not None:
        return {"us": None, "not_available": call.unavailable}
    try:
        us = timer(call)
    except Exception as err:  # the peer refused these inputs: say so, and go on with the others
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return {"us": None, "not_available": f"{call.function} raised {type(err).__name__}: {message}"[:300]}
    return {"us": us, **({"note": call.note} if call.note else {})}
