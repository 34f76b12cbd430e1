"""The DSV4 FP8 cache format helpers (CPU)."""

import pytest
import torch

from cute_kernels.sparse_mla_decode.cache_format import (
    CacheLayoutError, default_block_stride, gather_slots, pack_latent, quantize_latent, read_cache_view, unpack_cache,
)
from cute_kernels.sparse_mla_decode.layout import TOKEN_BYTES
from tests.dsv4_inputs import make_cache


def test_round_trip_within_fp8_error():
    latent = torch.randn(6, 64, 512).to(torch.bfloat16)
    back = unpack_cache(pack_latent(latent))
    nope_err = (back[..., :448] - latent[..., :448].float()).norm() / latent[..., :448].float().norm()
    assert nope_err < 0.04  # e4m3 keeps 3 mantissa bits: ~2.5% rms
    assert torch.equal(back[..., 448:], latent[..., 448:].float())  # rope is stored as is


def test_layout_bytes_match_the_spec():
    page = 4
    latent = torch.randn(2, page, 512).to(torch.bfloat16)
    cache = pack_latent(latent, block_stride=page * TOKEN_BYTES + 32)
    buf = torch.as_strided(cache, (2, page * TOKEN_BYTES + 32), (page * TOKEN_BYTES + 32, 1))
    nope, scales, rope = quantize_latent(latent)
    for b in range(2):
        for t in range(page):
            row = buf[b, t * 576:(t + 1) * 576]
            assert torch.equal(row[:448], nope[b, t].view(torch.uint8))
            assert torch.equal(row[448:], rope[b, t].contiguous().view(torch.uint8))
            foot = buf[b, page * 576 + t * 8: page * 576 + t * 8 + 8]
            assert torch.equal(foot[:7], scales[b, t])
            assert foot[7] == 0
    # the scale is 2**ceil(log2(amax / 448)): every tile uses its range without overflow
    amax = (nope.float().abs().reshape(2, page, 7, 64)).amax(-1)
    assert (amax <= 448).all() and (amax >= 224).all()


@pytest.mark.parametrize("layout", ["nhd", "hnd", "flat", "fp8"])
def test_every_view_reads_the_same(layout):
    gen = torch.Generator().manual_seed(0)
    ref = unpack_cache(make_cache(5, 64, device="cpu", gen=gen))
    gen = torch.Generator().manual_seed(0)
    view = make_cache(5, 64, device="cpu", gen=gen, layout=layout)
    assert torch.equal(unpack_cache(view), ref)
    info = read_cache_view(view)
    assert info.page_block_size == 64 and info.block_stride == default_block_stride(64) == 37440


def test_gather_slots_matches_unpack():
    cache = make_cache(4, 32, device="cpu", block_stride=32 * TOKEN_BYTES + 48)
    full = unpack_cache(cache).reshape(-1, 512)
    slots = torch.tensor([[0, 127, 5], [64, 64, 31]])
    assert torch.equal(gather_slots(read_cache_view(cache), slots), full[slots])


@pytest.mark.parametrize("make, message", [
    (lambda: torch.zeros(4, 64, 1, 584, dtype=torch.float16), "uint8 or float8_e4m3fn"),
    (lambda: torch.zeros(4, 64, 1, 580, dtype=torch.uint8), "expected [num_blocks, P, 1, 584]"),
    (lambda: torch.zeros(4, 1000, dtype=torch.uint8), "P*584"),
    (lambda: torch.as_strided(torch.zeros(4 * 37384, dtype=torch.uint8), (4, 64, 1, 584), (37384, 584, 584, 1)),
     "not a multiple of 16"),
    (lambda: torch.as_strided(torch.zeros(4 * 37376, dtype=torch.uint8), (4, 64, 1, 584), (37000, 584, 584, 1)),
     "smaller than a block"),
    (lambda: torch.zeros(4, 64, 1, 1168, dtype=torch.uint8)[..., ::2], "contiguous"),
])
def test_bad_views_are_refused(make, message):
    with pytest.raises(CacheLayoutError, match=message.replace("[", r"\[").replace("*", r"\*")):
        read_cache_view(make())
