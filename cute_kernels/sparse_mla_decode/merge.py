"""Combine kernel of sparse MLA decode: merges the split-K partials by their lse (CuTe DSL).

One CTA per (token, head); thread i owns output dims [4i, 4i + 4).

    m     = max_s lse2_s                    (log2 units, -inf for an empty split; NaN if any is)
    w_s   = 2**(lse2_s - m)
    out   = sum_s w_s * O_s / sum_s w_s     (each O_s is already normalized)
    lse   = (m + log2(sum_s w_s)) * ln 2    (natural log, as FlashMLA returns it)
    sink  : out *= 1 / (1 + exp(sink_h - lse)); lse unchanged
    empty : (every split empty) out = 0, lse = +inf

A batch of splits past the first whose splits are all empty (lse -inf) is skipped, its partial
outputs not loaded: a list much wider than its lengths leaves most splits empty
(``gather.ChunkGather.bound_chunks``). A split that met a NaN entry has lse NaN (``Epilogue``): the
max takes it (a NaN-propagating max), so every weight, the output and the lse are NaN, as in
the reference.

Where the arch has programmatic dependent launch (``Arch.pdl``) it is launched as a
dependent of the partial kernel (its CTAs start while the partial kernel's last wave runs,
and wait for it before reading); elsewhere it is an ordinary launch, which the stream starts
after the partial kernel has finished. It loads the first
``split_batch`` splits' partial outputs together with the lse values: one round trip for a
call with up to that many splits (``tuning.MERGE_BATCHES``, ``docs/tuning.md``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.memory import SmemAllocator

from ..arch import Arch
from .config import MergeConfig
from .device_utils import LN_2, load_f32, sink_gate, store_f32
from .kernel_args import MERGE_ARGS, KernelParams, fake_args, launcher_signature
from .kv_format import D_V


class MergeKernel:
    """The combine kernel for one ``MergeConfig``; ``__call__`` is the ``cute.jit`` launcher."""

    def __init__(self, cfg: MergeConfig, arch: Arch):
        cfg.check()
        self.cfg = cfg
        self.pdl = arch.pdl
        self.vec = D_V // cfg.num_threads

    def fake_args(self) -> list:
        """Stand-ins for every ``__call__`` argument, to compile with no tensors and no GPU."""
        return fake_args(MERGE_ARGS)

    def _launch(self, *args):
        """Launch on the arguments of ``MERGE_ARGS``, in order, the stream last (``__call__``)."""
        p = KernelParams(MERGE_ARGS, args)
        self.kernel(p.for_device()).launch(grid=(p.num_tokens, p.num_heads, 1), block=(self.cfg.num_threads, 1, 1),
                                           stream=args[-1], use_pdl=self.pdl)

    # the cute.jit entry point, with the schema's named, typed parameters
    __call__ = cute.jit(launcher_signature(MERGE_ARGS)(_launch))

    @cute.kernel
    def kernel(self, p: KernelParams):
        vec = self.vec
        o_part, lse_part, num_splits, num_heads, attn_sink = p.o_part, p.lse_part, p.num_splits, p.num_heads, p.attn_sink
        out, out_stride_t, out_stride_h, lse, lse_stride_t, lse_stride_h = (
            p.out, p.out_stride_t, p.out_stride_h, p.lse, p.lse_stride_t, p.lse_stride_h)
        # Launched as a programmatic dependent of the partial kernel (PDL): its CTAs may start
        # while the partial kernel's last wave runs; nothing is read before every partial CTA
        # has finished and its writes are visible. (Without PDL the launch itself waits.)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        tidx, _, _ = cute.arch.thread_idx()
        token, head, _ = cute.arch.block_idx()
        gLse = cute.make_tensor(
            cute.make_ptr(Float32, lse_part.toint() + (Int64(token) * num_splits * num_heads + head) * 4,
                          cute.AddressSpace.gmem, assumed_align=4),
            cute.make_layout(num_splits, stride=num_heads),
        )
        o_base = o_part.toint() + (Int64(token) * num_splits * num_heads + head) * (D_V * 4) + tidx * (vec * 4)
        o_split_stride = Int64(num_heads) * (D_V * 4)
        # the first split_batch splits' partial outputs are loaded right away, together with
        # the lse values: they do not depend on the weights, so one round trip serves both
        rO = cute.make_rmem_tensor(self.cfg.split_batch * vec, Float32)
        self._load_batch(rO, o_base, o_split_stride, Int32(0), num_splits)
        # pass 1: thread s loads split s's lse (num_splits <= num_threads, see splits.py), the
        # block max; then thread s keeps its split's weight 2**(lse_s - m) in shared memory
        nwarps = self.cfg.num_threads // 32
        alloc = self.cfg.smem_plan().allocator(SmemAllocator())
        sMax = alloc.allocate("warp_max", Float32, cute.make_layout(nwarps))
        sSum = alloc.allocate("warp_sum", Float32, cute.make_layout(nwarps))
        sW = alloc.allocate("weights", Float32, cute.make_layout(self.cfg.num_threads))
        sNonempty = alloc.allocate("warp_nonempty", Int32, cute.make_layout(nwarps))
        lse_s = -Float32.inf
        if tidx < num_splits:
            lse_s = gLse[tidx]
        m = lse_s
        for offset in (16, 8, 4, 2, 1):
            other = cute.arch.shuffle_sync_bfly(m, offset=offset, mask=-1, mask_and_clamp=31)
            m = cute.arch.fmax(m, other, nan=True)
        if tidx % 32 == 0:
            sMax[tidx // 32] = m
        cute.arch.sync_threads()
        m = sMax[0]
        for w in cutlass.range_constexpr(1, nwarps):
            m = cute.arch.fmax(m, sMax[w], nan=True)
        m_base = m
        if m == -Float32.inf:
            m_base = Float32(0.0)
        w_s = cute.math.exp2(lse_s - m_base, fastmath=True)  # 0 for an empty or absent split
        sW[tidx] = w_s
        # bit l: split 32 w + l is not empty (unordered: NaN counts)
        nonempty = cute.arch.vote_ballot_sync(lse_s != -Float32.inf)
        if tidx % 32 == 0:
            sNonempty[tidx // 32] = nonempty
        for offset in (16, 8, 4, 2, 1):
            w_s = w_s + cute.arch.shuffle_sync_bfly(w_s, offset=offset, mask=-1, mask_and_clamp=31)
        if tidx % 32 == 0:
            sSum[tidx // 32] = w_s
        cute.arch.sync_threads()

        # pass 2: the weighted sum (the first batch already in registers, any further batch
        # loaded together)
        acc = cute.make_rmem_tensor(vec, Float32)
        acc.fill(0.0)
        lse_out = Float32.inf
        if m != -Float32.inf:
            total = sSum[0]
            for w in cutlass.range_constexpr(1, nwarps):
                total = total + sSum[w]
            self._accumulate_batch(acc, rO, sW, Int32(0), num_splits)
            for b0 in cutlass.range(self.cfg.split_batch, num_splits, self.cfg.split_batch, unroll=1):
                # the batch's bits of its warp's ballot (a batch lies within one warp's 32 splits)
                bits = sNonempty[b0 // 32] >> (b0 % 32)
                if const_expr(self.cfg.split_batch < 32):
                    bits = bits & ((1 << self.cfg.split_batch) - 1)
                if bits != 0:
                    self._load_batch(rO, o_base, o_split_stride, b0, num_splits)
                    self._accumulate_batch(acc, rO, sW, b0, num_splits)
            lse2 = m + cute.math.log2(total, fastmath=False)
            gate = 1.0 / total
            if const_expr(self.cfg.has_sink):
                gate = gate * sink_gate(load_f32(attn_sink.toint() + Int64(head) * 4), lse2)
            acc.store(acc.load() * gate)
            lse_out = lse2 * LN_2

        gOut = cute.make_tensor(
            cute.make_ptr(
                BFloat16,
                out.toint() + (Int64(token) * out_stride_t + Int64(head) * out_stride_h + tidx * vec) * 2,
                cute.AddressSpace.gmem, assumed_align=8,
            ),
            cute.make_layout(vec),
        )
        gOut.store(acc.load().to(BFloat16))
        if tidx == 0:
            store_f32(lse.toint() + (Int64(token) * lse_stride_t + Int64(head) * lse_stride_h) * 4, lse_out)

    @cute.jit
    def _load_batch(self, rO: cute.Tensor, o_base: Int64, o_split_stride: Int64, b0: Int32, num_splits: Int32):
        """This thread's ``vec`` values of splits b0 .. b0 + split_batch - 1 (those that exist)."""
        vec = self.vec
        for k in cutlass.range_constexpr(self.cfg.split_batch):
            if b0 + k < num_splits:
                gO = cute.make_tensor(
                    cute.make_ptr(Float32, o_base + Int64(b0 + k) * o_split_stride, cute.AddressSpace.gmem,
                                  assumed_align=16),
                    cute.make_layout(vec),
                )
                cute.autovec_copy(gO, cute.make_tensor(rO.iterator + k * vec, cute.make_layout(vec)))

    @cute.jit
    def _accumulate_batch(self, acc: cute.Tensor, rO: cute.Tensor, sW: cute.Tensor, b0: Int32, num_splits: Int32):
        """acc += w_s O_s over the batch of splits from b0 held in ``rO``."""
        vec = self.vec
        for k in cutlass.range_constexpr(self.cfg.split_batch):
            if b0 + k < num_splits:
                w = sW[b0 + k]
                for i in cutlass.range_constexpr(vec):
                    acc[i] = acc[i] + rO[k * vec + i] * w
