"""scripts/mma_ceiling.py's kernels measure what they say: the plain loop is CHAINS independent
f16 MMAs per pass and nothing that waits between them; the converted-operand loop is one
"f16" nope warp's operand work per chunk and nothing else (both compiled for sm_120a on the
CPU); and bench.py's tensor-work count is the decode's QK and PV FLOPs."""

import pytest

from cute_kernels.sass_check import disassemble, inspect_cubin, mma_loop_mix
from scripts.bench import tensor_flops
from scripts.mma_ceiling import (CHAINS, HEAD_GROUPS, MMAS_PER_ROUND, THREADS, launch_converted_mma_loop,
                                 launch_mma_loop)


def test_mma_loop_is_independent_f16_mmas(tmp_path, monkeypatch):
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    monkeypatch.setenv("CUTE_DSL_DUMP_DIR", str(tmp_path))
    out = make_fake_compact_tensor(Float32, (4 * THREADS,))
    compiled = cute.compile(launch_mma_loop, out, Int32(16), 4, make_fake_stream(),
                            options="--gpu-arch sm_120a --keep-cubin")
    cubin = compiled.artifacts.CUBIN
    mix = mma_loop_mix(disassemble(cubin))
    assert mix.mma_kinds == {"HMMA.16816.F32": CHAINS}
    assert mix.chained_mma == 0 and mix.shared_memory == 0 and mix.barriers == 0
    (report,) = inspect_cubin(cubin)
    assert report.local_bytes == 0 and report.local_memory_instructions == 0


@pytest.mark.parametrize("m_tiles", HEAD_GROUPS)
def test_converted_loop_is_one_nope_warps_operand_work(m_tiles, tmp_path, monkeypatch):
    """Per pass: QK's 4 ldmatrix.x4 and PV's 4 ldmatrix.x4.trans of the raw rows, 2 conversions
    (F2FP) per e4m3 register of each (64), PV's byte permutes (16), the MMAs of m_tiles m16
    tiles (32 each), none waiting on the MMA just before it, and besides only the loop's counter
    and branch (and on sm_120a ptxas's never-executed padding, ``@!UPT UIADD3 URZ``): nothing
    of the kernel's other work, so the rate is an upper bound for it."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    monkeypatch.setenv("CUTE_DSL_DUMP_DIR", str(tmp_path))
    out = make_fake_compact_tensor(Float32, (4 * THREADS,))
    compiled = cute.compile(launch_converted_mma_loop, out, Int32(16), 4, m_tiles, 1, make_fake_stream(),
                            options="--gpu-arch sm_120a --keep-cubin")
    cubin = compiled.artifacts.CUBIN
    mix = mma_loop_mix(disassemble(cubin))
    assert mix.mma_kinds == {"HMMA.16816.F32": MMAS_PER_ROUND * m_tiles}
    assert mix.opcodes["LDSM"] == 8 and mix.opcodes["F2FP"] == 64 and mix.opcodes["PRMT"] == 16
    assert mix.shared_memory == 8 and mix.barriers == 0 and mix.chained_mma == 0
    work = {"LDSM", "F2FP", "PRMT", "HMMA"}
    loop_control = {op: n for op, n in mix.opcodes.items() if op not in work}
    assert set(loop_control) <= {"IADD3", "VIADD", "UIADD3", "ISETP", "UISETP", "BRA"}, loop_control
    (report,) = inspect_cubin(cubin)
    assert report.local_bytes == 0 and report.local_memory_instructions == 0


@pytest.mark.parametrize("T, H, shape, expected", [
    (1, 16, "128", 2 * 1 * 16 * 128 * (512 + 512)),
    (64, 128, "1024", 2 * 64 * 128 * 1024 * 1024),
    (8, 64, "128+512", 2 * 8 * 64 * 640 * 1024),
])
def test_tensor_flops_counts_qk_and_pv(T, H, shape, expected):
    assert tensor_flops(T, H, shape) == expected
