"""The ``torch.ops.dsv4_mla`` op (CPU): its schema (``sm_scale`` handed over as given) and the
fake implementation torch.compile traces."""

import re

import pytest
import torch

from cute_kernels.sparse_mla_decode.kv_format import V32_FP8
from dispatch import torch_ops  # noqa: F401  (registers torch.ops.dsv4_mla.sparse_mla_decode)


def test_torch_op_takes_the_format():
    """The op's schema has kv_format; its fake gives out the format's value width (every
    format's D_V) from q's shape alone, as torch.compile traces it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    schema = str(torch.ops.dsv4_mla.sparse_mla_decode.default._schema)
    assert "str? kv_format=None" in schema
    with FakeTensorMode():
        q = torch.empty(3, 16, 576, dtype=torch.bfloat16)
        out, lse = torch.ops.dsv4_mla.sparse_mla_decode(q, torch.empty(4, 64, 1, 656, dtype=torch.uint8),
                                                        torch.empty(3, 8, dtype=torch.int32), 0.1, kv_format="v32_fp8")
        assert out.shape == (3, 16, V32_FP8.d_v) and lse.shape == (3, 16)


def test_torch_op_hands_sm_scale_over_as_given():
    """``sm_scale`` is a ``Scalar`` in the op's schema: a bool reaches the library's rule and is
    refused (a ``float`` schema would have made it 1.0); an int is a number."""
    from dispatch import InvalidDecodeInput
    from dispatch.runtime.decode_inputs import SCALE_RULE
    from dispatch.tools.sample_inputs import make_cache, make_indices

    assert "Scalar sm_scale" in str(torch.ops.dsv4_mla.sparse_mla_decode.default._schema)
    args = (torch.randn(2, 16, 512).bfloat16(), make_cache(4, 64, device="cpu"), make_indices(2, 8, 256, device="cpu"))
    with pytest.raises(InvalidDecodeInput, match=re.escape(f"{SCALE_RULE}, got True")):
        torch.ops.dsv4_mla.sparse_mla_decode(*args, True)
    with pytest.raises(InvalidDecodeInput, match="the kernels run on CUDA devices only"):  # accepted up to the device
        torch.ops.dsv4_mla.sparse_mla_decode(*args, 1)
