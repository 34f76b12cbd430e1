"""The "f16" kernel's NVFP4 operands on the CPU: every e2m1 code through the kernel's integer
step to e4m3 (``warp_ops.e2m1x8_to_e4m3x8``, then the e4m3 -> f16 conversion), and every code
times every E4M3 scale as one f16 product, exact (``partial_f16._e2m1_qk_fragments`` /
``_e2m1_pv`` rely on both)."""

from __future__ import annotations

import random

import torch

from cute_kernels.sparse_mla_decode.warp_ops import E2M1_F16_EXP, e2m1x8_to_e4m3x8

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_value(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def e4m3_bytes(bits: int) -> list[float]:
    """The four e4m3 values of a 32-bit pattern (byte 0 first)."""
    data = torch.tensor([(bits >> (8 * i)) & 0xFF for i in range(4)], dtype=torch.uint8)
    return data.view(torch.float8_e4m3fn).double().tolist()


def test_every_code_in_every_byte_converts_exactly():
    """Every byte value in every byte of a register (the other bytes random): the low nibble
    of byte i becomes byte i of the first result, the high nibble byte i of the second, each
    the e4m3 value e2m1 x 2**-6, sign included (code 8 is -0)."""
    rnd = random.Random(0)
    for i in range(4):
        for byte in range(256):
            x = (byte << 8 * i) | (rnd.getrandbits(32) & ~(0xFF << 8 * i))
            if x >= 2**31:
                x -= 2**32  # the kernel's registers are signed int32
            lo, hi = e2m1x8_to_e4m3x8(x)
            for got, code in ((e4m3_bytes(lo)[i], byte & 0xF), (e4m3_bytes(hi)[i], byte >> 4)):
                assert got == e2m1_value(code) * 2.0**-E2M1_F16_EXP, f"byte {i} = {byte:#04x}: {got}"
                assert math_signbit(got) == bool(code & 8)
    assert E2M1_F16_EXP == 6


def math_signbit(v: float) -> bool:
    return torch.signbit(torch.tensor(v)).item()


def test_every_code_times_every_scale_is_one_exact_f16_product():
    """f16(e2m1 x 2**-6) x f16(E4M3 scale), rounded once to f16, equals the exact product
    x 2**-6 for all 16 codes and all 254 finite scale bytes (0 to 448, subnormals included;
    the smallest nonzero product, 2**-16, is an f16 value): the value operands of the NVFP4
    "f16" kernel carry no rounding."""
    codes = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
    scales = scales[torch.isfinite(scales)]
    assert scales.numel() == 254 and scales.max() == 448 and scales[scales > 0].min() == 2.0**-9
    a = (codes * 2.0**-E2M1_F16_EXP).to(torch.float16)
    assert torch.equal(a.double(), codes * 2.0**-E2M1_F16_EXP)  # the operand itself: exact
    product = (a[:, None] * scales.to(torch.float16)[None, :]).double()  # f16 x f16, one rounding
    assert torch.equal(product, codes[:, None] * scales[None, :] * 2.0**-E2M1_F16_EXP)
