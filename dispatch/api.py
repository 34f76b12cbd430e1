"""Public API: ``sparse_mla_decode`` and ``plan_sparse_mla_decode``, sparse MLA decode on a
paged FP8 cache of any format the library reads (``dispatch.kv_formats``), and the
validation every layout goes through (``validate_call``; the one-shot call's plans are then
reused per layout, ``dispatch.runtime.plan_cache``)."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from cute_kernels.arch import SUPPORTED_ARCHS, arch_for_capability
from cute_kernels.sparse_mla_decode.cache_view import (
    CACHE_DTYPES, CacheLayoutError, CacheView, extra_format_of, format_of, read_cache_view,
)
from cute_kernels.sparse_mla_decode.kv_format import FORMATS, PRECISIONS, KvFormat, formats_of_width, get_format

from .policy.call_metadata import DecodeMetadata, InvalidDecodeInput
from .policy.precision import check_format_precision, resolve_precision
from .policy.selection import KernelSelection, PlanOverrides, select_for_call
from .runtime.decode_inputs import (
    ATTN_SINK, INT32_MAX, LSE, OUT, POINTER_ALIGN, CallerNames, DecodeTensors, byte_span, caller_names, dense_problem,
    misaligned_problem, overlap_problem, overlapping_output, scale_log2, scale_problem, self_overlap_problem,
)
from .runtime.lse import LSE_CONVENTIONS, check_convention, convert_lse
from .runtime.plan import DecodePlan, launch_problem
from .runtime.plan_cache import CachedPlan, PlanCache, layout_key



@functools.lru_cache(maxsize=None)
def device_target(index: int):
    """(compile arch or None, SM count, shared memory per SM) of a CUDA device; read once."""
    props = torch.cuda.get_device_properties(index)
    return (arch_for_capability((props.major, props.minor)), props.multi_processor_count,
            props.shared_memory_per_multiprocessor)


# ---------------------------------------------------------------------- metadata of a call
def _dim(t, i):
    try:
        return int(t.shape[i])
    except Exception:
        return None


def _page_size(cache, kv_format):
    try:
        return read_cache_view(cache, kv_format).page_block_size
    except Exception:
        return None


def _format_name(cache, kv_format) -> str | None:
    """The name of the format ``cache`` is read as (``kv_format`` or its width), None where
    that cannot be told yet (the refusal then says why)."""
    try:
        return format_of(cache, kv_format).name
    except Exception:
        return None


def _mains_of(*extra_names: str) -> list[str]:
    """The main formats a model pairs with an extra cache of one of ``extra_names``."""
    return sorted(m.name for m in FORMATS.values() if set(extra_names) & set(m.extras))


def _extra_format_name(extra_cache, main_name: str | None, extra_kv_format) -> str | None:
    """The name of the format the extra cache is read as beside a ``main_name`` cache
    (``cache_view.extra_format_of``), None where that cannot be told yet."""
    try:
        return extra_format_of(extra_cache, get_format(main_name), extra_kv_format).name
    except Exception:
        return None


def _describe_call(given: DecodeTensors, kv_format=None, extra_kv_format=None) -> DecodeMetadata:
    """Best-effort metadata (fields that cannot be read yet stay None) for error messages."""
    q, kv_cache, indices, topk_length, attn_sink, _, _, extra_kv_cache, extra_indices, extra_topk_length = given
    lead = None
    if isinstance(q, torch.Tensor) and q.dim() >= 3:
        lead = math.prod(q.shape[:-2])
    name = _format_name(kv_cache, kv_format)
    extra_name = _extra_format_name(extra_kv_cache, name, extra_kv_format) if extra_kv_cache is not None else None
    return DecodeMetadata(
        num_tokens=lead,
        num_heads=_dim(q, -2) if isinstance(q, torch.Tensor) and q.dim() >= 3 else None,
        d_qk=_dim(q, -1) if isinstance(q, torch.Tensor) else None,
        topk=_dim(indices, -1) if isinstance(indices, torch.Tensor) else None,
        page_block_size=_page_size(kv_cache, name),
        extra_topk=(_dim(extra_indices, -1) if isinstance(extra_indices, torch.Tensor) else 0),
        extra_page_block_size=(_page_size(extra_kv_cache, extra_name) if extra_kv_cache is not None else None),
        has_topk_length=topk_length is not None,
        has_extra_topk_length=extra_topk_length is not None,
        has_sink=attn_sink is not None,
        kv_format=name,
        extra_kv_format=extra_name if extra_name != name else None,
    )


# ---------------------------------------------------------------------- validation
class _Checker:
    """Raises ``InvalidDecodeInput`` naming the call for the first problem found; ``names``
    spells the arguments as the caller does (``CallerNames``)."""

    def __init__(self, md: DecodeMetadata, names: CallerNames):
        self.md = md
        self.names = names

    def fail(self, problem: str):
        raise InvalidDecodeInput(self.md, problem)

    def check(self, problem: str | None):
        """Fail with ``problem`` where there is one (a shared rule's finding)."""
        if problem is not None:
            self.fail(problem)

    def tensor(self, t, name: str, dtype: torch.dtype | tuple, device: torch.device):
        if not isinstance(t, torch.Tensor):
            self.fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        self.check(dense_problem(t, name))
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in dtypes:
            want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            self.fail(f"{name} must be {want}, got {str(t.dtype).replace('torch.', '')}")
        if t.device != device:
            self.fail(f"{name} is on {t.device}, expected {device} (the device of {self.names['q']})")

    def shape(self, t, name: str, expected: tuple):
        if tuple(t.shape) != tuple(expected):
            self.fail(f"{name} has shape {list(t.shape)}, expected {list(expected)}")

    def rows(self, t, name: str, align_elems: int):
        """Last dim contiguous; every other stride a multiple of ``align_elems`` (the kernels
        load a row's elements as wide words; the address itself: ``misaligned_problem``)."""
        if t.numel() == 0:
            return
        if t.stride(-1) != 1:
            self.fail(f"{name} must be contiguous in its last dimension, got strides {list(t.stride())}")
        for i in range(t.dim() - 1):
            if t.shape[i] > 1 and t.stride(i) % align_elems != 0:
                self.fail(f"{name} strides {list(t.stride())} must be multiples of {align_elems} elements "
                          f"(except the last)")

    def cache(self, cache, name: str, device: torch.device, kv_format: str | None) -> CacheView:
        if not isinstance(cache, torch.Tensor):
            self.fail(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
        self.check(dense_problem(cache, name))
        if cache.device != device:
            self.fail(f"{name} is on {cache.device}, expected {device} (the device of {self.names['q']})")
        try:
            view = read_cache_view(cache, kv_format, name=name)
        except CacheLayoutError as err:
            self.fail(str(err))
        return view

    def extra_cache(self, cache, main: KvFormat, device: torch.device, extra_kv_format: str | None) -> CacheView:
        """The extra cache, in ``extra_kv_format`` or the format ``cache_view.extra_format_of``
        reads it as: only a combination a model uses (``KvFormat.extras``); any other, and an
        extra cache beside a format no model pairs with one, is refused."""
        name = self.names["extra_kv_cache"]
        allowed = main.extras
        if not allowed:
            served = ", ".join(f"{m.name} + {e}" for m in FORMATS.values() for e in m.extras)
            self.fail(f"an {name} is not served with {main.name} caches: no model combines a {main.name} "
                      f"main cache with an extra cache (main + extra served: {served})")
        self.tensor(cache, name, CACHE_DTYPES, device)  # its dtype before its width is read as a format's
        try:
            fmt = extra_format_of(cache, main, extra_kv_format)
        except CacheLayoutError as err:
            self.fail(f"{name}: {err}")
        if fmt.name not in allowed:
            self.fail(f"{name} reads as {fmt.name}: a {main.name} main cache combines only with an "
                      f"extra cache of {list(allowed)} (extra_kv_format= names it)")
        return self.cache(cache, name, device, fmt.name)


def _qk_width(fmt: KvFormat) -> str:
    """``fmt``'s QK width in words, for messages: "576 (512 nope + 64 rope dims)"."""
    rope = f" + {fmt.rope_dims} rope dims" if fmt.rope_dims else " dims, no rope"
    return f"{fmt.d_qk} ({fmt.nope_dims} nope{rope})"


def _flatten_tokens(t: torch.Tensor, keep: int, name: str, check: _Checker) -> torch.Tensor:
    """View ``t`` with its leading dims flattened into one (the last ``keep`` dims kept)."""
    if t.dim() == keep + 1:
        return t
    try:
        return t.view(-1, *t.shape[t.dim() - keep:]) if t.numel() else t.reshape(-1, *t.shape[t.dim() - keep:])
    except RuntimeError:
        check.fail(f"{name} of shape {list(t.shape)} and strides {list(t.stride())}: its leading "
                   f"dimensions cannot be flattened without a copy; pass a tensor whose tokens are evenly strided")


def _lengths(t, name: str, num_tokens: int, lead: tuple, device, check: _Checker):
    """``t`` (``[T]``, ``[T, 1]`` or q's leading dims) viewed as [num_tokens]; refused unless
    that view is the tensor itself, contiguous (the kernels read ``num_tokens`` int32 from its
    data pointer)."""
    check.tensor(t, name, torch.int32, device)
    if tuple(t.shape) not in {(num_tokens,), (num_tokens, 1), tuple(lead)}:
        check.fail(f"{name} has shape {list(t.shape)}, expected [{num_tokens}] (one length per query token)")
    try:
        flat = t.view(num_tokens)
    except RuntimeError:
        flat = None
    if flat is None or (num_tokens > 1 and flat.stride(0) != 1):
        check.fail(f"{name} must be contiguous (one int32 per token, in token order), got shape {list(t.shape)} "
                   f"and strides {list(t.stride())}")
    return flat


def _indices(t, name: str, lead: tuple, num_tokens: int, device, check: _Checker, allow_empty: bool):
    check.tensor(t, name, torch.int32, device)
    if t.dim() < 2 or (tuple(t.shape[:-1]) not in {tuple(lead), (num_tokens,), (num_tokens, 1)}):
        check.fail(f"{name} has shape {list(t.shape)}, expected [{num_tokens}, topk], "
                   f"[{num_tokens}, 1, topk] or {list(lead) + ['topk']} (int32 cache slots, -1 for none)")
    if t.shape[-1] == 0 and not allow_empty:
        check.fail(f"{name} selects no entry (topk = 0); topk must be at least 1")
    if t.shape[-1] > 0 and t.stride(-1) != 1:
        check.fail(f"{name} must be contiguous in its last dimension, got strides {list(t.stride())}")
    flat = t.reshape(num_tokens, t.shape[-1]) if t.shape[-1] > 0 else t.new_empty(num_tokens, 0)
    if flat.shape[-1] > 0 and flat.data_ptr() != t.data_ptr():
        check.fail(f"{name}: its token dimensions cannot be flattened without a copy")
    return flat


# ---------------------------------------------------------------------- validated call
@dataclasses.dataclass
class ValidatedCall:
    """A call whose inputs passed every check, with what planning and launching need."""

    tensors: DecodeTensors  # out and lse allocated where they were not given
    num_tokens: int
    num_heads: int
    topk: int
    extra_topk: int
    main: CacheView  # its ``fmt`` is the call's cache format
    extra: CacheView  # the main cache when there is no extra cache (never read then)
    strides: dict
    sm_scale: float
    device_index: int
    arch: str | None
    num_sms: int
    smem_per_sm: int
    precision: str
    launch_metadata: DecodeMetadata
    # the dispatch's choice of kernels for the call (``select_for_call``); None for no token
    selection: KernelSelection | None = None

    @property
    def fmt(self) -> KvFormat:
        return self.main.fmt


def validate_call(q, kv_cache, indices, *, sm_scale=None, topk_length=None, attn_sink=None, extra_kv_cache=None,
                  extra_indices=None, extra_topk_length=None, out=None, lse=None, precision=None,
                  kv_format=None, extra_kv_format=None, for_plan=False, names=None, _target=None) -> ValidatedCall:
    """Check every input of a ``sparse_mla_decode`` call, and that the GPU can launch the
    kernels the call selects (no GPU work); allocate ``out`` / ``lse`` when not given. Raises
    InvalidDecodeInput. ``validate_tensors`` with the tensors by name."""
    given = DecodeTensors(q=q, kv_cache=kv_cache, indices=indices, topk_length=topk_length, attn_sink=attn_sink,
                          out=out, lse=lse, extra_kv_cache=extra_kv_cache, extra_indices=extra_indices,
                          extra_topk_length=extra_topk_length)
    return validate_tensors(given, sm_scale=sm_scale, precision=precision, kv_format=kv_format,
                            extra_kv_format=extra_kv_format, for_plan=for_plan, names=names, _target=_target)


def validate_tensors(given: DecodeTensors, *, sm_scale=None, precision=None, kv_format=None, extra_kv_format=None,
                     for_plan=False, names=None, _target=None) -> ValidatedCall:
    """Check every input, and that the GPU can launch the kernels the call selects
    (``ValidatedCall.selection``: each grid within CUDA's limits, ``plan.launch_problem``), with
    no GPU work; allocate ``out``/``lse`` when not given. Raises InvalidDecodeInput.

    ``kv_format``: the cache format's name (``dispatch.kv_formats.FORMATS``), or None to take
    it from the cache's last dimension where only one format has that width;
    ``extra_kv_format``: the extra cache's (None: ``cache_view.extra_format_of``). ``for_plan``: the
    call is to be planned, which needs at least one token. ``names``: how the caller spells
    the arguments, a mapping from the core names (the fields of ``DecodeTensors`` and
    ``sm_scale``) to its own, e.g. ``{"q": "query", "indices": "sparse_indices", "attn_sink":
    "sinks"}``; every refusal names an argument as mapped (one not mapped keeps its core
    name); TypeError for a mapping of anything else (``decode_inputs.caller_names``).
    ``_target``: a testing aid: (arch, SM count, shared memory per SM) to plan for, instead of
    those of the inputs' CUDA device, so that planning can be checked on CPU tensors (device
    index -1)."""
    names = caller_names(names)
    md = _describe_call(given, kv_format, extra_kv_format)
    check = _Checker(md, names)
    q, kv_cache, indices, topk_length, attn_sink, out, lse, extra_kv_cache, extra_indices, extra_topk_length = given
    n_q, n_cache, n_extra_cache = names["q"], names["kv_cache"], names["extra_kv_cache"]

    # the main cache first: its format says what q, out and the extra cache must be
    if not isinstance(q, torch.Tensor):
        check.fail(f"{n_q} must be a torch.Tensor, got {type(q).__name__}")
    check.check(dense_problem(q, n_q))
    if kv_format is None and isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 4:
        widths = formats_of_width(kv_cache.shape[-1])  # rows only an extra cache has: say so at once
        if widths and not any(FORMATS[w].main for w in widths):
            check.fail(f"{kv_cache.shape[-1]}-byte rows are those of {widths}, read only as an extra (compressed) "
                       f"cache: pass it as {n_extra_cache} beside a main cache of {_mains_of(*widths)}")
    main = check.cache(kv_cache, n_cache, q.device, kv_format)
    fmt = main.fmt
    if not fmt.main:
        check.fail(f"{fmt.name} is read only as an extra (compressed) cache: pass it as {n_extra_cache} beside a "
                   f"main cache of {_mains_of(fmt.name)}")
    if extra_kv_format is not None and extra_kv_cache is None:
        check.fail(f"extra_kv_format was given without {n_extra_cache}")

    # q: [T, H, d_qk] or [B, S, H, d_qk]
    if q.dim() not in (3, 4):
        check.fail(f"{n_q} has shape {list(q.shape)}, expected [num_tokens, num_heads, {fmt.d_qk}] or "
                   f"[batch, seq, num_heads, {fmt.d_qk}]")
    if q.shape[-1] != fmt.d_qk:
        check.fail(f"{n_q} has QK width {q.shape[-1]}, expected d_qk = {_qk_width(fmt)}")
    if q.dtype != torch.bfloat16:
        check.fail(f"{n_q} must be bfloat16, got {str(q.dtype).replace('torch.', '')}")
    device = q.device
    lead = tuple(q.shape[:-2])
    num_heads = q.shape[-2]
    if num_heads < 1:
        check.fail("num_heads must be at least 1")
    q3 = _flatten_tokens(q, 2, n_q, check)
    num_tokens = q3.shape[0]
    if for_plan and num_tokens == 0:
        check.fail("a plan needs at least one token; sparse_mla_decode returns at once for T=0")
    check.rows(q3, n_q, POINTER_ALIGN["q"] // q.element_size())

    # lists and the extra cache
    idx = _indices(indices, names["indices"], lead, num_tokens, device, check, allow_empty=False)
    has_extra = extra_kv_cache is not None or extra_indices is not None
    if (extra_kv_cache is None) != (extra_indices is None):
        check.fail(f"{n_extra_cache} and {names['extra_indices']} go together: pass both or neither")
    if extra_topk_length is not None and not has_extra:
        check.fail(f"{names['extra_topk_length']} was given without {n_extra_cache} / {names['extra_indices']}")
    extra, extra_idx = main, None
    if has_extra:
        extra = check.extra_cache(extra_kv_cache, fmt, device, extra_kv_format)
        extra_idx = _indices(extra_indices, names["extra_indices"], lead, num_tokens, device, check, allow_empty=True)
    if topk_length is not None:
        _lengths(topk_length, names["topk_length"], num_tokens, lead, device, check)
    extra_lens = (None if extra_topk_length is None
                  else _lengths(extra_topk_length, names["extra_topk_length"], num_tokens, lead, device, check))

    # scalars and outputs
    if sm_scale is None:
        sm_scale = fmt.default_sm_scale
    if scale_log2(sm_scale, fmt.default_sm_scale) is None:
        check.fail(scale_problem(sm_scale, names["sm_scale"]))
    if attn_sink is not None:
        n_sink = names["attn_sink"]
        check.tensor(attn_sink, n_sink, torch.float32, device)
        check.shape(attn_sink, n_sink, (num_heads,))
        if num_heads > 1 and attn_sink.stride(0) != 1:
            check.fail(f"{n_sink} must be contiguous")
    n_out, n_lse = names["out"], names["lse"]
    if out is None:
        out = torch.empty(*lead, num_heads, fmt.d_v, dtype=torch.bfloat16, device=device)
    check.tensor(out, n_out, torch.bfloat16, device)
    check.shape(out, n_out, (*lead, num_heads, fmt.d_v))
    check.check(self_overlap_problem(out, n_out))
    out3 = _flatten_tokens(out, 2, n_out, check)
    check.rows(out3, n_out, POINTER_ALIGN["out"] // out.element_size())
    if lse is None:
        lse = torch.empty(*lead, num_heads, dtype=torch.float32, device=device)
    check.tensor(lse, n_lse, torch.float32, device)
    check.shape(lse, n_lse, (*lead, num_heads))
    check.check(self_overlap_problem(lse, n_lse))
    lse2 = _flatten_tokens(lse, 1, n_lse, check)
    tensors = given._replace(out=out, lse=lse)
    for field, t in zip(DecodeTensors._fields, tensors):  # every address as the kernels load it
        if t is not None:
            check.check(misaligned_problem(t, names[field], POINTER_ALIGN[field]))
    spans = tuple(0 if t is None else byte_span(t) for t in tensors)
    overlap = overlapping_output(tuple(0 if t is None else t.data_ptr() for t in tensors), spans,
                                 tuple(i for i, n in enumerate(spans) if n))
    if overlap is not None:
        check.fail(overlap_problem(overlap, names))

    if precision is not None and precision not in PRECISIONS:
        check.fail(f"precision must be one of {PRECISIONS} or None (the default), got {precision!r}")
    try:  # before the device: a format's paths hold everywhere
        check_format_precision(precision, fmt.name)
        if extra is not main:
            check_format_precision(precision, extra.fmt.name)
    except ValueError as e:
        check.fail(str(e))
    if _target is not None:
        device_index = device.index if device.index is not None else -1
        arch, num_sms, smem_per_sm = _target
    else:
        if device.type != "cuda":
            check.fail(f"the inputs are on {device}: the kernels run on CUDA devices only")
        device_index = device.index if device.index is not None else torch.cuda.current_device()
        arch, num_sms, smem_per_sm = device_target(device_index)
    if arch is None:
        check.fail(f"device {torch.cuda.get_device_name(device)} is not a supported target; "
                   f"supported: {', '.join(SUPPORTED_ARCHS)}")
    try:
        precision = resolve_precision(precision, arch)  # the formats read it (checked above)
    except ValueError as e:
        check.fail(str(e))

    extra_topk = 0 if extra_idx is None else extra_idx.shape[-1]
    used_extra_idx = extra_idx if extra_topk > 0 else idx
    strides = {
        "q_t": q3.stride(0), "q_h": q3.stride(1), "idx_t": idx.stride(0),
        "extra_idx_t": used_extra_idx.stride(0),
        "main_block": main.block_stride, "main_row": main.row_stride, "main_slots": min(main.num_slots, INT32_MAX),
        "extra_block": extra.block_stride, "extra_row": extra.row_stride,
        "extra_slots": min(extra.num_slots, INT32_MAX),
        "out_t": out3.stride(0), "out_h": out3.stride(1), "lse_t": lse2.stride(0), "lse_h": lse2.stride(1),
    }
    call = ValidatedCall(
        tensors=tensors, num_tokens=num_tokens, num_heads=num_heads, topk=idx.shape[-1], extra_topk=extra_topk,
        main=main, extra=extra, strides=strides, sm_scale=float(sm_scale), device_index=device_index, arch=arch,
        num_sms=num_sms, smem_per_sm=smem_per_sm, precision=precision,
        launch_metadata=dataclasses.replace(md, has_extra_topk_length=extra_lens is not None and extra_topk > 0,
                                            kv_format=fmt.name,
                                            extra_kv_format=extra.fmt.name if extra.fmt is not fmt else None),
    )
    if num_tokens:  # the kernels it would launch: each launch within the GPU's limits
        call.selection = select_for_call(call)
        check.md = call.launch_metadata
        check.check(launch_problem(call.selection, q.shape, n_q))
    return call


# ---------------------------------------------------------------------- public API
# the one-shot call's validated plans, by layout key (``plan_cache``)
ONE_SHOT_PLANS = PlanCache()


def clear_plan_cache() -> None:
    """Drop the one-shot call's cached plans and the buffers it keeps (``dispatch.runtime.plan_cache``);
    the next call of each layout validates and plans again."""
    ONE_SHOT_PLANS.clear()


def plan_cache_info() -> dict:
    """What the one-shot call's plan cache holds (``dispatch.runtime.plan_cache``): ``entries`` (layouts)
    and ``capacity``; ``buffer_bytes`` (device memory kept: ``scratch_bytes`` + ``lse_bytes``),
    ``byte_cap`` and ``buffers``."""
    return ONE_SHOT_PLANS.info()


def plan_sparse_mla_decode(q, kv_cache, indices, *, topk_length=None, attn_sink=None, extra_kv_cache=None,
                           extra_indices=None, extra_topk_length=None, out=None, lse=None, precision=None,
                           overrides=None, kv_format=None, extra_kv_format=None):
    """Validate one call's inputs and return a ``DecodePlan`` for tensors laid out like them.

    Hold the plan for a shape bucket and call ``plan.run(q, kv_cache, indices, ..., out=,
    lse=, scratch=)`` on every step: it allocates nothing and can be captured in a CUDA
    graph. ``plan.scratch_bytes`` says how much scratch ``run`` needs (``plan.new_scratch()``);
    ``plan.bind(...)`` fixes the tensors too, for the fastest ``bound.run()``.
    ``overrides``: a ``dispatch.PlanOverrides`` forcing the head groups, splits, stages or
    register bound (a measurement and testing aid). Arguments (``kv_format`` included: the
    plan is for that format) and errors as ``sparse_mla_decode``, but for T = 0 (refused: a
    plan needs at least one token).
    """
    given = DecodeTensors(q=q, kv_cache=kv_cache, indices=indices, topk_length=topk_length, attn_sink=attn_sink,
                          out=out, lse=lse, extra_kv_cache=extra_kv_cache, extra_indices=extra_indices,
                          extra_topk_length=extra_topk_length)
    if overrides is not None:  # the overrides' own errors before any input's or the device's
        problem = None
        if not isinstance(overrides, PlanOverrides):
            problem = (f"overrides must be a dispatch.PlanOverrides (e.g. PlanOverrides(num_splits=2)) or None, "
                       f"got {type(overrides).__name__}")
        else:
            try:
                overrides.check()
            except ValueError as err:
                problem = str(err)
        if problem is not None:
            raise InvalidDecodeInput(_describe_call(given, kv_format, extra_kv_format), problem)
    call = validate_tensors(given, precision=precision, kv_format=kv_format, extra_kv_format=extra_kv_format,
                            for_plan=True)
    try:
        return DecodePlan(call, overrides)
    except InvalidDecodeInput:  # a launch the GPU cannot make (``plan.launch_problem``)
        raise
    except ValueError as err:  # an override no kernel has
        raise InvalidDecodeInput(call.launch_metadata, str(err)) from None


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    sm_scale: float | None = None,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    lse_convention: str = "natural",
    precision: str | None = None,
    kv_format: str | None = None,
    extra_kv_format: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode over a paged FP8 or NVFP4 cache (``dispatch.kv_formats.FORMATS``:
    DeepSeek-V4's MODEL1 FP8 and NVFP4 records, DeepSeek-V4.1's 528- and 288-byte records,
    DeepSeek-V3.2 / GLM-5's 656-byte rows, GLM-5.3's rope-free rows).

    Args:
        q: ``[T, H, d_qk]`` (or ``[B, S, H, d_qk]``) bf16 queries, the format's nope dims then
            its rope dims (MODEL1: 448 + 64; V3.2: 512 + 64; V4.1, GLM-5.3: 512).
        kv_cache: the cache, uint8 or float8_e4m3fn, as ``[num_blocks, P, 1, W]``,
            ``[num_blocks, 1, P, W]`` or ``[num_blocks, P*W]`` (W: 584 for MODEL1, 384 for its
            NVFP4 record, 528 for V4.1, 656 for V3.2, 528 or 656 for GLM-5.3); any block stride
            that is a multiple of 16 bytes and holds the block.
        indices: ``[T, topk]`` (or ``[T, 1, topk]``, ``[B, S, topk]``) int32 cache slots,
            slot = block * P + offset (the inline V4.1 records: a row of the whole cache,
            block * (block stride / row stride) + offset, as FlashInfer addresses them). -1,
            and any slot outside the cache, is ignored.
        sm_scale: softmax scale, default the format's ``d_qk ** -0.5``.
        topk_length: optional ``[T]`` int32; only the first ``topk_length[t]`` entries count
            (negative counts as 0, past topk as topk).
        attn_sink: optional ``[H]`` float32 sink logits.
        extra_kv_cache, extra_indices, extra_topk_length: an optional second (compressed)
            cache with its own page size and list; main and extra entries form ONE softmax.
            Only where a model combines two caches (``KvFormat.extras``: DeepSeek-V4's
            FP8 and NVFP4 records, either for either; DeepSeek-V4.1's FP8 record with its FP8
            or NVFP4 record of the same scale placement). Two formats: a partial kernel per
            cache, then the merge.
        out, lse: optional outputs, written in place.
        lse_convention: ``"natural"`` (the default, below), ``"log2_with_sink"``
            (log2(sum_j exp(s_j) + exp(sink_h)), FlashInfer's) or ``"natural_with_sink"``
            (ln of the same sum); ``dispatch.runtime.lse``.
        precision: the compute path: None (the default: ``"f16"``, the cache values exact
            in f16 registers), ``"bf16"`` (dequantized to a bf16 tile), ``"fp8"`` (e4m3 MMAs
            on the cache bytes, about 1-2% output error) or ``"mxf8"`` (``"fp8"`` with SM120's
            block-scaled MMA; sm_120a / sm_121a and MODEL1's UE8M0 scales only).
            ``docs/design.md``, "Precision".
        kv_format: the cache format's name, or None (the default) for the one the cache's
            last dimension names: 584 is MODEL1's, 384 its NVFP4 record's, 656 V3.2's; a width
            several formats have (528: GLM-5.3 and V4.1) is refused naming the candidates.
        extra_kv_format: the extra cache's format's name, or None: the main cache's where the
            extra cache's width is one of its views', else the one its width names, else the
            one paired format its width fits (``cache_view.extra_format_of``).

    Returns:
        ``(out, lse)``: ``out`` bf16 ``[T, H, d_v]`` (d_v = 512 for every format), ``lse``
        float32 ``[T, H]`` (leading dims as ``q``). With s_j = sm_scale * <q, k_j> over the
        valid entries j: ``lse = ln(sum_j exp(s_j))`` (natural log, the sink NOT folded in,
        with the default ``lse_convention``) and
        ``out = sum_j softmax(s)_j v_j``, times ``exp(lse) / (exp(lse) + exp(attn_sink[h]))``
        when a sink is given. k_j is the slot's dequantized d_qk-dim latent and v_j its first
        d_v dims (MODEL1: the same 512 dims; V3.2: the 512 nope dims, not the rope).
        A token with no valid entry gets ``out = 0`` and ``lse = +inf``.

    Raises:
        InvalidDecodeInput (a ValueError): before any GPU work, for an input this function
        cannot serve; the message names the call's shape and what was expected.
    """
    # the record from a tuple in its fields' order (a third of a keyword call's cost on this hot
    # path; the order is tested in tests/test_plan_cache.py)
    given = DecodeTensors._make((q, kv_cache, indices, topk_length, attn_sink, out, lse, extra_kv_cache, extra_indices,
                                 extra_topk_length))
    return one_shot_decode(given, sm_scale=sm_scale, lse_convention=lse_convention, precision=precision,
                           kv_format=kv_format, extra_kv_format=extra_kv_format)


def one_shot_decode(given: DecodeTensors, *, sm_scale, lse_convention, precision, kv_format, extra_kv_format,
                    keep_lse=True, caller_tag=None, caller_check=None, names=None):
    """``sparse_mla_decode`` on a ``DecodeTensors`` record, every option required by name
    (what the adapters call).

    ``names``: how the caller spells the arguments, core name -> its own (``validate_tensors``),
    e.g. ``{"q": "query", "kv_cache": "swa_kv_cache", "indices": "sparse_indices",
    "topk_length": "swa_topk_lens", "attn_sink": "sinks", "sm_scale": "bmm1_scale"}``: a
    refusal then says "sparse_indices must be int32", not "indices must be int32". It is read
    only where the call is validated, never on a cached layout's call; build it once
    (``decode_inputs.caller_names``) to have a wrong mapping refused at import.

    ``keep_lse=False`` (an adapter that returns no lse, with ``lse=None``): the kernels write
    the lse into a buffer the plan cache keeps, and the lse returned must not be used.
    ``caller_check``: an adapter's own checks of the tensors' layouts (a callable that
    raises), run only when the layout is validated, with ``caller_tag`` (what those checks
    depend on beyond the layouts, hashable) part of the layout key.

    A call whose layout was validated before (``dispatch.runtime.plan_cache``) pays the layout key,
    one lookup, the address checks and the launches; any other is validated in full."""
    try:
        key = layout_key(given, (kv_format, extra_kv_format, precision, caller_tag))
        entry = ONE_SHOT_PLANS.get(key)
    except (AttributeError, TypeError, RuntimeError):  # not tensors, strideless, unhashable: validation says
        key = entry = None
    if entry is not None and lse_convention in LSE_CONVENTIONS:
        # the layout was validated before: only the addresses and the scale are new
        out, lse, laid_out = given[OUT], given[LSE], given
        if out is None or lse is None:
            out = entry.new_out() if out is None else out
            lse = lse if lse is not None else entry.new_lse() if keep_lse else ONE_SHOT_PLANS.discarded_lse(entry)
            laid_out = given[:OUT] + (out, lse) + given[LSE + 1:]  # a plain tuple in the fields' order
        plan = entry.plan
        if plan.launch_laid_out(laid_out, sm_scale, ONE_SHOT_PLANS.scratch(plan) if plan.scratch_bytes else None):
            if lse_convention != "natural":
                lse.copy_(convert_lse(lse, given[ATTN_SINK], lse_convention))
            return out, lse
    if caller_check is not None:
        caller_check()
    return _validated_one_shot(key, entry, given, sm_scale=sm_scale, lse_convention=lse_convention,
                               precision=precision, kv_format=kv_format, extra_kv_format=extra_kv_format, names=names)


def _validated_one_shot(key, entry, given: DecodeTensors, *, sm_scale, lse_convention, precision, kv_format,
                        extra_kv_format, names):
    """A one-shot call validated in full: its layout is not in the plan cache (``entry`` None),
    or the cached plan declined its addresses or scale (which this refuses). Plans and caches
    the plan under ``key`` (None: not cacheable), then launches."""
    try:
        check_convention(lse_convention)
    except ValueError as err:
        raise InvalidDecodeInput(_describe_call(given, kv_format, extra_kv_format), str(err)) from None
    call = validate_tensors(given, sm_scale=sm_scale, precision=precision, kv_format=kv_format,
                            extra_kv_format=extra_kv_format, names=names)
    out, lse = call.tensors.out, call.tensors.lse
    if call.num_tokens == 0:
        return out, lse
    if entry is None:
        entry = CachedPlan(DecodePlan(call), out, lse)
        if key is not None:
            entry = ONE_SHOT_PLANS.put(key, entry)
    scratch = ONE_SHOT_PLANS.scratch(entry.plan)
    if not entry.plan.launch_laid_out(call.tensors, call.sm_scale, scratch):
        raise RuntimeError("internal error: a validated call failed the plan's address checks; please report it")
    if lse_convention != "natural":
        lse.copy_(convert_lse(lse, given.attn_sink, lse_convention))
    return out, lse
