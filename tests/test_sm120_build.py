"""Every deployment variant as the AOT build compiled it for sm_120a / sm_121a (no GPU needed).

Reads the manifest of the README's main job (``build/aot``, built here where missing or
stale: the ``deployment_build`` fixture). The build itself refuses a variant that spills,
needs more than 99 KB of shared memory, uses an instruction SM120 lacks, or whose
shared-memory plan differs from what the DSL launches it with; this checks each entry is
the current sources' and what its SASS holds: the MMA mix of its compute path, registers
within its launch bound, no MMA of a main loop waiting on the one just before it, and no
wait for a global load before the first indices' copies.
"""

import pytest

from cute_kernels.arch import DEPLOYMENT_ARCHS, SMEM_PER_CTA_MAX
from dispatch.policy.variant_space import variant_space
from dispatch.tools.aot_build import up_to_date

VARIANTS = [v for arch in DEPLOYMENT_ARCHS for v in variant_space(arch)]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_variant_builds_for_sm120_without_spills(variant, deployment_build):
    out_dir, entries = deployment_build
    entry = entries.get(variant.name)
    assert entry is not None, f"{variant.name} is not in the build's manifest"
    assert up_to_date(variant, entry, out_dir), f"{variant.name}: the manifest entry is not the current sources'"
    res = entry["resources"]
    assert res["local_bytes"] == 0 and res["stack_bytes"] == 0 and res["local_memory_instructions"] == 0
    assert res["launch_smem_bytes"] == res["plan_smem_bytes"] == variant.config.smem_bytes() <= SMEM_PER_CTA_MAX
    assert res["registers"] <= 255
    if variant.kind == "partial":
        mt = variant.config.head_groups
        fmt = variant.config.fmt
        rope_qk = fmt.rope_dims > 0  # the rope dims' QK: bf16 MMAs on the raw rope bytes
        rope_pv = fmt.rope_in_v  # their PV (MODEL1): bf16 MMAs
        bf16 = {
            # QK (8 k-steps x 4 n-tiles) and PV (2 k-steps x 16 n-tiles) per warp, over the tile's
            # 512 columns; V3.2's rope dims 4 more (one k-step x 4 n-tiles, from the raw rows)
            "bf16": 64 + (4 if fmt.d_qk > 512 else 0),
            # the rope warp per m16 tile: QK 4 n-tiles x 4 k-steps, PV 8 n-tiles x 2 k-steps
            "f16": (16 * rope_qk + 16 * rope_pv) * mt,
            # rope QK and PV: 4 each
            "fp8": 4 * rope_qk + 4 * rope_pv,
            "mxf8": 4 * rope_qk + 4 * rope_pv,
        }[variant.config.precision]
        expected = {
            "bf16": {},
            # per m16 tile: nope warps QK 4 n-tiles x 4 k-steps, PV 8 n-tiles x 2 k-steps (f16)
            # (each role's loop once in the SASS)
            "f16": {"HMMA.16816.F32": 32 * mt},
            # QK: 2 tiles x 4 n-tiles x (2 hi + 2 lo) e4m3; PV: 2 tiles x 8
            "fp8": {"QMMA.16832.F32.E4M3.E4M3": 48},
            # the same, the QK e4m3 MMAs block-scaled (UE8M0 scale factors)
            "mxf8": {"QMMA.SF.16832.F32.E4M3.E4M3.E8": 32, "QMMA.16832.F32.E4M3.E4M3": 16},
        }[variant.config.precision]
        if bf16:
            expected["HMMA.16816.F32.BF16"] = bf16
        assert res["mma"] == expected
        assert res["registers"] <= variant.config.max_registers
        # QK's n tiles two or four at a time (``tuning``'s QK_TILES_AT_ONCE): no MMA of a main
        # loop waits on the one just before it (one tile at a time: 12 per role and chunk in
        # "f16", 23 / 22 per chunk in "fp8" / "mxf8"); "f16" has two MMA loops where its rope
        # warp multiplies (GLM-5.3's, rope-free, only gathers)
        loops = 1 + int(variant.config.precision == "f16" and rope_qk)
        assert res["chained_mma"] == [0] * loops
        # "f16" (the default path): the first indices are issued before anything waits for a
        # global load (the lengths' or Q's): with a length tensor, three dependent round trips
        # (lengths, indices, rows) would hold the first rows back instead of two. ("bf16" and
        # FP8 copy Q into the same first group, and ptxas uses the lengths before Q's copies:
        # their first rows wait for lengths, then Q; docs/design.md, "Prologue".)
        if variant.config.precision == "f16":
            assert res["waits_before_first_copy"] == 0
