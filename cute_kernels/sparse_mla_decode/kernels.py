"""The kernel classes, and which one generates a configuration.

Each partial-kernel class says beside its definition which compute paths
(``PartialConfig.precision``) it generates (``PATHS``); ``kernel_for`` builds the kernel object
of a configuration from that, and the loader asks it (``dispatch.runtime.loader.build_kernel``).
Importing this module imports the CuTe DSL: the dispatch imports it only to compile.
"""

from __future__ import annotations

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


def kernel_for(config: PartialConfig | MergeConfig):
    """The kernel object (its ``__call__`` is the ``cute.jit`` launcher) of ``config``."""
    if isinstance(config, MergeConfig):
        return MergeKernel(config)
    return PARTIAL_KERNEL_BY_PATH[config.precision](config)
