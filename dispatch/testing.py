"""Random DSV4 decode inputs: caches in the MODEL1 FP8 layout and lists of slots, for trying
the kernels, tests and benchmarks (CPU or GPU tensors; the packer is the package's own,
``cute_kernels.sparse_mla_decode.cache_format.pack_latent``)."""

from __future__ import annotations

import torch

from cute_kernels.sparse_mla_decode.cache_format import default_block_stride, pack_latent
from cute_kernels.sparse_mla_decode.layout import D_NOPE, D_QK, NUM_TILES, ROW_BYTES, SCALE_BYTES, TOKEN_BYTES

from .api import INT32_MAX

INT32_MIN = -(2**31)


def make_cache(num_blocks: int, page: int, *, device, block_stride: int | None = None, poison_blocks=(),
               layout: str = "nhd", gen: torch.Generator | None = None, spread: int = 0,
               tiny: bool = False) -> torch.Tensor:
    """A random FP8 cache. Blocks in ``poison_blocks`` and every padding byte are 0xFF (NaN as
    e4m3 and as bf16, scale 2**128): a kernel that reads them produces NaN. ``spread``: each
    token's latent is multiplied by a random power of two in [2**-spread, 2**spread], so the
    tokens' scale bytes differ by up to 2 * spread. ``tiny``: every scale byte drawn from
    0, 1, 2 (2**-127 .. 2**-125, the bottom of UE8M0, below what the model writes) and the
    rope dims 0, so the output is that tiny latent's alone: a kernel that takes byte 0 for 0
    rather than 2**-127 gets it wrong."""
    latent = torch.randn(num_blocks, page, D_QK, generator=gen, device="cpu")
    if spread:
        latent = latent * torch.exp2(torch.randint(-spread, spread + 1, (num_blocks, page, 1), generator=gen).float())
    latent = latent.to(torch.bfloat16)
    stride = default_block_stride(page) if block_stride is None else block_stride
    cache = pack_latent(latent.to(device), block_stride=stride)
    buf = torch.as_strided(cache, (num_blocks, stride), (stride, 1))
    if tiny:
        rows = buf[:, :page * ROW_BYTES].view(num_blocks, page, ROW_BYTES)
        rows[..., D_NOPE:] = 0
        footer = buf[:, page * ROW_BYTES:page * TOKEN_BYTES].view(num_blocks, page, SCALE_BYTES)
        footer[..., :NUM_TILES] = torch.randint(0, 3, (num_blocks, page, NUM_TILES), generator=gen,
                                                dtype=torch.uint8).to(device)
    buf[:, page * TOKEN_BYTES:] = 0xFF
    for b in poison_blocks:
        buf[b] = 0xFF
    if layout == "nhd":
        return cache
    if layout == "hnd":
        return torch.as_strided(buf, (num_blocks, 1, page, TOKEN_BYTES), (stride, TOKEN_BYTES, TOKEN_BYTES, 1))
    if layout == "flat":
        return torch.as_strided(buf, (num_blocks, page * TOKEN_BYTES), (stride, 1))
    if layout == "fp8":
        return cache.view(torch.float8_e4m3fn)
    raise ValueError(layout)


def make_indices(num_tokens: int, topk: int, num_slots: int, *, device, usable_blocks=None, page: int = 1,
                 invalid_frac: float = 0.0, gen: torch.Generator | None = None) -> torch.Tensor:
    """Random slots (with duplicates allowed) from ``usable_blocks`` (all by default); a fraction
    ``invalid_frac`` of entries replaced by -1, -2, INT32_MIN, INT32_MAX or num_slots."""
    if usable_blocks is None:
        slots = torch.randint(0, num_slots, (num_tokens, topk), generator=gen, dtype=torch.int64)
    else:
        blocks = torch.tensor(list(usable_blocks), dtype=torch.int64)
        pick = blocks[torch.randint(0, len(blocks), (num_tokens, topk), generator=gen)]
        slots = pick * page + torch.randint(0, page, (num_tokens, topk), generator=gen)
    if invalid_frac > 0:
        bad_values = torch.tensor([-1, -2, INT32_MIN, INT32_MAX, num_slots], dtype=torch.int64)
        mask = torch.rand(num_tokens, topk, generator=gen) < invalid_frac
        bad = bad_values[torch.randint(0, len(bad_values), (num_tokens, topk), generator=gen)]
        slots = torch.where(mask, bad, slots)
    return slots.to(torch.int32).to(device)
