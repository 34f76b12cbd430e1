"""Which kernel class generates a configuration: each class declares its compute paths beside
its definition (``PATHS``) and ``kernels.kernel_for`` is the one map the loader asks (CPU)."""

from __future__ import annotations

import pytest

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

    kernel = kernel_for(PartialConfig(precision=precision))
    assert type(kernel).__name__ == cls_name and kernel.cfg.precision == precision


def test_kernel_for_builds_the_merge_kernel():
    from cute_kernels.sparse_mla_decode.kernels import kernel_for

    kernel = kernel_for(MergeConfig(has_sink=True))
    assert type(kernel).__name__ == "MergeKernel" and kernel.cfg.has_sink


def test_loader_builds_through_the_classes():
    from dispatch.policy.variant_space import KernelVariant
    from dispatch.runtime.loader import build_kernel

    assert type(build_kernel(KernelVariant(PartialConfig(precision="bf16"), "sm_120a"))).__name__ == "PartialBf16Kernel"
