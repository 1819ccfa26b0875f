"""How much of a host tensor's memory is resident in RAM: ``mincore(2)`` over the pages it spans.

A ``torch.empty`` CPU buffer is reserved address space; the kernel commits a page the first time it is
written. The process's RSS says how much of *everything* is resident (8.8 MB for a process holding a
128 KiB cache); :func:`resident_bytes` asks the kernel about the buffer's own pages. Pages the buffer
shares with neighbours (its first and last, when it does not start or end on a page boundary) count only
for the bytes that are the buffer's. Linux and macOS (libc ``mincore``); None elsewhere or off the CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any

import torch


@functools.cache
def _mincore() -> Any:
    """libc's ``mincore(addr, length, vec)``, or None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


def resident_bytes(t: torch.Tensor) -> int | None:
    """Bytes of ``t``'s storage that are resident in RAM now (0 for an empty tensor); None for a tensor
    off the CPU, or when the kernel cannot say (no ``mincore``, or it fails)."""
    if t.device.type != "cpu":
        return None
    storage = t.untyped_storage()
    start, nbytes = storage.data_ptr(), storage.nbytes()
    if nbytes == 0:
        return 0
    mincore = _mincore()
    if mincore is None:
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    base, end = start - start % page, start + nbytes
    pages = -(-(end - base) // page)
    vec = (ctypes.c_ubyte * pages)()
    if mincore(base, end - base, vec) != 0:
        return None
    flags = torch.frombuffer(vec, dtype=torch.uint8).bitwise_and(1)  # bit 0: the page is resident
    total = int(flags.sum()) * page
    total -= (start - base) if flags[0] else 0                      # the part of the first page before t
    total -= (base + pages * page - end) if flags[-1] else 0        # the part of the last page after t
    return total
