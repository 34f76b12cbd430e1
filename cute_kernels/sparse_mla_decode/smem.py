"""Shared-memory plans: each kernel's regions, in allocation order, and their total size.

A plan is the one description of a kernel's shared memory: the kernel allocates its regions
from it (``SmemPlan.allocate``, which refuses a region out of order or of another size), and
the configuration's size (``PartialConfig.smem_bytes``: the 99 KB gate, the CTAs an SM
holds) is the plan's ``total_bytes``, the bytes the DSL's allocator hands the launch. The
AOT build records that launch size for every variant and a CPU test compares the two.
No CUTLASS here: the dispatch reads plans on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Region:
    name: str
    nbytes: int
    align: int  # byte alignment of its start


class SmemPlan:
    """Regions laid out in order, each at the next multiple of its alignment."""

    def __init__(self, regions: list[Region]):
        self.regions = tuple(regions)
        self.offsets = {}
        end = 0
        for r in self.regions:
            if r.name in self.offsets:
                raise ValueError(f"region {r.name!r} twice in one plan")
            start = -(-end // r.align) * r.align
            self.offsets[r.name] = start
            end = start + r.nbytes
        self.total_bytes = end

    def region(self, name: str) -> Region:
        return next(r for r in self.regions if r.name == name)

    def table(self) -> list[tuple[str, int, int]]:
        """(name, offset, bytes) of every region: the kernel's shared-memory map."""
        return [(r.name, self.offsets[r.name], r.nbytes) for r in self.regions]

    def allocator(self, smem) -> "PlanAllocator":
        """Allocation, in the kernel, of this plan's regions through the DSL allocator ``smem``."""
        return PlanAllocator(self, smem)


class PlanAllocator:
    """Hands out a plan's regions in plan order (at trace time)."""

    def __init__(self, plan: SmemPlan, smem):
        self.plan, self.smem, self.next = plan, smem, 0

    def allocate(self, name: str, dtype, layout):
        """The region ``name`` as a tensor of ``dtype`` laid out by ``layout`` (whose cosize
        times the element size must be the region's bytes)."""
        import cutlass.cute as cute

        region = self.plan.regions[self.next]
        if region.name != name:
            raise ValueError(f"shared memory region {name!r} allocated where the plan has {region.name!r}")
        nbytes = cute.cosize(layout) * dtype.width // 8
        if nbytes != region.nbytes:
            raise ValueError(f"shared memory region {name!r}: {nbytes} bytes allocated, the plan has {region.nbytes}")
        self.next += 1
        return self.smem.allocate_tensor(dtype, layout, byte_alignment=region.align)
