"""Target architectures: the compile target of each device and what the kernels rely on.

The kernels use only warp-level ``mma.sync`` (bf16 m16n8k16), ``ldmatrix``, ``cp.async``
and plain loads/stores: everything SM120 has. sm_90a is a test target only (the H200 this
project tests on runs the same instructions).
"""

from __future__ import annotations

# compute capability -> the arch string the DSL compiles for
ARCH_BY_CAPABILITY = {
    (12, 0): "sm_120a",  # RTX 50xx, RTX PRO 6000 Blackwell
    (12, 1): "sm_121a",  # DGX Spark GB10
    (9, 0): "sm_90a",  # H100/H200: the test GPU
}
SUPPORTED_ARCHS = tuple(ARCH_BY_CAPABILITY.values())
# shared memory per SM as the CUDA runtime reports it: sm_120/121 100 KB, the H200 228 KB
# (what decides how many partial CTAs an SM holds: ``dispatch.splits.resident_ctas_per_sm``)
SMEM_PER_SM_BY_ARCH = {"sm_120a": 102400, "sm_121a": 102400, "sm_90a": 233472}
DEPLOYMENT_ARCHS = ("sm_120a", "sm_121a")


def arch_for_capability(capability: tuple[int, int]) -> str | None:
    """The compile target for a device of this compute capability, or None if unsupported."""
    return ARCH_BY_CAPABILITY.get(tuple(capability))
