"""The SASS readers of cute_kernels.sass_check, on hand-written SASS (no compiler needed)."""

from __future__ import annotations

import pytest

from cute_kernels.sass_check import CHAIN_WINDOW, mma_loop_mix, mma_loops, waits_before_first_copy

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDS R2, [R3] ;
.L_x_1:
        /*0020*/                   LDSM.16.M88.4 R8, [R3] ;
        /*0030*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0040*/              @P1 BRA `(.L_x_1) ;
        /*0050*/                   STS.128 [R5], R8 ;
        /*0060*/                   HMMA.16816.F32.BF16 R4, R8, R14, R4 ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0080*/              @P0 BRA `(.L_x_0) ;
        /*0090*/                   EXIT ;
"""


def test_mma_loop_mix_counts_the_innermost_loop_holding_every_mma():
    mix = mma_loop_mix(SASS)  # .L_x_1 holds only the first HMMA: the loop is .L_x_0
    assert (mix.instructions, mix.mma, mix.shared_memory, mix.barriers) == (8, 2, 3, 1)


def test_mma_loop_mix_refuses_sass_without_mma_or_loop():
    with pytest.raises(ValueError, match="no MMA"):
        mma_loop_mix(SASS.replace("HMMA.16816.F32.BF16", "FFMA"))
    with pytest.raises(ValueError, match="no loop"):
        mma_loop_mix(SASS.replace("@P0 BRA `(.L_x_0)", "NOP"))


TWO_ROLES = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @P2 BRA `(.L_x_5) ;
.L_x_3:
        /*0020*/                   F2FP.F16.E4M3.UNPACK_B R8, R9 ;
        /*0030*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/              @P0 BRA `(.L_x_3) ;
        /*0060*/                   EXIT ;
.L_x_5:
.L_x_4:
        /*0070*/                   LDSM.16.MT88.4 R8, [R3] ;
        /*0080*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0090*/                   HMMA.16816.F32.BF16 R4, R8, R14, R4 ;
        /*00a0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00b0*/              @P1 BRA `(.L_x_4) ;
        /*00c0*/                   EXIT ;
"""


def test_mma_loops_finds_each_role_loop_with_its_mma_kinds():
    first, second = mma_loops(TWO_ROLES)
    assert (first.instructions, first.mma, first.barriers) == (4, 1, 1)
    assert first.mma_kinds == {"HMMA.16816.F32": 1}
    assert (second.instructions, second.mma, second.shared_memory) == (5, 2, 1)
    assert second.mma_kinds == {"HMMA.16816.F32.BF16": 2}
    assert [m.instructions for m in mma_loops(SASS)] == [3]  # .L_x_1: the innermost loop with an MMA


NESTED_RESCALE = """
.L_x_0:
        /*0000*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0020*/              @!P1 BRA `(.L_x_2) ;
.L_x_1:
        /*0030*/                   FMUL R4, R4, R20 ;
        /*0040*/                   FMUL R5, R5, R20 ;
        /*0050*/              @P2 BRA `(.L_x_1) ;
.L_x_2:
        /*0060*/                   HMMA.16816.F32 R4, R8, R14, R4 ;
        /*0070*/              @P0 BRA `(.L_x_0) ;
        /*0080*/                   EXIT ;
"""


def test_mma_loops_counts_a_nested_loop_without_mma_apart():
    (loop,) = mma_loops(NESTED_RESCALE)  # .L_x_1 has no MMA: .L_x_0 stays the innermost MMA loop
    assert (loop.instructions, loop.mma, loop.nested) == (8, 2, 3)
    (role,) = [m for m in mma_loops(TWO_ROLES) if m.mma == 1]
    assert role.nested == 0


CHAINS = """
.L_x_0:
        /*0000*/                   HMMA.16816.F32 R20, R32, R20, RZ ;
        /*0010*/                   NOP ;
        /*0020*/                   HMMA.16816.F32 R20, R36, R16, R20 ;
        /*0030*/                   HMMA.16816.F32 R24, R36, R16, R24 ;
        /*0040*/                   F2FP.F16.E4M3.UNPACK_B R16, R17 ;
        /*0050*/                   HMMA.16816.F32 R28, R40, R16, R24 ;
        /*0060*/                   HMMA.16816.F32 R24, R40, R18, R20 ;
        /*0070*/              @P0 HMMA.16816.F32.BF16 R2, R40, R18, R24 ;
        /*0080*/              @P0 BRA `(.L_x_0) ;
"""


def test_chained_mma_counts_each_mma_fed_by_the_one_just_before():
    # 0x20 takes 0x00's R20 (a NOP between does not break it), 0x50 takes 0x30's R24 (an
    # F2FP between), 0x70 (predicated) takes 0x60's R24; 0x30 and 0x60 read other registers
    (loop,) = mma_loops(CHAINS)
    assert (loop.mma, loop.chained_mma) == (6, 3)


def test_chained_mma_ignores_an_mma_a_latency_or_more_after_the_one_it_reads():
    # the second MMA reads the first's R20: chained at CHAIN_WINDOW - 1 instructions after it
    # (CHAIN_WINDOW - 2 between), not at CHAIN_WINDOW (the first one's result is ready)
    def loop(between: int) -> str:
        lines = ["        /*0000*/                   HMMA.16816.F32 R20, R32, R20, RZ ;"]
        lines += [f"        /*{16 * (k + 1):04x}*/                   FADD R{k % 8}, R1, R2 ;" for k in range(between)]
        lines += [f"        /*{16 * (between + 1):04x}*/                   HMMA.16816.F32 R20, R36, R16, R20 ;",
                  f"        /*{16 * (between + 2):04x}*/              @P0 BRA `(.L_x_0) ;"]
        return ".L_x_0:\n" + "\n".join(lines) + "\n"
    assert mma_loops(loop(CHAIN_WINDOW - 2))[0].chained_mma == 1
    assert mma_loops(loop(CHAIN_WINDOW - 1))[0].chained_mma == 0


def test_forbidden_instructions_match_by_opcode_and_modifier():
    """An entry "OP" names every OP instruction, "OP.MOD" an OP with MOD among its modifiers
    (``Arch.forbidden_sass``): the e4m3 conversion and PDL's instructions on sm_80, nothing
    of an sm_120a f16 kernel's mix on sm_120a."""
    from cute_kernels.arch import ARCHS
    from cute_kernels.sass_check import forbidden_in

    opcodes = [("F2FP", ".F16.E4M3.UNPACK_B"), ("F2FP", ".BF16.F32.PACK_AB"), ("HMMA", ".16816.F32"),
               ("PREEXIT", ""), ("ACQBULK", ""), ("QMMA", ".SF.16832.F32.E4M3.E4M3.E8"), ("LOP3", ".LUT")]
    assert forbidden_in(opcodes, ARCHS["sm_80"].forbidden_sass) == [
        "ACQBULK", "F2FP.F16.E4M3.UNPACK_B", "PREEXIT", "QMMA.SF.16832.F32.E4M3.E4M3.E8"]
    assert forbidden_in(opcodes, ARCHS["sm_89"].forbidden_sass) == [
        "ACQBULK", "PREEXIT", "QMMA.SF.16832.F32.E4M3.E4M3.E8"]
    assert forbidden_in(opcodes, ARCHS["sm_120a"].forbidden_sass) == []
    assert forbidden_in([("HGMMA", ".64x128x16.F32")], ARCHS["sm_120a"].forbidden_sass) == ["HGMMA.64x128x16.F32"]
    assert forbidden_in([("F2FP", ".BF16.F32.PACK_AB")], ("F2FP.E4M3",)) == []


PROLOGUE = """
        /*0000*/                   LDG.E R2, desc[UR10][R4.64] ;
        /*0010*/                   LDG.E.64 R8, desc[UR10][R6.64] ;
        /*0020*/                   IADD3 R13, R14, 0x1, RZ ;
        /*0030*/              @!P1 LDGSTS.E [R17+0x13a10], desc[UR10][R14.64] ;
        /*0040*/                   LDGSTS.E.BYPASS.128 [R16], desc[UR10][R10.64] ;
        /*0050*/                   LDGDEPBAR ;
        /*0060*/                   VIMNMX.RELU R2, R2, R39, PT ;
"""


def _with(line_at_0x20: str, sass: str = PROLOGUE) -> str:
    return sass.replace("IADD3 R13, R14, 0x1, RZ", line_at_0x20)


def test_waits_before_first_copy_finds_an_instruction_naming_a_pending_load_before_the_first_commit():
    # R2's read comes after the first group's commit (LDGDEPBAR): not before it
    assert waits_before_first_copy(PROLOGUE) == []
    assert waits_before_first_copy(_with("IADD3 R13, R2, 0x1, RZ")) == ["IADD3 R13, R2, 0x1, RZ"]
    # a 64-bit load writes two registers (R8, R9); a 64-bit operand names two (R1.64: R1, R2)
    assert waits_before_first_copy(_with("IADD3 R13, R9, 0x1, RZ")) == ["IADD3 R13, R9, 0x1, RZ"]
    assert waits_before_first_copy(_with("LDG.E R13, desc[UR10][R1.64]")) == ["LDG.E R13, desc[UR10][R1.64]"]
    # the width among other suffixes: a 64-bit load through the constant cache writes R8 and R9
    constant = PROLOGUE.replace("LDG.E.64 R8", "LDG.E.64.CONSTANT R8")
    assert waits_before_first_copy(_with("IADD3 R13, R9, 0x1, RZ", constant)) == ["IADD3 R13, R9, 0x1, RZ"]
    wide = PROLOGUE.replace("LDG.E.64 R8", "LDG.E.128.CONSTANT R8")
    # (R8-R11: the copy's address R10.64 waits for it too)
    assert waits_before_first_copy(_with("IADD3 R13, R11, 0x1, RZ", wide)) == [
        "IADD3 R13, R11, 0x1, RZ", "LDGSTS.E.BYPASS.128 [R16], desc[UR10][R10.64]"]
    assert waits_before_first_copy(_with("IADD3 R13, R12, 0x1, RZ", constant)) == []
    # a write waits for the load's result too, predicated or not
    assert waits_before_first_copy(_with("@P0 MOV R2, RZ")) == ["@P0 MOV R2, RZ"]
    # after a copy of the group, before its commit: the group's later copies wait
    late = PROLOGUE.replace("LDGSTS.E.BYPASS.128 [R16], desc[UR10][R10.64]", "VIMNMX R16, R2, R3, PT")
    assert waits_before_first_copy(late) == ["VIMNMX R16, R2, R3, PT"]
    # no commit at all (the merge kernel): nothing to hold back
    no_copy = "\n".join(line for line in PROLOGUE.splitlines() if "LDGDEPBAR" not in line)
    assert waits_before_first_copy(_with("IADD3 R13, R2, 0x1, RZ", no_copy)) == []
