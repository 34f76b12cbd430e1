"""What the engine plugins share: the opt-in variable, the GPU family a process runs on, the
log lines, and the refusal when an engine release moved a function.

``DSV4_MLA_ENGINE_KERNELS``:
- unset, empty or "0": the plugins do nothing (the engine runs as installed);
- "1": this GPU's route: on sm_120 / sm_121 the engines' SM120 sparse MLA decode functions are
  replaced by this library's call shapes; on sm_90 (H100, H200, H20) the engines' FlashMLA
  calls are routed per shape between this library and FlashMLA (``dispatch.policy.sm90_policy``);
  on any other GPU nothing is patched (the engines call nothing this library replaces there);
- "sm120" / "sm90": that route only (nothing patched on a GPU of the other family).

Every line a plugin logs starts with ``dsv4-sparse-mla:`` and is a WARNING: the engines load
plugins before they configure logging (vLLM's API server, every SGLang process), when only
warnings reach the terminal. A replaced function also says so at its first call in each
process (a forked worker inherits the patch, not the start-up line).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import sys

ENV = "DSV4_MLA_ENGINE_KERNELS"
OFF = ("", "0", "false", "off", "no")
ON = ("1", "true", "on", "yes")
FAMILIES = ("sm120", "sm90")
# compute capability major -> the family of GPUs a route serves
FAMILY_BY_MAJOR = {12: "sm120", 9: "sm90"}
DESCRIBED = {"sm120": "the SM120 decode calls, on sm_120 / sm_121",
             "sm90": "the FlashMLA decode calls, per shape, on sm_90"}
# the engine releases whose sources the plugins were written against
CHECKED = {"vllm": "0.34.0 (its released wheel)", "sglang": "0.5.23 (its released wheel)"}


def requested_mode() -> str | None:
    """None (off), "auto" (this GPU's route), "sm120" or "sm90", from ``DSV4_MLA_ENGINE_KERNELS``;
    ValueError naming the values otherwise."""
    raw = os.environ.get(ENV, "")
    value = raw.strip().lower()
    if value in OFF:
        return None
    if value in ON:
        return "auto"
    if value in FAMILIES:
        return value
    raise ValueError(f"{ENV}={raw!r}: use 1 (this GPU's route: {DESCRIBED['sm120']}, {DESCRIBED['sm90']}), "
                     f"sm120 or sm90 (that route only), or 0 (off)")


def engine_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules.get(package), "__version__", "unknown")


def missing(log, engine: str, package: str, what: str, cause: BaseException | None = None) -> RuntimeError:
    """The error of a plugin that cannot patch what it was written to (logged, then returned
    for the caller to raise: SGLang only logs a plugin's exception)."""
    reason = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    message = (f"{ENV} is set, but {engine} {engine_version(package)} has no {what}{reason}: this plugin was "
               f"written against {engine} {CHECKED[package]}; unset {ENV} to run {engine}'s own kernels")
    log.error("dsv4-sparse-mla: %s", message)
    return RuntimeError(message)


def import_module(name: str):
    """(module, None), or (None, the exception) where it cannot be imported."""
    try:
        return importlib.import_module(name), None
    except Exception as err:  # an engine module may fail in other ways than ImportError on a partial install
        return None, err


def family_to_install(log, engine: str, capability) -> str | None:
    """The route to install in this process ("sm120", "sm90") or None, from the variable and
    the GPU (``capability``: a callable returning (major, minor), or None for no GPU). Says
    why nothing is installed where the variable asks for something."""
    try:
        mode = requested_mode()
    except ValueError as err:
        log.error("dsv4-sparse-mla: %s", err)
        raise
    if mode is None:
        return None
    try:
        cap = capability()
    except Exception as err:  # the GPU cannot be read: leave the engine as it is, and say so
        log.warning("dsv4-sparse-mla: %s %s: %s=%s but the GPU's compute capability cannot be read (%s: %s): "
                    "nothing patched", engine, engine_version(engine.lower()), ENV, os.environ[ENV],
                    type(err).__name__, err)
        return None
    family = None if cap is None else FAMILY_BY_MAJOR.get(cap[0])
    if family is not None and mode in ("auto", family):
        return family
    shown = "no CUDA GPU" if cap is None else f"sm_{cap[0]}{cap[1]}"
    routes = "; ".join(DESCRIBED[f] for f in FAMILIES if mode in ("auto", f))
    log.warning("dsv4-sparse-mla: %s %s: %s=%s but the GPU is %s, where %s makes none of the calls this setting "
                "takes (%s): nothing patched", engine, engine_version(engine.lower()), ENV, os.environ[ENV], shown, engine,
                routes)
    return None


# every OncePerProcess's keys, forgotten in a forked child (which has its own first calls)
_ONCE_KEYS: list[set] = []
os.register_at_fork(after_in_child=lambda: [keys.clear() for keys in _ONCE_KEYS])


class OncePerProcess:
    """Keys seen in this process: ``first(key)`` is True once per key and process (a forked
    worker inherits a patched function but not the lines its parent logged). The check is a
    set lookup: a call site asks before it formats anything."""

    def __init__(self):
        self.seen: set = set()
        _ONCE_KEYS.append(self.seen)

    def first(self, key) -> bool:
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def announce_first_call(fn, log, text: str):
    """``fn``, logging ``text`` once per process at its first call (a forked worker inherits a
    patched function without the plugin's start-up line)."""
    once = OncePerProcess()

    @functools.wraps(fn)
    def first_call_told(*args, **kwargs):
        if once.first(None):
            log.warning("dsv4-sparse-mla: %s (pid %d, first call)", text, os.getpid())
        return fn(*args, **kwargs)

    return first_call_told


def gpu_capability():
    """The first visible GPU's compute capability from NVML where it is installed (no CUDA
    context in this process: engines load plugins before they start their workers), else
    torch's; None without a GPU, and None where ``CUDA_VISIBLE_DEVICES`` leaves this process
    none (set but empty, or its first entry not a GPU: CUDA sees only the entries before an
    invalid one)."""
    try:
        import pynvml
    except ImportError:
        import torch

        return torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = "0" if visible is None else visible.split(",")[0].strip()
    pynvml.nvmlInit()
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
        if first.startswith("GPU-") or first.startswith("MIG-"):
            handle = pynvml.nvmlDeviceGetHandleByUUID(first)
        elif first.isdigit() and int(first) < pynvml.nvmlDeviceGetCount():
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(first))
        else:
            return None
        return tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))
    finally:
        pynvml.nvmlShutdown()
