"""``FileTier``: blocks as files in a directory, bounded in bytes, least recently used evicted first.

Layout: ``DIR/<namespace tag>/<first 2 hex digits>/<32 hex digits of the block key>``, each file one value
(64-byte header with its MAC + payload, see :mod:`kvpool.tiers.backend`), written with one ``writev``
straight to its name (a payload of at least ``FileTier.overlap_bytes``: the payload first, while the MAC
thread computes the header, then the header): a key is indexed only once its file is whole, and a torn
file (a crash mid-write) fails its MAC. The index (key -> the stamp of the write that made its file, LRU
order) lives in memory; files left by an earlier run of the same namespace are indexed at start (oldest
modification first), so a restart finds them (and a file that does not verify under this run's key is a
miss then); anything else in the folder (another name, a folder, a temporary file) is deleted then. One
tier owns a namespace directory at a time (an exclusive ``flock`` on ``.lock``; a second, of this process or
another, is refused saying which); share blocks across processes with the Redis tier.

Threads: reads (``exists``, ``get``, ``refresh``) take the index lock only for their index lookups and read
the file outside it (a ``get`` of blocks of at least ``FileTier.overlap_bytes`` checks each block's MAC on
the tier's MAC thread while it reads the next one: a load then costs about max(read, MAC), not their
sum); every change of the folder (``set``'s writes and evictions, ``delete``, ``clear``, the removal of a
file a read found bad) runs under ``_write_lock`` together with its index change, so the
index and the files never disagree. A reader never waits for that lock (a store may hold it while its
evictions cascade into a stalled Redis): it notes the bad file, and whoever holds the lock next removes it,
if its index entry is still the one the read found (a block evicted and written again meanwhile is left
alone).

Faults: a write that fails (``ENOSPC``, ``EIO``, a read-only disk) is a store failure, its file removed; a
missing, truncated, flipped, foreign or unauthenticated file is a miss and the file is deleted.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from pathlib import Path

import torch

from kvpool.numeric import as_int
from kvpool.tiers._disk_folder import claim_folder, key_of, release_folder
from kvpool.tiers.auth import TierKey, require_auth_key
from kvpool.tiers.backend import HEADER_BYTES, Namespace, TierBackend, block_key, encode_header, verify_parts
from kvpool.tiers.segments import Segments, close_all, remove_quietly, require, unlink_quietly, write_all
from kvpool.units import plural

#: ``listener(keys, payloads)``: blocks a store is about to evict, with their verified payloads.
Cascade = Callable[[list[bytes], list[bytes]], None]


class FileTier(TierBackend):
    """A directory of block files holding at most ``capacity_bytes`` (values with their 64-byte headers).

    Args:
        directory: the folder (created if missing); each namespace gets its own subfolder.
        namespace: the blocks' :class:`Namespace`.
        capacity_bytes: the bound; the least recently used files are deleted to stay under it.
        block_bytes: payload bytes per block (0: hash-only values, a header each).
        auth_key: the fleet's :class:`~kvpool.tiers.auth.TierKey` (str or bytes: a secret) that signs and
            verifies every file (``TierKey.from_env()``; ``TierKey.public()`` to opt out).

    Raises:
        ConfigError: no ``auth_key``; ``directory`` is a file, cannot be created or written, or another
            process holds this namespace's folder; InvalidArgumentError: a capacity that is not an int >= 0.
    """

    medium = "disk"
    #: Payload bytes from which ``get`` checks each block's MAC on a thread of its own while it reads the
    #: next block (0: never): below it the hand-off costs about what it hides.
    overlap_bytes = 1 << 20
    #: Values (header and payload) smaller than this go into segment files, several to a file
    #: (:mod:`kvpool.tiers.segments`): below it a file per value costs more in system calls than in bytes.
    segment_bytes = 1 << 16

    def __init__(self, directory: str | os.PathLike, namespace: Namespace, *, capacity_bytes: int,
                 block_bytes: int, auth_key: TierKey | str | bytes | None = None) -> None:
        super().__init__(namespace, block_bytes)
        self._capacity = as_int(capacity_bytes, "capacity_bytes", minimum=0)
        self.auth_key = require_auth_key(auth_key, "a disk tier")
        self.directory = Path(directory)
        self._dir = self.directory / namespace.tag
        self._prefix = f"{self._dir}{os.sep}"  # a block's path as a str (pathlib costs more than the I/O)
        self._write_lock = threading.RLock()  # changes of the folder, each with its index change
        self._doomed: list[tuple[bytes, int, bool]] = []  # bad files a read found: (key, stamp, unlink)
        self._stamps = itertools.count(1)  # a stamp per indexed write: a reader knows the file it read
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> stamp, least recently used first
        self._lock_fd, self._held = claim_folder(self._dir)
        self._subdirs: set[str] = set()
        self._cascade: Cascade | None = None
        self._macs: concurrent.futures.ThreadPoolExecutor | None = None  # the MAC thread of big loads
        self._segments = Segments(str(self._dir), self.value_bytes, self._lock, self._index, self._stamps) \
            if self.value_bytes < self.segment_bytes else None
        self._scan()

    # ---- the interface ------------------------------------------------------------------------------

    def exists(self, keys: Sequence[Hashable]) -> int:
        index, n = self._index, 0
        with self._lock:
            for key in keys:  # converted one at a time: a long tail past the first miss costs nothing
                if block_key(key) not in index:
                    break
                n += 1
        return n

    def get(self, keys: Sequence[Hashable], out: torch.Tensor | None) -> int:
        names = self._check_rows(keys, out, "out")
        fds: dict[int, int] = {}
        try:
            if out is not None and len(names) > 1 and 0 < self.overlap_bytes <= self.block_bytes:
                n = self._get_overlapped(names, out, fds)
            else:
                n = self._get_in_turn(names, out, fds)
        finally:
            close_all(fds)
        with self._lock:
            self._stats.loaded += n
            self._stats.loaded_bytes += n * self.block_bytes
        return n

    def _get_in_turn(self, names: list[bytes], out: torch.Tensor | None, fds: dict[int, int]) -> int:
        """Read and verify one block after the other; how many leading ones are good."""
        n = 0
        for i, key in enumerate(names):
            with self._lock:
                stamp = self._index.get(key)
                if stamp is None:
                    self._stats.missing += 1
                    break
                self._index.move_to_end(key)
            why = self._read(key, out[i] if out is not None and self.block_bytes else None, fds=fds)
            if why is not None:
                why = self._unless_gone(key, stamp, why)
                self._miss(key, why, stamp)
                break
            n += 1
        return n

    def _get_overlapped(self, names: list[bytes], out: torch.Tensor, fds: dict[int, int]) -> int:
        """As :meth:`_get_in_turn`, the MAC of block ``i`` checked on the tier's MAC thread while block ``i +
        1`` is read (BLAKE3 and ``readv`` release the GIL), so a load costs about max(read, MAC) instead of
        their sum. A block is marked recently used once it verified, in order, so the index ends as the
        one-by-one loop leaves it (a block read ahead of a bad one is not refreshed)."""
        n, checking = 0, None  # checking: (key, stamp, future of why block n is a miss)
        for i, key in enumerate([*names, None]):
            stamp, why, header = None, None, bytearray(HEADER_BYTES)
            if key is not None:
                with self._lock:
                    stamp = self._index.get(key)
                if stamp is not None:
                    why = self._read(key, out[i], header=header, fds=fds)
            if checking is not None:
                bad = checking[2].result()
                if bad is not None:
                    bad = self._unless_gone(checking[0], checking[1], bad)
                    self._miss(checking[0], bad, checking[1])
                    return n
                with self._lock:
                    if checking[0] in self._index:
                        self._index.move_to_end(checking[0])
                n += 1
            if key is None:
                return n
            if stamp is None:  # not indexed
                with self._lock:
                    self._stats.missing += 1
                return n
            if why is not None:
                self._miss(key, self._unless_gone(key, stamp, why), stamp)
                return n
            checking = (key, stamp, self._mac_thread().submit(self._verify, key, header, out[i]))
        return n

    def _unless_gone(self, key: bytes, stamp: int, why: str) -> str:
        """``why`` a read of ``key`` (indexed under ``stamp``) failed, or ``"missing"`` when the key left
        the index (or was written again) meanwhile: what the read met was its removal (a deleted file, a
        zeroed slot of a segment), not a bad value."""
        with self._lock:
            return why if self._index.get(key) == stamp else "missing"

    def _mac_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._macs is None:
                self._macs = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-disk-mac")
            return self._macs

    def set(self, keys: Sequence[Hashable], blocks: torch.Tensor | None) -> int:
        """Refresh the keys held already, then write the others in order, as if one at a time into an LRU
        bounded by the capacity: the least recently used files are evicted first (all the batch needs at
        once, passed down together), and when the batch alone exceeds the capacity its first blocks, which
        such a store would evict again at once, go down instead of being written."""
        names = self._check_rows(keys, blocks, "blocks")
        with self._folder():  # one store at a time: its room is made for its own writes
            with self._lock:
                held = [key in self._index for key in names]
                for key, there in zip(names, held, strict=True):
                    if there:
                        self._index.move_to_end(key)
            new = list({names[i]: i for i in range(len(names)) if not held[i]}.values())
            fits = self._capacity // self.value_bytes
            if not fits:
                self._count_failure(len(new))
                return sum(held)
            left_out, new = new[:max(0, len(new) - fits)], new[max(0, len(new) - fits):]
            rows = blocks if blocks is not None and self.block_bytes else None
            self._make_room(len(new), [(names[i], rows[i] if rows is not None else None) for i in left_out])
            batch = [(names[i], rows[i] if rows is not None else None) for i in new]
            if self._segments is not None:
                written = self._write_segment(batch) if batch else 0
            else:
                written = sum(self._write(key, row) for key, row in batch)
        return sum(held) + written

    def delete(self, keys: Sequence[Hashable]) -> int:
        with self._folder():
            with self._lock:
                gone = [key for key in map(block_key, keys) if self._index.pop(key, None) is not None]
            self._drop_files([(key, True) for key in gone])
        return len(gone)

    def clear(self) -> int:
        with self._folder():
            with self._lock:
                keys = list(self._index)
            return self.delete(keys)

    def refresh(self, keys: Sequence[Hashable]) -> None:
        with self._lock:
            for key in map(block_key, keys):
                if key in self._index:
                    self._index.move_to_end(key)

    def set_eviction_listener(self, listener: Cascade | None) -> None:
        """Call ``listener(keys, payloads)`` with the blocks a store evicts, before their files are deleted
        (the offload manager cascades them to the next tier); corrupt ones are left out."""
        self._cascade = listener

    @property
    def capacity_bytes(self) -> int | None:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return len(self._index) * self.value_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def check_integrity(self) -> None:
        """The index and the directory agree: every indexed block has a file of one value's size (or, for
        values in segments, a slot of a segment file of its size: :meth:`Segments.check_locked`), there
        is no other file, and ``used_bytes`` (their sum) is within the capacity."""
        with self._folder(), self._lock:
            if self._segments is not None:
                stray = [p for p in self._dir.glob("*/*") if p.parent.name != "segments"]
                _require(not stray, f"{plural(len(stray), 'file')} outside the segments in {self._dir}")
                _require(set(self._segments.where) == set(self._index), "the index and the segments disagree")
                self._segments.check_locked(self._capacity)
            else:
                files = {f"{p.parent.name}/{p.name}": p.stat().st_size for p in self._dir.glob("*/*")}
                indexed = {f"{key.hex()[:2]}/{key.hex()}": self.value_bytes for key in self._index}
                differ = set(files.items()) ^ set(indexed.items())  # a name in one only, or another size
                _require(not differ, f"{plural(len({name for name, _ in differ}), 'file')} and the index "
                                     f"disagree (name or size) in {self._dir}")
            _require(self.used_bytes <= self._capacity,
                     f"used {self.used_bytes} B exceeds {self._capacity} B")

    def close(self) -> None:
        if self._macs is not None:
            self._macs.shutdown()
            self._macs = None
        if self._lock_fd is not None:
            release_folder(self._lock_fd, self._held)
            self._lock_fd = None

    # ---- files ---------------------------------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        """Where ``key``'s file lives (its segment's file, for values in segments)."""
        return self._value_at(key)[0]

    def _value_at(self, key: bytes) -> tuple[Path, int]:
        """The file holding ``key``'s value and the value's offset in it."""
        if self._segments is None:
            return Path(self._file(key)), 0
        with self._lock:
            segment, slot = self._segments.where[key]
        return Path(self._segments.path(segment)), slot * self.value_bytes

    def _file(self, key: bytes) -> str:
        """:meth:`_path` as a str (what the I/O calls take: a ``Path`` costs more than the call)."""
        name = key.hex()
        return f"{self._prefix}{name[:2]}{os.sep}{name}"

    def _read(self, key: bytes, row: torch.Tensor | None, *, header: bytearray | None = None,
              fds: dict[int, int]) -> str | None:
        """Read ``key``'s file into ``row`` (one ``readv``: header, payload, and one byte that must stay
        empty; a value in a segment: one ``preadv`` of the segment the call opened, kept in ``fds``); why
        it is a miss, or None. Given a ``header`` buffer, the header is read into it and left unchecked,
        with the MAC, for :meth:`_verify`."""
        verify = header is None
        header = bytearray(HEADER_BYTES) if header is None else header
        payload = memoryview(row.numpy()) if row is not None else memoryview(bytearray(0))
        if self._segments is not None:
            why = self._segments.read(key, [header, payload], fds)
            if why is not None or not verify:
                return why
            return verify_parts(header, payload, self._ns, key, self.block_bytes, auth_key=self.auth_key)
        extra = bytearray(1)
        try:
            fd = os.open(self._file(key), os.O_RDONLY)
        except FileNotFoundError:
            return "missing"
        except OSError:
            return "errors"
        try:
            got = os.readv(fd, [header, payload, extra])  # a regular file reads short only at its end
        except OSError:
            return "errors"
        finally:
            os.close(fd)
        if got != HEADER_BYTES + len(payload):  # truncated, or longer than a value
            return "corrupt"
        if not verify:
            return None
        return verify_parts(header, payload, self._ns, key, self.block_bytes, auth_key=self.auth_key)

    def _verify(self, key: bytes, header: bytearray, row: torch.Tensor) -> str | None:
        """Why a block :meth:`_read` left unchecked is a miss, or None (on the MAC thread)."""
        return verify_parts(header, memoryview(row.numpy()), self._ns, key, self.block_bytes,
                            auth_key=self.auth_key)

    def _write(self, key: bytes, row: torch.Tensor | None) -> bool:
        """Write ``key``'s value (one ``writev``); False (counted) when the disk refuses. It goes straight
        to its name: a reader only reads indexed keys, and a key is indexed once its file is whole (a torn
        file a crash leaves behind fails its checksum: a miss). A payload of at least ``overlap_bytes`` is
        written first, behind the header's place, while the MAC thread computes the header; the header
        follows."""
        payload = memoryview(row.numpy()) if row is not None else memoryview(b"")
        path = self._file(key)
        header = None
        if row is not None and 0 < self.overlap_bytes <= self.block_bytes:
            header = self._mac_thread().submit(encode_header, self._ns, key, payload, auth_key=self.auth_key)
        try:
            subdir = key.hex()[:2]
            if subdir not in self._subdirs:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self._subdirs.add(subdir)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                if header is None:
                    _write_all(fd, [encode_header(self._ns, key, payload, auth_key=self.auth_key), payload])
                else:
                    _write_all(fd, [payload], HEADER_BYTES)
                    _write_all(fd, [header.result()], 0)
            finally:
                os.close(fd)
        except OSError:
            if header is not None:
                header.result()  # the MAC thread is done with the row before the caller reuses it
            _unlink(path)
            self._count_failure()
            return False
        with self._lock:
            self._index[key] = next(self._stamps)
            self._stats.stored += 1
            self._stats.stored_bytes += self.block_bytes
        return True

    def _write_segment(self, batch: list[tuple[bytes, torch.Tensor | None]]) -> int:
        """Write the values of ``batch`` into one new segment and index those the disk took; how many
        (the others are counted store failures)."""
        values = []
        for key, row in batch:
            payload = memoryview(row.numpy()) if row is not None else memoryview(b"")
            values.append([encode_header(self._ns, key, payload, auth_key=self.auth_key), payload])
        segment, done = self._segments.write(values)  # type: ignore[union-attr]
        with self._lock:
            self._segments.place(segment, [key for key, _ in batch[:done]])  # type: ignore[union-attr]
            for key, _ in batch[:done]:
                self._index[key] = next(self._stamps)
            self._stats.stored += done
            self._stats.stored_bytes += done * self.block_bytes
            self._stats.store_failures += len(batch) - done
        return done

    def _drop_files(self, dropped: list[tuple[bytes, bool]]) -> None:
        """Remove the values of keys just dropped from the index (under ``_write_lock``): ``(key, erase)``,
        erase False leaves a file that could not be read in place (a value in a segment is only
        forgotten then)."""
        if self._segments is None:
            for key, erase in dropped:
                if erase:
                    _unlink(self._file(key))
            return
        erased: list[tuple[int, int]] = []
        empty: list[int] = []
        with self._lock:
            for key, erase in dropped:
                self._segments.forget_locked(key, erase, erased, empty)
        self._segments.erase(erased, empty)
        self._segments.compact(self._capacity)

    def _make_room(self, n: int, left_out: list[tuple[bytes, torch.Tensor | None]]) -> None:
        """Evict least recently used files until ``n`` more values fit, and pass them down (the cascade)
        with the ``left_out`` blocks of the batch, oldest first. A victim stays readable until then, so a
        reader finds it here or below, never in neither."""
        with self._lock:
            victims, room = [], self._capacity // self.value_bytes - n
            for key in self._index:
                if len(self._index) - len(victims) <= room:
                    break
                victims.append(key)
        if (victims or left_out) and self._cascade is not None:
            self._pass_down(victims, left_out)
        with self._lock:
            victims = [key for key in victims if self._index.pop(key, None) is not None]
            self._stats.evictions += len(victims) + len(left_out)
        self._drop_files([(key, True) for key in victims])

    def _pass_down(self, victims: list[bytes], left_out: list[tuple[bytes, torch.Tensor | None]]) -> None:
        keys, payloads = [], []
        buf = torch.empty(max(self.block_bytes, 1), dtype=torch.uint8)
        fds: dict[int, int] = {}
        try:
            for key in victims:  # corrupt ones are not passed on
                if self._read(key, buf[:self.block_bytes] if self.block_bytes else None, fds=fds) is None:
                    keys.append(key)
                    payloads.append(bytes(buf.numpy()[:self.block_bytes]) if self.block_bytes else b"")
        finally:
            close_all(fds)
        for key, row in left_out:
            keys.append(key)
            payloads.append(row.numpy().tobytes() if row is not None else b"")
        if keys:
            self._cascade(keys, payloads)

    def _miss(self, key: bytes, why: str, stamp: int) -> None:
        """Count a miss; have a bad or vanished file dropped from the index (and the disk): now if the
        folder is free, else by the next change of it (a reader never waits for a store)."""
        with self._lock:
            setattr(self._stats, why, getattr(self._stats, why) + 1)
            self._doomed.append((key, stamp, why != "errors"))
        if self._write_lock.acquire(blocking=False):
            try:
                self._drop_doomed()
            finally:
                self._write_lock.release()

    @contextlib.contextmanager
    def _folder(self) -> Iterator[None]:
        """Hold ``_write_lock`` (a change of the folder), dropping the bad files reads found, before and
        after."""
        with self._write_lock:
            self._drop_doomed()
            yield
            self._drop_doomed()

    def _drop_doomed(self) -> None:
        """Drop each noted bad file whose index entry is still the one its read found (under
        ``_write_lock``)."""
        dropped = []
        with self._lock:
            doomed, self._doomed = self._doomed, []
            for key, stamp, unlink in doomed:
                if self._index.get(key) == stamp:  # (a key noted twice is dropped once)
                    del self._index[key]
                    dropped.append((key, unlink))
        if dropped:
            self._drop_files(dropped)

    def _count_failure(self, n: int = 1) -> None:
        with self._lock:
            self._stats.store_failures += n

    def _scan(self) -> None:
        """Index the files a previous run left (oldest first), delete stray temporary files, then evict
        down to the capacity."""
        if self._segments is not None:
            self._scan_segments()
            return
        found = []
        for path in self._dir.glob("*/*"):
            key = key_of(path)
            try:
                stat = path.stat() if key is not None and path.is_file() else None
            except OSError:
                stat = None
            if stat is not None and stat.st_size == self.value_bytes:
                found.append((stat.st_mtime_ns, key))
            else:  # a temporary file left by a crash, another name or size, a folder: deleted
                remove_quietly(path)
        for _, key in sorted(found):
            self._index[key] = next(self._stamps)
        self._subdirs = {p.name for p in self._dir.iterdir() if p.is_dir()}
        while self.used_bytes > self._capacity:
            key, _ = self._index.popitem(last=False)
            _unlink(self._file(key))


    def _scan_segments(self) -> None:
        """:meth:`_scan` for values in segments: files of a file per value are deleted (another layout)."""
        for path in self._dir.glob("*/*"):
            if path.parent.name != "segments":
                remove_quietly(path)
        for _, key in self._segments.scan(self._ns):  # type: ignore[union-attr]
            self._index[key] = next(self._stamps)
        while self.used_bytes > self._capacity:
            key, _ = self._index.popitem(last=False)
            self._drop_files([(key, True)])
        self._segments.compact(self._capacity)  # type: ignore[union-attr]  (dead slots a smaller capacity left)


_write_all = write_all
_unlink = unlink_quietly
_require = require
