"""The warp-MMA ceilings of the GPU: the throughput of ``mma.sync.m16n8k16`` f16 x f16 -> f32,
the MMA the default ("f16") kernel issues (sm_80+; SM120 has no other 16-bit tensor path),
alone and fed the way that kernel feeds it.

    python -m scripts.mma_ceiling [--heads 16 32 64]    # prints both, TFLOP/s (needs a CUDA GPU)

``--heads``: the heads each converted fragment is used by (multiples of 16; default 16 and
32, the kernel's head groups; 64 bounds a design no register budget allows).

``scripts.bench`` measures them in the same run as the decode calls and reports each
shape's tensor work against the first ("%mma"), next to the copy ceiling: the many-head
shapes are bound by the MMAs and the instructions around them, not by the gather. On the
H200 these are the ceilings of every kernel SM120 can run too; FlashMLA's SM90 kernel uses
``wgmma`` instead, which has about twice that rate there (989 TFLOP/s dense f16 as NVIDIA
specifies it).

Method (``mma_ceiling_tflops``): every SM runs ``CTAS_PER_SM`` CTAs of 8 warps; each warp
issues ``CHAINS`` independent chains of MMAs (each waits only on the one ``CHAINS`` before
it, so the tensor pipe, not the MMA latency, sets the rate) for ``ITERS`` rounds; time =
median of ``triton.testing.do_bench``; FLOPs = 2 * 16 * 8 * 16 per MMA.

The converted-operand ceiling (``converted_ceiling_tflops``) is the same MMA with the
operand work the "f16" kernel cannot avoid. Each round is one 64-column warp's share of a
32-entry chunk, issued as ``partial_f16`` issues it, and nothing else. QK: 4 ``ldmatrix.x4``
of raw e4m3 rows, 16 conversions to f16 B fragments (``e4m3x4_to_f16x2``), each fragment
multiplied into ``m_tiles`` m16 tiles (4 interleaved chains of 4 MMAs per tile). PV: 4
``ldmatrix.x4.trans``, 16 byte permutes and conversions, even and odd columns as two MMAs
each (8 chains of 2 per tile, interleaved). The rows lie in shared memory in the kernel's
layout (``RAW_ROW_STRIDE``: MODEL1's ``KvFormat.raw_row_stride``); the faster of two launch
bounds counts (``CONVERTED_MIN_CTAS``).
Left out, so this is an upper bound of that design and not a model of it: the gather, the
scales, the S exchange, the softmax, the P loads, the barriers; the A operands (Q, P) stay
in registers. ``m_tiles`` is the kernel's head groups (16 heads per tile): a kernel that
turns each gathered e4m3 byte into an f16 operand in registers once per ``16 * m_tiles``
heads cannot run its MMAs faster than this rate.
"""

from __future__ import annotations

import sys

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


from cute_kernels.sparse_mla_decode.config import HEAD_GROUPS
from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT, NOPE_TILE, get_format
from cute_kernels.sparse_mla_decode.partial_f16 import PAIR_COLUMNS
from cute_kernels.sparse_mla_decode.warp_ops import e4m3x4_to_f16x2, ldsm_x4, mma_f16

RAW_ROW_STRIDE = get_format(DEFAULT_FORMAT).raw_row_stride  # bytes between gathered rows in shared memory
UNIT = NOPE_TILE  # columns per "f16" warp: one 64-dim nope tile

THREADS = 256
CHAINS = 8
ITERS = 4096
CTAS_PER_SM = 4
FLOPS_PER_MMA = 2 * 16 * 8 * 16
# converted-operand loop: one chunk stage of 32 raw rows; warp w reads columns 64 w .. 64 w + 63
# (the 7 nope tiles and, for warp 7, the first 64 bytes of the rope dims: the loop only needs
# e4m3 values, any bytes will do)
CHUNK_ROWS = 32
CONVERTED_ITERS = 1024
# more CTAs than fit at once: the SM keeps as many resident as its registers allow, the rest
# follow in later waves (enough of them that the last wave's tail is small)
CONVERTED_CTAS_PER_SM = 8
MMAS_PER_ROUND = 32  # per warp and m tile: 16 QK + 16 PV
# launch bounds (minimum CTAs per SM) the converted loop is timed with, the faster one kept:
# ptxas's free choice (32 heads: 165 registers, one 8-warp CTA per SM) and held to 128
# registers (two per SM, as the "f16" kernel runs on the H200; 32 heads: spills)
CONVERTED_MIN_CTAS = (1, 2)


@cute.kernel
def mma_loop_kernel(out: cute.Tensor, iters: Int32):
    """``iters`` rounds of ``CHAINS`` independent f16 MMAs per warp; writes each thread's sum
    (so that nothing is dead code). The operands are f16 values near 1 (their values do not
    change the rate)."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    seed = Int32(tidx) & 0xFF
    a = [Int32(0x3C003C00 + k) + seed for k in range(4)]
    b = [Int32(0x3C003C00 + 4 + k) + seed for k in range(2)]
    acc = cute.make_rmem_tensor(CHAINS * 4, Float32)
    acc.fill(0.0)
    for _ in cutlass.range(iters, unroll=1):
        for j in cutlass.range_constexpr(CHAINS):
            d = mma_f16([acc[4 * j + k] for k in range(4)], a, b)
            for k in cutlass.range_constexpr(4):
                acc[4 * j + k] = d[k]
    total = Float32(0.0)
    for k in cutlass.range_constexpr(CHAINS * 4):
        total = total + acc[k]
    out[bidx * THREADS + tidx] = total


@cute.jit
def launch_mma_loop(out: cute.Tensor, iters: Int32, blocks: cutlass.Constexpr, stream):
    mma_loop_kernel(out, iters).launch(grid=[blocks, 1, 1], block=[THREADS, 1, 1], stream=stream)


@cute.kernel
def converted_mma_loop_kernel(out: cute.Tensor, iters: Int32, m_tiles: cutlass.Constexpr):
    """``iters`` rounds of one warp's QK and PV operand work for a 32-entry chunk (module doc),
    each converted fragment multiplied into ``m_tiles`` m16 tiles; writes each thread's sum.
    The stage holds e4m3 bytes 0x30..0x3f (0.5 .. 0.94), the A operands f16 values near 1."""
    from cutlass.memory import SmemAllocator

    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    warp = tidx // 32
    lane = tidx % 32
    words = CHUNK_ROWS * RAW_ROW_STRIDE // 4
    stage = SmemAllocator().allocate_tensor(Int32, cute.make_layout(words), byte_alignment=128)
    for k in cutlass.range(tidx, words, THREADS, unroll=1):
        stage[k] = Int32(0x30303030) | ((k * 0x01030507) & 0x0F0F0F0F)
    cute.arch.sync_threads()
    base = stage.iterator.toint()
    k_row = base + (lane % 8) * RAW_ROW_STRIDE + (lane // 8) * 16 + warp * UNIT  # partial_f16's QK rows
    v_row = base + lane * RAW_ROW_STRIDE + warp * UNIT  # its PV rows
    seed = Int32(tidx) & 0xFF
    qa = [Int32(0x3C003C00 + k) + seed for k in range(16)]  # Q: 4 k16 steps x 4 registers
    pa = [Int32(0x38003800 + k) + seed for k in range(8)]  # P: 2 k16 steps x 4 registers
    acc_s = cute.make_rmem_tensor(m_tiles * 16, Float32)  # QK: ((m * 4 + n tile) * 4 + c)
    acc_o = cute.make_rmem_tensor(m_tiles * 32, Float32)  # PV: (((m * 4 + block) * 2 + parity) * 4 + c)
    acc_s.fill(0.0)
    acc_o.fill(0.0)
    for _ in cutlass.range(iters, unroll=1):
        b = []
        for nb in cutlass.range_constexpr(4):
            kb = ldsm_x4(k_row + 8 * nb * RAW_ROW_STRIDE, trans=False)
            b.append([e4m3x4_to_f16x2(kb[i]) for i in range(4)])
        for m in cutlass.range_constexpr(m_tiles):
            d = [[acc_s[(m * 4 + nb) * 4 + c] for c in range(4)] for nb in range(4)]
            for i in cutlass.range_constexpr(4):
                for nb in cutlass.range_constexpr(4):
                    d[nb] = mma_f16(d[nb], qa[4 * i:4 * i + 4], b[nb][i])
            for nb in cutlass.range_constexpr(4):
                for c in cutlass.range_constexpr(4):
                    acc_s[(m * 4 + nb) * 4 + c] = d[nb][c]
        # PV as partial_f16._nope_pv issues it, but with each chain's two k16 steps interleaved
        # with the other chains': in a loop of its own, _nope_pv's order leaves 8 MMAs (16 heads)
        # waiting on the one just before (sm_120a), which the kernel's other work hides there
        for blk in cutlass.range_constexpr(4):
            vfrag = ldsm_x4(v_row + 16 * blk, trans=True)
            bv = [e4m3x4_to_f16x2(vfrag[k], PAIR_COLUMNS) for k in range(4)]  # [even column, odd column]
            chains = [(parity, m) for parity in range(2) for m in range(m_tiles)]
            d = {pm: [acc_o[(((pm[1] * 4 + blk) * 2 + pm[0]) * 4) + c] for c in range(4)] for pm in chains}
            for s in cutlass.range_constexpr(2):
                for parity, m in chains:
                    d[parity, m] = mma_f16(d[parity, m], pa[4 * s:4 * s + 4],
                                           [bv[2 * s][parity], bv[2 * s + 1][parity]])
            for parity, m in chains:
                for c in cutlass.range_constexpr(4):
                    acc_o[((m * 4 + blk) * 2 + parity) * 4 + c] = d[parity, m][c]
    total = Float32(0.0)
    for k in cutlass.range_constexpr(m_tiles * 16):
        total = total + acc_s[k]
    for k in cutlass.range_constexpr(m_tiles * 32):
        total = total + acc_o[k]
    out[bidx * THREADS + tidx] = total


@cute.jit
def launch_converted_mma_loop(out: cute.Tensor, iters: Int32, blocks: cutlass.Constexpr,
                              m_tiles: cutlass.Constexpr, min_ctas_per_sm: cutlass.Constexpr, stream):
    converted_mma_loop_kernel(out, iters, m_tiles).launch(grid=[blocks, 1, 1], block=[THREADS, 1, 1],
                                                          stream=stream, min_blocks_per_mp=min_ctas_per_sm,
                                                          # (given, the DSL asks no GPU for the SM's
                                                          # shared memory when it compiles)
                                                          preferred_smem_carveout=100)


def _measured_tflops(launcher, ctas_per_sm: int, iters: int, mmas_per_warp_round: int, *constexprs) -> float:
    """Compile ``launcher`` for ``ctas_per_sm`` CTAs per SM of the current device, time it
    (``do_bench`` median) and return its MMA rate in TFLOP/s; every thread's sum must be
    finite."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import from_dlpack
    from triton.testing import do_bench

    blocks = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count * ctas_per_sm
    out = torch.empty(blocks * THREADS, dtype=torch.float32, device="cuda")
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    out_t = from_dlpack(out)
    compiled = cute.compile(launcher, out_t, Int32(iters), blocks, *constexprs, stream)
    ms = do_bench(lambda: compiled(out_t, Int32(iters), stream), return_mode="median")
    if not torch.isfinite(out).all():
        raise RuntimeError("the MMA loop produced non-finite sums")
    flops = blocks * (THREADS // 32) * iters * mmas_per_warp_round * FLOPS_PER_MMA
    return flops / (ms * 1e-3) / 1e12


def mma_ceiling_tflops() -> float:
    """The measured f16 ``mma.sync`` rate of the current CUDA device, TFLOP/s."""
    return _measured_tflops(launch_mma_loop, CTAS_PER_SM, ITERS, CHAINS)


def converted_tflops(m_tiles: int, min_ctas_per_sm: int) -> float:
    """The converted-operand loop's MMA rate (module doc) at one launch bound, TFLOP/s."""
    return _measured_tflops(launch_converted_mma_loop, CONVERTED_CTAS_PER_SM, CONVERTED_ITERS,
                            MMAS_PER_ROUND * m_tiles, m_tiles, min_ctas_per_sm)


def converted_ceiling_tflops(m_tiles: int) -> float:
    """The measured f16 ``mma.sync`` rate with every B operand converted from e4m3 bytes in
    registers and used by ``m_tiles`` m16 tiles (module doc), TFLOP/s: the faster of the
    launch bounds ``CONVERTED_MIN_CTAS``."""
    return max(converted_tflops(m_tiles, min_ctas) for min_ctas in CONVERTED_MIN_CTAS)


def main(argv=None) -> int:
    import argparse

    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[16 * g for g in HEAD_GROUPS],
                    help="heads per converted fragment, multiples of 16 (default: the kernel's head groups)")
    args = ap.parse_args(argv)
    if any(h <= 0 or h % 16 for h in args.heads):
        ap.error(f"--heads takes multiples of 16, got {args.heads}")
    print(f"{torch.cuda.get_device_name()}: mma.sync m16n8k16 f16 -> f32 {mma_ceiling_tflops():.0f} TFLOP/s")
    for m_tiles in (h // 16 for h in args.heads):
        rates = {min_ctas: converted_tflops(m_tiles, min_ctas) for min_ctas in CONVERTED_MIN_CTAS}
        print(f"  with e4m3 operands converted in registers, each used by {16 * m_tiles} heads: "
              f"{max(rates.values()):.0f} TFLOP/s ("
              + ", ".join(f"{r:.0f} with at least {n} CTA(s) per SM" for n, r in rates.items()) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
