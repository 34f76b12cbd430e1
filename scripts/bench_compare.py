"""Compare two trees' ``scripts.bench --json`` runs: an A/B table (``docs/contributing.md``).

    python -m scripts.bench_compare --old old_1.json old_2.json --new new_1.json new_2.json

The method: on one machine, in one sitting, run the bench on the old tree, the new, the old,
the new (so that a drift of the machine hits both alike; ``scripts/ab_bench.sh``), then take
each shape's minimum over its runs. Prints one line per shape (old us, new us, new / old, and
every run's time) and the geometric mean of new / old over the shapes both sides timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def load_runs(paths: list[str]) -> dict:
    """{(T, H, topk): [us of each run]} of ``scripts.bench --json`` files."""
    times: dict = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            times.setdefault((row["T"], row["H"], str(row["topk"])), []).append(row["us"])
    return times


def _order(key):
    T, H, topk = key
    return T, H, sum(int(part) for part in topk.split("+"))


def compare(old: dict, new: dict) -> tuple[list[tuple], float]:
    """(rows (key, old min, new min, new / old, old runs, new runs), geometric mean of new / old)."""
    rows = []
    for key in sorted(old.keys() & new.keys(), key=_order):
        a, b = min(old[key]), min(new[key])
        rows.append((key, a, b, b / a, old[key], new[key]))
    if not rows:
        raise SystemExit("the two sides share no shape")
    return rows, statistics.geometric_mean(r[3] for r in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", nargs="+", required=True, help="bench JSON files of the old tree")
    ap.add_argument("--new", nargs="+", required=True, help="bench JSON files of the new tree")
    args = ap.parse_args(argv)
    rows, geomean = compare(load_runs(args.old), load_runs(args.new))
    print(f"{'T':>4} {'H':>4} {'topk':>8} {'old us':>9} {'new us':>8} {'new/old':>8}   (runs old | new)")
    for (T, H, topk), a, b, ratio, runs_a, runs_b in rows:
        print(f"{T:>4} {H:>4} {topk:>8} {a:>9.2f} {b:>8.2f} {ratio:>8.3f}   "
              f"{' '.join(f'{x:.2f}' for x in runs_a)} | {' '.join(f'{x:.2f}' for x in runs_b)}")
    print(f"geomean new/old {geomean:.3f} over {len(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
