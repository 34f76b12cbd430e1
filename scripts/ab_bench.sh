#!/usr/bin/env bash
# A/B timing of this tree against another checkout of the project, on one GPU in one sitting
# (docs/contributing.md):
#   bash scripts/ab_bench.sh OLD_TREE [ROUNDS] [bench arguments ...]
# Runs `python3 -m scripts.bench --no-torch --json ...` in OLD_TREE and here alternately (old,
# new, old, new, ...: a drift of the machine hits both alike), ROUNDS times each (default 2),
# keeps every run's JSON and log under $OUT (default /tmp/ab), and prints the comparison of
# each shape's minimum last (scripts/bench_compare.py). Each tree's kernels come from its own
# sources; prebuilt ones from $AOT_OLD / $AOT_NEW (each tree's DSV4_MLA_AOT_DIR) where set.
set -euo pipefail
old="$(cd "$1" && pwd)"; shift
rounds="${1:-2}"; shift || true
here="$(pwd)"
out="${OUT:-/tmp/ab}"
mkdir -p "$out"
olds=(); news=()
for r in $(seq 1 "$rounds"); do
  (cd "$old" && DSV4_MLA_AOT_DIR="${AOT_OLD:-}" python3 -m scripts.bench --no-torch --json "$out/old$r.json" "$@" \
    > "$out/old$r.log" 2>&1) || { tail -20 "$out/old$r.log"; exit 1; }
  DSV4_MLA_AOT_DIR="${AOT_NEW:-}" python3 -m scripts.bench --no-torch --json "$out/new$r.json" "$@" \
    > "$out/new$r.log" 2>&1 || { tail -20 "$out/new$r.log"; exit 1; }
  olds+=("$out/old$r.json"); news+=("$out/new$r.json")
  echo "round $r done" >&2
done
python3 -m scripts.bench_compare --old "${olds[@]}" --new "${news[@]}" | tee "$out/compare.txt"
