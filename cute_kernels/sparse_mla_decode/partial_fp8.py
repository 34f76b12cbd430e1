"""Split-K partial kernel, FP8 compute path (``PartialConfig.precision`` "fp8" or "mxf8";
archs with the e4m3 MMA, sm_89 and later, and for "mxf8" the block-scaled one: ``arch.Arch``).

Same work split, gather, S exchange, quad-form softmax and outputs as the "bf16" path
(``partial.py``, ``gather.py``, ``softmax.py``, ``epilogue.py``); what differs is the MMA step.
Nothing is dequantized: the tensor cores read the gathered cache rows in shared memory as they
are.

Per CTA (once): Q [heads, d_qk] is staged in shared memory; each head gets one power-of-two
scale sq = 2**ceil(log2(amax / 448)) over its nope dims, and every warp turns its part of Q
into e4m3 MMA operands as two terms, hi = e4m3(q / sq) and lo = e4m3(16 (q / sq - hi)), so
q / sq ~= hi + lo / 16 to about 8 significant bits (bf16's); the rope part of Q stays bf16,
divided by sq (exact), so every partial score is in units of sq and sq joins the softmax
scale of its row. The operands go back to shared memory (9 x 16 bytes per thread), read once
per chunk.

Per chunk, warp w of a group owns nope tiles w and w + 4 (64 columns each; MODEL1 has 7
tiles: its last warp has no second tile and computes zeros there) and rope columns
nope_dims + 16 w .. + 16, for QK and, where V has the rope dims, for the output:
- QK, nope tile: per 8-entry n tile one ``ldmatrix.x4`` of the raw rows is the e4m3 B
  fragment of two k32 steps; "fp8": lo terms, times 1/16, then hi terms (four e4m3
  ``mma.m16n8k32``), the partial added to S times the entry's K scale (UE8M0 2**(b - 127)
  or the FP32 value); "mxf8" (UE8M0 formats): the block-scaled MMA applies 2**-4 / 2**0 (A)
  and the entry's byte b (B) itself.
- QK, rope: bf16 ``mma.m16n8k16`` on the raw rows' bf16 rope bytes.
- S exchange and online softmax in the quad form (``softmax.py``).
- PV, nope tile: P (<= 1 after the running max) times s / R * 2**8, R the running maximum of
  the tile's scale over the valid entries of the split so far (so P' <= 256 < 448): UE8M0
  the power of two 2**(b - R + 8); FP32 (s / R) times 256 in f32 (R at least 2**-126, so the
  reciprocal is finite); rounded to e4m3; the value fragments are the raw rows read by
  ``ldmatrix.x4.trans`` (rows 2q, 2q+1 of 8-entry groups) regrouped by byte permutes into k
  order {2q, 2q+1, 8+2q, 9+2q} (+16): exactly the entries of P this thread holds in its S
  registers, so neither operand moves between threads. Output columns come out as even/odd
  pairs of 16-column blocks (each thread ends with 4 contiguous columns). When R grows, the
  tile's accumulator is rescaled with the softmax correction; the epilogue multiplies by
  R / 2**8.
- PV, rope (MODEL1): P in bf16 times the raw bf16 rope rows (``ldmatrix.trans``).
Invalid entries have zero rows (the gather zero-fills them) and probability 0.
The rounding is ``fp8_model``'s.

Measured (``docs/tuning.md``): the H200 (sm_90) has no e4m3 ``mma.sync``; ptxas lowers each
m16n8k32 e4m3 MMA to two f16 HMMA and unpacks, so there this path runs 57% more instructions
than "bf16" and is slower on every bench shape, and the 512-dim formats' kernel spills there
(the emulation's registers; none on sm_120a): its GPU tests check its arithmetic, not its
SM120 speed. Accuracy: out relative L2 error 0.7e-2 .. 2.1e-2 per token (P in e4m3), lse
f32-sized (``fp8_model`` models the rounding).
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, const_expr
from cutlass.memory import SmemAllocator

from .config import FP8_Q_REGS as Q_REGS
from .device_utils import smem_scalar as _smem_scalar, smem_vec as _smem_vec
from .kernel_args import KernelParams
from .kv_format import FP8_E4M3_MAX, NOPE_TILE as UNIT, UE8M0_BIAS
from .partial import PartialKernel
from .softmax import exchange_s, quad_online_softmax
from .tuning import FP8_QK_TILES_AT_ONCE as QK_TILES_AT_ONCE
from .warp_ops import (
    byte_perm, f32_bits, f32_from_bits, ldsm_x4, mma_bf16, mma_e4m3, mma_mxf8, pack_bf16x2, pack_e4m3x4, pow2_f32,
    quantize_two_terms, rcp_approx, ue8m0_scale, warp_max_u32,
)

P_HEADROOM_LOG2 = 8  # P' = P * 2**(b - R + 8) <= 256: inside e4m3's range, 8 binades above P
FLT_MIN_BITS = 0x00800000  # FP32 scales: R starts at (and never falls below) 2**-126, so 1 / R is finite


@cute.jit
def _load_regs(addr, n: int) -> list:
    """``n`` (4 or 8) Int32 registers from 16-byte groups at ``addr`` (groups 32 * 16 bytes apart)."""
    regs = []
    for k in cutlass.range_constexpr(n // 4):
        r = cute.make_rmem_tensor(4, Int32)
        cute.autovec_copy(_smem_vec(Int32, addr + k * 32 * 16, 4), r)
        regs += [r[0], r[1], r[2], r[3]]
    return regs


@cute.jit
def _scale_exponent(amax: Float32) -> Int32:
    """E = ceil(log2(amax / 448)) from the bits of amax / 448 (exact, unlike a log2), 0 for
    amax = 0, clamped to the normal range [-126, 127]."""
    bits = f32_bits(amax / FP8_E4M3_MAX)
    e = ((bits >> 23) & 0xFF) - 127
    if bits & 0x7FFFFF != 0:
        e = e + 1
    if bits == 0:
        e = Int32(0)
    return cutlass.min(cutlass.max(e, -126), 127)


class PartialFp8Kernel(PartialKernel):
    """The FP8-path partial kernel for one ``PartialConfig`` (precision "fp8" or "mxf8")."""

    PATHS = ("fp8", "mxf8")  # the compute paths (``PartialConfig.precision``) this class generates

    def __init__(self, cfg, arch):
        super().__init__(cfg, arch)
        self.wpg = cfg.warps_per_group
        fmt = self.fmt
        # warp wq of a group: nope tiles wq and wq + wpg, the rope dims' k16 step wq
        assert self.wpg < fmt.nope_tiles <= 2 * self.wpg and fmt.rope_dims in (0, 16 * self.wpg)
        self.fp32_scales = fmt.fp32_scales
        self.rope_cols = 8 if fmt.rope_in_v else 0  # output columns of the rope dims per thread

    def kernel_operands(self) -> tuple:
        return (self.tile_layout(self.hb, self.cfg.q_cols), self.bf16_tiled_mma(),
                self.tiled_store(8, self.cfg.q_cols))

    @cute.kernel
    def kernel(self, p: KernelParams, q_layout: cute.ComposedLayout, tiled_mma: cute.TiledMma,
               tiled_store: cute.TiledCopy):
        bn, hb, hg, fmt = self.bn, self.hb, self.hg, self.fmt
        tidx, token, head_block, split = self.epilogue.start(p.num_heads)
        warp_id = tidx // 32
        lane = tidx % 32
        g = lane // 4
        qd = lane % 4
        group = warp_id // self.wpg
        wq = warp_id % self.wpg
        head0 = head_block * hb
        ghead0 = head0 + group * hg
        # nope tiles of this warp: wq and wq + 4; with 7 tiles (MODEL1) the last warp has no
        # second tile and runs its unit 1 on tile 0 with Q operands of 0 (an exact 0
        # contribution: tile 0 holds finite FP8 values and scales), its output never stored
        tile1 = wq + self.wpg
        keep1 = Float32(1.0)
        has_unit1 = Int32(1)
        if const_expr(fmt.nope_tiles < 2 * self.wpg):
            has_unit1 = Int32(wq + self.wpg < fmt.nope_tiles)
            if has_unit1 == 0:
                tile1 = Int32(0)
                keep1 = Float32(0.0)

        # ---- shared memory: Q (bf16, then, after a barrier, every thread's Q operands in the
        # same bytes) and its per-head scales, then the gather's
        alloc = self.smem_plan.allocator(SmemAllocator())
        sQbuf = alloc.allocate("q", Uint8, cute.make_layout(self.cfg.q_region_bytes))
        sQ = cute.make_tensor(cute.recast_ptr(sQbuf.iterator, dtype=BFloat16), q_layout)
        sQexp = alloc.allocate("q_exponents", Int32, cute.make_layout(hb))  # per-head log2(sq)
        q_base = sQbuf.iterator.toint()
        ctx = self.gather.context(alloc, self.quad_s_exchange_layout(), tidx, token, split, p)
        sMask, sS, raw_base = ctx.sMask, ctx.sS, ctx.raw_base
        self.gather.issue_first_indices(ctx, ctx.c_begin)  # before Q: the first rows wait for them
        # the epilogue's addresses, taken at the top level (see ChunkGather.context)
        sink_addr, lse_part_addr, lse_addr = p.attn_sink.toint(), p.lse_part.toint(), p.lse.toint()
        sm_scale_log2 = p.sm_scale_log2
        self.stage_q(p, token, head0, sQ, tiled_store, tidx)
        self.gather.wait_first_indices()  # (and Q's copies, where they are cp.async)
        c_begin, c_end = self.gather.bound_chunks(ctx)  # the lengths' first use: after the wait
        self.gather.start_pipeline(ctx, c_begin, c_end)

        # ---- per-head Q scale: 8 threads per head, each the max of an eighth of the nope dims
        qh = tidx // 8
        amax = Float32(0.0)
        for i in cutlass.range_constexpr(fmt.nope_dims // 8):
            amax = cute.arch.fmax(amax, abs(sQ[qh, i * 8 + tidx % 8].to(Float32)))
        for off in (4, 2, 1):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off, mask=-1, mask_and_clamp=31))
        if tidx % 8 == 0:
            sQexp[qh] = _scale_exponent(amax)
        cute.arch.sync_threads()

        # ---- this thread's Q operands: nope unit u (tile wq, tile1): hi and lo terms of two
        # k32 steps (16 registers); rope: k16 step wq of the rope dims (4 registers). Every
        # warp runs the same code (MODEL1's last warp's unit 1 computes zeros): ptxas
        # predicated warp-dependent branches of this size into every warp's instruction stream.
        rows = [group * hg + g, group * hg + g + 8]  # CTA-local heads of this thread's rows
        row_exp = [sQexp[rows[0]], sQexp[rows[1]]]
        inv_sq = [pow2_f32(-row_exp[i]) for i in range(2)]
        row_scale = [sm_scale_log2 * pow2_f32(row_exp[i]) for i in range(2)]
        rQ = cute.make_rmem_tensor(Q_REGS, Int32)
        self._load_q_unit(sQ, rQ, 0, wq * UNIT, rows, inv_sq, qd)
        self._load_q_unit(sQ, rQ, 1, tile1 * UNIT, rows, [inv_sq[0] * keep1, inv_sq[1] * keep1], qd)
        if const_expr(fmt.rope_dims > 0):
            q_rope = self.load_q_rope(sQ, wq, rows, inv_sq, qd)
            for a in cutlass.range_constexpr(4):
                rQ[32 + a] = q_rope[a]
        # The operands go back to shared memory, over the bf16 Q, as 16-byte groups (group k
        # of a thread at ((warp * 9 + k) * 32 + lane) * 16: conflict-free): held in registers
        # across the loop they pushed the kernel past 255 registers into spills.
        q_frag = q_base + warp_id * (Q_REGS // 4 * 32 * 16) + lane * 16
        cute.arch.sync_threads()  # every thread has read the bf16 Q
        for k in cutlass.range_constexpr(Q_REGS // 4):
            dst = _smem_vec(Int32, q_frag + k * 32 * 16, 4)
            for i in cutlass.range_constexpr(4):
                dst[i] = rQ[4 * k + i]

        # ---- per-thread state
        acc_O = cute.make_rmem_tensor(64 + self.rope_cols, Float32)  # nope unit u: [32 u, 32 u + 32); rope: [64, 72)
        acc_O.fill(0.0)
        row_max = cute.make_rmem_tensor(2, Float32)
        row_sum = cute.make_rmem_tensor(2, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        # R per unit: the running maximum of the unit's value scale over the split's valid
        # entries so far: UE8M0, the scale byte; FP32, the scale's bits (a positive float's
        # bits order as it does), at least 2**-126
        r_run = cute.make_rmem_tensor(2, Int32)
        r_run.fill(FLT_MIN_BITS if self.fp32_scales else 0)
        # the scales of this thread's entries (n tile j, column i at 2 j + i): UE8M0, unit 0's
        # byte in bits 0-7, unit 1's in bits 8-15; FP32, unit u's scale at 8 u + 2 j + i
        sbytes = cute.make_rmem_tensor(8, Int32)
        sf = cute.make_rmem_tensor(16 if self.fp32_scales else 1, Float32)
        pv_unit = cute.make_rmem_tensor(2, Float32)  # FP32: 1 / R per unit (P' = P * (s / R) * 256)
        pick = wq | (tile1 << 4)  # byte_perm selector: the scale bytes of tiles wq and tile1 of a record
        # FP32: the byte offset of unit u's scale in a row
        scale_at = [fmt.scale_offset + 4 * ((t * UNIT) // fmt.scale_group) for t in (wq, tile1)]
        thr_mma = tiled_mma.get_slice(lane)
        # S [16, 32] in m16n8 C order ((2, 2), 1, 4): flat index 4 j + c for n tile j, element c
        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((hg, bn)), Float32)
        tSsS = [thr_mma.partition_C(sS[None, None, w, group]) for w in range(self.wpg)]
        tScS = thr_mma.partition_C(cute.make_identity_tensor((hg, bn)))
        pitch = self.gather.row_pitch

        for c in cutlass.range(c_begin, c_end, 1, unroll=1):
            step = c - c_begin
            stage = step % self.stages
            buf = step % self.slots
            self.gather.next_chunk(ctx, c, c_end, step)
            valid_rows = sMask[buf]
            stage_base = raw_base + stage * self.gather.stage_bytes
            scale_base = stage_base + self.gather.scale_off

            # the scales of this warp's two tiles: per thread for its 8 entries; per lane for
            # entry `lane`, masked by validity, for the running maximum R of each tile
            ratio = [Float32(1.0), Float32(1.0)]
            bscale = [Int32(0)] * 4
            if const_expr(self.fp32_scales):
                for u in cutlass.range_constexpr(2):
                    for j in cutlass.range_constexpr(4):
                        for i in cutlass.range_constexpr(2):
                            sf[8 * u + 2 * j + i] = _smem_scalar(
                                Float32, stage_base + (8 * j + 2 * qd + i) * pitch + scale_at[u])[0]
                    mine = f32_bits(_smem_scalar(Float32, stage_base + lane * pitch + scale_at[u])[0])
                    if (valid_rows >> lane) & 1 == 0:
                        mine = Int32(0)
                    r_new = cutlass.max(r_run[u], warp_max_u32(mine))
                    inv = rcp_approx(f32_from_bits(r_new))
                    ratio[u] = f32_from_bits(r_run[u]) * inv
                    pv_unit[u] = inv
                    r_run[u] = r_new
            else:
                for j in cutlass.range_constexpr(4):
                    for i in cutlass.range_constexpr(2):
                        sbytes[2 * j + i] = self._scale_pair(scale_base + (8 * j + 2 * qd + i) * fmt.footer_bytes,
                                                             pick)
                mine = self._scale_pair(scale_base + lane * fmt.footer_bytes, pick)
                if const_expr(self.cfg.precision == "mxf8"):  # B scale factors: entry 8 j + g's bytes
                    bscale = [self._scale_pair(scale_base + (8 * j + g) * fmt.footer_bytes, pick) for j in range(4)]
                if (valid_rows >> lane) & 1 == 0:
                    mine = Int32(0)
                for u in cutlass.range_constexpr(2):
                    r_new = cutlass.max(r_run[u], warp_max_u32((mine >> (8 * u)) & 0xFF))
                    ratio[u] = pow2_f32(r_run[u] - r_new)
                    r_run[u] = r_new

            # S_w = Q_w K_w^T over this warp's columns (two nope tiles, 16 rope dims)
            acc_S.fill(0.0)
            for u in cutlass.range_constexpr(2):
                self._qk_nope(acc_S, q_frag, sbytes, sf, bscale, u, stage_base + (wq if u == 0 else tile1) * UNIT,
                              lane)
            if const_expr(fmt.rope_dims > 0):
                self.qk_rope(acc_S, _load_regs(q_frag + 8 * 32 * 16, 4), stage_base, wq, lane)

            # the group's full S in every warp; the online softmax (row r's scores times
            # sm_scale * log2(e) * sq); the accumulators rescaled
            exchange_s(acc_S, tSsS, wq, group, self.wpg, self.groups)
            correction = quad_online_softmax(acc_S, tScS, valid_rows, row_scale, row_max, row_sum)
            for u in cutlass.range_constexpr(3 if self.rope_cols else 2):  # nope units 0, 1, then the rope columns
                for r in cutlass.range_constexpr(2):
                    f = correction[r]
                    if const_expr(u < 2):
                        f = f * ratio[u]
                    for k in cutlass.range_constexpr(16 if u < 2 else 4):
                        idx = 32 * u + 4 * (k // 2) + 2 * r + k % 2
                        acc_O[idx] = acc_O[idx] * f

            # O_w += P V_w
            for u in cutlass.range_constexpr(2):
                self._pv_nope(acc_O, acc_S, sbytes, sf, r_run, pv_unit, u,
                              stage_base + (wq if u == 0 else tile1) * UNIT, lane)
            if const_expr(self.rope_cols > 0):
                self._pv_rope(acc_O, acc_S, stage_base + fmt.rope_offset + wq * 32, lane)

        # ---- epilogue: nope units times R / 256 (the value scales were folded into P relative
        # to R, with 8 binades of headroom); the rope columns as accumulated. Row r of a nope
        # unit: column 16 blk + 4 q + k is accumulator 32 u + 8 blk + 4 (k % 2) + 2 r + k // 2
        # (even / odd column MMAs); of the rope: column 8 n + 2 q + i is 64 + 4 n + 2 r + i
        if const_expr(self.fp32_scales):
            scale = [f32_from_bits(r_run[u]) * (1.0 / (1 << P_HEADROOM_LOG2)) for u in range(2)]
        else:
            scale = [ue8m0_scale(r_run[u]) * (1.0 / (1 << P_HEADROOM_LOG2)) for u in range(2)]

        store_row = functools.partial(self._store_row, acc_O, scale, has_unit1, wq, qd)
        self.quad_epilogue(p, row_sum, row_max, token, split, ghead0, g, qd, wq, store_row, sink_addr,
                           lse_part_addr, lse_addr)

    @cute.jit
    def _store_row(self, acc_O, scale, has_unit1, wq, qd, r: int, gate: Float32, out_ctx):
        """Head row r of this thread's output columns: its nope units times ``gate * scale[u]``
        (unit 1 only where the warp has a second tile), its rope columns (where V has them)
        times ``gate``."""
        for u in cutlass.range_constexpr(2):
            f = gate * scale[u]
            for blk in cutlass.range_constexpr(4):
                vals = [acc_O[32 * u + 8 * blk + 4 * (k % 2) + 2 * r + k // 2] * f for k in range(4)]
                col = (wq + u * self.wpg) * UNIT + 16 * blk + 4 * qd
                if const_expr(u == 0 or self.fmt.nope_tiles == 2 * self.wpg):
                    self.epilogue.store_out(vals, col, *out_ctx)
                else:
                    if has_unit1 != 0:
                        self.epilogue.store_out(vals, col, *out_ctx)
        if const_expr(self.rope_cols > 0):
            for n in cutlass.range_constexpr(2):
                self.epilogue.store_out([acc_O[64 + 4 * n + 2 * r + i] * gate for i in range(2)],
                                        self.fmt.nope_dims + wq * 16 + 8 * n + 2 * qd, *out_ctx)

    # ------------------------------------------------------------------ setup pieces
    @cute.jit
    def _load_q_unit(self, sQ, rQ, u: int, col0, rows, inv_sq, qd):
        """Q operands of nope unit u (columns col0..col0+63): the A fragment (a0..a3) of k32
        step s at 16 u + 4 s (hi term) and 16 u + 8 + 4 s (lo term)."""
        for s in cutlass.range_constexpr(2):
            for a in cutlass.range_constexpr(4):
                r = a % 2
                c = col0 + 32 * s + 16 * (a // 2) + 4 * qd
                x = [sQ[rows[r], c + k].to(Float32) * inv_sq[r] for k in range(4)]
                hi, lo = quantize_two_terms(x[0], x[1], x[2], x[3])
                rQ[16 * u + 4 * s + a] = hi
                rQ[16 * u + 8 + 4 * s + a] = lo

    @cute.jit
    def _scale_pair(self, record_addr, pick) -> Int32:
        """UE8M0: bytes wq and wq + 4 of an entry's 8-byte scale record (its two tiles of this warp)."""
        rec = cute.make_rmem_tensor(2, Int32)
        cute.autovec_copy(_smem_vec(Int32, record_addr, 2), rec)
        return byte_perm(rec[0], rec[1], pick)

    @cute.jit
    def _entry_scale(self, sbytes, sf, u: int, k: int) -> Float32:
        """Unit u's value scale of this thread's entry k (n tile k // 2, column k % 2)."""
        if const_expr(self.fp32_scales):
            return sf[8 * u + k]
        return ue8m0_scale((sbytes[k] >> (8 * u)) & 0xFF)

    # ------------------------------------------------------------------ per-chunk MMA steps
    @cute.jit
    def _qk_nope(self, acc_S, q_frag, sbytes, sf, bscale, u: int, unit_base, lane):
        """acc_S += (Q_u K_u^T) per entry times its K scale, for a nope unit at ``unit_base``
        (its first column in the stage); the Q operands of unit u are groups 4 u.. at ``q_frag``.

        "fp8": the scales in registers (the lo terms' 1/16, then the entry's scale: UE8M0
        2**(b - 127) or the FP32 value). "mxf8" (UE8M0 only): the block-scaled MMA applies
        them: A scale 2**0 (hi) or 2**-4 (lo) for every row, B scale byte b of column (entry)
        g from ``bscale[j]`` (byte 8 u of the lanes of quad column 0), accumulating straight
        into S."""
        pitch = self.gather.row_pitch
        qr = _load_regs(q_frag + 4 * u * 32 * 16, 16)  # hi: qr[0:8], lo: qr[8:16]
        row_addr = unit_base + (lane % 8) * pitch + (lane // 8) * 16
        # n tiles two at a time: one at a time, ptxas issued each tile's 4 MMAs back to back,
        # each waiting on the one before (``LoopMix.chained_mma``); two interleaved chains
        # leave none waiting, with every output element's order of operations unchanged
        for j0 in cutlass.range_constexpr(0, 4, QK_TILES_AT_ONCE):
            js = range(j0, j0 + QK_TILES_AT_ONCE)
            kb = {j: ldsm_x4(row_addr + 8 * j * pitch, trans=False) for j in js}  # k32 steps 0, 1: [0:2], [2:4]
            if const_expr(self.cfg.precision == "mxf8"):
                d = {j: [acc_S[4 * j + k] for k in range(4)] for j in js}
                sfb = {j: bscale[j] >> (8 * u) for j in js}
                for s in cutlass.range_constexpr(2):
                    for j in js:
                        d[j] = mma_mxf8(d[j], qr[8 + 4 * s:12 + 4 * s], kb[j][2 * s:2 * s + 2], Int32(UE8M0_BIAS - 4),
                                        sfb[j])
                for s in cutlass.range_constexpr(2):
                    for j in js:
                        d[j] = mma_mxf8(d[j], qr[4 * s:4 * s + 4], kb[j][2 * s:2 * s + 2], Int32(UE8M0_BIAS), sfb[j])
                for j in js:
                    for k in cutlass.range_constexpr(4):
                        acc_S[4 * j + k] = d[j][k]
            else:
                t = {j: [Float32(0.0)] * 4 for j in js}
                for s in cutlass.range_constexpr(2):
                    for j in js:
                        t[j] = mma_e4m3(t[j], qr[8 + 4 * s:12 + 4 * s], kb[j][2 * s:2 * s + 2])
                for j in js:
                    t[j] = [x * (1.0 / 16.0) for x in t[j]]
                for s in cutlass.range_constexpr(2):
                    for j in js:
                        t[j] = mma_e4m3(t[j], qr[4 * s:4 * s + 4], kb[j][2 * s:2 * s + 2])
                for j in js:
                    kfac = [self._entry_scale(sbytes, sf, u, 2 * j + i) for i in range(2)]
                    for k in cutlass.range_constexpr(4):
                        acc_S[4 * j + k] = acc_S[4 * j + k] + t[j][k] * kfac[k % 2]

    @cute.jit
    def _pv_nope(self, acc_O, acc_S, sbytes, sf, r_run, pv_unit, u: int, unit_base, lane):
        """acc_O[unit u] += P' V8 for a nope unit: P' = P * s / R * 2**8 in e4m3 (UE8M0: the
        power of two 2**(b - R + 8); FP32: (s times ``pv_unit[u]`` = 1 / R, at most 1) times 256:
        256 / R itself overflows for R near 2**-126).
        Accumulator index 32 u + 8 blk + 4 parity + c: 16-column block blk, even/odd columns."""
        if const_expr(self.fp32_scales):
            fac = [(sf[8 * u + k] * pv_unit[u]) * float(1 << P_HEADROOM_LOG2) for k in range(8)]
        else:
            fac = [pow2_f32(((sbytes[k] >> (8 * u)) & 0xFF) - r_run[u] + P_HEADROOM_LOG2) for k in range(8)]
        pq = [acc_S[4 * j + c] * fac[2 * j + c % 2] for j in range(4) for c in range(4)]
        a = [
            pack_e4m3x4(pq[0], pq[1], pq[4], pq[5]),  # row g: entries 2q, 2q+1, 8+2q, 9+2q
            pack_e4m3x4(pq[2], pq[3], pq[6], pq[7]),  # row g+8
            pack_e4m3x4(pq[8], pq[9], pq[12], pq[13]),  # row g: the same + 16
            pack_e4m3x4(pq[10], pq[11], pq[14], pq[15]),  # row g+8
        ]
        row_addr = unit_base + lane * self.gather.row_pitch
        for blk in cutlass.range_constexpr(4):
            v = ldsm_x4(row_addr + 16 * blk, trans=True)  # entries 0-7, 8-15, 16-23, 24-31
            for parity in cutlass.range_constexpr(2):
                sel = 0x7531 if parity else 0x6420
                b = [byte_perm(v[0], v[1], sel), byte_perm(v[2], v[3], sel)]
                base = 32 * u + 8 * blk + 4 * parity
                d = mma_e4m3([acc_O[base + k] for k in range(4)], a, b)
                for k in cutlass.range_constexpr(4):
                    acc_O[base + k] = d[k]

    @cute.jit
    def _pv_rope(self, acc_O, acc_S, rope_base, lane):
        """acc_O[64:72] += P V over this warp's 16 rope columns (bf16): n tile n at 64 + 4 n."""
        a = []
        for s in cutlass.range_constexpr(2):  # k16 step: entries 16 s .. 16 s + 15 = n tiles 2 s, 2 s + 1
            a.append([
                pack_bf16x2(acc_S[8 * s + 0], acc_S[8 * s + 1]),
                pack_bf16x2(acc_S[8 * s + 2], acc_S[8 * s + 3]),
                pack_bf16x2(acc_S[8 * s + 4], acc_S[8 * s + 5]),
                pack_bf16x2(acc_S[8 * s + 6], acc_S[8 * s + 7]),
            ])
        row_addr = rope_base + lane * self.gather.row_pitch
        for n in cutlass.range_constexpr(2):
            v = ldsm_x4(row_addr + 16 * n, trans=True)  # entries 0-7, 8-15 (step 0), 16-23, 24-31 (step 1)
            d = [acc_O[64 + 4 * n + k] for k in range(4)]
            for s in cutlass.range_constexpr(2):
                d = mma_bf16(d, a[s], v[2 * s:2 * s + 2])
            for k in cutlass.range_constexpr(4):
                acc_O[64 + 4 * n + k] = d[k]
