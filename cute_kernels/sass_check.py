"""Read a compiled cubin: registers, shared memory, local memory (spills) and the SASS mix.

Uses ``cuobjdump`` and ``nvdisasm`` from the ``nvidia-cuda-cuobjdump`` and
``nvidia-cuda-nvdisasm`` wheels (or from PATH). No GPU needed.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

# Instructions that must not appear in an SM120 kernel: Hopper-only warpgroup MMA and
# Blackwell datacenter tensor-memory MMA (SM120 has neither).
FORBIDDEN_ON_SM120 = ("HGMMA", "QGMMA", "IGMMA", "BGMMA", "UTCHMMA", "UTCQMMA", "UTCIMMA", "UTCOMMA")


def _tool(name: str) -> str:
    try:
        import nvidia  # the namespace package the wheels install into

        for base in nvidia.__path__:
            for sub in ("cu13", "cuda_nvdisasm", "cuda_cuobjdump"):
                path = os.path.join(base, sub, "bin", name)
                if os.path.exists(path):
                    return path
    except ImportError:
        pass
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: pip install nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump")
    return found


@dataclass
class CubinReport:
    kernel: str
    registers: int
    stack_bytes: int
    local_bytes: int
    static_smem_bytes: int
    local_memory_instructions: int  # LDL/STL in the SASS
    mma_counts: dict = field(default_factory=dict)  # HMMA / QMMA / OMMA ... -> count
    forbidden: list = field(default_factory=list)


def inspect_cubin(cubin: bytes) -> list[CubinReport]:
    """One report per kernel in the cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    reports = []
    for name, usage in re.findall(r"Function (\S+):\s*\n\s*(REG:.*)", res):
        val = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", usage))
        reports.append(CubinReport(kernel=name.rstrip(":"), registers=int(val.get("REG", 0)),
                                   stack_bytes=int(val.get("STACK", 0)), local_bytes=int(val.get("LOCAL", 0)),
                                   static_smem_bytes=int(val.get("SHARED", 0)), local_memory_instructions=0))
    opcodes = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)", sass, re.M)
    counts = collections.Counter()
    for op, mods in opcodes:
        if op.endswith("MMA"):
            counts[op + mods] += 1
    local = sum(1 for op, _ in opcodes if op in ("LDL", "STL"))
    forbidden = sorted({op for op, _ in opcodes if op in FORBIDDEN_ON_SM120})
    for r in reports:  # one kernel per cubin in this project; counts are per cubin
        r.local_memory_instructions = local
        r.mma_counts = dict(counts)
        r.forbidden = forbidden
    return reports
