"""Run by ``tests/test_real_engines.py``, one process per engine and GPU family: a released
engine (its wheel unpacked, ahead of everything on ``sys.path``) loads this package's plugin
through its own plugin loader on a GPU it is told it has, then its own call sites are run
with CPU tensors; what happened is written as JSON for the tests to assert on.

    python tests/engine_probe.py vllm|sglang --gpu MAJOR.MINOR [--gpu ...] --out FILE
        [--flash-mla] [--attention-classes]
    python tests/engine_probe.py status --out FILE [--flash-mla] -- ARGS   (runs dsv4-mla-engines ARGS)

What the probe observes is recorded, not judged: which object each engine name holds before
and after the loader ran, what a call raised (type, message, the frames it passed through),
the log lines. A missing package stops it with ``{"missing_package": ...}`` in the JSON
(the tests skip on it); anything else that goes wrong fails the process.

Two stand-ins, each for a compiled library that cannot load without CUDA, so that the engines'
Python imports on a CPU machine:
- ``torchvision``: where its compiled ops do not load (its PyPI wheel is built against CUDA
  torch), the two operator schemas (``nms``, ``qnms``) its Python registers fake kernels for
  unconditionally are defined first; vLLM's and SGLang's imports reach torchvision through
  transformers and SGLang's multimodal configs, never its ops;
- ``flash_mla`` (``--flash-mla``, the ``sgl-flash-mla`` wheel SGLang requires, unpacked on ``PYTHONPATH``): its
  own Python, with ``flash_mla._loader`` (which loads the CUDA extensions) replaced by one whose
  ``get_ops`` raises; SGLang's ``flash_mla_interface`` imports the package at its import.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import runpy
import sys
import traceback
import types
from pathlib import Path
from types import SimpleNamespace as NS

import torch

from dispatch.engines.status import _described as described

# the modules whose names the plugins patch, imported before the engine's loader runs (a module
# imported afterwards binds whatever the loader left in the module it imports from)
VLLM_SM120_MODULES = ("vllm.utils.flashinfer", "vllm.models.deepseek_v4.nvidia.flashinfer_sparse",
                      "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120")
VLLM_SM90_MODULES = ("vllm.v1.attention.ops.flashmla", "vllm.models.deepseek_v4.nvidia.flashmla",
                     "vllm.v1.attention.backends.mla.flashmla_sparse")
# DeepSeek-V4.1's modules (its FlashMLA module imports its FlashInfer one): on sm_120 first
# imported after the loader ran, as vLLM imports a model's modules when it builds the model
VLLM_V41_MODULES = ("vllm.models.deepseek_v41.nvidia.flashinfer_sparse", "vllm.models.deepseek_v41.nvidia.flashmla")
VLLM_MODEL_MODULES = ("vllm.models.deepseek_v4.nvidia.model", "vllm.models.deepseek_v41.nvidia.model")
SGLANG_MODULES = ("sglang.srt.plugins", "sglang.kernels.ops.attention.flash_mla_sm120",
                  "sglang.srt.layers.attention.deepseek_v4_backend", "sglang.srt.layers.attention.dsa_backend")
SGLANG_SM90_MODULE = "sglang.kernels.ops.attention.flash_mla_interface"
# the heads of a layer in the calls below: 16 per GPU (DeepSeek-V4-Pro / V3.2 at TP 8, V4-Flash at TP 4)
HEADS = 16
# the cache record widths, as the engines view them (bytes)
MODEL1_BYTES, V32_BYTES, GLM_NOPE_BYTES, PAGE_ALIGN = 584, 656, 528, 576


# ---------------------------------------------------------------------- observing
class Records(logging.Handler):
    """Every log record emitted while attached (each once, whichever logger it reached)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: dict[int, logging.LogRecord] = {}

    def emit(self, record):
        self.records.setdefault(id(record), record)

    def take(self) -> list[dict]:
        lines = [{"logger": r.name, "level": r.levelname, "message": r.getMessage()}
                 for r in sorted(self.records.values(), key=lambda r: r.created)]
        self.records.clear()
        return lines


RECORDS = Records()


def listen(*logger_names: str) -> None:
    for name in ("", *logger_names):
        logging.getLogger(name).addHandler(RECORDS)


def resolve(path: str):
    """The object at a dotted path (an attribute of an imported module, or of its class)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is not None:
            obj = module
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            return obj
    raise LookupError(f"{path}: its module is not imported")


def resolvable(path: str) -> bool:
    """Whether the module holding ``path`` is imported."""
    try:
        resolve(path)
    except (LookupError, AttributeError):
        return False
    return True


def library_name(obj) -> str | None:
    """The dotted name of the function of ``dispatch.engines`` that ``obj`` is, None for any other."""
    from dispatch.engines import flashinfer_dsv4, flashinfer_mla, flashmla, sglang_plugin

    for module in (flashinfer_dsv4, flashinfer_mla, flashmla, sglang_plugin):
        for name, value in vars(module).items():
            if value is obj:
                return f"{module.__name__}.{name}"
    return None


def state(paths, before: dict) -> dict:
    """For each path: what it holds now, whether that is what it held before the loader ran,
    what it wraps (``__wrapped__``: described, a library function's name, whether it is the
    object held before)."""
    seen = {}
    for path in paths:
        now = resolve(path)
        inner = getattr(now, "__wrapped__", None)
        seen[path] = {"now": described(now), "unchanged": path in before and now is before[path],
                      "loaded_before": path in before,
                      "wraps": None if inner is None else described(inner), "wraps_library": library_name(inner),
                      "wraps_original": inner is not None and path in before and inner is before[path]}
    return seen


def outcome(fn, *args, **kwargs) -> dict:
    """What calling ``fn`` did: the exception's type, whether it is this library's
    ``InvalidDecodeInput``, its message and the (file, function) of each frame it passed."""
    from dispatch import InvalidDecodeInput

    try:
        result = fn(*args, **kwargs)
    except Exception as err:  # recorded, for the tests to judge
        frames = [(str(Path(f.filename).resolve()), f.name) for f in traceback.extract_tb(err.__traceback__)]
        return {"raised": described(type(err)), "invalid_decode_input": isinstance(err, InvalidDecodeInput),
                "message": str(err), "frames": frames}
    return {"raised": None, "returned": type(result).__name__}


# ---------------------------------------------------------------------- stand-ins
def torchvision_ops_stand_in() -> None:
    """Make ``import torchvision`` work where its compiled ops do not load (module docstring)."""
    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
        return
    except RuntimeError as err:
        if "torchvision::nms" not in str(err):
            raise
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    library = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    torchvision_ops_stand_in.library = library  # the schemas live as long as the library object
    import torchvision  # noqa: F401,F811


def flash_mla_stand_in() -> None:
    """The ``flash_mla`` package of the unpacked ``sgl-flash-mla`` wheel (on ``PYTHONPATH``), its
    extension loader replaced (module docstring)."""
    def get_ops(use_legacy: bool):
        raise RuntimeError("flash_mla's CUDA kernels are not loaded in this process (engine_probe stand-in)")

    loader = types.ModuleType("flash_mla._loader")
    loader.get_ops, loader.has_legacy = get_ops, (lambda: False)
    sys.modules["flash_mla._loader"] = loader
    import flash_mla  # noqa: F401


def import_all(names) -> None:
    for name in names:
        importlib.import_module(name)


# ---------------------------------------------------------------------- tensors as the engines make them
def record_pool(pages: int, page_tokens: int, width: int = MODEL1_BYTES, dtype=torch.uint8) -> torch.Tensor:
    """A paged cache as vLLM and SGLang allocate DeepSeek-V4's: ``[pages, page_tokens, width]``
    over a buffer whose pages are padded to a multiple of 576 bytes (vLLM's
    ``packed_page_alignment``, SGLang's ``KVLayout.page_bytes``)."""
    page_bytes = math.ceil(page_tokens * width / PAGE_ALIGN) * PAGE_ALIGN
    buffer = torch.zeros(pages, page_bytes, dtype=torch.uint8)
    return buffer[:, :page_tokens * width].view(dtype).view(pages, page_tokens, width)


def slots(tokens: int, width: int, rows: int | None = None) -> torch.Tensor:
    """``[tokens, 1, width]`` int32 cache slots (-1 past the first few), a view of a buffer of
    ``rows`` slots per token where the engine keeps a wider one."""
    buffer = torch.full((tokens, rows or width), -1, dtype=torch.int32)
    buffer[:, :4] = torch.arange(4, dtype=torch.int32)
    return buffer[:, :width].view(tokens, 1, width)


def lengths(tokens: int, value: int = 4) -> torch.Tensor:
    return torch.full((tokens,), value, dtype=torch.int32)


def sink(padded: int, real: int = HEADS) -> torch.Tensor:
    """vLLM's attention sink: the layer's heads, -inf in the padded ones (``make_attention_sink``)."""
    values = torch.full((padded,), -math.inf)
    values[:real] = 0.0
    return values


def bare(cls, **attrs):
    """An instance of the engine's layer class with only the attributes its method reads (its
    ``__init__`` builds weights and needs a GPU)."""
    obj = cls.__new__(cls)
    if isinstance(obj, torch.nn.Module):
        torch.nn.Module.__init__(obj)
    for name, value in attrs.items():
        object.__setattr__(obj, name, value)
    return obj


# ---------------------------------------------------------------------- vLLM
def fake_vllm_gpu(capability) -> None:
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    cap = DeviceCapability(*capability)
    type(current_platform).get_device_capability = classmethod(lambda cls, device_id=0: cap)


def vllm_names(family: str) -> list[str]:
    from dispatch.engines import vllm_plugin as p

    if family == "sm120":
        callers = [f"{c}.{name}" for name, _, cs in p.SM120_BINDINGS for c in cs]
        return ([f"{p.FLASHINFER_BINDINGS}.{name}" for name, _, _ in p.SM120_BINDINGS]
                + [f"{p.FLASHINFER_BINDINGS}.{p.SM120_SHAPE_CHECK}"] + callers)
    return ([".".join(p.SM90_FLASHMLA)] + [f"{c}.{p.SM90_FLASHMLA[1]}" for c in p.SM90_CALLERS]
            + [f"{m}.{c}.{f}" for m, c, f, *_ in p.SM90_SITES])


def run_vllm_loader() -> tuple[list[dict], bool]:
    """vLLM's own plugin loader, as each vLLM process runs it (its once-per-process guard reset):
    the log lines it produced, and whether the guard was already set."""
    import vllm.plugins

    was_loaded = vllm.plugins.plugins_loaded
    vllm.plugins.plugins_loaded = False
    RECORDS.take()
    vllm.plugins.load_general_plugins()
    return RECORDS.take(), was_loaded


def vllm_sm120_calls() -> dict:
    """vLLM's SM120 call sites, run by vLLM's own methods on CPU tensors shaped as vLLM makes them."""
    v4 = importlib.import_module("vllm.models.deepseek_v4.nvidia.flashinfer_sparse")
    v41 = importlib.import_module(VLLM_V41_MODULES[0])
    mla = importlib.import_module("vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120")
    tokens, pages = 4, 8
    calls = {}
    for label, module, ratio in (("v4 decode", v4, 128), ("v4.1 decode", v41, 0)):
        # DeepseekV4FlashInferSM120Attention._forward_decode: a C128A layer (V4: the compressed
        # list precomputed at metadata build; C4A's comes from a Triton kernel) or SWA-only (V4.1)
        layer = bare(module.DeepseekV4FlashInferSM120Attention, compress_ratio=ratio, topk_indices_buffer=None,
                     swa_cache_layer=NS(kv_cache=record_pool(pages, 64)), kv_cache_torch_dtype=torch.uint8,
                     scale=512 ** -0.5, attn_sink=sink(HEADS), n_local_heads=HEADS)
        swa = NS(num_decodes=tokens, num_decode_tokens=tokens, is_valid_token=torch.ones(tokens, dtype=torch.bool),
                 token_to_req_indices=torch.arange(tokens, dtype=torch.int32), decode_swa_indices=slots(tokens, 128),
                 decode_swa_lens=lengths(tokens))
        compressed = NS(block_size=256, c128a_global_decode_topk_indices=slots(tokens, 128, rows=256),
                        c128a_decode_topk_lens=lengths(tokens))
        swa_only = ratio <= 1
        calls[label] = outcome(layer._forward_decode, q=torch.zeros(tokens, HEADS, 512, dtype=torch.bfloat16),
                               kv_cache=None if swa_only else record_pool(pages, 2), swa_metadata=swa,
                               attn_metadata=None if swa_only else compressed, swa_only=swa_only,
                               output=torch.empty(tokens, HEADS, 512, dtype=torch.bfloat16))
    # _forward_prefill of an SWA-only V4 layer: one prefill request of 6 tokens after 2 decodes
    layer = bare(v4.DeepseekV4FlashInferSM120Attention, compress_ratio=1, topk_indices_buffer=None,
                 kv_cache_torch_dtype=torch.uint8, scale=512 ** -0.5, attn_sink=sink(HEADS))
    prefill = NS(num_prefills=1, num_decodes=2, num_decode_tokens=2, num_prefill_tokens=6,
                 query_start_loc_cpu=torch.tensor([0, 1, 2, 8], dtype=torch.int32),
                 prefill_swa_indices=slots(6, 128), prefill_swa_lens=lengths(6))
    calls["v4 prefill"] = outcome(layer._forward_prefill, q=torch.zeros(6, HEADS, 512, dtype=torch.bfloat16),
                                  compressed_k_cache=None, swa_k_cache=record_pool(pages, 64),
                                  output=torch.empty(6, HEADS, 512, dtype=torch.bfloat16), attn_metadata=None,
                                  swa_metadata=prefill)
    # FlashInferMLASparseSM120Impl._run_mqa_kernel: DeepSeek-V3.2 and GLM-5 (576-wide queries,
    # 656-byte rows), GLM-5.3 (rope-free: 512-wide queries, 528-byte rows); the scale format
    # from vLLM's own rule for the model type
    for label, model_type, rope, row in (("v3.2", "deepseek_v32", 64, V32_BYTES),
                                         ("glm-5", "glm_moe_dsa", 64, V32_BYTES),
                                         ("glm-5.3 nope", "glm_moe_dsa", 0, GLM_NOPE_BYTES)):
        impl = bare(mla.FlashInferMLASparseSM120Impl, num_heads=HEADS, kv_lora_rank=512, qk_nope_head_dim=192,
                    qk_rope_head_dim=rope, scale=0.1, kv_scale_format=mla._kv_scale_format_for_model(model_type),
                    _workspace_buffer=None)
        topk = 2048
        calls[f"{label} decode"] = outcome(
            impl._run_mqa_kernel, torch.zeros(tokens, HEADS, 512 + rope, dtype=torch.bfloat16),
            torch.zeros(pages, 64, row, dtype=torch.uint8), slots(tokens, topk).view(tokens, topk))
        calls[f"{label} decode"]["kv_scale_format"] = impl.kv_scale_format
    return calls


def vllm_sm90_calls() -> dict:
    """vLLM's Hopper call sites, run by vLLM's own methods (the site wrappers the plugin put
    on them included) at a token count the route table gives to this library (4) and one it
    gives to FlashMLA (64)."""
    ops = importlib.import_module("vllm.v1.attention.ops.flashmla")
    v4 = importlib.import_module("vllm.models.deepseek_v4.nvidia.flashmla")
    v41 = importlib.import_module("vllm.models.deepseek_v41.nvidia.flashmla")
    v32 = importlib.import_module("vllm.v1.attention.backends.mla.flashmla_sparse")
    pages, padded = 8, 64
    calls = {}
    for tokens in (4, 64):
        # DeepseekV4FlashMLAAttention._forward_decode, q pre-padded to 64 heads: V4 C128A
        # (SWA pages of 64, compressed pages of 256 / 128 = 2), V4.1 SWA-only (SWA pages of 32)
        for label, module, ratio, swa_page in (("v4", v4, 128, 64), ("v4.1", v41, 0, 32)):
            layer = bare(module.DeepseekV4FlashMLAAttention, compress_ratio=ratio, topk_indices_buffer=None,
                         swa_cache_layer=NS(kv_cache=record_pool(pages, swa_page)), scale=512 ** -0.5,
                         attn_sink=sink(padded), n_local_heads=HEADS)
            sched = ops.FlashMLASchedMeta()
            swa = NS(num_decodes=tokens, num_decode_tokens=tokens, is_valid_token=torch.ones(tokens, dtype=torch.bool),
                     token_to_req_indices=torch.arange(tokens, dtype=torch.int32),
                     decode_swa_indices=slots(tokens, 128), decode_swa_lens=lengths(tokens), tile_sched_swaonly=sched,
                     tile_sched_c1a=sched, tile_sched_c2a=sched, tile_sched_c4a=sched, tile_sched_c128a=sched)
            compressed = NS(block_size=256, c128a_global_decode_topk_indices=slots(tokens, 128, rows=256),
                            c128a_decode_topk_lens=lengths(tokens))
            swa_only = ratio <= 1
            calls[f"{label} decode, {tokens} tokens"] = outcome(
                layer._forward_decode, q=torch.zeros(tokens, padded, 512, dtype=torch.bfloat16),
                kv_cache=None if swa_only else record_pool(pages, 2), swa_metadata=swa,
                attn_metadata=None if swa_only else compressed, swa_only=swa_only,
                output=torch.empty(tokens, padded, 512, dtype=torch.bfloat16))
        # FlashMLASparseImpl._fp8_flash_mla_kernel (DeepSeek-V3.2 / GLM-5, FP8 cache): the real
        # heads, padded by vLLM itself; 656-byte rows in pages of 64; the indexer's 2048
        impl = bare(v32.FlashMLASparseImpl, softmax_scale=0.1)
        metadata = NS(dummy_block_table=torch.empty(tokens, 1, dtype=torch.int32),
                      cache_lens=torch.full((tokens,), 4096, dtype=torch.int32),
                      scheduler_metadata=ops.FlashMLASchedMeta())
        calls[f"v3.2 decode, {tokens} tokens"] = outcome(
            impl._fp8_flash_mla_kernel, torch.zeros(tokens, 1, HEADS, 576, dtype=torch.bfloat16),
            torch.zeros(pages, 64, V32_BYTES, dtype=torch.uint8), slots(tokens, 2048).view(tokens, 1, 2048), metadata)
    return calls


def vllm_attention_classes() -> dict:
    """``_select_dsv4_attn_cls`` of DeepSeek-V4 and V4.1 for each GPU family and backend, as
    vLLM calls it when it builds a decoder layer (no LoRA, no prefill context parallelism,
    V4-Flash's 64 heads at TP 8); and, for V4.1, why FlashMLA's mega attention (its SM100
    default) is or is not taken on each family where vLLM's FlashMLA build were present."""
    from vllm.models.deepseek_v41.nvidia import flash_mla_mega_attn

    modules = {"v4": importlib.import_module(VLLM_MODEL_MODULES[0]),
               "v4.1": importlib.import_module(VLLM_MODEL_MODULES[1])}
    backends = modules["v4"].AttentionBackendEnum
    table, mega = {}, {}
    for capability in ((12, 0), (9, 0), (8, 0), (10, 0)):
        fake_vllm_gpu(capability)
        key = f"{capability[0]}.{capability[1]}"
        for backend in (None, "FLASHINFER_MLA_SPARSE_DSV4", "FLASHMLA_SPARSE"):
            config = NS(attention_config=NS(backend=None if backend is None else getattr(backends, backend)),
                        parallel_config=NS(prefill_context_parallel_size=1, tensor_parallel_size=8), lora_config=None,
                        model_config=NS(hf_config=NS(num_attention_heads=64, o_groups=8)))
            for model, module in modules.items():
                table[f"{model} {key} {backend or 'default'}"] = described(module._select_dsv4_attn_cls(config))
        saved = flash_mla_mega_attn.is_flashmla_sparse_supported
        flash_mla_mega_attn.is_flashmla_sparse_supported = lambda: (True, None)  # as where vLLM's FlashMLA loads
        try:
            mega[key] = list(flash_mla_mega_attn.is_flashmla_mega_attn_supported())
        finally:
            flash_mla_mega_attn.is_flashmla_sparse_supported = saved
    return {"classes": table, "mega_attention": mega,
            "mega_attention_here": list(flash_mla_mega_attn.is_flashmla_mega_attn_supported())}


def probe_vllm(args, seen: dict) -> None:
    from dispatch.engines import vllm_plugin

    listen("vllm", vllm_plugin.LOG.name)
    first = args.gpu[0]
    late = VLLM_V41_MODULES if first[0] == 12 else ()
    # (the model modules import every attention class: DeepSeek-V4.1's modules too)
    import_all(VLLM_SM120_MODULES + VLLM_SM90_MODULES + (() if late else VLLM_V41_MODULES + VLLM_MODEL_MODULES))
    seen["imported_before_loader"] = sorted(m for m in VLLM_SM120_MODULES + VLLM_SM90_MODULES + VLLM_V41_MODULES
                                            if m in sys.modules)
    names = vllm_names("sm120") + vllm_names("sm90")
    before = {n: resolve(n) for n in names if resolvable(n)}
    seen["runs"] = {}
    for capability in args.gpu:
        fake_vllm_gpu(capability)
        logs, was_loaded = run_vllm_loader()
        seen["runs"][f"{capability[0]}.{capability[1]}"] = {"logs": logs, "loader_had_run": was_loaded,
                                                           "names": state([n for n in names if resolvable(n)], before)}
    if late:
        import_all(late)
        seen["late_import"] = state(names, before)
        from vllm.utils import flashinfer

        check = getattr(flashinfer, vllm_plugin.SM120_SHAPE_CHECK)
        seen["shape_check"] = [[h, k, check(h, k)] for h in (1, 8, 16, 24, 64, 128) for k in (1, 128, 512, 640, 2048,
                                                                                              8192)]
        seen["calls"] = vllm_sm120_calls()
        seen["call_logs"] = RECORDS.take()
    elif first[0] == 9:
        seen["calls"] = vllm_sm90_calls()
        seen["call_logs"] = RECORDS.take()
    if args.attention_classes:
        seen["attention_classes"] = vllm_attention_classes()


# ---------------------------------------------------------------------- SGLang
def sglang_names(family: str) -> list[str]:
    from dispatch.engines import sglang_plugin as p

    targets = [p.SM120_TARGET, p.SM120_GLM_TARGET] if family == "sm120" else [p.SM90_TARGET]
    return targets + [path for path, *_ in p.SITE_HOOKS]


def sglang_sm120_calls() -> dict:
    """SGLang's SM120 call (``deepseek_v4_backend.py``: keywords only, the function looked up
    in its module at each call): SWA pages of 256 in SGLang's pool layout, a C4 compressed
    list; the query at the layer's 16 heads, and padded to 64 inside a site of 16 real heads
    (attention TP > 1: SGLang's V4 query padding is left uninitialised)."""
    from dispatch.engines.sites import site, within_site

    module = importlib.import_module("sglang.kernels.ops.attention.flash_mla_sm120")
    tokens, pages = 4, 8

    def call(heads):
        return module.flash_mla_with_kvcache_sm120(
            q=torch.empty(tokens, 1, heads, 512, dtype=torch.bfloat16),
            k_cache=record_pool(pages, 256, dtype=torch.float8_e4m3fn).unsqueeze(-2), head_dim_v=512,
            softmax_scale=512 ** -0.5, indices=slots(tokens, 128), topk_length=lengths(tokens),
            attn_sink=torch.zeros(heads), extra_k_cache=record_pool(pages, 64, dtype=torch.float8_e4m3fn).unsqueeze(-2),
            extra_indices_in_kvcache=slots(tokens, 512), extra_topk_length=lengths(tokens))

    calls = {"v4 decode, native heads": outcome(call, HEADS),
             "v4 decode, padded heads": outcome(within_site, site("probe", HEADS, False), call, 64)}
    # the DSA backend's GLM-5 (576-wide queries, 656-byte rows) and GLM-5.3 (rope-free, 528)
    # decode on SM120: its own _forward_flashinfer_sparse_mla, on a backend with what it reads
    dsa = importlib.import_module("sglang.srt.layers.attention.dsa_backend")
    for label, rope, row in (("glm-5", 64, V32_BYTES), ("glm-5.3 nope", 0, GLM_NOPE_BYTES)):
        backend = bare(dsa.DeepseekSparseAttnBackend, workspace_buffer=torch.empty(16, dtype=torch.uint8),
                       physical_page_size=64, kv_cache_dim=row, qk_nope_head_dim=192, kv_lora_rank=512,
                       qk_rope_head_dim=rope)
        calls[f"{label} decode"] = outcome(
            backend._forward_flashinfer_sparse_mla, q_all=torch.zeros(tokens, HEADS, 512 + rope, dtype=torch.bfloat16),
            kv_cache=torch.zeros(pages * 64, 1, row, dtype=torch.uint8).view(torch.float8_e4m3fn),
            page_table_1=slots(tokens, 2048).view(tokens, 2048), seq_lens=lengths(tokens, 2048), sm_scale=0.1,
            skip_softmax_threshold_scale_factor=None)
    return calls


def sglang_sm90_calls() -> dict:
    """SGLang's Hopper calls at a token count the route table gives to this library (4) and one
    it gives to FlashMLA (64): the DeepSeek-V4 backend's (the ``functools.partial`` of
    ``flash_mla_interface.flash_mla_with_kvcache`` with ``use_legacy=True`` it binds when it
    is built, called inside a site of 16 real heads as the backend's hooked
    ``_forward_attention`` runs it) and the DSA backend's (its own hooked
    ``_forward_flashmla_kv``, run on a backend with the attributes it reads)."""
    import functools

    from dispatch.engines.sites import site, within_site

    interface = importlib.import_module(SGLANG_SM90_MODULE)
    dsa = importlib.import_module("sglang.srt.layers.attention.dsa_backend")
    pages = 8
    calls = {}
    for tokens in (4, 64):
        bound = functools.partial(interface.flash_mla_with_kvcache, use_legacy=True)

        def v4_call():
            return bound(q=torch.empty(tokens, 1, 64, 512, dtype=torch.bfloat16),
                         k_cache=record_pool(pages, 256, dtype=torch.float8_e4m3fn).unsqueeze(-2), head_dim_v=512,
                         block_table=None, cache_seqlens=None, tile_scheduler_metadata=interface.get_mla_metadata()[0],
                         softmax_scale=512 ** -0.5, is_fp8_kvcache=True, indices=slots(tokens, 128),
                         topk_length=lengths(tokens), attn_sink=torch.zeros(64),
                         extra_k_cache=record_pool(pages, 64, dtype=torch.float8_e4m3fn).unsqueeze(-2),
                         extra_indices_in_kvcache=slots(tokens, 512), extra_topk_length=lengths(tokens))[0]

        calls[f"v4 decode, {tokens} tokens"] = outcome(within_site, site("SGLang V4 probe", HEADS, False), v4_call)
        backend = bare(dsa.DeepseekSparseAttnBackend, flashmla_kv_num_q_heads=64, physical_page_size=64,
                       kv_cache_dim=V32_BYTES, dsa_kv_cache_store_fp8=True, dsa_index_topk=2048,
                       flashmla_kv_format="V32")
        schedule = NS(flashmla_metadata=torch.zeros(8, 8, dtype=torch.int32),
                      num_splits=torch.zeros(tokens + 1, dtype=torch.int32))
        calls[f"v3.2 decode, {tokens} tokens"] = outcome(
            backend._forward_flashmla_kv, q_all=torch.zeros(tokens, HEADS, 576, dtype=torch.bfloat16),
            kv_cache=torch.zeros(pages * 64, 1, V32_BYTES, dtype=torch.uint8).view(torch.float8_e4m3fn),
            sm_scale=0.1, v_head_dim=512, layer=NS(tp_q_head_num=HEADS, head_dim=576),
            metadata=NS(dsa_cache_seqlens_int32=lengths(tokens, 2048), flashmla_metadata=schedule),
            page_table_1=slots(tokens, 2048).view(tokens, 2048))
    return calls


def probe_sglang(args, seen: dict) -> None:
    from dispatch.engines import plugin_mode, sglang_plugin

    listen("sglang", sglang_plugin.LOG.name)
    capability = args.gpu[0]
    family = plugin_mode.FAMILY_BY_MAJOR[capability[0]]
    import_all(SGLANG_MODULES + ((SGLANG_SM90_MODULE,) if family == "sm90" else ()))
    names = sglang_names(family)
    before = {n: resolve(n) for n in names}
    import sglang.srt.plugins

    plugin_mode.gpu_capability = lambda: capability  # the GPU the plugin reads (NVML, else torch)
    sglang.srt.plugins._plugins_loaded = False
    RECORDS.take()
    sglang.srt.plugins.load_plugins()
    seen["logs"] = RECORDS.take()
    seen["names"] = state(names, before)
    seen["calls"] = sglang_sm120_calls() if family == "sm120" else sglang_sm90_calls()
    seen["call_logs"] = RECORDS.take()


# ---------------------------------------------------------------------- main
def capability(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def probe_status_imports(args, seen: dict) -> None:
    """Before ``dsv4-mla-engines`` runs: the engines' modules it reaches import here."""
    import_all(VLLM_SM120_MODULES + VLLM_SM90_MODULES + VLLM_V41_MODULES + SGLANG_MODULES
               + ((SGLANG_SM90_MODULE,) if args.flash_mla else ()))


MODES = {"vllm": (probe_vllm, ("vllm.general_plugins",)), "sglang": (probe_sglang, ("sglang.srt.plugins",)),
          "status": (probe_status_imports, ("vllm.general_plugins", "sglang.srt.plugins"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", choices=list(MODES))
    ap.add_argument("--gpu", type=capability, action="append", default=[])
    ap.add_argument("--out", required=True)
    ap.add_argument("--flash-mla", action="store_true",
                    help="stand in for flash_mla's kernels (the unpacked sgl-flash-mla wheel on PYTHONPATH)")
    ap.add_argument("--attention-classes", action="store_true")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    torchvision_ops_stand_in()
    if args.flash_mla:
        flash_mla_stand_in()
    probe, groups = MODES[args.engine]
    seen = {"entry_point": [ep.value for group in groups for ep in importlib.metadata.entry_points(group=group)
                            if ep.name == "dsv4_sparse_mla"]}
    try:
        probe(args, seen)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] in ("vllm", "sglang", "dispatch", "cute_kernels", "tests"):
            raise  # a name the engine or this package moved: a failure, not a missing package
        seen = {"missing_package": f"{type(err).__name__}: {err}"}
    Path(args.out).write_text(json.dumps(seen, indent=1))
    if args.engine == "status" and "missing_package" not in seen:  # dsv4-mla-engines, as its script runs it
        sys.argv = ["dsv4-mla-engines", *argv[cut + 1:]]
        runpy.run_module("dispatch.engines.status", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
