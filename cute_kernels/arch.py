"""Target architectures: the facts of the hardware the kernels are built for, in one table.

Every kernel and dispatch decision that depends on the arch reads an ``Arch`` of ``ARCHS``
(``arch_facts(name)``); no arch name is compared anywhere else.

The kernels use warp-level ``mma.sync`` (f16 / bf16 m16n8k16 on every target), ``ldmatrix``,
``cp.async`` and plain loads and stores: what Ampere (sm_80, sm_86), Ada (sm_89), Hopper
(sm_90a) and SM120 (sm_120a, sm_121a) all have. What differs, per target:

- programmatic dependent launch (``griddepcontrol``, SASS ``ACQBULK`` / ``PREEXIT``): sm_90
  and later. Elsewhere the merge kernel is an ordinary launch that the stream orders after
  the partial kernel;
- the e4m3 conversions (``cvt.rn.f16x2.e4m3x2``, ``cvt.rn.satfinite.e4m3x2.f32``: SASS
  ``F2FP ... E4M3``): sm_89 and later. On sm_80 / sm_86 the kernels turn e4m3 bytes into f16
  by integer operations (``sparse_mla_decode.warp_ops.OperandConversion``);
- the e4m3 MMA (``mma.sync ... m16n8k32 .e4m3``): sm_89 and later (sm_90a has no such
  instruction: ptxas emulates it with f16 MMAs): the "fp8" path;
- the block-scaled MMA (``mma.sync ... kind::mxf8f6f4.block_scale``): sm_120a / sm_121a: the
  "mxf8" path;
- shared memory per CTA and per SM (registers: 64K per SM and 255 per thread on every one).

An arch profile (``DSV4_MLA_ARCH_PROFILE=sm_80`` and so on, ``profile``) runs one target's
choices on a GPU of another: the sm_80 profile on an H100 compiles the very code generated
for sm_80 (no PDL, the integer conversions, sm_80's compute paths, shared memory and CTAs per
SM) into sm_90a SASS, so that the GPU tests check the instruction sequences shipped for 8.x
on the test GPU. (An sm_80 cubin itself does not load there: SASS is compatible only within
a major version, 8.x to a later 8.y. PTX would be JIT-compiled by the driver, but the
exported objects carry SASS only; a profile is that JIT done ahead, for sm_90a.)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

REGISTERS_PER_SM = 65536  # on every target
MAX_REGISTERS_PER_THREAD = 255  # on every target

# what an ``Arch``'s instruction fields mean, for messages: field -> (what, the PTX)
FEATURES = {
    "pdl": ("programmatic dependent launch", "griddepcontrol"),
    "e4m3_cvt": ("e4m3 conversion instruction", "cvt.rn.f16x2.e4m3x2"),
    "e4m3_mma": ("e4m3 MMA", "mma.sync.aligned.m16n8k32 .e4m3"),
    "block_scaled_mma": ("block-scaled MMA", "mma.sync.aligned.kind::mxf8f6f4.block_scale"),
}

# SASS that no target of this project may contain: Hopper's warpgroup MMA (the kernels use
# warp-level MMA only, which every target has) and the datacenter Blackwell tensor-memory
# MMA (no target has it)
_NOT_USED = ("HGMMA", "QGMMA", "IGMMA", "BGMMA", "UTCHMMA", "UTCQMMA", "UTCIMMA", "UTCOMMA")
# per instruction field of ``Arch``: the SASS of an arch that has it, which one that lacks it
# must not contain ("OP.MOD": opcode OP with modifier MOD among its modifiers)
_SASS_OF = {
    "pdl": ("ACQBULK", "PREEXIT"),
    "e4m3_cvt": ("F2FP.E4M3",),
    "e4m3_mma": ("QMMA", "HMMA.E4M3"),
    "block_scaled_mma": ("QMMA.SF", "OMMA"),
}


@dataclass(frozen=True)
class Arch:
    """One compile target. ``name`` keys kernel variants and their caches; ``isa`` is what
    the compiler is given (``--gpu-arch``): the name itself, or for a profile the GPU's."""

    name: str
    isa: str
    pdl: bool
    e4m3_cvt: bool
    e4m3_mma: bool
    block_scaled_mma: bool
    smem_per_cta: int  # the most dynamic shared memory one CTA may use
    smem_per_sm: int  # shared memory per SM as the CUDA runtime reports it
    # whether its binaries are what a deployment runs: the AOT build SASS-checks them (no
    # spills, shared memory within ``smem_per_cta``, no instruction of ``forbidden_sass``)
    ships: bool
    profile_of: str | None = None  # a profile: the target whose choices these are

    @property
    def target(self) -> "Arch":
        """The target whose choices it makes: itself, or for a profile the one it stands for."""
        return ARCHS[self.profile_of] if self.profile_of else self

    @property
    def label(self) -> str:
        """The name messages use: ``sm_80``, or ``sm_80 (profile on sm_90a)``."""
        return self.name if self.profile_of is None else f"{self.profile_of} (profile on {self.isa})"

    @property
    def forbidden_sass(self) -> tuple[str, ...]:
        """SASS its binaries must not contain: what no target uses, and the instructions of
        every feature it lacks ("OP" an opcode, "OP.MOD" the opcode with that modifier)."""
        return _NOT_USED + tuple(s for field, sass in _SASS_OF.items() if not getattr(self, field) for s in sass)

    def lacks(self, feature: str) -> str | None:
        """None where it has ``feature`` (a field of ``FEATURES``), else why not, in words (of
        the target: a profile's facts are its target's)."""
        if getattr(self, feature):
            return None
        what, ptx = FEATURES[feature]
        return f"{self.target.name} has no {what} ({ptx})"


def _arch(name, *, pdl, e4m3, block_scaled=False, smem_per_cta, smem_per_sm, ships=True) -> Arch:
    return Arch(name, name, pdl=pdl, e4m3_cvt=e4m3, e4m3_mma=e4m3, block_scaled_mma=block_scaled,
                smem_per_cta=smem_per_cta, smem_per_sm=smem_per_sm, ships=ships)


# the targets (shared memory: the CUDA programming guide's table of compute capabilities)
ARCHS = {a.name: a for a in (
    _arch("sm_80", pdl=False, e4m3=False, smem_per_cta=166912, smem_per_sm=167936),  # A100: 163 / 164 KB
    _arch("sm_86", pdl=False, e4m3=False, smem_per_cta=101376, smem_per_sm=102400),  # A10, A40, RTX 30xx: 99 / 100 KB
    _arch("sm_89", pdl=False, e4m3=True, smem_per_cta=101376, smem_per_sm=102400),  # L4, L40S, RTX 40xx
    # H100 / H200: the test GPU (227 / 228 KB); its binaries are a test build, not checked
    _arch("sm_90a", pdl=True, e4m3=True, smem_per_cta=232448, smem_per_sm=233472, ships=False),
    _arch("sm_120a", pdl=True, e4m3=True, block_scaled=True, smem_per_cta=101376, smem_per_sm=102400),  # RTX 50xx, RTX PRO 6000
    _arch("sm_121a", pdl=True, e4m3=True, block_scaled=True, smem_per_cta=101376, smem_per_sm=102400),  # DGX Spark GB10
)}

# compute capability -> the target its binaries are built for
ARCH_BY_CAPABILITY = {
    (8, 0): "sm_80",
    (8, 6): "sm_86",
    # Jetson AGX Orin: sm_80's shared memory (164 KB per SM), and sm_80 SASS runs on 8.7
    # (binary compatibility within a major version): served by the sm_80 build
    (8, 7): "sm_80",
    (8, 9): "sm_89",
    (9, 0): "sm_90a",
    (12, 0): "sm_120a",
    (12, 1): "sm_121a",
}
SUPPORTED_ARCHS = tuple(ARCHS)
# what the default AOT build (the README's main job) compiles and CI checks
DEPLOYMENT_ARCHS = ("sm_120a", "sm_121a")
# the targets an arch profile can stand for (``profile``)
PROFILE_ARCHS = ("sm_80", "sm_86", "sm_89")
PROFILE_ENV = "DSV4_MLA_ARCH_PROFILE"

# every kernel stays within the smallest per-CTA shared memory of the targets, so that one
# configuration serves them all (``PartialConfig.check``)
SMEM_PER_CTA_MAX = min(a.smem_per_cta for a in ARCHS.values())
# shared memory the driver reserves per resident CTA, beside the kernel's own
RESERVED_SMEM_PER_CTA = 1024


def _profile_problems(of: str, on: str) -> list[str]:
    """Why a GPU of target ``on`` cannot run the profile of ``of`` (empty: it can)."""
    target, host = ARCHS[of], ARCHS[on]
    problems = [host.lacks(f) for f in FEATURES if getattr(target, f) and host.lacks(f)]
    if target.smem_per_cta > host.smem_per_cta:
        problems.append(f"{on} has {host.smem_per_cta} bytes of shared memory per CTA, {of} {target.smem_per_cta}")
    return problems


def profile(of: str, on: str) -> Arch:
    """The profile of target ``of`` (one of ``PROFILE_ARCHS``) on a GPU of target ``on``:
    ``of``'s facts, and so every choice the kernels and the dispatch make from them, compiled
    for ``on``. Refused (ValueError) where ``on`` lacks an instruction ``of`` has or has less
    shared memory per CTA."""
    if of not in PROFILE_ARCHS:
        raise ValueError(f"{PROFILE_ENV}={of!r}: a profile stands for one of {', '.join(PROFILE_ARCHS)}")
    problems = _profile_problems(of, on)
    if problems:
        raise ValueError(f"{PROFILE_ENV}={of}: the {of} profile cannot run on {on}: {'; '.join(problems)}")
    return dataclasses.replace(ARCHS[of], name=f"{of}_on_{on}", isa=ARCHS[on].isa, ships=False, profile_of=of)


# every profile a GPU of another target can run, by name ("sm_80_on_sm_90a", ...)
PROFILES = {f"{of}_on_{on}": profile(of, on) for of in PROFILE_ARCHS for on in ARCHS
            if on != of and not _profile_problems(of, on)}


def arch_facts(name: str) -> Arch:
    """The ``Arch`` of a target or profile name (KeyError naming the known ones otherwise)."""
    found = ARCHS.get(name) or PROFILES.get(name)
    if found is None:
        raise KeyError(f"unknown arch {name!r}: the targets are {', '.join(ARCHS)}, the profiles "
                       f"{', '.join(PROFILES)}")
    return found


def arch_for_capability(capability: tuple[int, int]) -> str | None:
    """The compile target for a device of this compute capability, or None if unsupported.
    With ``DSV4_MLA_ARCH_PROFILE`` set (sm_80, sm_86 or sm_89), the profile of that target on
    this device (``profile``; ValueError where the device cannot run it)."""
    arch = ARCH_BY_CAPABILITY.get(tuple(capability))
    wanted = os.environ.get(PROFILE_ENV, "")
    if not wanted or arch is None or wanted == arch:
        return arch
    return profile(wanted, arch).name
