"""On Hopper (sm_90), which calls this library serves and which it leaves to the engine's own
FlashMLA: a measured policy, and the measurements it is read from.

The engines call FlashMLA's SM90 sparse decode with the query heads padded to 64 or 128 (its
only head counts). This library computes the real heads only; FlashMLA's ``wgmma`` kernel is
faster where many real heads meet many tokens. ``choose`` answers, for one call, which of the
two was faster on the measured shape nearest at or above it:

- ``family``: the cache the call reads, "model1" (DeepSeek-V4 / V4.1's 584-byte records, main
  and extra) or "v32" (DeepSeek-V3.2 / GLM-5's 656-byte rows);
- ``heads``: the real query heads of the call (the layer's, before the engine's padding);
- ``tokens``: the query tokens of the call;
- ``entries``: its top-k plus its extra top-k (the entries each token attends to).

The nearest shape at or above a call: the smallest measured head count >= ``heads``, then the
smallest measured entry count >= ``entries`` and the smallest measured token count >=
``tokens`` of those rows (the largest where the call is beyond every measured value). Rounding
up keeps the choice conservative: this library's advantage shrinks as heads, entries and tokens
grow. A call of a family with no measured row goes to FlashMLA.

``EVIDENCE``: the measured rows (``dispatch.tools.sm90_route_table``, the table of
``docs/performance.md``, "The Hopper route"): each row this library's routed call (the real
heads of a query padded as the engines pad it) and FlashMLA's call on the padded query, both
replayed from CUDA graphs with L2 cleared, in one process, on one GPU. ``dsv4-mla-selftest
--route-table FILE`` measures the same rows for a deployment on the user's GPU;
``load_table`` reads them (``DSV4_MLA_SM90_ROUTE_TABLE`` names the file for the engine plugins).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

LIBRARY, FLASHMLA = "library", "flashmla"
FAMILIES = ("model1", "v32")
# the cache formats of each family, as this library names them (``kv_format.FORMATS``)
FAMILY_OF_FORMAT = {"model1_fp8": "model1", "v32_fp8": "v32", "glm_nope_fp8": "v32"}


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
EVIDENCE_SOURCE = ""
EVIDENCE: tuple[RouteRow, ...] = ()


def _at_or_above(values, wanted: int) -> int:
    """The smallest of ``values`` >= ``wanted``, else the largest."""
    above = [v for v in values if v >= wanted]
    return min(above) if above else max(values)


@functools.lru_cache(maxsize=4096)
def _choose(rows: tuple[RouteRow, ...], family: str, heads: int, tokens: int, entries: int) -> str:
    rows = [r for r in rows if r.family == family]
    if not rows:
        return FLASHMLA
    h = _at_or_above({r.heads for r in rows}, heads)
    rows = [r for r in rows if r.heads == h]
    e = _at_or_above({r.entries for r in rows}, entries)
    rows = [r for r in rows if r.entries == e]
    t = _at_or_above({r.tokens for r in rows}, tokens)
    return next(r for r in rows if r.tokens == t).winner


def choose(family: str, heads: int, tokens: int, entries: int, rows: tuple[RouteRow, ...] | None = None) -> str:
    """``LIBRARY`` or ``FLASHMLA`` for one call (module docstring), by ``rows`` (default
    ``EVIDENCE``). Cached: a serving loop asks the same few shapes every step."""
    return _choose(EVIDENCE if rows is None else rows, family, heads, tokens, entries)


def to_json(rows, source: str) -> str:
    """``rows`` as ``load_table`` reads them back."""
    return json.dumps({"source": source, "rows": [asdict(r) for r in rows]}, indent=1)


def load_table(path) -> tuple[tuple[RouteRow, ...], str]:
    """(rows, source) from a file ``to_json`` (or ``dsv4-mla-selftest --route-table``) wrote;
    ValueError naming the file and what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
        rows = tuple(RouteRow(**{k: row[k] for k in RouteRow.__dataclass_fields__}) for row in data["rows"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a route table ({type(err).__name__}: {err}); "
                         f"dsv4-mla-selftest --route-table FILE writes one") from None
    bad = [r for r in rows if r.family not in FAMILIES or min(r.heads, r.tokens, r.entries) < 1
           or not (r.library_us > 0 and r.flashmla_us > 0)]
    if not rows or bad:
        raise ValueError(f"{path}: {'no rows' if not rows else f'rows out of range: {bad[:3]}'} (families "
                         f"{FAMILIES}, positive heads, tokens, entries and times)")
    return rows, str(data.get("source", path))
