"""Compile-time configuration of the sparse-MLA decode kernels, and its one constraint check.

Everything a call can vary (num_tokens, num_heads, topk, extra_topk, page block sizes, block
strides, the split of the work) is a runtime argument of the kernels. What is fixed here is
only what changes the generated code.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import D_QK, SCALE_BYTES

SMEM_LIMIT_BYTES = 101376  # 99 KB: the most an SM120 CTA may use
# Shared-memory bytes per gathered row: the 576 data bytes padded to 592 (37 x 16) so that 8
# consecutive rows start 20 banks apart: ldmatrix on the raw rows (the FP8 path reads K and V
# straight from them) is then free of bank conflicts; 576 would put rows 2 apart on the same banks.
RAW_ROW_STRIDE = 592
PRECISIONS = ("bf16", "f16", "fp8", "mxf8")
HEAD_GROUPS = (1, 2)  # 16-head groups one partial-kernel CTA can cover (PartialConfig.head_groups)
BLOCK_SCALED_ARCHS = ("sm_120a", "sm_121a")  # the archs with the block-scaled MMA ("mxf8")
FP8_Q_REGS = 36  # FP8 path: Q operand registers per thread (2 nope tiles x 16, 4 for the rope dims)
MAX_REGISTERS_PER_THREAD = 255
REGISTERS_PER_SM = 65536  # on every target (sm_90, sm_120, sm_121)
# "f16" path: one warp per 64 columns of the QK width and of the output (7 nope tiles, the rope)
F16_WARPS = D_QK // 64
F16_S_ROW = 40  # floats per head row of a warp's partial S: 32 entries + 8 (conflict-free STS.64 / LDS.128)
F16_P_ROW_BYTES = 80  # bytes per head row of P in f16 or bf16: 32 entries + 8 (conflict-free ldmatrix)


@dataclass(frozen=True)
class PartialConfig:
    """Code-generating parameters of the split-K partial kernel.

    head_groups: 16-head groups one CTA covers (1 or 2). Each group has its own 4 warps and
        runs its own MMAs and softmax; the gathered and dequantized rows are shared, so a
        group of heads past the first costs no extra row traffic.
    heads_per_group: rows of the MMA M tile (heads >= H are masked, never read).
    block_n: selected entries gathered and processed per step (one chunk).
    warps_per_group: warp w of a group owns a 512/warps_per_group slice of the QK width and
        of the output.
    has_topk_length / has_extra_topk_length: whether the length tensors are read.
    final_output: write the bf16 output and natural-log lse directly (one split, no merge)
        instead of f32 partials.
    has_sink: apply attn_sink in the epilogue (final_output only; else the merge does it).
    precision: the compute path. "bf16": the FP8 nope values are dequantized to a bf16 tile
        and every MMA is bf16. "f16": no dequantized tile; warp w owns 64 columns of QK and
        of the output for every head of the CTA (nope tile w, the rope for the last warp),
        converts the cache's e4m3 bytes to f16 in registers (exact) and applies the scales
        to S and to P instead; the softmax is spread over all threads (``partial_f16.py``). "fp8": QK and PV over the nope dims run as e4m3 MMAs straight
        on the gathered cache bytes (no dequantization; Q as two e4m3 terms, the
        probabilities requantized to e4m3 with the value scales folded in), the rope dims in
        bf16 (``partial_fp8.py``). "mxf8": the same with the SM120 block-scaled MMA for QK
        (sm_120a/sm_121a only; compiled and SASS-checked, not executed by this project's
        tests, whose GPU is an H200).
    """

    has_topk_length: bool = False
    has_extra_topk_length: bool = False
    final_output: bool = False
    has_sink: bool = False
    precision: str = "f16"
    head_groups: int = 1
    heads_per_group: int = 16
    block_n: int = 32
    warps_per_group: int = 4
    num_stages: int | None = None  # raw row stages; None: ``default_stages``
    two_ctas_per_sm: bool = False  # "f16" only: held to 128 registers (``min_ctas_per_sm``)

    @property
    def stages(self) -> int:
        """Chunks of gathered rows in shared memory at once: the one being computed on and
        ``stages - 1`` in flight (``num_stages``, else ``default_stages``)."""
        return self.num_stages if self.num_stages is not None else self.default_stages

    @property
    def default_stages(self) -> int:
        """3 for the "f16" one-group kernel, 2 for the others (the "f16" two-group kernel
        has no room for a third in 99 KB). The f16 kernel's rope warp issues most of the
        next chunk's rows after the softmax (``partial_f16.EARLY_ROW_GROUPS``), which leaves
        them less than a chunk to land: with 16 heads a third stage gives them more than
        one. Measured on the H200 (``scripts/bench.py --stages``, 2026-12-01): see
        ``partial_f16.py``."""
        return 3 if self.precision == "f16" and self.head_groups == 1 else 2

    @property
    def slot_buffers(self) -> int:
        """Index / validity-mask buffers: a chunk's indices land ``stages`` chunks ahead of
        its compute (``SparseMlaPartialKernel._next_chunk``)."""
        return self.stages + 1

    @property
    def heads_per_cta(self) -> int:
        return self.heads_per_group * self.head_groups

    @property
    def num_warps(self) -> int:
        if self.precision == "f16":
            return F16_WARPS
        return self.warps_per_group * self.head_groups

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def min_ctas_per_sm(self) -> int:
        """The launch bound (``.minnctapersm``). ``two_ctas_per_sm`` (the "f16" kernel only,
        either head-group count): held to 128 registers so that two of its 256-thread CTAs fit
        an SM's registers, which the dispatch asks for where a call's grid puts two on an SM
        (the H200, ``dispatch.splits.two_ctas_per_sm``; on sm_120 shared memory allows one CTA
        anyway). Otherwise ptxas may use all 255 (the "f16" one-group kernel then takes 136,
        and its sm_120a main loop is 332 -> 319 instructions per chunk in the nope warps, 375
        -> 348 in the rope warp; measured on the H200 at one CTA per SM, 2026-12-01: 1-3.4%
        faster at 1 and 8 tokens, BENCHMARKS.md)."""
        return 2 if self.two_ctas_per_sm else 1

    @property
    def max_registers(self) -> int:
        """The most registers per thread ptxas may give this kernel under its launch bound."""
        return min(MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM // (self.min_ctas_per_sm * self.num_threads))

    @property
    def stage_bytes(self) -> int:
        """Raw bytes one gathered chunk occupies in shared memory: rows, then scales."""
        return self.block_n * (RAW_ROW_STRIDE + SCALE_BYTES)

    @property
    def q_region_bytes(self) -> int:
        """FP8 path: the bf16 Q tile, later every thread's ``FP8_Q_REGS`` Q operand registers."""
        return max(self.heads_per_cta * D_QK * 2, self.num_threads * FP8_Q_REGS * 4)

    def smem_bytes(self) -> int:
        if self.precision == "f16":
            hb = self.heads_per_cta
            s_part = self.num_warps * hb * F16_S_ROW * 4
            p_tiles = 2 * hb * F16_P_ROW_BYTES  # P in f16 (nope) and bf16 (rope)
            per_head = hb * 4 * (2 + F16_WARPS)  # corrections, gates, Q amax per warp
            raw = self.stages * self.stage_bytes
            slots = self.slot_buffers * (self.block_n * 4 + 4)
            return s_part + p_tiles + per_head + raw + slots + 1024
        if self.precision == "bf16":
            tile = self.block_n * D_QK * 2  # dequantized bf16 rows (Q staged here first)
        else:
            tile = self.q_region_bytes + self.heads_per_cta * 4  # Q (bf16, then operands) and per-head scales
        raw = self.stages * self.stage_bytes
        s_exchange = self.num_warps * self.heads_per_group * self.block_n * 4  # per group: its warps' S tiles
        slots = self.slot_buffers * (self.block_n * 4 + 4)  # raw indices and validity masks
        return tile + raw + s_exchange + slots + 1024  # + alignment slack

    def check(self) -> None:
        """Raise ValueError when this configuration cannot be generated."""
        if self.has_sink and not self.final_output:
            raise ValueError("has_sink needs final_output (the merge kernel applies the sink otherwise)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not one of {PRECISIONS}")
        if self.heads_per_group != 16:
            raise ValueError("heads_per_group must be 16 (one m16 MMA tile)")
        if self.head_groups not in HEAD_GROUPS or self.heads_per_cta > self.block_n:
            raise ValueError(f"head_groups {self.head_groups} must be 1 or 2 (Q is staged in the {self.block_n}-row KV tile)")
        if self.block_n != 32:
            raise ValueError(f"block_n {self.block_n} must be 32 (one validity bit per lane of a warp)")
        if D_QK % (self.warps_per_group * 64) != 0:
            raise ValueError(f"warps_per_group {self.warps_per_group} must split {D_QK} into 64-wide slices")
        if self.block_n * (D_QK // 8) % self.num_threads != 0:
            raise ValueError("block_n * 64 must be a multiple of the thread count")
        if self.two_ctas_per_sm and self.precision != "f16":
            raise ValueError("two_ctas_per_sm is for the \"f16\" kernel (no other kernel has a 128-register bound)")
        if self.stages not in (2, 3):
            raise ValueError(f"num_stages {self.stages} must be 2 or 3 (the cp.async group order of _next_chunk)")
        if self.smem_bytes() > SMEM_LIMIT_BYTES:
            raise ValueError(f"{self} needs {self.smem_bytes()} bytes of shared memory > {SMEM_LIMIT_BYTES}")

    @property
    def name(self) -> str:
        """A name that holds every code-generating field (used for kernels and caches)."""
        return (
            f"sparse_mla_partial_{self.precision}_g{self.head_groups}x{self.heads_per_group}_n{self.block_n}"
            f"_w{self.warps_per_group}_s{self.stages}"
            f"_len{int(self.has_topk_length)}{int(self.has_extra_topk_length)}"
            f"_final{int(self.final_output)}_sink{int(self.has_sink)}_occ{self.min_ctas_per_sm}"
        )


@dataclass(frozen=True)
class MergeConfig:
    """Code-generating parameters of the combine kernel."""

    has_sink: bool = False
    num_threads: int = 128  # each thread owns D_V / num_threads output dims
    # splits whose partial outputs a thread loads at once (4 registers each), the first batch
    # together with the lse values: one round trip for a call with up to this many splits.
    # 32 registers' worth (8) keeps many merge CTAs per SM for calls with many tokens x heads
    # and few splits; 32 serves the many-split calls of few tokens (MERGE_BATCHES)
    split_batch: int = 8

    @property
    def max_splits(self) -> int:
        """The most splits one merge can combine: one thread loads each split's lse."""
        return self.num_threads

    def smem_bytes(self) -> int:
        # one float per warp (the block-wide max over splits) and one weight per split
        return 8 * (self.num_threads // 32) + 4 * self.num_threads  # + one float per warp: the weight sums

    def check(self) -> None:
        if D_QK % self.num_threads != 0 or (D_QK // self.num_threads) % 4 != 0:
            raise ValueError(f"num_threads {self.num_threads} must split {D_QK} into groups of 4")
        if self.split_batch not in MERGE_BATCHES:
            raise ValueError(f"split_batch {self.split_batch} must be one of {MERGE_BATCHES}")

    @property
    def name(self) -> str:
        return f"sparse_mla_merge_t{self.num_threads}_b{self.split_batch}_sink{int(self.has_sink)}"


MERGE_BATCHES = (8, 32)


def merge_batch_for(num_splits: int) -> int:
    """The merge kernel's split batch for a call with ``num_splits`` splits: the smallest
    that takes every split in one round trip, else the largest."""
    return next((b for b in MERGE_BATCHES if num_splits <= b), MERGE_BATCHES[-1])
