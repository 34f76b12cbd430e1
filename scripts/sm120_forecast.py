"""ESTIMATE of the decode times on an RTX PRO 6000 Blackwell (sm_120), from the sm_120a SASS.

    python scripts/sm120_forecast.py [--h200-json bench.json]

No SM120 GPU has run these kernels: every number this prints for it is a model, not a
measurement. The model, per shape of scripts/bench.py's grid:

    time = FIXED_US + max(issue_us, memory_us)

- issue_us: the partial kernel is bound by instruction issue on the H200 (ncu: issue slots
  26% busy, see BENCHMARKS.md). Per SM it issues (CTAs per SM) x (chunks per CTA) x (the
  main loop's warp-instructions per chunk and CTA: instructions per thread and chunk in the
  sm_120a SASS of the shipped kernel times the warps running that loop); at ISSUE_RATE warp-instructions per scheduler and cycle, 4
  schedulers per SM, the device's boost clock. The split and the head groups are the ones
  the dispatch picks for that device (dispatch/splits.py, dispatch/variants.py).
- memory_us: the bytes gathered (584 per selected entry; once per token: the head blocks
  of a token, which read the same rows, are adjacent in the grid and run together, so all
  but the first read them from L2) at the device's peak memory bandwidth: a lower bound
  that only matters if it exceeds issue_us.
- FIXED_US: the shortest call measured on the H200 (launches, the dependent index -> row
  load chain, the merge), taken as the same on SM120.

Each compute path gets its own estimate (its own main-loop count: bf16, f16, fp8, and mxf8,
the block-scaled form only SM120 has); the model charges every instruction the same issue
slot, so it says nothing about the MMA rates themselves.

With ``--h200-json`` (a scripts/bench.py --json file) the same model is also evaluated for
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
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cute_kernels.sparse_mla_decode.config import PRECISIONS, PartialConfig  # noqa: E402
from cute_kernels.sparse_mla_decode.layout import TOKEN_BYTES  # noqa: E402
from dispatch.registry import H200_SMEM_PER_SM, SM120_SMEM_PER_SM  # noqa: E402
from dispatch.splits import ctas_per_split, plan_splits  # noqa: E402
from scripts.bench import GRID, list_lengths  # noqa: E402
from dispatch.variants import DEFAULT_PRECISION, partial_shape_config  # noqa: E402

ISSUE_RATE = 0.26  # warp-instructions per scheduler per cycle: ncu, H200, T=64 H=64 topk=512
FIXED_US = 11.4  # the fastest call of the H200 bench at 08710b7 (1 x 16 x 128)
SCHEDULERS_PER_SM = 4
BLOCK_N = PartialConfig.block_n


@dataclass(frozen=True)
class Device:
    name: str
    num_sms: int
    clock_ghz: float  # boost clock
    memory_gbs: float
    smem_per_sm: int


# published specifications (boost clock, memory bandwidth); shared memory per SM as the
# CUDA runtime reports it for the architecture
RTX_PRO_6000 = Device("RTX PRO 6000 Blackwell (sm_120)", 188, 2.617, 1792.0, SM120_SMEM_PER_SM)
H200 = Device("H200 (model check)", 132, 1.98, 4800.0, H200_SMEM_PER_SM)


def loop_instructions(precision: str) -> dict:
    """Main-loop warp-instructions per chunk of one CTA of the shipped partial kernel
    (sm_120a) of ``precision``, for one and two head groups, counted in the SASS (compiles
    two variants): the loop's instructions times the warps that run it, summed over the
    kernel's main loops (the "f16" kernel has one per warp role: 7 nope warps, 1 rope warp),
    each without its nested rescale loop (a chunk runs it only when a softmax max moved)."""
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="dsv4_mla_forecast_"))
    from cute_kernels.sass_check import disassemble, mma_loops
    from dispatch.loader import compile_variant
    from dispatch.variants import KernelVariant

    out = {}
    for groups in (1, 2):
        cfg = PartialConfig(head_groups=groups, final_output=True, precision=precision)
        compiled = compile_variant(KernelVariant(cfg, "sm_120a"), keep_cubin=True)
        loops = mma_loops(disassemble(compiled.artifacts.CUBIN))
        if precision == "f16":  # the nope loop runs f16 MMAs, the rope loop bf16 ones
            (nope,) = [lp for lp in loops if "HMMA.16816.F32" in lp.mma_kinds]
            (rope,) = [lp for lp in loops if "HMMA.16816.F32.BF16" in lp.mma_kinds]
            out[groups] = (cfg.num_warps - 1) * (nope.instructions - nope.nested) + rope.instructions - rope.nested
        else:
            (loop,) = loops
            out[groups] = cfg.num_warps * (loop.instructions - loop.nested)
    return out


def model_us(T: int, H: int, shape: str, dev: Device, instrs: dict,
             precision: str = "bf16") -> tuple[float, float, float]:
    """(estimate, issue_us, memory_us) for one shape on ``dev``; ``instrs`` from
    ``loop_instructions(precision)``."""
    topk, extra = list_lengths(shape)
    cfg = partial_shape_config(H, T, dev.num_sms, precision, entries=topk + extra, smem_per_sm=dev.smem_per_sm)
    split = plan_splits(T, H, topk, extra, cfg=cfg, num_sms=dev.num_sms, smem_per_sm=dev.smem_per_sm)
    ctas = ctas_per_split(T, H, cfg) * split.num_splits
    ctas_per_sm = math.ceil(ctas / dev.num_sms)
    warp_instructions = ctas_per_sm * split.chunks_per_split * instrs[cfg.head_groups]
    issue_us = warp_instructions / (SCHEDULERS_PER_SM * ISSUE_RATE * dev.clock_ghz * 1e3)
    gathered = T * (topk + extra) * TOKEN_BYTES  # once from DRAM: a token's head blocks run together (L2)
    memory_us = gathered / (dev.memory_gbs * 1e3)
    return FIXED_US + max(issue_us, memory_us), issue_us, memory_us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--h200-json", help="a scripts/bench.py --json file: check the model against it")
    args = ap.parse_args(argv)
    instrs = {p: loop_instructions(p) for p in PRECISIONS}
    measured, h200_precision = {}, DEFAULT_PRECISION
    if args.h200_json:
        rows = json.loads(Path(args.h200_json).read_text())["rows"]
        for row in rows:
            measured[(row["T"], row["H"], row["topk"])] = row["us"]
        if rows and rows[0].get("precision") not in (None, "default"):
            h200_precision = rows[0]["precision"]
    print(f"ESTIMATE, not a measurement: {RTX_PRO_6000.name}, {RTX_PRO_6000.num_sms} SMs, "
          f"{RTX_PRO_6000.clock_ghz} GHz, {RTX_PRO_6000.memory_gbs:.0f} GB/s; main loop warp-instructions "
          f"per chunk and CTA (16 / 32 heads per CTA, sm_120a SASS): "
          + ", ".join(f"{p} {instrs[p][1]} / {instrs[p][2]}" for p in PRECISIONS)
          + f"; issue rate {ISSUE_RATE}, fixed {FIXED_US} us (H200 measurements)")
    head = (f"{'T':>4} {'H':>4} {'topk':>8}" + "".join(f" {'est. us ' + p:>12}" for p in PRECISIONS)
            + f" {'memory us':>10}")
    if measured:
        head += f" {'H200 model':>11} {'H200 measured':>14} {'model/meas.':>12}"
    print(head)
    errors = []
    for T, H, shape in GRID:
        ests = {p: model_us(T, H, shape, RTX_PRO_6000, instrs[p], p) for p in PRECISIONS}
        mem = ests[DEFAULT_PRECISION][2]
        line = f"{T:>4} {H:>4} {shape:>8}" + "".join(f" {ests[p][0]:>12.1f}" for p in PRECISIONS) + f" {mem:>10.2f}"
        if (T, H, shape) in measured:
            h200 = model_us(T, H, shape, H200, instrs[h200_precision], h200_precision)[0]
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
