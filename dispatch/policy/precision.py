"""Which compute path serves a call: the paths each arch has, the paths each format
reads (``KvFormat.paths``), and the default."""

from __future__ import annotations

from cute_kernels.arch import arch_facts
from cute_kernels.sparse_mla_decode import config
from cute_kernels.sparse_mla_decode.kv_format import PRECISIONS, get_format, path_refusal
from cute_kernels.sparse_mla_decode.tuning import DEFAULT_PRECISION


def path_missing(precision: str, arch: str) -> str | None:
    """Why the arch named ``arch`` has no ``precision`` path, in words (``config.path_missing``),
    or None where it has it."""
    return config.path_missing(precision, arch_facts(arch))


def precisions_for(arch: str) -> tuple[str, ...]:
    """The compute paths compiled for ``arch``: every path whose instruction the arch has
    ("fp8", the e4m3 MMA: sm_89 and later; "mxf8", the block-scaled MMA: sm_120a / sm_121a)."""
    return tuple(p for p in PRECISIONS if path_missing(p, arch) is None)


def check_format_precision(precision: str | None, kv_format: str) -> None:
    """Raise ValueError, naming the format, for a compute path ``kv_format`` does not have
    (``KvFormat.paths``), with the reason ``path_problem`` gives (``path_refusal``). None (the default) always
    passes: ``DEFAULT_PRECISION`` reads every format."""
    fmt = get_format(kv_format)
    refusal = None if precision is None else path_refusal(precision, fmt)
    if refusal:
        raise ValueError(f"{refusal}: use one of {fmt.paths} or None (the default, {DEFAULT_PRECISION})")


def resolve_precision(precision: str | None, arch: str) -> str:
    """The compute path of a call whose formats read ``precision`` (``check_format_precision``,
    checked first: before the device is known): the caller's choice where ``arch`` has it
    (``precisions_for``; ValueError naming the instruction the arch lacks), else
    ``tuning.DEFAULT_PRECISION`` ("f16" on every arch and format, by measurement:
    ``docs/tuning.md``)."""
    if precision is None:
        return DEFAULT_PRECISION
    if precision not in precisions_for(arch):
        why = path_missing(precision, arch) if precision in PRECISIONS else "not a compute path"
        raise ValueError(f"precision {precision!r} is not available on {arch_facts(arch).label}: {why}; use one of "
                         f"{precisions_for(arch)} or None (the default, {DEFAULT_PRECISION})")
    return precision


def format_precisions(arch: str, kv_format: str) -> tuple[str, ...]:
    """The compute paths compiled for ``kv_format`` on ``arch``: the format's
    (``KvFormat.paths``) that the arch has (``precisions_for``), in ``PRECISIONS`` order."""
    paths = get_format(kv_format).paths
    return tuple(p for p in precisions_for(arch) if p in paths)
