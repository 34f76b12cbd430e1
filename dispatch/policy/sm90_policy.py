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
EVIDENCE_SOURCE = "NVIDIA H100 80GB HBM3, 2026-12-06, dsv4-sparse-mla 0.1.0, kernel sources 83aa163a2875"
EVIDENCE: tuple[RouteRow, ...] = tuple(RouteRow(*r) for r in (
    ("model1", 8, 1, 128, 10.05, 16.13),
    ("model1", 8, 2, 128, 10.27, 16.54),
    ("model1", 8, 4, 128, 10.69, 16.93),
    ("model1", 8, 8, 128, 11.01, 16.8),
    ("model1", 8, 16, 128, 11.04, 17.76),
    ("model1", 8, 32, 128, 12.16, 17.76),
    ("model1", 8, 64, 128, 12.64, 19.07),
    ("model1", 8, 128, 128, 14.56, 22.88),
    ("model1", 8, 256, 128, 21.09, 39.36),
    ("model1", 16, 1, 128, 10.62, 16.06),
    ("model1", 16, 2, 128, 10.72, 16.42),
    ("model1", 16, 4, 128, 11.01, 16.64),
    ("model1", 16, 8, 128, 11.3, 16.62),
    ("model1", 16, 16, 128, 11.62, 17.57),
    ("model1", 16, 32, 128, 13.02, 17.7),
    ("model1", 16, 64, 128, 12.96, 18.88),
    ("model1", 16, 128, 128, 15.23, 22.82),
    ("model1", 16, 256, 128, 22.82, 39.26),
    ("model1", 32, 1, 128, 10.56, 16.1),
    ("model1", 32, 2, 128, 10.72, 16.0),
    ("model1", 32, 4, 128, 11.1, 16.61),
    ("model1", 32, 8, 128, 11.62, 16.93),
    ("model1", 32, 16, 128, 12.61, 17.63),
    ("model1", 32, 32, 128, 12.42, 17.73),
    ("model1", 32, 64, 128, 13.47, 18.94),
    ("model1", 32, 128, 128, 18.18, 22.88),
    ("model1", 32, 256, 128, 26.85, 39.17),
    ("model1", 64, 1, 128, 10.34, 16.29),
    ("model1", 64, 2, 128, 10.88, 16.45),
    ("model1", 64, 4, 128, 11.33, 16.7),
    ("model1", 64, 8, 128, 12.32, 16.96),
    ("model1", 64, 16, 128, 12.35, 17.98),
    ("model1", 64, 32, 128, 12.86, 17.7),
    ("model1", 64, 64, 128, 17.02, 18.94),
    ("model1", 64, 128, 128, 24.06, 22.82),
    ("model1", 64, 256, 128, 41.82, 39.2),
    ("model1", 128, 1, 128, 10.82, 15.26),
    ("model1", 128, 2, 128, 11.26, 15.26),
    ("model1", 128, 4, 128, 12.13, 15.58),
    ("model1", 128, 8, 128, 12.06, 16.54),
    ("model1", 128, 16, 128, 12.74, 15.1),
    ("model1", 128, 32, 128, 17.09, 16.38),
    ("model1", 128, 64, 128, 23.84, 19.71),
    ("model1", 128, 128, 128, 42.18, 32.16),
    ("model1", 128, 256, 128, 73.98, 56.77),
    ("model1", 8, 1, 640, 11.07, 18.21),
    ("model1", 8, 2, 640, 11.42, 18.3),
    ("model1", 8, 4, 640, 11.68, 19.07),
    ("model1", 8, 8, 640, 12.93, 20.83),
    ("model1", 8, 16, 640, 14.5, 24.16),
    ("model1", 8, 32, 640, 17.73, 32.32),
    ("model1", 8, 64, 640, 26.21, 52.03),
    ("model1", 8, 128, 640, 39.14, 55.07),
    ("model1", 8, 256, 640, 53.02, 97.22),
    ("model1", 16, 1, 640, 11.39, 17.92),
    ("model1", 16, 2, 640, 11.46, 17.95),
    ("model1", 16, 4, 640, 12.22, 19.17),
    ("model1", 16, 8, 640, 13.63, 20.77),
    ("model1", 16, 16, 640, 15.1, 24.0),
    ("model1", 16, 32, 640, 18.37, 32.48),
    ("model1", 16, 64, 640, 28.61, 51.97),
    ("model1", 16, 128, 640, 41.41, 55.49),
    ("model1", 16, 256, 640, 53.92, 98.18),
    ("model1", 32, 1, 640, 11.3, 17.66),
    ("model1", 32, 2, 640, 11.84, 18.27),
    ("model1", 32, 4, 640, 12.86, 19.26),
    ("model1", 32, 8, 640, 14.24, 20.9),
    ("model1", 32, 16, 640, 16.32, 24.13),
    ("model1", 32, 32, 640, 22.5, 32.38),
    ("model1", 32, 64, 640, 34.98, 52.22),
    ("model1", 32, 128, 640, 44.96, 55.28),
    ("model1", 32, 256, 640, 65.18, 97.41),
    ("model1", 64, 1, 640, 11.71, 17.6),
    ("model1", 64, 2, 640, 12.7, 18.18),
    ("model1", 64, 4, 640, 13.86, 19.23),
    ("model1", 64, 8, 640, 16.06, 20.77),
    ("model1", 64, 16, 640, 20.99, 24.45),
    ("model1", 64, 32, 640, 29.98, 32.48),
    ("model1", 64, 64, 640, 39.58, 52.16),
    ("model1", 64, 128, 640, 60.83, 55.36),
    ("model1", 64, 256, 640, 112.58, 98.18),
    ("model1", 128, 1, 640, 12.61, 17.06),
    ("model1", 128, 2, 640, 13.54, 18.02),
    ("model1", 128, 4, 640, 15.78, 19.62),
    ("model1", 128, 8, 640, 20.86, 21.66),
    ("model1", 128, 16, 640, 29.76, 27.07),
    ("model1", 128, 32, 640, 39.36, 40.9),
    ("model1", 128, 64, 640, 60.16, 41.66),
    ("model1", 128, 128, 640, 111.42, 73.25),
    ("model1", 128, 256, 640, 215.94, 135.87),
    ("model1", 8, 1, 1152, 11.78, 19.97),
    ("model1", 8, 2, 1152, 12.38, 20.58),
    ("model1", 8, 4, 1152, 12.77, 21.95),
    ("model1", 8, 8, 1152, 14.3, 24.03),
    ("model1", 8, 16, 1152, 17.6, 29.25),
    ("model1", 8, 32, 1152, 25.09, 41.98),
    ("model1", 8, 64, 1152, 36.56, 68.22),
    ("model1", 8, 128, 1152, 52.59, 81.89),
    ("model1", 8, 256, 1152, 77.7, 150.75),
    ("model1", 16, 1, 1152, 12.35, 19.52),
    ("model1", 16, 2, 1152, 12.83, 20.7),
    ("model1", 16, 4, 1152, 13.54, 21.92),
    ("model1", 16, 8, 1152, 14.82, 24.16),
    ("model1", 16, 16, 1152, 18.18, 29.25),
    ("model1", 16, 32, 1152, 26.46, 41.95),
    ("model1", 16, 64, 1152, 38.66, 68.3),
    ("model1", 16, 128, 1152, 55.49, 81.82),
    ("model1", 16, 256, 1152, 78.62, 150.85),
    ("model1", 32, 1, 1152, 12.45, 19.74),
    ("model1", 32, 2, 1152, 12.96, 20.74),
    ("model1", 32, 4, 1152, 14.4, 21.92),
    ("model1", 32, 8, 1152, 16.16, 24.06),
    ("model1", 32, 16, 1152, 20.8, 29.38),
    ("model1", 32, 32, 1152, 30.72, 41.86),
    ("model1", 32, 64, 1152, 43.78, 68.42),
    ("model1", 32, 128, 1152, 67.3, 82.53),
    ("model1", 32, 256, 1152, 101.12, 151.17),
    ("model1", 64, 1, 1152, 12.7, 19.81),
    ("model1", 64, 2, 1152, 13.89, 20.8),
    ("model1", 64, 4, 1152, 15.78, 22.02),
    ("model1", 64, 8, 1152, 19.58, 24.1),
    ("model1", 64, 16, 1152, 26.85, 29.31),
    ("model1", 64, 32, 1152, 39.49, 41.86),
    ("model1", 64, 64, 1152, 63.17, 68.86),
    ("model1", 64, 128, 1152, 97.7, 82.82),
    ("model1", 64, 256, 1152, 186.4, 151.04),
    ("model1", 128, 1, 1152, 13.89, 20.1),
    ("model1", 128, 2, 1152, 15.62, 20.8),
    ("model1", 128, 4, 1152, 19.52, 21.92),
    ("model1", 128, 8, 1152, 26.75, 25.25),
    ("model1", 128, 16, 1152, 39.26, 33.25),
    ("model1", 128, 32, 1152, 62.18, 53.57),
    ("model1", 128, 64, 1152, 97.15, 62.14),
    ("model1", 128, 128, 1152, 183.07, 112.51),
    ("model1", 128, 256, 1152, 361.04, 213.79),
    ("model1", 8, 1, 8320, 11.9, 17.79),
    ("model1", 8, 2, 8320, 12.26, 18.46),
    ("model1", 8, 4, 8320, 13.82, 19.23),
    ("model1", 8, 8, 8320, 14.43, 20.54),
    ("model1", 8, 16, 8320, 16.03, 24.16),
    ("model1", 8, 32, 8320, 19.49, 32.58),
    ("model1", 8, 64, 8320, 26.75, 52.58),
    ("model1", 8, 128, 8320, 40.03, 56.19),
    ("model1", 8, 256, 8320, 55.14, 100.13),
    ("model1", 16, 1, 8320, 12.42, 17.44),
    ("model1", 16, 2, 8320, 13.22, 17.95),
    ("model1", 16, 4, 8320, 15.68, 19.14),
    ("model1", 16, 8, 8320, 17.41, 20.67),
    ("model1", 16, 16, 8320, 17.38, 24.1),
    ("model1", 16, 32, 8320, 20.67, 32.61),
    ("model1", 16, 64, 8320, 29.02, 52.58),
    ("model1", 16, 128, 8320, 42.62, 56.1),
    ("model1", 16, 256, 8320, 55.97, 100.61),
    ("model1", 32, 1, 8320, 12.51, 17.44),
    ("model1", 32, 2, 8320, 14.69, 18.21),
    ("model1", 32, 4, 8320, 15.81, 19.1),
    ("model1", 32, 8, 8320, 20.99, 20.83),
    ("model1", 32, 16, 8320, 23.49, 24.06),
    ("model1", 32, 32, 8320, 26.02, 32.67),
    ("model1", 32, 64, 8320, 34.02, 52.7),
    ("model1", 32, 128, 8320, 49.28, 56.1),
    ("model1", 32, 256, 8320, 65.38, 100.7),
    ("model1", 64, 1, 8320, 13.31, 17.7),
    ("model1", 64, 2, 8320, 14.78, 18.21),
    ("model1", 64, 4, 8320, 21.12, 19.17),
    ("model1", 64, 8, 8320, 22.88, 20.99),
    ("model1", 64, 16, 8320, 24.96, 24.19),
    ("model1", 64, 32, 8320, 30.56, 32.22),
    ("model1", 64, 64, 8320, 45.12, 52.54),
    ("model1", 64, 128, 8320, 60.77, 56.42),
    ("model1", 64, 256, 8320, 112.38, 100.77),
    ("model1", 128, 1, 8320, 14.53, 17.09),
    ("model1", 128, 2, 8320, 21.02, 18.24),
    ("model1", 128, 4, 8320, 22.85, 19.68),
    ("model1", 128, 8, 8320, 24.99, 21.41),
    ("model1", 128, 16, 8320, 30.59, 26.82),
    ("model1", 128, 32, 8320, 44.29, 41.12),
    ("model1", 128, 64, 8320, 60.1, 42.02),
    ("model1", 128, 128, 8320, 113.09, 73.92),
    ("model1", 128, 256, 8320, 217.44, 136.99),
    ("v32", 8, 1, 2048, 13.02, 22.53),
    ("v32", 8, 2, 2048, 14.62, 23.9),
    ("v32", 8, 4, 2048, 14.66, 23.65),
    ("v32", 8, 8, 2048, 17.31, 27.42),
    ("v32", 8, 16, 2048, 24.32, 37.76),
    ("v32", 8, 32, 2048, 37.28, 55.78),
    ("v32", 8, 64, 2048, 55.1, 82.4),
    ("v32", 8, 128, 2048, 88.22, 122.56),
    ("v32", 8, 256, 2048, 161.38, 231.71),
    ("v32", 16, 1, 2048, 13.5, 22.62),
    ("v32", 16, 2, 2048, 15.62, 23.9),
    ("v32", 16, 4, 2048, 15.55, 23.55),
    ("v32", 16, 8, 2048, 18.02, 27.62),
    ("v32", 16, 16, 2048, 25.31, 37.86),
    ("v32", 16, 32, 2048, 38.05, 55.9),
    ("v32", 16, 64, 2048, 56.54, 82.32),
    ("v32", 16, 128, 2048, 88.96, 122.69),
    ("v32", 16, 256, 2048, 163.1, 231.46),
    ("v32", 32, 1, 2048, 15.04, 22.62),
    ("v32", 32, 2, 2048, 14.43, 23.84),
    ("v32", 32, 4, 2048, 16.19, 23.42),
    ("v32", 32, 8, 2048, 20.51, 27.46),
    ("v32", 32, 16, 2048, 29.76, 37.63),
    ("v32", 32, 32, 2048, 49.6, 55.9),
    ("v32", 32, 64, 2048, 81.15, 82.27),
    ("v32", 32, 128, 2048, 139.87, 122.11),
    ("v32", 32, 256, 2048, 270.3, 231.58),
    ("v32", 64, 1, 2048, 14.24, 22.37),
    ("v32", 64, 2, 2048, 15.81, 23.81),
    ("v32", 64, 4, 2048, 20.06, 23.39),
    ("v32", 64, 8, 2048, 28.26, 27.17),
    ("v32", 64, 16, 2048, 45.14, 37.76),
    ("v32", 64, 32, 2048, 77.6, 55.71),
    ("v32", 64, 64, 2048, 134.37, 81.82),
    ("v32", 64, 128, 2048, 258.18, 122.82),
    ("v32", 64, 256, 2048, 519.65, 228.06),
    ("v32", 128, 1, 2048, 16.13, 22.43),
    ("v32", 128, 2, 2048, 20.13, 21.82),
    ("v32", 128, 4, 2048, 28.35, 24.45),
    ("v32", 128, 8, 2048, 44.64, 31.9),
    ("v32", 128, 16, 2048, 76.96, 45.73),
    ("v32", 128, 32, 2048, 133.82, 68.03),
    ("v32", 128, 64, 2048, 262.59, 100.0),
    ("v32", 128, 128, 2048, 517.1, 188.38),
    ("v32", 128, 256, 2048, 1011.9, 367.42),
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
