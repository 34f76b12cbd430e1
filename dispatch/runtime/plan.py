"""Planned execution: build a ``DecodePlan`` once per shape bucket, then ``run`` it many times.

A plan fixes everything a serving step repeats: the cache format, the validated layout of
every input (shapes, strides, dtypes, device, which optional inputs are present; the caches'
block and row strides become kernel arguments), the kernel variants, the split of the work
and the scratch it needs. ``run`` then only checks that the tensors
it is given have exactly that layout (cheap tuple comparisons, so no read can go out of
bounds), writes their addresses into the kernels' packed arguments and launches. It
allocates nothing, never synchronizes with the host, and is safe to capture in a CUDA
graph; replaying the graph with new values in the same tensors (fewer valid tokens than
captured: give the padding tokens ``topk_length`` 0) recomputes the result.

``plan.bind(...)`` goes one step further for persistent input buffers: it checks the
tensors once and returns a ``BoundDecode`` whose ``run()`` only launches (measured host
overhead: ``docs/performance.md``).
"""

from __future__ import annotations

import functools
import math
import operator
import threading

import torch

from cute_kernels.sparse_mla_decode.cache_view import page_division_magic
from cute_kernels.sparse_mla_decode.kernel_args import MERGE_ARGS, PARTIAL_ARGS, argument_kinds
from cute_kernels.sparse_mla_decode.kv_format import D_V

from ..policy.call_metadata import InvalidDecodeInput
from ..policy.selection import PlanOverrides, select_for_call
from ..policy.variant_space import variant_space
from . import loader
from .decode_inputs import (
    BIND_KEYS, INT32_MAX, INT32_MIN, DecodeTensors, byte_span, dense_problem, layout_signature,
    POINTER_ALIGN, misaligned_problem, overlap_problem, overlapping_output, scale_log2, scale_problem,
)

SCRATCH_ALIGN = 256
# the current stream's raw handle: torch's fast accessor where the build has it (CUDA builds do)
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)


def _aligned(address: int) -> int:
    """The scratch address rounded up to ``SCRATCH_ALIGN`` (``scratch_bytes`` has room for it)."""
    return -(-address // SCRATCH_ALIGN) * SCRATCH_ALIGN


class Bind:
    """A kernel argument that changes per call: the address (or value) ``key`` plus ``offset``."""

    __slots__ = ("key", "offset")

    def __init__(self, key: str, offset: int = 0):
        self.key, self.offset = key, offset


# run()'s and bind()'s tensor arguments, from their locals, in ``DecodeTensors`` order
_given = operator.itemgetter(*DecodeTensors._fields)
# every per-call value a Bind can name, by its position in the list run() fills
_VALUE_KEYS = tuple(BIND_KEYS.values()) + ("sm_scale_log2", "scratch", "stream")
_POSITION = {key: i for i, key in enumerate(_VALUE_KEYS)}


@functools.lru_cache(maxsize=None)
def _variant_space_set(arch: str) -> frozenset:
    return frozenset(variant_space(arch))


# CUDA's limits on a grid's x, y and z (every compute capability this library builds for)
GRID_LIMITS = (2**31 - 1, 65535, 65535)
# per kernel: what each dimension of its grid counts (``launch_grids``), and the calls that launch it
GRID_AXES = {"partial": ("tokens x head blocks", "splits", None), "merge": ("tokens", "heads", None)}
LAUNCHED_BY = {"partial": "a call", "merge": "a call that merges (two cache formats, or more than one split)"}


def launch_grids(selection, num_tokens: int, num_heads: int) -> list:
    """(variant, grid) of each kernel ``selection`` (``select_kernels``) launches, in order:
    the grids ``PartialKernel._launch`` (x: the tokens' head blocks, y: the launch's splits;
    a call of two formats launches the main list's splits, then the extra list's) and
    ``MergeKernel._launch`` (x: the tokens, y: the heads) compute from the plan's arguments
    (``tests/test_mixed_format_calls.py`` holds the kernels' launch code to these expressions)."""
    splits = [selection.split.num_splits] + ([selection.extra.split.num_splits] if selection.extra else [])
    grids = []
    for variant in selection.variants:
        if variant.kind == "merge":
            grids.append((variant, (num_tokens, num_heads, 1)))
        else:
            head_blocks = -(-num_heads // variant.config.heads_per_cta)
            grids.append((variant, (num_tokens * head_blocks, splits[len(grids)], 1)))
    return grids


def launch_problem(selection, q_shape, q_name: str = "q") -> str | None:
    """Why the GPU cannot launch what ``selection`` selects for a call whose q has shape
    ``q_shape`` (``q_name``: as the caller spells it), None when it can: a grid dimension past
    CUDA's limit (``GRID_LIMITS``). Checked where a call is validated (the dispatch's choice)
    and planned (any overrides'), before any kernel is loaded."""
    num_tokens, num_heads = math.prod(q_shape[:-2]), q_shape[-2]
    for variant, grid in launch_grids(selection, num_tokens, num_heads):
        for axis, (size, limit, counts) in enumerate(zip(grid, GRID_LIMITS, GRID_AXES[variant.kind])):
            if size > limit:
                where = "xyz"[axis]
                return (f"{q_name} of shape {list(q_shape)}: the {variant.kind} kernel's grid would be {grid}, its "
                        f"{where} the call's {counts} ({size:,}), past CUDA's limit of {limit:,} on a grid's {where}: "
                        f"{LAUNCHED_BY[variant.kind]} takes at most {limit:,} {counts}")
    return None


def int32_problem(schemas, args) -> str | None:
    """Why a kernel's "i32" argument would not hold its value (None: each does): the launcher
    packs it into a C int32 slot, which would keep only its low 32 bits."""
    for schema, values in zip(schemas, args):
        for a, value in zip(schema, values):
            if a.kind == "i32" and isinstance(value, int) and not INT32_MIN <= value <= INT32_MAX:
                return f"the kernels' int32 argument {a.name} would be {value:,}, outside int32"
    return None


def check_in_variant_space(variants, arch: str, what: str) -> None:
    """Every variant a plan launches is one the variant space (and so the AOT build) has:
    the dispatch's policies (head groups, splits) must never select another."""
    missing = [v.name for v in variants if v not in _variant_space_set(arch)]
    if missing:
        raise RuntimeError(f"internal error: {what} selected {missing}, outside the variant space; please report it")


class DecodePlan:
    """A launch plan for one layout of a ``sparse_mla_decode`` call (see the module doc)."""

    def __init__(self, call, overrides: PlanOverrides | None = None):
        """``call`` is a validated call (``dispatch.api.validate_call``); ``overrides`` forces
        choices the dispatch would make (``PlanOverrides``)."""
        if overrides is None:  # the selection validation checked (``launch_problem`` included)
            selection = call.selection
        else:  # overrides may split: the launch checked again, before any kernel is loaded
            selection = select_for_call(call, overrides)
            problem = launch_problem(selection, call.tensors.q.shape)
            if problem is not None:
                raise InvalidDecodeInput(call.launch_metadata, problem)
        self.device_index = call.device_index
        self.device = call.tensors.q.device
        self.num_tokens, self.num_heads = call.num_tokens, call.num_heads
        self.topk, self.extra_topk = call.topk, call.extra_topk
        self.precision = call.precision
        self.kv_format = call.fmt.name
        self.extra_kv_format = call.extra.fmt.name  # the main cache's format where there is no extra cache
        self.default_sm_scale = call.fmt.default_sm_scale
        self.split, self.variants = selection.split, selection.variants
        self.extra_split = selection.extra.split if selection.extra is not None else None
        self.num_splits = selection.num_splits
        for v in self.variants:
            v.config.check()
        if (overrides or PlanOverrides()) == PlanOverrides():  # the dispatch's own choice: one the AOT build has
            check_in_variant_space(self.variants, call.arch, f"{self.split} for {call.launch_metadata}")
        self.final = len(self.variants) == 1
        T, S, H = call.num_tokens, self.num_splits, call.num_heads
        self._o_part_bytes = 0 if self.final else T * S * H * D_V * 4
        lse_part_bytes = 0 if self.final else T * S * H * 4
        self.scratch_bytes = self._o_part_bytes + lse_part_bytes
        if self.scratch_bytes:
            self.scratch_bytes += SCRATCH_ALIGN  # room to align the start
        # the exact layout every run must present: (name, (shape, strides, dtype) or None), in
        # run()'s argument order
        tensors = call.tensors
        self._inputs = tuple((name, layout_signature(t)) for name, t in zip(DecodeTensors._fields, tensors))
        present = {BIND_KEYS[name] for name, sig in self._inputs if sig is not None}
        values = self._argument_values(call, present)
        if self.extra_split is None:  # the partial kernel (both lists), then the merge where split
            schemas, launches = (PARTIAL_ARGS, MERGE_ARGS)[:len(self.variants)], [values, values]
        else:  # two formats: a partial kernel per list, then the merge
            schemas = (PARTIAL_ARGS, PARTIAL_ARGS, MERGE_ARGS)
            launches = [self._main_list_values(values), self._extra_list_values(values), values]
        self._args = [[vals[a.name] for a in schema] for schema, vals in zip(schemas, launches)]
        problem = int32_problem(schemas, self._args)
        if problem is not None:
            raise InvalidDecodeInput(call.launch_metadata, problem)
        # per run() tensor, the byte alignment the kernels assume of its address, checked on
        # every run and bind (validation's: ``POINTER_ALIGN``)
        self._aligns = tuple(POINTER_ALIGN.values())
        # the planned layout's byte spans (``overlapping_output``: checked on every launch)
        self._spans = tuple(0 if t is None else byte_span(t) for t in tensors)
        self._present = tuple(i for i, span in enumerate(self._spans) if span)
        self._no_overlap = None  # the last addresses found free of overlap (``_overlap``)
        self._compiled = [(loader.get_compiled(v), argument_kinds(schema)) for v, schema in zip(self.variants, schemas)]
        example = [0 if t is None else t.data_ptr() for t in tensors] + [scale_log2(call.sm_scale, self.default_sm_scale), 0, 0]
        self._kernels = self._make_kernels(example)
        self._lock = threading.Lock()  # the packed arguments are shared state: one run at a time

    def _make_kernels(self, values: list) -> list:
        """The plan's kernels with their own packed arguments, filled from ``values`` (a value
        per ``_VALUE_KEYS`` entry). Each ``Bind`` becomes (word index, position of its value
        in such a list, offset), for ``_bind_and_launch`` to rewrite per call."""
        from .launcher import BoundKernel  # the DSL's runtime: loaded with the first plan

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

    # ------------------------------------------------------------------ argument values
    def _argument_values(self, call, present: set) -> dict:
        """Every kernel argument by its schema name (``kernel_args``): a plan constant, or a
        ``Bind`` for a per-call value. An absent optional input, and the partial outputs in
        final mode, are the constant 0: the compiled variant never dereferences them (and a
        bug that did would fault loudly)."""
        st = call.strides

        def optional(key):
            return Bind(key) if key in present else 0

        split = not self.final
        return {
            "q": Bind("q"), "q_stride_t": st["q_t"], "q_stride_h": st["q_h"],
            "num_tokens": self.num_tokens, "num_heads": self.num_heads,
            "main_cache": Bind("main"), "main_page": call.main.index_page,
            "main_page_magic": page_division_magic(call.main.index_page), "main_block_stride": st["main_block"],
            "main_row_stride": st["main_row"], "main_num_slots": st["main_slots"], "main_idx": Bind("indices"),
            "main_idx_stride": st["idx_t"],
            "main_topk": self.topk, "main_len": optional("topk_length"),
            "extra_cache": optional("extra"), "extra_page": call.extra.index_page,
            "extra_page_magic": page_division_magic(call.extra.index_page),
            "extra_block_stride": st["extra_block"], "extra_row_stride": st["extra_row"],
            "extra_num_slots": st["extra_slots"],
            "extra_idx": optional("extra_indices"), "extra_idx_stride": st["extra_idx_t"],
            "extra_topk": self.extra_topk, "extra_len": optional("extra_topk_length"),
            "sm_scale_log2": Bind("sm_scale_log2"), "chunks_per_split": self.split.chunks_per_split,
            "num_splits": self.num_splits, "launch_splits": self.split.num_splits,
            "o_part": Bind("scratch") if split else 0, "lse_part": Bind("scratch", self._o_part_bytes) if split else 0,
            "out": Bind("out"), "out_stride_t": st["out_t"], "out_stride_h": st["out_h"],
            "lse": Bind("lse"), "lse_stride_t": st["lse_t"], "lse_stride_h": st["lse_h"],
            "attn_sink": optional("attn_sink"), "stream": Bind("stream"),
        }

    # a list's arguments, without their "main_" / "extra_" prefix (``kernel_args._list_args``)
    _LIST_ARGS = tuple(a.name.removeprefix("main_") for a in PARTIAL_ARGS if a.name.startswith("main_"))

    @staticmethod
    def _main_list_values(values: dict) -> dict:
        """A two-format call's first launch: the main list alone (no extra list)."""
        return {**values, "extra_topk": 0}

    def _extra_list_values(self, values: dict) -> dict:
        """A two-format call's second launch: the extra list as the kernel's main list, its
        splits after the main list's in the partial outputs (o_part and lse_part [T, splits,
        H, ..] from the main list's splits' end on: split s is the outputs' main splits + s)."""
        moved = {f"main_{name}": values[f"extra_{name}"] for name in self._LIST_ARGS}
        first = self.split.num_splits * self.num_heads  # (split, head) rows before this launch's
        return {**values, **moved, "extra_topk": 0, "chunks_per_split": self.extra_split.chunks_per_split,
                "launch_splits": self.extra_split.num_splits,
                "o_part": Bind("scratch", first * D_V * 4), "lse_part": Bind("scratch", self._o_part_bytes + first * 4)}

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
        problem = dense_problem(t, name)
        if problem is not None:
            return ValueError(f"DecodePlan.{caller}: {problem}")
        return ValueError(
            f"DecodePlan.{caller}: {name} has shape {list(t.shape)}, strides {list(t.stride())}, {t.dtype} on "
            f"{t.device}; the plan was built for shape {list(expected[0])}, strides {list(expected[1])}, "
            f"{expected[2]} on {expected[3]}"
        )

    def _checked_values(self, caller, given, sm_scale, scratch) -> list:
        """The input addresses (0 for an absent input), then sm_scale * log2(e) and the aligned
        scratch address: a value per ``_VALUE_KEYS`` entry but the stream. Raises ValueError
        for a tensor not laid out exactly as planned (shape, strides, dtype, device) or whose
        address lacks the alignment the kernels assume, so no address written into the
        kernels' arguments can lead a kernel outside its tensor or to a misaligned access."""
        values = []
        for (name, sig), align, t in zip(self._inputs, self._aligns, given):
            if sig is None:
                if t is not None:
                    raise self._layout_error(caller, name, t, sig)
                values.append(0)
                continue
            try:
                ok = t.dtype is sig[2] and t.device == sig[3] and t.stride() == sig[1] and t.shape == sig[0]
                address = t.data_ptr()
            except (AttributeError, RuntimeError):  # None, not a tensor, or one without strides or storage
                ok = False
            if not ok:
                raise self._layout_error(caller, name, t, sig)
            if address % align:
                raise ValueError(f"DecodePlan.{caller}: {misaligned_problem(t, name, align)} (the planned one was)")
            values.append(address)
        overlap = self._overlap(values)
        if overlap is not None:
            raise ValueError(f"DecodePlan.{caller}: {overlap_problem(overlap)}")
        scale = scale_log2(sm_scale, self.default_sm_scale)
        if scale is None:
            raise ValueError(f"DecodePlan.{caller}: {scale_problem(sm_scale)}")
        values.append(scale)
        scratch_ptr = 0
        if self.scratch_bytes:
            try:
                ok = (scratch.device == self.device and scratch.is_contiguous()
                      and scratch.numel() * scratch.element_size() >= self.scratch_bytes)
            except AttributeError:
                ok = False
            if not ok:
                raise ValueError(f"DecodePlan.{caller}: scratch must be a contiguous buffer of at least "
                                 f"{self.scratch_bytes} bytes on {self.device} (plan.new_scratch())")
            scratch_ptr = _aligned(scratch.data_ptr())
        values.append(scratch_ptr)
        return values

    def run(self, q, kv_cache, indices, *, out, lse, scratch=None, sm_scale=None, topk_length=None,
            attn_sink=None, extra_kv_cache=None, extra_indices=None, extra_topk_length=None):
        """Launch on tensors laid out as planned. Allocates nothing; returns ``(out, lse)``."""
        given = _given(locals())
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
        given = _given(locals())
        values = self._checked_values("bind", given, sm_scale, scratch)
        tensors = tuple(t for t in given + (scratch if self.scratch_bytes else None,) if t is not None)
        return BoundDecode(self, self._make_kernels(values + [0]), tensors, out, lse)

    def launch_laid_out(self, given: tuple, sm_scale, scratch) -> bool:
        """Launch on tensors (a ``DecodeTensors``, or a plain tuple in its field order; None
        where absent) whose layout is known to be the planned one: the one-shot call's plan
        cache compared it (``plan_cache``). Checks only what the layout does not fix, each
        address's alignment, whether an output overlaps another tensor (``_overlap``) and the
        scale (``scale_log2``), and returns False without launching where one fails (the caller
        then validates the call in full, which says why)."""
        values = []
        for t, align in zip(given, self._aligns):
            if t is None:
                values.append(0)
                continue
            try:
                address = t.data_ptr()
            except RuntimeError:  # a sparse tensor whose key matched a dense one's (strides all 0)
                return False
            if address % align:
                return False
            values.append(address)
        if self._overlap(values) is not None:
            return False
        scale = scale_log2(sm_scale, self.default_sm_scale)
        if scale is None:
            return False
        values.append(scale)
        values.append(0 if scratch is None else _aligned(scratch.data_ptr()))
        self._bind_and_launch(values)
        return True

    def _overlap(self, addresses: list) -> tuple[str, str] | None:
        """``overlapping_output`` of these input addresses (a value per ``DecodeTensors``
        field), remembering the last ones found free of overlap: a serving loop passes the same
        buffers call after call, so the pairwise check runs once per new set of addresses."""
        if addresses == self._no_overlap:
            return None
        overlap = overlapping_output(addresses, self._spans, self._present)
        if overlap is None:
            self._no_overlap = addresses[:]  # a copy: the caller appends the scale and scratch
        return overlap

    def _bind_and_launch(self, values: list) -> None:
        """``values`` as ``_checked_values`` returns them; the stream is the current one."""
        values.append(raw_stream(self.device_index))
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
        stream = raw_stream(self._device_index)
        with self._lock:
            if stream != self._stream:
                for words, i in self._stream_words:
                    words[i] = stream
                self._stream = stream
            for launch in self._launches:
                launch()
        return self.out, self.lse
