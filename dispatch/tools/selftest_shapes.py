"""Which registry shapes ``dsv4-mla-selftest`` runs: the deployment a user names (``--model``,
``--tp``, ``--format``) mapped onto ``dispatch.policy.registry`` (no GPU, no torch work).

A model is named as users name it, in any case: ``registry.MODELS``' keys
(``deepseek-v4-flash``, ``glm-5.3``), the registry's own names (``V4-Flash``, ``GLM-5.x``) or
a key without ``deepseek-``. Its query heads per GPU are its query heads / ``--tp``, which must
be a head count the registry serves it at. Without ``--tp``: every head count of the model;
without ``--model``: every model at the head count all of them are deployed with (64).
"""

from __future__ import annotations

import dataclasses

from cute_kernels.sparse_mla_decode.kv_format import FORMATS

from ..policy.registry import DEPLOYMENT_SHAPES, MODELS, DeploymentShape


class UsageError(ValueError):
    """An option that names no deployment of the registry (the message says what would)."""


def model_aliases() -> dict[str, str]:
    """Every name ``--model`` takes, lower case -> its key in ``registry.MODELS``."""
    aliases = {}
    for key, model in MODELS.items():
        for name in (key, model.name.lower(), key.removeprefix("deepseek-")):
            aliases[name] = key
    return aliases


def resolve_model(name: str) -> str:
    """The ``registry.MODELS`` key of a model name given by a user (any case)."""
    key = model_aliases().get(name.strip().lower()) if isinstance(name, str) else None
    if key is None:
        raise UsageError(f"--model {name!r}: not a model of the registry; one of {', '.join(MODELS)}")
    return key


def heads_for(model_key: str, tp: int) -> int:
    """Query heads per GPU of ``model_key`` at tensor parallelism ``tp``: one of the degrees it
    is deployed at (``registry.Model.tps``)."""
    model = MODELS[model_key]
    if isinstance(tp, bool) or not isinstance(tp, int) or tp not in model.tps:
        raise UsageError(f"--tp {tp}: {model_key} has {model.heads} query heads, served at "
                         f"{', '.join(map(str, model.heads_per_gpu()))} per GPU: --tp one of "
                         f"{', '.join(map(str, model.tps))}")
    return model.heads // tp


def default_heads() -> int:
    """The query heads per GPU every model of the registry is deployed with (the most, if several)."""
    return max(set.intersection(*(set(m.heads_per_gpu()) for m in MODELS.values())))


def reads(shape: DeploymentShape, kv_format: str) -> bool:
    """Whether ``shape``'s main cache is of ``kv_format`` (for a format read only as an extra
    cache: its extra cache)."""
    if not FORMATS[kv_format].main:
        return shape.extra_topk > 0 and shape.extra_kv_format == kv_format
    return shape.kv_format == kv_format


@dataclasses.dataclass(frozen=True)
class SelfTestShape:
    """A deployment shape and every model of the selection deployed with it (one call for all)."""

    shape: DeploymentShape
    models: tuple[str, ...]

    @property
    def attn_sink(self) -> bool:
        """Whether the call has a sink per head: where a model of the shape has one."""
        return any(m.attn_sink for m in MODELS.values() if m.name in self.models)

    @property
    def label(self) -> str:
        s = self.shape
        lists = f"{s.topk}@p{s.page_block_size}" + (f" + {s.extra_topk}@p{s.extra_page_block_size}" if s.extra_topk
                                                     else "")
        formats = s.kv_format + (f" + {s.extra_kv_format}" if s.extra_kv_format else "")
        return f"{'/'.join(self.models)} {s.num_heads}h {lists} {formats}"


@dataclasses.dataclass(frozen=True)
class Deployment:
    """What a self-test runs: its shapes and, in words, the deployment they are of."""

    description: str
    shapes: tuple[SelfTestShape, ...]
    model: str | None = None  # the registry.MODELS key, None: every model
    tp: int | None = None
    kv_format: str | None = None


def _call_key(shape: DeploymentShape, quick: bool) -> DeploymentShape:
    """What makes two shapes one call: everything but the model; with ``quick`` not the page
    sizes either (they change strides, not kernels)."""
    key = dataclasses.replace(shape, model="")
    return dataclasses.replace(key, page_block_size=0, extra_page_block_size=None) if quick else key


def select_deployment(model: str | None = None, tp: int | None = None, kv_format: str | None = None,
                      quick: bool = False) -> Deployment:
    """The registry shapes of a deployment (module docstring), each call once (a shape that
    several models of the selection share names them all; with ``quick`` one page size per
    list shape). Raises ``UsageError`` naming what would be valid."""
    if tp is not None and model is None:
        raise UsageError("--tp needs --model (query heads per GPU = the model's query heads / tp)")
    if kv_format is not None and kv_format not in FORMATS:
        raise UsageError(f"--format {kv_format!r}: one of {', '.join(FORMATS)}")
    keys = [resolve_model(model)] if model is not None else list(MODELS)
    heads = heads_for(keys[0], tp) if tp is not None else (None if model is not None else default_heads())
    grouped: dict[DeploymentShape, tuple[DeploymentShape, list[str]]] = {}
    for key in keys:
        name = MODELS[key].name
        for s in DEPLOYMENT_SHAPES:
            if s.model != name or (heads is not None and s.num_heads != heads):
                continue
            if kv_format is None or reads(s, kv_format):
                grouped.setdefault(_call_key(s, quick), (s, []))[1].append(name)
    where = (keys[0] if model is not None else "every model") + (
        f" at TP {tp} ({heads} query heads per GPU)" if tp is not None
        else f" at {heads} query heads per GPU" if heads is not None else " at every head count")
    where += f", {kv_format} caches" if kv_format else ""
    if not grouped:
        names = {MODELS[k].name for k in keys}
        formats = sorted({f for s in DEPLOYMENT_SHAPES if s.model in names for f in (s.kv_format, s.extra_kv_format)
                          if f})
        raise UsageError(f"--format {kv_format}: no deployment shape of {where} (its formats: {', '.join(formats)})")
    shapes = tuple(SelfTestShape(first, tuple(dict.fromkeys(names))) for first, names in grouped.values())
    return Deployment(where, shapes, model=keys[0] if model is not None else None, tp=tp, kv_format=kv_format)
