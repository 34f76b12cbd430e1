"""Planned execution: build a ``DecodePlan`` once per shape bucket, then ``run`` it many times.

A plan fixes everything a serving step repeats: the validated layout of every input
(shapes, strides, dtypes, device, which optional inputs are present), the kernel variants,
the split of the work and the scratch it needs. ``run`` then only checks that the tensors
it is given have exactly that layout (cheap tuple comparisons, so no read can go out of
bounds), writes their addresses into the kernels' packed arguments and launches. It
allocates nothing, never synchronizes with the host, and is safe to capture in a CUDA
graph; replaying the graph with new values in the same tensors (fewer valid tokens than
captured: give the padding tokens ``topk_length`` 0) recomputes the result.
"""

from __future__ import annotations

import math
import threading

import torch

from cute_kernels.sparse_mla_decode.config import PartialConfig
from cute_kernels.sparse_mla_decode.layout import D_QK, D_V

from . import loader
from .launcher import BoundKernel, argument_kinds
from .splits import plan_splits
from .variants import heads_per_cta_for, variants_for

_LOG2_E = math.log2(math.e)
_INT32_MAX = 2**31 - 1
SCRATCH_ALIGN = 256
# the current stream's raw handle: torch's fast accessor where the build has it (CUDA builds do)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)


def layout_signature(t):
    """What a plan fixes about a tensor: shape, strides and dtype (None for an absent input)."""
    return None if t is None else (t.shape, t.stride(), t.dtype)


class DecodePlan:
    """A launch plan for one layout of a ``sparse_mla_decode`` call (see the module doc)."""

    def __init__(self, call):
        """``call`` is a validated call (``dispatch.api.validate_call``)."""
        self.device_index = call.device_index
        self.num_tokens, self.num_heads = call.num_tokens, call.num_heads
        self.topk, self.extra_topk = call.topk, call.extra_topk
        self.split = plan_splits(call.num_tokens, call.num_heads, call.topk, call.extra_topk,
                                 heads_per_cta=heads_per_cta_for(call.num_heads), block_n=PartialConfig.block_n,
                                 num_sms=call.num_sms)
        self.variants = variants_for(call.launch_metadata, call.arch, self.split.num_splits)
        self.final = len(self.variants) == 1
        T, S, H = call.num_tokens, self.split.num_splits, call.num_heads
        self._o_part_bytes = 0 if self.final else T * S * H * D_V * 4
        lse_part_bytes = 0 if self.final else T * S * H * 4
        self.scratch_bytes = self._o_part_bytes + lse_part_bytes
        if self.scratch_bytes:
            self.scratch_bytes += SCRATCH_ALIGN  # room to align the start
        # the exact layout every run must present
        self._expect = {name: layout_signature(getattr(call, name)) for name in call.TENSORS}
        self._page, self._extra_page = call.main.page_block_size, call.extra.page_block_size
        self._stride_vals = call.strides
        # the kernels, bound with their packed arguments
        partial = loader.get_compiled(self.variants[0])
        self._partial = BoundKernel(partial, argument_kinds(loader.build_kernel(self.variants[0]).fake_args()),
                                    self._partial_values(call.pointers(), call.sm_scale, 0, 0), self.device_index)
        self._partial_dynamic = self._dynamic_positions(self._partial_values)
        self._lock = threading.Lock()  # the packed arguments are shared state: one run at a time
        self._merge = None
        if not self.final:
            merge = loader.get_compiled(self.variants[1])
            self._merge = BoundKernel(merge, argument_kinds(loader.build_kernel(self.variants[1]).fake_args()),
                                      self._merge_values(call.pointers(), 0, 0), self.device_index)
            self._merge_dynamic = self._dynamic_positions(lambda p, scale, scratch, stream:
                                                          self._merge_values(p, scratch, stream))

    # ------------------------------------------------------------------ argument values
    def _partial_values(self, p, sm_scale, scratch, stream):
        st = self._stride_vals
        o_part = scratch if not self.final else p["q"]  # stand-in, never touched in final mode
        lse_part = scratch + self._o_part_bytes if not self.final else p["lse"]
        return [
            p["q"], st["q_t"], st["q_h"], self.num_tokens, self.num_heads,
            p["main"], self._page, st["main_block"], st["main_slots"], p["indices"], st["idx_t"], self.topk,
            p["topk_length"] or p["indices"],
            p["extra"], self._extra_page, st["extra_block"], st["extra_slots"], p["extra_indices"] or p["indices"],
            st["extra_idx_t"], self.extra_topk, p["extra_topk_length"] or p["indices"],
            sm_scale * _LOG2_E, self.split.chunks_per_split, self.split.num_splits, o_part, lse_part,
            p["out"], st["out_t"], st["out_h"], p["lse"], st["lse_t"], st["lse_h"], p["attn_sink"] or p["lse"],
            stream,
        ]

    def _merge_values(self, p, scratch, stream):
        st = self._stride_vals
        return [
            scratch, scratch + self._o_part_bytes, self.num_tokens, self.split.num_splits, self.num_heads,
            p["attn_sink"] or p["lse"], p["out"], st["out_t"], st["out_h"], p["lse"], st["lse_t"], st["lse_h"],
            stream,
        ]

    def _dynamic_positions(self, values_fn) -> list[int]:
        """The argument positions that depend on the tensors' addresses, sm_scale, scratch or stream.

        Found by evaluating the argument list with two different sets of those inputs; every
        other argument is fixed by the plan and written once.
        """
        keys = ("q", "main", "indices", "topk_length", "attn_sink", "out", "lse", "extra", "extra_indices",
                "extra_topk_length")
        a = values_fn({k: 4096 * (i + 1) for i, k in enumerate(keys)}, 1.0, 1 << 20, 7)
        b = values_fn({k: 8192 * (i + 3) for i, k in enumerate(keys)}, 2.0, 1 << 21, 9)
        return [i for i, (x, y) in enumerate(zip(a, b)) if x != y]

    # ------------------------------------------------------------------ run
    def new_scratch(self) -> torch.Tensor | None:
        """A scratch buffer for ``run`` (None when the plan needs none)."""
        if not self.scratch_bytes:
            return None
        return torch.empty(self.scratch_bytes, dtype=torch.uint8, device=torch.device("cuda", self.device_index))

    def _check(self, name, t):
        exp = self._expect[name]
        if exp is None:
            if t is not None:
                raise ValueError(f"DecodePlan.run: {name} was not part of the planned call; plan again with it")
            return 0
        if t is None:
            raise ValueError(f"DecodePlan.run: {name} is required by this plan")
        if t.shape != exp[0] or t.stride() != exp[1] or t.dtype != exp[2] or t.get_device() != self.device_index:
            raise ValueError(
                f"DecodePlan.run: {name} has shape {list(t.shape)}, strides {list(t.stride())}, {t.dtype} on "
                f"{t.device}; the plan was built for shape {list(exp[0])}, strides {list(exp[1])}, {exp[2]} on "
                f"cuda:{self.device_index}"
            )
        return t.data_ptr()

    def run(self, q, kv_cache, indices, *, out, lse, scratch=None, sm_scale=None, topk_length=None,
            attn_sink=None, extra_kv_cache=None, extra_indices=None, extra_topk_length=None):
        """Launch on tensors laid out as planned. Allocates nothing; returns ``(out, lse)``."""
        p = {
            "q": self._check("q", q), "main": self._check("kv_cache", kv_cache),
            "indices": self._check("indices", indices), "topk_length": self._check("topk_length", topk_length),
            "attn_sink": self._check("attn_sink", attn_sink), "out": self._check("out", out),
            "lse": self._check("lse", lse), "extra_indices": self._check("extra_indices", extra_indices),
            "extra_topk_length": self._check("extra_topk_length", extra_topk_length),
        }
        extra = self._check("extra_kv_cache", extra_kv_cache)
        p["extra"] = extra or p["main"]
        if sm_scale is None:
            sm_scale = 1.0 / math.sqrt(D_QK)
        elif not math.isfinite(sm_scale):
            raise ValueError(f"DecodePlan.run: sm_scale must be finite, got {sm_scale!r}")
        if self.scratch_bytes and (
                scratch is None or not scratch.is_contiguous() or scratch.get_device() != self.device_index
                or scratch.numel() * scratch.element_size() < self.scratch_bytes):
            raise ValueError(f"DecodePlan.run: scratch must be a contiguous buffer of at least "
                             f"{self.scratch_bytes} bytes on cuda:{self.device_index} (plan.new_scratch())")
        self.launch(p, float(sm_scale), scratch.data_ptr() if self.scratch_bytes else 0)
        return out, lse

    def launch(self, p: dict, sm_scale: float, scratch_ptr: int) -> None:
        """Write the changing arguments and launch. ``p`` holds the addresses of inputs whose
        layout is already checked (``run``, or ``validate_call`` for the one-shot API)."""
        base = -(-scratch_ptr // SCRATCH_ALIGN) * SCRATCH_ALIGN if self.scratch_bytes else 0
        stream = _raw_stream(self.device_index)
        with self._lock:
            self._partial.write_at(self._partial_dynamic, self._partial_values(p, float(sm_scale), base, stream))
            self._partial.launch()
            if self._merge is not None:
                self._merge.write_at(self._merge_dynamic, self._merge_values(p, base, stream))
                self._merge.launch()
