"""The one-shot call's plan cache: ``sparse_mla_decode`` (and every adapter over it) validates
a call's layout once and reuses the plan for every later call laid out the same way.

A call's *layout key* is what ``validate_call`` reads of its inputs: for each tensor its
shape, strides, dtype and device (None for an absent input), plus the cache format
and precision asked for. Every check ``validate_call`` makes is a function of that key and
of the tensors' addresses (their alignment, and whether an output overlaps another tensor), so
a call whose key matches a validated one needs only the address checks
``DecodePlan.launch_laid_out`` makes while writing the addresses: a repeated call pays the
key, one dictionary lookup and the launches. The key is compared exactly (tuples of ints and
dtypes), so a plan is never used for another layout.

The cache is bounded (the oldest layout out first) and thread-safe; ``clear()`` drops
every plan and every buffer it keeps.

Split plans need scratch for the partial results, and a call that returns no lse (an adapter
without ``return_lse``) still has the kernels write one. Outside a CUDA graph capture the
one-shot path keeps one buffer of each kind per (device, stream), grown to the largest need
seen: the scratch, and the lse of the calls that want none (a view of it, whatever the
layout; the buffer keeps each layout's view, and they go with it). Work on one stream runs in
order, so consecutive calls can share them, and a buffer freed (grown, or by ``clear()``)
is freed on the only stream that used it, so the caching allocator orders its reuse. The
buffers kept never exceed a byte cap together: a call that would need more is served by
buffers of its own, freed after its launch (in stream order), and the cache keeps what it
had. During a capture each call allocates its own (from the graph's pool), so that graphs
never share them.

The caps: ``DSV4_MLA_PLAN_CACHE_ENTRIES`` layouts (default ``DEFAULT_ENTRIES``) and
``DSV4_MLA_PLAN_CACHE_BYTES`` bytes of buffers (default ``DEFAULT_BYTES``), read when the
one-shot cache is created (at ``import dispatch``). ``plan_cache_info()`` (``dispatch``) says
what the cache holds.
"""

from __future__ import annotations

import math
import os
import threading

import torch

from .plan import DecodePlan, raw_stream

DEFAULT_ENTRIES = 256  # layouts kept; an engine's steady state uses a few dozen
# buffer bytes kept: the scratch of a decode step's split plan (T x splits x H x 2 KB: 33 MB
# at 8 tokens x 16 splits x 128 heads) and a discarded lse; larger needs are per call
DEFAULT_BYTES = 128 << 20
ENTRIES_ENV, BYTES_ENV = "DSV4_MLA_PLAN_CACHE_ENTRIES", "DSV4_MLA_PLAN_CACHE_BYTES"


def _env_cap(name: str, default: int, least: int) -> int:
    """A cap from the environment variable ``name`` (an int, at least ``least``), else ``default``."""
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least:
        raise ValueError(f"{name}={text!r}: expected an int of at least {least}")
    return value


def layout_key(tensors: tuple, names: tuple) -> tuple:
    """The layout key of a call's tensors (``DecodePlan``'s run order; None for an absent
    one) and ``names`` (the format and precision asked for, ...). Raises AttributeError for an
    argument that is not a tensor (the caller then validates the call in full, which refuses
    it); a name that cannot be hashed raises TypeError where the key is looked up. Per tensor
    it is ``decode_inputs.layout_signature``, written out here: this runs on every call."""
    return names + tuple([None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors])


# whether the current stream is capturing a CUDA graph: torch's check, without its Python wrapper
_capturing = torch._C._cuda_isCurrentStreamCapturing


class CachedPlan:
    """A plan with what the one-shot call needs beyond it: how to allocate the outputs that
    were not given (their planned shapes, on the planned device)."""

    __slots__ = ("plan", "out_shape", "lse_shape", "lse_numel")

    def __init__(self, plan: DecodePlan, out: torch.Tensor, lse: torch.Tensor):
        self.plan = plan
        self.out_shape, self.lse_shape = tuple(out.shape), tuple(lse.shape)
        self.lse_numel = math.prod(self.lse_shape)

    def new_out(self) -> torch.Tensor:
        return torch.empty(self.out_shape, dtype=torch.bfloat16, device=self.plan.device)

    def new_lse(self) -> torch.Tensor:
        return torch.empty(self.lse_shape, dtype=torch.float32, device=self.plan.device)


class PlanCache:
    """Bounded, thread-safe map from layout keys to ``CachedPlan``s (the oldest out first when
    full), and the buffers the one-shot call shares (the module doc). A lookup is one
    dictionary read (atomic in CPython, free-threaded builds included); inserting, evicting
    and growing a buffer hold a lock."""

    def __init__(self, capacity: int | None = None, byte_cap: int | None = None):
        self.capacity = _env_cap(ENTRIES_ENV, DEFAULT_ENTRIES, 1) if capacity is None else capacity
        self.byte_cap = _env_cap(BYTES_ENV, DEFAULT_BYTES, 0) if byte_cap is None else byte_cap
        self._plans: dict = {}  # insertion ordered: the first key is the oldest
        # (kind, device index, raw stream) -> (tensor, its bytes, its views by shape)
        self._buffers: dict = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, key) -> CachedPlan | None:
        return self._plans.get(key)

    def put(self, key, entry: CachedPlan) -> CachedPlan:
        """Insert ``entry`` (or keep the one another thread inserted first) and return it."""
        with self._lock:
            kept = self._plans.setdefault(key, entry)
            while len(self._plans) > self.capacity:
                del self._plans[next(iter(self._plans))]
            return kept

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self._buffers.clear()

    def info(self) -> dict:
        """What the cache holds: its layouts and their cap, and its buffers' bytes by kind
        (``scratch``, ``lse``) and in all, against the byte cap."""
        with self._lock:
            buffers = [(kind, n) for (kind, _, _), (_, n, _) in self._buffers.items()]
            return {"entries": len(self._plans), "capacity": self.capacity,
                    "buffer_bytes": sum(n for _, n in buffers), "byte_cap": self.byte_cap,
                    "scratch_bytes": sum(n for kind, n in buffers if kind == "scratch"),
                    "lse_bytes": sum(n for kind, n in buffers if kind == "lse"), "buffers": len(buffers)}

    def _buffer(self, kind: str, device_index: int, nbytes: int, allocate) -> tuple:
        """(the (device, stream)'s buffer of ``kind`` with at least ``nbytes``, its views by
        shape) (``allocate()`` makes one): the kept one, grown where the byte cap allows (its
        views go with the buffer replaced); else one of the call's own, with views None."""
        if _capturing():
            return allocate(), None
        slot = (kind, device_index, raw_stream(device_index))
        kept = self._buffers.get(slot)
        if kept is not None and kept[1] >= nbytes:
            return kept[0], kept[2]
        with self._lock:
            kept = self._buffers.get(slot)
            if kept is not None and kept[1] >= nbytes:
                return kept[0], kept[2]
            others = sum(n for s, (_, n, _) in self._buffers.items() if s != slot)
            if others + nbytes > self.byte_cap:
                return allocate(), None  # the call's own, freed after its launch; the cache keeps what it had
            buffer = allocate()
            self._buffers[slot] = kept = (buffer, buffer.numel() * buffer.element_size(), {})
            return kept[0], kept[2]

    def scratch(self, plan: DecodePlan) -> torch.Tensor | None:
        """Scratch for one launch of ``plan`` on the current stream (None when it needs none);
        see the module doc. Hold it until the launch is enqueued."""
        if not plan.scratch_bytes:
            return None
        return self._buffer("scratch", plan.device_index, plan.scratch_bytes, plan.new_scratch)[0]

    def discarded_lse(self, entry: CachedPlan) -> torch.Tensor:
        """Where the kernels write the lse of a call that returns none (an adapter without
        ``return_lse``): a view of the current stream's lse buffer with the planned layout."""
        plan = entry.plan
        buffer, views = self._buffer("lse", plan.device_index, 4 * entry.lse_numel,
                                     lambda: torch.empty(entry.lse_numel, dtype=torch.float32, device=plan.device))
        if views is None:  # the call's own buffer (over the byte cap, or in a capture): freed after its launch
            return buffer[:entry.lse_numel].view(entry.lse_shape)
        view = views.get(entry.lse_shape)  # a repeated call: no new view (a few microseconds of host time)
        if view is None:
            view = views[entry.lse_shape] = buffer[:entry.lse_numel].view(entry.lse_shape)
        return view
