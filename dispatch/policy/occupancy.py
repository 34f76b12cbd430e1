"""How many partial-kernel CTAs an SM holds at once, and where the "f16" kernel is held to
128 registers so that it holds two (the H200; never on sm_120)."""

from __future__ import annotations

import functools

from cute_kernels.arch import REGISTERS_PER_SM, RESERVED_SMEM_PER_CTA
from cute_kernels.sparse_mla_decode.config import PartialConfig


@functools.lru_cache(maxsize=1024)
def resident_ctas_per_sm(cfg: PartialConfig, smem_per_sm: int) -> int:
    """How many partial-kernel CTAs of ``cfg`` one SM holds at once (registers, shared memory).

    On sm_120 (100 KB of shared memory per SM) that is 1 for every configuration; on the
    H200 (228 KB) 2 for the "f16" kernel of either head-group count held to 128 registers
    (``two_ctas_per_sm``) and for the bf16 / FP8 one-group kernels (128 threads), 1 for the
    other two-group kernels (registers). Cached: a configuration's shared memory plan is the
    costly part of selecting a call's kernels, and a few configurations serve every call."""
    by_registers = REGISTERS_PER_SM // (cfg.max_registers * cfg.num_threads)
    by_smem = smem_per_sm // (cfg.smem_bytes() + RESERVED_SMEM_PER_CTA)
    return max(1, min(by_registers, by_smem))


@functools.lru_cache(maxsize=None)
def f16_bound_allowed(kv_format: str) -> bool:
    """Whether the "f16" kernel of ``kv_format`` can be held to 128 registers at all: only
    where it has 256 threads (MODEL1's 7 nope warps and its rope warp; the formats of 512
    nope dims have 8 nope warps, 288 threads, and cannot), as ``PartialConfig.check`` says."""
    try:
        PartialConfig(kv_format=kv_format, precision="f16", two_ctas_per_sm=True).check()
    except ValueError:
        return False
    return True


def two_bounded_f16_ctas_fit(smem_per_sm: int, kv_format: str) -> bool:
    """Whether an SM with ``smem_per_sm`` bytes of shared memory holds two "f16" one-group
    CTAs of ``kv_format`` held to 128 registers (MODEL1 on the H200: yes; on sm_120: no;
    a format whose "f16" kernel cannot be bounded: never): where the dispatch plans the
    "f16" kernels two to an SM (the 32-head one too where its grid is large enough:
    ``head_groups.head_groups_for``) and the variant space has their bounded forms."""
    if not f16_bound_allowed(kv_format):
        return False
    cfg = PartialConfig(kv_format=kv_format, precision="f16", two_ctas_per_sm=True)
    return resident_ctas_per_sm(cfg, smem_per_sm) > 1


def ctas_per_split(num_tokens: int, num_heads: int, cfg: PartialConfig) -> int:
    """The CTAs one split of a call launches: one per token and block of ``cfg.heads_per_cta`` heads."""
    return num_tokens * -(-num_heads // cfg.heads_per_cta)
