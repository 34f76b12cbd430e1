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
EVIDENCE_SOURCE = "NVIDIA H200, 2026-12-06, dsv4-sparse-mla 0.1.0, kernel sources 8711115de773"
EVIDENCE: tuple[RouteRow, ...] = tuple(RouteRow(*r) for r in (
    ("model1", 8, 1, 128, 9.15, 15.68),
    ("model1", 8, 2, 128, 9.31, 16.13),
    ("model1", 8, 4, 128, 9.92, 16.67),
    ("model1", 8, 8, 128, 10.14, 16.38),
    ("model1", 8, 16, 128, 10.37, 17.09),
    ("model1", 8, 32, 128, 11.14, 17.34),
    ("model1", 8, 64, 128, 11.74, 18.34),
    ("model1", 8, 128, 128, 12.96, 20.9),
    ("model1", 8, 256, 128, 17.66, 35.39),
    ("model1", 16, 1, 128, 9.81, 15.58),
    ("model1", 16, 2, 128, 10.05, 16.19),
    ("model1", 16, 4, 128, 9.95, 16.16),
    ("model1", 16, 8, 128, 10.3, 16.42),
    ("model1", 16, 16, 128, 10.85, 16.96),
    ("model1", 16, 32, 128, 12.29, 17.25),
    ("model1", 16, 64, 128, 12.03, 18.24),
    ("model1", 16, 128, 128, 13.47, 20.9),
    ("model1", 16, 256, 128, 18.75, 35.65),
    ("model1", 32, 1, 128, 10.21, 15.94),
    ("model1", 32, 2, 128, 9.95, 16.06),
    ("model1", 32, 4, 128, 10.24, 16.29),
    ("model1", 32, 8, 128, 10.37, 16.38),
    ("model1", 32, 16, 128, 11.71, 17.06),
    ("model1", 32, 32, 128, 11.68, 17.31),
    ("model1", 32, 64, 128, 12.67, 18.46),
    ("model1", 32, 128, 128, 17.06, 21.18),
    ("model1", 32, 256, 128, 24.35, 35.65),
    ("model1", 64, 1, 128, 10.3, 15.9),
    ("model1", 64, 2, 128, 10.11, 16.06),
    ("model1", 64, 4, 128, 10.5, 16.03),
    ("model1", 64, 8, 128, 11.39, 16.77),
    ("model1", 64, 16, 128, 11.33, 17.02),
    ("model1", 64, 32, 128, 12.19, 17.15),
    ("model1", 64, 64, 128, 16.06, 18.53),
    ("model1", 64, 128, 128, 23.39, 21.12),
    ("model1", 64, 256, 128, 40.51, 35.55),
    ("model1", 128, 1, 128, 10.27, 14.66),
    ("model1", 128, 2, 128, 10.14, 14.72),
    ("model1", 128, 4, 128, 11.62, 15.49),
    ("model1", 128, 8, 128, 11.3, 16.0),
    ("model1", 128, 16, 128, 12.22, 14.75),
    ("model1", 128, 32, 128, 16.0, 15.81),
    ("model1", 128, 64, 128, 23.2, 18.24),
    ("model1", 128, 128, 128, 40.35, 29.31),
    ("model1", 128, 256, 128, 72.0, 51.71),
    ("model1", 8, 1, 640, 10.27, 17.28),
    ("model1", 8, 2, 640, 10.91, 17.7),
    ("model1", 8, 4, 640, 11.01, 18.62),
    ("model1", 8, 8, 640, 12.19, 19.78),
    ("model1", 8, 16, 640, 13.47, 22.75),
    ("model1", 8, 32, 640, 16.06, 30.72),
    ("model1", 8, 64, 640, 21.98, 48.86),
    ("model1", 8, 128, 640, 32.03, 51.9),
    ("model1", 8, 256, 640, 44.51, 93.31),
    ("model1", 16, 1, 640, 10.53, 17.54),
    ("model1", 16, 2, 640, 10.82, 17.7),
    ("model1", 16, 4, 640, 11.2, 18.46),
    ("model1", 16, 8, 640, 12.45, 19.65),
    ("model1", 16, 16, 640, 14.05, 22.82),
    ("model1", 16, 32, 640, 16.8, 30.85),
    ("model1", 16, 64, 640, 23.52, 49.14),
    ("model1", 16, 128, 640, 34.75, 52.16),
    ("model1", 16, 256, 640, 46.05, 93.18),
    ("model1", 32, 1, 640, 10.62, 17.38),
    ("model1", 32, 2, 640, 11.07, 17.76),
    ("model1", 32, 4, 640, 12.0, 18.46),
    ("model1", 32, 8, 640, 13.34, 19.78),
    ("model1", 32, 16, 640, 15.74, 22.85),
    ("model1", 32, 32, 640, 20.61, 30.82),
    ("model1", 32, 64, 640, 29.41, 49.12),
    ("model1", 32, 128, 640, 40.42, 52.22),
    ("model1", 32, 256, 640, 62.18, 93.22),
    ("model1", 64, 1, 640, 11.2, 17.7),
    ("model1", 64, 2, 640, 12.0, 17.76),
    ("model1", 64, 4, 640, 13.09, 18.5),
    ("model1", 64, 8, 640, 15.3, 19.68),
    ("model1", 64, 16, 640, 19.58, 23.07),
    ("model1", 64, 32, 640, 28.61, 30.88),
    ("model1", 64, 64, 640, 39.42, 49.09),
    ("model1", 64, 128, 640, 60.77, 52.19),
    ("model1", 64, 256, 640, 111.78, 93.12),
    ("model1", 128, 1, 640, 11.97, 16.9),
    ("model1", 128, 2, 640, 12.86, 17.57),
    ("model1", 128, 4, 640, 15.3, 18.82),
    ("model1", 128, 8, 640, 19.39, 20.64),
    ("model1", 128, 16, 640, 28.51, 26.02),
    ("model1", 128, 32, 640, 39.23, 38.53),
    ("model1", 128, 64, 640, 59.78, 39.2),
    ("model1", 128, 128, 640, 111.94, 70.08),
    ("model1", 128, 256, 640, 214.27, 130.34),
    ("model1", 8, 1, 1152, 11.46, 19.49),
    ("model1", 8, 2, 1152, 11.71, 20.03),
    ("model1", 8, 4, 1152, 12.03, 20.8),
    ("model1", 8, 8, 1152, 13.54, 22.85),
    ("model1", 8, 16, 1152, 15.71, 27.55),
    ("model1", 8, 32, 1152, 21.12, 39.68),
    ("model1", 8, 64, 1152, 30.21, 64.64),
    ("model1", 8, 128, 1152, 43.94, 79.3),
    ("model1", 8, 256, 1152, 67.23, 145.82),
    ("model1", 16, 1, 1152, 11.68, 19.68),
    ("model1", 16, 2, 1152, 12.03, 20.06),
    ("model1", 16, 4, 1152, 12.45, 20.83),
    ("model1", 16, 8, 1152, 13.73, 22.83),
    ("model1", 16, 16, 1152, 16.32, 27.62),
    ("model1", 16, 32, 1152, 22.3, 39.78),
    ("model1", 16, 64, 1152, 31.58, 64.67),
    ("model1", 16, 128, 1152, 46.66, 79.17),
    ("model1", 16, 256, 1152, 68.67, 145.86),
    ("model1", 32, 1, 1152, 11.3, 19.07),
    ("model1", 32, 2, 1152, 11.74, 19.84),
    ("model1", 32, 4, 1152, 13.06, 20.8),
    ("model1", 32, 8, 1152, 15.44, 22.82),
    ("model1", 32, 16, 1152, 19.36, 27.84),
    ("model1", 32, 32, 1152, 26.3, 39.78),
    ("model1", 32, 64, 1152, 39.87, 64.98),
    ("model1", 32, 128, 1152, 63.2, 79.26),
    ("model1", 32, 256, 1152, 98.5, 145.95),
    ("model1", 64, 1, 1152, 11.68, 19.14),
    ("model1", 64, 2, 1152, 12.83, 19.9),
    ("model1", 64, 4, 1152, 15.26, 21.31),
    ("model1", 64, 8, 1152, 19.01, 22.78),
    ("model1", 64, 16, 1152, 25.15, 27.65),
    ("model1", 64, 32, 1152, 38.05, 39.49),
    ("model1", 64, 64, 1152, 61.38, 65.02),
    ("model1", 64, 128, 1152, 96.42, 79.39),
    ("model1", 64, 256, 1152, 184.58, 145.76),
    ("model1", 128, 1, 1152, 13.25, 19.33),
    ("model1", 128, 2, 1152, 14.94, 19.74),
    ("model1", 128, 4, 1152, 18.69, 20.7),
    ("model1", 128, 8, 1152, 25.18, 24.42),
    ("model1", 128, 16, 1152, 38.18, 32.45),
    ("model1", 128, 32, 1152, 61.6, 50.34),
    ("model1", 128, 64, 1152, 95.74, 59.65),
    ("model1", 128, 128, 1152, 183.14, 108.99),
    ("model1", 128, 256, 1152, 357.28, 208.32),
    ("model1", 8, 1, 8320, 10.72, 17.5),
    ("model1", 8, 2, 8320, 10.82, 17.79),
    ("model1", 8, 4, 8320, 11.39, 18.46),
    ("model1", 8, 8, 8320, 12.45, 19.81),
    ("model1", 8, 16, 8320, 13.98, 22.85),
    ("model1", 8, 32, 8320, 17.5, 30.88),
    ("model1", 8, 64, 8320, 22.85, 49.86),
    ("model1", 8, 128, 8320, 33.38, 53.46),
    ("model1", 8, 256, 8320, 46.11, 95.9),
    ("model1", 16, 1, 8320, 11.1, 17.47),
    ("model1", 16, 2, 8320, 10.94, 18.08),
    ("model1", 16, 4, 8320, 11.97, 18.66),
    ("model1", 16, 8, 8320, 12.93, 19.81),
    ("model1", 16, 16, 8320, 14.5, 23.14),
    ("model1", 16, 32, 8320, 18.88, 30.94),
    ("model1", 16, 64, 8320, 24.42, 49.6),
    ("model1", 16, 128, 8320, 35.9, 53.31),
    ("model1", 16, 256, 8320, 47.46, 95.49),
    ("model1", 32, 1, 8320, 10.78, 17.44),
    ("model1", 32, 2, 8320, 11.46, 18.24),
    ("model1", 32, 4, 8320, 12.58, 18.78),
    ("model1", 32, 8, 8320, 16.1, 19.74),
    ("model1", 32, 16, 8320, 17.54, 22.88),
    ("model1", 32, 32, 8320, 23.81, 30.82),
    ("model1", 32, 64, 8320, 30.66, 49.7),
    ("model1", 32, 128, 8320, 45.28, 53.54),
    ("model1", 32, 256, 8320, 62.88, 95.84),
    ("model1", 64, 1, 8320, 11.49, 17.7),
    ("model1", 64, 2, 8320, 12.35, 18.14),
    ("model1", 64, 4, 8320, 15.52, 18.78),
    ("model1", 64, 8, 8320, 17.12, 19.74),
    ("model1", 64, 16, 8320, 22.88, 22.91),
    ("model1", 64, 32, 8320, 29.41, 30.85),
    ("model1", 64, 64, 8320, 43.39, 49.54),
    ("model1", 64, 128, 8320, 60.42, 53.31),
    ("model1", 64, 256, 8320, 112.22, 96.0),
    ("model1", 128, 1, 8320, 12.22, 17.12),
    ("model1", 128, 2, 8320, 15.33, 17.7),
    ("model1", 128, 4, 8320, 17.25, 19.1),
    ("model1", 128, 8, 8320, 23.07, 20.83),
    ("model1", 128, 16, 8320, 29.57, 26.05),
    ("model1", 128, 32, 8320, 43.52, 38.78),
    ("model1", 128, 64, 8320, 59.62, 39.52),
    ("model1", 128, 128, 8320, 111.26, 70.69),
    ("model1", 128, 256, 8320, 214.08, 131.65),
    ("v32", 8, 1, 2048, 11.39, 22.18),
    ("v32", 8, 2, 2048, 11.94, 23.17),
    ("v32", 8, 4, 2048, 13.92, 23.14),
    ("v32", 8, 8, 2048, 16.06, 26.46),
    ("v32", 8, 16, 2048, 21.22, 35.33),
    ("v32", 8, 32, 2048, 31.87, 52.06),
    ("v32", 8, 64, 2048, 49.31, 79.55),
    ("v32", 8, 128, 2048, 82.14, 118.91),
    ("v32", 8, 256, 2048, 154.37, 224.11),
    ("v32", 16, 1, 2048, 11.94, 22.34),
    ("v32", 16, 2, 2048, 12.58, 23.14),
    ("v32", 16, 4, 2048, 14.34, 22.85),
    ("v32", 16, 8, 2048, 16.54, 26.3),
    ("v32", 16, 16, 2048, 21.98, 35.26),
    ("v32", 16, 32, 2048, 32.42, 51.74),
    ("v32", 16, 64, 2048, 49.92, 79.58),
    ("v32", 16, 128, 2048, 82.43, 118.46),
    ("v32", 16, 256, 2048, 154.51, 224.29),
    ("v32", 32, 1, 2048, 12.1, 22.34),
    ("v32", 32, 2, 2048, 13.92, 23.04),
    ("v32", 32, 4, 2048, 15.68, 22.98),
    ("v32", 32, 8, 2048, 20.0, 26.37),
    ("v32", 32, 16, 2048, 28.77, 35.33),
    ("v32", 32, 32, 2048, 46.18, 52.06),
    ("v32", 32, 64, 2048, 79.39, 79.87),
    ("v32", 32, 128, 2048, 138.46, 119.23),
    ("v32", 32, 256, 2048, 265.73, 224.48),
    ("v32", 64, 1, 2048, 13.79, 22.24),
    ("v32", 64, 2, 2048, 15.68, 23.1),
    ("v32", 64, 4, 2048, 19.87, 23.04),
    ("v32", 64, 8, 2048, 28.26, 26.56),
    ("v32", 64, 16, 2048, 44.29, 35.42),
    ("v32", 64, 32, 2048, 77.5, 52.0),
    ("v32", 64, 64, 2048, 136.45, 79.74),
    ("v32", 64, 128, 2048, 264.42, 119.17),
    ("v32", 64, 256, 2048, 518.78, 225.5),
    ("v32", 128, 1, 2048, 15.81, 21.92),
    ("v32", 128, 2, 2048, 19.9, 21.31),
    ("v32", 128, 4, 2048, 28.51, 23.94),
    ("v32", 128, 8, 2048, 44.22, 30.98),
    ("v32", 128, 16, 2048, 77.2, 43.97),
    ("v32", 128, 32, 2048, 135.87, 67.42),
    ("v32", 128, 64, 2048, 262.94, 99.87),
    ("v32", 128, 128, 2048, 516.7, 189.18),
    ("v32", 128, 256, 2048, 1023.9, 367.17),
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
