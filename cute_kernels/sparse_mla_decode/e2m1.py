"""The e2m1 (FP4) element: its values, the round-to-nearest-even encoding the GPU writers'
conversion gives, and two nibbles to a byte (element 2i in the low nibble of byte i)."""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
# the e2m1 nibble s ee m: codes 0..7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign (8 is -0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """The e2m1 nibbles (uint8 0..15, ``E2M1_VALUES``) of float32 ``x`` as a satfinite
    round-to-nearest-even conversion (``cvt.rn.satfinite.e2m1x2.f32``) writes them: ties to the
    even code, given as values (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4),
    magnitudes past 6 (infinities included) saturated to 6, the sign of a zero kept (-0 and
    negatives that round to 0 are code 8); NaN is +6 (code 7: e2m1 has no NaN)."""
    x = x.float()
    a = x.abs()
    # the code of |x| is the number of rounding boundaries it passes; at a boundary (a tie) the
    # even code wins: "> b" where the code below is even, ">= b" where the code above is
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
            + (a > 5.0))
    code = torch.where(torch.isnan(x), 7, code + torch.signbit(x).to(torch.uint8) * 8)
    return code.to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of e2m1 nibbles (any integer dtype, 0..15; ``E2M1_VALUES``)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles [..., 2n] -> bytes [..., n]: element 2i in the low nibble of byte i."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> nibbles uint8 [..., 2n] (``pack_nibbles``' inverse)."""
    data = data.to(torch.uint8)
    return torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2)
