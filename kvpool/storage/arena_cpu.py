"""The CPU back end of :class:`~kvpool.storage.arena.PageArena`: an anonymous private memory mapping.

``reserve`` maps the reservation (plus one page, to start it on a page boundary) with ``MAP_NORESERVE``:
address space only, nothing resident. ``commit`` faults a run of pages in with one
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14; elsewhere one written byte per OS page), so that what the
arena counts committed is resident; ``release`` gives a run back with one ``madvise(MADV_DONTNEED)``, after
which the pages read 0 and RSS drops by their size. The region is advised ``MADV_HUGEPAGE`` (where
transparent huge pages are on ``madvise``), so a 2 MiB-aligned page is one huge page: one fault to commit,
one TLB entry to read. ``tensor()`` is ``torch.frombuffer`` over the mapping: the same memory, no copy.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

from kvpool.errors import ConfigError, InsufficientMemoryError

#: ``MADV_POPULATE_WRITE`` (Linux 5.14): fault pages in writable, as a first write would.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class CPUBackend:
    """Anonymous ``mmap`` + ``madvise``; see the module docstring."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        #: the OS page: a CPU arena's page size must be a multiple of it
        self.granularity = mmap.PAGESIZE
        self._map: mmap.mmap | None = None
        self._offset = 0
        self._page_size = 0
        self._tensor: torch.Tensor | None = None
        self._populate = True  # MADV_POPULATE_WRITE works here (until the kernel says otherwise)

    def reserve(self, nbytes: int, page_size: int) -> None:
        """Map ``nbytes`` of address space (nothing resident), its start aligned to ``page_size``.
        ConfigError where the mapping fails or Python has no ``madvise`` (pages could not be given back)."""
        if not hasattr(mmap.mmap, "madvise"):
            raise ConfigError("a CPU page arena needs madvise (Linux, macOS), which this Python lacks")
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        try:
            self._map = mmap.mmap(-1, nbytes + page_size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, OverflowError, ValueError) as exc:
            raise ConfigError(f"cannot reserve {nbytes} B of address space: {exc}") from None
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        self._offset = (-whole.data_ptr()) % page_size
        self._page_size = page_size
        self._tensor = whole[self._offset:self._offset + nbytes]
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # no transparent huge pages: 4 KiB pages work, slower
                self._map.madvise(mmap.MADV_HUGEPAGE, self._offset, nbytes)

    def commit(self, first: int, count: int) -> None:
        """Fault pages ``first .. first + count - 1`` in; InsufficientMemoryError (none kept) when the
        kernel cannot."""
        start, length = self._range(first, count)
        if self._populate:
            try:
                self._advise(MADV_POPULATE_WRITE, start, length)
                return
            except OSError as exc:
                if exc.errno not in (22, 95):  # EINVAL / EOPNOTSUPP: an older kernel, touch instead
                    self._advise(mmap.MADV_DONTNEED, start, length)
                    raise InsufficientMemoryError(f"cannot commit {length} B: {exc}") from None
                self._populate = False
        step = self.granularity
        self.tensor()[start - self._offset:start - self._offset + length:step].zero_()

    def release(self, first: int, count: int) -> None:
        """Give pages ``first .. first + count - 1`` back to the OS (they read 0 afterwards)."""
        self._advise(mmap.MADV_DONTNEED, *self._range(first, count))

    def tensor(self) -> torch.Tensor:
        """``uint8 [nbytes]`` over the reservation (``torch.frombuffer``: the mapping's memory)."""
        if self._tensor is None:
            raise ConfigError("the CPU arena has no reservation yet")
        return self._tensor

    def close(self) -> None:
        """Give every page back. The mapping itself is unmapped when the last tensor over it is freed
        (``torch.frombuffer`` holds it)."""
        if self._map is not None and self._tensor is not None:
            self._advise(mmap.MADV_DONTNEED, self._offset, self._tensor.numel())

    def _range(self, first: int, count: int) -> tuple[int, int]:
        return self._offset + first * self._page_size, count * self._page_size

    def _advise(self, option: int, start: int, length: int) -> None:
        assert self._map is not None
        self._map.madvise(option, start, length)

