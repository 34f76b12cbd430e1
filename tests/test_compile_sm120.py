"""Every kernel variant compiles for sm_120a on the CPU, with clean SASS (no GPU needed)."""

import pytest

from cute_kernels.sass_check import inspect_cubin
from cute_kernels.sparse_mla_decode.config import SMEM_LIMIT_BYTES, PartialConfig
from dispatch.loader import compile_variant
from dispatch.variants import variant_space


@pytest.fixture(autouse=True)
def _dump_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_DSL_DUMP_DIR", str(tmp_path))  # where the DSL writes the kept cubin


@pytest.mark.parametrize("variant", variant_space("sm_120a"), ids=lambda v: v.name)
def test_variant_compiles_for_sm120_without_spills(variant):
    compiled = compile_variant(variant, keep_cubin=True)
    cubin = compiled.artifacts.CUBIN
    assert cubin, "no cubin kept"
    (rep,) = inspect_cubin(cubin)
    assert rep.local_bytes == 0 and rep.stack_bytes == 0 and rep.local_memory_instructions == 0, rep
    assert rep.forbidden == [], f"instructions SM120 does not have: {rep.forbidden}"
    assert rep.registers <= 255
    dynamic = variant.config.smem_bytes() if isinstance(variant.config, PartialConfig) else 0
    assert rep.static_smem_bytes + dynamic <= SMEM_LIMIT_BYTES
    if variant.kind == "partial":
        # QK (8 k-steps x 4 n-tiles) and PV (2 k-steps x 16 n-tiles) per warp, on the tensor cores
        assert rep.mma_counts.get("HMMA.16816.F32.BF16") == 64, rep.mma_counts
