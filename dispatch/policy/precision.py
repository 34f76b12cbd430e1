"""Which compute path serves a call: the paths each arch has, the paths each format
reads (``KvFormat.paths``), and the default."""

from __future__ import annotations

from cute_kernels.sparse_mla_decode.config import PATH_ARCHS
from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT, PRECISIONS, get_format, path_problem
from cute_kernels.sparse_mla_decode.tuning import DEFAULT_PRECISION


def precisions_for(arch: str) -> tuple[str, ...]:
    """The compute paths compiled for ``arch``: every path but those ``config.PATH_ARCHS``
    keeps to other archs ("mxf8", the block-scaled MMA: sm_120a / sm_121a only)."""
    return tuple(p for p in PRECISIONS if arch in PATH_ARCHS.get(p, (arch,)))


def check_format_precision(precision: str | None, kv_format: str = DEFAULT_FORMAT) -> None:
    """Raise ValueError, naming the format, for a compute path ``kv_format`` does not have
    (``KvFormat.paths``), with the reason ``path_problem`` gives. None (the default) always
    passes: ``DEFAULT_PRECISION`` reads every format."""
    fmt = get_format(kv_format)
    problem = None if precision is None else path_problem(precision, fmt)
    if problem:
        raise ValueError(f"precision {precision!r} does not read {fmt.name} caches ({problem}): "
                         f"use one of {fmt.paths} or None (the default, {DEFAULT_PRECISION})")


def resolve_precision(precision: str | None, arch: str, kv_format: str = DEFAULT_FORMAT) -> str:
    """The compute path of a call: the caller's choice, else ``tuning.DEFAULT_PRECISION``
    ("f16" on every arch and format, by measurement: ``docs/tuning.md``). Refuses a path the
    format (``check_format_precision``) or the arch (``precisions_for``) lacks."""
    check_format_precision(precision, kv_format)
    if precision is None:
        return DEFAULT_PRECISION
    if precision not in precisions_for(arch):
        raise ValueError(f"precision {precision!r} is not available on {arch}: use one of {precisions_for(arch)} "
                         f"or None (the default, {DEFAULT_PRECISION})")
    return precision


def format_precisions(arch: str, kv_format: str) -> tuple[str, ...]:
    """The compute paths compiled for ``kv_format`` on ``arch``: the format's
    (``KvFormat.paths``) that the arch has (``precisions_for``), in ``PRECISIONS`` order."""
    return tuple(p for p in precisions_for(arch) if p in get_format(kv_format).paths)
