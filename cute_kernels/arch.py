"""Target architectures: the facts of the hardware the kernels are built and sized for.

The kernels use only warp-level ``mma.sync`` (f16 / bf16 m16n8k16, e4m3 m16n8k32 and, on
SM120 only, the block-scaled ``kind::mxf8f6f4`` form), ``ldmatrix``, ``cp.async`` and plain
loads and stores: everything SM120 has. sm_90a (H100 / H200) is a test target: it runs the
same instructions except the block-scaled MMA (and emulates the e4m3 MMA with f16 ones).
"""

from __future__ import annotations

# compute capability -> the arch string the DSL compiles for
ARCH_BY_CAPABILITY = {
    (12, 0): "sm_120a",  # RTX 50xx, RTX PRO 6000 Blackwell
    (12, 1): "sm_121a",  # DGX Spark GB10
    (9, 0): "sm_90a",  # H100 / H200: the test GPU
}
SUPPORTED_ARCHS = tuple(ARCH_BY_CAPABILITY.values())
# what a deployment ships binaries for; their builds are SASS-checked (no spills, 99 KB, no
# instruction SM120 lacks)
DEPLOYMENT_ARCHS = ("sm_120a", "sm_121a")
# the archs with SM120's block-scaled MMA (``mma.sync ... kind::mxf8f6f4.block_scale``)
BLOCK_SCALED_ARCHS = ("sm_120a", "sm_121a")
# Instructions that must not appear in an SM120 kernel: Hopper's warpgroup MMA and the
# datacenter Blackwell tensor-memory MMA (SM120 has neither).
FORBIDDEN_ON_SM120 = ("HGMMA", "QGMMA", "IGMMA", "BGMMA", "UTCHMMA", "UTCQMMA", "UTCIMMA", "UTCOMMA")

# shared memory per SM as the CUDA runtime reports it: sm_120/121 100 KB, the H200 228 KB
# (what decides how many partial CTAs an SM holds: ``dispatch.policy.occupancy.resident_ctas_per_sm``)
SMEM_PER_SM_BY_ARCH = {"sm_120a": 102400, "sm_121a": 102400, "sm_90a": 233472}
# the most dynamic shared memory one CTA may use on SM120 (99 KB); every kernel stays within
# it on every arch, since what the H200 runs is the code shipped for SM120
SMEM_PER_CTA_MAX = 101376
# shared memory the driver reserves per resident CTA, beside the kernel's own
RESERVED_SMEM_PER_CTA = 1024
REGISTERS_PER_SM = 65536  # on every target (sm_90, sm_120, sm_121)
MAX_REGISTERS_PER_THREAD = 255


def arch_for_capability(capability: tuple[int, int]) -> str | None:
    """The compile target for a device of this compute capability, or None if unsupported."""
    return ARCH_BY_CAPABILITY.get(tuple(capability))
