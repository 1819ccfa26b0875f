"""One memory limit shared by arenas in several processes: :class:`SharedMemoryBudget`.

A :class:`~kvpool.storage.arena.MemoryBudget` counts the bytes the arenas of one process commit. Engines in
separate processes (one model each, on one machine) share a limit through a small file instead: a
:class:`SharedMemoryBudget` over the same ``path`` in every process (``/dev/shm/...`` keeps it in memory).
The file holds the limit and one slot per process, ``(pid, bytes committed)``, read and written under an
exclusive ``flock``; a charge sums the slots, so the limit holds across the processes. A slot whose process
is gone (killed before it gave its pages back: the kernel took them back) is dropped at the next charge,
so a crash never leaks budget. The lock is held for a few microseconds per commit or release of pages (a
page commit itself costs hundreds of microseconds).

Limits: one machine (a lock file, pids); ``MAX_PROCESSES`` processes at once; a process sees its own
slot's bytes, and another's only at a charge.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvpool.errors import ConfigError, MemoryLimitError
from kvpool.storage.arena import MemoryBudget
from kvpool.units import human_bytes

#: Processes that may share one budget file at once.
MAX_PROCESSES = 64
_HEAD = struct.Struct("<q")  # the limit in bytes, -1: none
_SLOT = struct.Struct("<qq")  # pid (0: free), bytes committed
_SIZE = _HEAD.size + MAX_PROCESSES * _SLOT.size


class SharedMemoryBudget(MemoryBudget):
    """A :class:`MemoryBudget` whose limit and committed bytes are shared by every process that opens
    ``path`` (the file is made, with ``limit_bytes``, by the first; a later opener's ``limit_bytes``, when
    not None, replaces the limit, as :meth:`set_limit`). Pass it as ``ElasticConfig(budget=...)`` in each
    process.

    Raises ConfigError for a path that cannot be opened or a file of another size, MemoryLimitError as
    :class:`MemoryBudget` does (a charge past the limit, summed over the processes; a limit below what they
    hold), and ConfigError when ``MAX_PROCESSES`` processes hold slots already.
    """

    def __init__(self, path: str | os.PathLike[str], limit_bytes: int | None = None) -> None:
        super().__init__(None)
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot open the budget file {self.path}: {exc.strerror}") from None
        self._fd, self._pid, self._local = fd, os.getpid(), threading.Lock()
        mapped: mmap.mmap | None = None
        with self._locked():
            size = os.fstat(fd).st_size
            if size == 0:
                os.ftruncate(fd, _SIZE)
                mapped = mmap.mmap(fd, _SIZE)
                _HEAD.pack_into(mapped, 0, -1)
            elif size == _SIZE:
                mapped = mmap.mmap(fd, _SIZE)
        if mapped is None:
            os.close(fd)
            raise ConfigError(f"{self.path} is not a kvpool budget file ({size} bytes)")
        self._map = mapped
        if limit_bytes is not None:
            self.set_limit(limit_bytes)

    @property
    def limit_bytes(self) -> int | None:
        """The limit shared by every process (None: none)."""
        limit = _HEAD.unpack_from(self._map, 0)[0]
        return None if limit < 0 else limit

    @property
    def committed_bytes(self) -> int:
        """Bytes committed by every live process under this budget."""
        with self._locked():
            return sum(self._slots().values())

    @property
    def own_bytes(self) -> int:
        """Bytes this process holds committed under the budget."""
        with self._locked():
            return self._slots().get(self._pid, 0)

    def set_limit(self, limit_bytes: int | None) -> None:
        """Change the shared limit; below the bytes the processes hold it raises MemoryLimitError."""
        probe = MemoryBudget(limit_bytes)  # checks the value (ConfigError for a bad one)
        with self._locked():
            held = sum(self._slots().values())
            if probe.limit_bytes is not None and probe.limit_bytes < held:
                raise MemoryLimitError(f"a limit of {human_bytes(probe.limit_bytes)} is below the "
                                       f"{human_bytes(held)} committed under this budget")
            _HEAD.pack_into(self._map, 0, -1 if probe.limit_bytes is None else probe.limit_bytes)

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` more for this process, or raise MemoryLimitError (nothing counted)."""
        with self._locked():
            slots, limit = self._slots(), self.limit_bytes
            held = sum(slots.values())
            if limit is not None and held + nbytes > limit:
                raise MemoryLimitError(f"committing {human_bytes(nbytes)} more would pass the shared "
                                       f"budget's limit of {human_bytes(limit)} ({human_bytes(held)} "
                                       f"committed by {len(slots)} processes)")
            self._write(slots.get(self._pid, 0) + nbytes)

    def credit(self, nbytes: int) -> None:
        """Count ``nbytes`` as given back by this process."""
        with self._locked():
            self._write(max(0, self._slots().get(self._pid, 0) - nbytes))

    def close(self) -> None:
        """Give this process's slot back (its arenas must be closed or asleep) and close the file."""
        with self._locked():
            self._write(0)
        self._map.close()
        os.close(self._fd)

    def __repr__(self) -> str:
        limit = self.limit_bytes
        return (f"SharedMemoryBudget({str(self.path)!r}, committed={human_bytes(self.committed_bytes)}, "
                f"limit={'none' if limit is None else human_bytes(limit)})")

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._local:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _slots(self) -> dict[int, int]:
        """Live processes' committed bytes (a dead process's slot is cleared)."""
        out = {}
        for i in range(MAX_PROCESSES):
            pid, held = _SLOT.unpack_from(self._map, _HEAD.size + i * _SLOT.size)
            if pid and not _alive(pid):
                _SLOT.pack_into(self._map, _HEAD.size + i * _SLOT.size, 0, 0)
            elif pid:
                out[pid] = held
        return out

    def _write(self, held: int) -> None:
        """Set this process's slot to ``held`` bytes (0 frees the slot)."""
        free = None
        for i in range(MAX_PROCESSES):
            offset = _HEAD.size + i * _SLOT.size
            pid = _SLOT.unpack_from(self._map, offset)[0]
            if pid == self._pid:
                _SLOT.pack_into(self._map, offset, self._pid if held else 0, held)
                return
            if pid == 0 and free is None:
                free = offset
        if not held:
            return
        if free is None:
            raise ConfigError(f"{MAX_PROCESSES} processes share {self.path} already")
        _SLOT.pack_into(self._map, free, self._pid, held)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
