"""ESTIMATE of the decode times on an RTX PRO 6000 Blackwell (sm_120), from the sm_120a SASS.

    python -m scripts.sm120_forecast [--h200-json bench.json]

No SM120 GPU has run these kernels: every number this prints for it is a model, not a
measurement. The model, per shape of scripts.bench's grid:

    time = FIXED_US + max(issue_us, tensor_us, memory_us)

- issue_us: the partial kernel is bound by instruction issue on the H200 (ncu at T=64 H=64
  topk=512: issue slots 26% busy, ``ISSUE_RATE`` below; ``partial_f16.py``'s docstring gives
  45% at 64 x 128 x 1024 for the current kernel). Per SM it issues (CTAs per SM) x (chunks per CTA) x (the
  main loop's warp-instructions per chunk and CTA: instructions per thread and chunk in the
  sm_120a SASS of the shipped kernel times the warps running that loop); at ISSUE_RATE warp-instructions per scheduler and cycle, 4
  schedulers per SM, the device's boost clock. The split and the head groups are the ones
  the dispatch picks for that device (dispatch/policy/splits.py, dispatch/policy/variant_space.py).
- tensor_us: the main loops' MMAs at SM120's tensor rates. Per SM (CTAs per SM) x (chunks
  per CTA) x the FLOPs of one chunk's MMAs (counted in the same SASS, each opcode's m n k:
  HMMA.16816 2 x 16 x 8 x 16, QMMA.16832 twice that), each kind at its rate per SM and cycle:
  TENSOR_FLOP_PER_SM_CYCLE, from published RTX 5090 rates (measured by the QuACK
  project: bf16 ~255, fp8 ~507, block-scaled fp8 ~1000 TFLOP/s dense) over its 170 SMs at
  its 2.407 GHz boost clock. Where the RTX PRO 6000 accumulates 16-bit MMAs in f32 at twice
  the GeForce rate (NVIDIA's professional parts have), the 16-bit term halves.
- memory_us: the bytes gathered (584 per selected entry; once per token: the head blocks
  of a token, which read the same rows, are adjacent in the grid and run together, so all
  but the first read them from L2) at the device's peak memory bandwidth: a lower bound
  that only matters if it exceeds issue_us.
- FIXED_US: the shortest call measured on the H200 (launches, the dependent index -> row
  load chain, the merge), taken as the same on SM120.

Each compute path gets its own estimate (its own main-loop count: bf16, f16, fp8, and mxf8,
the block-scaled form only SM120 has); the model charges every instruction the same issue
slot; the tensor term is what the MMA rates add.

With ``--h200-json`` (a scripts.bench --json file) the same model is also evaluated for
the H200, for the precision that file timed first (the default path unless it says), and
printed next to the H200 measurement: how far the model is off where it can be checked.

Where it is most likely wrong: ISSUE_RATE was measured with 8 warps per SM. On sm_120 one
CTA fills an SM's shared memory, so a 16-head CTA (4 warps) runs alone: fewer warps to hide
latency, a lower issue rate, so the 16-head and small-call estimates are optimistic. Random
584-byte gathers from GDDR7 reach less than its peak bandwidth, so memory_us is a floor.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


from cute_kernels.sparse_mla_decode.config import PartialConfig
from cute_kernels.sparse_mla_decode.kv_format import PRECISIONS
from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT, get_format
from dispatch.policy.registry import H200_SMEM_PER_SM, SM120_SMEM_PER_SM
from dispatch.policy.occupancy import bounded_f16_head_groups, ctas_per_split
from dispatch.policy.splits import plan_splits
from scripts.bench import GRID, list_lengths
from cute_kernels.sparse_mla_decode.tuning import DEFAULT_PRECISION
from dispatch.policy.head_groups import partial_shape_config

FORMAT = get_format(DEFAULT_FORMAT)  # the model is of the MODEL1 kernels (its grid: scripts.bench.GRID)
ISSUE_RATE = 0.26  # warp-instructions per scheduler per cycle: ncu, H200, T=64 H=64 topk=512
FIXED_US = 9.7  # the fastest call of the H200 bench at d931db8 (1 x 16 x 128)
SCHEDULERS_PER_SM = 4
# dense MMA FLOPs per SM and cycle on SM120 by kind: RTX 5090 (QuACK) TFLOP/s / (170 SMs x 2.407 GHz)
TENSOR_FLOP_PER_SM_CYCLE = {kind: tflops * 1e12 / (170 * 2.407e9)
                            for kind, tflops in (("16-bit", 255.0), ("fp8", 507.0), ("mxf8", 1000.0))}
BLOCK_N = PartialConfig.block_n


@dataclass(frozen=True)
class Device:
    name: str
    num_sms: int
    clock_ghz: float  # boost clock
    memory_gbs: float
    smem_per_sm: int
    tensor_flop_per_sm_cycle: dict | None  # None: no tensor term (the H200 check: its rates differ)
    arch: str = "sm_120a"  # the build it runs (``cute_kernels.arch``): its SASS and its dispatch choices


# published specifications (boost clock, memory bandwidth); shared memory per SM as the
# CUDA runtime reports it for the architecture
RTX_PRO_6000 = Device("RTX PRO 6000 Blackwell (sm_120)", 188, 2.617, 1792.0, SM120_SMEM_PER_SM,
                      TENSOR_FLOP_PER_SM_CYCLE)
# the model's check against the H200's measurements: issue and memory only (ISSUE_RATE was
# measured there, and there the e4m3 MMAs are emulated by f16 ones)
H200 = Device("H200 (model check)", 132, 1.98, 4800.0, H200_SMEM_PER_SM, None, "sm_90a")


def mma_kind_flops(opcode: str) -> tuple[str, int]:
    """(rate kind, FLOPs) of one SM120 MMA instruction of the SASS, e.g. ``HMMA.16816.F32``
    -> ("16-bit", 4096), ``QMMA.SF.16832.F32.E4M3.E4M3.E8`` -> ("mxf8", 8192)."""
    shape = re.search(r"\.(16)(8)(16|32)\b", opcode)
    if shape is None:
        raise ValueError(f"unknown MMA shape in {opcode!r}")
    flops = 2 * int(shape.group(1)) * int(shape.group(2)) * int(shape.group(3))
    if opcode.startswith("QMMA.SF"):
        return "mxf8", flops
    if opcode.startswith("QMMA"):
        return "fp8", flops
    if opcode.startswith("HMMA"):
        return "16-bit", flops
    raise ValueError(f"no SM120 rate for {opcode!r}")


def loop_work(precision: str, arch: str = "sm_120a") -> dict:
    """Per head groups (1, 2): (main-loop warp-instructions per chunk of one CTA, that
    chunk's MMA FLOPs by rate kind) of the shipped partial kernel (``arch``'s build) of
    ``precision``, counted in the SASS (compiles two variants): each loop's instructions
    times the warps that run it, summed over the kernel's main loops (the "f16" kernel has
    one per warp role: 7 nope warps, 1 rope warp), each without its nested loops (the
    rescale, which a chunk runs only when a softmax max moved). The "f16" kernel's exact
    softmax step, which also runs only then, is an ``if`` inside the loop and is counted:
    about 40 of each warp's instructions, an overestimate of about 6%."""
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="dsv4_mla_forecast_"))
    from cute_kernels.sass_check import disassemble, mma_loops
    from dispatch.policy.variant_space import KernelVariant
    from dispatch.runtime.loader import compile_variant

    out = {}
    for groups in (1, 2):
        cfg = PartialConfig(head_groups=groups, final_output=True, precision=precision)
        compiled = compile_variant(KernelVariant(cfg, arch), keep_cubin=True)
        loops = mma_loops(disassemble(compiled.artifacts.CUBIN))
        if precision == "f16":  # the nope loop runs f16 MMAs, the rope loop bf16 ones
            (nope,) = [lp for lp in loops if "HMMA.16816.F32" in lp.mma_kinds]
            (rope,) = [lp for lp in loops if "HMMA.16816.F32.BF16" in lp.mma_kinds]
            runs = [(nope, cfg.num_warps - 1), (rope, 1)]
        else:
            (loop,) = loops
            runs = [(loop, cfg.num_warps)]
        flops = {}
        for lp, warps in runs:
            for opcode, count in lp.mma_kinds.items():
                kind, f = mma_kind_flops(opcode)
                flops[kind] = flops.get(kind, 0) + warps * count * f
        out[groups] = (sum(warps * (lp.instructions - lp.nested) for lp, warps in runs), flops)
    return out


def model_us(T: int, H: int, shape: str, dev: Device, work: dict,
             precision: str = "bf16") -> tuple[float, float, float, float]:
    """(estimate, issue_us, tensor_us, memory_us) for one shape on ``dev``; ``work`` from
    ``loop_work(precision)``."""
    topk, extra = list_lengths(shape)
    cfg = partial_shape_config(H, T, dev.num_sms, precision, topk=topk, extra_topk=extra, smem_per_sm=dev.smem_per_sm,
                               bounded_head_groups=bounded_f16_head_groups(dev.arch))
    split = plan_splits(T, H, topk, extra, cfg=cfg, num_sms=dev.num_sms, smem_per_sm=dev.smem_per_sm)
    ctas = ctas_per_split(T, H, cfg) * split.num_splits
    chunks_per_sm = math.ceil(ctas / dev.num_sms) * split.chunks_per_split
    instructions, flops = work[cfg.head_groups]
    issue_us = chunks_per_sm * instructions / (SCHEDULERS_PER_SM * ISSUE_RATE * dev.clock_ghz * 1e3)
    rates = dev.tensor_flop_per_sm_cycle
    tensor_cycles = sum(f / rates[kind] for kind, f in flops.items()) if rates else 0.0
    tensor_us = chunks_per_sm * tensor_cycles / (dev.clock_ghz * 1e3)
    gathered = T * (topk + extra) * FORMAT.bytes_per_token  # once from DRAM: a token's head blocks run together (L2)
    memory_us = gathered / (dev.memory_gbs * 1e3)
    return FIXED_US + max(issue_us, tensor_us, memory_us), issue_us, tensor_us, memory_us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--h200-json", help="a scripts.bench --json file: check the model against it")
    args = ap.parse_args(argv)
    work = {p: loop_work(p) for p in PRECISIONS}
    measured, h200_precision = {}, DEFAULT_PRECISION
    if args.h200_json:
        rows = json.loads(Path(args.h200_json).read_text())["rows"]
        for row in rows:
            measured[(row["T"], row["H"], row["topk"])] = row["us"]
        if rows and rows[0].get("precision") not in (None, "default"):
            h200_precision = rows[0]["precision"]
    rates = ", ".join(f"{k} {v:.0f}" for k, v in TENSOR_FLOP_PER_SM_CYCLE.items())
    print(f"ESTIMATE, not a measurement: {RTX_PRO_6000.name}, {RTX_PRO_6000.num_sms} SMs, "
          f"{RTX_PRO_6000.clock_ghz} GHz, {RTX_PRO_6000.memory_gbs:.0f} GB/s; main loop warp-instructions "
          f"per chunk and CTA (16 / 32 heads per CTA, sm_120a SASS): "
          + ", ".join(f"{p} {work[p][1][0]} / {work[p][2][0]}" for p in PRECISIONS)
          + f"; issue rate {ISSUE_RATE}, fixed {FIXED_US} us (H200 measurements); MMA FLOP per SM and cycle: {rates}")
    print("each estimate is followed by its bound: i issue, t tensor, m memory")
    head = (f"{'T':>4} {'H':>4} {'topk':>8}" + "".join(f" {'est. us ' + p:>14}" for p in PRECISIONS)
            + f" {'memory us':>10}")
    if measured:
        head += f" {'H200 model':>11} {'H200 measured':>14} {'model/meas.':>12}"
    print(head)
    errors = []
    for T, H, shape in GRID:
        ests = {p: model_us(T, H, shape, RTX_PRO_6000, work[p], p) for p in PRECISIONS}
        mem = ests[DEFAULT_PRECISION][3]
        line = f"{T:>4} {H:>4} {shape:>8}"
        for p in PRECISIONS:
            est, issue, tensor, memory = ests[p]
            bound = "itm"[max(range(3), key=lambda k: (issue, tensor, memory)[k])]
            line += f" {est:>12.1f} {bound}"
        line += f" {mem:>10.2f}"
        if (T, H, shape) in measured:
            h200 = model_us(T, H, shape, H200, work[h200_precision], h200_precision)[0]
            ratio = h200 / measured[(T, H, shape)]
            errors.append(abs(math.log(ratio)))
            line += f" {h200:>11.1f} {measured[(T, H, shape)]:>14.1f} {ratio:>12.2f}"
        print(line)
    if errors:
        errors.sort()
        print(f"model vs H200 measurement: median |log ratio| {errors[len(errors) // 2]:.2f}, "
              f"worst {errors[-1]:.2f} (0.10 ~ 10%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
