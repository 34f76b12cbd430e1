"""Split-K partial kernel of sparse MLA decode: what its three compute paths share.

Work item (one CTA): query token t, a block of 16 or 32 query heads (``head_groups`` m16 MMA
tiles), and a split's share of the 32-entry chunks of the token's selected entries, main list
first, then extra. Grid: (num_tokens x ceil(H / heads_per_cta), launch_splits); split s owns
chunks [s * chunks_per_split, (s + 1) * chunks_per_split) (with a length tensor, chunks s,
s + S, ... below the token's lengths: ``gather.ChunkGather.bound_chunks``) and writes split s of the partial
outputs [T, num_splits, H, 512] (a call whose two lists have two formats launches a kernel per
list; the second's o_part and lse_part start at the first's splits' end, so that its splits
follow them: ``dispatch.runtime.plan.DecodePlan._extra_list_values``). Per chunk: the gather lands the
selected rows in shared memory (``gather.py``), QK and PV run on ``mma.sync``, an online
softmax joins them (``softmax.py``); the outputs are the split's normalized partial and lse,
or, with one split, the final bf16 output and natural-log lse (``epilogue.py``).

The compute paths (``PartialConfig.precision``), each a subclass with its own ``kernel``:

- "f16" (``partial_f16.py``, the default): e4m3 converted to f16 in registers, the scales
  applied to S and P, the softmax spread over all threads;
- "bf16" (``partial_bf16.py``): rows dequantized into a bf16 tile, bf16 MMAs;
- "fp8" / "mxf8" (``partial_fp8.py``): e4m3 MMAs on the raw rows (block-scaled for "mxf8").

Every input is a raw device pointer or an integer (``kernel_args.PARTIAL_ARGS``), so one
compiled kernel serves every num_tokens, num_heads, topk, extra_topk, page size and stride.
``docs/design.md`` has each path's spec and shared-memory map.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warp

from ..arch import Arch
from .config import PartialConfig, path_missing
from .epilogue import Epilogue, quad_allreduce
from .gather import ChunkGather
from .kernel_args import PARTIAL_ARGS, KernelParams, fake_args, launcher_signature
from .warp_ops import OperandConversion, ldsm_x4, mma_bf16, pack_bf16x2


class PartialKernel:
    """The partial kernel of one ``PartialConfig`` for one target ``Arch``: its launch
    (``__call__``, the ``cute.jit`` entry point) and the parts every path uses. A path
    subclass defines ``kernel(self, p, *operands)`` (``p``: the ``KernelParams`` of
    ``PARTIAL_ARGS``) and, where it needs layouts or MMA atoms built on the host side,
    ``kernel_operands``."""

    # the first of the 32 threads that issue a chunk's indices (``ChunkGather``)
    INDEX_THREAD0 = 0

    def __init__(self, cfg: PartialConfig, arch: Arch, index_chunks: int | None = None):
        cfg.check()
        missing = path_missing(cfg.precision, arch)
        if missing:
            raise ValueError(f"precision {cfg.precision!r}: {missing}")
        self.cfg = cfg
        # e4m3 / e2m1 bytes to numbers: the conversion instruction, or where the arch lacks it
        # integer operations (``OperandConversion``: sm_80 / sm_86)
        self.conv = OperandConversion(arch.e4m3_cvt)
        self.fmt = cfg.fmt  # the cache format: its layout is compiled in
        self.hb = cfg.heads_per_cta  # heads per CTA (all groups)
        self.hg = cfg.heads_per_group  # heads per group: the MMA M tile
        self.groups = cfg.head_groups
        self.bn = cfg.block_n
        self.nthr = cfg.num_threads
        self.stages = cfg.stages  # raw row buffers
        self.slots = cfg.slot_buffers  # index / validity-mask buffers
        self.smem_plan = cfg.smem_plan()
        self.gather = ChunkGather(cfg, self.INDEX_THREAD0, index_chunks)
        self.epilogue = Epilogue(cfg, arch)

    def fake_args(self) -> list:
        """Stand-ins for every ``__call__`` argument, to compile with no tensors and no GPU."""
        return fake_args(PARTIAL_ARGS)

    def kernel_operands(self) -> tuple:
        """The path's layouts and atoms passed to its ``kernel`` after the parameters."""
        return ()

    def _launch(self, *args):
        """Launch on the arguments of ``PARTIAL_ARGS``, in order, the stream last (``__call__``)."""
        p = KernelParams(PARTIAL_ARGS, args)
        head_blocks = (p.num_heads + self.hb - 1) // self.hb
        self.kernel(p.for_device(), *self.kernel_operands()).launch(
            grid=(p.num_tokens * head_blocks, p.launch_splits, 1),  # see Epilogue.block_coords
            block=(self.nthr, 1, 1),
            stream=args[-1],
            # .minnctapersm: 1 lets ptxas use every register (without it, it capped the
            # one-group block-scaled FP8 kernel at 168 registers and spilled); see
            # PartialConfig.min_ctas_per_sm
            min_blocks_per_mp=self.cfg.min_ctas_per_sm,
            # several CTAs per SM: ask for the largest shared-memory carveout (given, the DSL
            # also need not ask a GPU for the SM's shared memory at compile time)
            preferred_smem_carveout=100 if self.cfg.min_ctas_per_sm > 1 else None,
        )

    # the cute.jit entry point, with the schema's named, typed parameters
    __call__ = cute.jit(launcher_signature(PARTIAL_ARGS)(_launch))

    # ------------------------------------------------------------------ tile paths ("bf16", FP8)
    @staticmethod
    def tile_layout(rows: int, cols: int):
        """A bf16 tile [rows, cols] in 8 x 64 swizzled atoms: conflict-free ldmatrix, both ways."""
        atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))

    @staticmethod
    def bf16_tiled_mma():
        return cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)), (1, 1, 1),
                                   permutation_mnk=(16, 16, 16))

    def tiled_store(self, values: int, cols: int):
        """16-byte pieces of ``values`` bf16 each over a [rows, cols] tile: the threads laid out
        (num_threads / k, k), k the most of them that share a row evenly, values (1, values)."""
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        per_row = math.gcd(cols // values, self.nthr)
        return cute.make_tiled_copy_tv(atom, cute.make_layout((self.nthr // per_row, per_row), stride=(per_row, 1)),
                                       cute.make_layout((1, values)))

    @cute.jit
    def stage_q(self, p: KernelParams, token: Int32, head0: Int32, sQ: cute.Tensor, tiled_store: cute.TiledCopy,
                tidx: Int32):
        """Start the cp.async of Q [heads_per_cta, d_qk] into the tile ``sQ`` [heads_per_cta,
        q_cols] (rows >= H are zero-filled, never read; so are columns past d_qk);
        ``ChunkGather.start_pipeline`` commits and waits for it."""
        thr_store = tiled_store.get_slice(tidx)
        tQsQ = thr_store.partition_D(sQ)
        tQcQ = thr_store.partition_D(cute.make_identity_tensor((self.hb, self.cfg.q_cols)))
        for i in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(tQsQ, mode=[2])):
                row = tQcQ[(0, 0), i, j][0]
                col = tQcQ[(0, 0), i, j][1]
                present = head0 + row < p.num_heads
                if const_expr(self.cfg.q_cols > self.fmt.d_qk):  # the tile's padding columns
                    present = present & (col < self.fmt.d_qk)
                if present:
                    addr = p.q.toint() + (Int64(token) * p.q_stride_t + Int64(head0 + row) * p.q_stride_h
                                          + Int64(col)) * 2
                    src = cute.make_tensor(
                        cute.make_ptr(BFloat16, addr, cute.AddressSpace.gmem, assumed_align=16), cute.make_layout(8)
                    )
                    cute.copy(cute.make_copy_atom(cpasync.CopyG2SOp(), BFloat16, num_bits_per_copy=128), src,
                              tQsQ[None, i, j])
                else:
                    tQsQ[None, i, j].fill(0.0)

    @cute.jit
    def load_q_rope(self, sQ: cute.Tensor, wq, rows: list, inv_sq: list, qd) -> list:
        """The A fragment (4 registers, bf16 pairs) of warp ``wq``'s 16 rope dims of Q (columns
        nope_dims + 16 wq ..) for this thread's head rows ``rows`` of the tile ``sQ``, times
        ``inv_sq[r]`` (a power of two: exact)."""
        regs = []
        for a in cutlass.range_constexpr(4):
            r = a % 2
            c = self.fmt.nope_dims + wq * 16 + 8 * (a // 2) + 2 * qd
            regs.append(pack_bf16x2(sQ[rows[r], c].to(Float32) * inv_sq[r], sQ[rows[r], c + 1].to(Float32) * inv_sq[r]))
        return regs

    @cute.jit
    def qk_rope(self, acc_S, q_rope: list, stage_base, wq, lane):
        """acc_S += Q K^T over warp ``wq``'s 16 rope dims, K the raw bf16 rope bytes of the
        stage at ``stage_base`` (``ldmatrix``), Q the A fragment ``q_rope`` (``load_q_rope``);
        acc_S: S [16, 32] in m16n8 C order, n tile j at 4 j .. 4 j + 3."""
        pitch = self.gather.row_pitch
        row_addr = (stage_base + self.fmt.rope_offset + wq * 32 + ((lane // 16) * 8 + lane % 8) * pitch
                    + ((lane // 8) % 2) * 16)
        for jj in cutlass.range_constexpr(2):  # n tiles 2 jj, 2 jj + 1
            kb = ldsm_x4(row_addr + 16 * jj * pitch, trans=False)
            for h in cutlass.range_constexpr(2):
                j = 2 * jj + h
                d = mma_bf16([acc_S[4 * j + k] for k in range(4)], q_rope, kb[2 * h:2 * h + 2])
                for k in cutlass.range_constexpr(4):
                    acc_S[4 * j + k] = d[k]

    def quad_s_exchange_layout(self):
        """The tile paths' S exchange: per head group, each warp's partial S [16, 32] (f32)."""
        hg, bn, wpg = self.hg, self.bn, self.cfg.warps_per_group
        return cute.make_layout((hg, bn, wpg, self.groups), stride=(bn, 1, hg * bn, wpg * hg * bn))

    @cute.jit
    def quad_epilogue(self, p: KernelParams, row_sum: cute.Tensor, row_max: cute.Tensor, token: Int32, split: Int32,
                      ghead0: Int32, g: Int32, qd: Int32, wq: Int32, store_row, sink_addr: Int64,
                      lse_part_addr: Int64, lse_addr: Int64):
        """The tile paths' outputs: for each of this thread's head rows r (head ghead0 + g +
        8 r) the sum over its quad, the gate and the lse; ``store_row(r, gate, out_ctx)``
        writes the row's output columns (``out_ctx``: what ``Epilogue.store_out`` takes after
        the values and the column); warp 0 of the group, lane q = 0, writes the lse."""
        num_heads, num_splits = p.num_heads, p.num_splits
        out_ctx = (p.o_part.toint(), p.out.toint(), p.out_stride_t, p.out_stride_h)
        for r in cutlass.range_constexpr(2):
            total = quad_allreduce(row_sum[r], lambda a, b: a + b)
            head = ghead0 + g + 8 * r
            if head < num_heads:
                gate, lse2 = self.epilogue.gate_and_lse2(total, row_max[r], sink_addr, head)
                store_row(r, gate, (token, split, num_splits, num_heads, head) + out_ctx)
                if wq == 0:  # one warp per group writes its heads' lse
                    if qd == 0:
                        self.epilogue.store_lse(lse2, token, split, num_splits, num_heads, head,
                                                lse_part_addr, lse_addr, p.lse_stride_t, p.lse_stride_h)
