"""The DSV4 decode call metadata and the errors that name it.

Every refusal of the public API is an ``InvalidDecodeInput`` (a ``ValueError``) raised before
anything touches the GPU. Its message names the call's shape so the user can act on it:
model type, num_tokens, num_heads, topk, d_qk, page_block_size and extra_topk, then what
was expected.
"""

from __future__ import annotations

from dataclasses import dataclass

MODEL_TYPE = "DeepSeek-V4 sparse MLA decode (MODEL1 FP8 cache)"


@dataclass(frozen=True)
class DecodeMetadata:
    """What a decode call is, as far as kernels and errors care. Unknown fields are None."""

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

    def describe(self) -> str:
        def show(v):
            return "?" if v is None else str(v)

        text = (
            f"{MODEL_TYPE}: num_tokens={show(self.num_tokens)}, num_heads={show(self.num_heads)}, "
            f"topk={show(self.topk)}, d_qk={show(self.d_qk)}, page_block_size={show(self.page_block_size)}, "
            f"extra_topk={show(self.extra_topk)}"
        )
        if self.extra_page_block_size is not None:
            text += f", extra_page_block_size={self.extra_page_block_size}"
        return text


class InvalidDecodeInput(ValueError):
    """An input the decode API refuses; the message names the call and what was expected."""

    def __init__(self, metadata: DecodeMetadata, problem: str):
        self.metadata = metadata
        self.problem = problem
        super().__init__(f"{metadata.describe()}: {problem}")
