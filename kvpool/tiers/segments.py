"""Segment files: the values of a :class:`~kvpool.tiers.file.FileTier` whose values are small, several to a
file.

A value smaller than ``FileTier.segment_bytes`` costs a file of its own more in system calls (``open``,
``writev``, ``close`` to store it; ``open``, ``readv``, ``close`` and ``unlink`` to pass it down) than in
bytes: a tier replay spent most of its time there. So each store's new values go into one **segment**, a
file ``<folder>/segments/<16 hex digits>`` holding them back to back (value ``i`` at offset ``i *
value_bytes``), written with one ``writev`` per ``WRITE_RECORDS`` values; a read is one ``preadv`` at the
value's offset (a call opens each segment it reads once). Eviction stays per value, in the tier's LRU
order: a value that leaves (evicted, deleted, found bad) is a dead slot; its header is zeroed (so a restart
does not index it again) unless its whole segment is dead, which is deleted. When dead slots outweigh the
tier's capacity, the segments holding them are **compacted**: their live values copied into a new segment
(verbatim: a MAC covers the value, not where it lies), the old files deleted; the LRU order does not change.
A value moved so gets a new stamp, so a read that found the old place cannot drop the new one.

Everything here runs under the tier's locks: changes of the folder under its ``_write_lock``, changes of
the bookkeeping under its ``_lock`` (the ``locked`` methods, called with it held).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from kvpool.errors import IntegrityError
from kvpool.tiers.backend import HEADER_BYTES, MAGIC

#: Values per ``writev`` (each is two buffers, header and payload; Linux takes at most 1024 per call).
WRITE_RECORDS = 256
#: A segment file's name: exactly what :meth:`Segments.path` writes (``int(name, 16)`` would also take
#: ``1f``, ``0x1f``, ``1_f``, `` 1f`` or upper case, whose values would be indexed but read elsewhere).
_SEGMENT_NAME = re.compile(r"[0-9a-f]{16}")
_KEY = slice(24, 40)  # the block key's bytes in a header


class Segments:
    """The segment files of one namespace folder and where each value lies in them.

    Args:
        folder: the namespace's folder (``segments/`` is made inside it).
        value_bytes: bytes per value (header and payload).
        lock: the tier's ``_lock`` (its bookkeeping).
        index: the tier's index (key -> stamp, least recently used first): a moved value is stamped anew.
        stamps: the tier's stamp counter.
    """

    def __init__(self, folder: str, value_bytes: int, lock: Any, index: OrderedDict[bytes, int],
                 stamps: Iterator[int]) -> None:
        self.folder = os.path.join(folder, "segments")
        os.makedirs(self.folder, exist_ok=True)
        self.value_bytes = value_bytes
        self._lock, self._index, self._stamps = lock, index, stamps
        self.where: dict[bytes, tuple[int, int]] = {}  # key -> (segment, slot)
        self.slots: dict[int, int] = {}  # segment -> values in its file
        self.live: dict[int, int] = {}  # segment -> values still indexed
        self._next = 0

    def path(self, segment: int) -> str:
        return f"{self.folder}{os.sep}{segment:016x}"

    @staticmethod
    def number(name: str) -> int | None:
        """The segment a file named ``name`` is (16 lowercase hex digits, as :meth:`path` names it), or
        None: no segment."""
        return int(name, 16) if _SEGMENT_NAME.fullmatch(name) else None

    @property
    def dead_bytes(self) -> int:
        """Bytes of dead slots in the segment files."""
        return (sum(self.slots.values()) - len(self.where)) * self.value_bytes

    # ---- writing ------------------------------------------------------------------------------------

    def write(self, values: list[list[Any]]) -> tuple[int, int]:
        """Write ``values`` (each a list of buffers: header, payload) into a new segment, in order;
        returns (segment, how many leading values are whole in it). A write the disk refuses keeps the
        values of the calls before it (the file is cut to them; none: deleted). Call :meth:`place` with
        their keys, under the lock, to make them readable."""
        with self._lock:
            segment, self._next = self._next, self._next + 1
        path = self.path(segment)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError:
            return segment, 0
        done = len(values)
        try:
            for start in range(0, len(values), WRITE_RECORDS):
                write_all(fd, [buf for value in values[start:start + WRITE_RECORDS] for buf in value])
        except OSError:  # keep what the disk took, in whole values
            done = 0
            with contextlib.suppress(OSError):
                done = min(len(values) - 1, os.fstat(fd).st_size // self.value_bytes)
                os.ftruncate(fd, done * self.value_bytes)
        finally:
            os.close(fd)
        if not done:
            unlink_quietly(path)
        return segment, done

    def place(self, segment: int, keys: list[bytes]) -> None:
        """Record ``keys`` as the values of ``segment``, in order (locked)."""
        if keys:
            for slot, key in enumerate(keys):
                self.where[key] = (segment, slot)
            self.slots[segment] = self.live[segment] = len(keys)

    # ---- reading ------------------------------------------------------------------------------------

    def read(self, key: bytes, buffers: list[Any], fds: dict[int, int]) -> str | None:
        """Read ``key``'s value into ``buffers`` (header, payload: one ``preadv`` at its offset); why it is
        a miss, or None. ``fds``: the segments this call opened (close them with :func:`close_all`). A
        value moved by a compaction meanwhile is looked for once more at its new place."""
        for _ in range(2):
            with self._lock:
                place = self.where.get(key)
            if place is None:
                return "missing"
            segment, slot = place
            try:
                fd = fds.get(segment)
                if fd is None:
                    fd = fds[segment] = os.open(self.path(segment), os.O_RDONLY)
                got = os.preadv(fd, buffers, slot * self.value_bytes)
            except FileNotFoundError:
                with self._lock:
                    if self.where.get(key) != place:
                        continue
                return "missing"
            except OSError:
                return "errors"
            return None if got == self.value_bytes else "corrupt"
        return "missing"

    # ---- removing -----------------------------------------------------------------------------------

    def forget_locked(self, key: bytes, erase: bool, erased: list[tuple[int, int]], empty: list[int]) -> None:
        """Forget ``key``'s place (locked): its segment is noted in ``empty`` once it has no live value
        left, else its slot in ``erased`` when ``erase`` (to zero its header, :meth:`erase`)."""
        place = self.where.pop(key, None)
        if place is None:
            return
        segment = place[0]
        self.live[segment] -= 1
        if not self.live[segment]:
            del self.live[segment], self.slots[segment]
            empty.append(segment)
        elif erase:
            erased.append(place)

    def erase(self, erased: list[tuple[int, int]], empty: list[int]) -> None:
        """Delete the ``empty`` segments and zero the headers of the ``erased`` slots of live ones (not of
        a segment that died since)."""
        for segment in empty:
            unlink_quietly(self.path(segment))
        gone = set(empty)
        erased = sorted(p for p in erased if p[0] not in gone)
        fd, at = -1, -1
        try:
            for segment, slot in erased:
                with self._lock:
                    if segment not in self.slots:
                        continue
                if segment != at:
                    if fd >= 0:
                        os.close(fd)
                    fd, at = os.open(self.path(segment), os.O_WRONLY), segment
                os.pwrite(fd, bytes(HEADER_BYTES), slot * self.value_bytes)
        except OSError:
            pass  # the slot stays: a restart may index it again (authentic, and under the capacity bound)
        finally:
            if fd >= 0:
                os.close(fd)

    def compact(self, capacity: int) -> None:
        """When dead slots hold more than ``capacity`` bytes, copy the live values of every segment that
        has dead slots into a new segment (oldest segment first, in slot order) and delete those files."""
        with self._lock:
            if self.dead_bytes <= capacity:
                return
            old = sorted(s for s in self.slots if self.live[s] < self.slots[s])
            moving = sorted((place, key) for key, place in self.where.items() if place[0] in old)
        values, keys, fds = [], [], {}
        try:
            for (segment, slot), key in moving:
                buf = bytearray(self.value_bytes)
                with contextlib.suppress(OSError):
                    fd = fds.get(segment)
                    if fd is None:
                        fd = fds[segment] = os.open(self.path(segment), os.O_RDONLY)
                    if os.preadv(fd, [buf], slot * self.value_bytes) == self.value_bytes:
                        values.append([buf])
                        keys.append(key)
        finally:
            close_all(fds)
        segment, done = self.write(values)
        with self._lock:
            for _, key in moving:
                self.where.pop(key, None)
            for s in old:  # every value of these segments is moved, or dropped (unreadable, not written)
                self.slots.pop(s, None)
                self.live.pop(s, None)
            self.place(segment, keys[:done])
            for _, key in moving:
                if key in self.where:
                    self._index[key] = next(self._stamps)  # an existing key keeps its place in the LRU order
                else:
                    self._index.pop(key, None)
        for s in old:
            unlink_quietly(self.path(s))

    # ---- at start, and checks -----------------------------------------------------------------------

    def scan(self, namespace: bytes) -> list[tuple[tuple[int, int], bytes]]:
        """The values earlier runs left, in the order they were written: ((segment, slot), key) for each
        slot whose header names a key of ``namespace`` (its MAC is checked when it is read), a later one
        of a key winning. Anything that is no segment (another name, a folder, a file that cannot be read)
        is deleted, a torn last value cut off, a segment without values deleted."""
        found: dict[bytes, tuple[int, int]] = {}
        for name in os.listdir(self.folder):
            path = os.path.join(self.folder, name)
            segment = self.number(name)
            try:
                if segment is None:
                    raise OSError("no segment")
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                remove_quietly(path)
                continue
            self._next = max(self._next, segment + 1)
            n = len(data) // self.value_bytes
            if len(data) % self.value_bytes:
                with contextlib.suppress(OSError):
                    os.truncate(path, n * self.value_bytes)
            self.slots[segment], self.live[segment] = n, 0
            for slot in range(n):
                header = data[slot * self.value_bytes:slot * self.value_bytes + HEADER_BYTES]
                if header[:4] == MAGIC and header[8:24] == namespace:
                    key = header[_KEY]
                    if key not in found or found[key] < (segment, slot):
                        found[key] = (segment, slot)
        for key, (segment, slot) in found.items():
            self.where[key] = (segment, slot)
            self.live[segment] += 1
        for segment in [s for s, n in self.live.items() if not n]:
            del self.slots[segment], self.live[segment]
            unlink_quietly(self.path(segment))
        return sorted((place, key) for key, place in found.items())

    def check_locked(self, capacity: int) -> None:
        """The files and the places agree (locked): each segment file holds its values, each place lies
        in one, live counts match, no other file, dead slots within ``capacity`` bytes."""
        files = {}
        for name in os.listdir(self.folder):
            segment = self.number(name)
            try:
                path = os.path.join(self.folder, name)
                if segment is None or not os.path.isfile(path):
                    raise OSError("no segment")
                files[segment] = os.stat(path).st_size
            except OSError:
                files[-1] = -1
        expected = {s: n * self.value_bytes for s, n in self.slots.items()}
        differ = set(files.items()) ^ set(expected.items())
        require(not differ, f"{len({s for s, _ in differ})} segment file(s) and the index disagree (name or "
                             f"size) in {self.folder}")
        live: dict[int, int] = {}
        for segment, slot in self.where.values():
            require(0 <= slot < self.slots.get(segment, 0), f"a value's place {segment:x}/{slot} is no slot")
            live[segment] = live.get(segment, 0) + 1
        require(live == self.live and len(set(self.where.values())) == len(self.where),
                 "live values per segment disagree with the places")
        require(self.dead_bytes <= capacity, f"dead slots hold {self.dead_bytes} B, over {capacity} B")


def close_all(fds: dict[int, int]) -> None:
    """Close the segments a call opened."""
    for fd in fds.values():
        os.close(fd)
    fds.clear()


def write_all(fd: int, parts: list[Any], offset: int | None = None) -> None:
    """``writev`` until every part is written (a short write continues where it stopped); at ``offset``
    (``pwritev``) when one is given."""
    views = [memoryview(p) for p in parts]
    while views:
        done = os.writev(fd, views) if offset is None else os.pwritev(fd, views, offset)
        if offset is not None:
            offset += done
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][done:]


def unlink_quietly(path: str | os.PathLike) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def remove_quietly(path: str | os.PathLike) -> None:
    """Delete what is at ``path``: a file, or a folder with everything in it (a tier's folder holds only
    what the tier put there; anything else found at start goes)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        unlink_quietly(path)


def require(ok: bool, what: str) -> None:
    """IntegrityError naming ``what`` unless ``ok``."""
    if not ok:
        raise IntegrityError(f"file tier invariant broken: {what}")
