"""The kernel classes, and which one generates a configuration.

Each partial-kernel class says beside its definition which compute paths
(``PartialConfig.precision``) it generates (``PATHS``); ``kernel_for`` builds the kernel object
of a configuration for a target arch from that, and the loader asks it
(``dispatch.runtime.loader.build_kernel``). Importing this module imports the CuTe DSL: the
dispatch imports it only to compile.
"""

from __future__ import annotations

from ..arch import Arch
from .config import MergeConfig, PartialConfig
from .kv_format import PRECISIONS
from .merge import MergeKernel
from .partial_bf16 import PartialBf16Kernel
from .partial_f16 import PartialF16Kernel
from .partial_fp8 import PartialFp8Kernel

PARTIAL_KERNELS = (PartialF16Kernel, PartialBf16Kernel, PartialFp8Kernel)
PARTIAL_KERNEL_BY_PATH = {path: cls for cls in PARTIAL_KERNELS for path in cls.PATHS}
assert sorted(PARTIAL_KERNEL_BY_PATH) == sorted(PRECISIONS) and \
    sum(len(cls.PATHS) for cls in PARTIAL_KERNELS) == len(PRECISIONS), "each compute path has exactly one class"


def kernel_for(config: PartialConfig | MergeConfig, arch: Arch):
    """The kernel object (its ``__call__`` is the ``cute.jit`` launcher) of ``config``,
    generated for ``arch`` (what it has: PDL, the e4m3 conversion)."""
    if isinstance(config, MergeConfig):
        return MergeKernel(config, arch)
    return PARTIAL_KERNEL_BY_PATH[config.precision](config, arch)
