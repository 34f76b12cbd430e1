"""The vLLM plugin (entry point ``vllm.general_plugins`` / ``dsv4_sparse_mla``, opt-in by
``DSV4_MLA_ENGINE_KERNELS``: ``plugin_mode``). vLLM calls ``register`` in every process it
starts, before it builds the model. What it patches, read in vLLM 0.34.0's released wheel:

On sm_120 / sm_121 (``SM120_BINDINGS``, replaced by this library's call shapes):
- ``vllm.utils.flashinfer.flashinfer_trtllm_batch_decode_sparse_mla_dsv4``: FlashInfer's
  DeepSeek-V4 call, which ``DeepseekV4FlashInferSM120Attention`` (the class vLLM picks for
  DeepSeek-V4 and V4.1 on compute capability 12.x, ``models/deepseek_v4/nvidia/model.py``
  ``_select_dsv4_attn_cls``) imports by name into ``models/deepseek_v4/nvidia/flashinfer_sparse.py``
  and ``models/deepseek_v41/nvidia/flashinfer_sparse.py`` (patched there too where already
  imported); with it ``has_flashinfer_sparse_mla_sm120_config``, each layer's start-up check
  that FlashInfer has a kernel for its (heads, top-k): this library serves every pair;
- ``vllm.utils.flashinfer.flashinfer_trtllm_batch_decode_with_kv_cache_mla``: FlashInfer's MLA
  decode, which ``FlashInferMLASparseSM120Impl._run_mqa_kernel``
  (``v1/attention/backends/mla/flashinfer_mla_sparse_sm120.py``, the ``FLASHINFER_MLA_SPARSE_SM120``
  backend of DeepSeek-V3.2 and GLM-5 on 12.x) imports at each call.

On sm_90 (``SM90_FLASHMLA``, routed per shape by ``sm90_route``): FlashMLA's
``vllm.v1.attention.ops.flashmla.flash_mla_with_kvcache``, which the FlashMLA modules of
DeepSeek-V4 / V4.1 (``models/deepseek_v4/nvidia/flashmla.py``, ``models/deepseek_v41/nvidia/flashmla.py``)
and the ``FLASHMLA_SPARSE`` backend of DeepSeek-V3.2 / GLM-5 with an FP8 cache
(``v1/attention/backends/mla/flashmla_sparse.py``) import by name; and the methods that make
those calls (``SM90_SITES``), which tell the route the layer's real heads (vLLM pads the query
to 64 or 128 heads for FlashMLA; the padded rows of the output are dropped after the call).

Where a name is not where the plugin expects it (another vLLM release), ``register`` raises
RuntimeError naming the release and the name, patching nothing: vLLM stops on it.
"""

from __future__ import annotations

import logging
import sys

from . import plugin_mode
from .sites import site, within_site

# vLLM's "vllm" logger does not propagate to the root logger once configured; before that,
# a warning reaches the terminal through Python's last-resort handler
LOG = logging.getLogger("vllm.dsv4_sparse_mla")

FLASHINFER_BINDINGS = "vllm.utils.flashinfer"
# the SM120 names: (binding in vllm.utils.flashinfer, this library's function, the modules
# that import the binding by name)
SM120_BINDINGS = (
    ("flashinfer_trtllm_batch_decode_sparse_mla_dsv4", "flashinfer_dsv4.trtllm_batch_decode_sparse_mla_dsv4",
     ("vllm.models.deepseek_v4.nvidia.flashinfer_sparse", "vllm.models.deepseek_v41.nvidia.flashinfer_sparse")),
    ("flashinfer_trtllm_batch_decode_with_kv_cache_mla", "flashinfer_mla.trtllm_batch_decode_with_kv_cache_mla", ()),
)
SM120_SHAPE_CHECK = "has_flashinfer_sparse_mla_sm120_config"
SM90_FLASHMLA = ("vllm.v1.attention.ops.flashmla", "flash_mla_with_kvcache")
# the modules that import FlashMLA's function by name at their import
SM90_CALLERS = ("vllm.models.deepseek_v4.nvidia.flashmla", "vllm.models.deepseek_v41.nvidia.flashmla",
                "vllm.v1.attention.backends.mla.flashmla_sparse")
# (module, class, method, what the site is, the attribute or argument holding its real heads,
# whether the engine reads the lse the call returns)
SM90_SITES = (
    ("vllm.models.deepseek_v4.nvidia.flashmla", "DeepseekV4FlashMLAAttention", "_forward_decode",
     "DeepSeek-V4 decode", "n_local_heads", False),
    ("vllm.models.deepseek_v41.nvidia.flashmla", "DeepseekV4FlashMLAAttention", "_forward_decode",
     "DeepSeek-V4.1 decode", "n_local_heads", False),
    ("vllm.v1.attention.backends.mla.flashmla_sparse", "FlashMLASparseImpl", "_fp8_flash_mla_kernel",
     "DeepSeek-V3.2 / GLM-5 decode", "q", True),
)


def serves_sm120_shape(num_q_heads: int, top_k: int) -> bool:
    """vLLM's ``has_flashinfer_sparse_mla_sm120_config`` for this library: every head count and
    top-k of at least 1 has a kernel."""
    return int(num_q_heads) >= 1 and int(top_k) >= 1


def _vllm_capability():
    """The GPU's compute capability as vLLM reads it (NVML: no CUDA context in this process)."""
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    return None if cap is None else (cap.major, cap.minor)


def register(capability=None) -> None:
    """The ``vllm.general_plugins`` entry point (vLLM calls it without arguments).
    ``capability``: a callable returning (major, minor) of the GPU to install for, instead of
    vLLM's reading of this process's GPU (``dsv4-mla-engines --gpu``)."""
    family = plugin_mode.family_to_install(LOG, "vLLM", capability or _vllm_capability)
    if family == "sm120":
        _install_sm120()
    elif family == "sm90":
        _install_sm90()


def _missing(what: str, cause=None) -> RuntimeError:
    return plugin_mode.missing(LOG, "vLLM", "vllm", what, cause)


def _library_function(path: str):
    from . import flashinfer_dsv4, flashinfer_mla

    module, name = path.split(".")
    return getattr({"flashinfer_dsv4": flashinfer_dsv4, "flashinfer_mla": flashinfer_mla}[module], name)


def patched_names(family: str) -> list[str]:
    """The vLLM names the plugin patches on ``family``'s GPUs ("sm120" or "sm90"; on sm120 also
    the binding in each caller module already loaded)."""
    if family == "sm120":
        return [f"{FLASHINFER_BINDINGS}.{name}" for name, _, _ in SM120_BINDINGS] + [
            f"{FLASHINFER_BINDINGS}.{SM120_SHAPE_CHECK}"]
    return ([".".join(SM90_FLASHMLA)] + [f"{c}.{SM90_FLASHMLA[1]}" for c in SM90_CALLERS]
            + [f"{m}.{c}.{f}" for m, c, f, *_ in SM90_SITES])


def _install_sm120() -> None:
    binding, error = plugin_mode.import_module(FLASHINFER_BINDINGS)
    names = [name for name, _, _ in SM120_BINDINGS] + [SM120_SHAPE_CHECK]
    for name in names:
        if binding is None or not hasattr(binding, name):
            raise _missing(f"{FLASHINFER_BINDINGS}.{name}", error)
    patches = []  # (module, attribute, new value, shown name): all checked before any is set
    for name, target, callers in SM120_BINDINGS:
        new = plugin_mode.announce_first_call(_library_function(target), LOG,
                                              f"vLLM's {name} served by dispatch.engines.{target}")
        patches.append((binding, name, new, f"{FLASHINFER_BINDINGS}.{name}"))
        for caller in callers:  # modules that bound the name before this ran: all or none patched
            loaded = sys.modules.get(caller)
            if loaded is not None:
                if not hasattr(loaded, name):
                    raise _missing(f"{caller}.{name}")
                patches.append((loaded, name, new, f"{caller}.{name}"))
    patches.append((binding, SM120_SHAPE_CHECK, serves_sm120_shape, f"{FLASHINFER_BINDINGS}.{SM120_SHAPE_CHECK}"))
    for module, name, new, _ in patches:
        setattr(module, name, new)
    LOG.warning("dsv4-sparse-mla: vLLM %s on sm_120 / sm_121 (%s=%s): DeepSeek-V4 / V4.1 decode and DeepSeek-V3.2 / "
                "GLM-5 decode now call this library (%s replaced by dispatch.engines)",
                plugin_mode.engine_version("vllm"), plugin_mode.ENV, _env(), ", ".join(p[3] for p in patches))


def _install_sm90() -> None:
    from .sm90_route import make_route, route_table

    ops, error = plugin_mode.import_module(SM90_FLASHMLA[0])
    name = SM90_FLASHMLA[1]
    if ops is None or not hasattr(ops, name):
        raise _missing(".".join(SM90_FLASHMLA), error)
    original = getattr(ops, name)
    callers, methods = [], []
    for caller in SM90_CALLERS:
        module, error = plugin_mode.import_module(caller)
        if module is None or getattr(module, name, None) is not original:
            raise _missing(f"{caller}.{name} (FlashMLA's function, imported by name)", error)
        callers.append(module)
    for module_name, cls_name, method, label, heads_from, wants_lse in SM90_SITES:
        cls = getattr(sys.modules[module_name], cls_name, None)
        if cls is None or not callable(getattr(cls, method, None)):
            raise _missing(f"{module_name}.{cls_name}.{method}")
        methods.append((cls, method, f"vLLM {cls_name}.{method} ({label})", heads_from, wants_lse))
    table = route_table(LOG)
    route = make_route(original, LOG, "vLLM", table=table)
    for module in (ops, *callers):
        setattr(module, name, route)
    for cls, method, label, heads_from, wants_lse in methods:
        setattr(cls, method, _site_method(getattr(cls, method), label, heads_from, wants_lse))
    LOG.warning("dsv4-sparse-mla: vLLM %s on sm_90 (%s=%s): FlashMLA's sparse decode (%s) routed per shape between "
                "this library and FlashMLA (route table: %s, %d rows) at %s",
                plugin_mode.engine_version("vllm"), plugin_mode.ENV, _env(),
                ", ".join(f"{m.__name__}.{name}" for m in (ops, *callers)), table.source, len(table),
                ", ".join(m[2] for m in methods))


def _site_method(original, label: str, heads_from: str, wants_lse: bool):
    """The method ``original``, run within its call site: the layer's real heads are its
    attribute ``heads_from``, or (``"q"``) the heads of its first argument before vLLM pads it."""
    if heads_from == "q":
        def run_at_site(self, *args, **kwargs):
            q = args[0] if args else kwargs["q"]
            return within_site(site(label, q.shape[2], wants_lse), original, self, *args, **kwargs)
    else:
        def run_at_site(self, *args, **kwargs):
            return within_site(site(label, getattr(self, heads_from), wants_lse), original, self, *args, **kwargs)
    run_at_site.__wrapped__ = original
    run_at_site.__name__ = original.__name__
    run_at_site.__qualname__ = getattr(original, "__qualname__", original.__name__)
    return run_at_site


def _env() -> str:
    import os

    return os.environ.get(plugin_mode.ENV, "")
