"""The ``torch.ops.dsv4_mla`` op (CPU): its schema and the fake implementation torch.compile
traces."""

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
