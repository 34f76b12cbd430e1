"""Plugins that switch vLLM and SGLang's DeepSeek-V4 / V4.1 attention on SM120 over to this
library, opt-in by one environment variable.

``DSV4_MLA_ENGINE_KERNELS``:
- unset, empty or "0": the plugins do nothing (the engine runs as installed);
- "1": on an sm_120 / sm_121 GPU, the engine's sparse MLA decode function is replaced by this
  library's adapter of the same signature (``dispatch.adapters``); on any other GPU nothing
  is replaced (one log line says so);
- "force": replaced whatever the GPU (for tests, and for GPUs that run the sm_120 kernels'
  instructions, such as the H200).

What is replaced, by the engines' names (``pyproject.toml`` declares the entry points):
- vLLM (``vllm.general_plugins`` entry point ``dsv4_sparse_mla``): FlashInfer's
  ``trtllm_batch_decode_sparse_mla_dsv4`` as vLLM binds it,
  ``vllm.utils.flashinfer.flashinfer_trtllm_batch_decode_sparse_mla_dsv4``, which the
  DeepSeek-V4 and V4.1 attention modules (``vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py``
  and ``vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py``) import by that name; the
  binding in those modules too where they are already imported; and
  ``vllm.utils.flashinfer.has_flashinfer_sparse_mla_sm120_config``, with which each SM120
  attention layer refuses to start when FlashInfer has no kernel for its (heads, top-k).
- SGLang (``sglang.srt.plugins`` entry point ``dsv4_sparse_mla``): a REPLACE hook in SGLang's
  ``HookRegistry`` on ``sglang.kernels.ops.attention.flash_mla_sm120.flash_mla_with_kvcache_sm120``.

Each plugin logs one line saying what it replaced (logger ``vllm.dsv4_sparse_mla``, INFO;
``sglang.dsv4_sparse_mla``, WARNING). Where the engine's function is not where
the plugin expects it (another engine version), it raises RuntimeError naming the engine
version and the missing name, never falling back silently: vLLM stops on it; SGLang logs a
plugin's exception and goes on, so the plugin logs the error itself as well.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys

ENV = "DSV4_MLA_ENGINE_KERNELS"
# each plugin logs through its engine's logger tree (vLLM's "vllm" logger does not propagate to
# the root logger; SGLang may load plugins before it configures logging, so its line is a warning)
VLLM_LOG = logging.getLogger("vllm.dsv4_sparse_mla")
SGLANG_LOG = logging.getLogger("sglang.dsv4_sparse_mla")

# vLLM: where the function is bound, and the modules that import it by that name
VLLM_BINDING = ("vllm.utils.flashinfer", "flashinfer_trtllm_batch_decode_sparse_mla_dsv4")
# vLLM's check, at each SM120 attention layer's construction, that FlashInfer has a kernel for
# (padded heads, top-k): this library serves every such pair
VLLM_SHAPE_CHECK = "has_flashinfer_sparse_mla_sm120_config"
VLLM_CALLERS = ("vllm.models.deepseek_v4.nvidia.flashinfer_sparse", "vllm.models.deepseek_v41.nvidia.flashinfer_sparse")
# SGLang: the function its DeepSeek-V4 backend imports at each call on SM120
SGLANG_TARGET = "sglang.kernels.ops.attention.flash_mla_sm120.flash_mla_with_kvcache_sm120"
SGLANG_HOOKS = "sglang.srt.plugins.hook_registry"
# the engine versions whose sources the plugins were written against
CHECKED = {"vllm": "0.34.0 (its released wheel)",
           "sglang": "0.5.23 (its released wheel)"}


def requested_mode() -> str | None:
    """None (off), "sm120" or "force", from ``DSV4_MLA_ENGINE_KERNELS``; ValueError otherwise."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "false", "off", "no"):
        return None
    if value in ("1", "true", "on", "yes"):
        return "sm120"
    if value == "force":
        return "force"
    raise ValueError(f"{ENV}={os.environ[ENV]!r}: use 1 (replace on sm_120 / sm_121 GPUs), force (on any GPU) "
                     f"or 0 (off)")


def _engine_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules.get(package), "__version__", "unknown")


def _missing(log, engine: str, package: str, what: str, cause: BaseException | None = None) -> RuntimeError:
    reason = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    message = (f"{ENV} is set, but {engine} {_engine_version(package)} has no {what}{reason}: this plugin was "
               f"written against {engine} {CHECKED[package]}; unset {ENV} to run {engine}'s own kernel")
    log.error("dsv4-sparse-mla: %s", message)
    return RuntimeError(message)


def _wanted(log, engine: str, capability) -> bool:
    """Whether to replace: the variable asks for it and the GPU is an SM120 one (``capability``:
    a callable returning (major, minor), or None for no GPU), or the variable forces it."""
    try:
        mode = requested_mode()
    except ValueError as err:
        log.error("dsv4-sparse-mla: %s", err)
        raise
    if mode is None:
        return False
    if mode == "force":
        return True
    try:
        cap = capability()
    except Exception as err:  # the GPU cannot be read: leave the engine as it is, and say so
        log.warning("dsv4-sparse-mla: %s=%s but the GPU's compute capability cannot be read (%s: %s): %s's kernels "
                    "are left in place", ENV, os.environ[ENV], type(err).__name__, err, engine)
        return False
    if cap is not None and cap[0] == 12:
        return True
    shown = "no CUDA GPU" if cap is None else f"sm_{cap[0]}{cap[1]}"
    log.info("dsv4-sparse-mla: %s=%s but the GPU is %s, not sm_120 / sm_121: %s's kernels are left in place "
             "(%s=force replaces them anyway)", ENV, os.environ[ENV], shown, engine, ENV)
    return False


def _import(name: str):
    """(module, None), or (None, the ImportError) where it cannot be imported."""
    try:
        return importlib.import_module(name), None
    except ImportError as err:
        return None, err


# ---------------------------------------------------------------------- vLLM
def serves_sm120_shape(num_q_heads: int, top_k: int) -> bool:
    """vLLM's ``has_flashinfer_sparse_mla_sm120_config`` for this library: every head count and
    top-k of at least 1 has a kernel."""
    return int(num_q_heads) >= 1 and int(top_k) >= 1


def _vllm_capability():
    """The GPU's compute capability as vLLM reads it (NVML: no CUDA context in this process)."""
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    return None if cap is None else (cap.major, cap.minor)


def register_vllm() -> None:
    """The ``vllm.general_plugins`` entry point (vLLM calls it in every process it starts)."""
    if not _wanted(VLLM_LOG, "vLLM", _vllm_capability):
        return
    from .adapters import trtllm_batch_decode_sparse_mla_dsv4 as adapter

    module_name, name = VLLM_BINDING
    module, error = _import(module_name)
    for wanted in (name, VLLM_SHAPE_CHECK):
        if module is None or not hasattr(module, wanted):
            raise _missing(VLLM_LOG, "vLLM", "vllm", f"{module_name}.{wanted}", error)
    callers = [(caller, sys.modules[caller]) for caller in VLLM_CALLERS if caller in sys.modules]
    for caller, loaded in callers:  # modules that bound the name before this ran: all or none patched
        if not hasattr(loaded, name):
            raise _missing(VLLM_LOG, "vLLM", "vllm", f"{caller}.{name}")
    setattr(module, name, adapter)
    setattr(module, VLLM_SHAPE_CHECK, serves_sm120_shape)
    for _, loaded in callers:
        setattr(loaded, name, adapter)
    replaced = ([f"{module_name}.{name}"] + [f"{caller}.{name}" for caller, _ in callers]
                + [f"{module_name}.{VLLM_SHAPE_CHECK}"])
    VLLM_LOG.info("dsv4-sparse-mla: vLLM %s: %s replaced by dispatch.adapters.trtllm_batch_decode_sparse_mla_dsv4",
                  _engine_version("vllm"), ", ".join(replaced))


# ---------------------------------------------------------------------- SGLang
def _gpu_capability():
    """The first visible GPU's compute capability from NVML where it is installed (no CUDA
    context in this process: SGLang loads plugins before it starts its workers), else torch's."""
    try:
        import pynvml
    except ImportError:
        import torch

        return torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    pynvml.nvmlInit()
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        if visible.startswith("GPU-") or visible.startswith("MIG-"):
            handle = pynvml.nvmlDeviceGetHandleByUUID(visible)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
        return tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))
    finally:
        pynvml.nvmlShutdown()


def register_sglang() -> None:
    """The ``sglang.srt.plugins`` entry point: registers a REPLACE hook that SGLang's plugin
    loader applies once every plugin has run."""
    if not _wanted(SGLANG_LOG, "SGLang", _gpu_capability):
        return
    from .adapters import flash_mla_with_kvcache_sm120 as adapter

    hooks, error = _import(SGLANG_HOOKS)
    registry = getattr(hooks, "HookRegistry", None)
    hook_type = getattr(getattr(hooks, "HookType", None), "REPLACE", None)
    if registry is None or hook_type is None:
        raise _missing(SGLANG_LOG, "SGLang", "sglang", f"{SGLANG_HOOKS}.HookRegistry / HookType.REPLACE", error)
    module_name, name = SGLANG_TARGET.rsplit(".", 1)
    module, error = _import(module_name)
    if module is None or not hasattr(module, name):
        raise _missing(SGLANG_LOG, "SGLang", "sglang", SGLANG_TARGET, error)
    registry.register(SGLANG_TARGET, adapter, hook_type)
    SGLANG_LOG.warning("dsv4-sparse-mla: SGLang %s: %s replaced by dispatch.adapters.flash_mla_with_kvcache_sm120",
                       _engine_version("sglang"), SGLANG_TARGET)
