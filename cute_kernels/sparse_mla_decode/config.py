"""Compile-time configuration of the sparse-MLA decode kernels, and its one constraint check.

Everything a call can vary (num_tokens, num_heads, topk, extra_topk, page block sizes, block
strides, the split of the work) is a runtime argument of the kernels. What is fixed here is
only what changes the generated code; ``name`` holds every such field.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..arch import MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM, SMEM_PER_CTA_MAX, Arch
from . import tuning
from .kv_format import DEFAULT_FORMAT, D_V, KvFormat, get_format, path_refusal
from .smem import Region, SmemPlan

# the compute paths that need an instruction some archs lack: the ``arch.Arch`` field that
# says whether an arch has it (the others run on every arch)
PATH_NEEDS = {"fp8": "e4m3_mma", "mxf8": "block_scaled_mma"}


def path_missing(precision: str, arch: Arch) -> str | None:
    """Why ``arch`` has no ``precision`` path, in words (the instruction it lacks:
    ``PATH_NEEDS``), or None where it has it."""
    needs = PATH_NEEDS.get(precision)
    return arch.lacks(needs) if needs else None


HEAD_GROUPS = (1, 2)  # 16-head groups one partial-kernel CTA can cover (PartialConfig.head_groups)
FP8_Q_REGS = 36  # FP8 path: Q operand registers per thread (2 nope tiles x 16, 4 for the rope dims)
# "f16" path: the softmax runs on 8 warps (the nope warps, and MODEL1's rope warp with them)
F16_SOFTMAX_THREADS = 256
F16_S_ROW = 40  # floats per head row of a warp's partial S: 32 entries + 8 (conflict-free STS.64 / LDS.128)
F16_P_ROW_BYTES = 80  # bytes per head row of P in f16 or bf16: 32 entries + 8 (conflict-free ldmatrix)


@dataclass(frozen=True)
class PartialConfig:
    """Code-generating parameters of the split-K partial kernel.

    kv_format: the cache format (``kv_format.FORMATS``): its layout and widths are compiled in.
    precision: the compute path ("f16", "bf16", "fp8", "mxf8"; ``docs/design.md``).
    head_groups: 16-head m16 tiles one CTA covers (1 or 2); the gathered rows serve all of them.
    heads_per_group: rows of the MMA M tile (heads >= H are masked, never read).
    block_n: selected entries gathered and processed per step (one chunk).
    warps_per_group: "bf16" / FP8 paths: warps per head group, each owning a 1 /
        warps_per_group slice of the QK width and of the output ("f16": a warp per 64-dim
        nope tile and the rope warp, each for every head of the CTA).
    has_topk_length / has_extra_topk_length: whether the length tensors are read.
    final_output: write the bf16 output and natural-log lse directly (one split, no merge)
        instead of f32 partials.
    has_sink: apply attn_sink in the epilogue (final_output only; else the merge does it).
    num_stages: raw row stages in shared memory (None: ``default_stages``).
    two_ctas_per_sm: "f16" only: held to 128 registers, so that two CTAs share an SM.
    """

    kv_format: str = DEFAULT_FORMAT
    has_topk_length: bool = False
    has_extra_topk_length: bool = False
    final_output: bool = False
    has_sink: bool = False
    precision: str = tuning.DEFAULT_PRECISION
    head_groups: int = 1
    heads_per_group: int = 16
    block_n: int = 32
    warps_per_group: int = 4
    num_stages: int | None = None
    two_ctas_per_sm: bool = False

    @property
    def fmt(self) -> KvFormat:
        return get_format(self.kv_format)

    @property
    def stages(self) -> int:
        """Chunks of gathered rows in shared memory at once: the one being computed on and
        ``stages - 1`` in flight."""
        return self.num_stages if self.num_stages is not None else self.default_stages

    @property
    def default_stages(self) -> int:
        if self.precision == "f16" and self.head_groups == 1:
            return tuning.F16_ONE_GROUP_STAGES
        return tuning.OTHER_STAGES

    @property
    def slot_buffers(self) -> int:
        """Index / validity-mask buffers: a chunk's indices land up to ``stages + 1`` chunks
        ahead of its compute (``gather.ChunkGather``)."""
        return self.stages + 1

    @property
    def heads_per_cta(self) -> int:
        return self.heads_per_group * self.head_groups

    @property
    def num_warps(self) -> int:
        if self.precision == "f16":  # a warp per 64-dim nope tile and one for the rope and the gather
            return self.fmt.nope_tiles + 1
        return self.warps_per_group * self.head_groups

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def min_ctas_per_sm(self) -> int:
        """The launch bound (``.minnctapersm``): 2 when held to two CTAs' registers per SM,
        else 1 (ptxas may then use all 255 registers; without the bound it capped some
        kernels below what they need and spilled)."""
        return 2 if self.two_ctas_per_sm else 1

    @property
    def max_registers(self) -> int:
        """The most registers per thread ptxas may give this kernel under its launch bound."""
        return min(MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM // (self.min_ctas_per_sm * self.num_threads))

    @property
    def stage_bytes(self) -> int:
        """Raw bytes one gathered chunk occupies in shared memory: rows (``raw_row_stride``
        apart), then a footer format's scale records."""
        return self.block_n * (self.fmt.raw_row_stride + self.fmt.footer_bytes)

    @property
    def q_cols(self) -> int:
        """The tile paths' bf16 Q tile columns: d_qk rounded up to a 64-column swizzle atom (every
        format's d_qk, 512 and 576, are multiples of 64)."""
        return -(-self.fmt.d_qk // 64) * 64

    @property
    def q_region_bytes(self) -> int:
        """FP8 path: the bf16 Q tile, later every thread's ``FP8_Q_REGS`` Q operand registers."""
        return max(self.heads_per_cta * self.q_cols * 2, self.num_threads * FP8_Q_REGS * 4)

    @property
    def kv_tile_bytes(self) -> int:
        """"bf16" path: the dequantized tile [block_n, D_V] (the value's columns: V3.2's rope dims
        are multiplied from the raw rows), where Q [heads, q_cols] is staged first."""
        return max(self.block_n * D_V, self.heads_per_cta * self.q_cols) * 2

    def smem_plan(self) -> SmemPlan:
        """The partial kernel's shared memory, region by region, in allocation order: the
        compute path's own regions, then the gather's (raw row stages, the S exchange,
        validity masks, indices)."""
        hb, fmt = self.heads_per_cta, self.fmt
        if self.precision == "f16":
            if not fmt.fp32_scales:  # P in f16 (the nope warps' PV) and in bf16 (the rope warp's PV)
                own = [Region("p_f16", hb * F16_P_ROW_BYTES, 128), Region("p_bf16", hb * F16_P_ROW_BYTES, 128)]
            else:  # P with each scale group's FP32 scales folded in, a row per group; the groups' running maxima
                own = [Region("p_f16", fmt.num_scales * hb * F16_P_ROW_BYTES, 128),
                       Region("scale_max", fmt.nope_tiles * 4, 16)]
            own += [Region("corrections", hb * 4, 16), Region("gates", hb * 4, 16),
                    Region("q_amax", hb * self.num_warps * 4, 16)]
            s_exchange = Region("s_exchange", self.s_partials * hb * F16_S_ROW * 4, 128)
        else:
            if self.precision == "bf16":
                own = [Region("kv_tile", self.kv_tile_bytes, 1024)]  # Q staged here first
            else:
                own = [Region("q", self.q_region_bytes, 1024), Region("q_exponents", hb * 4, 16)]
            s_exchange = Region("s_exchange", self.num_warps * self.heads_per_group * self.block_n * 4, 16)
        return SmemPlan(own + [
            Region("raw_rows", self.stages * self.stage_bytes, 128), s_exchange,
            Region("masks", self.slot_buffers * 4, 16), Region("indices", self.block_n * self.slot_buffers * 4, 16),
        ])

    @property
    def s_partials(self) -> int:
        """"f16": the warps whose partial S the softmax sums (the nope warps, and the rope warp
        where the format has rope dims)."""
        return self.fmt.nope_tiles + (1 if self.fmt.rope_dims else 0)

    def smem_bytes(self) -> int:
        return self.smem_plan().total_bytes

    def check(self) -> None:
        """Raise ValueError when this configuration cannot be generated."""
        fmt = get_format(self.kv_format)
        refusal = path_refusal(self.precision, fmt)
        if refusal:
            raise ValueError(refusal)
        if self.has_sink and not self.final_output:
            raise ValueError("has_sink needs final_output (the merge kernel applies the sink otherwise)")
        if self.heads_per_group != 16:
            raise ValueError("heads_per_group must be 16 (one m16 MMA tile)")
        if self.head_groups not in HEAD_GROUPS or self.heads_per_cta > self.block_n:
            raise ValueError(f"head_groups {self.head_groups} must be one of {HEAD_GROUPS} "
                             f"(Q is staged in the {self.block_n}-row KV tile)")
        if self.block_n != 32:
            raise ValueError(f"block_n {self.block_n} must be 32 (one validity bit per lane of a warp)")
        if self.warps_per_group != 4:
            raise ValueError(f"warps_per_group {self.warps_per_group} must be 4 (a warp per 128 value columns)")
        if self.two_ctas_per_sm and (self.precision != "f16" or self.num_threads != F16_SOFTMAX_THREADS):
            raise ValueError("two_ctas_per_sm is for the 256-thread \"f16\" kernel (no other kernel has a "
                             "128-register bound)")
        if self.precision == "bf16" and tuning.DEQUANT_VALUES != 16:
            raise ValueError(f"tuning.DEQUANT_VALUES is {tuning.DEQUANT_VALUES}: the \"bf16\" kernel's dequantize "
                             f"loads assume 16 e4m3 bytes, 16-byte aligned, per thread (partial_bf16.py)")
        if self.stages not in (2, 3):
            raise ValueError(f"num_stages {self.stages} must be 2 or 3 (the cp.async group order of the gather)")
        if self.smem_bytes() > SMEM_PER_CTA_MAX:  # the smallest of the targets': one configuration serves all
            raise ValueError(f"{self} needs {self.smem_bytes()} bytes of shared memory > {SMEM_PER_CTA_MAX}")

    @property
    def name(self) -> str:
        """A name that holds every code-generating field (used for kernels and caches)."""
        return (
            f"sparse_mla_partial_{self.kv_format}_{self.precision}_g{self.head_groups}x{self.heads_per_group}"
            f"_n{self.block_n}"
            f"_w{self.warps_per_group}_s{self.stages}"
            f"_len{int(self.has_topk_length)}{int(self.has_extra_topk_length)}"
            f"_final{int(self.final_output)}_sink{int(self.has_sink)}_occ{self.min_ctas_per_sm}"
        )


@dataclass(frozen=True)
class MergeConfig:
    """Code-generating parameters of the combine kernel."""

    has_sink: bool = False
    num_threads: int = 128  # each thread owns D_V / num_threads output dims (every format's D_V)
    # splits whose partial outputs a thread loads at once (``tuning.MERGE_BATCHES``)
    split_batch: int = tuning.MERGE_BATCHES[0]

    @property
    def max_splits(self) -> int:
        """The most splits one merge can combine: one thread loads each split's lse."""
        return self.num_threads

    def smem_plan(self) -> SmemPlan:
        warps = self.num_threads // 32
        return SmemPlan([Region("warp_max", warps * 4, 16), Region("warp_sum", warps * 4, 16),
                         Region("weights", self.num_threads * 4, 16), Region("warp_nonempty", warps * 4, 16)])

    def smem_bytes(self) -> int:
        return self.smem_plan().total_bytes

    def check(self) -> None:
        if D_V % self.num_threads != 0 or (D_V // self.num_threads) % 4 != 0:
            raise ValueError(f"num_threads {self.num_threads} must split the {D_V} output dims into groups of 4")
        if self.split_batch not in tuning.MERGE_BATCHES:
            raise ValueError(f"split_batch {self.split_batch} must be one of {tuning.MERGE_BATCHES}")
        if 32 % self.split_batch:  # the kernel reads a batch's weights from one warp's ballot
            raise ValueError(f"split_batch {self.split_batch} must divide 32")

    @property
    def name(self) -> str:
        return f"sparse_mla_merge_t{self.num_threads}_b{self.split_batch}_sink{int(self.has_sink)}"


def merge_batch_for(num_splits: int) -> int:
    """The merge kernel's split batch for a call with ``num_splits`` splits: the smallest
    that takes every split in one round trip, else the largest."""
    return next((b for b in tuning.MERGE_BATCHES if num_splits <= b), tuning.MERGE_BATCHES[-1])
