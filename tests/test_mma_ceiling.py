"""scripts/mma_ceiling.py's kernel measures what it says: its loop is CHAINS independent f16
MMAs per pass and nothing that waits between them (compiled for sm_120a on the CPU), and
bench.py's tensor-work count is the decode's QK and PV FLOPs."""

import pytest

from cute_kernels.sass_check import disassemble, inspect_cubin, mma_loop_mix
from scripts.bench import tensor_flops
from scripts.mma_ceiling import CHAINS, THREADS, launch_mma_loop


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


@pytest.mark.parametrize("T, H, shape, expected", [
    (1, 16, "128", 2 * 1 * 16 * 128 * (512 + 512)),
    (64, 128, "1024", 2 * 64 * 128 * 1024 * 1024),
    (8, 64, "128+512", 2 * 8 * 64 * 640 * 1024),
])
def test_tensor_flops_counts_qk_and_pv(T, H, shape, expected):
    assert tensor_flops(T, H, shape) == expected
