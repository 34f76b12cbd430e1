"""The kernels' arguments: one ordered schema per kernel, the single source of their order.

Every kernel takes raw device pointers and integers (one compiled kernel serves every shape),
in the order its schema lists them, the stream last. From the schema come

- ``launcher_signature(schema)``: the named, typed signature of the kernel's ``cute.jit``
  launcher (what the DSL marshals and what an exported object's C header declares);
- ``fake_args(schema)``: the compile-time stand-ins (``cute.compile`` with no tensors, no GPU);
- ``KernelParams``: the values inside the kernel, by name (``p.main_page``);
- the host side's packing (``dispatch.runtime.launcher``: one C slot per argument, its kind and
  pointer alignment) and the plan's argument list (``dispatch.runtime.plan``: a value per name).

This module imports no CUTLASS at import time: the dispatch reads the schema on any machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LOG2_E = math.log2(math.e)  # the kernels' scores are in log2 units: the argument sm_scale_log2 = sm_scale * LOG2_E


@dataclass(frozen=True)
class Arg:
    """One kernel argument. ``kind``: "ptr" (global memory), "i32", "i64", "f32" or "stream";
    a pointer's ``dtype`` ("bf16", "u8", "i32", "f32") and assumed byte alignment ``align``;
    ``launch_only``: read by the launch (the grid) and not passed to the device code."""

    name: str
    kind: str
    dtype: str | None = None
    align: int = 0
    launch_only: bool = False


def _list_args(which: str) -> tuple[Arg, ...]:
    """A cache and its list of selected slots ("main" or "extra")."""
    return (
        Arg(f"{which}_cache", "ptr", "u8", 16),  # page blocks, 16-byte aligned
        Arg(f"{which}_page", "i32"),  # tokens per page block
        Arg(f"{which}_page_magic", "i64"),  # cache_view.page_division_magic(page)
        Arg(f"{which}_block_stride", "i64"),  # bytes between page blocks
        Arg(f"{which}_row_stride", "i64"),  # bytes between a block's rows (inline-scale formats)
        Arg(f"{which}_num_slots", "i32"),  # slots in the cache: larger ones are never read
        Arg(f"{which}_idx", "ptr", "i32", 4),  # [T, topk] slots
        Arg(f"{which}_idx_stride", "i64"),  # elements between tokens' rows
        Arg(f"{which}_topk", "i32"),  # 0 for an absent extra list
        Arg(f"{which}_len", "ptr", "i32", 4),  # [T] lengths (read only when the variant has them)
    )


# The split-K partial kernel (every compute path).
PARTIAL_ARGS = (
    Arg("q", "ptr", "bf16", 16),  # [T, H, 512], rows 16-byte aligned
    Arg("q_stride_t", "i64"),  # elements
    Arg("q_stride_h", "i64"),
    Arg("num_tokens", "i32", launch_only=True),
    Arg("num_heads", "i32"),
    *_list_args("main"),
    *_list_args("extra"),
    Arg("sm_scale_log2", "f32"),  # sm_scale * log2(e)
    Arg("chunks_per_split", "i32"),
    Arg("num_splits", "i32"),  # splits of the partial outputs (all launches of the call)
    Arg("launch_splits", "i32", launch_only=True),  # this launch's splits (the grid's y)
    # [T, splits, H, 512] normalized partial outputs (split mode); a second launch's starts at
    # its first split (the first launch's splits later)
    Arg("o_part", "ptr", "f32", 16),
    Arg("lse_part", "ptr", "f32", 4),  # [T, splits, H] their lse, log2 units (split mode)
    Arg("out", "ptr", "bf16", 8),  # [T, H, 512] (final mode)
    Arg("out_stride_t", "i64"),
    Arg("out_stride_h", "i64"),
    Arg("lse", "ptr", "f32", 4),  # [T, H] natural log (final mode)
    Arg("lse_stride_t", "i64"),
    Arg("lse_stride_h", "i64"),
    Arg("attn_sink", "ptr", "f32", 4),  # [H] (final mode with a sink)
    Arg("stream", "stream"),
)

# The combine kernel: the partial kernel's split outputs in, out / lse out.
MERGE_ARGS = (
    Arg("o_part", "ptr", "f32", 16),
    Arg("lse_part", "ptr", "f32", 4),
    Arg("num_tokens", "i32", launch_only=True),
    Arg("num_splits", "i32"),
    Arg("num_heads", "i32"),
    Arg("attn_sink", "ptr", "f32", 4),  # read only when the variant has a sink
    Arg("out", "ptr", "bf16", 8),
    Arg("out_stride_t", "i64"),
    Arg("out_stride_h", "i64"),
    Arg("lse", "ptr", "f32", 4),
    Arg("lse_stride_t", "i64"),
    Arg("lse_stride_h", "i64"),
    Arg("stream", "stream"),
)


def _dsl_dtype(name: str):
    from cutlass import BFloat16, Float32, Int32, Uint8

    return {"bf16": BFloat16, "u8": Uint8, "i32": Int32, "f32": Float32}[name]


def launcher_signature(schema: tuple[Arg, ...]):
    """Give a ``(self, *args)`` launcher the signature ``(self, <schema's names, typed>)``:
    apply it before ``cute.jit`` (``__call__ = cute.jit(launcher_signature(SCHEMA)(fn))``)."""
    import inspect

    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    annotation = {"ptr": cute.Pointer, "i32": Int32, "i64": Int64, "f32": Float32, "stream": cuda.CUstream}
    P = inspect.Parameter
    signature = inspect.Signature([P("self", P.POSITIONAL_OR_KEYWORD)] + [
        P(a.name, P.POSITIONAL_OR_KEYWORD, annotation=annotation[a.kind]) for a in schema])

    def apply(fn):
        fn.__signature__ = signature
        return fn
    return apply


def fake_args(schema: tuple[Arg, ...]) -> list:
    """Stand-ins for every argument of ``schema``, to compile with no tensors and no GPU."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    def stand_in(a: Arg):
        if a.kind == "ptr":
            return make_ptr(_dsl_dtype(a.dtype), 0, cute.AddressSpace.gmem, assumed_align=a.align)
        return {"i32": lambda: Int32(1), "i64": lambda: Int64(0), "f32": lambda: Float32(1.0),
                "stream": make_fake_stream}[a.kind]()

    return [stand_in(a) for a in schema]


def argument_kinds(schema: tuple[Arg, ...]) -> list:
    """Per argument: its kind, and for a pointer the DSL dtype and alignment the compiled
    kernel assumes (what ``dispatch.runtime.launcher`` packs and checks)."""
    return [(a.kind, _dsl_dtype(a.dtype), a.align) if a.kind == "ptr" else (a.kind,) for a in schema]


class KernelParams:
    """A kernel's runtime arguments (``schema`` without the stream), by name. ``for_device()``
    is what a ``cute.kernel`` takes as ONE argument: the DSL flattens it into the kernel's
    parameters in schema order (``__extract_mlir_values__``), without the launch-only ones,
    and rebuilds it inside the kernel."""

    def __init__(self, schema: tuple[Arg, ...], values):
        values = list(values)
        if len(values) == len(schema):  # the launcher's arguments: drop the stream's (the launch takes it)
            values = [v for a, v in zip(schema, values) if a.kind != "stream"]
        schema = tuple(a for a in schema if a.kind != "stream")
        if len(values) != len(schema):
            raise ValueError(f"{len(schema)} kernel arguments expected (and optionally the stream), got {len(values)}")
        self._schema, self._values = schema, values
        for a, v in zip(schema, values):
            setattr(self, a.name, v)

    def for_device(self) -> "KernelParams":
        """The arguments the device code reads (all but the launch-only ones)."""
        keep = [(a, v) for a, v in zip(self._schema, self._values) if not a.launch_only]
        return KernelParams(tuple(a for a, _ in keep), [v for _, v in keep])

    def __extract_mlir_values__(self):
        flat, self._counts = [], []
        for v in self._values:
            vals = v.__extract_mlir_values__()
            flat += vals
            self._counts.append(len(vals))
        return flat

    def __new_from_mlir_values__(self, values):
        rebuilt, at = [], 0
        for v, n in zip(self._values, self._counts):
            rebuilt.append(v.__new_from_mlir_values__(values[at:at + n]))
            at += n
        return KernelParams(self._schema, rebuilt)
