"""The lse conventions (CPU): ``convert_lse``'s "natural_with_sink" against "log2_with_sink"."""

import math

import torch

from dispatch.runtime.lse import convert_lse


def test_natural_with_sink_is_the_log2_convention_in_natural_units():
    lse = torch.tensor([[0.5, math.inf], [math.inf, 2.0]])  # [T, H]; +inf: a token with no valid entry
    sink = torch.tensor([1.0, -math.inf])
    natural = convert_lse(lse, sink, "natural_with_sink")
    assert torch.allclose(natural, convert_lse(lse, sink, "log2_with_sink") * math.log(2), rtol=0, atol=1e-6)
    assert natural[1, 0] == 1.0  # empty: the sink alone
    assert natural[0, 1] == -math.inf and natural[1, 1] == 2.0  # a -inf sink: empty stays ln 0, the rest unchanged
    assert torch.allclose(natural[0, 0], torch.logaddexp(torch.tensor(0.5), torch.tensor(1.0)))
