"""scripts.ncu_phases on a hand-written export of ncu's source page (no GPU, no ncu)."""

from __future__ import annotations

import pytest

from scripts.ncu_phases import phases, read_source_page, report

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"Instructions Executed","stall_long_sb","stall_barrier","stall_long_sb (Not Issued)"')
ROWS = [
    ("0x00", "LDG.E R2, desc[UR10][R4.64]", 3, 3, 160, 0, 0, 0),
    ("0x10", "VIMNMX.RELU R2, R2, R39, PT", 40, 40, 160, 40, 0, 40),
    ("0x20", "BAR.SYNC.DEFER_BLOCKING 0x0", 10, 10, 160, 0, 10, 0),
    ("0x30", "HMMA.16816.F32 R4, R8, R12, R4", 5, 2, "1,120", 0, 0, 0),
    ("0x40", "@P0 EXIT", 1, 1, 160, 0, 0, 0),
    ("0x50", "EXIT", 1, 1, 140, 0, 0, 0),
    ("0x60", "LDS R3, [R5]", 2, 2, 20, 0, 0, 0),
]


@pytest.fixture
def export(tmp_path):
    path = tmp_path / "src.csv"
    lines = ['"Kernel Name","kernel_x",', HEADER]
    lines += [",".join(f'"{v}"' for v in row) for row in ROWS]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_phases_end_at_each_barrier_and_unpredicated_exit(export):
    reasons, instructions = read_source_page(export)
    assert reasons == ["stall_long_sb", "stall_barrier"]  # the "(Not Issued)" columns left out
    cut = phases(reasons, instructions)
    # a predicated EXIT does not end a phase; "1,120" is read as 1120
    assert [(p.first, p.end, p.samples, p.executed) for p in cut] == [(0, 3, 53, 160), (3, 6, 7, 1120), (6, 7, 2, 20)]
    assert cut[0].stalls == {"long_sb": 40, "barrier": 10}
    assert cut[0].first_instruction == "LDG.E R2, desc[UR10][R4.64]"


def test_report_gives_each_phase_its_share_of_the_samples(export):
    text = report(export)
    assert "7 instructions, 62 warp-state samples, 3 phases" in text
    assert " 53  85.5%  long_sb 40, barrier 10; LDG.E" in text


def test_an_export_without_the_sampling_columns_is_refused_with_the_command_that_makes_one(tmp_path):
    path = tmp_path / "details.csv"
    path.write_text('"ID","Metric Name","Metric Value"\n"0","Duration","6.27"\n')
    with pytest.raises(ValueError, match="--page source --csv --print-source sass"):
        read_source_page(str(path))
