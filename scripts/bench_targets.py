"""The performance targets of the "Fast" issue, checked against one ``scripts/bench.py --json`` run.

    python scripts/bench_targets.py bench.json

For each target, every shape it covers: the measured time, the time the target allows, and
for a shape that misses it the tensor rate that time would take (the call's QK + PV FLOPs,
``bench.tensor_flops``, over the allowed time) against the ceilings measured in the same run:
the plain ``mma.sync`` rate ("%mma") and the rate with the "f16" kernel's operand work, e4m3
bytes converted in registers for 16 or 32 heads ("%conv16", "%conv32";
``mma_ceiling.converted_ceiling_tflops``). A target whose shapes need more than a ceiling
cannot be met by a kernel bound by that ceiling. No GPU needed: it reads the JSON.

The targets (the issue's "Done when", measured with the dispatch's default precision):
- ``flashmla``: every shape with a FlashMLA figure at least as fast as it;
- ``flashmla_h16``: the 16-head ones at least 1.5x faster;
- ``t1_under_12us``: every T=1 shape under 12 us;
- ``t64_1000gbs``: T=64 with at least 512 entries, at least 1000 GB/s (entries = topk plus
  the extra list's, so 128+512 counts; GB/s as bench.py counts it);
- ``torch_10x``: every shape at least 10x faster than the torch reference (where timed).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cute_kernels.sparse_mla_decode.layout import TOKEN_BYTES  # noqa: E402
from scripts.bench import list_lengths, tensor_flops  # noqa: E402

FLASHMLA_H16_SPEEDUP = 1.5
T1_LIMIT_US = 12.0
T64_GBS = 1000.0
T64_MIN_ENTRIES = 512
TORCH_SPEEDUP = 10.0
TARGETS = ("flashmla", "flashmla_h16", "t1_under_12us", "t64_1000gbs", "torch_10x")


@dataclass(frozen=True)
class Check:
    target: str
    T: int
    H: int
    topk: str
    us: float
    allowed_us: float  # the target's limit as a time (the shape meets it at or below)
    strict: bool  # the limit itself misses ("under 12 us")
    need_tflops: float  # tensor rate at allowed_us

    @property
    def met(self) -> bool:
        return self.us < self.allowed_us if self.strict else self.us <= self.allowed_us


def checks(bench: dict) -> list[Check]:
    """Every (target, shape) pair of a bench JSON that the target covers."""
    out = []
    for r in bench["rows"]:
        T, H, shape, us = r["T"], r["H"], r["topk"], r["us"]
        entries = sum(list_lengths(shape))
        limits = []
        if r.get("flashmla_us"):
            limits.append(("flashmla", r["flashmla_us"], False))
            if H == 16:
                limits.append(("flashmla_h16", r["flashmla_us"] / FLASHMLA_H16_SPEEDUP, False))
        if T == 1:
            limits.append(("t1_under_12us", T1_LIMIT_US, True))
        if T == 64 and entries >= T64_MIN_ENTRIES:
            limits.append(("t64_1000gbs", T * entries * TOKEN_BYTES / (T64_GBS * 1e9) * 1e6, False))
        torch_us = r.get("torch_us")
        if torch_us is not None and math.isfinite(torch_us):
            limits.append(("torch_10x", torch_us / TORCH_SPEEDUP, False))
        flops = tensor_flops(T, H, shape)
        for target, allowed, strict in limits:
            out.append(Check(target, T, H, shape, us, allowed, strict, flops / (allowed * 1e-6) / 1e12))
    return out


def report(bench: dict) -> str:
    """The table: per target, how many shapes meet it, then each shape that misses it."""
    mma = bench["mma_tflops"]
    conv = {int(h): v for h, v in bench.get("conv_tflops", {}).items()}
    lines = [f"{bench.get('device', '?')}: mma.sync ceiling {mma:.0f} TFLOP/s"
             + "".join(f", converted for {h} heads {v:.0f}" for h, v in sorted(conv.items()))]
    all_checks = checks(bench)
    for target in TARGETS:
        rows = [c for c in all_checks if c.target == target]
        if not rows:
            lines.append(f"{target}: no shape of this run covers it")
            continue
        missed = [c for c in rows if not c.met]
        lines.append(f"{target}: {len(rows) - len(missed)} of {len(rows)} shapes meet it")
        for c in missed:
            ratios = f"{100 * c.need_tflops / mma:5.0f}%mma" + "".join(
                f" {100 * c.need_tflops / v:5.0f}%conv{h}" for h, v in sorted(conv.items()))
            lines.append(f"  missed {c.T:>4} x {c.H:>3} x {c.topk:>8}: {c.us:7.1f} us, allowed "
                         f"{c.allowed_us:7.1f} us ({'<' if c.strict else '<='}), needs {c.need_tflops:5.0f} TFLOP/s "
                         f"= {ratios}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json", help="the JSON of a scripts/bench.py --json run")
    args = ap.parse_args(argv)
    print(report(json.loads(Path(args.bench_json).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
