"""The inputs several CPU test files of the dispatch share: a call's metadata and tensors, the
caches of each format (drawn from one seeded generator), and plans built on CPU tensors with
their kernels stubbed."""

import torch

from cute_kernels.sparse_mla_decode.kv_format import FORMATS, GLM_NOPE_FP8, MODEL1_FP8, V32_FP8, V41_FP8, V41_NVFP4
from dispatch.policy.call_metadata import DecodeMetadata
from dispatch.policy.registry import SM120_SMEM_PER_SM
from dispatch.runtime.decode_inputs import byte_span
from dispatch.runtime.plan import DecodePlan
from dispatch.tools.sample_inputs import make_cache, make_indices

# an RTX PRO 6000 (sm_120a, 188 SMs) for ``validate_call(_target=...)``: validation and plans with no GPU
SM120_TARGET = ("sm_120a", 188, SM120_SMEM_PER_SM)


MODEL1 = MODEL1_FP8.name


def _md(kv_format=MODEL1, **kw):
    """The metadata of a call on a ``kv_format`` cache (q as wide as the format's keys)."""
    return DecodeMetadata(kv_format=kv_format, d_qk=FORMATS[kv_format].d_qk, **kw)


def _inputs(T=2, H=16, topk=128, device="cpu"):
    """A valid MODEL1 call's q, cache and indices: what a case changes one input of."""
    cache = make_cache(4, 64, device=device)
    return dict(q=torch.randn(T, H, 512).to(torch.bfloat16), kv_cache=cache,
                indices=make_indices(T, topk, 256, device=device))


# every cache below comes from this one seeded generator, in this order: a cache's bytes depend
# on the draws before it
_GEN = torch.Generator().manual_seed(0)
V32_CACHE = make_cache(4, 64, device="cpu", kv_format=V32_FP8.name, gen=_GEN)  # [4, 64, 1, 656]
GLM_CACHE = make_cache(4, 64, device="cpu", kv_format=GLM_NOPE_FP8.name, gen=_GEN)  # [4, 64, 1, 528]
GLM_POOL_CACHE = make_cache(4, 64, device="cpu", kv_format=GLM_NOPE_FP8.name, row_stride=656, gen=_GEN)  # 656 wide
NVFP4_CACHE = make_cache(4, 64, device="cpu", kv_format="model1_nvfp4", gen=_GEN)  # [4, 64, 1, 384]
V41_CACHE = make_cache(4, 64, device="cpu", kv_format=V41_FP8.name, gen=_GEN)  # [4, 64, 1, 528]
V41_NVFP4_CACHE = make_cache(2, 64, device="cpu", kv_format=V41_NVFP4.name, gen=_GEN)  # [2, 64, 1, 288]
# V4.1 inline records in blocks padded by two rows: indices count rows of the whole cache (66 a block)
V41_INLINE_PADDED_CACHE = make_cache(4, 64, device="cpu", kv_format="v41_fp8_inline", block_stride=66 * 528, gen=_GEN)

_EXTRA_IDX = torch.zeros(2, 64, dtype=torch.int32)

# q [B=2, S=2, H, 512]: 4 tokens whose lengths may come as [2, 2]
_BATCHED = dict(q=torch.randn(2, 2, 16, 512).to(torch.bfloat16), indices=make_indices(4, 128, 256, device="cpu"))
# [2, 2] int32 rows 4 apart: no [4] view of it exists (reshape would copy, and the kernels read the original)
_STRIDED_ROWS = torch.zeros(2, 4, dtype=torch.int32)[:, :2]


def _stub_kernels(monkeypatch):
    """Plans whose kernels are stubbed: their checks run, nothing is compiled or launched."""
    from dispatch.runtime import loader

    monkeypatch.setattr(loader, "get_compiled", lambda variant: None)
    monkeypatch.setattr(DecodePlan, "_make_kernels", lambda self, values: [])


def _cpu_plan(monkeypatch, precision="f16", **kwargs):
    """A plan built on CPU tensors for sm_120a (``validate_call``'s ``_target``), with its
    kernels stubbed: its checks run, nothing is compiled or launched."""
    from dispatch.api import validate_call

    _stub_kernels(monkeypatch)
    base = _inputs()
    base.update(kwargs)
    call = validate_call(base.pop("q"), base.pop("kv_cache"), base.pop("indices"), precision=precision,
                         _target=SM120_TARGET, **base)
    return DecodePlan(call), call


def _misaligned(t: torch.Tensor, offset_bytes: int) -> torch.Tensor:
    """``t``'s values in a view of its shape and strides whose address is ``offset_bytes`` past
    a 256-byte boundary: any byte, even inside an element (the view is over a Python buffer,
    which torch reads as any dtype at any address)."""
    span = byte_span(t)
    buffer = bytearray(span + 256)
    start = -torch.frombuffer(buffer, dtype=torch.uint8).data_ptr() % 256 + offset_bytes
    view = torch.as_strided(torch.frombuffer(buffer, dtype=t.dtype, count=span // t.element_size(), offset=start),
                            t.shape, t.stride())
    view.copy_(t)
    return view
