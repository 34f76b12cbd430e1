"""The SM120 forecast's arithmetic (CPU only; the forecast itself compiles kernels and is run
by hand: scripts/sm120_forecast.py)."""

from __future__ import annotations

import pytest

from scripts.sm120_forecast import (
    FIXED_US, H200, ISSUE_RATE, RTX_PRO_6000, SCHEDULERS_PER_SM, TENSOR_FLOP_PER_SM_CYCLE, mma_kind_flops, model_us,
)


@pytest.mark.parametrize("opcode, expected", [
    ("HMMA.16816.F32", ("16-bit", 2 * 16 * 8 * 16)),
    ("HMMA.16816.F32.BF16", ("16-bit", 2 * 16 * 8 * 16)),
    ("QMMA.16832.F32.E4M3.E4M3", ("fp8", 2 * 16 * 8 * 32)),
    ("QMMA.SF.16832.F32.E4M3.E4M3.E8", ("mxf8", 2 * 16 * 8 * 32)),
])
def test_mma_kind_flops_reads_the_rate_kind_and_shape_of_an_opcode(opcode, expected):
    assert mma_kind_flops(opcode) == expected


@pytest.mark.parametrize("opcode", ["HGMMA.64x128x16.F32", "IMMA.16832.S32.S8", "HMMA.1688.F32"])
def test_mma_kind_flops_refuses_what_it_has_no_rate_or_shape_for(opcode):
    with pytest.raises(ValueError):
        mma_kind_flops(opcode)


def test_model_takes_the_largest_of_issue_tensor_and_memory():
    # one chunk per CTA and one CTA per SM (T=1, 16 heads, 128 entries: four splits of one
    # chunk on either device), a made-up loop whose MMAs outweigh its instructions on SM120
    instructions, flops = 400, {"16-bit": 4096 * 2000, "mxf8": 8192 * 100}
    work = {1: (instructions, flops), 2: (instructions, flops)}
    est, issue, tensor, memory = model_us(1, 16, "128", RTX_PRO_6000, work)
    clock = RTX_PRO_6000.clock_ghz * 1e3  # cycles per us
    assert issue == pytest.approx(instructions / (SCHEDULERS_PER_SM * ISSUE_RATE * clock))
    cycles = 4096 * 2000 / TENSOR_FLOP_PER_SM_CYCLE["16-bit"] + 8192 * 100 / TENSOR_FLOP_PER_SM_CYCLE["mxf8"]
    assert tensor == pytest.approx(cycles / clock)
    assert tensor > issue > memory
    assert est == pytest.approx(FIXED_US + tensor)
    # the H200 check has no tensor term
    _, _, h200_tensor, _ = model_us(1, 16, "128", H200, work)
    assert h200_tensor == 0.0
