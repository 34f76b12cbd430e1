"""Dispatch: DSV4 decode metadata -> compiled kernel variant -> launch. The public API lives here."""

from .api import plan_sparse_mla_decode, sparse_mla_decode, validate_call
from .metadata import DecodeMetadata, InvalidDecodeInput
from . import torch_ops  # noqa: F401  (registers torch.ops.dsv4_mla.sparse_mla_decode)

__all__ = ["sparse_mla_decode", "plan_sparse_mla_decode", "validate_call", "DecodeMetadata", "InvalidDecodeInput"]
