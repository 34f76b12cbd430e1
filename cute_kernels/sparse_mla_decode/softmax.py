"""The scores' way to probabilities: the S exchange between warps and the online softmax.

Everything is in log2 units: a score is s * sm_scale * log2(e), so that P = 2**(s - m).
An entry that does not count has score -inf and probability 0; a row with no valid entry
keeps max -inf (its P uses 0 as the reference, so no NaN ever appears) and sum 0.

Two forms:

- quad form ("bf16", FP8 paths): every warp of a head group holds the full S [16, 32] of its
  group after ``exchange_s`` (each warp's partial S over its slice of the QK width, summed
  through shared memory in a fixed order), and the 4 threads of an MMA quad own two head
  rows: their max and sum by quad shuffles;
- spread form ("f16", ``SpreadSoftmax``): the warps' partial S of all heads are in shared
  memory (one per nope warp, and the rope dims' where the format has them), and thread t of
  the first 256 sums the partials of 2 or 4 consecutive entries of one head and runs the
  softmax with the 16 or 8 threads of its head. A head's reference max moves only when the
  chunk's max exceeds it by more than ``tuning.RESCALE_LOG2`` (so P <= 2**8); P is written
  to shared memory with the row's rescale factor, for the PV step to load: UE8M0 and NVFP4
  formats in f16 (UE8M0: the nope warps scale it by powers of two; NVFP4: the scales are in
  the value operands) and bf16 (the rope warp); FP32-scale
  formats once per scale group g, in f16, as P * s_g / R_g (s_g the entry's scale of group
  g, R_g the group's running maximum, ``scale_max``): the FP32 scale is applied in f32 and
  P rounded once.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from . import tuning
from .config import F16_P_ROW_BYTES, F16_S_ROW, F16_SOFTMAX_THREADS, PartialConfig
from .device_utils import smem_scalar, smem_vec
from .epilogue import quad_allreduce
from .kv_format import NOPE_TILE
from .warp_ops import pack_bf16x2, pack_f16x2, pow2_f32, rcp_approx, sync_threads_or


# ---------------------------------------------------------------------- quad form
@cute.jit
def exchange_s(acc_S: cute.Tensor, tSsS: list, wq: Int32, group: Int32, warps_per_group: int, groups: int):
    """Each warp's partial S [16, 32] (``acc_S``, its m16n8 C fragments) into its slot
    ``tSsS[wq]`` of the group's exchange, a barrier of the group's warps, then the full S =
    the sum of the slots in a fixed order (identical in every warp) back into ``acc_S``."""
    for w in cutlass.range_constexpr(warps_per_group):
        if wq == w:
            cute.autovec_copy(acc_S, tSsS[w])
    if const_expr(groups > 1):  # only the group's own warps exchange S
        cute.arch.barrier(barrier_id=1 + group, number_of_threads=32 * warps_per_group)
    else:
        cute.arch.sync_threads()
    acc_S.store(tSsS[0].load())
    for w in cutlass.range_constexpr(1, warps_per_group):
        acc_S.store(acc_S.load() + tSsS[w].load())


@cute.jit
def quad_online_softmax(acc_S: cute.Tensor, tScS: cute.Tensor, valid_rows: Int32, row_scale: list,
                        row_max: cute.Tensor, row_sum: cute.Tensor) -> list:
    """One chunk of the online softmax on the full S of a thread's two head rows.

    ``acc_S``: S [16, 32] as m16n8 C fragments (element (row g + 8 r, entry 8 j + 2 q + i) at
    4 j + 2 r + i), replaced by P; ``tScS``: their (row, entry) coordinates; ``valid_rows``:
    the chunk's validity mask; ``row_scale[r]``: the factor from S to log2-domain scores of
    row r; ``row_max`` / ``row_sum``: the rows' running max and sum, updated. Returns each
    row's correction 2**(old max - new max), for the caller to rescale its accumulators."""
    correction = [Float32(1.0), Float32(1.0)]
    for r in cutlass.range_constexpr(2):
        m_chunk = -Float32.inf
        for j in cutlass.range_constexpr(4):
            for i in cutlass.range_constexpr(2):
                col = tScS[2 * r + i, 0, j][1]
                s = acc_S[4 * j + 2 * r + i] * row_scale[r]
                if (valid_rows >> col) & 1 == 0:
                    s = -Float32.inf
                acc_S[4 * j + 2 * r + i] = s
                m_chunk = cute.arch.fmax(m_chunk, s)
        m_chunk = quad_allreduce(m_chunk, cute.arch.fmax)
        m_new = cute.arch.fmax(row_max[r], m_chunk)
        m_base = m_new
        if m_new == -Float32.inf:
            m_base = Float32(0.0)
        correction[r] = cute.math.exp2(row_max[r] - m_base, fastmath=True)
        psum = Float32(0.0)
        for j in cutlass.range_constexpr(4):
            for i in cutlass.range_constexpr(2):
                p = cute.math.exp2(acc_S[4 * j + 2 * r + i] - m_base, fastmath=True)
                acc_S[4 * j + 2 * r + i] = p
                psum = psum + p
        row_sum[r] = row_sum[r] * correction[r] + psum
        row_max[r] = m_new
    return correction


# ---------------------------------------------------------------------- spread form
class SpreadSoftmax:
    """The "f16" kernel's softmax over all its threads (module docstring)."""

    def __init__(self, cfg: PartialConfig):
        self.hb = cfg.heads_per_cta
        self.fmt = fmt = cfg.fmt
        # entries per thread, threads per head row (the first F16_SOFTMAX_THREADS threads)
        self.ept = self.hb * cfg.block_n // F16_SOFTMAX_THREADS
        self.tpr = cfg.block_n // self.ept
        self.partials = cfg.s_partials  # the nope warps' partial S, then the rope dims' if any
        self.fold = fmt.fp32_scales  # P per scale group with the FP32 scales folded in
        self.row_pitch = fmt.raw_row_stride
        self.group_rows = self.hb * F16_P_ROW_BYTES  # bytes between the P rows of two scale groups
        assert not self.fold or (fmt.scale_offset % 16 == 0 and self.row_pitch % 16 == 0)

    @cute.jit
    def state(self, tidx: Int32, nope_unit_exponent, sm_scale_log2: Float32) -> SimpleNamespace:
        """This thread's head row, its first entry, its running max / partial sum, and the
        factors that turn the summed partials into log2-domain scores: the nope partials of
        head row h are in units of 2**``nope_unit_exponent(h)``, the rope partial in 1."""
        hrow = tidx // self.tpr
        e = nope_unit_exponent(hrow)
        run = cute.make_rmem_tensor(2, Float32)  # running max (log2 units), this thread's partial sum
        run[0] = -Float32.inf
        run[1] = Float32(0.0)
        return SimpleNamespace(hrow=hrow, j0=(tidx % self.tpr) * self.ept, run=run,
                               nope_fac=pow2_f32(e) * sm_scale_log2, rope_fac=sm_scale_log2)

    @cute.jit
    def step(self, sm, bases, valid_rows, tidx, step, stage_base):
        """Scores of this thread's entries from the partials, the online softmax over its
        head row, P (module docstring; ``stage_base``: the chunk's raw rows, for FP32 scales)
        and the row's rescale factor into shared memory, visible to the CTA on return; returns
        1 (every thread) when some head's reference max moved, else 0.

        After the first chunk a head's max rarely moves, so P is first computed against the
        old max without the row's max: each thread only tests its own entries against
        ``m_old + RESCALE_LOG2`` and the P barrier ORs the tests (``sync_threads_or``). Only
        when one is set (CTA-uniform) does the exact step below run (the row max by shuffles,
        P again, a second barrier); every value it leaves is the one the step without the
        test computes. The first chunk goes to it directly (every max moves there)."""
        ept, tpr = self.ept, self.tpr
        hrow, j0, run = sm.hrow, sm.j0, sm.run
        s_base, p16_base, pbf_base, corr_addr = bases.s, bases.p16, bases.pbf, bases.corr + hrow * 4
        parts = []  # the nope partials then the rope one (if any), each [ept]
        for w in cutlass.range_constexpr(self.partials):
            v = cute.make_rmem_tensor(ept, Float32)
            cute.autovec_copy(smem_vec(Float32, s_base + ((w * self.hb + hrow) * F16_S_ROW + j0) * 4, ept), v)
            parts.append(v.load())
        part = cute.make_rmem_tensor(ept, Float32)
        if const_expr(self.fmt.rope_dims > 0):
            part.store(parts.pop())
        acc = cute.make_rmem_tensor(ept, Float32)  # the scores (log2 units), -inf where invalid
        acc.store(_tree_sum(parts))  # 3 dependent adds, not 6
        for e in cutlass.range_constexpr(ept):
            s = acc[e] * sm.nope_fac
            if const_expr(self.fmt.rope_dims > 0):
                s = s + part[e] * sm.rope_fac
            if (valid_rows >> (j0 + e)) & 1 == 0:
                s = -Float32.inf
            acc[e] = s
        # FP32 scales: where _store_p reads the group maxima and this thread's entries' scales
        fold = (bases.scale_max, stage_base + j0 * self.row_pitch + self.fmt.scale_offset)
        p = cute.make_rmem_tensor(ept, Float32)
        p_offset = hrow * F16_P_ROW_BYTES + j0 * 2
        m_old = run[0]
        moved = Int32(1)
        if step != 0:
            m_base = m_old
            if m_old == -Float32.inf:
                m_base = Float32(0.0)
            exceeds = Int32(0)
            for e in cutlass.range_constexpr(ept):
                exceeds = exceeds | Int32(acc[e] > m_old + tuning.RESCALE_LOG2)
            psum = self._write_p(acc, m_base, Float32(1.0), p, fold, p16_base, pbf_base, p_offset, corr_addr, tidx)
            moved = cute.arch.make_warp_uniform(sync_threads_or(exceeds))
            if moved == 0:
                run[1] = run[1] + psum
        if moved != 0:
            m_chunk = -Float32.inf
            for e in cutlass.range_constexpr(ept):
                m_chunk = cute.arch.fmax(m_chunk, acc[e])
            off = tpr // 2
            while off >= 1:
                m_chunk = cute.arch.fmax(m_chunk, cute.arch.shuffle_sync_bfly(m_chunk, offset=off, mask=-1,
                                                                               mask_and_clamp=31))
                off //= 2
            m_new = m_old
            if m_chunk > m_old + tuning.RESCALE_LOG2:
                m_new = m_chunk
            m_base = m_new
            if m_new == -Float32.inf:
                m_base = Float32(0.0)
            corr = cute.math.exp2(m_old - m_base, fastmath=True)
            psum = self._write_p(acc, m_base, corr, p, fold, p16_base, pbf_base, p_offset, corr_addr, tidx)
            run[1] = run[1] * corr + psum
            run[0] = m_new
            cute.arch.sync_threads()
        return moved

    @cute.jit
    def step_barriers(self, step) -> Int32:
        """``step``'s barriers, in its order, for a warp with no share of the softmax (the
        "f16" rope warp of a format with 8 nope warps); returns ``moved`` as ``step`` does."""
        moved = Int32(1)
        if step != 0:
            moved = cute.arch.make_warp_uniform(sync_threads_or(Int32(0)))
        if moved != 0:
            cute.arch.sync_threads()
        return moved

    @cute.jit
    def _fold_factors(self, fold):
        """FP32 scales: s_g / R_g of this thread's entries, entry e's of group g at
        ``num_scales * e + g``, from ``fold`` = (the groups' running maxima R_g as the nope
        warps of group g wrote them for this chunk, the first entry's scales; one 16-byte load
        per entry). Computed where P is stored, not held across the softmax's barrier: held,
        they pushed the 288-thread kernel past its 168 registers."""
        fmt = self.fmt
        scale_max, scales = fold
        factors = cute.make_rmem_tensor(fmt.num_scales * self.ept, Float32)
        inv_r = [rcp_approx(smem_scalar(Float32, scale_max + 4 * (g * fmt.scale_group // NOPE_TILE))[0])
                 for g in range(fmt.num_scales)]
        for e in cutlass.range_constexpr(self.ept):
            sc = cute.make_rmem_tensor(fmt.num_scales, Float32)
            cute.autovec_copy(smem_vec(Float32, scales + e * self.row_pitch, fmt.num_scales), sc)
            for g in cutlass.range_constexpr(fmt.num_scales):
                factors[fmt.num_scales * e + g] = sc[g] * inv_r[g]
        return factors

    @cute.jit
    def _write_p(self, acc, m_base, corr, p, fold, p16_base, pbf_base, p_offset, corr_addr, tidx):
        """P = 2**(score - m_base) of this thread's entries into ``p`` and the P rows, the
        head row's rescale factor ``corr`` (by its first thread); returns the entries' sum.
        Both softmax paths (against the old max, and the exact step) write P through this."""
        psum = Float32(0.0)
        for e in cutlass.range_constexpr(self.ept):
            p[e] = cute.math.exp2(acc[e] - m_base, fastmath=True)
            psum = psum + p[e]
        self._store_p(p, fold, p16_base, pbf_base, p_offset)
        if tidx % self.tpr == 0:
            smem_scalar(Float32, corr_addr)[0] = corr
        return psum

    @cute.jit
    def _store_p(self, p, fold, p16_base, pbf_base, offset):
        """This thread's P values into the P rows (``offset`` bytes in): UE8M0, the f16 and the
        bf16 rows; FP32 scales, group g's f16 row P s_g / R_g (``_fold_factors``)."""
        ept = self.ept
        if const_expr(self.fold):
            ns = self.fmt.num_scales
            factors = self._fold_factors(fold)
            for g in cutlass.range_constexpr(ns):
                words = cute.make_rmem_tensor(ept // 2, Int32)
                for k in cutlass.range_constexpr(ept // 2):
                    words[k] = pack_f16x2(p[2 * k] * factors[ns * 2 * k + g],
                                          p[2 * k + 1] * factors[ns * (2 * k + 1) + g])
                cute.autovec_copy(words, smem_vec(Int32, p16_base + g * self.group_rows + offset, ept // 2))
        else:
            words16 = cute.make_rmem_tensor(ept // 2, Int32)
            words_bf = cute.make_rmem_tensor(ept // 2, Int32)
            for k in cutlass.range_constexpr(ept // 2):
                words16[k] = pack_f16x2(p[2 * k], p[2 * k + 1])
                words_bf[k] = pack_bf16x2(p[2 * k], p[2 * k + 1])
            cute.autovec_copy(words16, smem_vec(Int32, p16_base + offset, ept // 2))
            cute.autovec_copy(words_bf, smem_vec(Int32, pbf_base + offset, ept // 2))

    @cute.jit
    def row_total(self, sm):
        """The head row's probability sum (the partial sums of its threads, by shuffles)."""
        total = sm.run[1]
        off = self.tpr // 2
        while off >= 1:
            total = total + cute.arch.shuffle_sync_bfly(total, offset=off, mask=-1, mask_and_clamp=31)
            off //= 2
        return total

    def is_row_leader(self, tidx):
        return tidx % self.tpr == 0


def _tree_sum(values: list):
    """The sum of ``values`` (traced vectors) as a balanced tree of adds (a plain function:
    its loop unrolls at trace time)."""
    while len(values) > 1:
        values = [values[k] + values[k + 1] for k in range(0, len(values) - 1, 2)] + values[len(values) - len(values) % 2:]
    return values[0]
