"""What a compiled variant depends on, so that a stale binary is never loaded.

A fingerprint holds the variant's name (every code-generating field is in it), its arch,
the installed nvidia-cutlass-dsl version and its libs flavour (cu12/cu13: the exported
objects link against that runtime), this project's version, and a hash of the kernel
sources. The AOT manifest and the JIT disk cache are both keyed by it.
"""

from __future__ import annotations

import functools
import hashlib
import re
from importlib import metadata
from pathlib import Path

from ..policy.variant_space import KernelVariant

FIELDS = ("name", "arch", "dsl_version", "dsl_libs", "project_version", "source_hash")
DISTRIBUTION = "dsv4-sparse-mla"

ROOT = Path(__file__).resolve().parents[2]  # the checkout (or the installed copy) this package runs from


def _project_version() -> str:
    """The project's version, written once in ``pyproject.toml``: read from it in a source
    checkout (installed or not), else from the installed distribution's metadata (a wheel)."""
    pyproject = ROOT / "pyproject.toml"
    if pyproject.is_file():
        section = None
        for line in pyproject.read_text().splitlines():
            header = re.match(r"\s*\[([^\]]+)\]\s*$", line)
            if header:
                section = header.group(1).strip()
            found = re.match(r'\s*version\s*=\s*"([^"]+)"', line)
            if section == "project" and found:
                return found.group(1)
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


PROJECT_VERSION = _project_version()

# Every file whose content can change a generated binary.
_SOURCES = ("cute_kernels", "dispatch/runtime/loader.py", "dispatch/policy/variant_space.py")


@functools.lru_cache(maxsize=None)
def dsl_version() -> str:
    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        import cutlass

        return getattr(cutlass, "__version__", "unknown")


@functools.lru_cache(maxsize=None)
def dsl_libs() -> str:
    """Which nvidia-cutlass-dsl-libs-* flavour is installed (the runtime the objects link to)."""
    found = []
    for flavour in ("cu13", "cu12"):
        try:
            metadata.version(f"nvidia-cutlass-dsl-libs-{flavour}")
            found.append(flavour)
        except metadata.PackageNotFoundError:
            pass
    return "+".join(found) or "unknown"


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    h = hashlib.sha256()
    files = []
    for rel in _SOURCES:
        path = ROOT / rel
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:20]


def fingerprint(variant: KernelVariant) -> dict:
    return {
        "name": variant.name,
        "arch": variant.arch,
        "dsl_version": dsl_version(),
        "dsl_libs": dsl_libs(),
        "project_version": PROJECT_VERSION,
        "source_hash": source_hash(),
    }


def fingerprint_id(fp: dict) -> str:
    """A short stable id of a fingerprint (a directory name of the JIT disk cache)."""
    text = "|".join(f"{k}={fp[k]}" for k in FIELDS)
    return f"{fp['name']}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def mismatches(expected: dict, found: dict) -> list[str]:
    """The fields in which ``found`` differs from ``expected``, as 'field: found != expected'."""
    return [f"{k}: {found.get(k)!r} != {expected[k]!r}" for k in FIELDS if found.get(k) != expected[k]]
