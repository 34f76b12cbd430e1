"""Dispatch: DSV4 decode metadata -> compiled kernel variant -> launch. The public API lives here."""

from .api import sparse_mla_decode
from .metadata import DecodeMetadata, InvalidDecodeInput

__all__ = ["sparse_mla_decode", "DecodeMetadata", "InvalidDecodeInput"]
