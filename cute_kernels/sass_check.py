"""Read a compiled kernel: registers, shared memory, local memory (spills), the SASS mix, and
what waits for a global load before its first copies are issued.

Uses ``cuobjdump`` and ``nvdisasm`` from the ``nvidia-cuda-cuobjdump`` and
``nvidia-cuda-nvdisasm`` wheels (the package's ``[aot]`` extra) or from PATH. No GPU needed.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

SASS_TOOLS = ("cuobjdump", "nvdisasm")
INSTALL_SASS_TOOLS = "python -m pip install nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump"


class MissingSassTool(RuntimeError):
    """cuobjdump or nvdisasm is not installed."""


def require_sass_tools() -> None:
    """Raise ``MissingSassTool``, naming the command that installs them, unless both SASS
    tools are found (call it before compiling anything that will be checked)."""
    for name in SASS_TOOLS:
        _tool(name)


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
        raise MissingSassTool(f"{name} not found (it reads the compiled kernels' SASS): {INSTALL_SASS_TOOLS}")
    return found


def _run_on_cubin(cubin: bytes, *commands: list) -> list[str]:
    """The stdout of each ``[tool, args...]`` run on the cubin (written to a temporary file)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return [subprocess.run([_tool(cmd[0]), *cmd[1:], path], capture_output=True, text=True, check=True).stdout
                for cmd in commands]
    finally:
        os.unlink(path)


@dataclass
class CubinReport:
    kernel: str
    registers: int
    stack_bytes: int
    local_bytes: int
    static_smem_bytes: int
    local_memory_instructions: int  # LDL/STL in the SASS
    mma_counts: dict = field(default_factory=dict)  # HMMA / QMMA / OMMA ... -> count
    forbidden: list = field(default_factory=list)  # instructions the target must not contain


def forbidden_in(opcodes, forbidden) -> list[str]:
    """The instructions of ``opcodes`` ((opcode, ".MOD.MOD..." modifiers) pairs) that an entry
    of ``forbidden`` names: "OP" any OP instruction, "OP.MOD" an OP with the modifier MOD
    (``Arch.forbidden_sass``); each as the opcode with its modifiers, sorted."""
    found = set()
    for op, mods in opcodes:
        names = set(mods.split(".")[1:])
        for entry in forbidden:
            want, *need = entry.split(".")
            if op == want and names.issuperset(need):
                found.add(op + mods)
    return sorted(found)


def inspect_cubin(cubin: bytes, forbidden) -> list[CubinReport]:
    """One report per kernel in the cubin; ``forbidden``: the SASS the target must not
    contain (``Arch.forbidden_sass``), reported in ``CubinReport.forbidden``."""
    res, sass = _run_on_cubin(cubin, ["cuobjdump", "-res-usage"], ["nvdisasm", "-c"])
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
    found = forbidden_in(opcodes, forbidden)
    for r in reports:  # one kernel per cubin in this project; counts are per cubin
        r.local_memory_instructions = local
        r.mma_counts = dict(counts)
        r.forbidden = found
    return reports


@dataclass
class LoopMix:
    """The instructions of one loop body in the SASS (static count: one pass through it)."""

    instructions: int
    mma: int
    shared_memory: int  # LDS*, STS*, LDSM*, LDGSTS (cp.async)
    barriers: int
    mma_kinds: dict = field(default_factory=dict)  # MMA opcode with modifiers -> count
    # of ``instructions``, those inside loops nested in this one (mma_loops: loops without
    # MMA, such as the "f16" kernel's 0-or-1-pass rescale, which a chunk runs only when a
    # softmax max moved): ``instructions - nested`` is the pass that skips them
    nested: int = 0
    # MMAs whose accumulator input is the output of the MMA just before them in program
    # order, fewer than ``CHAIN_WINDOW`` instructions back: each waits for that one's whole
    # latency (two or more interleaved chains hide it)
    chained_mma: int = 0
    opcodes: dict = field(default_factory=dict)  # opcode without modifiers (LDSM, F2FP, HMMA, ...) -> count


_SHARED_MEMORY_OPS = ("LDS", "STS", "LDSM", "LDGSTS")


def _instructions(sass: str):
    """(address, text) of every instruction and the address of every label."""
    label_addr, body, pending = {}, [], []
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        ins = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if ins:
            addr = int(ins.group(1), 16)
            for name in pending:
                label_addr[name] = addr
            pending = []
            body.append((addr, ins.group(2).strip()))
    return body, label_addr


def _is_mma(text: str) -> bool:
    return re.search(r"\b[A-Z]*MMA\b|\b[A-Z]*MMA\.", text) is not None


def _backward_loops(body, label_addr) -> list:
    """(start, end) of every loop closed by a backward branch."""
    loops = []
    for addr, text in body:
        # "@P0 BRA `(.L_x_1)", and the uniform form "BRA.U UP0, `(.L_x_1)"
        target = re.search(r"BRA(?:\.U)?\s+(?:!?UP\w+,\s*)?`?\(?(\.L_x_\d+)", text)
        if target and label_addr.get(target.group(1), addr + 1) <= addr:
            loops.append((label_addr[target.group(1)], addr))
    return loops


_MMA_OPERANDS = re.compile(r"^(?:@!?U?P\w+\s+)?[A-Z]*MMA\S*\s+(R\d+),\s*(R\d+),\s*(R\d+),\s*(R\d+|RZ)")


# An MMA's latency in issue slots (about 32 cycles on SM80-SM120 for a 16-bit m16n8k16): a
# dependent MMA at least this many instructions later does not wait for it.
CHAIN_WINDOW = 32


def _chained_mma(texts) -> int:
    """How many MMAs of ``texts`` (in program order) take the previous MMA's D register as
    their accumulator C (``HMMA D, A, B, C``) fewer than ``CHAIN_WINDOW`` instructions after it."""
    chained, previous_d, previous_at = 0, None, 0
    for at, text in enumerate(texts):
        m = _MMA_OPERANDS.match(text)
        if m:
            chained += m.group(4) == previous_d and at - previous_at < CHAIN_WINDOW
            previous_d, previous_at = m.group(1), at
    return chained


def _mix(body, start: int, end: int, inner=()) -> LoopMix:
    ops = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for a, t in body if start <= a <= end]
    return LoopMix(
        chained_mma=_chained_mma(t for a, t in body if start <= a <= end),
        nested=sum(1 for a, _ in body if any(s <= a <= e for s, e in inner)),
        instructions=len(ops),
        mma=sum(1 for o in ops if re.match(r"[A-Z]*MMA\b|[A-Z]*MMA\.", o)),
        shared_memory=sum(1 for o in ops if o.split(".")[0] in _SHARED_MEMORY_OPS),
        barriers=sum(1 for o in ops if o.startswith("BAR.")),
        mma_kinds=dict(collections.Counter(o for o in ops if re.match(r"[A-Z]*MMA\b|[A-Z]*MMA\.", o))),
        opcodes=dict(collections.Counter(o.split(".")[0] for o in ops)),
    )


def mma_loops(sass: str) -> list[LoopMix]:
    """Every innermost loop of ``sass`` that holds MMA instructions, in code order: the
    main loops of this project's partial kernels (one per warp role in the "f16" kernel);
    each one's ``nested`` counts the instructions of the loops (without MMA) inside it."""
    body, label_addr = _instructions(sass)
    with_mma = [(s, e) for s, e in _backward_loops(body, label_addr)
                if any(_is_mma(t) for a, t in body if s <= a <= e)]
    innermost = [(s, e) for s, e in with_mma if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e)
                                                          for s2, e2 in with_mma)]
    loops = _backward_loops(body, label_addr)

    def inner(s, e):  # the outermost loops nested in (s, e)
        nested = [(s2, e2) for s2, e2 in loops if s <= s2 and e2 <= e and (s2, e2) != (s, e)]
        return [(a, b) for a, b in nested if not any(c <= a and b <= d and (c, d) != (a, b) for c, d in nested)]
    return [_mix(body, s, e, inner(s, e)) for s, e in sorted(innermost)]


def mma_loop_mix(sass: str) -> LoopMix:
    """The innermost loop of ``sass`` (``nvdisasm -c`` text of one kernel) that holds every
    MMA instruction: the main loop of this project's partial kernel, one chunk per pass."""
    body, label_addr = _instructions(sass)
    mma = [a for a, t in body if _is_mma(t)]
    if not mma:
        raise ValueError("no MMA instruction in this SASS")
    loops = [(end - start, start, end) for start, end in _backward_loops(body, label_addr)
             if start <= min(mma) and end >= max(mma)]
    if not loops:
        raise ValueError("no loop holds every MMA instruction")
    _, start, end = min(loops)
    return _mix(body, start, end)


_LAUNCH_CONFIG = r"!llvm.struct<\(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32\)>"


def launch_smem_bytes(host_ir: str) -> int:
    """The dynamic shared memory a compiled DSL kernel is launched with, from its host code
    (``str(compiled.ir_module)``): the constant stored into the launch configuration's
    shared-memory field, which the DSL's allocator sized from the kernel's allocations."""
    found = set()
    fields = re.findall(r"(%\d+) = llvm.getelementptr %\d+\[0, 2\] : \(!llvm.ptr\) -> !llvm.ptr, " + _LAUNCH_CONFIG,
                        host_ir)
    for field in fields:
        for stored in re.findall(r"llvm.store (%\d+), " + field + r" : i64, !llvm.ptr", host_ir):
            found.update(int(v) for v in re.findall(re.escape(stored) + r" = llvm.mlir.constant\((\d+) : i64\)",
                                                    host_ir))
    if len(found) != 1:
        raise ValueError(f"expected one launch shared-memory size in the host code, found {sorted(found)}")
    return found.pop()


def disassemble(cubin: bytes) -> str:
    """``nvdisasm -c`` text of a cubin."""
    return _run_on_cubin(cubin, ["nvdisasm", "-c"])[0]


_REGISTER = re.compile(r"\bR(\d+)(\.64)?\b")


def _registers(operand_text: str) -> set[int]:
    """The registers an operand list names (``R4.64``: R4 and R5)."""
    regs = set()
    for m in _REGISTER.finditer(operand_text):
        regs.add(int(m.group(1)))
        if m.group(2):
            regs.add(int(m.group(1)) + 1)
    return regs


def waits_before_first_copy(sass: str) -> list[str]:
    """The instructions before a kernel's first ``cp.async`` group is committed (its first
    ``LDGDEPBAR``, in program order) that name a register a global load (``LDG``) before them
    writes, read or written: each waits for that load's round trip (a write too, for the
    load's result), so every copy of the group issued after it waits as well. A partial
    kernel's first group is its first chunks' indices (and Q's copies, where Q is copied):
    the first rows wait for it, and nothing may hold it back
    (``gather.ChunkGather.issue_first_indices``). Conservative: a register stays pending
    once loaded (a wait after the load has landed is still reported). Empty where no such
    instruction precedes the first commit, or where the kernel commits none."""
    body, _ = _instructions(sass)
    pending: set[int] = set()  # registers an LDG before here writes
    waits = []
    for _, text in body:
        op_text = re.sub(r"^@!?U?P\w+\s+", "", text)
        opcode, _, operands = op_text.partition(" ")
        if opcode.startswith("LDGDEPBAR"):
            return waits
        if pending & _registers(operands):
            waits.append(text)
        if opcode.startswith("LDG") and not opcode.startswith("LDGSTS"):
            # the width may sit before other suffixes (``LDG.E.64.CONSTANT``)
            suffixes = opcode.split(".")[1:]
            width = 4 if "128" in suffixes else 2 if "64" in suffixes else 1
            (first,) = _registers(operands.partition(",")[0])
            pending |= set(range(first, first + width))
    return []
