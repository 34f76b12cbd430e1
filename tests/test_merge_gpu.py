"""The combine kernel alone against a float64 logsumexp combine, on a CUDA GPU.

Its inputs are what the partial kernel writes per (token, split, head): the split's
normalized output (f32) and its lse in log2 units, -inf with an output of 0 for a split with
no valid entry. Every split-count class (one batch, a full batch, several batches, the most
one merge takes), both split batches, sinks of every kind, empty splits and rows whose every
split is empty; launched through the same packed-argument path as a plan.
"""

from __future__ import annotations

import math

import pytest
import torch

from cute_kernels.arch import arch_for_capability
from cute_kernels.sparse_mla_decode.config import MergeConfig
from cute_kernels.sparse_mla_decode.kernel_args import MERGE_ARGS, argument_kinds
from dispatch.policy.splits import MAX_SPLITS
from dispatch.policy.variant_space import KernelVariant
from dispatch.runtime import loader
from tests.tolerances import bf16_floor, check_against_reference, seed_for

pytestmark = pytest.mark.gpu
T, H = 5, 12


def merge_reference(o_part: torch.Tensor, lse2_part: torch.Tensor, sink: torch.Tensor | None):
    """float64 combine of [T, S, H, 512] outputs and [T, S, H] log2 lse: (out, natural lse)."""
    lse_nat = lse2_part.double() * math.log(2.0)
    lse = torch.logsumexp(lse_nat, dim=1)  # [T, H]; -inf where every split is empty
    empty = torch.isneginf(lse)
    weights = torch.exp(lse_nat - torch.where(empty, 0.0, lse)[:, None, :])  # [T, S, H]
    out = (weights[..., None] * o_part.double()).sum(dim=1)
    if sink is not None:
        out = out * torch.sigmoid(lse - sink.double()[None, :])[..., None]
    out = out.masked_fill(empty[..., None], 0.0)
    return out, lse.masked_fill(empty, math.inf)


def run_merge(o_part, lse_part, sink, split_batch: int):
    from dispatch.runtime.launcher import BoundKernel

    arch = arch_for_capability(torch.cuda.get_device_capability())
    variant = KernelVariant(MergeConfig(has_sink=sink is not None, split_batch=split_batch), arch)
    out = torch.full((T, H, 512), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((T, H), math.nan, dtype=torch.float32, device="cuda")
    values = {"o_part": o_part.data_ptr(), "lse_part": lse_part.data_ptr(), "num_tokens": T,
              "num_splits": o_part.shape[1], "num_heads": H, "attn_sink": 0 if sink is None else sink.data_ptr(),
              "out": out.data_ptr(), "out_stride_t": out.stride(0), "out_stride_h": out.stride(1),
              "lse": lse.data_ptr(), "lse_stride_t": lse.stride(0), "lse_stride_h": lse.stride(1),
              "stream": torch.cuda.current_stream().cuda_stream}
    kernel = BoundKernel(loader.get_compiled(variant), argument_kinds(MERGE_ARGS), [values[a.name] for a in MERGE_ARGS],
                         torch.cuda.current_device())
    kernel.launch()
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.parametrize("split_batch", [8, 32])
@pytest.mark.parametrize("num_splits", [1, 2, 8, 9, 32, 33, 100, MAX_SPLITS])
@pytest.mark.parametrize("sink", [None, "finite", "mixed"])
def test_merge_matches_logsumexp_combine(num_splits, split_batch, sink):
    seed = seed_for(f"merge {num_splits} {split_batch} {sink}")
    gen = torch.Generator().manual_seed(seed)
    o_part = torch.randn(T, num_splits, H, 512, generator=gen) * 3
    # the splits' lse spread over ~40 binades; a quarter of the splits empty (lse -inf, output 0)
    lse_part = torch.randn(T, num_splits, H, generator=gen) * 12
    empty = torch.rand(T, num_splits, H, generator=gen) < 0.25
    empty[1] = True  # token 1: every split empty
    empty[2, :, 0] = True  # token 2, head 0 too
    lse_part = lse_part.masked_fill(empty, -math.inf)
    o_part = o_part.masked_fill(empty[..., None], 0.0)
    sinks = None
    if sink is not None:
        sinks = torch.randn(H, generator=gen) * 4
        if sink == "mixed":
            sinks[0::3], sinks[1::3] = math.inf, -math.inf
    ref_out, ref_lse = merge_reference(o_part, lse_part, sinks)
    dev = [t.cuda() if t is not None else None for t in (o_part, lse_part, sinks)]
    out, lse = run_merge(*dev, split_batch)
    check_against_reference(out, lse, ref_out, ref_lse, floor=bf16_floor(ref_out), seed=seed,
                            what=f"merge of {num_splits} splits, batch {split_batch}, sink {sink}")
    assert torch.isposinf(lse[1]).all() and (out[1] == 0).all()
