"""Launch a compiled kernel with its C arguments packed once and updated in place.

The DSL's generic call path marshals every argument on every call (tens of microseconds
for the ~35 arguments of the partial kernel). A ``BoundKernel`` instead keeps one 8-byte
word per argument and the packed argument array of the host entry point alive; a caller
writes the few values that change into the words (``words``/``floats``, plain memoryview
stores) and ``launch`` calls the entry point. At construction it checks
against the DSL's own marshalling of the same arguments, byte for byte, that every slot
holds what the generic path would pass, so a change of the DSL's calling convention fails
loudly here instead of launching with wrong arguments (nvidia-cutlass-dsl is pinned).
"""

from __future__ import annotations

import ctypes

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.runtime import make_ptr


_CTYPE = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float,
          "stream": ctypes.c_void_p}


def _generic_arg(kind, value):
    if kind[0] == "ptr":
        return make_ptr(kind[1], value, cute.AddressSpace.gmem, assumed_align=kind[2])
    if kind[0] == "i32":
        return Int32(value)
    if kind[0] == "i64":
        return Int64(value)
    if kind[0] == "f32":
        return Float32(value)
    return cuda.CUstream(value)


class BoundKernel:
    """One compiled kernel on one device, with persistent packed arguments. ``kinds``: per
    argument, as ``cute_kernels.sparse_mla_decode.kernel_args.argument_kinds`` gives them."""

    def __init__(self, compiled, kinds: list, example_values: list, device_index: int):
        if len(kinds) != len(example_values):
            raise ValueError("one example value per kernel argument is needed")
        self._executor = compiled.to(device_index)
        # one 8-byte word per argument; a slot is a ctypes view of its word (an i32 or f32
        # argument is the word's low half: little-endian)
        self._storage = (ctypes.c_int64 * len(kinds))()
        self._slots = [_CTYPE[k[0]].from_buffer(self._storage, 8 * i) for i, k in enumerate(kinds)]
        raw = memoryview(self._storage).cast("B")
        self.words = raw.cast("q")  # words[i] = v sets argument i (pointer, i64 or i32) for the next launch
        self.floats = raw.cast("f")  # floats[2 * i] = x sets f32 argument i
        self.write(example_values)
        generic, keep_alive = self._executor.generate_execution_args(
            *[_generic_arg(k, v) for k, v in zip(kinds, example_values)]
        )
        if len(generic) != len(kinds):
            raise RuntimeError(f"the DSL passes {len(generic)} C arguments for {len(kinds)} kernel arguments: "
                               f"its calling convention changed (nvidia-cutlass-dsl must be the pinned version)")
        for i, (g, slot) in enumerate(zip(generic, self._slots)):
            address = g.value if isinstance(g, ctypes.c_void_p) else int(g)
            if ctypes.string_at(address, ctypes.sizeof(slot)) != bytes(slot):
                raise RuntimeError(f"kernel argument {i} ({kinds[i][0]}) is marshalled differently by the DSL: "
                                   f"its calling convention changed (nvidia-cutlass-dsl must be the pinned version)")
        # the DSL's packed array holds the arguments, then its own trailing entries (result, kernels)
        reference = self._executor._get_invoke_packed_args(generic)
        total = len(kinds) + self._executor._num_extra_args
        self._packed = (ctypes.c_void_p * total)()
        for i, slot in enumerate(self._slots):
            self._packed[i] = ctypes.addressof(slot)
        for i in range(len(kinds), total):
            self._packed[i] = reference[i]
        self._capi = self._executor.capi_func
        self._result = self._executor.cuda_result
        del keep_alive

    def write(self, values: list) -> None:
        for slot, v in zip(self._slots, values):
            slot.value = v

    def launch(self) -> None:
        self._capi(self._packed)
        if self._result is not None and self._result.value != 0:
            code = self._result.value
            raise RuntimeError(f"kernel launch failed with CUDA error {code}")
