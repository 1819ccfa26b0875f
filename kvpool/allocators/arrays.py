"""Flat per-block arrays that grow with the blocks a pool hands out, and what a pool may take of the machine.

A pool's per-block state (ref counts, the hash each block holds, its place in the eviction order) lives in
``librt.vecs`` vectors of 32- or 64-bit integers: 4 or 8 bytes an entry, no Python object per block, read and
written natively by the compiled pool. They cover the ids handed out so far (the pool's high-water mark),
not the whole pool: when a fresh id passes their length they grow to :func:`next_capacity`, by at least
:data:`GROWTH_CHUNK` entries and an eighth of their length, so growing costs O(1) per block amortized and a
pool of hundreds of millions of blocks that holds ten requests costs what those hold. A grown vector's old
buffer is freed once the new one replaces it; glibc keeps such freed pages resident (its heap grows for the
larger buffer past the hole), so after each large growth :func:`release_freed_memory` gives them back.
"""

from __future__ import annotations

import os
from typing import Any, Final

from librt.vecs import extend, vec
from mypy_extensions import i32, i64, u8

from kvpool.errors import InsufficientMemoryError
from kvpool.units import human_bytes

#: Entries a per-block array grows by at least (and starts with, pools smaller than that aside).
GROWTH_CHUNK: Final = 1 << 14
#: The largest pool in blocks: block ids are 32-bit, as the int32 block tables of attention kernels are.
MAX_BLOCKS: Final = (1 << 31) - 2
#: Bytes of a grown buffer from which its growth calls :func:`release_freed_memory` (4 MiB: the holes smaller
#: buffers leave stay resident, at most about twice that per array; a trim below it would cost the hot path
#: more than it gives back, the pages it releases being touched again at once).
LARGE_BUFFER: Final = 1 << 22
#: Entries of a kept fill buffer (:func:`_fill_span`): a growth fills its new entries in copies this long.
FILL_SPAN: Final = 1 << 12
_SPANS: dict[tuple[int, int], memoryview] = {}  # (fill, entry bytes) -> FILL_SPAN entries of fill
_TRIM: dict[str, Any] = {}  # "fn": glibc's malloc_trim, or None where the C library has none


def next_capacity(current: int, needed: int, limit: int, chunk: int = GROWTH_CHUNK) -> int:
    """The length a per-block array of ``current`` entries grows to so that it holds ``needed``: at least
    ``chunk`` (:data:`GROWTH_CHUNK`) and an eighth more, never past ``limit`` (the pool's size)."""
    return min(limit, max(needed, current + max(chunk, current >> 3)))


def grown_i32(values: vec[i32], length: int, fill: int) -> vec[i32]:
    """``values`` extended to ``length`` entries of ``fill`` (one new buffer, filled by memory copies)."""
    out = vec[i32](capacity=length)
    out = extend(out, values)
    span = _fill_span(fill, 4)
    rest = length - len(values)
    while rest > 0:
        take = min(rest, FILL_SPAN)
        out = extend(out, span[:take])
        rest -= take
    return out


def grown_i64(values: vec[i64], length: int, fill: int) -> vec[i64]:
    """``values`` extended to ``length`` entries of ``fill`` (one new buffer, filled by memory copies)."""
    out = vec[i64](capacity=length)
    out = extend(out, values)
    span = _fill_span(fill, 8)
    rest = length - len(values)
    while rest > 0:
        take = min(rest, FILL_SPAN)
        out = extend(out, span[:take])
        rest -= take
    return out


def _fill_span(fill: int, size: int) -> memoryview:
    """:data:`FILL_SPAN` entries of ``fill``, ``size`` bytes each, made once per fill value
    and size (4: int32, 8: int64) and kept: a growth copies from it instead of building a buffer of its fill
    each time."""
    span = _SPANS.get((fill, size))
    if span is None:
        entry = fill.to_bytes(size, "little", signed=True)
        raw = memoryview(entry * FILL_SPAN)
        span = _SPANS[(fill, size)] = raw.cast("i") if size == 4 else raw.cast("q")
    return span


def grown_u8(flags: vec[u8], length: int) -> vec[u8]:
    """The per-block flags ``flags`` extended to ``length`` zero bytes (itself when it is that long already;
    one new buffer, filled by a memory copy)."""
    if length <= len(flags):
        return flags
    out = vec[u8](capacity=length)
    out = extend(out, flags)
    return extend(out, memoryview(bytes(length - len(flags))))


def extend_to(values: list[Any], length: int, fill: object) -> None:
    """Extend the per-block list ``values`` in place to ``length`` entries of ``fill`` (none past it)."""
    if length > len(values):
        values.extend([fill] * (length - len(values)))


def release_freed_memory(grown_bytes: int) -> None:
    """After a buffer of ``grown_bytes`` replaced a smaller one: give the C heap's free pages back to the OS
    (glibc's ``malloc_trim(0)``, which also releases free pages inside the heap) when the buffer is at least
    :data:`LARGE_BUFFER`; nothing where the C library has no ``malloc_trim``. O(the heap's free chunks),
    called O(log n) times as a pool grows to n blocks."""
    if grown_bytes < LARGE_BUFFER:
        return
    if "fn" not in _TRIM:
        try:
            import ctypes

            _TRIM["fn"] = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError, ImportError):
            _TRIM["fn"] = None
    trim = _TRIM["fn"]
    if trim is not None:
        trim(0)


def available_memory() -> int | None:
    """Bytes of memory the machine can give now without swapping (psutil's ``available``, else the free
    pages the OS reports), or None where neither is known."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_fits_memory(what: str, num_blocks: int, bytes_per_block: int) -> None:
    """Refuse, before anything is built, bookkeeping of ``num_blocks`` blocks at ``bytes_per_block`` each
    (what it takes once every block has been handed out) that the machine's available memory cannot hold.

    Raises:
        InsufficientMemoryError: one line naming the bytes needed and the bytes available.
    """
    needed = num_blocks * bytes_per_block
    available = available_memory()
    if available is not None and needed > available:
        raise InsufficientMemoryError(
            f"{what} of {num_blocks:,} blocks needs {human_bytes(needed)} of bookkeeping once every block is "
            f"in use ({bytes_per_block} B per block), but this machine has {human_bytes(available)} "
            "available")
