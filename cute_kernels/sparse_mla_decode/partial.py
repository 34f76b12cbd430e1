"""Split-K partial kernel of DeepSeek-V4 sparse MLA decode (CuTe DSL, warp-level MMA).

Work item (one CTA): query token t, a block of 16 query heads, and a contiguous range of
"chunks" of ``block_n`` selected entries. The chunks of a token are numbered main first,
then extra: chunk c < ceil(topk / block_n) reads the main cache, the rest the extra cache.
Grid: (num_tokens, ceil(H / 16), num_splits); split s owns chunks
``[s * chunks_per_split, (s + 1) * chunks_per_split)``.

Per chunk:
1. gather: each selected slot's 576 data bytes (36 x 16-byte cp.async) and 8 scale bytes
   (one 8-byte cp.async) land in a raw shared-memory stage; an invalid entry (-1, a slot
   outside the cache, or a position past topk_length) is never read. Two stages: the
   gather of chunk c+1 is in flight while chunk c is computed, and the indices of chunk
   c+2 (4-byte cp.async) with it, so no thread ever waits on a global load in the loop.
2. dequantize: FP8 nope bytes times 2**(scale - 127) and the bf16 rope values become a
   bf16 tile [block_n, 512] (swizzled for ldmatrix); invalid entries become rows of 0.
3. S = Q K^T on the tensor cores (mma.sync m16n8k16 bf16 -> f32). Warp w multiplies its
   own 128-wide slice of the QK width (Q slice kept in registers for the whole kernel);
   the four partial S tiles are summed through shared memory, so every warp holds the
   full S [16, block_n] and runs the same online softmax (log2 domain) on it.
4. O_w += P V_w: P (bf16, straight from the S registers) times the warp's 128-wide slice
   of the value (the same tile, read transposed by ldmatrix).

Output, partial mode: per (token, split, head) the normalized partial output (f32, 512)
and its lse in log2 units (-inf for a split with no valid entry); ``merge.py`` combines
the splits. Final mode (``cfg.final_output``, for a call that needs one split): the kernel
writes the bf16 output and the natural-log lse itself, sink applied, and no merge runs.

Inputs are raw device pointers plus integer strides, so one compiled kernel serves every
shape: nothing about num_tokens, num_heads, topk, extra_topk or the page block sizes is
baked into the code.

Measured facts (H200, sm_90a build of this source; BENCHMARKS.md has the runs):
- The 64/128-head shapes are bound by instruction issue, not by the gathers: ncu at T=64,
  H=64, topk=512 (8 warps per SM: the kernel needs 197-255 registers) shows the issue
  slots 26% busy; per issued instruction a warp waits 1.7 cycles on shared-memory results
  (short scoreboard), 1.6 on fixed-latency dependencies, 1.6 on the shared-memory
  instruction queue (MIO throttle), 0.5 on barriers and 0.26 on global memory.
- So instructions per chunk are what to cut: locating a row once per thread group instead
  of per 16-byte piece (integer division by the runtime page size) and one ballot mask per
  chunk for entry validity took T=64 x 16 x 1024 from 73 to 58 us. Skipping the O rescale
  when no row max of the warp moved (a vote.all branch) made it worse: ptxas if-converts
  it into predicated multiplies plus ~80 register moves around the PV MMAs; the plain
  rescale gives 965 instead of 1040 loop instructions (sm_120a, two groups, final mode).
- Loading the next-next chunk's indices by cp.async instead of a plain load the loop waits
  on gained 4-6% at T >= 64 (global latency was not the main stall).
- Dequantizing 16 columns per thread piece (one 16-byte FP8 load and one scale per 16
  values) and a named barrier per head group for the S exchange: 965 -> 921 loop
  instructions, every bench shape 1-6% faster.
- Remaining per chunk and thread (sm_120a, two head groups): 921 instructions (918 since
  the launch carries .minnctapersm 1), of them 64
  HMMA, ~154 shared-memory instructions (dequantization loads and stores, the S exchange
  between the four warps of a group, ldmatrix) and ~50 per 16 values for FP8 -> bf16 (8
  unpacks to f16x2, 16 widenings to f32, 16 scale multiplies, 8 packs, loads, the scale).
"""

from __future__ import annotations

from types import SimpleNamespace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, Uint8, const_expr
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.memory import SmemAllocator

from .config import RAW_ROW_STRIDE, PartialConfig
from .device_utils import LN_2, cp_async_zfill, load_f32, load_i32, load_smem_u8, sink_gate, store_f32
from .layout import D_NOPE, D_QK, ROW_BYTES, SCALE_BYTES, TILE
from .warp_ops import ue8m0_scale




DEQUANT_VALUES = 16  # columns one thread dequantizes at a time (divides the 64-column scale tile)


class SparseMlaPartialKernel:
    """The partial kernel for one ``PartialConfig``; ``__call__`` is the ``cute.jit`` launcher."""

    INDEX_THREAD0 = 0  # the first of the block_n threads that load a chunk's indices

    def __init__(self, cfg: PartialConfig):
        cfg.check()
        self.cfg = cfg
        self.hb = cfg.heads_per_cta  # heads per CTA (all groups)
        self.hg = cfg.heads_per_group  # heads per group: the MMA M tile
        self.groups = cfg.head_groups
        self.wpg = cfg.warps_per_group
        self.bn = cfg.block_n
        self.nthr = cfg.num_threads
        self.wslice = D_QK // cfg.warps_per_group  # QK/output columns per warp
        self.stage_bytes = cfg.stage_bytes
        self.stages = cfg.stages  # raw row buffers (``_next_chunk``)
        self.slots = cfg.slot_buffers  # index / validity-mask buffers
        # chunks whose indices the prologue loads (``_start_pipeline``): ``stages`` here; the
        # "f16" kernel without the register bound issues them one chunk further ahead
        # (``SparseMlaPartialF16Kernel.late_indices``); at most ``slots``
        self.index_chunks = cfg.stages
        self.scale_off = cfg.block_n * RAW_ROW_STRIDE  # scales follow the rows in a stage

    def fake_args(self) -> list:
        """Stand-ins for every ``__call__`` argument, to compile with no tensors and no GPU."""
        from cutlass.cute.runtime import make_fake_stream, make_ptr

        def ptr(dtype, align):
            return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)

        source = [ptr(Uint8, 16), Int32(1), Int64(0), Int64(0), Int32(1), ptr(Int32, 4), Int64(0), Int32(1),
                  ptr(Int32, 4)]
        return (
            [ptr(BFloat16, 16), Int64(0), Int64(0), Int32(1), Int32(1)]
            + source
            + source
            + [Float32(1.0), Int32(1), Int32(1), ptr(Float32, 16), ptr(Float32, 4)]
            + [ptr(BFloat16, 8), Int64(0), Int64(0), ptr(Float32, 4), Int64(0), Int64(0), ptr(Float32, 4)]
            + [make_fake_stream()]
        )

    # ------------------------------------------------------------------ launcher
    @cute.jit
    def __call__(
        self,
        q: cute.Pointer,  # bf16 [T, H, 512], 16-byte aligned rows
        q_stride_t: Int64,  # elements
        q_stride_h: Int64,  # elements
        num_tokens: Int32,
        num_heads: Int32,
        main_cache: cute.Pointer,  # uint8 blocks, 16-byte aligned
        main_page: Int32,
        main_page_magic: Int64,  # cache_format.page_division_magic(main_page)
        main_block_stride: Int64,  # bytes
        main_num_slots: Int32,
        main_idx: cute.Pointer,  # int32 [T, topk]
        main_idx_stride: Int64,  # elements
        main_topk: Int32,
        main_len: cute.Pointer,  # int32 [T] (read only when cfg.has_topk_length)
        extra_cache: cute.Pointer,
        extra_page: Int32,
        extra_page_magic: Int64,
        extra_block_stride: Int64,
        extra_num_slots: Int32,
        extra_idx: cute.Pointer,
        extra_idx_stride: Int64,
        extra_topk: Int32,  # 0 when there is no extra cache
        extra_len: cute.Pointer,
        sm_scale_log2: Float32,  # sm_scale * log2(e)
        chunks_per_split: Int32,
        num_splits: Int32,
        o_part: cute.Pointer,  # f32 [T, num_splits, H, 512] (partial mode)
        lse_part: cute.Pointer,  # f32 [T, num_splits, H], log2 units (partial mode)
        out: cute.Pointer,  # bf16 [T, H, 512], rows 8-byte aligned (final mode)
        out_stride_t: Int64,  # elements
        out_stride_h: Int64,
        lse: cute.Pointer,  # f32 [T, H], natural log (final mode)
        lse_stride_t: Int64,
        lse_stride_h: Int64,
        attn_sink: cute.Pointer,  # f32 [H] (final mode with cfg.has_sink)
        stream: cuda.CUstream,
    ):
        # bf16 tile [rows, 512] in 8x64 swizzled atoms: conflict-free ldmatrix, both ways.
        atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        kv_layout = cute.tile_to_shape(atom, (self.bn, D_QK), (0, 1))
        q_layout = cute.tile_to_shape(atom, (self.hb, D_QK), (0, 1))
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)),
            (1, 1, 1),
            permutation_mnk=(16, 16, 16),
        )
        # 16-byte stores of 8 bf16 into a [rows, 512] tile: threads (nthr/64, 64), values (1, 8).
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        tiled_store = cute.make_tiled_copy_tv(
            store_atom,
            cute.make_layout((self.nthr // 64, 64), stride=(64, 1)),
            cute.make_layout((1, 8)),
        )
        # the dequantization's pieces of DEQUANT_VALUES columns: threads (nthr/32, 32), values
        # (1, 16): one 16-byte load of FP8 and one scale per piece, two 16-byte stores
        tiled_dequant = cute.make_tiled_copy_tv(
            store_atom,
            cute.make_layout((self.nthr // (D_QK // DEQUANT_VALUES), D_QK // DEQUANT_VALUES),
                             stride=(D_QK // DEQUANT_VALUES, 1)),
            cute.make_layout((1, DEQUANT_VALUES)),
        )
        head_blocks = (num_heads + self.hb - 1) // self.hb
        self.kernel(
            q, q_stride_t, q_stride_h, num_heads,
            main_cache, main_page, main_page_magic, main_block_stride, main_num_slots,
            main_idx, main_idx_stride, main_topk, main_len,
            extra_cache, extra_page, extra_page_magic, extra_block_stride, extra_num_slots,
            extra_idx, extra_idx_stride, extra_topk, extra_len,
            sm_scale_log2, chunks_per_split, num_splits, o_part, lse_part,
            out, out_stride_t, out_stride_h, lse, lse_stride_t, lse_stride_h, attn_sink,
            kv_layout, q_layout, tiled_mma, tiled_store, tiled_dequant,
        ).launch(
            grid=(num_tokens * head_blocks, num_splits, 1),  # see _block_coords
            block=(self.nthr, 1, 1),
            stream=stream,
            # .minnctapersm: 1 lets ptxas use every register (without it, it capped the
            # one-group block-scaled FP8 kernel at 168 registers and spilled); see
            # PartialConfig.min_ctas_per_sm
            min_blocks_per_mp=self.cfg.min_ctas_per_sm,
            # several CTAs per SM: ask for the largest shared-memory carveout (given, the DSL
            # also need not ask a GPU for the SM's shared memory at compile time)
            preferred_smem_carveout=100 if self.cfg.min_ctas_per_sm > 1 else None,
        )

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(
        self,
        q: cute.Pointer,
        q_stride_t: Int64,
        q_stride_h: Int64,
        num_heads: Int32,
        main_cache: cute.Pointer,
        main_page: Int32,
        main_page_magic: Int64,
        main_block_stride: Int64,
        main_num_slots: Int32,
        main_idx: cute.Pointer,
        main_idx_stride: Int64,
        main_topk: Int32,
        main_len: cute.Pointer,
        extra_cache: cute.Pointer,
        extra_page: Int32,
        extra_page_magic: Int64,
        extra_block_stride: Int64,
        extra_num_slots: Int32,
        extra_idx: cute.Pointer,
        extra_idx_stride: Int64,
        extra_topk: Int32,
        extra_len: cute.Pointer,
        sm_scale_log2: Float32,
        chunks_per_split: Int32,
        num_splits: Int32,
        o_part: cute.Pointer,
        lse_part: cute.Pointer,
        out: cute.Pointer,
        out_stride_t: Int64,
        out_stride_h: Int64,
        lse: cute.Pointer,
        lse_stride_t: Int64,
        lse_stride_h: Int64,
        attn_sink: cute.Pointer,
        kv_layout: cute.ComposedLayout,
        q_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        tiled_store: cute.TiledCopy,
        tiled_dequant: cute.TiledCopy,
    ):
        bn, hb, hg = self.bn, self.hb, self.hg
        if const_expr(not self.cfg.final_output):
            # let the merge kernel (a programmatic dependent launch) get its CTAs onto the SMs
            # as this grid's last wave starts; it waits for this grid to finish before reading
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        token, head_block, split = self._block_coords(num_heads)
        warp_id = tidx // 32
        lane = tidx % 32
        group = warp_id // self.wpg  # which 16 heads of the CTA this warp computes
        wq = warp_id % self.wpg  # which 128-wide slice of QK and of the output
        head0 = head_block * hb
        ghead0 = head0 + group * hg  # first head of this warp's group

        # ---- shared memory: the bf16 KV tile (Q is staged in it first), then the gather's
        smem = SmemAllocator()
        sKV = smem.allocate_tensor(BFloat16, kv_layout, byte_alignment=1024)
        sQ = cute.make_tensor(sKV.iterator, q_layout)
        ctx = self._gather_context(
            smem, tidx, token, split, chunks_per_split,
            (main_cache, main_page, main_page_magic, main_block_stride, main_num_slots, main_idx, main_idx_stride,
             main_topk, main_len),
            (extra_cache, extra_page, extra_page_magic, extra_block_stride, extra_num_slots, extra_idx,
             extra_idx_stride, extra_topk, extra_len),
        )
        sMask, sS, c_begin, c_end = ctx.sMask, ctx.sS, ctx.c_begin, ctx.c_end
        # the epilogue's addresses, taken at the top level (see _gather_context)
        sink_addr, lse_part_addr, lse_addr = attn_sink.toint(), lse_part.toint(), lse.toint()
        self._stage_q(q, q_stride_t, q_stride_h, num_heads, token, head0, sQ, tiled_store, tidx)
        self._start_pipeline(ctx, c_begin, c_end)

        # ---- MMA partitions: warp w owns columns [w*wslice, (w+1)*wslice) of QK and of O
        thr_mma = tiled_mma.get_slice(lane)
        sQ_w = cute.local_tile(sQ, (hg, self.wslice), (group, wq))
        sK_w = cute.local_tile(sKV, (bn, self.wslice), (0, wq))
        sVt = cute.composition(sKV, cute.make_layout((D_QK, bn), stride=(bn, 1)))
        sVt_w = cute.local_tile(sVt, (self.wslice, bn), (wq, 0))

        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ_w))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK_w))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt_w))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((hg, self.wslice)), Float32)
        acc_O.fill(0.0)

        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), BFloat16)
        thr_ld_Q = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(lane)
        thr_ld_K = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(lane)
        thr_ld_V = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(lane)
        tSsQ = thr_ld_Q.partition_S(sQ_w)
        tSrQ_v = thr_ld_Q.retile(tSrQ)
        tSsK = thr_ld_K.partition_S(sK_w)
        tSrK_v = thr_ld_K.retile(tSrK)
        tOsVt = thr_ld_V.partition_S(sVt_w)
        tOrVt_v = thr_ld_V.retile(tOrVt)

        # Q stays in registers for the whole kernel.
        for k in cutlass.range_constexpr(cute.size(tSsQ, mode=[2])):
            cute.copy(ldsm, tSsQ[None, None, k], tSrQ_v[None, None, k])
        cute.arch.sync_threads()  # the KV tile is reused from here on

        # S exchange views and the (row, column) of each accumulator element
        tSsS = [thr_mma.partition_C(sS[None, None, w, group]) for w in range(self.wpg)]
        tScS = thr_mma.partition_C(cute.make_identity_tensor((hg, bn)))
        row_max = cute.make_rmem_tensor(2, Float32)  # rows g and g+8 of this thread
        row_sum = cute.make_rmem_tensor(2, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)

        # ---- dequantization partition of the KV tile (thread owns one 8-column group)
        thr_deq = tiled_dequant.get_slice(tidx)
        tXsKV = thr_deq.partition_D(sKV)
        tXcKV = thr_deq.partition_D(cute.make_identity_tensor((bn, D_QK)))

        ctx.tXsKV = tXsKV
        ctx.tXcKV = tXcKV

        # ---- main loop over the chunks of this split. Chunk c's rows were issued stages - 1
        # steps ahead and its indices stages steps ahead (``_next_chunk``).
        for c in cutlass.range(c_begin, c_end, 1, unroll=1):
            step = c - c_begin
            stage = step % self.stages  # raw row buffer of chunk c
            buf = step % self.slots  # index and validity-mask buffer of chunk c
            self._next_chunk(ctx, c, c_end, step)
            self._dequantize(ctx, stage)
            cute.arch.sync_threads()

            # S_w = Q_w K_w^T over this warp's slice of the QK width
            acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((hg, bn)), Float32)
            acc_S.fill(0.0)
            for k in cutlass.range_constexpr(cute.size(tSsK, mode=[2])):
                cute.copy(ldsm, tSsK[None, None, k], tSrK_v[None, None, k])
                cute.gemm(tiled_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
            for w in cutlass.range_constexpr(self.wpg):
                if wq == w:
                    cute.autovec_copy(acc_S, tSsS[w])
            if const_expr(self.groups > 1):  # only the group's own warps exchange S
                cute.arch.barrier(barrier_id=1 + group, number_of_threads=32 * self.wpg)
            else:
                cute.arch.sync_threads()
            # full S = sum of the warps' slices, in a fixed order (identical in every warp)
            acc_S.store(tSsS[0].load())
            for w in cutlass.range_constexpr(1, self.wpg):
                acc_S.store(acc_S.load() + tSsS[w].load())

            # online softmax in log2 units; invalid entries -> -inf
            valid_rows = sMask[buf]
            acc_S_mn = self._mn_view(acc_S)
            tScS_mn = self._mn_view(tScS)
            acc_O_mn = self._mn_view(acc_O)
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                for j in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                    col = tScS_mn[0, j][1]
                    s = acc_S_mn[r, j] * sm_scale_log2
                    if (valid_rows >> col) & 1 == 0:
                        s = -Float32.inf
                    acc_S_mn[r, j] = s
                m_chunk = acc_S_mn[r, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
                m_chunk = self._quad_allreduce(m_chunk, cute.arch.fmax)
                m_new = cute.arch.fmax(row_max[r], m_chunk)
                m_base = m_new
                if m_new == -Float32.inf:
                    m_base = Float32(0.0)
                correction = cute.math.exp2(row_max[r] - m_base, fastmath=True)
                p = cute.math.exp2(acc_S_mn[r, None].load() - m_base, fastmath=True)
                acc_S_mn[r, None] = p
                row_sum[r] = row_sum[r] * correction + p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                row_max[r] = m_new
                acc_O_mn[r, None] = acc_O_mn[r, None].load() * correction

            # O_w += P V_w
            rP = cute.make_fragment_like(acc_S, BFloat16)
            rP.store(acc_S.load().to(BFloat16))
            tOrP = self._acc_as_a_operand(rP)
            for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                cute.copy(ldsm_t, tOsVt[None, None, k], tOrVt_v[None, None, k])
                cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrVt[None, None, k], acc_O)

        # ---- epilogue. partial mode: normalized O (f32) and its log2 lse per split;
        # final mode (one split): out = O * gate (bf16) and the natural-log lse, sink applied.
        final = self.cfg.final_output
        acc_O_mn = self._mn_view(acc_O)
        tOcO_mn = self._mn_view(thr_mma.partition_C(cute.make_identity_tensor((hg, self.wslice))))
        o_row0 = (Int64(token) * num_splits + split) * num_heads
        if const_expr(final):
            gO = cute.make_tensor(
                cute.make_ptr(
                    BFloat16,
                    out.toint() + (Int64(token) * out_stride_t + Int64(ghead0) * out_stride_h + wq * self.wslice) * 2,
                    cute.AddressSpace.gmem, assumed_align=4,
                ),
                cute.make_layout((hg, self.wslice), stride=(out_stride_h, 1)),
            )
        else:
            gO = cute.make_tensor(
                cute.make_ptr(
                    Float32, o_part.toint() + ((o_row0 + ghead0) * D_QK + wq * self.wslice) * 4,
                    cute.AddressSpace.gmem, assumed_align=16,
                ),
                cute.make_layout((hg, self.wslice), stride=(D_QK, 1)),
            )
        tOgO_mn = self._mn_view(thr_mma.partition_C(gO))
        for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
            total = self._quad_allreduce(row_sum[r], lambda a, b: a + b)
            row = tOcO_mn[r, 0][0]
            if ghead0 + row < num_heads:
                gate, lse2 = self._gate_and_lse2(total, row_max[r], sink_addr, ghead0 + row)
                for j in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                    if const_expr(final):
                        tOgO_mn[r, j] = BFloat16(acc_O_mn[r, j] * gate)
                    else:
                        tOgO_mn[r, j] = acc_O_mn[r, j] * gate
                if wq == 0:  # one warp per group writes its heads' lse
                    if lane % 4 == 0:
                        self._store_lse(total, lse2, token, split, num_splits, num_heads, ghead0 + row,
                                        lse_part_addr, lse_addr, lse_stride_t, lse_stride_h)

    # ------------------------------------------------------------------ epilogue pieces
    @cute.jit
    def _block_coords(self, num_heads: Int32):
        """(token, head block, split) of this CTA. The grid's x runs over the head blocks of
        a token first: a token's head blocks, which gather the same rows, run at the same
        time, so all but the first find those rows in L2."""
        bx, split, _ = cute.arch.block_idx()
        head_blocks = (num_heads + self.hb - 1) // self.hb
        token = bx // head_blocks
        return token, bx - token * head_blocks, split

    @cute.jit
    def _gate_and_lse2(self, total: Float32, row_max: Float32, sink_addr: Int64, head: Int32):
        """(factor for the accumulated output row, lse in log2 units) of a head whose
        probabilities sum to ``total`` after the running max ``row_max``. An empty row (no
        valid entry) has total 0: factor 0 and lse -inf. The sink (``sink_addr``: attn_sink's
        address) is applied in final mode."""
        gate = Float32(0.0)
        lse2 = -Float32.inf
        if total > 0.0:
            gate = 1.0 / total
            lse2 = row_max + cute.math.log2(total, fastmath=False)
            if const_expr(self.cfg.final_output and self.cfg.has_sink):
                gate = gate * sink_gate(load_f32(sink_addr + Int64(head) * 4), lse2)
        return gate, lse2

    @cute.jit
    def _store_lse(self, total: Float32, lse2: Float32, token: Int32, split: Int32, num_splits: Int32,
                   num_heads: Int32, head: Int32, lse_part_addr: Int64, lse_addr: Int64,
                   lse_stride_t: Int64, lse_stride_h: Int64):
        """Write a head's lse: natural log (+inf for an empty row) in final mode, the split's
        log2 lse in partial mode (``lse_part_addr`` / ``lse_addr``: the tensors' addresses)."""
        if const_expr(self.cfg.final_output):
            lse_nat = Float32.inf
            if total > 0.0:
                lse_nat = lse2 * LN_2
            store_f32(lse_addr + (Int64(token) * lse_stride_t + Int64(head) * lse_stride_h) * 4, lse_nat)
        else:
            store_f32(lse_part_addr + ((Int64(token) * num_splits + split) * num_heads + head) * 4, lse2)

    # ------------------------------------------------------------------ prologue pieces
    def _allocate_s_exchange(self, smem):
        """The S exchange: per head group, each warp's partial S [16, block_n] (f32)."""
        hg, bn = self.hg, self.bn
        return smem.allocate_tensor(
            Float32,
            cute.make_layout((hg, bn, self.wpg, self.groups), stride=(bn, 1, hg * bn, self.wpg * hg * bn)),
            byte_alignment=16,
        )

    def _gather_context(self, smem, tidx, token, split, chunks_per_split, main: tuple, extra: tuple):
        """Allocate the gather's shared memory (raw stages, the S exchange, indices, validity
        masks) and gather what ``_issue_indices`` / ``_issue_rows`` read about the two lists;
        also this split's chunk range [c_begin, c_end). ``main`` / ``extra``: (cache, page,
        page division magic, block stride, num slots, indices, indices stride, topk, length
        pointer)."""
        bn = self.bn
        m_cache, m_page, m_magic, m_stride, m_slots, m_idx, m_idx_stride, m_topk, m_len = main
        e_cache, e_page, e_magic, e_stride, e_slots, e_idx, e_idx_stride, e_topk, e_len = extra
        n_main_chunks = (m_topk + bn - 1) // bn
        n_chunks = n_main_chunks + (e_topk + bn - 1) // bn
        c_begin = split * chunks_per_split
        m_limit, e_limit = self._length_limits(m_len, m_topk, e_len, e_topk, token)
        sRaw = smem.allocate_tensor(Uint8, cute.make_layout(self.stages * self.stage_bytes), byte_alignment=128)
        sS = self._allocate_s_exchange(smem)
        sMask = smem.allocate_tensor(Int32, cute.make_layout(self.slots), byte_alignment=16)
        sIdx = smem.allocate_tensor(Int32, cute.make_layout((bn, self.slots)), byte_alignment=16)
        return SimpleNamespace(
            c_begin=c_begin, c_end=cutlass.min(c_begin + chunks_per_split, n_chunks), sS=sS,
            # addresses taken here, at the top level: an iterator's toint() first evaluated
            # inside a dynamic if is reused by later evaluations outside it (IR that does not verify)
            tidx=tidx, n_main_chunks=n_main_chunks, raw_base=sRaw.iterator.toint(), sMask=sMask, sIdx=sIdx,
            sidx_base=sIdx.iterator.toint(),
            main_idx_row=m_idx.toint() + Int64(token) * m_idx_stride * 4, main_topk=m_topk, main_limit=m_limit,
            main_num_slots=m_slots, main_page=m_page, main_page_magic=m_magic, main_block_stride=m_stride,
            main_base=m_cache.toint(),
            extra_idx_row=e_idx.toint() + Int64(token) * e_idx_stride * 4, extra_topk=e_topk, extra_limit=e_limit,
            extra_num_slots=e_slots, extra_page=e_page, extra_page_magic=e_magic, extra_block_stride=e_stride,
            extra_base=e_cache.toint(),
            g2s_4=cute.make_copy_atom(cpasync.CopyG2SOp(), Int32, num_bits_per_copy=32),
        )

    @cute.jit
    def _length_limits(self, main_len: cute.Pointer, main_topk: Int32, extra_len: cute.Pointer,
                       extra_topk: Int32, token: Int32):
        """How many leading entries of each list count for ``token`` (topk_length clamped to
        [0, topk], or topk when the call has no length tensor)."""
        main_limit = main_topk
        if const_expr(self.cfg.has_topk_length):
            main_limit = cutlass.max(cutlass.min(load_i32(main_len.toint() + Int64(token) * 4), main_topk), 0)
        extra_limit = extra_topk
        if const_expr(self.cfg.has_extra_topk_length):
            extra_limit = cutlass.max(cutlass.min(load_i32(extra_len.toint() + Int64(token) * 4), extra_topk), 0)
        return main_limit, extra_limit

    @cute.jit
    def _stage_q(self, q: cute.Pointer, q_stride_t: Int64, q_stride_h: Int64, num_heads: Int32, token: Int32,
                 head0: Int32, sQ: cute.Tensor, tiled_store: cute.TiledCopy, tidx: Int32):
        """Start the cp.async of Q [heads_per_cta, 512] into ``sQ`` (rows >= H are zero-filled,
        never read); ``_start_pipeline`` commits and waits for it."""
        thr_store = tiled_store.get_slice(tidx)
        tQsQ = thr_store.partition_D(sQ)
        tQcQ = thr_store.partition_D(cute.make_identity_tensor((self.hb, D_QK)))
        for i in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
            row = tQcQ[(0, 0), i, 0][0]
            col = tQcQ[(0, 0), i, 0][1]
            if head0 + row < num_heads:
                addr = q.toint() + (Int64(token) * q_stride_t + Int64(head0 + row) * q_stride_h + Int64(col)) * 2
                src = cute.make_tensor(
                    cute.make_ptr(BFloat16, addr, cute.AddressSpace.gmem, assumed_align=16), cute.make_layout(8)
                )
                cute.copy(cute.make_copy_atom(cpasync.CopyG2SOp(), BFloat16, num_bits_per_copy=128), src, tQsQ[None, i, 0])
            else:
                tQsQ[None, i, 0].fill(0.0)

    @cute.jit
    def _start_pipeline(self, ctx: SimpleNamespace, c_begin: Int32, c_end: Int32):
        """The first ``index_chunks`` chunks' indices (cp.async, in the same group as Q), a
        wait for them and Q (visible to every thread on return), then the first ``stages - 1``
        chunks' rows (in flight, one cp.async group each)."""
        for k in cutlass.range_constexpr(self.index_chunks):
            if c_begin + k < c_end:
                self._issue_indices(ctx, c_begin + k, Int32(k))
        cute.arch.cp_async_commit_group()  # group: Q and the first indices
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # Q and the indices visible
        for k in cutlass.range_constexpr(self.stages - 1):
            if c_begin + k < c_end:
                self._issue_rows(ctx, c_begin + k, Int32(k), Int32(k))
            cute.arch.cp_async_commit_group()  # group: rows of chunk c_begin + k

    # ------------------------------------------------------------------ per-chunk stages
    @cute.jit
    def _next_chunk(self, ctx: SimpleNamespace, c: Int32, c_end: Int32, step: Int32, issue: cutlass.Constexpr = True):
        """The head of every partial kernel's chunk loop: wait for chunk c's rows and for
        chunk c + stages - 1's indices (and, by the barrier, for every warp to be done with
        chunk c - 1, whose buffers are reused), then start chunk c + stages's indices and
        chunk c + stages - 1's rows, in two cp.async groups in that order. The wait leaves
        the newest stages - 2 groups in flight: with 2 stages none, with 3 the rows of chunk
        c + 1 (issued after the indices now needed, which is why the indices go first).
        ``issue=False``: only the barrier (the f16 kernel: its nope warps issue no copies,
        its rope warp waits and issues on its own schedule, ``_rope_role``)."""
        if const_expr(issue):
            cute.arch.cp_async_wait_group(self.stages - 2)
        cute.arch.sync_threads()
        if const_expr(issue):
            ahead = self.stages - 1
            if c + ahead + 1 < c_end:
                self._issue_indices(ctx, c + ahead + 1, (step + ahead + 1) % self.slots)
            cute.arch.cp_async_commit_group()
            if c + ahead < c_end:
                self._issue_rows(ctx, c + ahead, (step + ahead) % self.stages, (step + ahead) % self.slots)
            cute.arch.cp_async_commit_group()

    @cute.jit
    def _chunk_source(self, ctx: SimpleNamespace, c: Int32):
        """Where chunk ``c``'s entries live: (first list position, index row address, list
        length (topk), length limit, slots in the cache, page block size, its division magic
        (``cache_format.page_division_magic``), block stride, cache base address)."""
        pos0 = c * self.bn
        idx_row = ctx.main_idx_row
        topk = ctx.main_topk
        limit = ctx.main_limit
        num_slots = ctx.main_num_slots
        page = ctx.main_page
        magic = ctx.main_page_magic
        block_stride = ctx.main_block_stride
        base = ctx.main_base
        if c >= ctx.n_main_chunks:
            pos0 = (c - ctx.n_main_chunks) * self.bn
            idx_row = ctx.extra_idx_row
            topk = ctx.extra_topk
            limit = ctx.extra_limit
            num_slots = ctx.extra_num_slots
            page = ctx.extra_page
            magic = ctx.extra_page_magic
            block_stride = ctx.extra_block_stride
            base = ctx.extra_base
        return pos0, idx_row, topk, limit, num_slots, page, magic, block_stride, base

    @cute.jit
    def _issue_indices(self, ctx: SimpleNamespace, c: Int32, buf: Int32):
        """Threads INDEX_THREAD0 .. + block_n - 1 start the cp.async of one index of chunk ``c`` each into
        ``sIdx[:, buf]`` (positions past topk are not read: they are outside the index row).

        Asynchronous so that no thread waits on a global load in the main loop; the indices
        are checked when the rows are issued (``_valid_slot``)."""
        e = ctx.tidx - self.INDEX_THREAD0
        pos0, idx_row, topk, _, _, _, _, _, _ = self._chunk_source(ctx, c)
        if e >= 0:
            if e < self.bn:
                if pos0 + e < topk:
                    src = cute.make_tensor(
                        cute.make_ptr(Int32, idx_row + Int64(pos0 + e) * 4, cute.AddressSpace.gmem, assumed_align=4),
                        cute.make_layout(1),
                    )
                    dst = cute.make_tensor(
                        cute.make_ptr(Int32, ctx.sidx_base + (buf * self.bn + e) * 4,
                                      cute.AddressSpace.smem, assumed_align=4),
                        cute.make_layout(1),
                    )
                    cute.copy(ctx.g2s_4, src, dst)

    @cute.jit
    def _valid_slot(self, ctx: SimpleNamespace, e: Int32, buf: Int32, pos0: Int32, limit: Int32,
                    num_slots: Int32) -> Int32:
        """The cache slot of entry ``e`` of a chunk whose indices landed in ``sIdx[:, buf]``,
        or -1 when the entry does not count (past the length limit, -1, or outside the cache)."""
        sIdx = ctx.sIdx
        slot = Int32(-1)
        if pos0 + e < limit:
            v = sIdx[e, buf]
            if v >= 0:
                if v < num_slots:
                    slot = v
        return slot

    @staticmethod
    def _row_location(slot: Int32, page: Int32, magic: Int64, block_stride: Int64, base: Int64):
        """(row address, scales address) of cache slot ``slot`` (>= 0) in a paged cache at
        ``base``: rows first in each page block, the scales in its footer. The block is
        slot // page by the host's multiplier (``cache_format.page_division_magic``)."""
        blk = Int32((Int64(slot) * (magic & 0xFFFFFFFF)) >> (magic >> 32))
        off = slot - blk * page
        block_addr = base + Int64(blk) * block_stride
        return block_addr + Int64(off) * ROW_BYTES, block_addr + Int64(page) * ROW_BYTES + Int64(off) * SCALE_BYTES

    @cute.jit
    def _issue_rows(self, ctx: SimpleNamespace, c: Int32, stage: Int32, buf: Int32):
        """Start the cp.async gather of chunk ``c``'s rows and scales; its indices landed in
        ``sIdx[:, buf]``. Warp 0 also records which entries count as a bit mask in
        ``sMask[buf]`` (bit e: entry e is read), for the dequantization and the softmax.

        The threads_per_row = num_threads / block_n consecutive threads of a row check its
        index and locate it once (one division by the runtime page size per thread), then
        issue every threads_per_row-th 16-byte piece: one warp-wide copy still covers 64
        contiguous bytes of each of its rows. An invalid entry's row and scales become zeros
        by the same copies (src-size 0: nothing is read, at slot 0's address), which the
        kernels multiplying the raw rows need (probability 0 times stale bytes that decode
        as NaN is NaN)."""
        tidx, sMask = ctx.tidx, ctx.sMask
        tpr = self.nthr // self.bn
        pieces = ROW_BYTES // 16
        pos0, _, _, limit, num_slots, page, magic, block_stride, base = self._chunk_source(ctx, c)
        stage_base = ctx.raw_base + stage * self.stage_bytes
        e = tidx // tpr
        r = tidx % tpr
        slot = self._valid_slot(ctx, e, buf, pos0, limit, num_slots)
        if tidx < 32:  # warp 0: the validity mask (block_n == 32: one bit per lane)
            mask = cute.arch.vote_ballot_sync(self._valid_slot(ctx, tidx, buf, pos0, limit, num_slots) >= 0)
            if tidx == 0:
                sMask[buf] = mask
        row_addr, scale_addr = self._row_location(cutlass.max(slot, 0), page, magic, block_stride, base)
        nbytes = Int32(slot >= 0) * 16
        dst = stage_base + e * RAW_ROW_STRIDE
        for k in cutlass.range_constexpr((pieces + tpr - 1) // tpr):
            piece = r + k * tpr
            if const_expr((k + 1) * tpr <= pieces):  # every thread has this piece
                cp_async_zfill(dst + piece * 16, row_addr + piece * 16, 16, nbytes)
            else:
                if piece < pieces:
                    cp_async_zfill(dst + piece * 16, row_addr + piece * 16, 16, nbytes)
        if r == tpr - 1:  # the row's scales: by the thread with the fewest pieces
            cp_async_zfill(stage_base + self.scale_off + e * SCALE_BYTES, scale_addr, SCALE_BYTES, nbytes // 2)

    @cute.jit
    def _dequantize(self, ctx: SimpleNamespace, stage: Int32):
        """Dequantize a landed raw stage into the bf16 KV tile. An invalid entry's row and
        scales arrived as zeros (``_issue_rows``), so it dequantizes to a row of 0 with no test."""
        tXsKV, tXcKV = ctx.tXsKV, ctx.tXcKV
        stage_base = ctx.raw_base + stage * self.stage_bytes
        for i in cutlass.range_constexpr(cute.size(tXsKV, mode=[1])):
            row = tXcKV[(0, 0), i, 0][0]
            col = tXcKV[(0, 0), i, 0][1]
            dst = tXsKV[None, i, 0]
            if col < D_NOPE:
                f8 = cute.make_tensor(
                    cute.make_ptr(Float8E4M3FN, stage_base + row * RAW_ROW_STRIDE + col, cute.AddressSpace.smem,
                                  assumed_align=16),
                    cute.make_layout(DEQUANT_VALUES),
                )
                sb = load_smem_u8(stage_base + self.scale_off + row * SCALE_BYTES + col // TILE)
                dst.store((f8.load().to(Float32) * ue8m0_scale(sb)).to(BFloat16))
            else:
                rope = cute.make_tensor(
                    cute.make_ptr(BFloat16, stage_base + row * RAW_ROW_STRIDE + D_NOPE + (col - D_NOPE) * 2,
                                  cute.AddressSpace.smem, assumed_align=16),
                    cute.make_layout(DEQUANT_VALUES),
                )
                dst.store(rope.load())

    # ------------------------------------------------------------------ layout helpers
    @staticmethod
    def _mn_view(acc: cute.Tensor) -> cute.Tensor:
        """View an m16n8 accumulator fragment ((2, 2), M, N) as (rows, columns) of this thread."""
        lay = cute.make_layout(acc.layout.shape)
        mn = cute.make_layout(
            ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
            stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])),
        )
        return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))

    @staticmethod
    def _acc_as_a_operand(rP: cute.Tensor) -> cute.Tensor:
        """Regroup an m16n8 accumulator ((2, 2), M, N) as the A operand ((2, 2, 2), M, N / 2) of m16n8k16."""
        div = cute.logical_divide(rP.layout, (None, None, 2))
        lay = cute.make_layout(
            ((div.shape[0], div.shape[2][0]), div.shape[1], div.shape[2][1]),
            stride=((div.stride[0], div.stride[2][0]), div.stride[1], div.stride[2][1]),
        )
        return cute.make_tensor(rP.iterator, lay)

    @staticmethod
    def _quad_allreduce(val, op):
        """Reduce over the 4 threads of an MMA quad (they hold the same rows)."""
        val = op(val, cute.arch.shuffle_sync_bfly(val, offset=2, mask=-1, mask_and_clamp=31))
        val = op(val, cute.arch.shuffle_sync_bfly(val, offset=1, mask=-1, mask_and_clamp=31))
        return val
