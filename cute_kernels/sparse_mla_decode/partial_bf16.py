"""Split-K partial kernel, "bf16" path (``PartialConfig.precision == "bf16"``): the gathered
rows dequantized into a bf16 tile, bf16 MMAs. Every cache format.

Per CTA: Q [heads, d_qk] is staged in the tile (cp.async), then held in registers as bf16 A
fragments. Warp w of a head group owns columns 128 w .. + 128 of the QK width's first 512
and of the output; V3.2's rope dims (QK only) are 16 per warp, multiplied from the raw rows
(``PartialKernel.qk_rope``, as the FP8 path does).

Per chunk of 32 entries:
1. dequantize: the landed raw stage becomes the bf16 tile [32, 512] (8 x 64 swizzled atoms,
   conflict-free ``ldmatrix`` both ways); a thread converts 16 columns at a time (one 16-byte
   load; without the arch's e4m3 conversion instruction, by ``warp_ops.OperandConversion``'s
   integer operations). UE8M0 formats: e4m3 times 2**(b - 127) (exact in bf16), MODEL1's bf16 rope as
   stored. FP32-scale formats: the e4m3 values alone (exact); their scales, one per 128 dims =
   one per warp's slice, are applied after the MMA: to the warp's partial S and to P (P s,
   rounded to bf16 once), so no product of a value and an FP32 scale is ever rounded. An
   entry that does not count arrived as zeros (``gather.py``) and becomes a row of 0.
2. S_w = Q_w K_w^T (mma.sync m16n8k16 bf16 -> f32) over the warp's slice, the group's four
   partial S summed through shared memory (``softmax.exchange_s``), the online softmax in the
   quad form (``softmax.quad_online_softmax``).
3. O_w += P V_w: P in bf16 straight from the S registers, V_w the tile read transposed.

Precision: K, V and the scales are exact; P is rounded to bf16 (8 bits); S, the softmax and
the accumulators are f32.

Measured (sm_120a SASS; ``docs/tuning.md``): the main loop is 1117 instructions per thread
and chunk (MODEL1, 16 heads) against the "f16" path's 320 / 340 (nope / rope warps), which
is why "f16" is the default.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Uint8, const_expr
from cutlass.cute.nvgpu import warp
from cutlass.memory import SmemAllocator

from .device_utils import load_smem_u8, smem_scalar, smem_vec
from .kernel_args import KernelParams
from .kv_format import D_V
from .partial import PartialKernel
from .softmax import exchange_s, quad_online_softmax
from .tuning import DEQUANT_VALUES
from .warp_ops import f16x2_to_f32, ue8m0_scale


class PartialBf16Kernel(PartialKernel):
    """The "bf16"-path partial kernel for one ``PartialConfig``."""

    PATHS = ("bf16",)  # the compute paths (``PartialConfig.precision``) this class generates

    def __init__(self, cfg, arch):
        super().__init__(cfg, arch)
        self.wpg = cfg.warps_per_group
        self.wslice = D_V // cfg.warps_per_group  # QK and output columns per warp
        fmt = self.fmt
        # the tile holds the value's D_V columns (MODEL1: nope and rope); V3.2's rope dims,
        # QK only, come from the raw rows
        self.rope_from_raw = fmt.d_qk > D_V
        assert fmt.d_qk == D_V or (fmt.nope_dims == D_V and fmt.rope_dims == 16 * self.wpg)
        # FP32 scales, applied after the MMA: one per warp's slice
        self.fp32_scales = fmt.fp32_scales
        assert not self.fp32_scales or fmt.scale_group == self.wslice

    def kernel_operands(self) -> tuple:
        return (self.tile_layout(self.bn, D_V), self.tile_layout(self.hb, self.cfg.q_cols), self.bf16_tiled_mma(),
                self.tiled_store(8, self.cfg.q_cols), self.tiled_store(DEQUANT_VALUES, D_V))

    @cute.kernel
    def kernel(self, p: KernelParams, kv_layout: cute.ComposedLayout, q_layout: cute.ComposedLayout,
               tiled_mma: cute.TiledMma, tiled_store: cute.TiledCopy, tiled_dequant: cute.TiledCopy):
        bn, hb, hg = self.bn, self.hb, self.hg
        tidx, token, head_block, split = self.epilogue.start(p.num_heads)
        warp_id = tidx // 32
        lane = tidx % 32
        group = warp_id // self.wpg  # which 16 heads of the CTA this warp computes
        wq = warp_id % self.wpg  # which 128-wide slice of QK and of the output
        head0 = head_block * hb
        ghead0 = head0 + group * hg  # first head of this warp's group

        # ---- shared memory: the bf16 KV tile (Q is staged in it first), then the gather's
        alloc = self.smem_plan.allocator(SmemAllocator())
        sTile = alloc.allocate("kv_tile", Uint8, cute.make_layout(self.cfg.kv_tile_bytes))
        sKV = cute.make_tensor(cute.recast_ptr(sTile.iterator, dtype=BFloat16), kv_layout)
        sQ = cute.make_tensor(cute.recast_ptr(sTile.iterator, dtype=BFloat16), q_layout)
        ctx = self.gather.context(alloc, self.quad_s_exchange_layout(), tidx, token, split, p)
        sMask, sS = ctx.sMask, ctx.sS
        self.gather.issue_first_indices(ctx, ctx.c_begin)  # before Q: the first rows wait for them
        # the epilogue's addresses, taken at the top level (see ChunkGather.context)
        sink_addr, lse_part_addr, lse_addr = p.attn_sink.toint(), p.lse_part.toint(), p.lse.toint()
        sm_scale_log2 = p.sm_scale_log2
        self.stage_q(p, token, head0, sQ, tiled_store, tidx)
        self.gather.wait_first_indices()  # (and Q's copies, where they are cp.async)
        c_begin, c_end = self.gather.bound_chunks(ctx)  # the lengths' first use: after the wait
        self.gather.start_pipeline(ctx, c_begin, c_end)

        # ---- MMA partitions: warp w owns columns [w*wslice, (w+1)*wslice) of QK and of the output
        thr_mma = tiled_mma.get_slice(lane)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), BFloat16)
        thr_ld_Q = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(lane)
        thr_ld_K = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(lane)
        thr_ld_V = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(lane)
        sQ_w = cute.local_tile(sQ, (hg, self.wslice), (group, wq))
        sK_w = cute.local_tile(sKV, (bn, self.wslice), (0, wq))
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ_w))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK_w))
        tSsQ, tSrQ_v = thr_ld_Q.partition_S(sQ_w), thr_ld_Q.retile(tSrQ)
        tSsK, tSrK_v = thr_ld_K.partition_S(sK_w), thr_ld_K.retile(tSrK)
        sVt = cute.composition(sKV, cute.make_layout((D_V, bn), stride=(bn, 1)))
        sVt_w = cute.local_tile(sVt, (self.wslice, bn), (wq, 0))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt_w))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((hg, self.wslice)), Float32)
        acc_O.fill(0.0)
        tOsVt = thr_ld_V.partition_S(sVt_w)
        tOrVt_v = thr_ld_V.retile(tOrVt)

        # Q stays in registers for the whole kernel (V3.2: its rope dims as 4 more registers).
        for k in cutlass.range_constexpr(cute.size(tSsQ, mode=[2])):
            cute.copy(ldsm, tSsQ[None, None, k], tSrQ_v[None, None, k])
        q_rope = [Int32(0)] * 4
        if const_expr(self.rope_from_raw):
            q_rope = self.load_q_rope(sQ, wq, [group * hg + lane // 4, group * hg + lane // 4 + 8],
                                      [Float32(1.0), Float32(1.0)], lane % 4)
        cute.arch.sync_threads()  # the KV tile is reused from here on
        sf = cute.make_rmem_tensor(8, Float32)  # FP32: this warp's scale of the thread's entries 8 j + 2 q + i at 2 j + i

        # S exchange views and the (row, column) of each accumulator element
        tSsS = [thr_mma.partition_C(sS[None, None, w, group]) for w in range(self.wpg)]
        tScS = thr_mma.partition_C(cute.make_identity_tensor((hg, bn)))
        row_max = cute.make_rmem_tensor(2, Float32)  # rows g and g+8 of this thread
        row_sum = cute.make_rmem_tensor(2, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)

        # ---- dequantization partition of the KV tile (thread owns one 16-column piece)
        thr_deq = tiled_dequant.get_slice(tidx)
        ctx.tXsKV = thr_deq.partition_D(sKV)
        ctx.tXcKV = thr_deq.partition_D(cute.make_identity_tensor((bn, D_V)))

        # ---- main loop over the chunks of this split
        for c in cutlass.range(c_begin, c_end, 1, unroll=1):
            step = c - c_begin
            stage = step % self.stages  # raw row buffer of chunk c
            buf = step % self.slots  # index and validity-mask buffer of chunk c
            self.gather.next_chunk(ctx, c, c_end, step)
            self._dequantize(ctx, stage)
            cute.arch.sync_threads()

            # S_w = Q_w K_w^T over this warp's slice of the QK width (FP32: times each entry's
            # scale of the slice), plus its rope dims from the raw rows (V3.2)
            acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((hg, bn)), Float32)
            acc_S.fill(0.0)
            for k in cutlass.range_constexpr(cute.size(tSsK, mode=[2])):
                cute.copy(ldsm, tSsK[None, None, k], tSrK_v[None, None, k])
                cute.gemm(tiled_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
            stage_base = ctx.raw_base + stage * self.gather.stage_bytes
            if const_expr(self.fp32_scales):
                self._load_scales(sf, stage_base, wq, lane % 4)
                self._scale_columns(acc_S, sf)
            if const_expr(self.rope_from_raw):
                self.qk_rope(acc_S, q_rope, stage_base, wq, lane)
            exchange_s(acc_S, tSsS, wq, group, self.wpg, self.groups)
            correction = quad_online_softmax(acc_S, tScS, sMask[buf], [sm_scale_log2, sm_scale_log2], row_max,
                                             row_sum)
            for r in cutlass.range_constexpr(2):  # acc_O row r: elements 4 n + 2 r + {0, 1}
                for k in cutlass.range_constexpr(cute.size(acc_O) // 2):
                    idx = 4 * (k // 2) + 2 * r + k % 2
                    acc_O[idx] = acc_O[idx] * correction[r]

            # O_w += P V_w (FP32: P times each entry's scale of the slice, then rounded once)
            if const_expr(self.fp32_scales):
                self._scale_columns(acc_S, sf)
            rP = cute.make_fragment_like(acc_S, BFloat16)
            rP.store(acc_S.load().to(BFloat16))
            tOrP = self._acc_as_a_operand(rP)
            for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                cute.copy(ldsm_t, tOsVt[None, None, k], tOrVt_v[None, None, k])
                cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrVt[None, None, k], acc_O)

        # ---- epilogue
        qd = lane % 4
        store_row = functools.partial(self._store_row, acc_O, wq, qd)
        self.quad_epilogue(p, row_sum, row_max, token, split, ghead0, lane // 4, qd, wq, store_row, sink_addr,
                           lse_part_addr, lse_addr)

    @cute.jit
    def _store_row(self, acc_O, wq, qd, r: int, gate: Float32, out_ctx):
        """Head row r of this thread's output columns times ``gate``: of n tile n, accumulators
        4 n + 2 r + {0, 1}, columns 8 n + 2 q + {0, 1} of the warp's slice."""
        for n in cutlass.range_constexpr(cute.size(acc_O) // 4):
            self.epilogue.store_out([acc_O[4 * n + 2 * r] * gate, acc_O[4 * n + 2 * r + 1] * gate],
                                    wq * self.wslice + 8 * n + 2 * qd, *out_ctx)

    @cute.jit
    def _load_scales(self, sf, stage_base, wq, qd):
        """FP32 scales: this warp's slice's scale of the thread's S columns (entries 8 j + 2 q + i
        at 2 j + i) from the raw rows of the stage."""
        for j in cutlass.range_constexpr(4):
            for i in cutlass.range_constexpr(2):
                sf[2 * j + i] = smem_scalar(Float32, stage_base + (8 * j + 2 * qd + i) * self.gather.row_pitch
                                            + self.fmt.scale_offset + 4 * wq)[0]

    @cute.jit
    def _scale_columns(self, acc_S, sf):
        """Each element of S [16, 32] (m16n8 C order: n tile j, element c at 4 j + c, column
        8 j + 2 q + c % 2) times its column's (entry's) scale."""
        for j in cutlass.range_constexpr(4):
            for c in cutlass.range_constexpr(4):
                acc_S[4 * j + c] = acc_S[4 * j + c] * sf[2 * j + c % 2]

    @cute.jit
    def _dequantize(self, ctx, stage: Int32):
        """Dequantize a landed raw stage into the bf16 KV tile [32, 512] (the value's columns).
        An invalid entry's row and scales arrived as zeros (``ChunkGather.issue_rows``), so it
        dequantizes to a row of 0 with no test."""
        fmt = self.fmt
        tXsKV, tXcKV = ctx.tXsKV, ctx.tXcKV
        stage_base = ctx.raw_base + stage * self.gather.stage_bytes
        for i in cutlass.range_constexpr(cute.size(tXsKV, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(tXsKV, mode=[2])):
                row = tXcKV[(0, 0), i, j][0]
                col = tXcKV[(0, 0), i, j][1]
                dst = tXsKV[None, i, j]
                if const_expr(fmt.nope_dims == D_V):
                    self._dequantize_nope(dst, stage_base, row, col)
                else:
                    if col < fmt.nope_dims:
                        self._dequantize_nope(dst, stage_base, row, col)
                    else:
                        self._copy_rope(dst, stage_base, row, col)

    @cute.jit
    def _dequantize_nope(self, dst, stage_base, row, col):
        """DEQUANT_VALUES e4m3 values of ``row`` from column ``col`` to bf16: UE8M0 times their
        scale (exact), FP32 alone (the scale comes after the MMA)."""
        fmt = self.fmt
        addr = stage_base + row * self.gather.row_pitch + col
        factor = None
        if const_expr(not self.fp32_scales):
            factor = ue8m0_scale(load_smem_u8(stage_base + self.gather.scale_start + row * self.gather.scale_pitch
                                              + col // fmt.scale_group))
        values = self._e4m3_values(addr)
        if const_expr(self.fp32_scales):
            dst.store(values.to(BFloat16))
        else:
            dst.store((values * factor).to(BFloat16))

    @cute.jit
    def _e4m3_values(self, addr):
        """The DEQUANT_VALUES e4m3 values at shared address ``addr`` (16-byte aligned) as f32:
        the DSL's conversion (the e4m3 conversion instruction), or, where the arch lacks it,
        4 bytes at a time as exact f16 pairs (``OperandConversion.e4m3x4_exact``), then f32."""
        if const_expr(self.conv.by_instruction):
            return cute.make_tensor(cute.make_ptr(Float8E4M3FN, addr, cute.AddressSpace.smem, assumed_align=16),
                                    cute.make_layout(DEQUANT_VALUES)).load().to(Float32)
        words = cute.make_rmem_tensor(DEQUANT_VALUES // 4, Int32)
        cute.autovec_copy(smem_vec(Int32, addr, DEQUANT_VALUES // 4), words)
        f32 = cute.make_rmem_tensor(DEQUANT_VALUES, Float32)
        for w in cutlass.range_constexpr(DEQUANT_VALUES // 4):
            pairs = self.conv.e4m3x4_exact(words[w])
            for h in cutlass.range_constexpr(2):
                f32[4 * w + 2 * h], f32[4 * w + 2 * h + 1] = f16x2_to_f32(pairs[h])
        return f32.load()

    @cute.jit
    def _copy_rope(self, dst, stage_base, row, col):
        """DEQUANT_VALUES bf16 rope values of ``row`` from (value) column ``col``, as stored."""
        fmt = self.fmt
        rope = cute.make_tensor(
            cute.make_ptr(BFloat16, stage_base + row * self.gather.row_pitch + fmt.rope_offset
                          + (col - fmt.nope_dims) * 2, cute.AddressSpace.smem, assumed_align=16),
            cute.make_layout(DEQUANT_VALUES),
        )
        dst.store(rope.load())

    @staticmethod
    def _acc_as_a_operand(rP: cute.Tensor) -> cute.Tensor:
        """Regroup an m16n8 accumulator ((2, 2), M, N) as the A operand ((2, 2, 2), M, N / 2) of m16n8k16."""
        div = cute.logical_divide(rP.layout, (None, None, 2))
        lay = cute.make_layout(
            ((div.shape[0], div.shape[2][0]), div.shape[1], div.shape[2][1]),
            stride=((div.stride[0], div.stride[2][0]), div.stride[1], div.stride[2][1]),
        )
        return cute.make_tensor(rP.iterator, lay)
