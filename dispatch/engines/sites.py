"""The engine call sites the plugins know, as the calls run: a method of the engine that makes a
decode call sets ``SITE`` (the site's name, the layer's real query heads, whether the engine
reads the lse) for the duration of the call, so that the function it calls, replaced by a
plugin, knows how many of the query heads the engine padded are real."""

from __future__ import annotations

import functools
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class Site:
    """A known call site: its name (for the log lines), the layer's real query heads and
    whether the engine reads the lse the call returns."""

    name: str
    real_heads: int
    wants_lse: bool


SITE: ContextVar[Site | None] = ContextVar("dsv4_mla_site", default=None)


@functools.lru_cache(maxsize=256)
def site(name: str, real_heads: int, wants_lse: bool) -> Site:
    """The ``Site`` of these fields (one object per layer shape: a serving loop sets it every call)."""
    return Site(name, int(real_heads), wants_lse)


def within_site(where: Site, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with ``SITE`` set to ``where``."""
    token = SITE.set(where)
    try:
        return fn(*args, **kwargs)
    finally:
        SITE.reset(token)


def real_heads_of(q) -> int | None:
    """The real heads of the current site for a query of ``q``'s heads, None where every head
    given is real (no site, or a site whose layer has as many)."""
    where = SITE.get()
    if where is None or where.real_heads >= q.shape[-2]:
        return None
    return where.real_heads
