"""On Hopper (sm_90), which calls this library serves and which it leaves to the engine's own
FlashMLA: a measured policy, and the measurements it is read from.

The engines call FlashMLA's SM90 sparse decode with the query heads padded to 64 or 128 (its
only head counts: vLLM 0.34.0 ``vllm/v1/attention/backends/mla/flashmla_sparse.py`` l. 1347,
``vllm/models/deepseek_v4/nvidia/flashmla.py`` l. 74-81). This library computes the real heads only; FlashMLA's ``wgmma`` kernel is
faster where many real heads meet many tokens.
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


# The measured rows: ``python -m dispatch.tools.sm90_route_table`` (device, date and kernel sources in
# ``EVIDENCE_SOURCE``); replace both together when re-measured.
# (family, heads, tokens, entries, library us, FlashMLA us)
EVIDENCE_SOURCE = "NVIDIA H100 80GB HBM3, 2026-12-06, dsv4-sparse-mla 0.1.0, kernel sources 7043a2ebf286"
EVIDENCE: tuple[RouteRow, ...] = tuple(RouteRow(*r) for r in (
    ("model1", 8, 1, 128, 9.89, 16.06),
    ("model1", 8, 2, 128, 9.86, 16.38),
    ("model1", 8, 4, 128, 10.5, 16.74),
    ("model1", 8, 8, 128, 10.5, 16.74),
    ("model1", 8, 16, 128, 10.94, 17.41),
    ("model1", 8, 32, 128, 12.13, 17.63),
    ("model1", 8, 64, 128, 12.54, 19.01),
    ("model1", 8, 128, 128, 14.69, 23.14),
    ("model1", 8, 256, 128, 21.31, 39.62),
    ("model1", 16, 1, 128, 10.56, 16.19),
    ("model1", 16, 2, 128, 10.53, 16.22),
    ("model1", 16, 4, 128, 10.94, 16.58),
    ("model1", 16, 8, 128, 11.01, 16.74),
    ("model1", 16, 16, 128, 11.87, 17.44),
    ("model1", 16, 32, 128, 13.47, 17.66),
    ("model1", 16, 64, 128, 13.09, 19.01),
    ("model1", 16, 128, 128, 15.52, 23.1),
    ("model1", 16, 256, 128, 23.2, 39.49),
    ("model1", 32, 1, 128, 10.72, 16.38),
    ("model1", 32, 2, 128, 10.53, 16.38),
    ("model1", 32, 4, 128, 11.2, 16.74),
    ("model1", 32, 8, 128, 11.78, 16.86),
    ("model1", 32, 16, 128, 12.83, 17.47),
    ("model1", 32, 32, 128, 12.54, 17.86),
    ("model1", 32, 64, 128, 13.47, 19.04),
    ("model1", 32, 128, 128, 18.18, 23.07),
    ("model1", 32, 256, 128, 27.2, 39.46),
    ("model1", 64, 1, 128, 10.59, 16.1),
    ("model1", 64, 2, 128, 10.46, 16.26),
    ("model1", 64, 4, 128, 10.98, 16.61),
    ("model1", 64, 8, 128, 12.42, 16.7),
    ("model1", 64, 16, 128, 12.29, 17.28),
    ("model1", 64, 32, 128, 12.83, 17.63),
    ("model1", 64, 64, 128, 17.15, 18.91),
    ("model1", 64, 128, 128, 24.13, 22.94),
    ("model1", 64, 256, 128, 41.98, 39.55),
    ("model1", 128, 1, 128, 10.46, 15.39),
    ("model1", 128, 2, 128, 10.98, 15.1),
    ("model1", 128, 4, 128, 12.32, 15.3),
    ("model1", 128, 8, 128, 11.74, 15.9),
    ("model1", 128, 16, 128, 12.7, 14.94),
    ("model1", 128, 32, 128, 17.12, 16.29),
    ("model1", 128, 64, 128, 23.9, 19.81),
    ("model1", 128, 128, 128, 42.46, 32.45),
    ("model1", 128, 256, 128, 74.91, 57.92),
    ("model1", 8, 1, 640, 10.98, 18.02),
    ("model1", 8, 2, 640, 11.01, 18.05),
    ("model1", 8, 4, 640, 11.94, 18.37),
    ("model1", 8, 8, 640, 12.9, 20.32),
    ("model1", 8, 16, 640, 14.43, 23.65),
    ("model1", 8, 32, 640, 17.76, 32.19),
    ("model1", 8, 64, 640, 26.69, 52.35),
    ("model1", 8, 128, 640, 38.98, 55.26),
    ("model1", 8, 256, 640, 53.7, 98.14),
    ("model1", 16, 1, 640, 11.26, 18.02),
    ("model1", 16, 2, 640, 11.52, 17.92),
    ("model1", 16, 4, 640, 12.16, 18.4),
    ("model1", 16, 8, 640, 13.41, 20.48),
    ("model1", 16, 16, 640, 15.17, 23.68),
    ("model1", 16, 32, 640, 18.69, 32.45),
    ("model1", 16, 64, 640, 28.35, 52.32),
    ("model1", 16, 128, 640, 41.57, 55.26),
    ("model1", 16, 256, 640, 54.72, 98.21),
    ("model1", 32, 1, 640, 11.49, 17.86),
    ("model1", 32, 2, 640, 11.65, 17.95),
    ("model1", 32, 4, 640, 12.72, 18.24),
    ("model1", 32, 8, 640, 14.14, 20.29),
    ("model1", 32, 16, 640, 16.38, 23.65),
    ("model1", 32, 32, 640, 21.95, 32.22),
    ("model1", 32, 64, 640, 34.59, 52.64),
    ("model1", 32, 128, 640, 45.02, 55.68),
    ("model1", 32, 256, 640, 65.42, 98.14),
    ("model1", 64, 1, 640, 11.94, 17.82),
    ("model1", 64, 2, 640, 12.51, 18.02),
    ("model1", 64, 4, 640, 13.76, 18.43),
    ("model1", 64, 8, 640, 15.97, 20.34),
    ("model1", 64, 16, 640, 20.42, 23.81),
    ("model1", 64, 32, 640, 29.38, 32.38),
    ("model1", 64, 64, 640, 39.42, 52.7),
    ("model1", 64, 128, 640, 61.15, 55.58),
    ("model1", 64, 256, 640, 113.18, 98.43),
    ("model1", 128, 1, 640, 12.26, 17.25),
    ("model1", 128, 2, 640, 13.41, 17.28),
    ("model1", 128, 4, 640, 15.71, 19.2),
    ("model1", 128, 8, 640, 20.1, 21.18),
    ("model1", 128, 16, 640, 29.09, 26.88),
    ("model1", 128, 32, 640, 39.14, 41.18),
    ("model1", 128, 64, 640, 59.84, 41.66),
    ("model1", 128, 128, 640, 112.8, 73.38),
    ("model1", 128, 256, 640, 215.52, 136.0),
    ("model1", 8, 1, 1152, 11.81, 19.71),
    ("model1", 8, 2, 1152, 12.1, 19.9),
    ("model1", 8, 4, 1152, 12.77, 21.38),
    ("model1", 8, 8, 1152, 14.24, 23.52),
    ("model1", 8, 16, 1152, 17.57, 29.31),
    ("model1", 8, 32, 1152, 25.41, 42.02),
    ("model1", 8, 64, 1152, 37.09, 68.58),
    ("model1", 8, 128, 1152, 52.74, 82.11),
    ("model1", 8, 256, 1152, 79.07, 150.85),
    ("model1", 16, 1, 1152, 11.97, 19.33),
    ("model1", 16, 2, 1152, 12.77, 19.87),
    ("model1", 16, 4, 1152, 13.54, 21.28),
    ("model1", 16, 8, 1152, 14.75, 23.58),
    ("model1", 16, 16, 1152, 18.18, 29.31),
    ("model1", 16, 32, 1152, 26.86, 41.98),
    ("model1", 16, 64, 1152, 38.37, 68.38),
    ("model1", 16, 128, 1152, 55.65, 82.14),
    ("model1", 16, 256, 1152, 80.48, 150.88),
    ("model1", 32, 1, 1152, 12.26, 19.68),
    ("model1", 32, 2, 1152, 12.61, 19.94),
    ("model1", 32, 4, 1152, 14.18, 21.28),
    ("model1", 32, 8, 1152, 16.06, 23.39),
    ("model1", 32, 16, 1152, 20.93, 29.38),
    ("model1", 32, 32, 1152, 30.5, 41.95),
    ("model1", 32, 64, 1152, 43.84, 68.77),
    ("model1", 32, 128, 1152, 66.98, 82.69),
    ("model1", 32, 256, 1152, 101.57, 151.14),
    ("model1", 64, 1, 1152, 12.48, 19.46),
    ("model1", 64, 2, 1152, 14.05, 19.97),
    ("model1", 64, 4, 1152, 15.65, 21.31),
    ("model1", 64, 8, 1152, 19.68, 23.42),
    ("model1", 64, 16, 1152, 26.14, 29.38),
    ("model1", 64, 32, 1152, 38.98, 41.7),
    ("model1", 64, 64, 1152, 61.82, 68.8),
    ("model1", 64, 128, 1152, 97.79, 82.88),
    ("model1", 64, 256, 1152, 185.5, 151.07),
    ("model1", 128, 1, 1152, 13.89, 19.2),
    ("model1", 128, 2, 1152, 15.58, 20.48),
    ("model1", 128, 4, 1152, 19.52, 21.15),
    ("model1", 128, 8, 1152, 26.02, 25.25),
    ("model1", 128, 16, 1152, 38.75, 33.28),
    ("model1", 128, 32, 1152, 61.41, 53.41),
    ("model1", 128, 64, 1152, 96.86, 62.05),
    ("model1", 128, 128, 1152, 184.38, 112.32),
    ("model1", 128, 256, 1152, 357.09, 213.06),
    ("model1", 8, 1, 8320, 10.98, 17.82),
    ("model1", 8, 2, 8320, 11.23, 18.24),
    ("model1", 8, 4, 8320, 12.38, 18.4),
    ("model1", 8, 8, 8320, 14.08, 20.32),
    ("model1", 8, 16, 8320, 16.19, 23.71),
    ("model1", 8, 32, 8320, 19.78, 32.45),
    ("model1", 8, 64, 8320, 27.23, 52.99),
    ("model1", 8, 128, 8320, 40.32, 56.64),
    ("model1", 8, 256, 8320, 56.22, 101.31),
    ("model1", 16, 1, 8320, 11.23, 18.05),
    ("model1", 16, 2, 8320, 11.81, 17.98),
    ("model1", 16, 4, 8320, 13.06, 18.45),
    ("model1", 16, 8, 8320, 16.67, 20.38),
    ("model1", 16, 16, 8320, 17.63, 23.74),
    ("model1", 16, 32, 8320, 21.09, 32.42),
    ("model1", 16, 64, 8320, 28.83, 52.96),
    ("model1", 16, 128, 8320, 42.88, 56.54),
    ("model1", 16, 256, 8320, 57.02, 100.74),
    ("model1", 32, 1, 8320, 11.46, 17.98),
    ("model1", 32, 2, 8320, 12.42, 17.92),
    ("model1", 32, 4, 8320, 15.04, 18.34),
    ("model1", 32, 8, 8320, 19.94, 20.64),
    ("model1", 32, 16, 8320, 24.06, 23.9),
    ("model1", 32, 32, 8320, 25.5, 32.35),
    ("model1", 32, 64, 8320, 34.24, 52.99),
    ("model1", 32, 128, 8320, 49.5, 56.74),
    ("model1", 32, 256, 8320, 66.34, 101.22),
    ("model1", 64, 1, 8320, 12.0, 17.89),
    ("model1", 64, 2, 8320, 14.05, 17.86),
    ("model1", 64, 4, 8320, 19.87, 18.3),
    ("model1", 64, 8, 8320, 23.52, 20.51),
    ("model1", 64, 16, 8320, 24.45, 23.84),
    ("model1", 64, 32, 8320, 30.34, 32.45),
    ("model1", 64, 64, 8320, 44.22, 53.18),
    ("model1", 64, 128, 8320, 61.38, 56.96),
    ("model1", 64, 256, 8320, 113.57, 101.44),
    ("model1", 128, 1, 8320, 13.95, 17.34),
    ("model1", 128, 2, 8320, 19.81, 17.5),
    ("model1", 128, 4, 8320, 23.23, 19.52),
    ("model1", 128, 8, 8320, 24.22, 21.22),
    ("model1", 128, 16, 8320, 29.98, 26.9),
    ("model1", 128, 32, 8320, 43.42, 41.25),
    ("model1", 128, 64, 8320, 59.74, 42.11),
    ("model1", 128, 128, 8320, 112.32, 74.11),
    ("model1", 128, 256, 8320, 214.53, 137.28),
    ("v32", 8, 1, 2048, 12.26, 22.4),
    ("v32", 8, 2, 2048, 12.8, 23.68),
    ("v32", 8, 4, 2048, 14.78, 23.55),
    ("v32", 8, 8, 2048, 17.41, 27.1),
    ("v32", 8, 16, 2048, 24.7, 38.18),
    ("v32", 8, 32, 2048, 37.89, 56.16),
    ("v32", 8, 64, 2048, 56.38, 83.2),
    ("v32", 8, 128, 2048, 89.55, 122.34),
    ("v32", 8, 256, 2048, 162.69, 231.62),
    ("v32", 16, 1, 2048, 12.86, 22.27),
    ("v32", 16, 2, 2048, 13.47, 23.42),
    ("v32", 16, 4, 2048, 15.55, 23.42),
    ("v32", 16, 8, 2048, 18.11, 27.17),
    ("v32", 16, 16, 2048, 25.57, 38.06),
    ("v32", 16, 32, 2048, 38.82, 56.42),
    ("v32", 16, 64, 2048, 57.22, 83.14),
    ("v32", 16, 128, 2048, 90.27, 122.88),
    ("v32", 16, 256, 2048, 163.68, 231.74),
    ("v32", 32, 1, 2048, 13.15, 22.34),
    ("v32", 32, 2, 2048, 14.5, 23.49),
    ("v32", 32, 4, 2048, 16.29, 23.42),
    ("v32", 32, 8, 2048, 20.51, 27.39),
    ("v32", 32, 16, 2048, 30.08, 38.08),
    ("v32", 32, 32, 2048, 49.22, 56.38),
    ("v32", 32, 64, 2048, 81.44, 83.3),
    ("v32", 32, 128, 2048, 139.28, 122.85),
    ("v32", 32, 256, 2048, 268.74, 231.81),
    ("v32", 64, 1, 2048, 14.3, 22.18),
    ("v32", 64, 2, 2048, 15.84, 23.46),
    ("v32", 64, 4, 2048, 20.03, 23.36),
    ("v32", 64, 8, 2048, 28.48, 27.17),
    ("v32", 64, 16, 2048, 44.83, 38.08),
    ("v32", 64, 32, 2048, 77.47, 56.22),
    ("v32", 64, 64, 2048, 134.58, 83.23),
    ("v32", 64, 128, 2048, 263.01, 122.27),
    ("v32", 64, 256, 2048, 516.67, 230.88),
    ("v32", 128, 1, 2048, 16.0, 22.46),
    ("v32", 128, 2, 2048, 20.03, 21.76),
    ("v32", 128, 4, 2048, 29.02, 24.22),
    ("v32", 128, 8, 2048, 44.48, 32.13),
    ("v32", 128, 16, 2048, 76.54, 45.98),
    ("v32", 128, 32, 2048, 134.3, 68.48),
    ("v32", 128, 64, 2048, 260.74, 101.92),
    ("v32", 128, 128, 2048, 513.81, 189.89),
    ("v32", 128, 256, 2048, 1012.27, 368.35),
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
