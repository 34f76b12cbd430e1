"""The float formats of the cache specification in plain Python, independent of torch's
conversions and of the package: what the byte-level tests compute their expectations from."""

from __future__ import annotations

import math
import struct


def f32(x: float) -> float:
    """``x`` rounded to float32 (nearest even; past the largest float32: infinity), as a Python float."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def e4m3_value(code: int) -> float:
    """The value of an e4m3fn byte: bias 7, subnormals m/8 * 2**-6, 0x7F / 0xFF NaN."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 7
    if e == 0xF and m == 7:
        return math.nan
    return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
