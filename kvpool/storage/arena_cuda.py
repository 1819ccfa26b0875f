"""The CUDA back end of :class:`~kvpool.storage.arena.PageArena`: the driver's virtual memory management API.

Through NVIDIA's ``cuda-python`` bindings (``cuda.bindings.driver``, imported on first use; the ``cuda``
extra), as kvcached and vLLM 0.34's extensible KV cache do it:

* once: ``cuInit``, the device's primary context (``cuDevicePrimaryCtxRetain``, the one torch uses), the
  granularity (``cuMemGetAllocationGranularity``, minimum, of pinned device memory: 2 MiB on current GPUs)
  and ``cuMemAddressReserve`` of the whole reservation, aligned to the page size;
* commit of a run of pages: per page ``cuMemCreate`` (one physical allocation of ``page_size``) and
  ``cuMemMap`` at its address, then one ``cuMemSetAccess`` (read/write from this device) and one
  ``cuMemsetD8`` to 0 over the run. A failure unmaps and releases what the call created and raises;
* release of a run: ``cuCtxSynchronize`` (no kernel still reads the pages), then per page ``cuMemUnmap``
  and ``cuMemRelease``;
* close: ``cuMemAddressFree`` and ``cuDevicePrimaryCtxRelease``.

Every call runs with the primary context pushed (``cuCtxPushCurrent`` / ``cuCtxPopCurrent``), whatever is
current on the thread. Sizes and addresses are multiples of the granularity. ``tensor()`` hands the
reservation to torch without a copy through ``__cuda_array_interface__`` (``torch.as_tensor``), with page 0
mapped for the moment torch asks the driver which device the address is on; torch's caching allocator never
owns it. Measured per 2 MiB page on an A100 by kvcached: create 193 us, map
1.45 us, set_access 36 us, unmap 25.6 us (``kvpool bench memory`` prints this machine's beside them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from kvpool.errors import ConfigError, DriverError, InsufficientMemoryError


def import_driver() -> Any:
    """``cuda.bindings.driver`` (cuda-python >= 12.6), or ConfigError naming the extra to install."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise ConfigError("a CUDA page arena needs NVIDIA's cuda-python bindings (pip install "
                          f"'kvpool[cuda]', the major version of your driver's CUDA): {exc}") from None
    return driver


class CudaArray:
    """The reservation as ``__cuda_array_interface__`` (version 3): ``uint8 [nbytes]`` at ``ptr``.
    ``torch.as_tensor`` keeps this object, and so ``owner``, alive as long as the tensor."""

    def __init__(self, ptr: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


def cuda_tensor(ptr: int, nbytes: int, device: torch.device, owner: object) -> torch.Tensor:
    """A ``uint8 [nbytes]`` CUDA tensor over device memory at ``ptr`` on ``device``, without a copy;
    ``owner`` lives as long as the tensor."""
    return torch.as_tensor(CudaArray(ptr, nbytes, owner), device=device)


class _Driver:
    """Calls into the driver with the status checked, under the device's primary context."""

    def __init__(self, drv: Any, index: int) -> None:
        self.drv = drv
        self.call("cuInit", 0)
        (self.dev,) = self.call("cuDeviceGet", index)
        (self.ctx,) = self.call("cuDevicePrimaryCtxRetain", self.dev)

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The primary context pushed for the calls inside (whatever is current on the thread)."""
        self.call("cuCtxPushCurrent", self.ctx)
        try:
            yield
        finally:
            self.call("cuCtxPopCurrent")

    def call(self, name: str, *args: Any) -> tuple[Any, ...]:
        """Call driver function ``name``; return its results after the status, or raise
        InsufficientMemoryError (out of memory) / DriverError (anything else)."""
        drv = self.drv
        result = getattr(drv, name)(*args)
        status, values = result[0], tuple(result[1:])
        if status != drv.CUresult.CUDA_SUCCESS:
            named = drv.cuGetErrorName(status)
            label = named[1].decode() if named[0] == drv.CUresult.CUDA_SUCCESS else str(status)
            if status == drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                raise InsufficientMemoryError(f"{name} failed: {label} (the device is out of memory)")
            raise DriverError(f"{name} failed: {label}")
        return values


class _Reservation:
    """The reserved range and the page handles mapped in it; freed when the last tensor over it (which
    owns this object) and the back end are gone, or by :meth:`free`."""

    def __init__(self, driver: _Driver, nbytes: int, page_size: int) -> None:
        self.driver, self.nbytes, self.page_size = driver, nbytes, page_size
        with driver.context():
            (ptr,) = driver.call("cuMemAddressReserve", nbytes, page_size, 0, 0)
        self.base = int(ptr)
        self.handles: list[Any] = [None] * (nbytes // page_size)

    def ptr(self, page: int) -> Any:
        return self.driver.drv.CUdeviceptr(self.base + page * self.page_size)

    def unmap(self, pages: Iterable[int]) -> None:
        """``cuMemUnmap`` then ``cuMemRelease`` each page (the caller holds the context)."""
        for page in pages:
            self.driver.call("cuMemUnmap", self.ptr(page), self.page_size)
            self.driver.call("cuMemRelease", self.handles[page])
            self.handles[page] = None

    def free(self) -> None:
        """Unmap what is still mapped, free the range and the context (once)."""
        if not self.nbytes:
            return
        with self.driver.context():
            self.unmap([p for p, h in enumerate(self.handles) if h is not None])
            self.driver.call("cuMemAddressFree", self.ptr(0), self.nbytes)
        self.nbytes = 0
        self.driver.call("cuDevicePrimaryCtxRelease", self.driver.dev)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the driver may be gone already
            self.free()


class CUDABackend:
    """Reserve / commit / release pages of one CUDA device through the driver; see the module docstring.

    Args:
        device: a CUDA device (``cuda`` is the current one).
        driver: the ``cuda.bindings.driver`` module or an object with its functions (tests pass a fake
            that checks every call); default: imported.
        to_tensor: ``(ptr, nbytes, device, owner) -> tensor`` over the reservation (default
            :func:`cuda_tensor`; a test on a machine without a GPU passes its own).

    Raises:
        ConfigError: no cuda-python. DriverError: the driver refuses the device.
    """

    def __init__(self, device: torch.device, *, driver: Any = None,
                 to_tensor: Callable[[int, int, torch.device, object], torch.Tensor] = cuda_tensor) -> None:
        drv = driver if driver is not None else import_driver()
        index = device.index if device.index is not None else _current_device()
        self.device = torch.device("cuda", index)
        self._to_tensor = to_tensor
        self._driver = _Driver(drv, index)
        self._prop = drv.CUmemAllocationProp()
        self._prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = index
        self._access = drv.CUmemAccessDesc()
        self._access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = index
        self._access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        minimum = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        with self._driver.context():
            (granularity,) = self._driver.call("cuMemGetAllocationGranularity", self._prop, minimum)
        #: bytes: page sizes and every address and size must be multiples of it
        self.granularity = int(granularity)
        self._res: _Reservation | None = None

    def reserve(self, nbytes: int, page_size: int) -> None:
        """``cuMemAddressReserve`` of ``nbytes`` aligned to ``page_size`` (address space only)."""
        self._res = _Reservation(self._driver, nbytes, page_size)

    def commit(self, first: int, count: int) -> None:
        """Create, map, open and clear pages ``first .. first + count - 1``; on a failure, undo the run
        and raise InsufficientMemoryError (out of memory) or DriverError."""
        res, call = self._reservation(), self._driver.call
        done: list[int] = []
        with self._driver.context():
            try:
                for page in range(first, first + count):
                    (handle,) = call("cuMemCreate", res.page_size, self._prop, 0)
                    try:
                        call("cuMemMap", res.ptr(page), res.page_size, 0, handle, 0)
                    except BaseException:
                        call("cuMemRelease", handle)
                        raise
                    res.handles[page] = handle
                    done.append(page)
                start, length = res.ptr(first), count * res.page_size
                call("cuMemSetAccess", start, length, [self._access], 1)
                call("cuMemsetD8", start, 0, length)
            except BaseException:
                res.unmap(done)
                raise

    def release(self, first: int, count: int) -> None:
        """Wait for the device, then unmap and release pages ``first .. first + count - 1``."""
        res = self._reservation()
        with self._driver.context():
            self._driver.call("cuCtxSynchronize")
            res.unmap(range(first, first + count))

    def tensor(self) -> torch.Tensor:
        """``uint8 [nbytes]`` over the reservation; it keeps the reservation alive. torch asks the driver
        which device the base address is on (``cudaPointerGetAttributes``), which an address with nothing
        mapped cannot answer: page 0 is committed while the tensor is made, and released after if it was
        not committed before."""
        res = self._reservation()
        transient = res.handles[0] is None
        if transient:
            self.commit(0, 1)
        try:
            return self._to_tensor(res.base, res.nbytes, self.device, res)
        finally:
            if transient:
                self.release(0, 1)

    def close(self) -> None:
        """Unmap every page and free the reservation and the context."""
        if self._res is not None:
            self._res.free()

    def _reservation(self) -> _Reservation:
        if self._res is None or not self._res.nbytes:
            raise ConfigError("the CUDA arena has no reservation (not reserved yet, or closed)")
        return self._res


def _current_device() -> int:
    return torch.cuda.current_device() if torch.cuda.is_available() else 0
