"""What every partial kernel does around its main loop: the CTA's coordinates, the early
launch of the merge kernel, and the outputs.

Outputs, split mode: per (token, split, head) the normalized partial output (f32, 512) and
its lse in log2 units (-inf for a split with no valid entry); ``merge.py`` combines the
splits. Final mode (``cfg.final_output``, a call that needs one split): the bf16 output and
the natural-log lse (+inf for a head with no valid entry), the sink applied, and no merge.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from ..arch import Arch
from .config import PartialConfig
from .device_utils import LN_2, load_f32, sink_gate, store_f32
from .kv_format import D_V


def quad_allreduce(val, op):
    """Reduce over the 4 threads of an MMA quad (they hold the same rows)."""
    val = op(val, cute.arch.shuffle_sync_bfly(val, offset=2, mask=-1, mask_and_clamp=31))
    val = op(val, cute.arch.shuffle_sync_bfly(val, offset=1, mask=-1, mask_and_clamp=31))
    return val


class Epilogue:
    """The prologue and output steps of one ``PartialConfig``."""

    def __init__(self, cfg: PartialConfig, arch: Arch):
        self.cfg = cfg
        self.hb = cfg.heads_per_cta
        self.pdl = arch.pdl

    @cute.jit
    def start(self, num_heads: Int32):
        """The kernel's first step: in split mode, where the arch has PDL, let the merge kernel
        (a programmatic dependent launch) get its CTAs onto the SMs as this grid's last wave
        starts (it waits for this grid to finish before reading). Returns (thread, token,
        head block, split)."""
        if const_expr(not self.cfg.final_output and self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        token, head_block, split = self.block_coords(num_heads)
        return tidx, token, head_block, split

    @cute.jit
    def block_coords(self, num_heads: Int32):
        """(token, head block, split) of this CTA. The grid's x runs over the head blocks of
        a token first: a token's head blocks, which gather the same rows, run at the same
        time, so all but the first find those rows in L2."""
        bx, split, _ = cute.arch.block_idx()
        head_blocks = (num_heads + self.hb - 1) // self.hb
        token = bx // head_blocks
        return token, bx - token * head_blocks, split

    @cute.jit
    def gate_and_lse2(self, total: Float32, row_max: Float32, sink_addr: Int64, head: Int32):
        """(factor for the accumulated output row, lse in log2 units) of a head whose
        probabilities sum to ``total`` after the running max ``row_max``. An empty row (no
        valid entry) has total 0: factor 0 and lse -inf. A row that met a NaN entry has total
        NaN: factor 0 (its row NaN) and lse NaN, which the merge's max takes, not skipping the
        split as empty (``merge.py``). The sink (``sink_addr``: attn_sink's address) is applied in
        final mode."""
        gate = Float32(0.0)
        lse2 = -Float32.inf
        if total > 0.0:
            gate = 1.0 / total
            lse2 = row_max + cute.math.log2(total, fastmath=False)
            if const_expr(self.cfg.final_output and self.cfg.has_sink):
                gate = gate * sink_gate(load_f32(sink_addr + Int64(head) * 4), lse2)
        if total != total:  # NaN (an unordered compare)
            lse2 = total
        return gate, lse2

    @cute.jit
    def store_lse(self, lse2: Float32, token: Int32, split: Int32, num_splits: Int32,
                  num_heads: Int32, head: Int32, lse_part_addr: Int64, lse_addr: Int64,
                  lse_stride_t: Int64, lse_stride_h: Int64):
        """A head's lse from ``gate_and_lse2``'s: natural log (+inf for an empty row, NaN for a
        row that met a NaN entry) in final mode, the split's log2 lse in split mode
        (``lse_part_addr`` / ``lse_addr``: the tensors' addresses)."""
        if const_expr(self.cfg.final_output):
            lse_nat = lse2 * LN_2  # (NaN stays NaN)
            if lse2 == -Float32.inf:
                lse_nat = Float32.inf
            store_f32(lse_addr + (Int64(token) * lse_stride_t + Int64(head) * lse_stride_h) * 4, lse_nat)
        else:
            store_f32(lse_part_addr + ((Int64(token) * num_splits + split) * num_heads + head) * 4, lse2)

    @cute.jit
    def store_out(self, vals, col, token, split, num_splits, num_heads, head, o_part, out, out_stride_t,
                  out_stride_h):
        """``len(vals)`` adjacent output values of ``head`` from column ``col``: bf16 ``out``
        (final mode) or the split's f32 partial (``out`` / ``o_part``: their addresses)."""
        n = len(vals)
        if const_expr(self.cfg.final_output):
            v = cute.make_rmem_tensor(n, BFloat16)
            for k in cutlass.range_constexpr(n):
                v[k] = BFloat16(vals[k])
            addr = out + (Int64(token) * out_stride_t + Int64(head) * out_stride_h + Int64(col)) * 2
            dst = cute.make_tensor(cute.make_ptr(BFloat16, addr, cute.AddressSpace.gmem, assumed_align=2 * n),
                                   cute.make_layout(n))
        else:
            v = cute.make_rmem_tensor(n, Float32)
            for k in cutlass.range_constexpr(n):
                v[k] = vals[k]
            addr = o_part + (((Int64(token) * num_splits + split) * num_heads + head) * D_V + col) * 4
            dst = cute.make_tensor(cute.make_ptr(Float32, addr, cute.AddressSpace.gmem, assumed_align=4 * n),
                                   cute.make_layout(n))
        cute.autovec_copy(v, dst)
