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
EVIDENCE_SOURCE = "NVIDIA H100 80GB HBM3, 2026-12-06, dsv4-sparse-mla 0.1.0, kernel sources 7c8308e39432"
EVIDENCE: tuple[RouteRow, ...] = tuple(RouteRow(*r) for r in (
    ("model1", 8, 1, 128, 9.89, 15.9),
    ("model1", 8, 2, 128, 10.08, 16.16),
    ("model1", 8, 4, 128, 10.5, 16.42),
    ("model1", 8, 8, 128, 10.46, 16.9),
    ("model1", 8, 16, 128, 10.88, 17.5),
    ("model1", 8, 32, 128, 12.0, 17.98),
    ("model1", 8, 64, 128, 12.58, 19.01),
    ("model1", 8, 128, 128, 14.59, 23.01),
    ("model1", 8, 256, 128, 21.25, 39.62),
    ("model1", 16, 1, 128, 10.5, 16.03),
    ("model1", 16, 2, 128, 10.66, 16.1),
    ("model1", 16, 4, 128, 10.56, 16.38),
    ("model1", 16, 8, 128, 10.88, 16.61),
    ("model1", 16, 16, 128, 11.71, 17.5),
    ("model1", 16, 32, 128, 13.22, 17.63),
    ("model1", 16, 64, 128, 12.86, 18.85),
    ("model1", 16, 128, 128, 15.3, 22.91),
    ("model1", 16, 256, 128, 22.98, 39.52),
    ("model1", 32, 1, 128, 10.59, 16.13),
    ("model1", 32, 2, 128, 10.5, 16.06),
    ("model1", 32, 4, 128, 11.1, 16.29),
    ("model1", 32, 8, 128, 11.36, 16.67),
    ("model1", 32, 16, 128, 13.02, 17.92),
    ("model1", 32, 32, 128, 12.35, 17.73),
    ("model1", 32, 64, 128, 13.34, 18.91),
    ("model1", 32, 128, 128, 18.14, 23.04),
    ("model1", 32, 256, 128, 27.1, 39.52),
    ("model1", 64, 1, 128, 10.62, 16.1),
    ("model1", 64, 2, 128, 10.4, 15.94),
    ("model1", 64, 4, 128, 10.91, 16.29),
    ("model1", 64, 8, 128, 12.58, 16.67),
    ("model1", 64, 16, 128, 11.97, 17.6),
    ("model1", 64, 32, 128, 12.93, 17.57),
    ("model1", 64, 64, 128, 16.93, 18.75),
    ("model1", 64, 128, 128, 24.03, 22.82),
    ("model1", 64, 256, 128, 41.89, 39.55),
    ("model1", 128, 1, 128, 10.69, 14.91),
    ("model1", 128, 2, 128, 11.39, 15.36),
    ("model1", 128, 4, 128, 12.29, 15.3),
    ("model1", 128, 8, 128, 12.1, 16.37),
    ("model1", 128, 16, 128, 12.77, 15.07),
    ("model1", 128, 32, 128, 17.09, 16.38),
    ("model1", 128, 64, 128, 23.9, 19.78),
    ("model1", 128, 128, 128, 42.5, 32.61),
    ("model1", 128, 256, 128, 74.69, 57.76),
    ("model1", 8, 1, 640, 11.14, 18.08),
    ("model1", 8, 2, 640, 11.1, 18.27),
    ("model1", 8, 4, 640, 12.03, 19.17),
    ("model1", 8, 8, 640, 12.99, 20.8),
    ("model1", 8, 16, 640, 14.98, 24.22),
    ("model1", 8, 32, 640, 17.89, 32.51),
    ("model1", 8, 64, 640, 26.56, 52.19),
    ("model1", 8, 128, 640, 39.2, 55.42),
    ("model1", 8, 256, 640, 53.7, 98.37),
    ("model1", 16, 1, 640, 11.26, 17.89),
    ("model1", 16, 2, 640, 11.58, 17.98),
    ("model1", 16, 4, 640, 12.42, 19.33),
    ("model1", 16, 8, 640, 13.38, 20.77),
    ("model1", 16, 16, 640, 15.62, 24.16),
    ("model1", 16, 32, 640, 18.66, 32.64),
    ("model1", 16, 64, 640, 28.45, 52.13),
    ("model1", 16, 128, 640, 41.47, 55.47),
    ("model1", 16, 256, 640, 54.72, 98.46),
    ("model1", 32, 1, 640, 11.14, 17.76),
    ("model1", 32, 2, 640, 11.74, 17.89),
    ("model1", 32, 4, 640, 12.86, 19.2),
    ("model1", 32, 8, 640, 14.11, 20.67),
    ("model1", 32, 16, 640, 16.42, 24.22),
    ("model1", 32, 32, 640, 21.98, 32.54),
    ("model1", 32, 64, 640, 34.56, 52.26),
    ("model1", 32, 128, 640, 45.31, 55.9),
    ("model1", 32, 256, 640, 65.42, 98.37),
    ("model1", 64, 1, 640, 11.58, 17.73),
    ("model1", 64, 2, 640, 12.54, 17.98),
    ("model1", 64, 4, 640, 13.6, 18.94),
    ("model1", 64, 8, 640, 15.9, 20.54),
    ("model1", 64, 16, 640, 20.29, 24.06),
    ("model1", 64, 32, 640, 29.22, 32.35),
    ("model1", 64, 64, 640, 39.46, 52.42),
    ("model1", 64, 128, 640, 60.93, 56.03),
    ("model1", 64, 256, 640, 113.12, 98.62),
    ("model1", 128, 1, 640, 12.7, 17.18),
    ("model1", 128, 2, 640, 13.54, 18.02),
    ("model1", 128, 4, 640, 15.87, 19.55),
    ("model1", 128, 8, 640, 20.22, 21.47),
    ("model1", 128, 16, 640, 29.28, 27.2),
    ("model1", 128, 32, 640, 39.33, 40.99),
    ("model1", 128, 64, 640, 60.64, 41.66),
    ("model1", 128, 128, 640, 111.55, 73.34),
    ("model1", 128, 256, 640, 214.14, 135.94),
    ("model1", 8, 1, 1152, 11.52, 19.52),
    ("model1", 8, 2, 1152, 11.97, 20.7),
    ("model1", 8, 4, 1152, 12.8, 21.98),
    ("model1", 8, 8, 1152, 14.14, 23.78),
    ("model1", 8, 16, 1152, 17.44, 28.96),
    ("model1", 8, 32, 1152, 25.31, 41.95),
    ("model1", 8, 64, 1152, 37.02, 68.54),
    ("model1", 8, 128, 1152, 52.8, 82.11),
    ("model1", 8, 256, 1152, 78.59, 150.94),
    ("model1", 16, 1, 1152, 12.06, 19.39),
    ("model1", 16, 2, 1152, 12.42, 20.48),
    ("model1", 16, 4, 1152, 13.28, 21.76),
    ("model1", 16, 8, 1152, 14.72, 24.03),
    ("model1", 16, 16, 1152, 18.27, 29.25),
    ("model1", 16, 32, 1152, 26.69, 41.89),
    ("model1", 16, 64, 1152, 38.56, 68.42),
    ("model1", 16, 128, 1152, 55.68, 82.4),
    ("model1", 16, 256, 1152, 79.68, 151.14),
    ("model1", 32, 1, 1152, 12.45, 19.74),
    ("model1", 32, 2, 1152, 12.7, 20.54),
    ("model1", 32, 4, 1152, 14.27, 21.92),
    ("model1", 32, 8, 1152, 16.1, 24.06),
    ("model1", 32, 16, 1152, 20.83, 29.18),
    ("model1", 32, 32, 1152, 30.3, 41.86),
    ("model1", 32, 64, 1152, 43.52, 68.64),
    ("model1", 32, 128, 1152, 66.42, 82.59),
    ("model1", 32, 256, 1152, 102.78, 151.04),
    ("model1", 64, 1, 1152, 12.42, 19.74),
    ("model1", 64, 2, 1152, 13.73, 20.77),
    ("model1", 64, 4, 1152, 15.68, 21.89),
    ("model1", 64, 8, 1152, 19.58, 23.94),
    ("model1", 64, 16, 1152, 26.08, 29.34),
    ("model1", 64, 32, 1152, 38.94, 41.79),
    ("model1", 64, 64, 1152, 61.98, 68.93),
    ("model1", 64, 128, 1152, 98.08, 82.93),
    ("model1", 64, 256, 1152, 183.9, 150.94),
    ("model1", 128, 1, 1152, 13.7, 19.84),
    ("model1", 128, 2, 1152, 15.49, 20.64),
    ("model1", 128, 4, 1152, 19.52, 21.7),
    ("model1", 128, 8, 1152, 26.11, 25.06),
    ("model1", 128, 16, 1152, 38.69, 33.31),
    ("model1", 128, 32, 1152, 61.47, 53.22),
    ("model1", 128, 64, 1152, 95.81, 62.06),
    ("model1", 128, 128, 1152, 185.38, 112.35),
    ("model1", 128, 256, 1152, 359.58, 213.25),
    ("model1", 8, 1, 8320, 10.94, 18.05),
    ("model1", 8, 2, 8320, 11.26, 18.11),
    ("model1", 8, 4, 8320, 12.32, 19.42),
    ("model1", 8, 8, 8320, 13.34, 20.74),
    ("model1", 8, 16, 8320, 14.91, 24.34),
    ("model1", 8, 32, 8320, 19.81, 32.67),
    ("model1", 8, 64, 8320, 27.42, 52.96),
    ("model1", 8, 128, 8320, 40.29, 56.86),
    ("model1", 8, 256, 8320, 56.22, 101.54),
    ("model1", 16, 1, 8320, 11.58, 17.7),
    ("model1", 16, 2, 8320, 12.26, 18.37),
    ("model1", 16, 4, 8320, 13.12, 19.2),
    ("model1", 16, 8, 8320, 14.02, 20.86),
    ("model1", 16, 16, 8320, 15.55, 24.29),
    ("model1", 16, 32, 8320, 21.12, 32.64),
    ("model1", 16, 64, 8320, 28.93, 53.25),
    ("model1", 16, 128, 8320, 42.85, 56.96),
    ("model1", 16, 256, 8320, 57.12, 101.44),
    ("model1", 32, 1, 8320, 11.78, 17.66),
    ("model1", 32, 2, 8320, 12.48, 18.4),
    ("model1", 32, 4, 8320, 13.09, 19.26),
    ("model1", 32, 8, 8320, 17.15, 20.9),
    ("model1", 32, 16, 8320, 18.98, 24.16),
    ("model1", 32, 32, 8320, 25.5, 32.77),
    ("model1", 32, 64, 8320, 34.02, 52.99),
    ("model1", 32, 128, 8320, 49.34, 56.64),
    ("model1", 32, 256, 8320, 66.08, 101.23),
    ("model1", 64, 1, 8320, 12.26, 17.89),
    ("model1", 64, 2, 8320, 12.77, 18.11),
    ("model1", 64, 4, 8320, 16.77, 19.42),
    ("model1", 64, 8, 8320, 18.66, 20.99),
    ("model1", 64, 16, 8320, 24.42, 24.32),
    ("model1", 64, 32, 8320, 30.4, 32.48),
    ("model1", 64, 64, 8320, 44.58, 52.9),
    ("model1", 64, 128, 8320, 61.44, 57.12),
    ("model1", 64, 256, 8320, 113.22, 101.63),
    ("model1", 128, 1, 8320, 12.85, 17.44),
    ("model1", 128, 2, 8320, 16.29, 18.43),
    ("model1", 128, 4, 8320, 17.86, 19.9),
    ("model1", 128, 8, 8320, 24.51, 21.66),
    ("model1", 128, 16, 8320, 30.24, 27.07),
    ("model1", 128, 32, 8320, 43.84, 41.44),
    ("model1", 128, 64, 8320, 60.22, 42.4),
    ("model1", 128, 128, 8320, 112.13, 74.3),
    ("model1", 128, 256, 8320, 215.26, 137.73),
    ("v32", 8, 1, 2048, 12.26, 22.98),
    ("v32", 8, 2, 2048, 12.96, 24.0),
    ("v32", 8, 4, 2048, 14.98, 23.97),
    ("v32", 8, 8, 2048, 17.38, 27.42),
    ("v32", 8, 16, 2048, 25.44, 38.11),
    ("v32", 8, 32, 2048, 37.89, 56.48),
    ("v32", 8, 64, 2048, 56.62, 83.07),
    ("v32", 8, 128, 2048, 88.96, 122.5),
    ("v32", 8, 256, 2048, 162.11, 232.19),
    ("v32", 16, 1, 2048, 12.99, 23.14),
    ("v32", 16, 2, 2048, 13.57, 24.0),
    ("v32", 16, 4, 2048, 15.68, 23.81),
    ("v32", 16, 8, 2048, 18.37, 27.55),
    ("v32", 16, 16, 2048, 25.54, 38.08),
    ("v32", 16, 32, 2048, 38.82, 56.54),
    ("v32", 16, 64, 2048, 57.28, 83.42),
    ("v32", 16, 128, 2048, 90.21, 123.01),
    ("v32", 16, 256, 2048, 164.06, 231.55),
    ("v32", 32, 1, 2048, 13.22, 22.75),
    ("v32", 32, 2, 2048, 14.56, 24.0),
    ("v32", 32, 4, 2048, 16.38, 23.6),
    ("v32", 32, 8, 2048, 20.61, 27.62),
    ("v32", 32, 16, 2048, 30.37, 38.18),
    ("v32", 32, 32, 2048, 49.34, 56.58),
    ("v32", 32, 64, 2048, 81.41, 82.72),
    ("v32", 32, 128, 2048, 139.81, 123.04),
    ("v32", 32, 256, 2048, 268.67, 231.39),
    ("v32", 64, 1, 2048, 14.43, 22.72),
    ("v32", 64, 2, 2048, 15.97, 24.0),
    ("v32", 64, 4, 2048, 20.1, 23.74),
    ("v32", 64, 8, 2048, 28.51, 27.78),
    ("v32", 64, 16, 2048, 45.06, 38.14),
    ("v32", 64, 32, 2048, 77.57, 56.48),
    ("v32", 64, 64, 2048, 134.77, 82.59),
    ("v32", 64, 128, 2048, 261.89, 123.39),
    ("v32", 64, 256, 2048, 513.79, 229.63),
    ("v32", 128, 1, 2048, 16.22, 22.78),
    ("v32", 128, 2, 2048, 20.16, 22.08),
    ("v32", 128, 4, 2048, 28.99, 24.69),
    ("v32", 128, 8, 2048, 44.58, 32.06),
    ("v32", 128, 16, 2048, 76.99, 46.21),
    ("v32", 128, 32, 2048, 134.37, 68.51),
    ("v32", 128, 64, 2048, 261.66, 100.8),
    ("v32", 128, 128, 2048, 514.14, 192.38),
    ("v32", 128, 256, 2048, 1013.26, 371.46),
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
