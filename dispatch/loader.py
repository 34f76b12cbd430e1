"""Compile a variant on first use and keep it for the life of the process."""

from __future__ import annotations

import threading

from .variants import KernelVariant

_compiled: dict[KernelVariant, object] = {}
_lock = threading.Lock()


def build_kernel(variant: KernelVariant):
    """The kernel object (a ``cute.jit`` callable) of a variant."""
    if variant.kind == "partial":
        from cute_kernels.sparse_mla_decode.partial import SparseMlaPartialKernel

        return SparseMlaPartialKernel(variant.config)
    from cute_kernels.sparse_mla_decode.merge import SparseMlaMergeKernel

    return SparseMlaMergeKernel(variant.config)


def compile_variant(variant: KernelVariant, keep_cubin: bool = False):
    """Compile a variant for its arch with stand-in arguments (no GPU needed).

    ``keep_cubin`` keeps the cubin in ``compiled.artifacts.CUBIN``; the DSL also writes it
    to ``$CUTE_DSL_DUMP_DIR`` (set that to a scratch directory).
    """
    import cutlass.cute as cute

    kernel = build_kernel(variant)
    options = f"--gpu-arch {variant.arch}" + (" --keep-cubin" if keep_cubin else "")
    return cute.compile(kernel, *kernel.fake_args(), options=options)


def get_compiled(variant: KernelVariant):
    """The compiled callable of a variant, compiling it once per process."""
    fn = _compiled.get(variant)
    if fn is not None:
        return fn
    with _lock:
        fn = _compiled.get(variant)
        if fn is None:
            fn = compile_variant(variant)
            _compiled[variant] = fn
    return fn
