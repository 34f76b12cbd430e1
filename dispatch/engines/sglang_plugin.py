"""The SGLang plugin (entry point ``sglang.srt.plugins`` / ``dsv4_sparse_mla``, opt-in by
``DSV4_MLA_ENGINE_KERNELS``: ``plugin_mode``). SGLang calls ``register`` in every process it
starts, then applies the hooks registered in its ``HookRegistry`` (``srt/plugins/hook_registry.py``),
before it builds the model. What it hooks, read in SGLang 0.5.23's released wheel:

- ``SITE_HOOKS`` (AROUND, both GPU families): the backend methods that make the decode calls,
  ``DeepseekV4AttnBackend._forward_attention`` (DeepSeek-V4 / V4.1, ``srt/layers/attention/deepseek_v4_backend.py``)
  and ``DeepseekSparseAttnBackend._forward_flashmla_kv`` (DeepSeek-V3.2 / GLM-5 with an FP8
  cache, ``srt/layers/attention/dsa_backend.py``): each tells the call its layer's real heads
  (``layer.tp_q_head_num``; SGLang pads the query to 64 heads at attention TP > 1 for FlashMLA,
  uninitialised for V4, and drops the padded rows after the call);
- on sm_120 / sm_121 (REPLACE): ``SM120_TARGET``, the function the DeepSeek-V4 backend imports
  at each call on SM120, by ``flashmla.flash_mla_with_kvcache_sm120``; ``SM120_GLM_TARGET``, the
  function the DSA backend imports at each call for GLM-5 / GLM-5.3 with an FP8 cache on SM120
  (its decode there, and its default prefill: ``forward_extend`` calls it too), by
  ``flashinfer_mla.flashinfer_sparse_mla_forward``. DeepSeek-V3.2 on
  SM120 is not taken: SGLang calls FlashInfer's ``trtllm_batch_decode_with_kv_cache_mla`` for it
  directly with ``backend="trtllm-gen"`` (``dsa_backend.py`` ``_forward_trtllm``), a function every
  MLA model of the process shares;
- on sm_90 (AROUND): ``SM90_TARGET``, FlashMLA's function that SGLang's backends call (the
  DeepSeek-V4 backend binds it, with ``use_legacy=``, when it is built, after the hooks are
  applied; the DSA backend imports it at each call), routed per shape by ``sm90_route``.

Where a name is not where the plugin expects it (another SGLang release), ``register`` logs
and raises RuntimeError naming the release and the name, registering nothing (SGLang logs a
plugin's exception and goes on).
"""

from __future__ import annotations

import logging
import os

from . import plugin_mode
from .sites import real_heads_of, site, within_site

# SGLang loads plugins before it configures logging: a warning reaches the terminal
LOG = logging.getLogger("sglang.dsv4_sparse_mla")
_TOLD = plugin_mode.OncePerProcess()  # what the hooks say once per process

HOOKS = "sglang.srt.plugins.hook_registry"
SM120_TARGET = "sglang.kernels.ops.attention.flash_mla_sm120.flash_mla_with_kvcache_sm120"
# the DSA backend's GLM-5 / GLM-5.3 decode on SM120 with an FP8 cache (resolved at each call)
SM120_GLM_TARGET = "sglang.kernels.ops.attention.flash_mla_sm120.flashinfer_sparse_mla_forward"
SM90_TARGET = "sglang.kernels.ops.attention.flash_mla_interface.flash_mla_with_kvcache"
# (method, what the site is, the position of ``layer`` among the method's arguments after self,
# whether SGLang reads the lse the call returns)
SITE_HOOKS = (
    ("sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend._forward_attention",
     "DeepSeek-V4 / V4.1 attention", 3, False),
    ("sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend._forward_flashmla_kv",
     "DeepSeek-V3.2 / GLM-5 FP8 decode", 4, False),
)


def register(capability=None) -> None:
    """The ``sglang.srt.plugins`` entry point: registers the hooks SGLang's plugin loader
    applies once every plugin has run (SGLang calls it without arguments). ``capability``: a
    callable returning (major, minor) of the GPU to install for, instead of this process's
    (``dsv4-mla-engines --gpu``)."""
    family = plugin_mode.family_to_install(LOG, "SGLang", capability or plugin_mode.gpu_capability)
    if family is None:
        return
    hooks, error = plugin_mode.import_module(HOOKS)
    registry = getattr(hooks, "HookRegistry", None)
    hook_type = getattr(hooks, "HookType", None)
    if registry is None or not all(hasattr(hook_type, t) for t in ("REPLACE", "AROUND")):
        raise _missing(f"{HOOKS}.HookRegistry / HookType.REPLACE, AROUND", error)
    for path in hooked_names(family):
        _resolve(path)  # every name first: all hooks or none
    if family == "sm120":
        from .flashinfer_mla import flashinfer_sparse_mla_forward

        registry.register(SM120_TARGET, plugin_mode.announce_first_call(
            sm120_call, LOG, "SGLang's flash_mla_with_kvcache_sm120 served by dispatch.engines.flashmla"),
            hook_type.REPLACE)
        registry.register(SM120_GLM_TARGET, plugin_mode.announce_first_call(
            flashinfer_sparse_mla_forward, LOG,
            "SGLang's flashinfer_sparse_mla_forward served by dispatch.engines.flashinfer_mla"), hook_type.REPLACE)
    else:
        from .sm90_route import route_table

        registry.register(SM90_TARGET, sm90_around(route_table(LOG)), hook_type.AROUND)
    for path, label, layer_at, wants_lse in SITE_HOOKS:
        registry.register(path, _site_around(f"SGLang {path.rsplit('.', 2)[-2]} ({label})", layer_at, wants_lse),
                          hook_type.AROUND)
    what = (f"DeepSeek-V4 / V4.1 and GLM-5 decode now call this library ({SM120_TARGET}, {SM120_GLM_TARGET} "
            f"replaced by dispatch.engines)" if family == "sm120" else
            f"FlashMLA's sparse decode ({SM90_TARGET}) routed per shape between this library and FlashMLA")
    LOG.warning("dsv4-sparse-mla: SGLang %s on %s (%s=%s): %s; the real heads of each layer from %s",
                plugin_mode.engine_version("sglang"), "sm_120 / sm_121" if family == "sm120" else "sm_90",
                plugin_mode.ENV, os.environ.get(plugin_mode.ENV, ""), what,
                ", ".join(p.rsplit(".", 2)[-2] + "." + p.rsplit(".", 1)[-1] for p, *_ in SITE_HOOKS))


def hooked_names(family: str) -> list[str]:
    """The SGLang names the plugin hooks on ``family``'s GPUs ("sm120" or "sm90")."""
    targets = [SM120_TARGET, SM120_GLM_TARGET] if family == "sm120" else [SM90_TARGET]
    return targets + [path for path, *_ in SITE_HOOKS]


def _missing(what: str, cause=None) -> RuntimeError:
    return plugin_mode.missing(LOG, "SGLang", "sglang", what, cause)


def _resolve(path: str):
    """The object at ``path`` (a module's attribute, or a class's), imported as SGLang's hook
    registry will; RuntimeError naming it where it is not there."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module, error = plugin_mode.import_module(".".join(parts[:cut]))
        if module is not None:
            obj = module
            for attr in parts[cut:]:
                obj = getattr(obj, attr, None)
                if obj is None:
                    raise _missing(path)
            return obj
    raise _missing(path, error)


def sm120_call(**kwargs):
    """SGLang's ``flash_mla_with_kvcache_sm120`` served by ``flashmla.flash_mla_with_kvcache_sm120``,
    on the real heads of the layer where SGLang padded the query."""
    from .flashmla import flash_mla_with_kvcache_sm120

    real = real_heads_of(kwargs["q"]) if hasattr(kwargs.get("q"), "shape") else None
    if real is not None and "num_valid_heads" not in kwargs:
        kwargs["num_valid_heads"] = real
    return flash_mla_with_kvcache_sm120(**kwargs)


def sm90_around(table):
    """The AROUND hook of FlashMLA's function: SGLang passes its original with each call;
    ``table``: the ``sm90_policy.RouteTable`` the route chooses by (``sm90_route.route_table``)."""
    from .sm90_route import make_route

    routes = {}

    def routed(original, *args, **kwargs):
        route = routes.get(original)
        if route is None:
            route = routes[original] = make_route(original, LOG, "SGLang", table=table)
        return route(*args, **kwargs)

    return routed


def _site_around(label: str, layer_at: int, wants_lse: bool):
    """The AROUND hook of a backend method taking ``layer`` at position ``layer_at`` (after
    self): the method runs within its call site, the real heads ``layer.tp_q_head_num``."""
    def at_site(original, self, *args, **kwargs):
        layer = args[layer_at] if len(args) > layer_at else kwargs.get("layer")
        heads = getattr(layer, "tp_q_head_num", None)
        if not isinstance(heads, int):
            if _TOLD.first(("no heads", label)):
                LOG.warning("dsv4-sparse-mla: SGLang %s (pid %d): the layer has no int tp_q_head_num (got %r): its "
                            "calls are not told their real heads (every head computed on SM120, FlashMLA on sm_90)",
                            label, os.getpid(), heads)
            return original(self, *args, **kwargs)
        return within_site(site(label, heads, wants_lse), original, self, *args, **kwargs)

    return at_site
