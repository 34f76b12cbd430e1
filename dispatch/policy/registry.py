"""The deployment grid, as data: the shapes serving engines run, per cache format.

This is the single source of truth for what the offline AOT build compiles
(``dsv4-mla-aot-build`` builds ``registry_variants(arch)``): the variants the dispatch selects
(``selection.select_kernels``, what ``DecodePlan`` plans with) for these calls:

- DeepSeek-V4 (MODEL1 cache): heads per GPU for TP 1 to 16 of V4-Flash, V4-Pro and
  V4.1-Flash, the main and extra top-k widths and page sizes serving engines use,
  speculative-draft widths; V4-Flash and V4-Pro again on the NVFP4 cache (``model1_nvfp4``),
  and with either record for the main cache and the other for the extra cache;
- DeepSeek-V4.1-Flash on its own records: the 528-byte FP8 main cache (footer or inline
  scales) with an extra cache of the same record or of the 288-byte NVFP4 record (the same
  scale placement);
- DeepSeek-V3.2 and GLM-5.x (the 656-byte V3.2 rows): their heads per GPU, the indexer's
  top-k of 2048, page 64;
- GLM-5.3 (528-byte rope-free rows): 64, 32 and 16 heads (TP 1, 2, 4), top-k 2176, page 64
  (its 528- and 656-byte row pitches are a runtime value: nothing more to build; the 16 heads
  are where the dispatch picks its one-group final-mode kernels);

each with every combination of the optional inputs (lengths, sink; the extra list's lengths
where the format has an extra cache) with one split (final mode) and several splits
(partial + merge). ``tests/test_registry.py::test_registry_is_what_plans_select`` plans a
sample of these calls as a call is planned and checks that each plan selects what
``registry_calls`` says, all of it in ``registry_variants``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from cute_kernels.arch import arch_facts
from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT, get_format

from .call_metadata import DecodeMetadata
from .selection import select_kernels
from .precision import format_precisions, precisions_for
from .variant_space import KernelVariant


@dataclass(frozen=True)
class DeploymentShape:
    model: str
    num_heads: int  # query heads per GPU
    topk: int
    page_block_size: int
    extra_topk: int = 0
    extra_page_block_size: int | None = None
    kv_format: str = DEFAULT_FORMAT  # the cache format (``kv_format.FORMATS``)
    extra_kv_format: str | None = None  # the extra cache's, where it is another (``KvFormat.extras``)


@dataclass(frozen=True)
class Model:
    """A model the registry serves: its name in the shapes, its query heads in all, the
    tensor-parallel degrees it is deployed at (heads per GPU = heads / tp) and whether its
    attention has a learned sink per head (DeepSeek-V4 and V4.1: the ``sinks`` vLLM passes
    FlashInfer's call; DeepSeek-V3.2 and GLM-5.x have none)."""

    name: str
    heads: int
    tps: tuple[int, ...]
    attn_sink: bool

    def heads_per_gpu(self) -> tuple[int, ...]:
        return tuple(self.heads // tp for tp in self.tps)


# by the name users give (``dsv4-mla-selftest --model``)
MODELS = {
    "deepseek-v4-flash": Model("V4-Flash", 64, (1, 2, 4, 8, 16), attn_sink=True),
    "deepseek-v4-pro": Model("V4-Pro", 128, (1, 2, 4, 8, 16), attn_sink=True),
    "deepseek-v4.1-flash": Model("V4.1-Flash", 64, (1, 2, 4, 8), attn_sink=True),
    "deepseek-v3.2": Model("DeepSeek-V3.2", 128, (1, 2, 4, 8, 16), attn_sink=False),
    "glm-5": Model("GLM-5.x", 64, (1, 2, 4, 8, 16), attn_sink=False),
    "glm-5.3": Model("GLM-5.3", 64, (1, 2, 4), attn_sink=False),
}
_BY_NAME = {m.name: m for m in MODELS.values()}

# the inline-scale formats' models: (model, format, topk, page)
_INDEXER_MODELS = (
    ("DeepSeek-V3.2", "v32_fp8", 2048, 64),
    ("GLM-5.x", "v32_fp8", 2048, 64),
    ("GLM-5.3", "glm_nope_fp8", 2176, 64),
)


def _shapes() -> list[DeploymentShape]:
    out = []
    heads = {name: _BY_NAME[name].heads_per_gpu() for name in ("V4-Flash", "V4-Pro", "V4.1-Flash")}
    # DeepSeek-V4 in either of its cache formats (FP8 or NVFP4, main and extra, in any pairing);
    # V4.1 as vLLM keeps it on SM120, in V4's FP8 record, and in its own records (FlashInfer's
    # and b12x's writers: FP8 main, FP8 or NVFP4 extra, footer or inline scales)
    v4_pairs = (("model1_fp8", None), ("model1_nvfp4", None), ("model1_fp8", "model1_nvfp4"),
                ("model1_nvfp4", "model1_fp8"))
    v41_pairs = (("model1_fp8", None), ("v41_fp8", None), ("v41_fp8", "v41_nvfp4"), ("v41_fp8_inline", None),
                 ("v41_fp8_inline", "v41_nvfp4_inline"))
    for model, hs in heads.items():
        for (fmt, extra_fmt), h in itertools.product(v4_pairs if model != "V4.1-Flash" else v41_pairs, hs):
            main_topk = 128 if model != "V4.1-Flash" else 1152
            if extra_fmt is None:  # the main cache alone, where its format pairs with itself
                for topk, page in itertools.product((128, 192, 256, 512) if model != "V4.1-Flash" else (1152,),
                                                    (64, 256)):
                    out.append(DeploymentShape(model, h, topk, page, kv_format=fmt))
            extras = {"V4-Flash": ((512, 64), (1024, 2), (8192, 2)),
                      "V4-Pro": ((1024, 64), (1024, 2), (8192, 2)),
                      "V4.1-Flash": ((512, 32), (512, 128), (512, 256))}[model]
            for extra_topk, extra_page in extras:
                out.append(DeploymentShape(model, h, main_topk, 64, extra_topk, extra_page, kv_format=fmt,
                                           extra_kv_format=extra_fmt))
    for model, kv_format, topk, page in _INDEXER_MODELS:
        out += [DeploymentShape(model, h, topk, page, kv_format=kv_format) for h in _BY_NAME[model].heads_per_gpu()]
    return out


DEPLOYMENT_SHAPES = tuple(_shapes())
# num_tokens that reach decode: 1 token to prefill-sized calls (one split and several)
DEPLOYMENT_NUM_TOKENS = (1, 2, 8, 64, 256, 4096)
# shared memory per SM as the CUDA runtime reports it (``cute_kernels.arch``)
SM120_SMEM_PER_SM = arch_facts("sm_120a").smem_per_sm
H200_SMEM_PER_SM = arch_facts("sm_90a").smem_per_sm
# SM counts of the targets: RTX PRO 6000, RTX 5090, DGX Spark GB10 and the H200 test GPU. Every
# arch's build is planned for all of them (an SM count is a runtime value), each with the
# arch's own shared memory per SM (``Arch.smem_per_sm``: what decides the CTAs per SM)
DEPLOYMENT_SM_COUNTS = (188, 170, 48, 132)


def deployment_calls(precision: str, arch: str):
    """Every call of the deployment grid with the ``precision`` compute path for ``arch``, as
    (metadata, SM count): the shapes of every format that has that path
    (``precision.format_precisions``), with each combination of the optional inputs, on each
    of ``DEPLOYMENT_NUM_TOKENS`` and ``DEPLOYMENT_SM_COUNTS``."""
    for shape, flags in itertools.product(DEPLOYMENT_SHAPES, itertools.product((False, True), repeat=3)):
        has_len, has_extra_len, has_sink = flags
        formats = (shape.kv_format,) + ((shape.extra_kv_format,) if shape.extra_kv_format else ())
        if (has_extra_len and shape.extra_topk == 0) or any(precision not in format_precisions(arch, f)
                                                             for f in formats):
            continue
        for T, sms in itertools.product(DEPLOYMENT_NUM_TOKENS, DEPLOYMENT_SM_COUNTS):
            md = DecodeMetadata(num_tokens=T, num_heads=shape.num_heads, d_qk=get_format(shape.kv_format).d_qk,
                                topk=shape.topk, page_block_size=shape.page_block_size, extra_topk=shape.extra_topk,
                                extra_page_block_size=shape.extra_page_block_size, has_topk_length=has_len,
                                has_extra_topk_length=has_extra_len, has_sink=has_sink, kv_format=shape.kv_format,
                                extra_kv_format=shape.extra_kv_format)
            yield md, sms


def registry_calls(precision: str, arch: str):
    """Every (metadata, num_splits, head_groups, two_ctas_per_sm) the dispatch selects
    (``selection.select_kernels``) for the deployment calls (``deployment_calls``) with the
    ``precision`` compute path on ``arch``, with the arch's shared memory per SM, in
    ``deployment_calls``' order. For a call of two cache formats (``DecodeMetadata.mixed``)
    these are the call's total splits and its main list's head groups and bound; its kernels:
    ``select_kernels(...).variants``."""
    smem_per_sm = arch_facts(arch).smem_per_sm
    for md, sms in deployment_calls(precision, arch):
        selection = select_kernels(md, arch, num_sms=sms, smem_per_sm=smem_per_sm, precision=precision)
        yield md, selection.num_splits, selection.head_groups, selection.two_ctas_per_sm


def registry_variants(arch: str) -> list[KernelVariant]:
    """The variants the AOT build compiles for ``arch``, in a stable order: every format's,
    those the dispatch selects (``selection.select_kernels``) for the deployment calls."""
    smem_per_sm = arch_facts(arch).smem_per_sm
    found = {}
    for precision in precisions_for(arch):  # every path a caller can ask for, not only the default
        for md, sms in deployment_calls(precision, arch):
            for v in select_kernels(md, arch, num_sms=sms, smem_per_sm=smem_per_sm, precision=precision).variants:
                found.setdefault(v.name, v)
    return [found[name] for name in sorted(found)]
