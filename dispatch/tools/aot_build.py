"""Offline AOT build of the sparse-MLA kernel variants (no GPU needed): ``dsv4-mla-aot-build``.

    dsv4-mla-aot-build [--arch sm_120a --arch sm_121a] [--out build/aot] [--jobs N] [--only REGEX] [--force]
    dsv4-mla-aot-build --arch sm_80 --arch sm_86 --arch sm_89 --out build/aot8x    # Ampere and Ada
    dsv4-mla-aot-build --report [--out DIR]
    dsv4-mla-aot-build --wheel DIR [--arch ...]       # from a source checkout: a wheel with the kernels

Builds exactly ``dispatch.policy.registry.registry_variants(arch)`` for each ``--arch`` (default: the
deployment archs, sm_120a and sm_121a; also sm_80, sm_86, sm_89; ``--arch sm_90a --out
build/aot90`` builds the H200 test GPU's, and ``--arch sm_80_on_sm_90a`` an arch profile's
(``cute_kernels.arch.profile``), each best kept in a directory of its own) in parallel
processes, exports each variant as ``<name>.o`` into ``--out`` (default ``build/aot`` in the
current directory) and records it in ``manifest.json``: its key, the fingerprint the loader
checks (arch, nvidia-cutlass-dsl version and libs, project version, kernel source hash), the
object's sha256 and the resources read from the compiled kernel. Up-to-date entries are
skipped; entries of the built archs that the registry no longer plans are dropped with their
files (other archs' are kept). A variant fails the build when its SASS holds an instruction
its target must not contain (``Arch.forbidden_sass``: what no target uses, and the
instructions of what the arch lacks: PDL, the e4m3 conversion, the e4m3 or block-scaled MMA),
or its shared-memory plan (``PartialConfig.smem_plan``) differs from what the DSL launches it
with; the variant of an arch whose binaries ship (``Arch.ships``: every one but the sm_90a
test GPU and the profiles) also when it spills to local memory or is launched with more shared
memory than the arch's per-CTA limit. Exits non-zero naming every failed variant; prints the
resource report at the end.

Serve from the directory with ``DSV4_MLA_AOT_DIR=<out>`` (``DSV4_MLA_REQUIRE_AOT=1`` turns a
missing variant into an error), or with ``--wheel DIR`` build a wheel of this package that
carries the up-to-date objects of the registry of each ``--arch`` in ``dispatch/aot_data/``,
where the loader finds them on its own. The wheel is built by ``pip wheel``, which by default
installs the build backend (setuptools) into an isolated environment from the package index;
offline, install setuptools and pass ``--no-build-isolation``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cute_kernels.arch import DEPLOYMENT_ARCHS, PROFILES, SUPPORTED_ARCHS, arch_facts

from ..policy.registry import registry_variants
from ..policy.variant_space import KernelVariant
from ..runtime.fingerprint import ROOT, fingerprint, mismatches
from ..runtime.loader import MANIFEST, MANIFEST_FORMAT, PACKAGE_AOT_DIR, read_manifest, sha256_file

DEFAULT_OUT = Path("build") / "aot"


def planned_variants(archs, only: str | None = None) -> list[KernelVariant]:
    """What a build for ``archs`` compiles: the registry, optionally filtered by a name regex."""
    out = [v for arch in archs for v in registry_variants(arch)]
    return [v for v in out if only is None or re.search(only, v.name)]


def build_one(variant: KernelVariant, out_dir: str) -> dict:
    """Compile, check and export one variant (runs in a worker process); its manifest entry.

    A failure comes back as a RuntimeError carrying the message as text: the DSL's own
    compile errors hold objects that cannot cross the process boundary."""
    try:
        return _build_one_unchecked(variant, out_dir)
    except Exception as err:
        raise RuntimeError(f"{type(err).__name__}: {err}") from None


def _worker_init(dump_root: str) -> None:
    """A build worker's own directory for the cubins the DSL dumps, inside ``dump_root`` (the
    build's, removed when it ends), unless the caller chose one with ``CUTE_DSL_DUMP_DIR``."""
    if "CUTE_DSL_DUMP_DIR" not in os.environ:
        os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix="worker_", dir=dump_root)


def _build_one_unchecked(variant: KernelVariant, out_dir: str) -> dict:
    from cute_kernels.sass_check import disassemble, inspect_cubin, launch_smem_bytes, mma_loops, waits_before_first_copy

    from ..runtime.loader import compile_variant, export_variant

    t0 = time.time()
    target = variant.target
    compiled = compile_variant(variant, keep_cubin=True)
    (rep,) = inspect_cubin(compiled.artifacts.CUBIN, target.forbidden_sass)
    launch_smem = launch_smem_bytes(str(compiled.ir_module))
    resources = {
        "registers": rep.registers, "launch_smem_bytes": launch_smem, "plan_smem_bytes": variant.config.smem_bytes(),
        "reserved_smem_bytes": rep.static_smem_bytes, "local_bytes": rep.local_bytes, "stack_bytes": rep.stack_bytes,
        "local_memory_instructions": rep.local_memory_instructions, "mma": rep.mma_counts,
        # per main loop (one per warp role in the "f16" kernel): its instructions, and the MMAs
        # right after the MMA whose output they accumulate onto (``LoopMix.chained_mma``)
        "loop_instructions": [], "chained_mma": [],
    }
    sass = disassemble(compiled.artifacts.CUBIN)
    # instructions that wait for a global load before the first cp.async (a partial kernel's
    # first indices) is issued (``sass_check.waits_before_first_copy``)
    resources["waits_before_first_copy"] = len(waits_before_first_copy(sass))
    for loop in mma_loops(sass):
        resources["loop_instructions"].append(loop.instructions)
        resources["chained_mma"].append(loop.chained_mma)
    problems = []
    if rep.forbidden:
        problems.append(f"uses instructions {target.label} must not contain: {rep.forbidden}")
    if target.ships:  # its binaries are what a deployment runs
        if rep.local_bytes or rep.stack_bytes or rep.local_memory_instructions:
            problems.append("spills to local memory")
        if launch_smem > target.smem_per_cta:
            problems.append(f"is launched with {launch_smem} bytes of shared memory > {target.smem_per_cta}, "
                            f"{target.label}'s limit per CTA")
    if launch_smem != variant.config.smem_bytes():
        problems.append(f"is launched with {launch_smem} bytes of shared memory, its plan says "
                        f"{variant.config.smem_bytes()}")
    if problems:
        raise RuntimeError("; ".join(problems))
    obj = export_variant(compiled, variant, out_dir)
    return {
        "key": {"kind": variant.kind, **variant.config.__dict__},
        "fingerprint": fingerprint(variant),
        "object": obj.name,
        "object_sha256": sha256_file(obj),
        "resources": resources,
        "compile_seconds": round(time.time() - t0, 2),
    }


def up_to_date(variant: KernelVariant, entry: dict | None, out_dir: Path) -> bool:
    """Whether ``entry`` (a manifest entry or None) is this variant as the current sources build it."""
    if entry is None or mismatches(fingerprint(variant), entry.get("fingerprint", {})):
        return False
    obj = out_dir / entry.get("object", "")
    return obj.exists() and sha256_file(obj) == entry.get("object_sha256")


def prune(entries: dict, archs, out_dir: Path) -> dict:
    """``entries`` without those of ``archs`` that their registry no longer plans (their
    object and header files are removed); entries of other archs are kept as they are."""
    planned = {v.name for v in planned_variants(archs)}
    kept = {}
    for name, entry in entries.items():
        if entry.get("fingerprint", {}).get("arch") in archs and name not in planned:
            for suffix in (".o", ".h"):
                (out_dir / f"{name}{suffix}").unlink(missing_ok=True)
            print(f"dropped {name}: no longer planned for {entry['fingerprint']['arch']}", flush=True)
            continue
        kept[name] = entry
    return kept


def _write_manifest(out_dir: Path, entries: dict) -> None:
    tmp = out_dir / f".{MANIFEST}.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"format": MANIFEST_FORMAT, "entries": entries}, indent=1, sort_keys=True))
    os.replace(tmp, out_dir / MANIFEST)


def _bar(done: int, total: int, width: int = 24) -> str:
    fill = width * done // max(total, 1)
    return f"[{'#' * fill}{'.' * (width - fill)}] {done}/{total}"


def report(out_dir: Path) -> str:
    """The manifest's resource table: one row per variant, then a summary line per arch."""
    manifest = read_manifest(out_dir)
    if manifest is None:
        return f"no manifest in {out_dir}"
    head = ("variant", "arch", "regs", "smem/CTA", "local B", "LDL/STL", "loop instr.", "MMA instructions")
    rows = []
    for name, e in sorted(manifest["entries"].items()):
        r = e["resources"]
        mma = " ".join(f"{k} x{n}" for k, n in sorted(r["mma"].items())) or "-"
        rows.append((name, e["fingerprint"]["arch"], r["registers"], r["launch_smem_bytes"], r["local_bytes"],
                     r["local_memory_instructions"], "/".join(map(str, r["loop_instructions"])) or "-", mma))
    widths = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [head] + rows]
    for arch in sorted({row[1] for row in rows}):
        mine = [row for row in rows if row[1] == arch]
        limit = arch_facts(arch).smem_per_cta
        spills = sum(1 for row in mine if row[4] or row[5])
        over = sum(1 for row in mine if row[3] > limit)
        lines.append(f"{arch}: {len(mine)} variants; {spills} spill; {over} over {limit} bytes of shared memory per "
                     f"CTA; largest {max(row[3] for row in mine)} bytes, {max(row[2] for row in mine)} registers")
    if not rows:
        lines.append("0 variants")
    return "\n".join(lines)


def build(archs, out_dir: Path, *, jobs: int, only: str | None = None, force: bool = False) -> list[str]:
    """Build every planned variant that is not up to date into ``out_dir``; returns the failures."""
    from cute_kernels.sass_check import require_sass_tools

    require_sass_tools()  # before any compiling: a missing tool names its install command
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = prune(dict((read_manifest(out_dir) or {"entries": {}})["entries"]), archs, out_dir)
    variants = planned_variants(archs, only)
    todo = [v for v in variants if force or not up_to_date(v, entries.get(v.name), out_dir)]
    print(f"{len(variants)} variants planned for {', '.join(archs)}, {len(variants) - len(todo)} up to date, "
          f"{len(todo)} to build with {jobs} processes -> {out_dir}", flush=True)
    failures = []
    if todo:
        ctx = mp.get_context("spawn")  # fresh interpreters: the DSL keeps global state
        with tempfile.TemporaryDirectory(prefix="dsv4_mla_cubin_") as dump_root, \
                cf.ProcessPoolExecutor(max_workers=max(1, min(jobs, len(todo))), mp_context=ctx,
                                       initializer=_worker_init, initargs=(dump_root,)) as pool:
            futures = {pool.submit(build_one, v, str(out_dir)): v for v in todo}
            for done, fut in enumerate(cf.as_completed(futures), 1):
                v = futures[fut]
                try:
                    entries[v.name] = fut.result()
                    status = f"ok {entries[v.name]['compile_seconds']:.1f}s"
                except Exception as err:  # name every failure, keep building the rest
                    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                    failures.append(f"{v.name}: {first}")
                    entries.pop(v.name, None)
                    status = "FAILED"
                print(f"{_bar(done, len(todo))} {v.name} {status}", file=sys.stderr, flush=True)
                _write_manifest(out_dir, entries)  # progress survives an interrupted build
    _write_manifest(out_dir, entries)
    return failures


def source_checkout() -> Path:
    """The source checkout this package runs from (what ``--wheel`` packages); SystemExit if
    it runs from an installed copy."""
    root = ROOT
    if not (root / "pyproject.toml").exists():
        raise SystemExit(f"--wheel packages a source checkout: no pyproject.toml in {root} (install the project "
                         f"with pip install -e from its checkout)")
    return root


def wheel_entries(out_dir: Path, archs) -> dict:
    """The manifest entries a wheel of ``archs`` ships from ``out_dir``: those of the variants
    the registry plans for ``archs`` that are up to date; stale, unplanned and other archs'
    entries stay out. Reports the planned variants it lacks."""
    found = (read_manifest(out_dir) or {"entries": {}})["entries"]
    entries, missing = {}, []
    for v in planned_variants(archs):
        if up_to_date(v, found.get(v.name), out_dir):
            entries[v.name] = found[v.name]
        else:
            missing.append(v.name)
    if missing:
        print(f"warning: {len(missing)} planned variants have no up-to-date entry in {out_dir} and are not in "
              f"the wheel (build them first), e.g. {missing[0]}", file=sys.stderr)
    return entries


def build_wheel(out_dir: Path, wheel_dir: Path, archs, *, build_isolation: bool = True) -> Path:
    """A wheel of this package whose ``dispatch/aot_data`` holds the up-to-date manifest
    entries and objects of the registry of ``archs`` from ``out_dir`` (``wheel_entries``).
    Needs the package's source checkout (its ``pyproject.toml``)."""
    root = source_checkout()
    entries = wheel_entries(out_dir, archs)
    with tempfile.TemporaryDirectory(prefix="dsv4_mla_wheel_") as stage:
        stage = Path(stage)
        for item in ("pyproject.toml", "README.md", "cute_kernels", "dispatch"):
            src = root / item
            if src.is_dir():
                shutil.copytree(src, stage / item, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "aot_data"))
            else:
                shutil.copy2(src, stage / item)
        data = stage / "dispatch" / PACKAGE_AOT_DIR.name
        data.mkdir()
        for e in entries.values():
            shutil.copy2(out_dir / e["object"], data / e["object"])
        _write_manifest(data, entries)
        wheel_dir.mkdir(parents=True, exist_ok=True)
        before = set(wheel_dir.glob("*.whl"))
        isolation = [] if build_isolation else ["--no-build-isolation"]
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *isolation, "-w", str(wheel_dir),
                        str(stage)], check=True)
        built = sorted(set(wheel_dir.glob("*.whl")) - before) or sorted(wheel_dir.glob("dsv4_sparse_mla-*.whl"))
    print(f"wheel with {len(entries)} prebuilt variants ({', '.join(archs)}): {built[-1]}")
    return built[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4-mla-aot-build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", choices=SUPPORTED_ARCHS + tuple(PROFILES),
                    help=f"target arch or arch profile, repeatable (default: {' '.join(DEPLOYMENT_ARCHS)})")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output directory (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile processes")
    ap.add_argument("--only", help="build only the variants whose name matches this regex")
    ap.add_argument("--force", action="store_true", help="rebuild entries that are up to date")
    ap.add_argument("--report", action="store_true", help="print the manifest's resource table and exit")
    ap.add_argument("--wheel", metavar="DIR", help="then build a wheel carrying the objects into DIR")
    ap.add_argument("--no-build-isolation", action="store_true",
                    help="--wheel: build with the installed setuptools (offline) instead of an isolated one")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    if args.report:
        print(report(out_dir))
        return 0
    if args.wheel:
        source_checkout()  # before the build: an installed copy cannot make a wheel
    archs = args.arch or list(DEPLOYMENT_ARCHS)
    t0 = time.time()
    from cute_kernels.sass_check import MissingSassTool

    try:
        failures = build(archs, out_dir, jobs=args.jobs, only=args.only, force=args.force)
    except MissingSassTool as err:
        print(f"dsv4-mla-aot-build: {err} (or install this package with its [aot] extra)", file=sys.stderr)
        return 2
    print(f"built in {time.time() - t0:.1f}s")
    print(report(out_dir))
    for f in failures:
        print(f"FAILED {f}")
    if failures:
        return 1
    if args.wheel:
        build_wheel(out_dir, Path(args.wheel), archs, build_isolation=not args.no_build_isolation)
    return 0


if __name__ == "__main__":
    sys.exit(main())
