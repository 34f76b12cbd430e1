"""Small device-side pieces the decode kernels share: scalar loads and stores, copies (CuTe DSL)."""

from __future__ import annotations

import math

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8
from cutlass._mlir.dialects import llvm

from .kernel_args import LOG2_E

LN_2 = math.log(2.0)


@cute.jit
def load_i32(addr: Int64) -> Int32:
    """Scalar int32 load from a global-memory byte address."""
    return cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4), cute.make_layout(1))[0]


def smem_scalar(dtype, addr):
    """One element at a shared-memory address."""
    return cute.make_tensor(cute.make_ptr(dtype, addr, cute.AddressSpace.smem, assumed_align=dtype.width // 8),
                            cute.make_layout(1))


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


def cp_async_zfill(smem_addr: Int32, gmem_addr: Int64, nbytes: int, src_bytes: Int32):
    """``cp.async`` of ``nbytes`` (8 or 16) from global to shared memory, of which only the
    first ``src_bytes`` (0 or ``nbytes``) are read: with 0 nothing is read and the shared
    bytes become zeros (PTX's src-size operand), so an invalid row needs no separate store.
    16-byte copies bypass L1 (``.cg``: no CTA re-reads a gathered row from global memory)."""
    cache = "cg" if nbytes == 16 else "ca"
    llvm.inline_asm(
        None, [Int32(smem_addr).ir_value(), Int64(gmem_addr).ir_value(), Int32(src_bytes).ir_value()],
        f"cp.async.{cache}.shared.global [$0], [$1], {nbytes}, $2;", "r,l,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
