"""Where a kernel's warps spend their time, phase by phase between its CTA barriers (CPU).

    ncu --clock-control none --cache-control all -k regex:partial --launch-skip 2 --launch-count 1 \\
        --set full --warp-sampling-interval 0 --import-source no -o prof \\
        python -m scripts.profile_kernels 1x16x128+512
    ncu -i prof.ncu-rep --page source --csv --print-source sass > prof.csv
    python -m scripts.ncu_phases prof.csv [--top 2]

Reads the per-instruction source page that ncu exports (SASS, CSV: each instruction's
warp-state samples, executions and samples per stall reason) and cuts the program after
each CTA barrier (``BAR.SYNC``) and each unpredicated ``EXIT``: one phase per stretch of
straight-line work a CTA's warps do between two waits for each other (a warp role's code,
such as the "f16" kernel's rope warp, ends at its ``EXIT``). Per phase: its instruction
lines, the most any of its instructions executed (warps x passes), its warp-state samples
and their share of the kernel's, its largest stall reasons, and its first instruction.

A sample is one warp caught at one instruction, so a phase's share is its share of the warp
time, which is its share of the CTA's time where the warps move together (a latency-bound
kernel of one CTA per SM); the counts are statistical (ncu samples each SM sub-partition
every 2**(5 + interval) cycles). ncu puts a warp's samples after its ``EXIT``, while its
stores drain (stall reason "drain"), on the instruction after the ``EXIT``: the first line
of the next phase.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Phase:
    first: int  # line of its first instruction (0-based, in the export's order)
    end: int  # one past its last
    samples: int = 0
    executed: int = 0  # the most any of its instructions executed
    stalls: dict = field(default_factory=dict)  # reason: samples
    first_instruction: str = ""


def read_source_page(path: str) -> tuple[list[str], list[dict]]:
    """(stall reason columns, one dict per SASS instruction) of ncu's exported source page."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    for i, row in enumerate(rows):
        if "Source" in row and SAMPLES in row:
            header, body = row, rows[i + 1:]
            break
    else:
        raise ValueError(f"{path}: no header with 'Source' and {SAMPLES!r}: export it with "
                         f"`ncu -i REPORT --page source --csv --print-source sass`")
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    return reasons, [dict(zip(header, r)) for r in body if len(r) == len(header)]


def _count(text: str) -> int:
    text = (text or "").replace(",", "").strip()
    return int(float(text)) if text and text != "-" else 0


def phases(reasons: list[str], instructions: list[dict]) -> list[Phase]:
    """The program cut after each CTA barrier and each unpredicated EXIT."""
    out, current = [], None
    for n, ins in enumerate(instructions):
        source = ins["Source"].strip()
        if current is None:
            current = Phase(first=n, end=n, first_instruction=source)
        current.end = n + 1
        current.samples += _count(ins[SAMPLES])
        current.executed = max(current.executed, _count(ins[EXECUTED]))
        for r in reasons:
            reason = r[len("stall_"):]
            current.stalls[reason] = current.stalls.get(reason, 0) + _count(ins[r])
        if re.match(r"BAR\.SYNC\b", source) or re.match(r"EXIT\b", source):
            out.append(current)
            current = None
    if current is not None:
        out.append(current)
    return out


def report(path: str, top: int = 2) -> str:
    reasons, instructions = read_source_page(path)
    cut = phases(reasons, instructions)
    total = sum(p.samples for p in cut) or 1
    lines = [f"{path}: {len(instructions)} instructions, {total} warp-state samples, {len(cut)} phases",
             f"{'lines':>13} {'executed':>9} {'samples':>8} {'share':>6}  stalls; first instruction"]
    for p in cut:
        stalls = ", ".join(f"{k} {v}" for k, v in sorted(p.stalls.items(), key=lambda kv: -kv[1])[:top] if v)
        lines.append(f"{p.first:>6}-{p.end:<6} {p.executed:>9} {p.samples:>8} {100 * p.samples / total:>5.1f}%  "
                     f"{stalls or '-'}; {p.first_instruction[:60]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.ncu_phases", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+", help="ncu's source page of one kernel (--page source --csv --print-source sass)")
    ap.add_argument("--top", type=int, default=2, help="stall reasons per phase (default: %(default)s)")
    args = ap.parse_args(argv)
    for path in args.csv:
        print(report(path, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
