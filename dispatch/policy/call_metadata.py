"""The decode call metadata and the errors that name it.

Every refusal of the public API is an ``InvalidDecodeInput`` (a ``ValueError``) raised before
anything touches the GPU. Its message names the call's shape so the user can act on it:
the model type of the call's cache format (``KvFormat.model_type``), num_tokens, num_heads,
topk, d_qk, page_block_size and extra_topk, then what was expected. Where the format is not
known (an unknown ``kv_format`` name, a cache whose width names no format or more than one),
the message starts with ``GENERIC_MODEL_TYPE`` instead: naming a model the cache may not be
would mislead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cute_kernels.sparse_mla_decode.kv_format import FORMATS

GENERIC_MODEL_TYPE = "Sparse MLA decode (cache format not determined)"


@dataclass(frozen=True)
class DecodeMetadata:
    """What a decode call is, as far as kernels and errors care. Unknown fields are None.

    kv_format: the cache format's name (``kv_format.FORMATS``), None where it is not known.
    extra_kv_format: the extra cache's format where it is another than ``kv_format`` (the call
    then runs a partial kernel per list: ``selection.select_kernels``), else None.
    d_qk: the QK width of the call's q (what it was given, which a refusal may then compare
    with the format's)."""

    num_tokens: int | None = None
    num_heads: int | None = None
    d_qk: int | None = None
    topk: int | None = None
    page_block_size: int | None = None
    extra_topk: int | None = None
    extra_page_block_size: int | None = None
    has_topk_length: bool = False
    has_extra_topk_length: bool = False
    has_sink: bool = False
    kv_format: str | None = None
    extra_kv_format: str | None = None

    @property
    def mixed(self) -> bool:
        """Whether the two lists are read in two formats (an extra list of another format)."""
        return self.extra_kv_format is not None and self.extra_kv_format != self.kv_format and bool(self.extra_topk)

    def list_calls(self) -> tuple["DecodeMetadata", "DecodeMetadata"]:
        """A mixed call as two calls of one format each: the main list alone, and the extra
        list as the main list of a call of its own format (its lengths, page, no extra list)."""
        main = replace(self, extra_topk=0, extra_page_block_size=None, has_extra_topk_length=False,
                       extra_kv_format=None)
        extra = replace(main, topk=self.extra_topk, page_block_size=self.extra_page_block_size,
                        has_topk_length=self.has_extra_topk_length, kv_format=self.extra_kv_format)
        return main, extra

    @property
    def model_type(self) -> str:
        """What starts the call's messages: the format's model type, or the generic one."""
        fmt = FORMATS.get(self.kv_format) if isinstance(self.kv_format, str) else None
        return GENERIC_MODEL_TYPE if fmt is None else fmt.model_type

    def describe(self) -> str:
        def show(v):
            return "?" if v is None else str(v)

        text = (
            f"{self.model_type}: num_tokens={show(self.num_tokens)}, num_heads={show(self.num_heads)}, "
            f"topk={show(self.topk)}, d_qk={show(self.d_qk)}, page_block_size={show(self.page_block_size)}, "
            f"extra_topk={show(self.extra_topk)}"
        )
        if self.extra_page_block_size is not None:
            text += f", extra_page_block_size={self.extra_page_block_size}"
        if self.extra_kv_format is not None and self.extra_kv_format != self.kv_format:
            text += f", extra_kv_format={self.extra_kv_format}"
        return text


class InvalidDecodeInput(ValueError):
    """An input the decode API refuses; the message names the call and what was expected."""

    def __init__(self, metadata: DecodeMetadata, problem: str):
        self.metadata = metadata
        self.problem = problem
        super().__init__(f"{metadata.describe()}: {problem}")
