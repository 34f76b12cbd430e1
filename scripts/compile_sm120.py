"""Compile every kernel variant the dispatch can select, for SM120, and check its SASS.

    python scripts/compile_sm120.py [--arch sm_120a] [--arch sm_121a ...]

Runs on a machine with no GPU. Prints, per variant: registers per thread, static and
planned dynamic shared memory per CTA, local memory (spills), and the MMA instructions.
Exits non-zero when a variant fails to compile, spills, needs more than 99 KB of shared
memory, or uses an instruction SM120 does not have.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="dsv4_mla_cubin_"))

from cute_kernels.sass_check import inspect_cubin  # noqa: E402
from cute_kernels.sparse_mla_decode.config import SMEM_LIMIT_BYTES, PartialConfig  # noqa: E402
from dispatch.loader import compile_variant  # noqa: E402
from dispatch.variants import variant_space  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", help="target arch (repeatable), default sm_120a")
    args = ap.parse_args(argv)
    archs = args.arch or ["sm_120a"]
    failures = []
    rows = []
    for arch in archs:
        for v in variant_space(arch):
            t0 = time.time()
            try:
                compiled = compile_variant(v, keep_cubin=True)
                (rep,) = inspect_cubin(compiled.artifacts.CUBIN)
            except Exception as err:  # report every failing variant, then fail
                failures.append(f"{v.name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
                continue
            dyn = v.config.smem_bytes() if isinstance(v.config, PartialConfig) else 0
            smem = rep.static_smem_bytes + dyn
            problems = []
            if rep.local_bytes or rep.local_memory_instructions or rep.stack_bytes:
                problems.append("local memory")
            if smem > SMEM_LIMIT_BYTES:
                problems.append(f"smem {smem} > {SMEM_LIMIT_BYTES}")
            if rep.forbidden and arch.startswith("sm_12"):
                problems.append(f"not on SM120: {rep.forbidden}")
            if problems:
                failures.append(f"{v.name}: {', '.join(problems)}")
            mma = " ".join(f"{k}x{n}" for k, n in sorted(rep.mma_counts.items())) or "-"
            rows.append((v.name, rep.registers, rep.static_smem_bytes, dyn, rep.local_bytes,
                         rep.local_memory_instructions, mma, f"{time.time() - t0:.1f}s"))
    head = ("variant", "regs", "smem static", "smem dyn", "local B", "LDL/STL", "MMA", "compile")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)))
    for f in failures:
        print("FAILED", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
