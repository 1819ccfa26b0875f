"""A fake of the CUDA driver's virtual memory calls (``cuda.bindings.driver``) that records every call and
checks the rules the real driver enforces (CUDA Driver API, "Virtual Memory Management"):

* a mapping lies inside a reservation, at an address and size that are multiples of the granularity, of a
  handle that was created with exactly that size and is not mapped yet;
* ``cuMemSetAccess`` and ``cuMemsetD8`` cover only mapped memory (access is set after the map);
* ``cuMemUnmap`` names exactly one whole mapping; ``cuMemRelease`` comes after the handle's unmap;
* ``cuMemAddressFree`` frees a whole reservation with nothing mapped in it;
* every memory call runs with a context pushed.

A broken rule raises AssertionError at the call (a real driver returns an error or corrupts memory).
``fail_create_after``: ``cuMemCreate`` answers CUDA_ERROR_OUT_OF_MEMORY once that many handles exist.
Signatures and names follow cuda-bindings 13.5 (``tests/test_arena_cuda.py`` compares them with the real
module where it is installed).
"""

from __future__ import annotations

import enum
import types
from dataclasses import dataclass, field
from typing import Any


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemAllocationGranularity_flags(enum.IntEnum):  # noqa: N801 (the driver's name)
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class CUmemAccess_flags(enum.IntEnum):  # noqa: N801 (the driver's name)
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUdeviceptr(int):
    """The driver's device pointer (an int here)."""


@dataclass
class _Location:
    type: int = 0
    id: int = -1


@dataclass
class CUmemAllocationProp:
    type: int = 0
    location: _Location = field(default_factory=_Location)


@dataclass
class CUmemAccessDesc:
    location: _Location = field(default_factory=_Location)
    flags: int = 0


GRANULARITY = 2 << 20
BASE = 1 << 40


class FakeDriver(types.SimpleNamespace):
    """The fake driver module; ``calls`` lists ``(name, args)`` in order."""

    def __init__(self, *, granularity: int = GRANULARITY, fail_create_after: int | None = None) -> None:
        super().__init__()
        self.CUresult, self.CUdeviceptr = CUresult, CUdeviceptr
        self.CUmemAllocationProp, self.CUmemAccessDesc = CUmemAllocationProp, CUmemAccessDesc
        self.CUmemAllocationType, self.CUmemLocationType = CUmemAllocationType, CUmemLocationType
        self.CUmemAllocationGranularity_flags = CUmemAllocationGranularity_flags
        self.CUmemAccess_flags = CUmemAccess_flags
        self.granularity = granularity
        self.fail_create_after = fail_create_after
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.initialized = False
        self.context_depth = 0
        self.retained = 0
        self.reservations: dict[int, int] = {}      # start -> size
        self.handles: dict[int, int] = {}           # handle -> size (created, not released)
        self.mapped: dict[int, tuple[int, int]] = {}  # start -> (size, handle)
        self.accessible: set[int] = set()           # mapping starts whose access was set
        self._next_handle = 1
        self._next_base = BASE

    # ---- context and device -------------------------------------------------------------------------
    def cuInit(self, flags: int) -> tuple:  # noqa: N802
        self._log("cuInit", flags)
        self.initialized = True
        return (CUresult.CUDA_SUCCESS,)

    def cuDeviceGet(self, ordinal: int) -> tuple:  # noqa: N802
        self._log("cuDeviceGet", ordinal)
        assert self.initialized, "cuDeviceGet before cuInit"
        return (CUresult.CUDA_SUCCESS, ordinal)

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple:  # noqa: N802
        self._log("cuDevicePrimaryCtxRetain", dev)
        self.retained += 1
        return (CUresult.CUDA_SUCCESS, f"ctx{dev}")

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple:  # noqa: N802
        self._log("cuDevicePrimaryCtxRelease", dev)
        assert self.retained > 0, "context released more often than retained"
        self.retained -= 1
        return (CUresult.CUDA_SUCCESS,)

    def cuCtxPushCurrent(self, ctx: str) -> tuple:  # noqa: N802
        self._log("cuCtxPushCurrent", ctx)
        assert self.retained, "pushing a context that was not retained"
        self.context_depth += 1
        return (CUresult.CUDA_SUCCESS,)

    def cuCtxPopCurrent(self) -> tuple:  # noqa: N802
        self._log("cuCtxPopCurrent")
        assert self.context_depth > 0, "pop without a push"
        self.context_depth -= 1
        return (CUresult.CUDA_SUCCESS, "ctx")

    def cuCtxSynchronize(self) -> tuple:  # noqa: N802
        self._log("cuCtxSynchronize")
        self._need_context()
        return (CUresult.CUDA_SUCCESS,)

    def cuGetErrorName(self, error: CUresult) -> tuple:  # noqa: N802
        return (CUresult.CUDA_SUCCESS, CUresult(error).name.encode())

    # ---- virtual memory -----------------------------------------------------------------------------
    def cuMemGetAllocationGranularity(self, prop: CUmemAllocationProp, option: int) -> tuple:  # noqa: N802
        self._log("cuMemGetAllocationGranularity", prop, option)
        self._check_prop(prop)
        return (CUresult.CUDA_SUCCESS, self.granularity)

    def cuMemAddressReserve(self, size: int, alignment: int, addr: int, flags: int) -> tuple:  # noqa: N802
        self._log("cuMemAddressReserve", size, alignment, addr, flags)
        self._need_context()
        assert size > 0 and size % self.granularity == 0, f"reserve size {size} not a granularity multiple"
        assert alignment % self.granularity == 0, f"alignment {alignment} not a granularity multiple"
        start = -(-self._next_base // alignment) * alignment
        self._next_base = start + size + self.granularity
        self.reservations[start] = size
        return (CUresult.CUDA_SUCCESS, CUdeviceptr(start))

    def cuMemAddressFree(self, ptr: int, size: int) -> tuple:  # noqa: N802
        self._log("cuMemAddressFree", int(ptr), size)
        self._need_context()
        assert self.reservations.get(int(ptr)) == size, "cuMemAddressFree of no whole reservation"
        assert not any(int(ptr) <= m < int(ptr) + size for m in self.mapped), "freeing a range still mapped"
        del self.reservations[int(ptr)]
        return (CUresult.CUDA_SUCCESS,)

    def cuMemCreate(self, size: int, prop: CUmemAllocationProp, flags: int) -> tuple:  # noqa: N802
        self._log("cuMemCreate", size, prop, flags)
        self._need_context()
        self._check_prop(prop)
        assert size > 0 and size % self.granularity == 0, f"create size {size} not a granularity multiple"
        if self.fail_create_after is not None and len(self.handles) >= self.fail_create_after:
            return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
        handle = self._next_handle
        self._next_handle += 1
        self.handles[handle] = size
        return (CUresult.CUDA_SUCCESS, handle)

    def cuMemMap(self, ptr: int, size: int, offset: int, handle: int, flags: int) -> tuple:  # noqa: N802
        self._log("cuMemMap", int(ptr), size, offset, handle, flags)
        self._need_context()
        start = int(ptr)
        assert start % self.granularity == 0 and size % self.granularity == 0, "unaligned map"
        assert offset == 0 and flags == 0
        assert self.handles.get(handle) == size, "mapping a handle not created with this size"
        assert handle not in {h for _, h in self.mapped.values()}, "handle mapped twice"
        assert self._reserved(start, size), "map outside every reservation"
        assert not self._overlaps(start, size), "map over a mapped range"
        self.mapped[start] = (size, handle)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemSetAccess(self, ptr: int, size: int, desc: list, count: int) -> tuple:  # noqa: N802
        self._log("cuMemSetAccess", int(ptr), size, desc, count)
        self._need_context()
        assert count == len(desc) == 1
        d = desc[0]
        assert d.flags == CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        assert d.location.type == CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE and d.location.id >= 0
        self.accessible.update(self._fully_mapped(int(ptr), size, "cuMemSetAccess"))
        return (CUresult.CUDA_SUCCESS,)

    def cuMemsetD8(self, dst: int, value: int, n: int) -> tuple:  # noqa: N802
        self._log("cuMemsetD8", int(dst), value, n)
        self._need_context()
        starts = self._fully_mapped(int(dst), n, "cuMemsetD8")
        assert set(starts) <= self.accessible, "cuMemsetD8 before cuMemSetAccess"
        return (CUresult.CUDA_SUCCESS,)

    def cuMemUnmap(self, ptr: int, size: int) -> tuple:  # noqa: N802
        self._log("cuMemUnmap", int(ptr), size)
        self._need_context()
        assert self.mapped.get(int(ptr), (None,))[0] == size, "unmap of no whole mapping"
        del self.mapped[int(ptr)]
        self.accessible.discard(int(ptr))
        return (CUresult.CUDA_SUCCESS,)

    def cuMemRelease(self, handle: int) -> tuple:  # noqa: N802
        self._log("cuMemRelease", handle)
        assert handle in self.handles, "release of an unknown handle"
        assert handle not in {h for _, h in self.mapped.values()}, "release of a handle still mapped"
        del self.handles[handle]
        return (CUresult.CUDA_SUCCESS,)

    # ---- helpers ------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """The names of the calls so far, in order."""
        return [name for name, _ in self.calls]

    def _log(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))

    def _need_context(self) -> None:
        assert self.context_depth > 0, "a memory call without a current context"

    def _check_prop(self, prop: CUmemAllocationProp) -> None:
        assert prop.type == CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        assert prop.location.type == CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE and prop.location.id >= 0

    def _reserved(self, start: int, size: int) -> bool:
        return any(r <= start and start + size <= r + n for r, n in self.reservations.items())

    def _overlaps(self, start: int, size: int) -> bool:
        return any(m < start + size and start < m + n for m, (n, _) in self.mapped.items())

    def _fully_mapped(self, start: int, size: int, what: str) -> list[int]:
        """The mapping starts that tile ``[start, start + size)`` exactly; AssertionError otherwise."""
        covered, at = [], start
        while at < start + size:
            assert at in self.mapped, f"{what} over unmapped memory at {at:#x}"
            covered.append(at)
            at += self.mapped[at][0]
        assert at == start + size, f"{what} ends inside a mapping"
        return covered
