"""On Hopper (sm_90), which calls this library serves and which it leaves to the engine's own
FlashMLA: a measured policy, and the measurements it is read from.

The engines call FlashMLA's SM90 sparse decode with the query heads padded to 64 or 128 (its
only head counts). This library computes the real heads only; FlashMLA's ``wgmma`` kernel is
faster where many real heads meet many tokens, and on lists much wider than their lengths.
``RouteTable.choose`` answers for one call, by its shape:

- ``family``: the cache the call reads, "model1" (DeepSeek-V4 / V4.1's 584-byte records, main
  and extra) or "v32" (DeepSeek-V3.2 / GLM-5's 656-byte rows);
- ``heads``: the real query heads of the call (the layer's, before the engine's padding);
- ``tokens``: the query tokens of the call;
- ``entries``: its top-k plus its extra top-k (the widths of its lists).

The measured shapes around a call: in each of heads, entries and tokens, the measured value at
or below the call's and the one at or above it (one value where the call's is measured, or
beyond every measured value). This library takes the call only where it was faster on every
measured shape around it; otherwise, and for a family with no measured row, FlashMLA does. The
measured times are not monotone in tokens (a split plan changes with them), so a call between
two measured shapes goes to this library only where both agree.

``EVIDENCE``: the measured rows (``dispatch.tools.sm90_route_table``, the table of
``docs/performance.md``, "The Hopper route"): each row this library's routed call (the real
heads of a query padded as the engines pad it) and FlashMLA's call on the padded query, both
replayed from CUDA graphs with L2 cleared, in one process, on one GPU. ``dsv4-mla-selftest
--route-table FILE`` measures them on the user's GPU; ``load_table`` reads them
(``DSV4_MLA_SM90_ROUTE_TABLE`` names the file for the engine plugins).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

LIBRARY, FLASHMLA = "library", "flashmla"
FAMILIES = ("model1", "v32")
# the cache formats of each family, as this library names them (``kv_format.FORMATS``); GLM-5.3's
# rope-free rows are no family: nothing measured, so FlashMLA serves them
FAMILY_OF_FORMAT = {"model1_fp8": "model1", "v32_fp8": "v32"}
FORMAT_OF_FAMILY = {family: fmt for fmt, family in FAMILY_OF_FORMAT.items()}


@dataclass(frozen=True)
class RouteRow:
    """One measured shape: the two calls' median times in microseconds."""

    family: str
    heads: int
    tokens: int
    entries: int
    library_us: float
    flashmla_us: float

    @property
    def winner(self) -> str:
        return LIBRARY if self.library_us <= self.flashmla_us else FLASHMLA


# The measured rows: ``python -m dispatch.tools.sm90_route_table`` (device, date and commit in
# ``EVIDENCE_SOURCE``); replace both together when re-measured.
# (family, heads, tokens, entries, library us, FlashMLA us)
EVIDENCE_SOURCE = "NVIDIA H100 80GB HBM3, 2026-12-06, project 8f04524"
EVIDENCE: tuple[RouteRow, ...] = tuple(RouteRow(*r) for r in (
    ("model1", 8, 1, 128, 9.89, 16.0),
    ("model1", 8, 2, 128, 10.11, 16.51),
    ("model1", 8, 4, 128, 10.24, 16.64),
    ("model1", 8, 8, 128, 10.53, 17.15),
    ("model1", 8, 16, 128, 10.88, 17.57),
    ("model1", 8, 32, 128, 12.26, 17.73),
    ("model1", 8, 64, 128, 12.67, 19.17),
    ("model1", 8, 128, 128, 14.75, 23.01),
    ("model1", 8, 256, 128, 21.09, 39.39),
    ("model1", 16, 1, 128, 10.62, 15.9),
    ("model1", 16, 2, 128, 10.53, 16.35),
    ("model1", 16, 4, 128, 10.78, 16.54),
    ("model1", 16, 8, 128, 11.01, 16.96),
    ("model1", 16, 16, 128, 11.62, 17.47),
    ("model1", 16, 32, 128, 13.41, 17.89),
    ("model1", 16, 64, 128, 12.96, 18.85),
    ("model1", 16, 128, 128, 15.23, 22.88),
    ("model1", 16, 256, 128, 22.66, 39.3),
    ("model1", 32, 1, 128, 10.66, 16.03),
    ("model1", 32, 2, 128, 10.43, 16.16),
    ("model1", 32, 4, 128, 10.82, 16.51),
    ("model1", 32, 8, 128, 11.36, 16.99),
    ("model1", 32, 16, 128, 12.93, 17.54),
    ("model1", 32, 32, 128, 12.58, 17.86),
    ("model1", 32, 64, 128, 13.41, 18.94),
    ("model1", 32, 128, 128, 17.92, 22.82),
    ("model1", 32, 256, 128, 26.94, 39.36),
    ("model1", 64, 1, 128, 10.46, 16.26),
    ("model1", 64, 2, 128, 10.69, 16.22),
    ("model1", 64, 4, 128, 11.01, 16.42),
    ("model1", 64, 8, 128, 12.51, 16.83),
    ("model1", 64, 16, 128, 12.19, 17.47),
    ("model1", 64, 32, 128, 12.9, 17.86),
    ("model1", 64, 64, 128, 16.9, 18.94),
    ("model1", 64, 128, 128, 24.06, 22.85),
    ("model1", 64, 256, 128, 41.98, 39.26),
    ("model1", 128, 1, 128, 10.88, 15.1),
    ("model1", 128, 2, 128, 11.17, 15.23),
    ("model1", 128, 4, 128, 12.58, 15.42),
    ("model1", 128, 8, 128, 12.19, 15.97),
    ("model1", 128, 16, 128, 12.86, 15.2),
    ("model1", 128, 32, 128, 16.8, 16.42),
    ("model1", 128, 64, 128, 23.81, 19.68),
    ("model1", 128, 128, 128, 42.27, 32.26),
    ("model1", 128, 256, 128, 73.76, 56.8),
    ("model1", 8, 1, 640, 11.04, 17.82),
    ("model1", 8, 2, 640, 11.04, 18.27),
    ("model1", 8, 4, 640, 11.94, 18.5),
    ("model1", 8, 8, 640, 12.93, 21.02),
    ("model1", 8, 16, 640, 14.59, 24.32),
    ("model1", 8, 32, 640, 17.95, 32.42),
    ("model1", 8, 64, 640, 26.5, 52.13),
    ("model1", 8, 128, 640, 38.46, 55.01),
    ("model1", 8, 256, 640, 52.99, 97.15),
    ("model1", 16, 1, 640, 11.39, 17.57),
    ("model1", 16, 2, 640, 11.46, 18.08),
    ("model1", 16, 4, 640, 12.26, 18.53),
    ("model1", 16, 8, 640, 13.34, 20.99),
    ("model1", 16, 16, 640, 15.26, 24.13),
    ("model1", 16, 32, 640, 18.75, 32.48),
    ("model1", 16, 64, 640, 27.84, 52.13),
    ("model1", 16, 128, 640, 40.93, 55.3),
    ("model1", 16, 256, 640, 53.82, 98.21),
    ("model1", 32, 1, 640, 11.55, 17.82),
    ("model1", 32, 2, 640, 12.16, 18.21),
    ("model1", 32, 4, 640, 12.83, 18.59),
    ("model1", 32, 8, 640, 14.53, 20.99),
    ("model1", 32, 16, 640, 16.86, 24.42),
    ("model1", 32, 32, 640, 21.95, 32.51),
    ("model1", 32, 64, 640, 33.63, 52.45),
    ("model1", 32, 128, 640, 45.31, 55.84),
    ("model1", 32, 256, 640, 65.06, 97.6),
    ("model1", 64, 1, 640, 12.0, 17.7),
    ("model1", 64, 2, 640, 12.58, 18.18),
    ("model1", 64, 4, 640, 14.05, 18.66),
    ("model1", 64, 8, 640, 16.45, 20.96),
    ("model1", 64, 16, 640, 20.5, 24.48),
    ("model1", 64, 32, 640, 29.25, 32.51),
    ("model1", 64, 64, 640, 39.68, 52.74),
    ("model1", 64, 128, 640, 61.25, 55.9),
    ("model1", 64, 256, 640, 112.96, 98.56),
    ("model1", 128, 1, 640, 12.48, 17.44),
    ("model1", 128, 2, 640, 13.95, 17.5),
    ("model1", 128, 4, 640, 16.29, 19.84),
    ("model1", 128, 8, 640, 20.26, 21.66),
    ("model1", 128, 16, 640, 29.18, 27.17),
    ("model1", 128, 32, 640, 39.68, 41.22),
    ("model1", 128, 64, 640, 59.97, 41.82),
    ("model1", 128, 128, 640, 112.99, 73.57),
    ("model1", 128, 256, 640, 216.64, 136.32),
    ("model1", 8, 1, 1152, 11.55, 19.84),
    ("model1", 8, 2, 1152, 12.1, 20.26),
    ("model1", 8, 4, 1152, 12.9, 22.21),
    ("model1", 8, 8, 1152, 14.34, 24.38),
    ("model1", 8, 16, 1152, 17.82, 29.47),
    ("model1", 8, 32, 1152, 26.72, 42.27),
    ("model1", 8, 64, 1152, 36.8, 68.58),
    ("model1", 8, 128, 1152, 52.45, 82.3),
    ("model1", 8, 256, 1152, 77.66, 150.88),
    ("model1", 16, 1, 1152, 12.29, 19.68),
    ("model1", 16, 2, 1152, 12.86, 20.32),
    ("model1", 16, 4, 1152, 13.44, 22.08),
    ("model1", 16, 8, 1152, 14.82, 24.38),
    ("model1", 16, 16, 1152, 18.56, 29.54),
    ("model1", 16, 32, 1152, 28.22, 42.11),
    ("model1", 16, 64, 1152, 37.92, 68.42),
    ("model1", 16, 128, 1152, 54.85, 82.62),
    ("model1", 16, 256, 1152, 78.72, 151.04),
    ("model1", 32, 1, 1152, 12.51, 19.81),
    ("model1", 32, 2, 1152, 12.93, 20.48),
    ("model1", 32, 4, 1152, 14.53, 22.18),
    ("model1", 32, 8, 1152, 16.7, 24.29),
    ("model1", 32, 16, 1152, 22.08, 29.54),
    ("model1", 32, 32, 1152, 30.11, 42.05),
    ("model1", 32, 64, 1152, 43.15, 68.42),
    ("model1", 32, 128, 1152, 65.95, 82.66),
    ("model1", 32, 256, 1152, 101.22, 150.85),
    ("model1", 64, 1, 1152, 12.96, 19.74),
    ("model1", 64, 2, 1152, 13.86, 20.32),
    ("model1", 64, 4, 1152, 16.29, 22.02),
    ("model1", 64, 8, 1152, 20.99, 24.22),
    ("model1", 64, 16, 1152, 26.24, 29.54),
    ("model1", 64, 32, 1152, 39.33, 41.98),
    ("model1", 64, 64, 1152, 62.34, 68.99),
    ("model1", 64, 128, 1152, 98.08, 82.94),
    ("model1", 64, 256, 1152, 187.9, 150.75),
    ("model1", 128, 1, 1152, 13.95, 19.44),
    ("model1", 128, 2, 1152, 16.32, 20.93),
    ("model1", 128, 4, 1152, 21.15, 21.95),
    ("model1", 128, 8, 1152, 26.24, 25.44),
    ("model1", 128, 16, 1152, 39.33, 33.5),
    ("model1", 128, 32, 1152, 61.9, 53.76),
    ("model1", 128, 64, 1152, 96.48, 62.24),
    ("model1", 128, 128, 1152, 186.27, 112.32),
    ("model1", 128, 256, 1152, 361.71, 213.15),
    ("model1", 8, 1, 8320, 15.81, 18.02),
    ("model1", 8, 2, 8320, 16.9, 18.37),
    ("model1", 8, 4, 8320, 18.56, 18.59),
    ("model1", 8, 8, 8320, 20.58, 21.02),
    ("model1", 8, 16, 8320, 28.74, 24.48),
    ("model1", 8, 32, 8320, 32.13, 32.67),
    ("model1", 8, 64, 8320, 34.5, 52.99),
    ("model1", 8, 128, 8320, 40.86, 56.51),
    ("model1", 8, 256, 8320, 55.39, 101.12),
    ("model1", 16, 1, 8320, 16.48, 17.82),
    ("model1", 16, 2, 8320, 17.82, 18.27),
    ("model1", 16, 4, 8320, 20.22, 18.75),
    ("model1", 16, 8, 8320, 23.68, 21.25),
    ("model1", 16, 16, 8320, 30.69, 24.54),
    ("model1", 16, 32, 8320, 34.37, 32.74),
    ("model1", 16, 64, 8320, 36.42, 52.93),
    ("model1", 16, 128, 8320, 43.58, 56.32),
    ("model1", 16, 256, 8320, 56.13, 100.16),
    ("model1", 32, 1, 8320, 17.38, 17.82),
    ("model1", 32, 2, 8320, 19.26, 18.24),
    ("model1", 32, 4, 8320, 22.24, 18.75),
    ("model1", 32, 8, 8320, 32.45, 21.34),
    ("model1", 32, 16, 8320, 47.26, 24.35),
    ("model1", 32, 32, 8320, 51.39, 32.7),
    ("model1", 32, 64, 8320, 54.78, 52.99),
    ("model1", 32, 128, 8320, 58.85, 56.29),
    ("model1", 32, 256, 8320, 65.66, 100.99),
    ("model1", 64, 1, 8320, 18.62, 17.73),
    ("model1", 64, 2, 8320, 21.6, 18.37),
    ("model1", 64, 4, 8320, 31.84, 18.66),
    ("model1", 64, 8, 8320, 46.56, 21.38),
    ("model1", 64, 16, 8320, 50.14, 24.45),
    ("model1", 64, 32, 8320, 51.52, 32.38),
    ("model1", 64, 64, 8320, 55.42, 52.9),
    ("model1", 64, 128, 8320, 60.74, 56.83),
    ("model1", 64, 256, 8320, 114.66, 101.09),
    ("model1", 128, 1, 8320, 21.31, 17.28),
    ("model1", 128, 2, 8320, 31.52, 17.7),
    ("model1", 128, 4, 8320, 45.7, 19.9),
    ("model1", 128, 8, 8320, 49.66, 21.63),
    ("model1", 128, 16, 8320, 50.5, 27.07),
    ("model1", 128, 32, 8320, 54.05, 41.57),
    ("model1", 128, 64, 8320, 60.13, 42.24),
    ("model1", 128, 128, 8320, 113.28, 74.3),
    ("model1", 128, 256, 8320, 218.27, 137.54),
    ("v32", 8, 1, 2048, 13.09, 22.69),
    ("v32", 8, 2, 2048, 14.75, 24.37),
    ("v32", 8, 4, 2048, 15.65, 24.16),
    ("v32", 8, 8, 2048, 17.47, 27.62),
    ("v32", 8, 16, 2048, 24.8, 37.98),
    ("v32", 8, 32, 2048, 37.7, 56.19),
    ("v32", 8, 64, 2048, 55.68, 83.23),
    ("v32", 8, 128, 2048, 87.94, 122.14),
    ("v32", 8, 256, 2048, 161.54, 231.81),
    ("v32", 16, 1, 2048, 13.54, 22.62),
    ("v32", 16, 2, 2048, 15.62, 24.32),
    ("v32", 16, 4, 2048, 15.65, 23.94),
    ("v32", 16, 8, 2048, 18.05, 27.58),
    ("v32", 16, 16, 2048, 25.57, 37.92),
    ("v32", 16, 32, 2048, 38.34, 56.19),
    ("v32", 16, 64, 2048, 56.42, 83.49),
    ("v32", 16, 128, 2048, 89.73, 122.98),
    ("v32", 16, 256, 2048, 162.72, 231.78),
    ("v32", 32, 1, 2048, 15.2, 22.69),
    ("v32", 32, 2, 2048, 14.69, 24.32),
    ("v32", 32, 4, 2048, 16.32, 23.9),
    ("v32", 32, 8, 2048, 20.77, 27.62),
    ("v32", 32, 16, 2048, 30.34, 38.02),
    ("v32", 32, 32, 2048, 49.38, 56.16),
    ("v32", 32, 64, 2048, 81.12, 82.56),
    ("v32", 32, 128, 2048, 140.54, 122.37),
    ("v32", 32, 256, 2048, 270.82, 229.25),
    ("v32", 64, 1, 2048, 14.43, 22.5),
    ("v32", 64, 2, 2048, 16.0, 24.35),
    ("v32", 64, 4, 2048, 20.42, 24.0),
    ("v32", 64, 8, 2048, 28.7, 27.68),
    ("v32", 64, 16, 2048, 45.15, 38.05),
    ("v32", 64, 32, 2048, 77.47, 56.13),
    ("v32", 64, 64, 2048, 135.14, 83.07),
    ("v32", 64, 128, 2048, 265.63, 121.79),
    ("v32", 64, 256, 2048, 522.08, 229.28),
    ("v32", 128, 1, 2048, 16.35, 23.01),
    ("v32", 128, 2, 2048, 20.54, 22.3),
    ("v32", 128, 4, 2048, 28.9, 24.9),
    ("v32", 128, 8, 2048, 44.86, 32.26),
    ("v32", 128, 16, 2048, 76.93, 46.08),
    ("v32", 128, 32, 2048, 134.86, 68.48),
    ("v32", 128, 64, 2048, 259.65, 102.53),
    ("v32", 128, 128, 2048, 516.18, 191.26),
    ("v32", 128, 256, 2048, 1017.22, 366.7),
))


def _around(values, wanted: int) -> set:
    """The measured values next to ``wanted``: the largest <= it and the smallest >= it (the
    nearest one where it is outside them all)."""
    below, above = [v for v in values if v <= wanted], [v for v in values if v >= wanted]
    return {max(below) if below else min(values), min(above) if above else max(values)}


class RouteTable:
    """Measured rows and where they come from, with the choice per call shape remembered (a
    serving loop asks the same few shapes on every layer of every step: a dict lookup)."""

    def __init__(self, rows, source: str):
        self.rows, self.source = tuple(rows), source
        self._by_shape = {(r.family, r.heads, r.tokens, r.entries): r for r in self.rows}
        self._memo: dict = {}

    def __len__(self) -> int:
        return len(self.rows)

    def choose(self, family: str, heads: int, tokens: int, entries: int) -> str:
        """``LIBRARY`` or ``FLASHMLA`` for one call (module docstring)."""
        key = (family, heads, tokens, entries)
        choice = self._memo.get(key)
        if choice is None:
            choice = self._memo[key] = self._choose(*key)
        return choice

    def _choose(self, family, heads, tokens, entries) -> str:
        rows = [r for r in self.rows if r.family == family]
        if not rows:
            return FLASHMLA
        around = [_around({getattr(r, dim) for r in rows}, value)
                  for dim, value in (("heads", heads), ("tokens", tokens), ("entries", entries))]
        measured = [self._by_shape.get((family, h, t, e)) for h, t, e in itertools.product(*around)]
        measured = [r for r in measured if r is not None]
        return LIBRARY if measured and all(r.winner == LIBRARY for r in measured) else FLASHMLA


SHIPPED = RouteTable(EVIDENCE, EVIDENCE_SOURCE)


def to_json(rows, source: str) -> str:
    """``rows`` as ``load_table`` reads them back."""
    return json.dumps({"source": source, "rows": [asdict(r) for r in rows]}, indent=1)


def _row_problem(row: RouteRow) -> str | None:
    ints = (row.heads, row.tokens, row.entries)
    times = (row.library_us, row.flashmla_us)
    if row.family not in FAMILIES:
        return f"family {row.family!r} is not one of {FAMILIES}"
    if not all(type(v) is int and v >= 1 for v in ints):
        return f"heads, tokens and entries must be positive ints, got {ints}"
    if not all(type(v) in (int, float) and math.isfinite(v) and v > 0 for v in times):
        return f"the times must be positive numbers, got {times}"
    return None


def load_table(path) -> RouteTable:
    """The rows of a file ``to_json`` (or ``dsv4-mla-selftest --route-table``) wrote, with its
    source; ValueError naming the file and what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
        rows = tuple(RouteRow(**{k: row[k] for k in RouteRow.__dataclass_fields__}) for row in data["rows"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a route table ({type(err).__name__}: {err}); "
                         f"dsv4-mla-selftest --route-table FILE writes one") from None
    problems = [(r, _row_problem(r)) for r in rows]
    problems = [(r, p) for r, p in problems if p is not None]
    if not rows or problems:
        raise ValueError(f"{path}: " + ("no rows" if not rows else f"{problems[0][1]} in {problems[0][0]}")
                         + f" ({len(problems)} bad rows of {len(rows)})")
    return RouteTable(rows, str(data.get("source", path)))
