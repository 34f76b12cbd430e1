"""Every kernel variant builds for sm_120a on the CPU with clean SASS (no GPU needed).

``scripts/aot_build.py``'s per-variant build step compiles, reads the cubin and refuses a
variant that spills, needs more than 99 KB of shared memory per CTA or uses an
instruction SM120 does not have; here it runs over the whole variant space.
"""

import pytest

from dispatch.variants import variant_space
from scripts.aot_build import _build_one


@pytest.mark.parametrize("variant", variant_space("sm_120a"), ids=lambda v: v.name)
def test_variant_builds_for_sm120_without_spills(variant, tmp_path, monkeypatch):
    _check_build(variant, tmp_path, monkeypatch)


def _check_build(variant, tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_DUMP_DIR", str(tmp_path))
    entry = _build_one(variant, str(tmp_path))
    res = entry["resources"]
    assert res["local_bytes"] == 0 and res["stack_bytes"] == 0 and res["local_memory_instructions"] == 0
    assert res["static_smem_bytes"] + res["dynamic_smem_bytes"] <= 101376
    assert res["registers"] <= 255
    assert (tmp_path / entry["object"]).stat().st_size > 0
    if variant.kind == "partial":
        mt = variant.config.head_groups
        expected = {
            # QK (8 k-steps x 4 n-tiles) and PV (2 k-steps x 16 n-tiles) per warp
            "bf16": {"HMMA.16816.F32.BF16": 64},
            # per m16 tile: nope warps QK 4 n-tiles x 4 k-steps, PV 8 n-tiles x 2 k-steps (f16);
            # the rope warp the same in bf16 (each role's loop once in the SASS)
            "f16": {"HMMA.16816.F32": 32 * mt, "HMMA.16816.F32.BF16": 32 * mt},
            # QK: 2 tiles x 4 n-tiles x (2 hi + 2 lo) e4m3; PV: 2 tiles x 8; rope: 4 + 4 bf16
            "fp8": {"QMMA.16832.F32.E4M3.E4M3": 48, "HMMA.16816.F32.BF16": 8},
            # the same, the QK e4m3 MMAs block-scaled (UE8M0 scale factors)
            "mxf8": {"QMMA.SF.16832.F32.E4M3.E4M3.E8": 32, "QMMA.16832.F32.E4M3.E4M3": 16,
                     "HMMA.16816.F32.BF16": 8},
        }[variant.config.precision]
        assert res["mma"] == expected
        assert res["registers"] <= variant.config.max_registers
        # QK's n tiles two or four at a time (QK_TILES_AT_ONCE of partial_f16 and partial_fp8): no
        # MMA of a main loop waits on the one just before it (one tile at a time: 12 per role
        # and chunk in "f16", 23 / 22 per chunk in "fp8" / "mxf8")
        loops = {"f16": 2}.get(variant.config.precision, 1)
        assert res["chained_mma"] == [0] * loops
