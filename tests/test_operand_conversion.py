"""The f16 operands of archs without the e4m3 conversion instruction (sm_80, sm_86), on the
CPU: every e4m3 byte and every e2m1 code through the kernels' integer steps
(``warp_ops.e4m3x4_to_f16_bytes``, ``e2m1x8_to_f16_bytes``) and the byte permutes that pair
them (``f16_pair_selectors``, emulated here as ``prmt.b32`` computes it), exact, NaN for NaN,
in every byte position; and the NVFP4 products at the integer route's scale, exact."""

from __future__ import annotations

import math
import random

import pytest
import torch

from cute_kernels.sparse_mla_decode.partial_f16 import PAIR_COLUMNS
from cute_kernels.sparse_mla_decode.warp_ops import (
    E2M1_INTEGER_F16_EXP, E4M3_INTEGER_F16_EXP, F16X2_256, e2m1x8_to_f16_bytes, e4m3x4_to_f16_bytes,
    f16_pair_selectors,
)

from .test_e2m1_operands import e2m1_value

SEED = 44


def prmt(a: int, b: int, selector: int) -> int:
    """``prmt.b32`` (default mode): byte i of the result is byte ``(selector >> 4 i) & 7`` of
    {b, a} (a = bytes 0..3)."""
    both = (a & 0xFFFFFFFF) | (b & 0xFFFFFFFF) << 32
    return sum(((both >> 8 * ((selector >> 4 * i) & 7)) & 0xFF) << 8 * i for i in range(4))


def f16_halves(reg: int) -> list[float]:
    """The two f16 of a 32-bit register, the low half first."""
    data = torch.tensor([reg & 0xFFFF, (reg >> 16) & 0xFFFF], dtype=torch.int32).to(torch.int16)
    return data.view(torch.float16).double().tolist()


def e4m3_values(x: int) -> list[float]:
    data = torch.tensor([(x >> 8 * i) & 0xFF for i in range(4)], dtype=torch.uint8)
    return data.view(torch.float8_e4m3fn).double().tolist()


def signed(x: int) -> int:
    """``x`` as the kernel's signed int32 register holds it."""
    x &= 0xFFFFFFFF
    return x - 2**32 if x >= 2**31 else x


def same(got: float, want: float) -> bool:
    """Equal, sign of zero included, or both NaN."""
    if math.isnan(want):
        return math.isnan(got)
    return got == want and math.copysign(1.0, got) == math.copysign(1.0, want)


@pytest.mark.parametrize("nan", [True, False])
@pytest.mark.parametrize("selector", [0x3210, PAIR_COLUMNS, 0x0123])
def test_every_e4m3_byte_in_every_position_is_its_value_times_2_to_the_minus_8(selector, nan):
    """Every byte value in every byte of a register (the others random, seed printed): the
    two f16x2 hold bytes (s0, s1) and (s2, s3) of the selector as f16 of value x 2**-8,
    subnormals and signed zeros included; the NaN bytes (0x7F, 0xFF) as NaN, or with
    ``nan=False`` (the value operands) as the finite f16 of their bits."""
    rnd = random.Random(SEED)
    for pos in range(4):
        for byte in range(256):
            x = signed((byte << 8 * pos) | (rnd.getrandbits(32) & ~(0xFF << 8 * pos)))
            high, low = e4m3x4_to_f16_bytes(x, nan)
            pairs = [prmt(high, low, sel) for sel in f16_pair_selectors(selector)]
            got = f16_halves(pairs[0]) + f16_halves(pairs[1])
            values = e4m3_values(x)
            want = [values[(selector >> 4 * i) & 0xF] * 2.0**-E4M3_INTEGER_F16_EXP for i in range(4)]
            if not nan:  # s 1111 111 at f16's positions: +-1.875 x 2**(15 - 15)
                bytes_ = [(x >> 8 * ((selector >> 4 * i) & 0xF)) & 0xFF for i in range(4)]
                want = [math.copysign(1.875, -1.0 if b & 0x80 else 1.0) if (b & 0x7F) == 0x7F else w
                        for b, w in zip(bytes_, want)]
            for g, w in zip(got, want):
                assert same(g, w), f"[seed {SEED}] x={x & 0xFFFFFFFF:#010x} selector {selector:#x}: {got} != {want}"
    assert E4M3_INTEGER_F16_EXP == 8


def test_every_e2m1_code_in_every_position_is_its_value_times_2_to_the_minus_14():
    """Every byte in every byte of a register: each nibble's high byte, the low byte 0 (the
    kernel pairs them with a zero register), is the f16 of e2m1 x 2**-14, sign included
    (code 8 is -0; code 1, 0.5, the f16 subnormal 2**-15)."""
    rnd = random.Random(SEED)
    for pos in range(4):
        for byte in range(256):
            x = signed((byte << 8 * pos) | (rnd.getrandbits(32) & ~(0xFF << 8 * pos)))
            lo, hi = e2m1x8_to_f16_bytes(x)
            for form, code in ((lo, byte & 0xF), (hi, byte >> 4)):
                got = f16_halves(prmt(form, 0, f16_pair_selectors(0x3210)[pos // 2]))[pos % 2]
                want = e2m1_value(code) * 2.0**-E2M1_INTEGER_F16_EXP
                assert same(got, want), f"[seed {SEED}] byte {pos} = {byte:#04x}: {got} != {want}"
    assert E2M1_INTEGER_F16_EXP == 14


def test_the_integer_routes_nvfp4_products_are_exact():
    """f16(e2m1 x 2**-14) x f16(E4M3 scale) (the scale from the integer route's f16 of
    scale x 2**-8, times 256 by ``mul.rn.f16x2``, ``F16X2_256``), rounded once to f16, equals
    the exact product x 2**-14 for all 16 codes and all 254 finite scales: every product is a
    multiple of 2**-24, f16's smallest subnormal, and below 1."""
    codes = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    scales = raw.view(torch.float8_e4m3fn).double()
    finite = torch.isfinite(scales)
    # the scale as the integer route builds it: the f16 of scale x 2**-8, times 256 in f16
    first = f16_pair_selectors(0x3210)[0]  # byte 0 in the low half
    shifted = torch.tensor([f16_halves(prmt(*e4m3x4_to_f16_bytes(b), first))[0] for b in raw.tolist()],
                           dtype=torch.float64)
    assert F16X2_256 & 0xFFFF == torch.tensor(256.0, dtype=torch.float16).view(torch.int16).item()
    scale_f16 = (shifted.to(torch.float16) * torch.tensor(256.0, dtype=torch.float16))
    assert torch.equal(scale_f16.double()[finite], scales[finite]) and scale_f16[~finite].isnan().all()
    a = (codes * 2.0**-E2M1_INTEGER_F16_EXP).to(torch.float16)
    assert torch.equal(a.double(), codes * 2.0**-E2M1_INTEGER_F16_EXP)
    product = (a[:, None] * scale_f16[finite].to(torch.float16)[None, :]).double()
    assert torch.equal(product, codes[:, None] * scales[finite][None, :] * 2.0**-E2M1_INTEGER_F16_EXP)


def test_pair_selectors_take_the_high_byte_from_the_first_register():
    """Pair (s0, s1): result bytes [low s0, high s0, low s1, high s1]; a selector reaching
    past the register's 4 bytes is refused."""
    assert f16_pair_selectors(0x3210) == (0x1504, 0x3726)
    assert f16_pair_selectors(PAIR_COLUMNS) == (0x2604, 0x3715)
    with pytest.raises(ValueError, match="bytes 0..3"):
        f16_pair_selectors(0x4210)
