"""ESTIMATE of the decode times on an A100, an L40S and an RTX 4090 (compute capability 8.0 and
8.9), from each arch's SASS: ``scripts.sm120_forecast``'s model with these GPUs' numbers.

    python -m scripts.forecast_8x [--markdown]

No 8.x GPU has run these kernels: every number this prints is a model, not a measurement.
Per shape of scripts.bench's grid (MODEL1 FP8 caches) and compute path the arch has:

    time = FIXED_US + max(issue_us, tensor_us, memory_us)

with the main loops' warp-instructions and MMA FLOPs per chunk counted in the arch's own build
(sm_80: the e4m3 bytes turned into f16 by integer operations; sm_89: by the conversion
instruction, and the "fp8" path's e4m3 MMAs), the split and head groups the dispatch picks
for the GPU (its SMs and its shared memory per SM: on the A100 two 16-head "f16" CTAs share
an SM, as on the H200), the issue rate ncu measured on the H200, each GPU's published dense
tensor rate with f32 accumulation (``TENSOR_TFLOPS``) over its SMs and boost clock, and its
peak memory bandwidth. What it leaves out, all of which make it optimistic: 8.x has no
programmatic dependent launch, so a call with splits pays the merge kernel's launch after the
partial kernel instead of overlapping it (``FIXED_US`` is the H200's, PDL included); random
584-byte gathers reach less than the peak bandwidth of GDDR6 / GDDR6X; the issue rate of the
A100's and Ada's SMs is taken to be the H200's.
"""

from __future__ import annotations

import argparse
import sys

from cute_kernels.arch import arch_facts
from dispatch.policy.precision import precisions_for
from scripts.bench import GRID
from scripts.sm120_forecast import FIXED_US, ISSUE_RATE, Device, loop_work, model_us

# published dense tensor rates, f32 accumulation (TFLOP/s): A100 SXM4 (NVIDIA A100 datasheet),
# L40S (NVIDIA L40S datasheet), RTX 4090 (Ada architecture whitepaper: 16-bit and FP8 with FP32
# accumulate; the GeForce part runs them at half the FP16-accumulate rate)
TENSOR_TFLOPS = {"A100": {"16-bit": 312.0}, "L40S": {"16-bit": 362.05, "fp8": 733.0},
                 "RTX 4090": {"16-bit": 165.2, "fp8": 330.3}}


def device(name: str, arch: str, num_sms: int, clock_ghz: float, memory_gbs: float) -> Device:
    """A GPU of ``arch`` (its shared memory per SM from the arch table), its MMA rates per SM and cycle."""
    rates = {kind: tflops * 1e12 / (num_sms * clock_ghz * 1e9) for kind, tflops in TENSOR_TFLOPS[name].items()}
    return Device(f"{name} ({arch})", num_sms, clock_ghz, memory_gbs, arch_facts(arch).smem_per_sm, rates, arch)


# SMs, boost clock (GHz) and memory bandwidth (GB/s): published specifications
DEVICES = (
    device("A100", "sm_80", 108, 1.41, 2039.0),  # SXM4 80 GB, HBM2e
    device("L40S", "sm_89", 142, 2.52, 864.0),  # GDDR6
    device("RTX 4090", "sm_89", 128, 2.52, 1008.0),  # GDDR6X
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = ap.parse_args(argv)
    archs = sorted({d.arch for d in DEVICES})
    work = {(arch, p): loop_work(p, arch) for arch in archs for p in precisions_for(arch)}
    columns = [(d, p) for d in DEVICES for p in precisions_for(d.arch)]
    print(f"ESTIMATE, not a measurement; issue rate {ISSUE_RATE}, fixed {FIXED_US} us (H200 measurements); main "
          f"loop warp-instructions per chunk and CTA (16 / 32 heads per CTA): "
          + "; ".join(f"{arch} {p} {w[1][0]} / {w[2][0]}" for (arch, p), w in work.items()))
    for d in DEVICES:
        print(f"{d.name}: {d.num_sms} SMs, {d.clock_ghz} GHz, {d.memory_gbs:.0f} GB/s, MMA FLOP per SM and cycle "
              + ", ".join(f"{k} {v:.0f}" for k, v in d.tensor_flop_per_sm_cycle.items()))
    print("each estimate is followed by its bound: i issue, t tensor, m memory")
    names = [f"{d.name.split(' (')[0]} {p}" for d, p in columns]
    if args.markdown:
        print("| T | H | topk | " + " | ".join(f"{n} us" for n in names) + " |")
        print("| --- | --- | --- | " + " | ".join("---" for _ in names) + " |")
    else:
        print(f"{'T':>4} {'H':>4} {'topk':>8}" + "".join(f" {n:>16}" for n in names))
    for T, H, shape in GRID:
        cells = []
        for d, p in columns:
            est, issue, tensor, memory = model_us(T, H, shape, d, work[d.arch, p], p)
            cells.append(f"{est:.1f} {'itm'[max(range(3), key=lambda k: (issue, tensor, memory)[k])]}")
        if args.markdown:
            print(f"| {T} | {H} | {shape} | " + " | ".join(cells) + " |")
        else:
            print(f"{T:>4} {H:>4} {shape:>8}" + "".join(f" {c:>16}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
