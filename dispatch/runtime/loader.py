"""Get the compiled callable of a variant: memory -> AOT manifest -> JIT disk cache -> JIT compile.

- AOT: the first up-to-date entry of the variant in the manifests of ``set_aot_dir(path)``,
  ``$DSV4_MLA_AOT_DIR`` and the package's own ``dispatch/aot_data/`` (written by
  ``dsv4-mla-aot-build``, ``dispatch.tools.aot_build``), searched in that order. An entry is
  up to date when its fingerprint (arch, DSL version and libs, project version, kernel
  source hash) matches this process and its object file's sha256 matches the manifest. A
  missing or corrupt manifest, a manifest without the entry, and a stale or corrupt entry
  are skipped (the reason logged once) and the search goes on: a stale entry in one
  directory never hides an up-to-date one in the next.
- JIT results are exported to a per-user disk cache (``$DSV4_MLA_CACHE_DIR``, default
  ``~/.cache/dsv4_mla/jit``) keyed by the same fingerprint, written to a temporary
  directory and renamed into place under a file lock, so concurrent processes never
  corrupt it and a second process never recompiles.
- ``set_require_aot(True)`` or ``DSV4_MLA_REQUIRE_AOT=1``: a variant with no up-to-date AOT
  entry is an error (``MissingAotVariant``, naming what was skipped), never a compile at
  serve time.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

from ..policy.variant_space import KernelVariant
from .fingerprint import fingerprint, fingerprint_id, mismatches

log = logging.getLogger("dsv4_mla")

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
PACKAGE_AOT_DIR = Path(__file__).resolve().parents[1] / "aot_data"  # dispatch/aot_data

_compiled: dict[KernelVariant, object] = {}
_lock = threading.Lock()
_reported: set[str] = set()
_aot_dir_override: str | None = None
_require_aot_override: bool | None = None
# how each variant this process uses was obtained (tests and tools read it): counts, and per
# variant name where from ("aot <directory>", "jit disk cache <directory>" or "compiled")
stats = {"compiled": 0, "aot_loaded": 0, "disk_loaded": 0}
sources: dict[str, str] = {}


class MissingAotVariant(RuntimeError):
    """A variant is not in the AOT manifest and compiling at serve time is switched off."""


def set_aot_dir(path: str | os.PathLike | None) -> None:
    """Look for the AOT manifest in ``path`` first (None: back to the environment and package)."""
    global _aot_dir_override
    _aot_dir_override = None if path is None else str(path)


def set_require_aot(required: bool | None) -> None:
    """True: never JIT-compile; a variant missing from the manifest raises MissingAotVariant."""
    global _require_aot_override
    _require_aot_override = required


def require_aot() -> bool:
    if _require_aot_override is not None:
        return _require_aot_override
    return os.environ.get("DSV4_MLA_REQUIRE_AOT", "") not in ("", "0")


def reset_for_tests() -> None:
    """Forget everything this process loaded (the disk is untouched)."""
    _compiled.clear()
    _reported.clear()
    sources.clear()
    for k in stats:
        stats[k] = 0


def _report_once(message: str) -> None:
    if message not in _reported:
        _reported.add(message)
        log.warning(message)


# ---------------------------------------------------------------------- compile and export
def build_kernel(variant: KernelVariant):
    """The kernel object (a ``cute.jit`` callable) of a variant: the class that generates its
    configuration says so itself (``cute_kernels.sparse_mla_decode.kernels``), for the
    variant's target (an arch, or an arch profile: ``cute_kernels.arch``)."""
    from cute_kernels.sparse_mla_decode.kernels import kernel_for

    return kernel_for(variant.config, variant.target)


def compile_variant(variant: KernelVariant, keep_cubin: bool = False):
    """Compile a variant for its target with stand-in arguments (no GPU needed): the code
    generated for the target's facts, compiled for its ``isa`` (for an arch profile the GPU's
    arch, not the one whose choices it runs).

    ``keep_cubin`` keeps the cubin in ``compiled.artifacts.CUBIN``; the DSL also writes it
    to ``$CUTE_DSL_DUMP_DIR`` (set that to a scratch directory).
    """
    import cutlass.cute as cute

    kernel = build_kernel(variant)
    options = f"--gpu-arch {variant.target.isa}" + (" --keep-cubin" if keep_cubin else "")
    return cute.compile(kernel, *kernel.fake_args(), options=options)


_runtime_loaded = False


def _load_dsl_runtime() -> None:
    """Exporting an object needs the DSL's host runtime symbols in the process."""
    global _runtime_loaded
    if not _runtime_loaded:
        from cutlass.runtime import find_runtime_libraries

        for lib in find_runtime_libraries(enable_tvm_ffi=False):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        _runtime_loaded = True


def export_variant(compiled, variant: KernelVariant, directory: str | os.PathLike) -> Path:
    """Write ``<name>.o`` and ``<name>.h`` of a compiled variant; returns the object's path."""
    _load_dsl_runtime()
    compiled.export_to_c(file_path=str(directory), file_name=variant.name, function_prefix=variant.name)
    return Path(directory) / f"{variant.name}.o"


def load_object(path: Path, variant: KernelVariant):
    """Load an exported variant's callable from its object file."""
    from cutlass.cute.runtime import load_module

    return getattr(load_module(str(path)), variant.name)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ---------------------------------------------------------------------- AOT manifest
def aot_dirs() -> list[Path]:
    dirs = [_aot_dir_override, os.environ.get("DSV4_MLA_AOT_DIR"), str(PACKAGE_AOT_DIR)]
    return [Path(d) for d in dirs if d]


def read_manifest(directory: Path) -> dict | None:
    """The manifest of ``directory``; None if absent; a corrupt one is reported and ignored."""
    path = directory / MANIFEST
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("entries"), dict):
            raise ValueError(f"format {data.get('format')!r}")
        return data
    except (ValueError, OSError) as err:
        _report_once(f"dsv4_mla: ignoring corrupt AOT manifest {path}: {err}")
        return None


def _entry_key(variant: KernelVariant) -> str:
    return variant.name  # the name carries the arch and every code-generating field


def _stale_reason(expected: dict, found: dict, bad: list[str]) -> str:
    """Why an AOT entry's fingerprint does not match, in words (``bad``: ``mismatches``)."""
    if found.get("dsl_libs") != expected["dsl_libs"]:
        return (f"built with nvidia-cutlass-dsl-libs-{found.get('dsl_libs')}, this environment has "
                f"nvidia-cutlass-dsl-libs-{expected['dsl_libs']}: build the wheel where the DSL's libs flavour is the "
                f"server's")
    if found.get("dsl_version") != expected["dsl_version"]:
        return (f"built with nvidia-cutlass-dsl {found.get('dsl_version')}, this environment has "
                f"{expected['dsl_version']}")
    if found.get("source_hash") != expected["source_hash"] or found.get("project_version") != expected["project_version"]:
        return "built from other kernel sources than this installation's"
    return "; ".join(bad)


def _instead() -> str:
    """What happens to a kernel whose AOT entry cannot be used, as the stale-entry line says it."""
    if require_aot():
        return ("compiling at serve time is off (DSV4_MLA_REQUIRE_AOT / set_require_aot), so each kernel this "
                "process needs from there is an error (MissingAotVariant)")
    return (f"each kernel this process needs is compiled instead, once, into {jit_cache_dir()} "
            f"(set DSV4_MLA_REQUIRE_AOT=1 to make this an error)")


def _load_aot(variant: KernelVariant, skipped: list[str]):
    """The first up-to-date AOT entry of ``variant`` in ``aot_dirs()`` order, loaded, or None;
    every stale or corrupt entry passed over is reported once and added to ``skipped``."""
    expected = fingerprint(variant)
    directories = aot_dirs()
    for i, directory in enumerate(directories):
        manifest = read_manifest(directory)
        if manifest is None:
            continue
        entry = manifest["entries"].get(_entry_key(variant))
        if entry is None:
            archs = sorted({e.get("fingerprint", {}).get("arch") for e in manifest["entries"].values()} - {None})
            _report_once(f"dsv4_mla: the AOT manifest in {directory} (archs: {', '.join(archs) or 'none'}) has no "
                         f"entry for {variant.name}")
            continue
        found = entry.get("fingerprint", {})
        bad = mismatches(expected, found)
        if bad:
            skipped.append(f"{directory}: stale")
            # said once per directory and reason: the fields that differ are the environment's
            # (the DSL's version and libs flavour, the sources), the same for every entry there
            # what follows: the next directory with a manifest is searched (it may serve every
            # kernel: nothing is compiled), else the kernel is compiled or, with AOT required, an error
            later = next((d for d in directories[i + 1:] if (d / MANIFEST).exists()), None)
            then = _instead() if later is None else f"the AOT kernels in {later} are searched next"
            _report_once(f"dsv4_mla: the AOT kernels in {directory} do not match this environment "
                         f"({_stale_reason(expected, found, bad)}): each is stale and skipped; {then}")
            continue
        obj = directory / entry.get("object", "")
        try:
            if sha256_file(obj) != entry.get("object_sha256"):
                raise ValueError("object sha256 does not match the manifest")
            fn = load_object(obj, variant)
            sources[variant.name] = f"aot {directory}"
            return fn
        except Exception as err:  # a corrupt entry is never loaded
            skipped.append(f"{directory}: corrupt")
            _report_once(f"dsv4_mla: AOT entry {variant.name} in {directory} is corrupt ({err}); skipped")
    return None


# ---------------------------------------------------------------------- JIT disk cache
def jit_cache_dir() -> Path:
    return Path(os.environ.get("DSV4_MLA_CACHE_DIR", Path.home() / ".cache" / "dsv4_mla" / "jit"))


def _load_from_disk(variant: KernelVariant, entry_dir: Path):
    meta_path = entry_dir / "meta.json"  # written last: its presence commits the entry
    if not meta_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if mismatches(fingerprint(variant), meta.get("fingerprint", {})):
            raise ValueError("fingerprint differs")
        obj = entry_dir / f"{variant.name}.o"
        if sha256_file(obj) != meta.get("object_sha256"):
            raise ValueError("object sha256 does not match")
        return load_object(obj, variant)
    except Exception as err:
        _report_once(f"dsv4_mla: ignoring corrupt JIT cache entry {entry_dir}: {err}")
        return None


def _store_on_disk(compiled, variant: KernelVariant, entry_dir: Path) -> None:
    root = entry_dir.parent
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if (entry_dir / "meta.json").exists():
                return  # another process stored it first
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
            try:
                obj = export_variant(compiled, variant, tmp)
                meta = {"fingerprint": fingerprint(variant), "object_sha256": sha256_file(obj)}
                (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
                if entry_dir.exists():  # a stale, uncommitted leftover
                    shutil.rmtree(entry_dir)
                os.replace(tmp, entry_dir)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _obtain(variant: KernelVariant):
    skipped = []
    fn = _load_aot(variant, skipped)
    if fn is not None:
        stats["aot_loaded"] += 1
        return fn
    if require_aot():
        raise MissingAotVariant(
            f"dsv4_mla: kernel variant {variant.name} has no up-to-date entry in any AOT manifest "
            f"(searched: {', '.join(str(d) for d in aot_dirs())}"
            f"{'; skipped: ' + ', '.join(skipped) if skipped else ''}) and compiling at serve time is off "
            f"(DSV4_MLA_REQUIRE_AOT / set_require_aot). Build it with: "
            f"dsv4-mla-aot-build --arch {variant.arch} --out <dir>, then set DSV4_MLA_AOT_DIR=<dir>"
        )
    if skipped:
        _report_once("dsv4_mla: kernels with no up-to-date AOT entry are taken from the JIT disk cache or "
                     "compiled (dispatch.runtime.loader.sources says which)")
    entry_dir = jit_cache_dir() / fingerprint_id(fingerprint(variant))
    fn = _load_from_disk(variant, entry_dir)
    if fn is not None:
        stats["disk_loaded"] += 1
        sources[variant.name] = f"jit disk cache {jit_cache_dir()}"
        return fn
    compiled = compile_variant(variant)
    stats["compiled"] += 1
    sources[variant.name] = "compiled"
    try:
        _store_on_disk(compiled, variant, entry_dir)
    except OSError as err:  # a read-only home must not stop serving
        _report_once(f"dsv4_mla: could not write the JIT cache {entry_dir}: {err}")
    return compiled


def get_compiled(variant: KernelVariant):
    """The callable of a variant, obtained once per process."""
    fn = _compiled.get(variant)
    if fn is not None:
        return fn
    with _lock:
        fn = _compiled.get(variant)
        if fn is None:
            fn = _obtain(variant)
            _compiled[variant] = fn
    return fn
