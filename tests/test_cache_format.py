"""The DSV4 FP8 cache format helpers (CPU)."""

import pytest
import torch

from cute_kernels.sparse_mla_decode.cache_format import (
    CacheLayoutError, default_block_stride, gather_slots, pack_latent, page_division_magic, quantize_latent,
    read_cache_view, unpack_cache,
)
from cute_kernels.sparse_mla_decode.layout import TOKEN_BYTES
from dispatch.testing import make_cache


def test_round_trip_within_fp8_error():
    latent = torch.randn(6, 64, 512, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    back = unpack_cache(pack_latent(latent))
    nope_err = (back[..., :448] - latent[..., :448].float()).norm() / latent[..., :448].float().norm()
    assert nope_err < 0.04  # e4m3 keeps 3 mantissa bits: ~2.5% rms
    assert torch.equal(back[..., 448:], latent[..., 448:].float())  # rope is stored as is


def test_layout_bytes_match_the_spec():
    page = 4
    latent = torch.randn(2, page, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
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


def _quotient(slot: int, page: int) -> int:
    """slot // page the kernels' way (``gather.ChunkGather.row_location``)."""
    magic = page_division_magic(page)
    return (slot * (magic & 0xFFFFFFFF)) >> (magic >> 32)


@pytest.mark.parametrize("page", [*range(1, 130), 192, 255, 256, 257, 1000, 4096, 65535, 65536, 99991,
                                  (1 << 20) + 7, (1 << 30) - 1, 1 << 30, (1 << 31) - 1])
def test_page_division_magic_divides_every_slot(page):
    gen = torch.Generator().manual_seed(page)
    slots = list(range(0, 3 * page + 3)) if page <= 256 else []
    slots += [page * k + d for k in (1, 2, 1000) for d in (-1, 0, 1) if 0 <= page * k + d < 1 << 31]
    slots += torch.randint(0, 1 << 31, (2000,), generator=gen).tolist() + [(1 << 31) - 1, (1 << 31) - 2]
    magic = page_division_magic(page)
    assert magic & 0xFFFFFFFF < 1 << 32 and (magic >> 32) <= 62
    wrong = [s for s in slots if _quotient(s, page) != s // page]
    assert not wrong, f"page {page}: slot // page wrong for slots {wrong[:5]}"
    # the device's product of a slot (< 2**31) and the multiplier (< 2**32) fits a signed int64
    assert ((1 << 31) - 1) * (magic & 0xFFFFFFFF) < 1 << 63


@pytest.mark.parametrize("page", [0, -64, 64.0, True])
def test_page_division_magic_refuses_bad_pages(page):
    with pytest.raises(ValueError, match="page_block_size"):
        page_division_magic(page)
