"""``torch.ops.dsv4_mla.sparse_mla_decode``: the decode as a registered torch custom op.

Registered with ``torch.library.custom_op`` and a fake (meta) implementation, so
``torch.compile(fullgraph=True)`` traces a model that calls it without a graph break.
Importing ``dispatch`` registers it.

torch checks each argument against the op's schema before the implementation runs: an
argument of another kind (a string or a tensor for ``sm_scale``, a number for ``kv_format``)
is refused there, by torch (a RuntimeError naming the argument; an int past int64 an
OverflowError). ``sm_scale`` is a ``Scalar`` (``int | float | bool``): torch hands it over as
given, so that a bool is refused by the library's rule (``decode_inputs.scale_log2``) instead
of being converted to 1.0 (as a ``float`` schema would, and a 0-d tensor to its value: a read
back to the host).
"""

from __future__ import annotations

import torch

from cute_kernels.sparse_mla_decode.kv_format import D_V

from .api import sparse_mla_decode


@torch.library.custom_op("dsv4_mla::sparse_mla_decode", mutates_args=())
def sparse_mla_decode_op(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: int | float | bool,  # torch's Scalar: passed on as given (the module doc)
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    precision: str | None = None,
    kv_format: str | None = None,
    extra_kv_format: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same semantics as ``dispatch.sparse_mla_decode`` (lse: natural log, sink not folded in)."""
    return sparse_mla_decode(q, kv_cache, indices, sm_scale=sm_scale, topk_length=topk_length, attn_sink=attn_sink,
                             extra_kv_cache=extra_kv_cache, extra_indices=extra_indices,
                             extra_topk_length=extra_topk_length, precision=precision, kv_format=kv_format,
                             extra_kv_format=extra_kv_format)


@sparse_mla_decode_op.register_fake
def _(q, kv_cache, indices, sm_scale, topk_length=None, attn_sink=None, extra_kv_cache=None, extra_indices=None,
      extra_topk_length=None, precision=None, kv_format=None, extra_kv_format=None):
    """The outputs' shapes: ``out`` is D_V wide whatever the format (every format's value
    width is ``kv_format.D_V``, so the fake needs no cache to read)."""
    lead = q.shape[:-1]
    return q.new_empty(*lead, D_V), q.new_empty(*lead, dtype=torch.float32)
