"""Small device-side pieces both decode kernels use (CuTe DSL)."""

from __future__ import annotations

import math

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


@cute.jit
def load_i32(addr: Int64) -> Int32:
    """Scalar int32 load from a global-memory byte address."""
    return cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4), cute.make_layout(1))[0]


def smem_vec(dtype, addr, n):
    """``n`` elements at a shared-memory address aligned to their total size."""
    return cute.make_tensor(cute.make_ptr(dtype, addr, cute.AddressSpace.smem, assumed_align=n * dtype.width // 8),
                            cute.make_layout(n))


@cute.jit
def load_smem_u8(addr: Int32) -> Int32:
    """One byte from a shared-memory address, zero-extended. (The DSL widens a Uint8 load
    with a sign extension, LDS.S8: a UE8M0 scale byte of 128 or more came out negative.)"""
    byte = cute.make_tensor(cute.make_ptr(Uint8, addr, cute.AddressSpace.smem, assumed_align=1), cute.make_layout(1))[0]
    return Int32(byte) & 0xFF


@cute.jit
def load_f32(addr: Int64) -> Float32:
    """Scalar float32 load from a global-memory byte address."""
    return cute.make_tensor(cute.make_ptr(Float32, addr, cute.AddressSpace.gmem, assumed_align=4), cute.make_layout(1))[0]


@cute.jit
def store_f32(addr: Int64, value: Float32):
    """Scalar float32 store to a global-memory byte address."""
    cute.make_tensor(cute.make_ptr(Float32, addr, cute.AddressSpace.gmem, assumed_align=4), cute.make_layout(1))[0] = value


@cute.jit
def sink_gate(sink: Float32, lse2: Float32) -> Float32:
    """exp(lse) / (exp(lse) + exp(sink)) for a finite lse given in log2 units.

    = 1 / (1 + 2**(sink * log2(e) - lse2)): a sink of +inf gives 0, -inf gives 1.
    """
    return 1.0 / (1.0 + cute.math.exp2(sink * LOG2_E - lse2, fastmath=False))
