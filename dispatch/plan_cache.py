"""The one-shot call's plan cache: ``sparse_mla_decode`` (and every adapter over it) validates
a call's layout once and reuses the plan for every later call laid out the same way.

A call's *layout key* is what ``validate_call`` reads of its inputs: for each tensor its
shape, strides, dtype and device (None for an absent input), plus the cache format
and precision asked for. Every check ``validate_call`` makes is a function of that key and
of the tensors' addresses (their alignment), so a call whose key matches a validated one
needs only the alignment check ``DecodePlan.launch_laid_out`` makes while writing the
addresses: a repeated call pays the key, one dictionary lookup and the launches. The key is
compared exactly (tuples of ints and dtypes), so a plan is never used for another layout.

The cache is bounded (the oldest layout out first) and thread-safe; ``clear()`` drops
every plan and the scratch buffers.

Split plans need scratch for the partial results, and a call that returns no lse (an adapter
without ``return_lse``) still has the kernels write one. Outside a CUDA graph capture the
one-shot path keeps both per stream: the scratch in one buffer per (device, stream), grown to
the largest plan seen, the lse in a buffer per (plan, stream). Work on one stream runs in
order, so consecutive calls can share them, and a buffer freed (grown, dropped with its plan,
or by ``clear()``) is freed on the only stream that used it, so the caching allocator orders
its reuse. During a capture each call allocates its own (from the graph's pool), so that
graphs never share them.
"""

from __future__ import annotations

import threading

import torch

from .plan import DecodePlan, _raw_stream

CAPACITY = 256  # layouts kept; an engine's steady state uses a few dozen


def layout_key(tensors: tuple, *names) -> tuple:
    """The layout key of a call's tensors (``DecodePlan``'s run order; None for an absent
    one) and ``names`` (the format and precision asked for, ...). Raises AttributeError for an
    argument that is not a tensor (the caller then validates the call in full, which refuses
    it); a name that cannot be hashed raises TypeError where the key is looked up. Per tensor
    it is ``plan.layout_signature``, written out here: this runs on every call."""
    return names + tuple([None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors])


# whether the current stream is capturing a CUDA graph: torch's check, without its Python wrapper
_capturing = torch._C._cuda_isCurrentStreamCapturing


class CachedPlan:
    """A plan with what the one-shot call needs beyond it: how to allocate the outputs that
    were not given (their planned shapes, on the planned device), and per stream the buffer
    the kernels write an unwanted lse into (``discarded_lse``)."""

    __slots__ = ("plan", "out_shape", "lse_shape", "_lse_sinks")

    def __init__(self, plan: DecodePlan, out: torch.Tensor, lse: torch.Tensor):
        self.plan = plan
        self.out_shape, self.lse_shape = tuple(out.shape), tuple(lse.shape)
        self._lse_sinks: dict = {}  # raw stream -> lse tensor written (and freed) only on that stream

    def new_out(self) -> torch.Tensor:
        return torch.empty(self.out_shape, dtype=torch.bfloat16, device=self.plan.device)

    def new_lse(self) -> torch.Tensor:
        return torch.empty(self.lse_shape, dtype=torch.float32, device=self.plan.device)

    def discarded_lse(self) -> torch.Tensor:
        """Where the kernels write the lse of a call that returns none (an adapter without
        ``return_lse``): a buffer of the current stream's, not a new tensor per call. It is
        used only on that stream, so it is freed (with the plan) in that stream's order;
        during a capture the graph gets its own."""
        if _capturing():
            return self.new_lse()
        stream = _raw_stream(self.plan.device_index)
        sink = self._lse_sinks.get(stream)
        if sink is None:
            sink = self._lse_sinks.setdefault(stream, self.new_lse())
        return sink


class PlanCache:
    """Bounded, thread-safe map from layout keys to ``CachedPlan``s (the oldest out first when
    full), and the scratch buffers. A lookup is one dictionary read (atomic in CPython, free-
    threaded builds included); inserting and evicting hold a lock."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._plans: dict = {}  # insertion ordered: the first key is the oldest
        self._scratch: dict = {}  # (device index, raw stream) -> uint8 tensor
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
            self._scratch.clear()

    def scratch(self, plan: DecodePlan) -> torch.Tensor | None:
        """Scratch for one launch of ``plan`` on the current stream (None when it needs none);
        see the module doc. Hold it until the launch is enqueued."""
        need = plan.scratch_bytes
        if not need:
            return None
        if _capturing():
            return plan.new_scratch()
        slot = (plan.device_index, _raw_stream(plan.device_index))
        buffer = self._scratch.get(slot)
        if buffer is None or buffer.numel() < need:
            with self._lock:
                buffer = self._scratch.get(slot)
                if buffer is None or buffer.numel() < need:
                    buffer = self._scratch[slot] = plan.new_scratch()
        return buffer
