"""The gather pipeline every partial kernel shares: selected cache rows into shared memory.

The chunks of a token are numbered main list first, then extra: chunk c < ceil(topk / 32)
reads the main cache, the rest the extra cache (with a length tensor, only up to the last chunk
the token's lengths reach, dealt out across the splits: ``bound_chunks``). A CTA walks the chunks
of its split [c_begin, c_end) (with a length tensor, the chunks split, split + S, ...). Per chunk:

- indices: one 4-byte ``cp.async`` per entry into an index buffer (``slot_buffers`` of them,
  indexed by step), ``stages`` (or ``stages + 1``) chunks ahead of its compute, so that no
  thread ever waits on a global load in the loop;
- validity: an entry counts when it lies before the token's length (clamped to [0, topk]),
  is not -1 and is a slot inside the cache; a ballot over the 32 entries gives the chunk's
  mask (bit e: entry e is read);
- rows: each counting entry's row (the format's ``row_bytes``: 576 for MODEL1, 36 x 16-byte
  ``cp.async``) and, for a footer format, its scale record land in a raw stage (rows
  ``raw_row_stride`` bytes apart, then the scale records), ``stages - 1`` chunks ahead. An
  entry that does not count is zero-filled by the same copies (src-size 0: nothing is read),
  which the kernels multiplying raw rows need (probability 0 times stale bytes that decode as
  NaN is NaN).

The row of slot s lives in page block s // page (the division by the host's multiplier,
``cache_view.page_division_magic``), at ``block * block_stride + (s % page) * row_stride``
(a footer format: ``row_bytes``, a compile-time constant); a footer format's scales sit in
the block's footer at ``page * row_bytes + (s % page) * footer_bytes``.

Two issuing forms: every thread of the CTA (``issue_rows``: a row's ``num_threads / 32``
threads locate it once and copy every such-th piece), or one warp (``locate_rows`` then
``copy_rows``: lane l locates entry l; lane 4r + p copies pieces p, p + 4, .. of each 8-entry
group's row r), which the "f16" kernel's rope warp uses in its main loop.

Tracing note (CuTe DSL 4.8.1): a namespace of DSL values passed into a helper with a dynamic
branch has its entries rebound to the branch's results, which then escape their region (IR
that does not verify): helpers read such attributes into locals before a branch, and each
warp role of a kernel gets its own copy of the namespace.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from .config import PartialConfig
from .device_utils import cp_async_zfill, load_i32


class ChunkGather:
    """The gather of one ``PartialConfig``. ``index_thread0``: the first of the 32 threads
    that issue a chunk's indices; ``index_chunks``: chunks whose indices the prologue issues
    (at most ``slot_buffers``)."""

    def __init__(self, cfg: PartialConfig, index_thread0: int = 0, index_chunks: int | None = None):
        self.cfg = cfg
        self.fmt = cfg.fmt
        self.row_pitch = cfg.fmt.raw_row_stride  # bytes between rows in a stage
        self.bn = cfg.block_n
        self.nthr = cfg.num_threads
        self.stages = cfg.stages
        self.slots = cfg.slot_buffers
        self.stage_bytes = cfg.stage_bytes
        self.scale_off = cfg.block_n * self.row_pitch  # a footer format's scale records follow the rows
        # entry e's scale record in a stage: at scale_start + e * scale_pitch (inline: in the row)
        self.scale_start = cfg.fmt.scale_offset if cfg.fmt.inline else self.scale_off
        self.scale_pitch = self.row_pitch if cfg.fmt.inline else cfg.fmt.footer_bytes
        self.index_thread0 = index_thread0
        self.index_chunks = cfg.stages if index_chunks is None else index_chunks
        assert self.index_chunks <= self.slots

    # ------------------------------------------------------------------ set-up
    def context(self, alloc, s_exchange_layout, tidx, token, split, p) -> SimpleNamespace:
        """Allocate the gather's shared memory (after the compute path's own regions: raw
        stages, the S exchange laid out as ``s_exchange_layout``, validity masks, indices)
        and gather what the issuing steps read about the two lists into a namespace, with the
        first chunk of this split's loop (``c_begin``) and the S exchange tensor ``sS``. The
        token's lengths are loaded here but not yet used: ``bound_chunks`` makes the loop's end
        and the lists' limits of them once the first indices (and Q) have landed
        (``wait_first_indices``), so that nothing issued before that waits for the lengths'
        round trip (a use of a length before a copy's issue makes the copy wait for it)."""
        bn = self.bn
        n_main_chunks = (p.main_topk + bn - 1) // bn
        n_chunks = n_main_chunks + (p.extra_topk + bn - 1) // bn
        main_len = extra_len = None
        if const_expr(self.cfg.has_topk_length):
            main_len = load_i32(p.main_len.toint() + Int64(token) * 4)
        if const_expr(self.cfg.has_extra_topk_length):
            extra_len = load_i32(p.extra_len.toint() + Int64(token) * 4)
        if const_expr(self.cfg.has_topk_length or self.cfg.has_extra_topk_length):
            # split s of S takes chunks s, s + S, ... of those the lengths reach
            # (``bound_chunks``); the loop's c counts this split's chunks
            _, launch_splits, _ = cute.arch.grid_dim()
            c_begin = Int32(0)
            c_listed = None  # (the first indices: up to the lists' widths, ``issue_first_indices``)
            dealt = (split, launch_splits)
        else:
            # the plan's contiguous range; the loop's c is the chunk itself
            c_begin = split * p.chunks_per_split
            c_listed = cutlass.min(c_begin + p.chunks_per_split, n_chunks)
            dealt = None
        sRaw = alloc.allocate("raw_rows", cutlass.Uint8, cute.make_layout(self.stages * self.stage_bytes))
        sS = alloc.allocate("s_exchange", cutlass.Float32, s_exchange_layout)
        sMask = alloc.allocate("masks", Int32, cute.make_layout(self.slots))
        sIdx = alloc.allocate("indices", Int32, cute.make_layout((bn, self.slots)))
        return SimpleNamespace(
            c_begin=c_begin, c_listed=c_listed, dealt=dealt, sS=sS, n_chunks=n_chunks, lengths=(main_len, extra_len),
            # addresses taken here, at the top level: an iterator's toint() first evaluated
            # inside a dynamic if is reused by later evaluations outside it (IR that does not verify)
            tidx=tidx, n_main_chunks=n_main_chunks, raw_base=sRaw.iterator.toint(), sMask=sMask, sIdx=sIdx,
            sidx_base=sIdx.iterator.toint(),
            # per list: (index row address, topk, slots, page, its division magic, block stride,
            # cache base address[, row stride]); ``bound_chunks`` adds the length limit
            main_where=(p.main_idx.toint() + Int64(token) * p.main_idx_stride * 4, p.main_topk,
                        p.main_num_slots, p.main_page, p.main_page_magic, p.main_block_stride, p.main_cache.toint())
            + ((p.main_row_stride,) if self.fmt.inline else ()),
            extra_where=(p.extra_idx.toint() + Int64(token) * p.extra_idx_stride * 4, p.extra_topk,
                         p.extra_num_slots, p.extra_page, p.extra_page_magic, p.extra_block_stride,
                         p.extra_cache.toint()) + ((p.extra_row_stride,) if self.fmt.inline else ()),
            g2s_4=cute.make_copy_atom(cpasync.CopyG2SOp(), Int32, num_bits_per_copy=32),
        )

    def bound_chunks(self, ctx: SimpleNamespace):
        """After ``wait_first_indices``: how many leading entries of each list count for the
        token (topk_length clamped to [0, topk], or topk when the call has no length tensor),
        into the lists ``chunk_source`` reads (``ctx.main_list``, ``ctx.extra_list``), and the
        range [c_begin, c_end) of this split's chunk loop, which it returns.

        With a length tensor: up to the last chunk this token's lengths reach (the extra list's
        first ceil(e_limit / bn) after every main chunk; with no extra list, the main list's
        first ceil(m_limit / bn)), the chunks dealt out across the splits: split s of S takes
        chunks s, s + S, s + 2S, ... A list wider than its lengths (vLLM's ratio-128 rows, 8192
        wide with about seq / 128 valid) costs what its valid entries cost, spread over as many
        CTAs as it has live chunks (in contiguous ranges a few splits would walk them all); a
        split past them writes an empty partial. The loop's c counts this split's chunks (chunk
        split + c * S): split, S and c stay in uniform registers; only the count reads the
        lengths."""
        bn = self.bn
        main_topk, extra_topk = ctx.main_where[1], ctx.extra_where[1]
        main_len, extra_len = ctx.lengths
        m_limit = main_topk if main_len is None else cutlass.max(cutlass.min(main_len, main_topk), 0)
        e_limit = extra_topk if extra_len is None else cutlass.max(cutlass.min(extra_len, extra_topk), 0)
        ctx.main_list = ctx.main_where[:2] + (m_limit,) + ctx.main_where[2:]
        ctx.extra_list = ctx.extra_where[:2] + (e_limit,) + ctx.extra_where[2:]
        if const_expr(ctx.dealt is not None):
            split, launch_splits = ctx.dealt
            has_extra = cutlass.min(extra_topk, 1)  # 0 or 1
            live = (has_extra * (ctx.n_main_chunks + (e_limit + bn - 1) // bn)
                    + (1 - has_extra) * ((m_limit + bn - 1) // bn))
            ahead = cutlass.max(live - split, 0)  # live <= n_chunks: the limits are clamped to topk
            c_end = (ahead + launch_splits - 1) // launch_splits
        else:
            c_end = ctx.c_listed
        return ctx.c_begin, c_end

    @cute.jit
    def issue_first_indices(self, ctx: SimpleNamespace, c_begin: Int32):
        """The cp.async of the first ``index_chunks`` chunks' indices (not yet committed:
        ``wait_first_indices`` commits them). A kernel issues them right after ``context``,
        before Q: the first rows wait for them, and with L2 cold (decode) their round trip and
        the rows' are the two a CTA cannot overlap. With a length tensor they are bounded by the
        lists' widths, not the lengths, so that they are in flight with the lengths' load
        (indices past a length are read, not used): chunk split + k S of the dealt chunks, if
        there is one (a compare, not the division by S that the loop's count takes)."""
        c_listed = ctx.c_listed
        n_chunks = ctx.n_chunks
        for k in cutlass.range_constexpr(self.index_chunks):
            if const_expr(ctx.dealt is not None):
                listed = self._chunk_position(ctx, c_begin + k)[1] < n_chunks
            else:
                listed = c_begin + k < c_listed
            if listed:
                self.issue_indices(ctx, c_begin + k, Int32(k))

    def wait_first_indices(self):
        """After ``issue_first_indices``: one cp.async group of the first indices and any
        copies the kernel issued since (such as Q), and a wait for it, visible to every thread
        on return. The lengths are an ordinary load issued before the indices, not part of
        the group: most likely landed by then, and ``bound_chunks``, which comes next and is
        their first use, waits for them if not."""
        cute.arch.cp_async_commit_group()  # group: the first indices (and Q)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # the indices visible

    @cute.jit
    def start_pipeline(self, ctx: SimpleNamespace, c_begin: Int32, c_end: Int32):
        """After ``bound_chunks``: the first ``stages - 1`` chunks' rows by every thread (in
        flight, one cp.async group each)."""
        for k in cutlass.range_constexpr(self.stages - 1):
            if c_begin + k < c_end:
                self.issue_rows(ctx, c_begin + k, Int32(k), Int32(k))
            cute.arch.cp_async_commit_group()  # group: rows of chunk c_begin + k

    # ------------------------------------------------------------------ per chunk
    @cute.jit
    def next_chunk(self, ctx: SimpleNamespace, c: Int32, c_end: Int32, step: Int32, issue: cutlass.Constexpr = True):
        """The head of every partial kernel's chunk loop: wait for chunk c's rows and for
        chunk c + stages - 1's indices (and, by the barrier, for every warp to be done with
        chunk c - 1, whose buffers are reused), then start chunk c + stages's indices and
        chunk c + stages - 1's rows, in two cp.async groups in that order. The wait leaves
        the newest stages - 2 groups in flight: with 2 stages none, with 3 the rows of chunk
        c + 1 (issued after the indices now needed, which is why the indices go first).
        ``issue=False``: only the barrier (for warps that issue no copies, or issue them on
        their own schedule)."""
        if const_expr(issue):
            cute.arch.cp_async_wait_group(self.stages - 2)
        cute.arch.sync_threads()
        if const_expr(issue):
            ahead = self.stages - 1
            if c + ahead + 1 < c_end:
                self.issue_indices(ctx, c + ahead + 1, (step + ahead + 1) % self.slots)
            cute.arch.cp_async_commit_group()
            if c + ahead < c_end:
                self.issue_rows(ctx, c + ahead, (step + ahead) % self.stages, (step + ahead) % self.slots)
            cute.arch.cp_async_commit_group()

    @cute.jit
    def chunk_source(self, ctx: SimpleNamespace, c: Int32):
        """Where the loop's chunk ``c``'s entries live (chunks dealt out across the splits:
        chunk ``split + c * S``, see ``bound_chunks``): (first list position, index row address,
        list length (topk), length limit, slots in the cache, page block size, its division
        magic, block stride, cache base address, row stride (``row_bytes`` for a footer
        format)). After ``bound_chunks``."""
        pos0, chunk = self._chunk_position(ctx, c)
        if const_expr(self.fmt.inline):
            idx_row, topk, limit, num_slots, page, magic, block_stride, base, row_stride = ctx.main_list
            if chunk >= ctx.n_main_chunks:
                pos0 = (chunk - ctx.n_main_chunks) * self.bn
                idx_row, topk, limit, num_slots, page, magic, block_stride, base, row_stride = ctx.extra_list
        else:
            idx_row, topk, limit, num_slots, page, magic, block_stride, base = ctx.main_list
            if chunk >= ctx.n_main_chunks:
                pos0 = (chunk - ctx.n_main_chunks) * self.bn
                idx_row, topk, limit, num_slots, page, magic, block_stride, base = ctx.extra_list
            row_stride = self.fmt.row_bytes
        return pos0, idx_row, topk, limit, num_slots, page, magic, block_stride, base, row_stride

    @cute.jit
    def index_source(self, ctx: SimpleNamespace, c: Int32):
        """Where the loop's chunk ``c``'s indices live: (first list position, index row
        address, list length (topk)). Needs no length: also before ``bound_chunks``."""
        pos0, chunk = self._chunk_position(ctx, c)
        idx_row, topk = ctx.main_where[0], ctx.main_where[1]
        if chunk >= ctx.n_main_chunks:
            pos0 = (chunk - ctx.n_main_chunks) * self.bn
            idx_row, topk = ctx.extra_where[0], ctx.extra_where[1]
        return pos0, idx_row, topk

    def _chunk_position(self, ctx: SimpleNamespace, c: Int32):
        """(first position of chunk ``c`` in the concatenated lists, the chunk's number)."""
        chunk = c
        if const_expr(ctx.dealt is not None):
            first, stride = ctx.dealt
            chunk = first + c * stride
        return chunk * self.bn, chunk

    @cute.jit
    def issue_indices(self, ctx: SimpleNamespace, c: Int32, buf: Int32):
        """Threads index_thread0 .. + block_n - 1 start the cp.async of one index of chunk
        ``c`` each into ``sIdx[:, buf]`` (positions past topk are not read: they are outside
        the index row). The indices are checked when the rows are issued (``valid_slot``)."""
        e = ctx.tidx - self.index_thread0
        pos0, idx_row, topk = self.index_source(ctx, c)
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
    def valid_slot(self, ctx: SimpleNamespace, e: Int32, buf: Int32, pos0: Int32, limit: Int32,
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

    def row_location(self, slot: Int32, page: Int32, magic: Int64, block_stride: Int64, base: Int64, row_stride):
        """(row address, scale record address) of cache slot ``slot`` (>= 0) in a paged cache
        at ``base``; the scale record address is None for an inline format (the scales come with
        the row). The block is slot // page by the host's multiplier
        (``cache_view.page_division_magic``)."""
        fmt = self.fmt
        blk = Int32((Int64(slot) * (magic & 0xFFFFFFFF)) >> (magic >> 32))
        off = slot - blk * page
        block_addr = base + Int64(blk) * block_stride
        if fmt.inline:
            return block_addr + Int64(off) * row_stride, None
        return (block_addr + Int64(off) * fmt.row_bytes,
                block_addr + Int64(page) * fmt.row_bytes + Int64(off) * fmt.footer_bytes)

    @cute.jit
    def issue_rows(self, ctx: SimpleNamespace, c: Int32, stage: Int32, buf: Int32):
        """Every thread: start the cp.async gather of chunk ``c``'s rows and scales; its
        indices landed in ``sIdx[:, buf]``. Warp 0 also records which entries count as a bit
        mask in ``sMask[buf]``. The threads_per_row = num_threads / block_n consecutive threads
        of a row check its index and locate it once, then issue every threads_per_row-th
        16-byte piece: one warp-wide copy still covers 64 contiguous bytes of each of its rows."""
        tidx, sMask = ctx.tidx, ctx.sMask
        tpr = self.nthr // self.bn
        pieces = self.fmt.row_bytes // 16
        pos0, _, _, limit, num_slots, page, magic, block_stride, base, row_stride = self.chunk_source(ctx, c)
        stage_base = ctx.raw_base + stage * self.stage_bytes
        e = tidx // tpr
        r = tidx % tpr
        slot = self.valid_slot(ctx, e, buf, pos0, limit, num_slots)
        if tidx < 32:  # warp 0: the validity mask (block_n == 32: one bit per lane)
            mask = cute.arch.vote_ballot_sync(self.valid_slot(ctx, tidx, buf, pos0, limit, num_slots) >= 0)
            if tidx == 0:
                sMask[buf] = mask
        row_addr, scale_addr = self.row_location(cutlass.max(slot, 0), page, magic, block_stride, base, row_stride)
        nbytes = Int32(slot >= 0) * 16
        dst = stage_base + e * self.row_pitch
        for k in cutlass.range_constexpr((pieces + tpr - 1) // tpr):
            piece = r + k * tpr
            if const_expr((k + 1) * tpr <= pieces):  # every thread has this piece
                cp_async_zfill(dst + piece * 16, row_addr + piece * 16, 16, nbytes)
            else:
                if piece < pieces:
                    cp_async_zfill(dst + piece * 16, row_addr + piece * 16, 16, nbytes)
        if const_expr(not self.fmt.inline):
            if r == tpr - 1:  # the row's scale record: by the thread with the fewest pieces
                self._copy_scales(stage_base + self.scale_off + e * self.fmt.footer_bytes, scale_addr, nbytes // 16)

    # ------------------------------------------------------------------ one-warp form
    @cute.jit
    def locate_rows(self, ctx: SimpleNamespace, c: Int32, buf: Int32):
        """One warp: (validity mask, this lane's row address, its scales' address) of chunk
        ``c``, whose indices are in ``sIdx[:, buf]``; the mask also into ``sMask[buf]`` (by the
        warp's lane 0, thread ``index_thread0``). An invalid entry gets slot 0's addresses (the
        copies read nothing)."""
        tidx, sMask = ctx.tidx, ctx.sMask
        lane = tidx % 32
        pos0, _, _, limit, num_slots, page, magic, block_stride, base, row_stride = self.chunk_source(ctx, c)
        slot = self.valid_slot(ctx, lane, buf, pos0, limit, num_slots)
        mask = cute.arch.vote_ballot_sync(slot >= 0)
        if tidx == self.index_thread0:
            sMask[buf] = mask
        row_addr, scale_addr = self.row_location(cutlass.max(slot, 0), page, magic, block_stride, base, row_stride)
        return mask, row_addr, scale_addr

    def copy_rows(self, stage_base, located, lane, groups, scales: bool):
        """One warp: cp.async of the 8-entry groups ``groups`` of a located chunk
        (``locate_rows``) into the stage at ``stage_base``; ``scales``: also each lane's
        entry's scale record (a footer format). Lane 4r + p copies pieces p, p + 4, .. of the
        group's entry r (each warp-wide copy: 64 contiguous bytes of 8 rows)."""
        mask, row_addr, scale_addr = located
        if scales and not self.fmt.inline:
            self._copy_scales(stage_base + self.scale_off + lane * self.fmt.footer_bytes, scale_addr,
                              (mask >> lane) & 1)
        addr_lo = Int32(row_addr & 0xFFFFFFFF)
        addr_hi = Int32(row_addr >> 32)
        r = lane // 4
        p = lane % 4
        pieces = self.fmt.row_bytes // 16
        for j in groups:
            e = 8 * j + r
            src = (Int64(cute.arch.shuffle_sync(addr_hi, e)) << 32) | (
                Int64(cute.arch.shuffle_sync(addr_lo, e)) & 0xFFFFFFFF)
            nbytes = ((mask >> e) & 1) * 16
            dst = stage_base + e * self.row_pitch
            for k in range(pieces // 4):
                piece = 16 * (p + 4 * k)
                cp_async_zfill(dst + piece, src + piece, 16, nbytes)
            if pieces % 4:  # the row's last pieces, for the lanes that have one
                self._copy_tail_piece(dst, src, p + 4 * (pieces // 4), pieces, nbytes)

    @cute.jit
    def _copy_tail_piece(self, dst, src, piece, pieces: int, nbytes):
        if piece < pieces:
            cp_async_zfill(dst + 16 * piece, src + 16 * piece, 16, nbytes)

    def _copy_scales(self, dst, src, valid):
        """A footer format's scale record: one 8-byte cp.async (MODEL1) or 16-byte ones (V4.1
        FP8's 16-byte records, the NVFP4 formats' 32-byte ones), read when ``valid`` is 1 and
        zero-filled when 0 (an entry that does not count)."""
        size = self.fmt.footer_bytes
        piece = 8 if size == 8 else 16
        assert size % piece == 0, "a footer record is one 8-byte or whole 16-byte cp.async pieces"
        for k in range(size // piece):
            cp_async_zfill(dst + k * piece, src + k * piece, piece, valid * piece)
