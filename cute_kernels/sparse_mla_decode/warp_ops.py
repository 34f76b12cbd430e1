"""Register-level PTX the "f16" and FP8 partial kernels issue by hand (CuTe DSL, inline asm).

These paths feed the tensor cores straight from the gathered cache rows and from registers
built in the kernel (converted or quantized Q, the probabilities), in fragment orders the
kernels choose (``partial_f16.py``, ``partial_fp8.py``), so they work on 32-bit fragment
registers rather than on CuTe fragments. Everything here is one PTX instruction or a short fixed
sequence. ``mma_e4m3``, ``pack_e4m3x4``, ``quantize_two_terms`` and ``e4m3x4_to_f16x2`` need the
e4m3 instructions (sm_89+), ``mma_mxf8`` the block-scaled MMA (sm_120a / sm_121a); on an arch
without the e4m3 conversion, ``OperandConversion`` makes the f16 operands by integer operations
(``arch.Arch`` has the facts).

Fragment conventions (PTX ISA, ``mma.m16n8k32`` with .e4m3, ``mma.m16n8k16`` with .bf16;
g = lane / 4, q = lane % 4):
- A e4m3: a0 = A[g][4q..4q+3], a1 = A[g+8][4q..4q+3], a2 = A[g][16+4q..], a3 = A[g+8][16+4q..]
- B e4m3: b0 = B[4q..4q+3][g], b1 = B[16+4q..16+4q+3][g]
- A bf16: a0 = A[g][2q, 2q+1], a1 = A[g+8][2q, 2q+1], a2 = A[g][8+2q, ..], a3 = A[g+8][8+2q, ..]
- B bf16: b0 = B[2q, 2q+1][g], b1 = B[8+2q, 8+2q+1][g]
- C f32 (both): c0, c1 = C[g][2q, 2q+1], c2, c3 = C[g+8][2q, 2q+1]
The lowest byte (half) of a register is the lowest index.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm


def _asm(results: list, operands: list, text: str, constraints: str, side_effects: bool = False):
    """One inline-asm op; returns the result values (a list when there are several)."""
    ty = results[0] if len(results) == 1 else llvm.StructType.get_literal(results)
    out = llvm.inline_asm(
        ty, [x.ir_value() for x in operands], text, constraints,
        has_side_effects=side_effects, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    if len(results) == 1:
        return out
    return [llvm.extractvalue(t, out, [i]) for i, t in enumerate(results)]


def ldsm_x4(smem_addr: Int32, trans: bool) -> list:
    """``ldmatrix.x4`` (b16): four 8x8 matrices, lanes 8i..8i+7 give the row addresses of
    matrix i. Without ``trans`` lane t gets row t/4, 16-bit columns 2(t%4), 2(t%4)+1 of each
    matrix; with ``trans`` it gets rows 2(t%4), 2(t%4)+1 of 16-bit column t/4 (low half the
    lower row). Ordered with the barriers around it (side effects): it reads shared memory."""
    i32 = Int32.mlir_type
    op = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" if trans else "ldmatrix.sync.aligned.m8n8.x4.shared.b16"
    regs = _asm([i32] * 4, [Int32(smem_addr)], op + " {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
                side_effects=True)
    return [Int32(r) for r in regs]


def _mma_m16n8(shape_types: str, c: list, a: list, b: list) -> list:
    """d = a * b + c, ``mma.sync.aligned.<shape_types>`` with 4 A, 2 B and 4 f32 C/D registers."""
    f32 = Float32.mlir_type
    d = _asm(
        [f32] * 4, [Float32(x) for x in c] + [Int32(x) for x in a] + [Int32(x) for x in b],
        f"mma.sync.aligned.{shape_types} {{$0, $1, $2, $3}}, {{$8, $9, $10, $11}}, {{$12, $13}}, {{$4, $5, $6, $7}};",
        "=f,=f,=f,=f,f,f,f,f,r,r,r,r,r,r",
    )
    return [Float32(x) for x in d]


def mma_e4m3(c: list, a: list, b: list) -> list:
    """d = a * b + c, ``mma.sync.m16n8k32`` e4m3 x e4m3 -> f32 (sm_89+)."""
    return _mma_m16n8("m16n8k32.row.col.f32.e4m3.e4m3.f32", c, a, b)


def mma_mxf8(c: list, a: list, b: list, sfa: Int32, sfb: Int32) -> list:
    """d = (a * 2**(sfa - 127)) * (b * 2**(sfb - 127)) + c per row of A / column of B: the
    SM120 block-scaled ``mma.sync.m16n8k32`` (kind::mxf8f6f4, e4m3 x e4m3 -> f32, one UE8M0
    scale per row of A / column of B and 32 k values: scale_vec::1X), byte and thread
    selectors 0. Scale map with selectors 0, as measured on an sm_121a GPU outside this
    project (the PTX ISA's table reads differently): byte 0 of ``sfa`` in
    quad column 0 scales row g, in quad column 1 row g + 8; byte 0 of ``sfb`` in quad
    column 0 scales column g. sm_120a/sm_121a only: compiled and SASS-checked here, never
    executed by this project's tests (the test GPU is an sm_90 H200)."""
    f32 = Float32.mlir_type
    d = _asm(
        [f32] * 4, [Float32(x) for x in c] + [Int32(x) for x in a] + [Int32(x) for x in b] + [Int32(sfa), Int32(sfb)],
        "mma.sync.aligned.kind::mxf8f6f4.block_scale.scale_vec::1X.m16n8k32.row.col.f32.e4m3.e4m3.f32.ue8m0 "
        "{$0, $1, $2, $3}, {$8, $9, $10, $11}, {$12, $13}, {$4, $5, $6, $7}, {$14}, {0, 0}, {$15}, {0, 0};",
        "=f,=f,=f,=f,f,f,f,f,r,r,r,r,r,r,r,r",
    )
    return [Float32(x) for x in d]


def mma_bf16(c: list, a: list, b: list) -> list:
    """d = a * b + c, ``mma.sync.m16n8k16`` bf16 x bf16 -> f32."""
    return _mma_m16n8("m16n8k16.row.col.f32.bf16.bf16.f32", c, a, b)


def pack_e4m3x4(x0: Float32, x1: Float32, x2: Float32, x3: Float32) -> Int32:
    """Four floats rounded to e4m3 (nearest even, saturating to +-448), x0 in the low byte."""
    return Int32(_asm(
        [Int32.mlir_type], [Float32(x0), Float32(x1), Float32(x2), Float32(x3)],
        "{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\nmov.b32 $0, {lo, hi};\n}",
        "=r,f,f,f,f",
    ))


def quantize_two_terms(x0: Float32, x1: Float32, x2: Float32, x3: Float32) -> list:
    """Four floats as two e4m3 terms (packed like ``pack_e4m3x4``): hi = e4m3(x) and
    lo = e4m3(16 * (x - hi)), so x ~= hi + lo / 16 to about 8 significant bits (|x| <= 448:
    the residual is at most half an e4m3 step, 16, so 16 * residual stays in range)."""
    i32 = Int32.mlir_type
    hi, lo = _asm(
        [i32, i32], [Float32(x0), Float32(x1), Float32(x2), Float32(x3)],
        "{\n.reg .b16 h01, h23, l01, l23;\n.reg .b32 p01, p23;\n.reg .f16 e0, e1, e2, e3;\n"
        ".reg .f32 r0, r1, r2, r3;\n"
        "cvt.rn.satfinite.e4m3x2.f32 h01, $3, $2;\ncvt.rn.satfinite.e4m3x2.f32 h23, $5, $4;\n"
        "mov.b32 $0, {h01, h23};\n"
        "cvt.rn.f16x2.e4m3x2 p01, h01;\ncvt.rn.f16x2.e4m3x2 p23, h23;\n"
        "mov.b32 {e0, e1}, p01;\nmov.b32 {e2, e3}, p23;\n"
        "cvt.f32.f16 r0, e0;\ncvt.f32.f16 r1, e1;\ncvt.f32.f16 r2, e2;\ncvt.f32.f16 r3, e3;\n"
        "sub.rn.f32 r0, $2, r0;\nsub.rn.f32 r1, $3, r1;\nsub.rn.f32 r2, $4, r2;\nsub.rn.f32 r3, $5, r3;\n"
        "mul.rn.f32 r0, r0, 0f41800000;\nmul.rn.f32 r1, r1, 0f41800000;\n"
        "mul.rn.f32 r2, r2, 0f41800000;\nmul.rn.f32 r3, r3, 0f41800000;\n"
        "cvt.rn.satfinite.e4m3x2.f32 l01, r1, r0;\ncvt.rn.satfinite.e4m3x2.f32 l23, r3, r2;\n"
        "mov.b32 $1, {l01, l23};\n}",
        "=r,=r,f,f,f,f",
    )
    return [Int32(hi), Int32(lo)]


def pack_bf16x2(x0: Float32, x1: Float32) -> Int32:
    """Two floats rounded to bf16 (nearest even), x0 in the low half."""
    return Int32(_asm([Int32.mlir_type], [Float32(x1), Float32(x0)], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f"))


def byte_perm(a: Int32, b: Int32, selector: int) -> Int32:
    """``prmt.b32``: byte i of the result is byte ``(selector >> 4i) & 7`` of {b, a} (a = 0..3)."""
    return Int32(_asm([Int32.mlir_type], [Int32(a), Int32(b), Int32(selector)], "prmt.b32 $0, $1, $2, $3;",
                      "=r,r,r,r"))


def warp_max_u32(x: Int32) -> Int32:
    """The maximum of ``x`` (unsigned) over the 32 lanes of the warp (``redux.sync``)."""
    return Int32(_asm([Int32.mlir_type], [Int32(x)], "redux.sync.max.u32 $0, $1, 0xffffffff;", "=r,r",
                      side_effects=True))


def f32_from_bits(bits: Int32) -> Float32:
    """Reinterpret the bits of an Int32 as a Float32."""
    return Float32(llvm.bitcast(Float32.mlir_type, Int32(bits).ir_value()))


def pow2_f32_bits(e_bits: Int32) -> Float32:
    """2**e from ``e_bits`` = (e + 127) << 23 (an f32's bits), 0 where that is <= 0 (e <= -127)."""
    return f32_from_bits(cutlass.max(e_bits, Int32(0)))


def pow2_f32(e: Int32) -> Float32:
    """2**e as f32 for e <= 127, exactly for e >= -126; 0 for e <= -127 (so only where a
    factor that small is negligible)."""
    return pow2_f32_bits((e + 127) << 23)


def ue8m0_scale(b: Int32) -> Float32:
    """The UE8M0 scale 2**(b - 127) of scale byte ``b`` (0..254), exactly: the bits b << 23 for
    b >= 1, and for b = 0 the subnormal 2**-127 (bits 1 << 22, below every b >= 1: one integer
    max instead of a test and a select)."""
    return f32_from_bits(cutlass.max(Int32(b) << 23, Int32(1 << 22)))


def f32_bits(x: Float32) -> Int32:
    """The bits of a Float32 as an Int32."""
    return Int32(llvm.bitcast(Int32.mlir_type, Float32(x).ir_value()))


def mma_f16(c: list, a: list, b: list) -> list:
    """d = a * b + c, ``mma.sync.m16n8k16`` f16 x f16 -> f32."""
    return _mma_m16n8("m16n8k16.row.col.f32.f16.f16.f32", c, a, b)


def e4m3x4_to_f16x2(x: Int32, selector: int = 0x3210) -> list:
    """The four e4m3 bytes of ``x``, after ``prmt.b32`` with ``selector`` (0x3210: as they
    are, no permute), as two f16x2 registers [bytes 0, 1], [bytes 2, 3]
    (``cvt.rn.f16x2.e4m3x2``: exact, every e4m3 value is an f16 value). (ptxas keeps an
    identity ``prmt`` of inline PTX: one PRMT per call, 16 per chunk in each "f16" nope
    warp's QK, hence none for 0x3210.)"""
    i32 = Int32.mlir_type
    permute = "" if selector == 0x3210 else f"prmt.b32 t, $2, 0, {selector:#x};\n"
    lo, hi = _asm(
        [i32, i32], [Int32(x)],
        "{\n.reg .b32 t;\n.reg .b16 l, h;\n"
        + (permute or "mov.b32 t, $2;\n")
        + "mov.b32 {l, h}, t;\ncvt.rn.f16x2.e4m3x2 $0, l;\ncvt.rn.f16x2.e4m3x2 $1, h;\n}",
        "=r,=r,r",
    )
    return [Int32(lo), Int32(hi)]


# e2m1 -> f16 in registers, by way of e4m3: nibble ``s ee m`` as the e4m3 byte ``s 00ee m00``
# is the e4m3 value e2m1 x 2**-6 (codes 0-1 the e4m3 subnormals 0 and 2**-7, codes 2-7
# exponent fields 1-3), which ``cvt.rn.f16x2.e4m3x2`` turns into f16 exactly. Integer shifts
# and masks, then the conversion the e4m3 formats use (no e2m1 conversion instruction is
# needed). Without that conversion: ``e2m1x8_to_f16_bytes``.
E2M1_F16_EXP = 6


def e2m1x8_to_e4m3x8(x):
    """The 8 e2m1 nibbles of ``x`` as e4m3 bytes of e2m1 x 2**-6 (``E2M1_F16_EXP``), in two
    registers: (the low nibbles of bytes 0..3, the high nibbles of bytes 0..3), byte i of
    each from byte i of ``x``: exact. Plain shifts and masks, so that it also runs on Python
    ints (the low 32 bits: the test of every code, ``tests/test_e2m1_operands.py``)."""
    lo = ((x << 4) & -0x7F7F7F80) | ((x << 2) & 0x1C1C1C1C)
    hi = (x & -0x7F7F7F80) | ((x >> 2) & 0x1C1C1C1C)
    return lo, hi


def pack_f16x2(x0: Float32, x1: Float32) -> Int32:
    """Two floats rounded to f16 (nearest even; subnormals kept, beyond range to inf), x0 in the low half."""
    return Int32(_asm([Int32.mlir_type], [Float32(x1), Float32(x0)], "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f"))


def f16x2_to_f32(x: Int32) -> list:
    """The two f16 halves of ``x`` as f32 (exact), the low half first."""
    lo, hi = _asm([Float32.mlir_type] * 2, [Int32(x)],
                  "{\n.reg .f16 l, h;\nmov.b32 {l, h}, $2;\ncvt.f32.f16 $0, l;\ncvt.f32.f16 $1, h;\n}", "=f,=f,r")
    return [Float32(lo), Float32(hi)]


def mul_f16x2(a: Int32, b: Int32) -> Int32:
    """Element-wise product of two f16x2 registers (``mul.rn.f16x2``)."""
    return Int32(_asm([Int32.mlir_type], [Int32(a), Int32(b)], "mul.rn.f16x2 $0, $1, $2;", "=r,r,r"))


def sync_threads_or(flag: Int32) -> Int32:
    """``__syncthreads_or``: a CTA barrier (barrier 0, every thread) that also returns 1 to
    every thread when ``flag`` is nonzero in any thread, else 0 (``barrier.cta.red.or``; the
    same memory ordering as ``bar.sync``)."""
    return Int32(_asm([Int32.mlir_type], [Int32(flag)],
                      "{\n.reg .pred p, q;\nsetp.ne.u32 p, $1, 0;\nbarrier.cta.red.or.pred q, 0, p;\n"
                      "selp.u32 $0, 1, 0, q;\n}", "=r,r", side_effects=True))


def rcp_approx(x: Float32) -> Float32:
    """1 / x to within one ulp (``rcp.approx.ftz.f32``: one MUFU.RCP; x normal, results below
    2**-126 flushed to 0)."""
    return Float32(_asm([Float32.mlir_type], [Float32(x)], "rcp.approx.ftz.f32 $0, $1;", "=f,f"))


# ---------------------------------------------------------------------- without the e4m3 conversion
# An e4m3 byte ``s eeee mmm`` at f16's bit positions, ``s 0eeee mmm0000000``, is the f16 of its
# value x 2**-8, normals and subnormals alike: the exponent field keeps its value and f16's
# bias is 8 more (15 against 7); an e4m3 subnormal, 2**-6 x m / 8, lands on the f16 subnormal
# 2**-14 x m / 8. The NaN bytes (``s 1111 111``) would land on a finite f16 (1.875): they get
# f16's top exponent bit as well, so that they are f16 NaN as they are e4m3 NaN.
E4M3_INTEGER_F16_EXP = 8
# e2m1: nibble ``s ee m`` at f16's bit positions ``s 000ee m000000000`` is e2m1 x 2**-14
# (code 1, 0.5, the f16 subnormal 2**-15): the high byte ``s 000 eem 0`` and a zero low byte
E2M1_INTEGER_F16_EXP = 14
F16X2_256 = 0x5C005C00  # (256.0, 256.0) as f16x2


def e4m3x4_to_f16_bytes(x, nan: bool = True):
    """The f16 of each of the four e4m3 bytes of ``x`` (the value x 2**-8; with ``nan``, NaN
    for NaN, else a NaN byte's f16 is finite) as two registers: byte i of the first is the
    high byte of f16 i, byte i of the second its low byte (``_f16_pairs`` puts them together).
    Plain shifts, masks and an add, so that it also runs on Python ints (the low 32 bits: the
    test of every byte, ``tests/test_operand_conversion.py``)."""
    if nan:  # bits 6..0 of each byte as they are, bit 7 the carry of them + 1: set for NaN (all ones)
        marked = _bitselect(-0x7F7F7F80, (x & 0x7F7F7F7F) + 0x01010101, x)
    else:
        marked = x & 0x7F7F7F7F
    high = _bitselect(-0x7F7F7F80, x, marked >> 1)  # s, the NaN bit, eeee, mm
    low = (x << 7) & -0x7F7F7F80  # the last mantissa bit
    return high, low


def _bitselect(mask, a, b):
    """The bits of ``a`` where ``mask`` is set, of ``b`` elsewhere: one ``LOP3`` (written so,
    rather than as (a & mask) | (b & ~mask), which ptxas built from two)."""
    return b ^ ((b ^ a) & mask)


def e2m1x8_to_f16_bytes(x):
    """The 8 e2m1 nibbles of ``x`` as the high bytes of f16 of e2m1 x 2**-14 (the low bytes
    are 0), in two registers as ``e2m1x8_to_e4m3x8`` orders them: (the low nibbles of bytes
    0..3, the high nibbles). Runs on Python ints too."""
    lo = ((x << 4) & -0x7F7F7F80) | ((x << 1) & 0x0E0E0E0E)
    hi = (x & -0x7F7F7F80) | ((x >> 3) & 0x0E0E0E0E)
    return lo, hi


def f16_pair_selectors(selector: int) -> tuple[int, int]:
    """The ``prmt.b32`` selectors of ``_f16_pairs``: bytes (s0, s1) and (s2, s3) of the input
    (``selector``'s nibbles, as ``e4m3x4_to_f16x2`` takes it) as two f16x2, each f16's high
    byte from the first source (bytes 0..3), its low byte from the second (bytes 4..7)."""
    nib = [(selector >> 4 * i) & 0xF for i in range(4)]
    if any(n > 3 for n in nib):
        raise ValueError(f"selector {selector:#x} must pick bytes 0..3 of one register")
    return tuple((4 + a) | a << 4 | (4 + b) << 8 | b << 12 for a, b in ((nib[0], nib[1]), (nib[2], nib[3])))


def _f16_pairs(high: Int32, low: Int32, selector: int) -> list:
    """Two f16x2 registers from the high and low bytes of four f16 (``f16_pair_selectors``)."""
    return [byte_perm(high, low, sel) for sel in f16_pair_selectors(selector)]


class OperandConversion:
    """How a kernel turns cache bytes into f16 MMA operands on its arch: by the e4m3
    conversion instruction where the arch has it (``arch.Arch.e4m3_cvt``: the e4m3 values as
    they are, e2m1 x 2**-6), else by integer operations (e4m3 x 2**-8, e2m1 x 2**-14: every
    value exact, subnormals included). ``e4m3_exp`` / ``e2m1_exp``: the operands are the
    values times 2**-exp, which the kernel puts back into its partial scores' and outputs'
    units. Each method takes a register of packed bytes and a byte selector as
    ``e4m3x4_to_f16x2`` does."""

    def __init__(self, by_instruction: bool):
        self.by_instruction = by_instruction
        self.e4m3_exp = 0 if by_instruction else E4M3_INTEGER_F16_EXP
        self.e2m1_exp = E2M1_F16_EXP if by_instruction else E2M1_INTEGER_F16_EXP

    def e4m3x4(self, x, selector: int = 0x3210, nan: bool = True) -> list:
        """Two f16x2 of e4m3 x 2**-``e4m3_exp``: [bytes s0, s1], [bytes s2, s3]. Without the
        instruction about 10 integer instructions per register (the NaN test 3 of them, a
        ``prmt`` per pair) against 2 conversions. ``nan=False``: a NaN byte may come out
        finite, which the value operands allow: every value byte is a key byte too, whose
        NaN has made its entry's score, and so its P, NaN already."""
        if self.by_instruction:
            return e4m3x4_to_f16x2(x, selector)
        high, low = e4m3x4_to_f16_bytes(Int32(x), nan)
        return _f16_pairs(high, low, selector)

    def e4m3x4_exact(self, x, selector: int = 0x3210, nan: bool = True) -> list:
        """``e4m3x4`` with the values as they are (integer route: times 256 by one
        ``mul.rn.f16x2`` per pair, exact: |e4m3| <= 448)."""
        pairs = self.e4m3x4(x, selector, nan)
        if self.by_instruction:
            return pairs
        return [mul_f16x2(r, Int32(F16X2_256)) for r in pairs]

    def e2m1x8(self, x, selector: int = 0x3210) -> tuple:
        """The 8 e2m1 values of ``x`` as f16 x 2**-``e2m1_exp``: (the low nibbles' two f16x2,
        the high nibbles'), bytes picked by ``selector``. The same count either way: 7 integer
        instructions for the 8 nibbles, then a conversion, or a ``prmt``, per pair."""
        if self.by_instruction:
            lo, hi = e2m1x8_to_e4m3x8(x)
            return e4m3x4_to_f16x2(lo, selector), e4m3x4_to_f16x2(hi, selector)
        lo, hi = e2m1x8_to_f16_bytes(Int32(x))
        zero = Int32(0)
        return _f16_pairs(lo, zero, selector), _f16_pairs(hi, zero, selector)
