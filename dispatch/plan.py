"""Planned execution: build a ``DecodePlan`` once per shape bucket, then ``run`` it many times.

A plan fixes everything a serving step repeats: the validated layout of every input
(shapes, strides, dtypes, device, which optional inputs are present), the kernel variants,
the split of the work and the scratch it needs. ``run`` then only checks that the tensors
it is given have exactly that layout (cheap tuple comparisons, so no read can go out of
bounds), writes their addresses into the kernels' packed arguments and launches. It
allocates nothing, never synchronizes with the host, and is safe to capture in a CUDA
graph; replaying the graph with new values in the same tensors (fewer valid tokens than
captured: give the padding tokens ``topk_length`` 0) recomputes the result.

``plan.bind(...)`` goes one step further for persistent input buffers: it checks the
tensors once and returns a ``BoundDecode`` whose ``run()`` only launches (measured host
overhead in README "In a serving engine").
"""

from __future__ import annotations

import functools

import math
import threading

import torch

from cute_kernels.sparse_mla_decode.cache_format import page_division_magic
from cute_kernels.sparse_mla_decode.layout import D_QK, D_V

from . import loader
from .launcher import BoundKernel, argument_kinds
from .splits import plan_splits, two_ctas_per_sm
from .variants import partial_shape_config, variant_space, variants_for

_LOG2_E = math.log2(math.e)
_DEFAULT_SM_SCALE = 1.0 / math.sqrt(D_QK)
SCRATCH_ALIGN = 256
# the current stream's raw handle: torch's fast accessor where the build has it (CUDA builds do)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)


def layout_signature(t):
    """What a plan fixes about a tensor: shape, strides and dtype (None for an absent input)."""
    return None if t is None else (t.shape, t.stride(), t.dtype)


class Bind:
    """A kernel argument that changes per call: the address (or value) ``key`` plus ``offset``."""

    __slots__ = ("key", "offset")

    def __init__(self, key: str, offset: int = 0):
        self.key, self.offset = key, offset


# run()'s tensor arguments, in its signature order: (argument name, address key in the bindings)
_RUN_TENSORS = (("q", "q"), ("kv_cache", "main"), ("indices", "indices"), ("topk_length", "topk_length"),
                ("attn_sink", "attn_sink"), ("out", "out"), ("lse", "lse"), ("extra_kv_cache", "extra"),
                ("extra_indices", "extra_indices"), ("extra_topk_length", "extra_topk_length"))
# every per-call value a Bind can name, by its position in the list run() fills
_VALUE_KEYS = tuple(key for _, key in _RUN_TENSORS) + ("sm_scale_log2", "scratch", "stream")
_POSITION = {key: i for i, key in enumerate(_VALUE_KEYS)}


@functools.lru_cache(maxsize=None)
def _variant_space_set(arch: str) -> frozenset:
    return frozenset(variant_space(arch))


def check_in_variant_space(variants, arch: str, what: str) -> None:
    """Every variant a plan launches is one the variant space (and so the AOT build) has:
    the dispatch's policies (head groups, splits) must never select another."""
    missing = [v.name for v in variants if v not in _variant_space_set(arch)]
    if missing:
        raise RuntimeError(f"internal error: {what} selected {missing}, outside the variant space; please report it")


class DecodePlan:
    """A launch plan for one layout of a ``sparse_mla_decode`` call (see the module doc)."""

    def __init__(self, call):
        """``call`` is a validated call (``dispatch.api.validate_call``)."""
        self.device_index = call.device_index
        self.num_tokens, self.num_heads = call.num_tokens, call.num_heads
        self.topk, self.extra_topk = call.topk, call.extra_topk
        self.precision = call.precision
        shape = partial_shape_config(call.num_heads, call.num_tokens, call.num_sms, call.precision,
                                     topk=call.topk, extra_topk=call.extra_topk, smem_per_sm=call.smem_per_sm)
        self.split = plan_splits(call.num_tokens, call.num_heads, call.topk, call.extra_topk, cfg=shape,
                                 num_sms=call.num_sms, smem_per_sm=call.smem_per_sm)
        two_per_sm = two_ctas_per_sm(shape, self.split, call.num_tokens, call.num_heads, call.num_sms,
                                     call.smem_per_sm)
        self.variants = variants_for(call.launch_metadata, call.arch, self.split.num_splits, shape.head_groups,
                                     precision=call.precision, two_ctas_per_sm=two_per_sm)
        check_in_variant_space(self.variants, call.arch, f"{self.split} for {call.launch_metadata}")
        self.final = len(self.variants) == 1
        T, S, H = call.num_tokens, self.split.num_splits, call.num_heads
        self._o_part_bytes = 0 if self.final else T * S * H * D_V * 4
        lse_part_bytes = 0 if self.final else T * S * H * 4
        self.scratch_bytes = self._o_part_bytes + lse_part_bytes
        if self.scratch_bytes:
            self.scratch_bytes += SCRATCH_ALIGN  # room to align the start
        # the exact layout every run must present: (name, (shape, strides, dtype) or None), in
        # run()'s argument order
        self._inputs = tuple((name, layout_signature(getattr(call, name))) for name, _ in _RUN_TENSORS)
        present = {key for (_, key), (_, sig) in zip(_RUN_TENSORS, self._inputs) if sig is not None}
        self._page, self._extra_page = call.main.page_block_size, call.extra.page_block_size
        self._stride_vals = call.strides
        self._args = (self._partial_args(present), self._merge_args(present))[:len(self.variants)]
        self._compiled = [(loader.get_compiled(v), argument_kinds(loader.build_kernel(v).fake_args()))
                          for v in self.variants]
        example = [call.pointers()[key] for _, key in _RUN_TENSORS] + [call.sm_scale * _LOG2_E, 0, 0]
        self._kernels = self._make_kernels(example)
        self._lock = threading.Lock()  # the packed arguments are shared state: one run at a time

    def _make_kernels(self, values: list) -> list:
        """The plan's kernels with their own packed arguments, filled from ``values`` (a value
        per ``_VALUE_KEYS`` entry). Each ``Bind`` becomes (word index, position of its value
        in such a list, offset), for ``_bind_and_launch`` to rewrite per call."""
        kernels = []
        for (compiled, kinds), args in zip(self._compiled, self._args):
            filled = [values[_POSITION[a.key]] + a.offset if isinstance(a, Bind) else a for a in args]
            bound = BoundKernel(compiled, kinds, filled, self.device_index)
            binds = tuple((i, _POSITION[a.key], a.offset) for i, a in enumerate(args)
                          if isinstance(a, Bind) and kinds[i][0] != "f32")
            float_binds = tuple((2 * i, _POSITION[a.key]) for i, a in enumerate(args)
                                if isinstance(a, Bind) and kinds[i][0] == "f32")
            kernels.append((bound, bound.words, binds, bound.floats, float_binds))
        return kernels

    # ------------------------------------------------------------------ argument lists
    def _partial_args(self, present: set) -> list:
        """The partial kernel's arguments in order: plan constants, or ``Bind`` for per-call values.

        An absent optional input, and the partial outputs in final mode, are the constant 0:
        the compiled variant never dereferences them (and a bug that did would fault loudly).
        """
        st = self._stride_vals
        alt = {k: Bind(k) if k in present else 0
               for k in ("topk_length", "extra_indices", "extra_topk_length", "attn_sink", "extra")}
        o_part = Bind("scratch") if not self.final else 0
        lse_part = Bind("scratch", self._o_part_bytes) if not self.final else 0
        return [
            Bind("q"), st["q_t"], st["q_h"], self.num_tokens, self.num_heads,
            Bind("main"), self._page, page_division_magic(self._page), st["main_block"], st["main_slots"],
            Bind("indices"), st["idx_t"], self.topk, alt["topk_length"],
            alt["extra"], self._extra_page, page_division_magic(self._extra_page), st["extra_block"],
            st["extra_slots"], alt["extra_indices"],
            st["extra_idx_t"], self.extra_topk, alt["extra_topk_length"],
            Bind("sm_scale_log2"), self.split.chunks_per_split, self.split.num_splits, o_part, lse_part,
            Bind("out"), st["out_t"], st["out_h"], Bind("lse"), st["lse_t"], st["lse_h"], alt["attn_sink"],
            Bind("stream"),
        ]

    def _merge_args(self, present: set) -> list:
        st = self._stride_vals
        return [
            Bind("scratch"), Bind("scratch", self._o_part_bytes), self.num_tokens, self.split.num_splits,
            self.num_heads, Bind("attn_sink") if "attn_sink" in present else 0, Bind("out"), st["out_t"],
            st["out_h"], Bind("lse"), st["lse_t"], st["lse_h"], Bind("stream"),
        ]

    # ------------------------------------------------------------------ run
    def new_scratch(self) -> torch.Tensor | None:
        """A scratch buffer for ``run`` (None when the plan needs none)."""
        if not self.scratch_bytes:
            return None
        return torch.empty(self.scratch_bytes, dtype=torch.uint8, device=torch.device("cuda", self.device_index))

    def _layout_error(self, caller, name, t, expected):
        if expected is None:
            return ValueError(f"DecodePlan.{caller}: {name} was not part of the planned call; plan again with it")
        if t is None:
            return ValueError(f"DecodePlan.{caller}: {name} is required by this plan")
        if not isinstance(t, torch.Tensor):
            return ValueError(f"DecodePlan.{caller}: {name} must be a torch.Tensor, got {type(t).__name__}")
        return ValueError(
            f"DecodePlan.{caller}: {name} has shape {list(t.shape)}, strides {list(t.stride())}, {t.dtype} on "
            f"{t.device}; the plan was built for shape {list(expected[0])}, strides {list(expected[1])}, "
            f"{expected[2]} on cuda:{self.device_index}"
        )

    def _checked_values(self, caller, given, sm_scale, scratch) -> list:
        """The input addresses (0 for an absent input), then sm_scale * log2(e) and the aligned
        scratch address: a value per ``_VALUE_KEYS`` entry but the stream. Raises ValueError
        for a tensor not laid out exactly as planned (shape, strides, dtype, device), so no
        address written into the kernels' arguments can lead a kernel outside its tensor."""
        dev = self.device_index
        values = []
        for (name, sig), t in zip(self._inputs, given):
            if sig is None:
                if t is not None:
                    raise self._layout_error(caller, name, t, sig)
                values.append(0)
                continue
            try:
                ok = t.dtype is sig[2] and t.get_device() == dev and t.stride() == sig[1] and t.shape == sig[0]
            except AttributeError:  # None, or not a tensor
                ok = False
            if not ok:
                raise self._layout_error(caller, name, t, sig)
            values.append(t.data_ptr())
        if sm_scale is None:
            sm_scale = _DEFAULT_SM_SCALE
        elif not math.isfinite(sm_scale):
            raise ValueError(f"DecodePlan.{caller}: sm_scale must be finite, got {sm_scale!r}")
        values.append(float(sm_scale) * _LOG2_E)
        scratch_ptr = 0
        if self.scratch_bytes:
            try:
                ok = (scratch.get_device() == dev and scratch.is_contiguous()
                      and scratch.numel() * scratch.element_size() >= self.scratch_bytes)
            except AttributeError:
                ok = False
            if not ok:
                raise ValueError(f"DecodePlan.{caller}: scratch must be a contiguous buffer of at least "
                                 f"{self.scratch_bytes} bytes on cuda:{dev} (plan.new_scratch())")
            scratch_ptr = -(-scratch.data_ptr() // SCRATCH_ALIGN) * SCRATCH_ALIGN
        values.append(scratch_ptr)
        return values

    def run(self, q, kv_cache, indices, *, out, lse, scratch=None, sm_scale=None, topk_length=None,
            attn_sink=None, extra_kv_cache=None, extra_indices=None, extra_topk_length=None):
        """Launch on tensors laid out as planned. Allocates nothing; returns ``(out, lse)``."""
        given = (q, kv_cache, indices, topk_length, attn_sink, out, lse, extra_kv_cache, extra_indices,
                 extra_topk_length)
        self._bind_and_launch(self._checked_values("run", given, sm_scale, scratch))
        return out, lse

    def bind(self, q, kv_cache, indices, *, out, lse, scratch=None, sm_scale=None, topk_length=None,
             attn_sink=None, extra_kv_cache=None, extra_indices=None, extra_topk_length=None) -> "BoundDecode":
        """Fix the tensors (and sm_scale) of every later call: the fastest hot path.

        Checks the inputs as ``run`` does, once, and returns a ``BoundDecode`` whose ``run()``
        only launches the kernels on those tensors' current values (the serving pattern of
        persistent input buffers). The bound object keeps the tensors' storage alive, so no
        later change to the tensors (even ``set_`` or ``resize_``) can make a kernel read or
        write memory that is not theirs; write new values into them in place.
        """
        given = (q, kv_cache, indices, topk_length, attn_sink, out, lse, extra_kv_cache, extra_indices,
                 extra_topk_length)
        values = self._checked_values("bind", given, sm_scale, scratch)
        tensors = tuple(t for t in given + (scratch if self.scratch_bytes else None,) if t is not None)
        return BoundDecode(self, self._make_kernels(values + [0]), tensors, out, lse)

    def launch(self, pointers: dict, sm_scale: float, scratch_ptr: int) -> None:
        """Launch on inputs whose layout is already checked (``validate_call`` for the one-shot
        API); ``pointers`` as ``ValidatedCall.pointers()``."""
        self._bind_and_launch([pointers[key] for _, key in _RUN_TENSORS]
                              + [float(sm_scale) * _LOG2_E, -(-scratch_ptr // SCRATCH_ALIGN) * SCRATCH_ALIGN])

    def _bind_and_launch(self, values: list) -> None:
        """``values`` as ``_checked_values`` returns them; the stream is the current one."""
        values.append(_raw_stream(self.device_index))
        with self._lock:
            for bound, words, binds, floats, float_binds in self._kernels:
                for i, position, offset in binds:
                    words[i] = values[position] + offset
                for i, position in float_binds:
                    floats[i] = values[position]
                bound.launch()


class BoundDecode:
    """A ``DecodePlan`` bound to fixed tensors (``DecodePlan.bind``): ``run()`` recomputes the
    result from the tensors' current values. Per call it reads the current stream and
    launches; nothing is checked, allocated or synchronized. Safe to capture in a CUDA graph."""

    def __init__(self, plan: DecodePlan, kernels: list, tensors: tuple, out, lse):
        self.plan = plan
        self.out, self.lse = out, lse
        # the storages, held: the bound addresses stay valid whatever is done to the tensors
        self._storages = tuple(t.untyped_storage() for t in tensors)
        self._launches = tuple(k[0].launch for k in kernels)
        stream_key = _POSITION["stream"]
        self._stream_words = tuple((k[1], i) for k in kernels for i, position, _ in k[2] if position == stream_key)
        self._stream = None
        self._device_index = plan.device_index
        self._lock = threading.Lock()

    def run(self):
        """Launch on the current stream; returns ``(out, lse)``."""
        stream = _raw_stream(self._device_index)
        with self._lock:
            if stream != self._stream:
                for words, i in self._stream_words:
                    words[i] = stream
                self._stream = stream
            for launch in self._launches:
                launch()
        return self.out, self.lse
