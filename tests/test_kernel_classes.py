"""Which kernel class generates a configuration: each class declares its compute paths beside
its definition (``PATHS``) and ``kernels.kernel_for`` is the one map the loader asks; the
kernel takes what its arch has from ``cute_kernels.arch`` (CPU)."""

from __future__ import annotations

import pytest

from cute_kernels.arch import arch_facts
from cute_kernels.sparse_mla_decode.config import MergeConfig, PartialConfig
from cute_kernels.sparse_mla_decode.kv_format import PRECISIONS


def test_every_compute_path_has_exactly_one_class():
    from cute_kernels.sparse_mla_decode import kernels

    owners = {p: [cls.__name__ for cls in kernels.PARTIAL_KERNELS if p in cls.PATHS] for p in PRECISIONS}
    assert all(len(names) == 1 for names in owners.values()), owners


@pytest.mark.parametrize("precision,cls_name", [("f16", "PartialF16Kernel"), ("bf16", "PartialBf16Kernel"),
                                                ("fp8", "PartialFp8Kernel"), ("mxf8", "PartialFp8Kernel")])
def test_kernel_for_builds_the_declared_class(precision, cls_name):
    from cute_kernels.sparse_mla_decode.kernels import kernel_for

    kernel = kernel_for(PartialConfig(precision=precision), arch_facts("sm_120a"))
    assert type(kernel).__name__ == cls_name and kernel.cfg.precision == precision


def test_kernel_for_builds_the_merge_kernel():
    from cute_kernels.sparse_mla_decode.kernels import kernel_for

    kernel = kernel_for(MergeConfig(has_sink=True), arch_facts("sm_120a"))
    assert type(kernel).__name__ == "MergeKernel" and kernel.cfg.has_sink and kernel.pdl


def test_loader_builds_through_the_classes():
    from dispatch.policy.variant_space import KernelVariant
    from dispatch.runtime.loader import build_kernel

    assert type(build_kernel(KernelVariant(PartialConfig(precision="bf16"), "sm_120a"))).__name__ == "PartialBf16Kernel"


@pytest.mark.parametrize("arch,precision,lacks", [
    ("sm_80", "fp8", "sm_80 has no e4m3 MMA"), ("sm_86", "fp8", "sm_86 has no e4m3 MMA"),
    ("sm_89", "mxf8", "sm_89 has no block-scaled MMA"), ("sm_90a", "mxf8", "sm_90a has no block-scaled MMA"),
    ("sm_80_on_sm_90a", "fp8", "sm_80 has no e4m3 MMA"),
])
def test_a_kernel_of_a_path_its_arch_lacks_is_refused(arch, precision, lacks):
    from cute_kernels.sparse_mla_decode.kernels import kernel_for

    with pytest.raises(ValueError, match=f"precision '{precision}': {lacks}"):
        kernel_for(PartialConfig(precision=precision), arch_facts(arch))


@pytest.mark.parametrize("arch,pdl,by_instruction", [("sm_80", False, False), ("sm_86", False, False),
                                                     ("sm_89", False, True), ("sm_90a", True, True),
                                                     ("sm_120a", True, True), ("sm_80_on_sm_90a", False, False),
                                                     ("sm_89_on_sm_90a", False, True)])
def test_the_kernels_take_pdl_and_the_conversion_from_the_arch(arch, pdl, by_instruction):
    """The merge launch and the partial kernels' first step use PDL where the arch has it; the
    "f16" and "bf16" kernels convert e4m3 by the instruction where it has one (a profile: as
    its target)."""
    from cute_kernels.sparse_mla_decode.kernels import kernel_for

    target = arch_facts(arch)
    assert kernel_for(MergeConfig(), target).pdl is pdl
    for precision in ("f16", "bf16"):
        kernel = kernel_for(PartialConfig(precision=precision), target)
        assert kernel.epilogue.pdl is pdl and kernel.conv.by_instruction is by_instruction
