"""On Hopper, the engines' FlashMLA sparse decode calls, each served by this library or handed
to the engine's own FlashMLA function, as ``dispatch.policy.sm90_policy`` says for its shape.

The plugins wrap the engine's FlashMLA function with ``make_route`` and the methods that make
the calls with ``sites.within_site``: a call site sets ``sites.SITE`` (its name and the layer's real query
heads) for the duration of the call, so the route knows how many of the padded heads are real.
A call made outside a known site, a call that is not the sparse FP8 decode, or one with an
input this library does not read (batch-invariant mode, descaled queries, a keyword the route
does not know) goes to the engine's function unchanged; the last case is logged once.

The choice depends only on shapes (the family of the cache, real heads, tokens, entries):
under CUDA-graph capture it is made once, at capture, and the graph replays that kernel.
"""

from __future__ import annotations

import logging
import os

import torch

from cute_kernels.sparse_mla_decode.kv_format import D_V, FORMAT_BY_WIDTH, FORMATS

from ..policy import sm90_policy
from . import flashmla
from .plugin_mode import OncePerProcess
from .sites import SITE, Site

# names the engine's FlashMLA function takes: FlashMLA's own (vLLM 0.34's vendored interface)
# and those SGLang 0.5.23's wrapper adds (``sglang/kernels/ops/attention/flash_mla_interface.py``)
FLASHMLA_KEYWORDS = frozenset((
    "q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata", "num_splits",
    "softmax_scale", "causal", "is_fp8_kvcache", "indices", "attn_sink", "extra_k_cache", "extra_indices_in_kvcache",
    "topk_length", "extra_topk_length", "out", "enable_batch_invariant"))
SGLANG_KEYWORDS = frozenset(("descale_q", "descale_k", "kv_format", "use_legacy"))
KNOWN_KEYWORDS = FLASHMLA_KEYWORDS | SGLANG_KEYWORDS
# SGLang's kv_format names (``dsa_backend.py``): V3.2's 656-byte rows, GLM-5.3's rope-free 528-byte
# rows (no family of the route's table: FlashMLA serves them)
SGLANG_KV_FORMATS = {"V32": "v32_fp8", "V32_NO_ROPE": "glm_nope_fp8"}
ROUTE_TABLE_ENV = "DSV4_MLA_SM90_ROUTE_TABLE"


def route_table(log: logging.Logger | None = None) -> sm90_policy.RouteTable:
    """The table the route chooses by: the file ``ROUTE_TABLE_ENV`` names
    (``dsv4-mla-selftest --route-table``), else the shipped one (``sm90_policy.SHIPPED``). A
    file that is not a route table raises ValueError, logged first on ``log`` (a plugin reads
    it at start-up, not at the first decode)."""
    path = os.environ.get(ROUTE_TABLE_ENV, "").strip()
    try:
        return sm90_policy.load_table(path) if path else sm90_policy.SHIPPED
    except ValueError as err:
        if log is not None:
            log.error("dsv4-sparse-mla: %s", err)
        raise


def call_shape(kwargs: dict, site: Site) -> tuple[str, str, int, int] | None:
    """(format, family, tokens, entries) of a FlashMLA call made with ``kwargs`` at ``site``,
    or None where the call is not one this library may serve (the module docstring)."""
    if kwargs.get("indices") is None or kwargs.get("is_fp8_kvcache") is not True:
        return None
    if kwargs.get("enable_batch_invariant") or kwargs.get("causal") or kwargs.get("descale_q") is not None \
            or kwargs.get("descale_k") is not None or kwargs.get("use_legacy") is False:
        # (use_legacy=False: the token-interleaved V4.1 caches only, no record this route reads; SGLang
        # 0.5.23 ``sglang/kernels/ops/attention/flash_mla_interface.py`` l. 5-10)
        return None
    q, cache, indices = kwargs.get("q"), kwargs.get("k_cache"), kwargs["indices"]
    if not (isinstance(q, torch.Tensor) and isinstance(cache, torch.Tensor) and q.dim() == 4 and cache.dim() == 4
            and indices.dim() == 3):
        return None
    named = kwargs.get("kv_format")
    fmt = SGLANG_KV_FORMATS.get(named, "?") if named is not None else FORMAT_BY_WIDTH.get(cache.shape[-1])
    family = sm90_policy.FAMILY_OF_FORMAT.get(fmt)  # (None: a format FlashMLA's sparse decode does not read)
    # a query of another width (GLM-5.3's 512 over an unnamed 656-byte cache) is not this format's call
    if family is None or q.shape[-1] != FORMATS[fmt].d_qk or not 1 <= site.real_heads <= q.shape[-2]:
        return None
    extra = kwargs.get("extra_indices_in_kvcache")
    extra_cache = kwargs.get("extra_k_cache")
    if extra_cache is not None and (extra is None or extra_cache.shape[-1] != cache.shape[-1]):
        return None
    entries = indices.shape[-1] + (extra.shape[-1] if extra_cache is not None else 0)
    return fmt, family, q.shape[0] * q.shape[1], entries


def make_route(original, log: logging.Logger, engine: str, table: sm90_policy.RouteTable | None = None):
    """The engine's FlashMLA function ``original``, routed: same arguments, same return
    (``(out, lse)``; the lse None where the site does not read it). ``table``: the
    ``sm90_policy.RouteTable`` to choose by, instead of ``route_table()``."""
    table = route_table() if table is None else table
    told = OncePerProcess()  # (what, site): each said once per process, asked before anything is formatted

    def route(*args, **kwargs):
        site = SITE.get()
        if site is None:
            return original(*args, **kwargs)
        if args:  # the engines pass keywords only; a positional call is not read
            if told.first(("positional", site.name)):
                log.warning("dsv4-sparse-mla: %s (pid %d) passes %d positional arguments, which this library's "
                            "route does not read: these calls run %s's FlashMLA", site.name, os.getpid(), len(args),
                            engine)
            return original(*args, **kwargs)
        if not KNOWN_KEYWORDS.issuperset(kwargs):
            unknown = sorted(kwargs.keys() - KNOWN_KEYWORDS)
            if told.first(("unknown", site.name, tuple(unknown))):
                log.warning("dsv4-sparse-mla: %s (pid %d) passes %s, which this library's route does not know: these "
                            "calls run %s's FlashMLA", site.name, os.getpid(), ", ".join(unknown), engine)
            return original(*args, **kwargs)
        shape = call_shape(kwargs, site)
        if shape is None:
            return original(*args, **kwargs)
        fmt, family, tokens, entries = shape
        q = kwargs["q"]
        choice = table.choose(family, site.real_heads, tokens, entries)
        if told.first((choice, site.name)):
            log.warning("dsv4-sparse-mla: %s (pid %d): first call routed to %s (%s cache, %d real of %d heads, %d "
                        "tokens, %d entries; route table: %s)", site.name, os.getpid(),
                        "this library" if choice == sm90_policy.LIBRARY else f"{engine}'s FlashMLA", fmt,
                        site.real_heads, q.shape[-2], tokens, entries, table.source)
        if choice != sm90_policy.LIBRARY:
            return original(*args, **kwargs)
        return flashmla.flash_mla_with_kvcache(
            q, kwargs["k_cache"], None, None, kwargs.get("head_dim_v", D_V), softmax_scale=kwargs.get("softmax_scale"),
            is_fp8_kvcache=True, indices=kwargs["indices"], attn_sink=kwargs.get("attn_sink"),
            extra_k_cache=kwargs.get("extra_k_cache"), extra_indices_in_kvcache=kwargs.get("extra_indices_in_kvcache"),
            topk_length=kwargs.get("topk_length"), extra_topk_length=kwargs.get("extra_topk_length"),
            out=kwargs.get("out"), kv_format=fmt,
            num_valid_heads=site.real_heads if site.real_heads < q.shape[-2] else None, return_lse=site.wants_lse)

    route.__wrapped__ = original
    route.__qualname__ = f"route of {getattr(original, '__module__', '?')}.{getattr(original, '__qualname__', '?')}"
    return route
