"""Dispatch: decode metadata -> compiled kernel variant -> launch. The public API lives here.

- ``sparse_mla_decode``: one call, its layout validated once and its plan reused (the torch custom op
  ``torch.ops.dsv4_mla.sparse_mla_decode`` calls it), on a cache of any format of
  ``dispatch.kv_formats`` (``FORMATS``; ``pack`` / ``unpack`` make and read caches);
- ``plan_sparse_mla_decode``: validate once, then ``plan.run`` / ``plan.bind(...).run()`` on
  every step (allocation-free, CUDA-graph safe);
- ``InvalidDecodeInput``: every refusal, before any GPU work; ``MissingAotVariant``: a kernel
  with no prebuilt object while compiling is switched off (``DSV4_MLA_REQUIRE_AOT``);
- ``convert_lse`` / ``LSE_CONVENTIONS``: the lse conventions (``dispatch.runtime.lse``);
- ``plan_cache_info`` / ``clear_plan_cache``: what the one-shot call's plan cache holds, and dropping it;
- ``dispatch.engines``: the engines' call shapes (FlashMLA's, FlashInfer's, SGLang's), the opt-in
  vLLM / SGLang plugins and the Hopper route.

The modules directly in ``dispatch/`` are what users import; the machinery sits in wings, each
importing only from those before it: ``policy`` (a call's metadata, compute path, head groups,
split, variants and the deployment registry), ``runtime`` (a call's tensors as one record, plans,
the plan cache, the loader of compiled kernels, the lse conventions), then the public modules,
then ``engines`` (the engines' call shapes and plugins), then ``tools`` (the console commands:
AOT build and check, self-test, the Hopper route's table; sample inputs, accuracy bounds, timing).
"""

from . import torch_ops  # noqa: F401  (registers torch.ops.dsv4_mla.sparse_mla_decode)
from .api import clear_plan_cache, plan_cache_info, plan_sparse_mla_decode, sparse_mla_decode, validate_call
from .policy.call_metadata import DecodeMetadata, InvalidDecodeInput
from .policy.selection import PlanOverrides
from .runtime.loader import MissingAotVariant
from .runtime.lse import LSE_CONVENTIONS, convert_lse

__all__ = ["sparse_mla_decode", "plan_sparse_mla_decode", "validate_call", "DecodeMetadata", "InvalidDecodeInput",
           "PlanOverrides", "plan_cache_info", "clear_plan_cache", "MissingAotVariant", "LSE_CONVENTIONS",
           "convert_lse"]
