"""Split-K partial kernel, "f16" path (``PartialConfig.precision == "f16"``, the default):
column-sliced warps, e4m3 (or e2m1) converted to f16 in registers, the scales on S and P, the
softmax spread over the CTA.

Work split, gather (``gather.py``) and outputs (``epilogue.py``) as every partial kernel. A CTA
covers 16 or 32 heads (``head_groups`` m16 tiles) with a warp per 64-dim nope tile of the
format (``KvFormat.nope_tiles``) and one more, the "rope warp". Warp w owns 64 columns of the
QK width and of the output for every head of the CTA: each gathered byte becomes an MMA
operand in exactly one warp, once for QK and once for PV, and a 32-head CTA multiplies each
operand register into both m16 tiles. Nothing is dequantized into shared memory. The rope
warp also issues the main loop's gather.

Per chunk of 32 entries: QK in each warp (``ldmatrix`` of the raw rows, ``cvt`` to f16, f16
MMAs, each entry's scale applied in f32); the partial S of every warp to shared memory; the
softmax over the first 256 threads (``softmax.SpreadSoftmax``); PV with P' = P s / R_w in f16
(R_w the running maximum of the tile's scale) times the value fragments (``ldmatrix.trans``,
a byte permute, ``cvt``). Where the arch has no e4m3 conversion instruction (sm_80, sm_86)
integer operations and byte permutes make the same f16 operands, the values times 2**-8
(``warp_ops.OperandConversion``), which the softmax's unit and the outputs take back. Three
CTA barriers per chunk (four when a head's max moved). The
formats' variants (UE8M0 per 32 dims: two scale groups per tile; FP32 scales: folded into P
per scale group; e2m1: the scales in the value operands) are this class's branches on
compile-time format facts.

``docs/design.md`` ("Compute path "f16"") has the fragment layouts, the precision argument
and the shared-memory map; ``docs/tuning.md`` every measured choice (tiles at once, stages,
late indices, what was tried and not kept); ``docs/performance.md`` ("Where the time goes")
what bounds the many-head calls.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, const_expr
from cutlass.memory import SmemAllocator

from . import tuning
from .config import F16_P_ROW_BYTES, F16_S_ROW, F16_SOFTMAX_THREADS
from .device_utils import load_smem_u8, smem_scalar as _smem_scalar, smem_vec as _smem_vec
from .kernel_args import KernelParams
from .kv_format import NOPE_TILE as UNIT
from .epilogue import quad_allreduce
from .partial import PartialKernel
from .softmax import SpreadSoftmax
from .warp_ops import (
    byte_perm, f32_bits, f32_from_bits, ldsm_x4, mma_bf16, mma_f16, mul_f16x2, pack_f16x2,
    pow2_f32, pow2_f32_bits, rcp_approx, ue8m0_scale, warp_max_u32,
)

Q_F16_EXP = 14  # Q's nope dims times 2**(14 - E): the head's largest lands in [2**14, 2**15)
FLT_MIN_BITS = 0x00800000  # FP32 scales: R starts at (and never falls below) 2**-126, so 1 / R is finite
# prmt selector turning ldmatrix.trans bytes (row 2q: c, c+1; row 2q+1: c, c+1) into
# (row 2q, row 2q+1) pairs of column c, then of column c + 1
PAIR_COLUMNS = 0x3120


class PartialF16Kernel(PartialKernel):
    """The "f16"-path partial kernel for one ``PartialConfig``."""

    PATHS = ("f16",)  # the compute paths (``PartialConfig.precision``) this class generates

    def __init__(self, cfg, arch):
        fmt = cfg.fmt
        # warps 0 .. nope_tiles - 1: a nope tile each; the next, the "rope warp": the rope dims
        # (where the format has them) and the main loop's gather, with its indices
        self.rope_warp = fmt.nope_tiles
        self.INDEX_THREAD0 = self.rope_warp * 32
        # MODEL1: 7 nope warps and the rope warp share the softmax; formats with 8 nope
        # warps: they alone, and the rope warp only keeps the softmax's barriers
        self.rope_in_softmax = 32 * (fmt.nope_tiles + 1) == F16_SOFTMAX_THREADS
        assert self.rope_in_softmax or 32 * fmt.nope_tiles == F16_SOFTMAX_THREADS
        assert fmt.rope_dims in (0, UNIT) and (fmt.rope_dims > 0 or not fmt.rope_in_v)
        assert not self.rope_in_softmax or (fmt.rope_in_v and not fmt.fp32_scales)
        self.fp32_scales = fmt.fp32_scales
        self.e2m1 = fmt.e2m1
        # UE8M0 scales per nope tile (MODEL1: 1; DeepSeek-V4.1's per 32 dims: 2, k16 steps 0-1
        # and 2-3 of QK, value columns 0-31 and 32-63): a running maximum R and an accumulator
        # unit each; the other formats keep one (FP32: the tile's group; e2m1: none needed)
        self.tile_r = fmt.tile_scales if fmt.scale_type == "ue8m0" else 1
        # where the rope warp issues the indices of a later chunk: with the late rows, stages
        # + 1 chunks ahead (one cp.async group per chunk), or after the chunk-head barrier,
        # stages ahead (their own group); with stages + 1 buffers a late issue in chunk c
        # writes chunk c's index buffer (its indices were located at chunk c - stages + 1)
        self.late_indices = tuning.f16_late_indices(cfg.head_groups, cfg.two_ctas_per_sm)
        # (``self.conv``: e4m3 / e2m1 bytes to f16 operands; by integer operations on sm_80 and
        # sm_86 the operands are the values x 2**-8 / 2**-14, which the softmax's nope unit and
        # the outputs' units take back)
        super().__init__(cfg, arch, index_chunks=cfg.stages + int(self.late_indices))
        # 8-entry row groups of the next chunk the rope warp issues right after the chunk-head
        # barrier; the rest after the softmax
        self.early_row_groups = tuning.EARLY_ROW_GROUPS[cfg.head_groups]
        self.softmax = SpreadSoftmax(cfg)
        self.qk_tiles_at_once = (tuning.F16_QK_TILES_AT_ONCE[cfg.head_groups, cfg.two_ctas_per_sm] if self.tile_r == 1
                                 else tuning.F16_QK_TILES_AT_ONCE_TWO_SCALES[cfg.head_groups])
        # e2m1: one ldmatrix.x4 gives two n tiles (``_e2m1_qk_fragments``)
        assert not self.e2m1 or self.qk_tiles_at_once % 2 == 0
        self.rope_qk_tiles_at_once = tuning.F16_ROPE_QK_TILES_AT_ONCE[cfg.head_groups, cfg.two_ctas_per_sm]

    @cute.kernel
    def kernel(self, p: KernelParams):
        hb, mt = self.hb, self.groups
        tidx, token, head_block, split = self.epilogue.start(p.num_heads)
        warp_id = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        g = lane // 4
        qd = lane % 4
        head0 = head_block * hb

        fmt = self.fmt
        alloc = self.smem_plan.allocator(SmemAllocator())
        if const_expr(self.fp32_scales):  # P per scale group (``SpreadSoftmax``), the groups' R
            sP16 = alloc.allocate("p_f16", Uint8, cute.make_layout(fmt.num_scales * hb * F16_P_ROW_BYTES))
            sPbf = sP16
            sRmax = alloc.allocate("scale_max", Float32, cute.make_layout(fmt.nope_tiles))
        else:
            sP16 = alloc.allocate("p_f16", Uint8, cute.make_layout(hb * F16_P_ROW_BYTES))
            sPbf = alloc.allocate("p_bf16", Uint8, cute.make_layout(hb * F16_P_ROW_BYTES))
            sRmax = sP16
        sCorr = alloc.allocate("corrections", Float32, cute.make_layout(hb))
        sGate = alloc.allocate("gates", Float32, cute.make_layout(hb))
        sAmax = alloc.allocate("q_amax", Int32, cute.make_layout((hb, self.nthr // 32), stride=(1, hb)))
        # each warp's partial S for all heads of the CTA: [warp][head][F16_S_ROW] f32
        ctx = self.gather.context(alloc, cute.make_layout(self.cfg.s_partials * hb * F16_S_ROW), tidx, token, split,
                                  p)
        self.gather.issue_first_indices(ctx, ctx.c_begin)  # before Q: the first rows wait for them
        # addresses taken at the top level (see ChunkGather.context)
        out = SimpleNamespace(o_part=p.o_part.toint(), out=p.out.toint(), out_stride_t=p.out_stride_t,
                              out_stride_h=p.out_stride_h, lse_part=p.lse_part.toint(), lse=p.lse.toint(),
                              lse_stride_t=p.lse_stride_t, lse_stride_h=p.lse_stride_h,
                              attn_sink=p.attn_sink.toint(), num_heads=p.num_heads, num_splits=p.num_splits,
                              token=token, split=split, head0=head0)
        bases = SimpleNamespace(p16=sP16.iterator.toint(), pbf=sPbf.iterator.toint(), s=ctx.sS.iterator.toint(),
                                corr=sCorr.iterator.toint(), gate=sGate.iterator.toint(),
                                scale_max=sRmax.iterator.toint())

        # ---- Q: every warp loads its 64 columns as bf16 pairs; pair A / B of (m tile, row
        # half r, k16 step i) are the columns of A registers a0/a1 and a2/a3: nope warps
        # 4q, 4q+1 / 4q+2, 4q+3 (the order of the e4m3 bytes ldmatrix gives), the rope warp
        # 2q, 2q+1 / 8+2q, 9+2q (bf16's own order)
        # (e2m1 nope warps: columns 8q + 4h + {0, 1} / 8q + 4h + {2, 3} of k16 steps 2p + h, 32p
        # further on, which ``_nope_role`` regroups into (8q + 4h, 8q + 4h + 2) and (+1, +3))
        # column of pair A / B of k16 step i: 32 (i // 2) + step_odd (i % 2) + off_a / off_b
        qraw = cute.make_rmem_tensor(mt * 16, Int32)  # index ((m * 4 + i) * 2 + r) * 2 + pair
        off_a = 4 * qd
        off_b = 4 * qd + 2
        step_odd = Int32(16)
        if const_expr(self.e2m1):
            off_a = 8 * qd
            off_b = 8 * qd + 2
            step_odd = Int32(4)
        if warp_id == self.rope_warp:
            off_a = 2 * qd
            off_b = 2 * qd + 8
            step_odd = Int32(16)
        # the warps with Q columns: the nope warps, and the rope warp where there are rope dims
        q_warps = fmt.nope_tiles + (1 if fmt.rope_dims else 0)
        for m in cutlass.range_constexpr(mt):
            for r in cutlass.range_constexpr(2):
                head = head0 + 16 * m + g + 8 * r
                row = p.q.toint() + (Int64(token) * p.q_stride_t + Int64(head) * p.q_stride_h + warp_id * UNIT) * 2
                for i in cutlass.range_constexpr(4):
                    for pair in cutlass.range_constexpr(2):
                        col = 32 * (i // 2) + (i % 2) * step_odd + (off_a if pair == 0 else off_b)
                        v = Int32(0)
                        present = head < p.num_heads
                        if const_expr(q_warps < self.nthr // 32):
                            present = present & (warp_id < q_warps)
                        if present:
                            v = cute.make_tensor(cute.make_ptr(Int32, row + Int64(col) * 2, cute.AddressSpace.gmem,
                                                               assumed_align=4), cute.make_layout(1))[0]
                        qraw[((m * 4 + i) * 2 + r) * 2 + pair] = v

        self.gather.wait_first_indices()  # (and Q's copies, where they are cp.async)
        c_begin, c_end = self.gather.bound_chunks(ctx)  # the lengths' first use: after the wait
        self.gather.start_pipeline(ctx, c_begin, c_end)

        # per-head largest |q| of each warp's columns (as f32 bits), for the f16 scale of Q
        for m in cutlass.range_constexpr(mt):
            for r in cutlass.range_constexpr(2):
                amax = Int32(0)
                for i in cutlass.range_constexpr(4):
                    for pair in cutlass.range_constexpr(2):
                        v = qraw[((m * 4 + i) * 2 + r) * 2 + pair]
                        amax = cutlass.max(amax, cutlass.max((v << 16) & 0x7FFFFFFF, v & 0x7FFF0000))
                amax = quad_allreduce(amax, cutlass.max)
                if qd == 0:
                    sAmax[16 * m + g + 8 * r, warp_id] = amax
        cute.arch.sync_threads()

        sm_scale_log2 = p.sm_scale_log2
        if warp_id < self.rope_warp:
            self._nope_role(ctx, bases, out, qraw, sAmax, warp_id, lane, tidx, sm_scale_log2, c_begin, c_end)
        else:
            self._rope_role(ctx, bases, out, qraw, sAmax, lane, tidx, sm_scale_log2, c_begin, c_end)

    # ------------------------------------------------------------------ the rope warp's gather
    @cute.jit
    def _start_next_chunk(self, ctx, c: Int32, c_end: Int32, step: Int32, lane: Int32):
        """The rope warp's first part of the per-chunk gather: without ``late_indices`` chunk
        c + stages's indices (their own cp.async group); chunk c + stages - 1 located and its
        first ``early_row_groups`` groups of rows (and the scales) started. Returns the
        location for ``ChunkGather.copy_rows`` of the other groups. (Located even past c_end: into a
        mask buffer no chunk in use reads; nothing is copied for it.)"""
        ahead = self.stages - 1
        if const_expr(not self.late_indices):
            if c + ahead + 1 < c_end:
                self.gather.issue_indices(ctx, c + ahead + 1, (step + ahead + 1) % self.slots)
            cute.arch.cp_async_commit_group()
        stage = (step + ahead) % self.stages
        located = self.gather.locate_rows(ctx, c + ahead, (step + ahead) % self.slots)
        stage_base = ctx.raw_base + stage * self.gather.stage_bytes
        if const_expr(self.early_row_groups > 0):
            if c + ahead < c_end:
                self.gather.copy_rows(stage_base, located, lane, range(self.early_row_groups), scales=True)
        return located


    # ------------------------------------------------------------------ the two roles
    @cute.jit
    def _nope_role(self, ctx, bases, out, qraw, sAmax, w, lane, tidx, sm_scale_log2, c_begin, c_end):
        """Warps 0 .. nope_tiles - 1: nope tile w of QK and of the output, and their share of
        the softmax."""
        ctx, bases, out, corr_base, g, qd = self._role_start(ctx, bases, out, lane)
        mt, fmt, pitch = self.groups, self.fmt, self.gather.row_pitch
        # Q as f16 A fragments: index (m * 4 + i) * 4 + a
        qf = cute.make_rmem_tensor(mt * 16, Int32)
        for m in cutlass.range_constexpr(mt):
            for r in cutlass.range_constexpr(2):
                qscale = pow2_f32(Q_F16_EXP - self._head_exponent(sAmax, 16 * m + g + 8 * r))
                for i in cutlass.range_constexpr(4):
                    loaded = [qraw[((m * 4 + i) * 2 + r) * 2 + pair] for pair in range(2)]
                    for pair in cutlass.range_constexpr(2):
                        if const_expr(self.e2m1):  # (column X, X + 2) and (X + 1, X + 3) of the two loads
                            lo, hi = loaded[0], loaded[1]
                            if const_expr(pair == 0):
                                lo_bits, hi_bits = lo << 16, hi << 16
                            else:
                                lo_bits, hi_bits = lo & -65536, hi & -65536
                        else:
                            lo_bits, hi_bits = loaded[pair] << 16, loaded[pair] & -65536
                        qf[(m * 4 + i) * 4 + 2 * pair + r] = pack_f16x2(f32_from_bits(lo_bits) * qscale,
                                                                        f32_from_bits(hi_bits) * qscale)
        sm = self._softmax_state(sAmax, tidx, sm_scale_log2)
        acc_O = cute.make_rmem_tensor(mt * 32, Float32)  # index ((m * 4 + blk) * 2 + parity) * 4 + c
        acc_O.fill(0.0)
        # R_w: the running max of this tile's scale over the split's valid entries so far (UE8M0,
        # the byte; FP32, the scale's bits, at least 2**-126)
        nr = self.tile_r
        r_run = cute.make_rmem_tensor(nr, Int32)
        r_run.fill(FLT_MIN_BITS if self.fp32_scales else 0)
        # the scales of this thread's entries 8 nb + 2 q + i at 2 nb + i: UE8M0 bytes (scale
        # group h of the tile at (2 nb + i) * nr + h) or FP32 values
        sbytes = cute.make_rmem_tensor(8 * nr, Int32)
        sf = cute.make_rmem_tensor(8 if self.fp32_scales else 1, Float32)
        group = (w * UNIT) // fmt.scale_group  # this tile's (first) scale group
        # entry e's scale record in a stage at scale_start + e * spitch; this tile's scale in it
        spitch = self.gather.scale_pitch
        scale_at = group * (4 if self.fp32_scales else 1)
        k_row = (lane % 8) * pitch + (lane // 8) * 16 + w * UNIT  # ldmatrix row of QK
        if const_expr(self.e2m1):  # one ldmatrix.x4: entries 8 (i // 2) + r, bytes 16 (i % 2).. of the tile
            k_row = (8 * (lane // 16) + lane % 8) * pitch + 16 * ((lane // 8) % 2) + w * fmt.tile_bytes
        v_row = lane * pitch + w * fmt.tile_bytes  # ldmatrix.trans row of PV
        # this thread's share of the first stages - 1 chunks' rows (``issue_rows``, one
        # cp.async group each; the nope warps copy nothing later): chunk c_begin's landed
        # before its barrier, the next one's at the end of the first iteration (later a wait
        # for nothing)
        cute.arch.cp_async_wait_group(self.stages - 2)
        for c in cutlass.range(c_begin, c_end, 1, unroll=1):
            step = c - c_begin
            buf = step % self.slots
            self.gather.next_chunk(ctx, c, c_end, step, issue=False)
            stage_base = ctx.raw_base + (step % self.stages) * self.gather.stage_bytes
            valid_rows = ctx.sMask[buf]
            scale_base = stage_base + self.gather.scale_start
            r_old = [r_run[h] for h in range(nr)]
            r_new = list(r_old)
            mine = [Int32(0)] * nr
            if const_expr(self.e2m1):
                pass  # the E4M3 scales go into the value operands (``_e2m1_qk_fragments``, ``_e2m1_pv``)
            elif const_expr(self.fp32_scales):
                for nb in cutlass.range_constexpr(4):
                    for i in cutlass.range_constexpr(2):
                        sf[2 * nb + i] = _smem_scalar(Float32, scale_base + (8 * nb + 2 * qd + i) * spitch + scale_at)[0]
                mine = [f32_bits(_smem_scalar(Float32, scale_base + lane * spitch + scale_at)[0])]
            else:
                for nb in cutlass.range_constexpr(4):
                    for i in cutlass.range_constexpr(2):
                        entry = scale_base + (8 * nb + 2 * qd + i) * spitch + scale_at
                        for h in cutlass.range_constexpr(nr):
                            sbytes[(2 * nb + i) * nr + h] = load_smem_u8(entry + h)
                mine = [load_smem_u8(scale_base + lane * spitch + scale_at + h) for h in range(nr)]
            if const_expr(not self.e2m1):
                counts = (valid_rows >> lane) & 1
                for h in cutlass.range_constexpr(nr):
                    r_new[h] = cutlass.max(r_old[h], warp_max_u32(mine[h] * counts))
                    r_run[h] = r_new[h]
            if const_expr(self.fp32_scales):  # R_w for the softmax's folding (read after the S barrier)
                if lane == 0:
                    _smem_scalar(Float32, bases.scale_max + 4 * w)[0] = f32_from_bits(r_new[0])

            # S_w = Q_w K_w^T times each entry's scale; n tiles in pairs, their MMA chains
            # interleaved (one tile at a time, ptxas issued the 16 MMAs back to back on one
            # accumulator, each waiting for the one before)
            at_once = self.qk_tiles_at_once
            for nb0 in cutlass.range_constexpr(0, 4, at_once):
                tiles = range(nb0, nb0 + at_once)
                b = {}
                if const_expr(self.e2m1):
                    for nb in cutlass.range_constexpr(nb0, nb0 + at_once, 2):
                        b.update(self._e2m1_qk_fragments(stage_base + k_row + 8 * nb * pitch, scale_base, nb, w, lane))
                else:
                    for nb in tiles:
                        kb = ldsm_x4(stage_base + k_row + 8 * nb * pitch, trans=False)
                        b[nb] = [self.conv.e4m3x4(kb[i]) for i in range(4)]
                for m in cutlass.range_constexpr(mt):
                    # per n tile and scale group h of the tile (k16 steps 4 h / nr ..): a chain of MMAs
                    d = {nb: [[Float32(0.0)] * 4 for _ in range(nr)] for nb in tiles}
                    for i in cutlass.range_constexpr(4):
                        for nb in tiles:
                            h = i * nr // 4
                            d[nb][h] = mma_f16(d[nb][h], [qf[(m * 4 + i) * 4 + a] for a in range(4)], b[nb][i])
                    for nb in tiles:
                        if const_expr(self.e2m1):  # the scales are in the operands
                            self._store_s_part(bases, w, m, nb, lane, d[nb][0])
                        else:
                            kf = [[self._entry_scale(sbytes, sf, 2 * nb + i, h) for i in range(2)] for h in range(nr)]
                            s_part = [d[nb][0][k] * kf[0][k % 2] for k in range(4)]
                            for h in cutlass.range_constexpr(1, nr):
                                s_part = [s_part[k] + d[nb][h][k] * kf[h][k % 2] for k in range(4)]
                            self._store_s_part(bases, w, m, nb, lane, s_part)
            cute.arch.sync_threads()
            moved = self.softmax.step(sm, bases, valid_rows, tidx, step, stage_base)

            # O_w = O_w * correction * R_old / R_new + P' V_w, P' = P s / R_w
            # pa[h]: the A fragments of P' for the value columns of scale group h of the tile
            pa = [[] for _ in range(nr)]
            ratios = [Float32(1.0)]
            if const_expr(self.e2m1):  # P itself: the scales are in the value operands
                pa = [[self._load_p(bases.p16, m, s, lane) for m in range(mt) for s in range(2)]]
            elif const_expr(self.fp32_scales):  # P' as the softmax folded it (this tile's group's row)
                ratios = [f32_from_bits(r_old[0]) * rcp_approx(f32_from_bits(r_new[0]))]
                for m in cutlass.range_constexpr(mt):
                    for s in cutlass.range_constexpr(2):
                        pa[0].append(self._load_p(bases.p16 + group * (self.hb * F16_P_ROW_BYTES), m, s, lane))
            else:
                # UE8M0: P' scale pairs: k16 step s, entries 16 s + 2 q + {0, 1} (n tile 2 s) and
                # 16 s + 8 + 2 q + {0, 1} (n tile 2 s + 1); 2**(b - R_w) as (b << 23) +
                # ((127 - R_w) << 23): one multiply-add and a max per byte
                ratios = [pow2_f32(r_old[h] - r_new[h]) for h in range(nr)]
                pfac = []
                for h in cutlass.range_constexpr(nr):
                    r_bits = (127 - r_new[h]) << 23
                    pfac.append([pack_f16x2(*[pow2_f32_bits(self._scale_byte(sbytes, 2 * nt + i, h) * (1 << 23) + r_bits)
                                              for i in range(2)]) for nt in range(4)])
                if const_expr(nr == 1):  # P' before the rescale (two groups: after it, ``_nope_pv``)
                    pa = [self._scaled_p(bases.p16, pfac[0], lane)]
            # the rescale only when a head's reference max or an R moved (CTA- / warp-uniform),
            # in a loop of 0 or 1 pass: ptxas predicated an `if` around it (both paths issued).
            # (Measured, H200: giving each path its own copy of the MMAs, which saves the ~60
            # register moves ptxas puts where the paths meet with 32 heads, was 3-5% slower.)
            r_moved = Int32(r_new[0] != r_old[0])
            for h in cutlass.range_constexpr(1, nr):
                r_moved = r_moved | Int32(r_new[h] != r_old[h])
            for _ in cutlass.range(moved | r_moved, unroll=1):
                self._rescale(acc_O, corr_base, ratios, g)
            if const_expr(self.e2m1):
                self._e2m1_pv(acc_O, pa[0], stage_base + v_row, scale_base, w, lane)
            else:
                if const_expr(nr > 1 and not self.fp32_scales):
                    # both groups' P' held across the rescale loop spilled the 32-head kernel
                    pa = [self._scaled_p(bases.p16, pfac[h], lane) for h in range(nr)]
                self._nope_pv(acc_O, pa, stage_base + v_row)
            cute.arch.cp_async_wait_group(0)

        self._finish_softmax(sm, bases, out, tidx)
        # column 64 w + 16 blk + 4 q + k of row (m, r) is accumulator ((m * 4 + blk) * 2 + k % 2) * 4
        # + 2 r + k // 2, in units of R_w's scale
        def pieces(m, r):
            return [(w * UNIT + 16 * blk + 4 * qd, [((m * 4 + blk) * 2 + k % 2) * 4 + 2 * r + k // 2 for k in range(4)],
                     blk * nr // 4) for blk in range(4)]

        if const_expr(self.e2m1):
            # e2m1: column 64 w + 32 p + 8 q + 4 h + c of row (m, r) is accumulator ((m * 2 + p) * 4 + c)
            # * 4 + 2 r + h, in units of 2**-e2m1_exp (``OperandConversion``); stored 4 columns at a
            # time, as the other formats' (``out`` rows are only 8-byte aligned)
            def pieces(m, r):
                return [(w * UNIT + 32 * p + 8 * qd + 4 * h, [((m * 2 + p) * 4 + c) * 4 + 2 * r + h for c in range(4)], 0)
                        for p in range(2) for h in range(2)]

            units = [Float32(2.0 ** self.conv.e2m1_exp)]
            acc_exp = 0
        elif const_expr(self.fp32_scales):
            units = [f32_from_bits(r_run[0])]
            acc_exp = self.conv.e4m3_exp
        else:  # scale group h's accumulators are in units of its R
            units = [ue8m0_scale(r_run[h]) for h in range(nr)]
            acc_exp = self.conv.e4m3_exp
        self._store_outputs(acc_O, units, pieces, bases, out, lane, acc_exp)

    @cute.jit
    def _entry_scale(self, sbytes, sf, k: int, h: int = 0) -> Float32:
        """Scale group h of this tile's K scale of this thread's entry k (n tile k // 2, column
        k % 2): 2**(b - 127) as ``ue8m0_scale`` (byte 0: 2**-127), or the FP32 value."""
        if const_expr(self.fp32_scales):
            return sf[k]
        return ue8m0_scale(self._scale_byte(sbytes, k, h))

    def _scale_byte(self, sbytes, k: int, h: int):
        """This thread's entry k's UE8M0 byte of the tile's scale group h (``sbytes``' order)."""
        return sbytes[k * self.tile_r + h]

    @cute.jit
    def _e2m1_qk_fragments(self, k_addr, scale_base, nb: int, w, lane) -> dict:
        """e2m1 (NVFP4): the f16 B fragments of n tiles nb and nb + 1 of this warp's tile, the
        E4M3 scales multiplied in (exact: value x scale has at most 6 significant bits and
        value x scale x 2**-e2m1_exp is a multiple of 2**-24, f16's smallest subnormal: 2**-16
        or, without the conversion instruction, 2**-24 at the least). One ``ldmatrix.x4`` at
        ``k_addr`` gives register 2 t + p = bytes 4q..4q+3 of piece p (32 columns) of entry
        8 (nb + t) + g: columns 32p + 8q + {0..7}; as f16 (``OperandConversion.e2m1x8``), the
        pairs (8q + 4h, 8q + 4h + 2) and (8q + 4h + 1,
        8q + 4h + 3) are k16 step 2p + h's b0 and b1 (the Q columns the kernel loads in that
        order). Returns {n tile: [[b0, b1] per k16 step]}."""
        g = lane // 4
        qd = lane % 4
        kb = ldsm_x4(k_addr, trans=False)
        frags = {}
        for t in cutlass.range_constexpr(2):
            # the entry's scales of groups 4w + 2p + q // 2 (p = 0, 1), each as an f16 pair
            word = _smem_scalar(Int32, scale_base + (8 * (nb + t) + g) * self.gather.scale_pitch + 4 * w)[0]
            sc = self.conv.e4m3x4_exact(byte_perm(word, Int32(0), 0x2200 + 0x1111 * (qd // 2)))
            steps = []
            for p in cutlass.range_constexpr(2):
                even, odd = self.conv.e2m1x8(kb[2 * t + p])  # columns 0, 2 | 4, 6 and 1, 3 | 5, 7
                steps += [[mul_f16x2(even[h], sc[p]), mul_f16x2(odd[h], sc[p])] for h in range(2)]
            frags[nb + t] = steps
        return frags

    @cute.jit
    def _e2m1_pv(self, acc_O, pa, v_base, scale_base, w, lane):
        """e2m1 (NVFP4): acc_O += P V_w for one chunk. Per piece p (32 columns) one
        ``ldmatrix.x4.trans`` from ``v_base``: matrix j, entries 8j + 2q, 8j + 2q + 1 (the two
        16-bit halves), columns 32p + 4g .. + 3; as e4m3 and paired by one byte permute, the
        B fragment pairs of columns 32p + 4g + c (c = 0, 2 from the low nibbles, 1, 3 from the
        high ones), times the two entries' scales (exact, as in ``_e2m1_qk_fragments``).
        Column class c of piece p is one MMA per k16 step."""
        g = lane // 4
        qd = lane % 4
        fb = self.gather.scale_pitch
        # scales of entries 8j + 2q + {0, 1}, groups 4w + 2p + g // 4: per j [piece 0, piece 1] f16 pairs
        sp = []
        for j in cutlass.range_constexpr(4):
            e0 = scale_base + (8 * j + 2 * qd) * fb + 4 * w
            w0 = _smem_scalar(Int32, e0)[0]
            w1 = _smem_scalar(Int32, e0 + fb)[0]
            # (a NaN scale made the entry's P NaN already: its QK)
            sp.append(self.conv.e4m3x4_exact(byte_perm(w0, w1, 0x6240 + 0x1111 * (g // 4)), nan=False))
        for p in cutlass.range_constexpr(2):
            vfrag = ldsm_x4(v_base + 16 * p, trans=True)
            cols = []  # per matrix j: the pairs of columns [0, 2, 1, 3]
            for j in cutlass.range_constexpr(4):
                even, odd = self.conv.e2m1x8(vfrag[j], PAIR_COLUMNS)
                cols.append(even + odd)
            for c in cutlass.range_constexpr(4):
                at = (c % 2) * 2 + c // 2  # column c's pair in ``cols[j]``
                bv = [mul_f16x2(cols[j][at], sp[j][p]) for j in range(4)]
                for m in cutlass.range_constexpr(self.groups):
                    base = ((m * 2 + p) * 4 + c) * 4
                    d = [acc_O[base + k] for k in range(4)]
                    for s in cutlass.range_constexpr(2):
                        d = mma_f16(d, pa[m * 2 + s], [bv[2 * s], bv[2 * s + 1]])
                    for k in cutlass.range_constexpr(4):
                        acc_O[base + k] = d[k]

    def _rescale(self, acc_O, corr_base, ratios, g):
        """acc_O of this thread's head rows (16 m + g + 8 r) times the row's correction (shared
        memory) times the ratio of the accumulator's scale group (both roles keep row r of m
        tile m at m * 32 + 4 j + 2 r + {0, 1}; ``ratios[h]`` covers j in [8 h / n, 8 (h + 1) / n),
        n = len(ratios): the nope role's value columns 64 h / n ..)."""
        for m in range(self.groups):
            for r in range(2):
                corr = _smem_scalar(Float32, corr_base + (16 * m + g + 8 * r) * 4)[0]
                fo = [corr * ratio for ratio in ratios]
                for k in range(16):
                    idx = m * 32 + 4 * (k // 2) + 2 * r + k % 2
                    acc_O[idx] = acc_O[idx] * fo[(k // 2) * len(ratios) // 8]

    def _scaled_p(self, p_base, pfac, lane):
        """P' = P times each entry's factor: the A fragments of P (``_load_p``) for every m
        tile and k16 step, times ``pfac`` (per n tile nt, the f16 pair of entries 8 nt + 2 q +
        {0, 1}): k16 step s holds n tiles 2 s (registers 0, 1) and 2 s + 1 (registers 2, 3)."""
        pa = []
        for m in range(self.groups):
            for s in range(2):
                pfr = self._load_p(p_base, m, s, lane)
                pa.append([mul_f16x2(pfr[0], pfac[2 * s]), mul_f16x2(pfr[1], pfac[2 * s]),
                           mul_f16x2(pfr[2], pfac[2 * s + 1]), mul_f16x2(pfr[3], pfac[2 * s + 1])])
        return pa

    def _nope_pv(self, acc_O, pas, v_base):
        """acc_O += P' V_w for one chunk: the value fragments by ``ldmatrix.x4.trans`` of the
        raw rows from ``v_base`` (entries 0-7, 8-15, 16-23, 24-31 of 16 columns), one byte
        permute into (row 2q, row 2q + 1) pairs, then even and odd columns as two MMAs;
        ``pas[h]``: P' of the tile's scale group h (value columns 64 h / tile_r ..)."""
        for blk in range(4):
            pa = pas[blk * self.tile_r // 4]
            vfrag = ldsm_x4(v_base + 16 * blk, trans=True)
            # [even column, odd column]; a NaN value byte's entry has a NaN P already (its QK)
            bv = [self.conv.e4m3x4(vfrag[k], PAIR_COLUMNS, nan=False) for k in range(4)]
            for parity in range(2):
                for m in range(self.groups):
                    base = ((m * 4 + blk) * 2 + parity) * 4
                    d = [acc_O[base + k] for k in range(4)]
                    for s in range(2):
                        d = mma_f16(d, pa[m * 2 + s], [bv[2 * s][parity], bv[2 * s + 1][parity]])
                    for k in range(4):
                        acc_O[base + k] = d[k]

    def _rope_pv(self, acc_O, pa, v_base):
        """acc_O += P V_rope for one chunk (bf16 P, the raw bf16 rope rows by ``ldmatrix.trans``)."""
        for n in range(8):
            vfrag = ldsm_x4(v_base + 16 * n, trans=True)  # entries 0-7, 8-15 (step 0), 16-31 (step 1)
            for m in range(self.groups):
                d = [acc_O[(m * 8 + n) * 4 + k] for k in range(4)]
                for s in range(2):
                    d = mma_bf16(d, pa[m * 2 + s], vfrag[2 * s:2 * s + 2])
                for k in range(4):
                    acc_O[(m * 8 + n) * 4 + k] = d[k]

    @cute.jit
    def _rope_role(self, ctx, bases, out, qraw, sAmax, lane, tidx, sm_scale_log2, c_begin, c_end):
        """Warp nope_tiles: the 64 rope dims of QK (where the format has them) and of the
        output (where V has them; bf16), its share of the softmax (MODEL1) or only the
        softmax's barriers, and the gather of the main loop."""
        ctx, bases, out, corr_base, g, qd = self._role_start(ctx, bases, out, lane)
        mt, fmt, pitch = self.groups, self.fmt, self.gather.row_pitch
        if const_expr(self.rope_in_softmax):
            sm = self._softmax_state(sAmax, tidx, sm_scale_log2)
        acc_O = cute.make_rmem_tensor(mt * 32 if fmt.rope_in_v else 1, Float32)  # index (m * 8 + n) * 4 + c
        acc_O.fill(0.0)
        # ldmatrix rows: QK lane 8 i + r -> entry r, rope bytes 16 i.. (k16 steps 2 x, 2 x + 1
        # per x4); PV lane l -> entry l
        k_row = (lane % 8) * pitch + fmt.rope_offset + (lane // 8) * 16
        v_row = lane * pitch + fmt.rope_offset
        for c in cutlass.range(c_begin, c_end, 1, unroll=1):
            step = c - c_begin
            buf = step % self.slots
            # chunk c's rows and c + stages - 1's indices; in flight stay the rows of chunk
            # c + stages - 2 (and with late_indices, in the same group, chunk c + stages's indices)
            cute.arch.cp_async_wait_group(self.stages - 2)
            self.gather.next_chunk(ctx, c, c_end, step, issue=False)
            stage_base = ctx.raw_base + (step % self.stages) * self.gather.stage_bytes
            next_base = ctx.raw_base + ((step + self.stages - 1) % self.stages) * self.gather.stage_bytes
            valid_rows = ctx.sMask[buf]
            if const_expr(self.early_row_groups > 0):
                located = self._start_next_chunk(ctx, c, c_end, step, lane)
            if const_expr(fmt.rope_dims > 0):
                at_once = self.rope_qk_tiles_at_once
                for nb0 in cutlass.range_constexpr(0, 4, at_once):  # as in the nope role
                    tiles = range(nb0, nb0 + at_once)
                    kb = {nb: [] for nb in tiles}
                    for nb in tiles:
                        for x in cutlass.range_constexpr(2):
                            kb[nb] += ldsm_x4(stage_base + k_row + 8 * nb * pitch + 64 * x, trans=False)
                    for m in cutlass.range_constexpr(mt):
                        d = {nb: [Float32(0.0)] * 4 for nb in tiles}
                        for i in cutlass.range_constexpr(4):
                            a = [qraw[((m * 4 + i) * 2 + (k % 2)) * 2 + k // 2] for k in range(4)]
                            for nb in tiles:
                                d[nb] = mma_bf16(d[nb], a, kb[nb][2 * i:2 * i + 2])
                        for nb in tiles:
                            self._store_s_part(bases, self.rope_warp, m, nb, lane, d[nb])
            cute.arch.sync_threads()
            if const_expr(self.rope_in_softmax):
                moved = self.softmax.step(sm, bases, valid_rows, tidx, step, stage_base)
            else:
                moved = self.softmax.step_barriers(step)
            # the rest of the next chunk's gather here: the rope warp's shortest phase
            if const_expr(self.early_row_groups == 0):
                located = self._start_next_chunk(ctx, c, c_end, step, lane)
            if c + self.stages - 1 < c_end:
                self.gather.copy_rows(next_base, located, lane, range(self.early_row_groups, self.bn // 8),
                                      scales=self.early_row_groups == 0)
            if const_expr(self.late_indices):
                # chunk c + stages + 1's indices, in the same cp.async group as these rows (one
                # group per chunk): located two chunks from now, after the wait that lands it
                if c + self.stages + 1 < c_end:
                    self.gather.issue_indices(ctx, c + self.stages + 1, (step + self.stages + 1) % self.slots)
            cute.arch.cp_async_commit_group()

            if const_expr(fmt.rope_in_v):
                pa = [self._load_p(bases.pbf, m, s, lane) for m in range(mt) for s in range(2)]
                for _ in cutlass.range(moved, unroll=1):  # as in the nope role
                    self._rescale(acc_O, corr_base, [Float32(1.0)], g)
                self._rope_pv(acc_O, pa, stage_base + v_row)

        if const_expr(self.rope_in_softmax):
            self._finish_softmax(sm, bases, out, tidx)
        else:
            cute.arch.sync_threads()  # ``_finish_softmax``'s barrier
        if const_expr(fmt.rope_in_v):
            # column nope_dims + 8 n + 2 q + i of row (m, r) is accumulator (m * 8 + n) * 4 + 2 r + i
            def pieces(m, r):
                return [(fmt.nope_dims + 8 * n + 2 * qd, [(m * 8 + n) * 4 + 2 * r + i for i in range(2)], 0)
                        for n in range(8)]

            self._store_outputs(acc_O, [Float32(1.0)], pieces, bases, out, lane)

    # ------------------------------------------------------------------ shared steps
    @staticmethod
    def _role_start(ctx, bases, out, lane):
        """What both roles start with: their own namespaces (the tracer rebinds the attributes
        of a namespace passed into a helper with a branch to that branch's results, which the
        other role's code, another region, must not see), the corrections' address (read
        before any branch) and the lane's MMA fragment coordinates (g, q)."""
        ctx, bases, out = (SimpleNamespace(**vars(n)) for n in (ctx, bases, out))
        return ctx, bases, out, bases.corr, lane // 4, lane % 4

    @cute.jit
    def _head_exponent(self, sAmax, hrow) -> Int32:
        """E_h: the exponent of head row ``hrow``'s largest |q| over the nope dims, clamped so
        that every power of two built from it is a normal f32."""
        amax = sAmax[hrow, 0]
        for w in cutlass.range_constexpr(1, self.rope_warp):
            amax = cutlass.max(amax, sAmax[hrow, w])
        return cutlass.min(cutlass.max((amax >> 23) - 127, -100), 127)

    @cute.jit
    def _store_s_part(self, bases, w, m, nb, lane, d):
        """A warp's partial S of n tile nb, m tile m (C fragment ``d``) into its [head][entry] rows."""
        g = lane // 4
        qd = lane % 4
        for r in cutlass.range_constexpr(2):
            addr = bases.s + ((w * self.hb + 16 * m + g + 8 * r) * F16_S_ROW + 8 * nb + 2 * qd) * 4
            v = cute.make_rmem_tensor(2, Float32)
            v[0] = d[2 * r]
            v[1] = d[2 * r + 1]
            cute.autovec_copy(v, _smem_vec(Float32, addr, 2))

    @cute.jit
    def _load_p(self, p_base, m, s, lane):
        """The A fragment of P (m16 tile m, k16 step s) by ``ldmatrix.x4``: lane 8 i + r gives
        row r (+ 8 for matrices 1, 3), entries 16 s (+ 8 for matrices 2, 3)."""
        row = 16 * m + lane % 8 + 8 * ((lane // 8) % 2)
        col = 16 * s + 8 * (lane // 16)
        return ldsm_x4(p_base + row * F16_P_ROW_BYTES + col * 2, trans=False)

    @cute.jit
    def _softmax_state(self, sAmax, tidx, sm_scale_log2):
        """This thread's state of the spread softmax (``SpreadSoftmax.state``): the nope
        partials of head row h are in units of 2**(E_h - 14) (Q's f16 scale), times 2**exp
        for K operands that are the values x 2**-exp (``OperandConversion``: e2m1 x 2**-6,
        and without the conversion instruction e4m3 x 2**-8, e2m1 x 2**-14)."""
        b_exp = self.conv.e2m1_exp if self.e2m1 else self.conv.e4m3_exp
        return self.softmax.state(tidx, lambda hrow: self._head_exponent(sAmax, hrow) - Q_F16_EXP + b_exp,
                                  sm_scale_log2)

    @cute.jit
    def _finish_softmax(self, sm, bases, out, tidx):
        """The row sums, each head's output factor into shared memory (visible on return) and
        its lse to global memory."""
        hrow = sm.hrow
        total = self.softmax.row_total(sm)
        head = out.head0 + hrow
        gate_addr = bases.gate + hrow * 4
        num_heads, token, split, num_splits = out.num_heads, out.token, out.split, out.num_splits
        lse_part, lse, lse_stride_t, lse_stride_h = out.lse_part, out.lse, out.lse_stride_t, out.lse_stride_h
        row_max, attn_sink = sm.run[0], out.attn_sink
        if self.softmax.is_row_leader(tidx):
            if head < num_heads:
                gate, lse2 = self.epilogue.gate_and_lse2(total, row_max, attn_sink, head)
                _smem_scalar(Float32, gate_addr)[0] = gate
                self.epilogue.store_lse(lse2, token, split, num_splits, num_heads, head, lse_part, lse,
                                        lse_stride_t, lse_stride_h)
        cute.arch.sync_threads()

    @cute.jit
    def _store_outputs(self, acc_O, units, pieces, bases, out, lane, acc_exp: int = 0):
        """This thread's output values, in units of ``units[u]`` times each head's gate:
        ``pieces(m, r)`` lists (first column, accumulator indices of adjacent columns, u) of
        row r of m tile m. ``acc_exp``: the accumulators are first times 2**acc_exp (value
        operands that were the values x 2**-acc_exp; a separate exact multiply, so that no
        unit times it can overflow)."""
        g = lane // 4
        gate_base = bases.gate
        head0, num_heads = out.head0, out.num_heads
        out_ctx = (out.token, out.split, out.num_splits, num_heads)
        tail_ctx = (out.o_part, out.out, out.out_stride_t, out.out_stride_h)
        for m in cutlass.range_constexpr(self.groups):
            for r in cutlass.range_constexpr(2):
                hrow = 16 * m + g + 8 * r
                if head0 + hrow < num_heads:
                    gate = _smem_scalar(Float32, gate_base + hrow * 4)[0]
                    fg = [gate * unit for unit in units]
                    for col, idx, u in pieces(m, r):
                        vals = [acc_O[k] for k in idx]
                        if const_expr(acc_exp != 0):
                            vals = [v * (2.0 ** acc_exp) for v in vals]
                        self.epilogue.store_out([v * fg[u] for v in vals], col, *out_ctx, head0 + hrow, *tail_ctx)
