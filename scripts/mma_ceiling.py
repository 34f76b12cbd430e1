"""The warp-MMA ceiling of the GPU: the throughput of ``mma.sync.m16n8k16`` f16 x f16 -> f32,
the MMA the default ("f16") kernel issues (sm_80+; SM120 has no other 16-bit tensor path).

    python scripts/mma_ceiling.py    # prints TFLOP/s (needs a CUDA GPU)

``scripts/bench.py`` measures it in the same run as the decode calls and reports each shape's
tensor work against it ("%mma"), next to the copy ceiling: the many-head shapes are bound
by the MMAs and the instructions around them, not by the gather. On the H200 this is the
ceiling of every kernel SM120 can run too; FlashMLA's SM90 kernel uses ``wgmma`` instead,
which has about twice that rate there (989 TFLOP/s dense f16 as NVIDIA specifies it).

Method: every SM runs ``CTAS_PER_SM`` CTAs of 8 warps; each warp issues ``CHAINS``
independent chains of MMAs (each waits only on the one ``CHAINS`` before it, so the tensor
pipe, not the MMA latency, sets the rate) for ``ITERS`` rounds; time = median of
``triton.testing.do_bench``; FLOPs = 2 * 16 * 8 * 16 per MMA.
"""

from __future__ import annotations

import sys
from pathlib import Path

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cute_kernels.sparse_mla_decode.warp_ops import mma_f16  # noqa: E402

THREADS = 256
CHAINS = 8
ITERS = 4096
CTAS_PER_SM = 4
FLOPS_PER_MMA = 2 * 16 * 8 * 16


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


def mma_ceiling_tflops() -> float:
    """The measured f16 ``mma.sync`` rate of the current CUDA device, TFLOP/s."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import from_dlpack
    from triton.testing import do_bench

    blocks = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count * CTAS_PER_SM
    out = torch.empty(blocks * THREADS, dtype=torch.float32, device="cuda")
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    out_t = from_dlpack(out)
    compiled = cute.compile(launch_mma_loop, out_t, Int32(ITERS), blocks, stream)
    ms = do_bench(lambda: compiled(out_t, Int32(ITERS), stream), return_mode="median")
    flops = blocks * (THREADS // 32) * ITERS * CHAINS * FLOPS_PER_MMA
    if not torch.isfinite(out).all():
        raise RuntimeError("the MMA loop produced non-finite sums")
    return flops / (ms * 1e-3) / 1e12


def main() -> int:
    import torch

    print(f"{torch.cuda.get_device_name()}: mma.sync m16n8k16 f16 -> f32 {mma_ceiling_tflops():.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
