"""``dsv4-mla-engines``: in the engine's environment, what the plugins patch and what this GPU
routes through them.

It reads ``DSV4_MLA_ENGINE_KERNELS`` and the GPU (or ``--gpu``), runs each installed engine's
plugin in this process as the engine would (vLLM: ``register``; SGLang: ``register``, then its
hook registry's ``apply_hooks``), and prints every engine name the plugin patched with what it
resolves to now; on sm_90, the route's choice for the registry's Hopper deployments. Exit
status 1 where a plugin raised (an engine release it does not know), else 0.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys

from ..policy import sm90_policy
from ..policy.registry import MODELS
from . import plugin_mode

PROG = "dsv4-mla-engines"
GPU_CHOICES = {"sm_120": (12, 0), "sm_121": (12, 1), "sm_90": (9, 0), "sm_80": (8, 0), "sm_89": (8, 9), "none": None}
ENTRY_POINTS = {"vllm": ("vllm.general_plugins", "dispatch.engines.vllm_plugin:register"),
                "sglang": ("sglang.srt.plugins", "dispatch.engines.sglang_plugin:register")}
# the tokens per call the route table is shown for (decode, with MTP drafts, to batched decode)
SHOWN_TOKENS = (1, 2, 4, 8, 64, 256)
def hopper_layers() -> dict:
    """(registry model key, heads per GPU) -> the (family, entries per token) of its layers whose
    cache FlashMLA reads, from the deployment registry (``dispatch.policy.registry``)."""
    from ..policy.registry import DEPLOYMENT_SHAPES

    layers: dict = {}
    for key, model in MODELS.items():
        for shape in DEPLOYMENT_SHAPES:
            family = sm90_policy.FAMILY_OF_FORMAT.get(shape.kv_format)
            if shape.model != model.name or family is None or shape.extra_kv_format not in (None, shape.kv_format):
                continue
            layers.setdefault((key, shape.num_heads), set()).add((family, shape.topk + shape.extra_topk))
    return {k: sorted(v) for k, v in layers.items()}


def _described(obj) -> str:
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return f"{module}.{getattr(obj, '__qualname__', getattr(obj, '__name__', type(obj).__name__))}"


def _sglang_hooks() -> dict:
    """SGLang target -> what its hook runs (SGLang's hook wrapper carries the original's name)."""
    from . import sglang_plugin as p

    return {p.SM120_TARGET: "dispatch.engines.sglang_plugin.sm120_call",
            p.SM120_GLM_TARGET: "dispatch.engines.flashinfer_mla.flashinfer_sparse_mla_forward",
            p.SM90_TARGET: "dispatch.engines.sm90_route (AROUND: per shape)",
            **{path: "dispatch.engines.sites.within_site (AROUND: the layer's real heads)" for path, *_ in
               p.SITE_HOOKS}}


def _get(path: str):
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        return obj
    return None


def _apply(engine: str, family: str, capability) -> tuple[list[str], str | None]:
    """Run ``engine``'s plugin for ``family``; (a line per patched name, the error or None)."""
    from . import sglang_plugin, vllm_plugin

    names = vllm_plugin.patched_names(family) if engine == "vllm" else sglang_plugin.hooked_names(family)
    before = {n: _get(n) for n in names}
    try:
        if engine == "vllm":
            from .vllm_plugin import register

            register(capability=capability)
        else:
            from .sglang_plugin import register

            register(capability=capability)
            importlib.import_module("sglang.srt.plugins.hook_registry").HookRegistry.apply_hooks()
    except Exception as err:
        return [], f"{type(err).__name__}: {err}"
    lines, hooks = [], _sglang_hooks() if engine == "sglang" else {}
    for name in names:
        now = _get(name)
        state = "patched" if now is not before[name] else "NOT patched"
        reaches = hooks[name] if name in hooks and now is not before[name] else _described(now)
        lines.append(f"    {name}: {state} -> {reaches}")
    return lines, None


def route_lines(table: sm90_policy.RouteTable) -> list[str]:
    """The route's choice for each layer of the registry's deployments at ``SHOWN_TOKENS``."""
    lines = [f"  route table: {table.source} ({len(table)} rows)"]
    if not len(table):
        lines.append("    no measured rows: every call goes to FlashMLA")
        return lines
    lines.append(f"    {'model':<22} {'TP':>3} {'heads':>5} {'entries':>7}  tokens " +
                 " ".join(f"{t:>4}" for t in SHOWN_TOKENS))
    for (key, heads), layers in hopper_layers().items():
        tp = MODELS[key].heads // heads
        for family, entries in layers:
            picks = [table.choose(family, heads, t, entries) for t in SHOWN_TOKENS]
            lines.append(f"    {key:<22} {tp:>3} {heads:>5} {entries:>7}         " +
                         " ".join(f"{'lib' if p == sm90_policy.LIBRARY else 'fmla':>4}" for p in picks))
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", choices=list(GPU_CHOICES), help="the GPU to show the plugins for, instead of this "
                                                             "machine's (none: no GPU)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    print(f"{PROG}: {plugin_mode.ENV}={os.environ.get(plugin_mode.ENV, '')!r}")
    try:
        mode = plugin_mode.requested_mode()
    except ValueError as err:
        print(f"  {err}")
        return 1
    if args.gpu is not None:
        cap, where = GPU_CHOICES[args.gpu], f"{args.gpu} (--gpu)"
    else:
        try:
            cap = plugin_mode.gpu_capability()
            where = "no CUDA GPU" if cap is None else f"sm_{cap[0]}{cap[1]}"
        except Exception as err:  # as the plugins: an unreadable GPU patches nothing
            cap, where = None, f"its compute capability cannot be read ({type(err).__name__}: {err})"
    family = None if cap is None else plugin_mode.FAMILY_BY_MAJOR.get(cap[0])
    wanted = mode is not None and family is not None and mode in ("auto", family)
    print(f"  GPU: {where}; mode: {mode or 'off'}; route: "
          + (plugin_mode.DESCRIBED[family] if wanted else "none (nothing is patched on this GPU with this setting)"))
    failed = False
    for engine, (group, target) in ENTRY_POINTS.items():
        try:
            version = importlib.metadata.version(engine)
        except importlib.metadata.PackageNotFoundError:
            version = getattr(sys.modules.get(engine), "__version__", None) if engine in sys.modules else None
        if version is None:
            try:
                version = importlib.import_module(engine).__dict__.get("__version__", "unknown")
            except Exception:
                print(f"  {engine}: not installed in this environment")
                continue
        declared = [ep.value for ep in importlib.metadata.entry_points(group=group) if ep.name == "dsv4_sparse_mla"]
        print(f"  {engine} {version}: entry point {group} dsv4_sparse_mla -> "
              + (", ".join(declared) if declared else f"not declared (this package is not installed here; {target})"))
        if not wanted:
            continue
        lines, error = _apply(engine, family, lambda: cap)
        if error is not None:
            failed = True
            print(f"    plugin raised {error}")
        print("\n".join(lines))
    if wanted and family == "sm90":
        from .sm90_route import route_table

        try:
            table = route_table()
        except ValueError as err:
            print(f"  {err}")
            return 1
        print("\n".join(route_lines(table)))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
