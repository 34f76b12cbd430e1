"""How many partial-kernel CTAs an SM holds at once, and where the "f16" kernel is held to
128 registers so that it holds two (MODEL1's on the H200, of either head-group count, and on
sm_80 at 16 heads; never with 100 KB per SM: sm_120, sm_86, sm_89)."""

from __future__ import annotations

import functools

from cute_kernels.arch import REGISTERS_PER_SM, RESERVED_SMEM_PER_CTA, arch_facts
from cute_kernels.sparse_mla_decode.config import HEAD_GROUPS, PartialConfig

# the head-group counts whose "f16" kernel spills when held to 128 registers: 32 heads (MODEL1
# NVFP4's: 34-39 local-memory instructions on sm_80, sm_89 and sm_90a alike). A kernel that
# spills is never planned where the binaries ship (``Arch.ships``); on the H200 test GPU the
# measurements behind ``head_groups.head_groups_for`` chose them, spills and all.
F16_BOUNDED_SPILLS = (2,)


def bounded_f16_head_groups(arch: str) -> tuple[int, ...]:
    """The head-group counts whose "f16" kernel may be held to 128 registers on ``arch``
    (where two of its CTAs also fit in an SM: ``two_bounded_f16_ctas_fit``); an arch profile
    plans as its target."""
    ships = arch_facts(arch).target.ships
    return tuple(g for g in HEAD_GROUPS if not (ships and g in F16_BOUNDED_SPILLS))


@functools.lru_cache(maxsize=1024)
def resident_ctas_per_sm(cfg: PartialConfig, smem_per_sm: int) -> int:
    """How many partial-kernel CTAs of ``cfg`` one SM holds at once (registers, shared memory).

    On sm_120, sm_86 and sm_89 (100 KB of shared memory per SM) that is 1 for every
    configuration; on the H200 (228 KB) 2 for the "f16" kernel of either head-group count
    held to 128 registers (``two_ctas_per_sm``) and for the bf16 / FP8 one-group kernels (128
    threads), 1 for the other two-group kernels (registers); on sm_80 (164 KB) 2 for the
    MODEL1 "f16" kernels held to 128 registers but MODEL1 FP8's 32-head one, and for most
    bf16 one-group kernels. Cached: a configuration's shared memory plan is the
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


def two_bounded_f16_ctas_fit(smem_per_sm: int, kv_format: str, head_groups: int = 1,
                             bounded: tuple[int, ...] = HEAD_GROUPS) -> bool:
    """Whether an SM with ``smem_per_sm`` bytes of shared memory holds two "f16" CTAs of
    ``kv_format`` and ``head_groups`` held to 128 registers, ``head_groups`` being one of the
    ``bounded`` counts (``bounded_f16_head_groups``): MODEL1 on the H200, either head-group
    count; on sm_80 the 16-head ones; on sm_120 none; a format whose "f16" kernel cannot be
    bounded, never. Where the variant space has their bounded forms."""
    if head_groups not in bounded or not f16_bound_allowed(kv_format):
        return False
    cfg = PartialConfig(kv_format=kv_format, precision="f16", head_groups=head_groups, two_ctas_per_sm=True)
    return resident_ctas_per_sm(cfg, smem_per_sm) > 1


def ctas_per_split(num_tokens: int, num_heads: int, cfg: PartialConfig) -> int:
    """The CTAs one split of a call launches: one per token and block of ``cfg.heads_per_cta`` heads."""
    return num_tokens * -(-num_heads // cfg.heads_per_cta)
