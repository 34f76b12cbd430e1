"""Offline AOT build of the DeepSeek-V4 sparse-MLA kernel variants (no GPU needed).

    python scripts/aot_build.py [--arch sm_120a ...] [--out DIR] [--jobs N] [--only REGEX] [--force]
    python scripts/aot_build.py --report [--out DIR]

Builds exactly ``dispatch.registry.registry_variants(arch)`` for each ``--arch`` (default
sm_120a; repeatable: sm_121a, sm_90a, ...) in parallel processes, exports each variant as
``<name>.o``/``<name>.h`` into ``--out`` (default: the package's ``dispatch/aot_data``, where
the dispatch finds it) and records it in ``manifest.json``: its key, arch, nvidia-cutlass-dsl
version and libs, project version, kernel source hash, object sha256 and the resources
read from its cubin. Up-to-date entries are skipped. For sm_120a/sm_121a every variant's
SASS is checked: a variant that spills to local memory, needs more than 99 KB of shared
memory per CTA or uses an instruction SM120 does not have fails. Exits non-zero naming
every failed variant.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cute_kernels.arch import DEPLOYMENT_ARCHS  # noqa: E402
from dispatch.fingerprint import fingerprint, mismatches  # noqa: E402
from dispatch.loader import MANIFEST, MANIFEST_FORMAT, PACKAGE_AOT_DIR, read_manifest, sha256_file  # noqa: E402
from dispatch.registry import registry_variants  # noqa: E402
from dispatch.variants import KernelVariant  # noqa: E402



def planned_variants(archs, only: str | None = None) -> list[KernelVariant]:
    """What a build for ``archs`` compiles: the registry, optionally filtered by a name regex."""
    out = [v for arch in archs for v in registry_variants(arch)]
    return [v for v in out if only is None or re.search(only, v.name)]


def _build_one(variant: KernelVariant, out_dir: str) -> dict:
    """Compile, check and export one variant (runs in a worker process).

    A failure comes back as a RuntimeError carrying the message as text: the DSL's own
    compile errors hold objects that cannot cross the process boundary."""
    try:
        return _build_one_unchecked(variant, out_dir)
    except Exception as err:
        raise RuntimeError(f"{type(err).__name__}: {err}") from None


def _build_one_unchecked(variant: KernelVariant, out_dir: str) -> dict:
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="dsv4_mla_cubin_"))
    from cute_kernels.sass_check import disassemble, inspect_cubin, mma_loops
    from cute_kernels.sparse_mla_decode.config import SMEM_LIMIT_BYTES
    from dispatch.loader import compile_variant, export_variant

    t0 = time.time()
    compiled = compile_variant(variant, keep_cubin=True)
    (rep,) = inspect_cubin(compiled.artifacts.CUBIN)
    dynamic = variant.config.smem_bytes()  # what the kernel's SmemAllocator plan asks for
    resources = {
        "registers": rep.registers, "static_smem_bytes": rep.static_smem_bytes, "dynamic_smem_bytes": dynamic,
        "local_bytes": rep.local_bytes, "stack_bytes": rep.stack_bytes,
        "local_memory_instructions": rep.local_memory_instructions, "mma": rep.mma_counts,
        # per main loop (one per warp role in the "f16" kernel): MMAs right after the MMA whose
        # output they accumulate onto (``LoopMix.chained_mma``)
        "chained_mma": [loop.chained_mma for loop in mma_loops(disassemble(compiled.artifacts.CUBIN))],
    }
    problems = []
    if variant.arch in DEPLOYMENT_ARCHS:  # the SM120 targets: their binaries are what ships
        if rep.local_bytes or rep.stack_bytes or rep.local_memory_instructions:
            problems.append("spills to local memory")
        if rep.static_smem_bytes + dynamic > SMEM_LIMIT_BYTES:
            problems.append(f"needs {rep.static_smem_bytes + dynamic} bytes of shared memory > {SMEM_LIMIT_BYTES}")
        if rep.forbidden:
            problems.append(f"uses instructions SM120 does not have: {rep.forbidden}")
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


def _up_to_date(variant: KernelVariant, entry: dict | None, out_dir: Path) -> bool:
    if entry is None or mismatches(fingerprint(variant), entry.get("fingerprint", {})):
        return False
    obj = out_dir / entry.get("object", "")
    return obj.exists() and sha256_file(obj) == entry.get("object_sha256")


def _write_manifest(out_dir: Path, entries: dict) -> None:
    tmp = out_dir / f".{MANIFEST}.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"format": MANIFEST_FORMAT, "entries": entries}, indent=1, sort_keys=True))
    os.replace(tmp, out_dir / MANIFEST)


def _bar(done: int, total: int, width: int = 24) -> str:
    fill = width * done // max(total, 1)
    return f"[{'#' * fill}{'.' * (width - fill)}] {done}/{total}"


def report(out_dir: Path) -> str:
    manifest = read_manifest(out_dir)
    if manifest is None:
        return f"no manifest in {out_dir}"
    head = ("variant", "arch", "regs", "smem/CTA", "local B", "LDL/STL", "MMA instructions")
    rows = []
    for name, e in sorted(manifest["entries"].items()):
        r = e["resources"]
        mma = " ".join(f"{k} x{n}" for k, n in sorted(r["mma"].items())) or "-"
        rows.append((name, e["fingerprint"]["arch"], r["registers"], r["static_smem_bytes"] + r["dynamic_smem_bytes"],
                     r["local_bytes"], r["local_memory_instructions"], mma))
    widths = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [head] + rows]
    spills = sum(1 for row in rows if row[4] or row[5])
    over = sum(1 for row in rows if row[3] > 101376)
    lines.append(f"{len(rows)} variants; {spills} spill; {over} over 99 KB of shared memory per CTA")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", help="target arch, repeatable (default sm_120a)")
    ap.add_argument("--out", default=str(PACKAGE_AOT_DIR), help="output directory (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile processes")
    ap.add_argument("--only", help="build only the variants whose name matches this regex")
    ap.add_argument("--force", action="store_true", help="rebuild entries that are up to date")
    ap.add_argument("--report", action="store_true", help="print the manifest's resource table and exit")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    if args.report:
        print(report(out_dir))
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out_dir) or {"entries": {}}
    entries = dict(manifest["entries"])
    variants = planned_variants(args.arch or ["sm_120a"], args.only)
    todo = [v for v in variants if args.force or not _up_to_date(v, entries.get(v.name), out_dir)]
    print(f"{len(variants)} variants planned, {len(variants) - len(todo)} up to date, {len(todo)} to build "
          f"with {args.jobs} processes -> {out_dir}", flush=True)
    failures = []
    t0 = time.time()
    if todo:
        ctx = mp.get_context("spawn")  # fresh interpreters: the DSL keeps global state
        with cf.ProcessPoolExecutor(max_workers=max(1, min(args.jobs, len(todo))), mp_context=ctx) as pool:
            futures = {pool.submit(_build_one, v, str(out_dir)): v for v in todo}
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
    print(f"built in {time.time() - t0:.1f}s")
    print(report(out_dir))
    for f in failures:
        print(f"FAILED {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
