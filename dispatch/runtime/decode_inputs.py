"""A decode call's tensors as one record, and the rules every path checks them by.

``DecodeTensors`` is the one list of a call's tensor arguments: the public functions take
them by keyword (``sparse_mla_decode``, ``DecodePlan.run``, the adapters) and pass this
record on (validation, the one-shot call, the plan cache, the plan's launch). Its field order
is the order of every per-call value list the plan writes into the kernels' arguments.

The rules here are shared by ``dispatch.api.validate_call`` (which refuses a call naming
its shape) and the plan's per-call checks (``DecodePlan.run`` / ``bind`` and the plan
cache's hit), so that each says the same thing of the same input. Each refusal names an
argument as the caller spells it (``CallerNames``: an adapter's ``query`` for ``q``).
"""

from __future__ import annotations

import reprlib
from typing import Mapping, NamedTuple

import torch

from cute_kernels.sparse_mla_decode.kernel_args import LOG2_E, MERGE_ARGS, PARTIAL_ARGS
from cute_kernels.sparse_mla_decode.kv_format import FLT_MIN


class DecodeTensors(NamedTuple):
    """A decode call's tensors (None: an optional input not given; ``out`` / ``lse`` None:
    to be allocated). A tuple subclass: its fields are read by index on the hot paths, where
    it is built from a tuple in field order (``DecodeTensors._make``), a third of the cost of
    a keyword call."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    indices: torch.Tensor
    topk_length: torch.Tensor | None = None
    attn_sink: torch.Tensor | None = None
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    extra_kv_cache: torch.Tensor | None = None
    extra_indices: torch.Tensor | None = None
    extra_topk_length: torch.Tensor | None = None


# per field, the key the kernels' argument bindings name its address by (``plan.Bind``)
BIND_KEYS = dict(q="q", kv_cache="main", indices="indices", topk_length="topk_length", attn_sink="attn_sink",
                 out="out", lse="lse", extra_kv_cache="extra", extra_indices="extra_indices",
                 extra_topk_length="extra_topk_length")
assert tuple(BIND_KEYS) == DecodeTensors._fields
OUT, LSE, ATTN_SINK = (DecodeTensors._fields.index(name) for name in ("out", "lse", "attn_sink"))
assert LSE == OUT + 1  # the outputs are one slice of the record: the one-shot call replaces them together


INT32_MIN, INT32_MAX = -2**31, 2**31 - 1  # a C int32: the kernels' "i32" arguments, the slots an index names

# per field, the kernels' pointer argument its address is passed as (``kernel_args``; a call of
# two formats passes the extra list as its second launch's main list, of the same alignments)
KERNEL_POINTER = dict(q="q", kv_cache="main_cache", indices="main_idx", topk_length="main_len", attn_sink="attn_sink",
                      out="out", lse="lse", extra_kv_cache="extra_cache", extra_indices="extra_idx",
                      extra_topk_length="extra_len")
# per field, the byte alignment the kernels assume of its address (what every path checks)
POINTER_ALIGN = {field: max(a.align for a in PARTIAL_ARGS + MERGE_ARGS if a.name == arg)
                 for field, arg in KERNEL_POINTER.items()}
assert tuple(POINTER_ALIGN) == DecodeTensors._fields

# the arguments a refusal names: the tensors and the scale (``CallerNames`` maps them)
ARGUMENT_NAMES = DecodeTensors._fields + ("sm_scale",)


class CallerNames(dict):
    """How a caller spells the decode's arguments: core name (``ARGUMENT_NAMES``) -> its own
    name; an argument it does not map keeps the core name (``names["q"]`` is "q" in an
    empty one). Every refusal of ``dispatch.api.validate_tensors`` names its arguments
    through one, so that an adapter's user reads ``sparse_indices``, not ``indices``."""

    __slots__ = ()

    def __missing__(self, key: str) -> str:
        return key


def caller_names(names: Mapping[str, str] | None) -> CallerNames:
    """``names`` (None: the core names) as a ``CallerNames``; TypeError for a key that is no
    argument of the decode or a name that is not a string (the adapter's mistake, not its
    caller's)."""
    if isinstance(names, CallerNames):
        return names
    if names is None:
        return CORE_NAMES
    names = dict(names)
    unknown = sorted(set(names) - set(ARGUMENT_NAMES))
    if unknown or not all(isinstance(v, str) for v in names.values()):
        raise TypeError(f"names must map arguments of the decode {ARGUMENT_NAMES} to strings, got {names!r}")
    return CallerNames(names)


CORE_NAMES = CallerNames()


def layout_signature(t):
    """What a plan fixes about a tensor: shape, strides, dtype and device (None for an absent
    input). ``plan_cache.layout_key`` is the same per tensor, inlined on its hot path."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def byte_span(t: torch.Tensor) -> int:
    """The bytes from ``t``'s first element to one past its last (0 for an empty tensor):
    what two tensors must not share for one to be written while the other is read."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def overlapping_output(addresses, spans, present) -> tuple[str, str] | None:
    """(output, other) names of the first output (out, lse) whose bytes overlap another
    tensor's (any input, or the other output), None when none does: the kernels write the
    outputs while they read the inputs. ``addresses`` / ``spans``: per ``DecodeTensors``
    field (``byte_span``); ``present``: the indices of the tensors given."""
    for o in (OUT, LSE):
        low = addresses[o]
        high = low + spans[o]
        for i in present:
            if i != o and addresses[i] < high and low < addresses[i] + spans[i]:
                return DecodeTensors._fields[o], DecodeTensors._fields[i]
    return None


def overlap_problem(overlap: tuple[str, str], names: CallerNames = CORE_NAMES) -> str:
    """The refusal of an ``overlapping_output`` finding, as every path words it."""
    written, other = names[overlap[0]], names[overlap[1]]
    return (f"{written} overlaps {other} in memory; the kernels write {written} while they read the inputs: give "
            f"it memory of its own")


def self_overlap_problem(t: torch.Tensor, name: str) -> str | None:
    """Why the elements of an output ``t`` do not each have memory of their own (None when
    they do): a stride of 0 over a dimension of more than one element, or dimensions that do
    not nest. Sorted by stride, each dimension's stride must be at least the span of the
    dimensions inside it (the elements they cover); then no two elements share an address.
    A layout that interleaves disjoint elements (strides [2, 3] over [3, 2]) fails it too:
    no kernel writes such an output. An empty output has no element to share."""
    if t.numel() == 0:
        return None
    span = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride == 0:
            return (f"{name} has a stride of 0 (strides {list(t.stride())}): many rows would be written to one "
                    f"address; give every row memory of its own")
        if stride < span:
            return (f"{name} of shape {list(t.shape)} and strides {list(t.stride())} overlaps itself: its stride "
                    f"{stride} is smaller than the {span} elements the dimensions inside it span, so two of its "
                    f"elements would be written to one address; give every element memory of its own")
        span += stride * (size - 1)
    return None


def misaligned_problem(t: torch.Tensor, name: str, align: int) -> str | None:
    """Why ``t``'s address is not one the kernels may load as they do (``align`` bytes:
    ``POINTER_ALIGN``), None when it is."""
    address = t.data_ptr()
    if address % align == 0:
        return None
    return f"{name} data pointer must be {align}-byte aligned (the kernels' loads assume it), got {address:#x}"


def dense_problem(t: torch.Tensor, name: str) -> str | None:
    """Why ``t`` is not a dense (strided) tensor the kernels can read by its address and
    strides, None when it is: a sparse one (COO, CSR, ...) or a nested one has no such memory."""
    if t.layout is torch.strided and not t.is_nested:
        return None
    kind = "a sparse" if "sparse" in str(t.layout) else "a nested" if t.is_nested else "not a dense"
    return (f"{name} is {kind} tensor (layout {t.layout}): the kernels read dense (strided) memory; pass a dense "
            f"tensor ({name}.to_dense())")


def scalar_problem(value, name: str, kind: str, *, none_ok: bool = False) -> str | None:
    """Why ``value`` is not a ``kind`` argument of exactly the documented type, None when it
    is: "int" (a Python int, not a bool), "number" (an int or a float, not a bool) or "flag"
    (a bool); ``none_ok``: None too (a parameter whose default is None). Never coerced: a
    bool is no number, a float no int, a string or a tensor neither (a tensor would be read
    back to the host: a synchronization)."""
    if kind == "flag":
        ok = isinstance(value, bool)
        what = "True or False"
    else:
        ok = isinstance(value, (int, float) if kind == "number" else int) and not isinstance(value, bool)
        what = "a Python int" if kind == "int" else "a real Python number (int or float)"
    if ok or (none_ok and value is None):
        return None
    what += " or None" if none_ok else ""
    shown = f"a {type(value).__name__}" if isinstance(value, torch.Tensor) else f"{value!r} ({type(value).__name__})"
    return f"{name} must be {what}, got {shown}"


FLT_MAX = 3.4028234663852886e38  # the largest finite float32


# what an sm_scale must be, as every refusal of one says it (``scale_log2``), the argument's name first
_SCALE_RULE = ("{} must be a real Python number whose product with log2(e) is 0 or a normal float32 (the kernels' "
               "argument: finite, at least 1.2e-38 in magnitude)")
SCALE_RULE = _SCALE_RULE.format("sm_scale")


def scale_problem(sm_scale, name: str = "sm_scale") -> str:
    """The refusal of an ``sm_scale`` that ``scale_log2`` does not take (``name``: as the
    caller spells it), the value shown short (an int of 400 digits is refused too)."""
    return f"{_SCALE_RULE.format(name)}, got {reprlib.repr(sm_scale)}"


def scale_log2(sm_scale, default: float) -> float | None:
    """``sm_scale`` (None: ``default``) times log2(e), the kernels' float32 argument; None
    unless it is a real Python number (not a bool) whose product is 0 or a normal float32
    (an ``sm_scale`` finite as a Python float can still become inf, 0 or a subnormal as the
    kernels' float32: 1e300, 1e-50; an int can be past float64's range), what
    ``validate_call`` accepts."""
    if sm_scale is None:
        sm_scale = default
    elif type(sm_scale) is not float:
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
            return None
        try:
            sm_scale = float(sm_scale)
        except OverflowError:  # an int past float64's range
            return None
    value = sm_scale * LOG2_E
    if value != 0.0 and not FLT_MIN <= abs(value) <= FLT_MAX:  # NaN fails both comparisons
        return None
    return value
