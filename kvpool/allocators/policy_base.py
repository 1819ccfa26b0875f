"""The eviction policy interface every :class:`~kvpool.allocators.block_pool.BlockPool` policy implements
(:class:`EvictionPolicy`; the calls the pool makes and their order: :mod:`kvpool.allocators.policies`), the
keyed heap the heap-ordered policies share, and the default policy, :class:`LRUPolicy` (the pool's fast path
calls it directly, and the queue-informed variants wrap it). A module of its own so that each policy
family's module imports only this one; :mod:`kvpool.allocators.policies` re-exports all three names.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Final

from librt.vecs import append, vec
from mypy_extensions import i32, mypyc_attr, u8

from kvpool.allocators.arrays import extend_to, grown_i32, grown_u8, next_capacity, release_freed_memory
from kvpool.errors import InvalidArgumentError


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, yet subclassed outside (trace.belady)
class EvictionPolicy(ABC):
    """The order of a pool's evictable blocks (see the module docstring for the calls and their order)."""

    name = ""

    def __init__(self) -> None:
        self._n = 0

    def bind(self, num_blocks: int, capacity: int | None = None) -> None:
        """Serve a pool of ``num_blocks``, with per-block state for the ids below ``capacity`` (default: all
        of them; a pool passes what it covers so far and calls :meth:`grow` as that rises); called once.

        Raises:
            InvalidArgumentError: the policy already serves a pool.
        """
        if self._n:
            raise InvalidArgumentError(f"this {self.name} policy already serves a pool: give each pool one")
        self._n = num_blocks
        self._bound(num_blocks)
        self.grow(num_blocks if capacity is None else capacity)

    def _bound(self, num_blocks: int) -> None:
        """Set up state sized by the pool (subclasses; per-block state belongs in :meth:`grow`)."""
        return None  # default: nothing to record

    def grow(self, capacity: int) -> None:
        """Extend per-block state to cover block ids below ``capacity`` (called by the pool, in chunks,
        before it names a block id at or past the previous capacity)."""
        return None  # default: no per-block state

    def published(self, block: int, block_hash: Hashable) -> None:
        """An in-use ``block`` now holds ``block_hash`` in the prefix index."""
        return None  # default: nothing to record

    def hit(self, block: int) -> None:
        """A prefix hit touched cached ``block`` (in use or evictable)."""
        return None  # default: nothing to record

    def missed(self, block_hash: Hashable) -> None:
        """``block_hash`` was looked up, is not cached, and is about to be stored (called before the
        allocation that makes room for it; :meth:`BlockPool.missed`)."""
        return None  # default: nothing to record

    #: Whether the pool tells this policy the hashes waiting requests will look up (:meth:`waiting`).
    reads_waiting = False

    def waiting(self, block_hash: Hashable, count: int) -> None:
        """``count`` more waiting requests (negative: fewer) will look ``block_hash`` up (only called when
        :attr:`reads_waiting`)."""
        return None  # default: nothing to record

    def released(self, blocks: list[int], evictable: list[int], priority: int) -> None:
        """One ``free`` call's ``blocks`` (in its order: tail first for a request's table) and the sub-list
        of them that became ``evictable`` (same order); the default inserts each evictable one."""
        for block in evictable:
            self.insert(block, priority)

    def valued(self, block: int) -> bool:
        """Whether the policy holds ``block`` (cached, or just evicted and not yet reused) worth keeping in a
        tier below: not a one-hit wonder by its own signal (default: every block is)."""
        return True

    def moved(self, src: int, dst: int, block_hash: Hashable, evictable: bool) -> None:
        """Block ``src``'s hash now lives in the free block ``dst`` (a compaction moved its KV:
        :meth:`BlockPool.move_block <kvpool.allocators.block_pool.BlockPool.move_block>`); ``evictable``:
        it is a cached free block. The default forgets ``src`` and takes ``dst`` as newly published (and
        released, when evictable), so the block loses the place and history the policy kept for it;
        :class:`LRUPolicy` keeps its place exactly."""
        self.dropped(src)
        self.published(dst, block_hash)
        if evictable:
            self.insert(dst, 0)

    @abstractmethod
    def insert(self, block: int, priority: int) -> None:
        """``block`` became evictable: its last reference was freed."""

    @abstractmethod
    def remove(self, block: int) -> None:
        """Evictable ``block`` was touched or pinned: it is no longer evictable."""

    @abstractmethod
    def pop(self) -> int:
        """Remove and return the next victim (the pool then drops its hash)."""

    @abstractmethod
    def dropped(self, block: int) -> None:
        """``block``'s hash left the index without an eviction; remove it if evictable and forget it."""

    @abstractmethod
    def order(self) -> list[int]:
        """Evictable blocks, next victim first."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of evictable blocks."""


#: Sequence numbers stay below this, so ``major * SEQ_SPAN + seq`` orders by (major, seq) in one int.
SEQ_SPAN: Final = 1 << 48


#: Bits of a heap entry below its key: the push stamp (:data:`STAMP_BITS`) above the block id (32 bits).
BLOCK_BITS: Final = 32
STAMP_BITS: Final = 40
_BLOCK_MASK: Final = (1 << BLOCK_BITS) - 1
_STAMP_LIMIT: Final = (1 << STAMP_BITS) - 1


class KeyedHeap:
    """A min-heap of blocks by an int key, with O(log n) push and pop and O(1) lazy removal. Each entry is
    one int, ``(key << STAMP_BITS | stamp) << BLOCK_BITS | block`` (``stamp`` counts pushes, so equal keys
    leave in push order), which ``heapq`` compares natively: a tuple per entry cost about 3x as much per
    pop. ``_entry[b]`` is ``b``'s one live entry and ``_in[b]`` says it is live (0: not in the heap); stale
    entries are skipped on pop and swept out when they outnumber the live ones (amortized O(1) per call).
    Stamps are renumbered (in heap order, O(n)) before they would need more than ``STAMP_BITS`` bits. A
    two-part key ``(major, seq)`` is packed as ``major * SEQ_SPAN + seq``. Keys may be negative; block ids
    are below ``2**32``."""

    def __init__(self, num_blocks: int = 0) -> None:
        self._heap: list[int] = []
        self._entry = [0] * num_blocks  # per block, extended by grow()
        self._in: vec[u8] = grown_u8(vec[u8](), num_blocks)
        self._stamp = 0
        self._size = 0

    def grow(self, capacity: int) -> None:
        """Cover block ids below ``capacity``."""
        extend_to(self._entry, capacity, 0)
        self._in = grown_u8(self._in, capacity)

    def push(self, block: int, key: int) -> None:
        if self._in[block]:
            self._size -= 1
        if self._stamp >= _STAMP_LIMIT:
            self._renumber()
        self._stamp += 1
        entry = ((key << STAMP_BITS) + self._stamp << BLOCK_BITS) + block
        self._entry[block] = entry
        self._in[block] = 1
        self._size += 1
        heapq.heappush(self._heap, entry)

    def discard(self, block: int) -> bool:
        """Remove ``block`` if present; returns whether it was."""
        if not self._in[block]:
            return False
        self._in[block] = 0
        self._size -= 1
        if len(self._heap) > 2 * self._size + 64:
            self._sweep()
        return True

    def _sweep(self) -> None:
        """Keep only the live entries (O(n))."""
        entry, live = self._entry, self._in
        self._heap = [e for e in self._heap if live[e & _BLOCK_MASK] and entry[e & _BLOCK_MASK] == e]
        heapq.heapify(self._heap)

    def _renumber(self) -> None:
        """Give the live entries stamps 1, 2, ... in their order (keys and blocks kept)."""
        self._sweep()
        self._heap.sort()
        out, entry, shift = [], self._entry, STAMP_BITS + BLOCK_BITS
        for stamp, e in enumerate(self._heap, 1):
            block = e & _BLOCK_MASK
            renewed = (((e >> shift) << STAMP_BITS) + stamp << BLOCK_BITS) + block
            entry[block] = renewed
            out.append(renewed)
        self._heap = out  # sorted: a heap
        self._stamp = len(out)

    def pop(self) -> int:
        heap, entry, live = self._heap, self._entry, self._in
        while True:
            e = heapq.heappop(heap)
            block = e & _BLOCK_MASK
            if live[block] and entry[block] == e:
                live[block] = 0
                self._size -= 1
                return block

    def key(self, block: int) -> int | None:
        """The live key of ``block``, or None."""
        return self._entry[block] >> (STAMP_BITS + BLOCK_BITS) if self._in[block] else None

    def order(self) -> list[int]:
        entry, live = self._entry, self._in
        return [e & _BLOCK_MASK for e in sorted(self._heap) if live[e & _BLOCK_MASK] and
                entry[e & _BLOCK_MASK] == e]

    def __contains__(self, block: int) -> bool:
        return self._in[block] != 0

    def __len__(self) -> int:
        return self._size



class LRUPolicy(EvictionPolicy):
    """Least recently used: evict the block freed longest ago; a hit revives it in place. O(1) per call
    (amortized).

    The order of vLLM's ``FreeKVCacheBlockQueue`` and nano-vllm's free deque (which double as LRUs), kept
    as a **log**: each :meth:`insert_chunk` (one ``free`` call's blocks, in order) appends its blocks to
    ``_log[_head:_end]``, and ``where[b]`` is the position + 1 of ``b``'s live entry (0: not evictable). A
    revived block only loses its ``where``: its entry stays behind, stale, and :meth:`pop` skips it (an
    entry is live exactly when ``where`` of its block points at it). The log is compacted in place (the
    entries moved to its front, each live one's ``where`` renumbered) once the spent head is half of it,
    once stale entries pass half the live ones, and before it would grow, so memory stays O(evictable
    blocks) and every call O(1) amortized; it grows by a chunk or an eighth
    (:func:`~kvpool.allocators.arrays.next_capacity`). Both are flat vectors of 32-bit ints (4 bytes a
    block, 4 an entry; :mod:`kvpool.allocators.arrays`), with no Python object per entry. The pool calls
    :meth:`insert_chunk` and :meth:`pop` directly on its fast path (head = next victim), and revives a
    touched block itself: ``where[b] = 0`` for each, then :meth:`removed` with their count.
    """

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.where: vec[i32] = vec[i32]()  # block -> position + 1 of its live entry in _log, or 0
        self._log: vec[i32] = vec[i32]()  # entries _log[_head:_end], oldest first; the rest is room
        self._head = 0  # the entry the next victim is looked for at
        self._end = 0  # one past the newest entry
        self._live = 0  # evictable blocks (live entries)
        self._stale = 0  # entries of revived blocks not yet skipped or compacted away

    def grow(self, capacity: int) -> None:
        if capacity > len(self.where):
            self.where = grown_i32(self.where, capacity, 0)

    def insert(self, block: int, priority: int) -> None:
        self.insert_chunk([block])

    def insert_chunk(self, blocks: list[int]) -> None:
        """Append ``blocks`` (distinct ids, none evictable), oldest first."""
        if self._end + len(blocks) > len(self._log):
            self._make_room(len(blocks))
        where, log, end = self.where, self._log, self._end
        for b in blocks:
            log[end] = b
            end += 1
            where[b] = end
        self._end = end
        self._live += len(blocks)

    def _make_room(self, room: int) -> None:
        """Compact the log when its spent and stale entries are an eighth of it or more; grow it unless that
        left ``room`` free entries and an eighth of it besides (so the next call is that many entries
        away: O(1) amortized per entry)."""
        size = len(self._log)
        if 8 * (self._head + self._stale) >= size:
            self._compact(self._stale > 0)
        if self._end + room + (size >> 3) > size:
            self._log = grown_i32(self._log, next_capacity(size, self._end + room, 1 << 62), 0)
            release_freed_memory(4 * len(self._log))  # the old log's pages

    def remove(self, block: int) -> None:
        self.where[block] = 0
        self.removed(1)

    def removed(self, count: int) -> None:
        """``count`` evictable blocks left the queue: the caller set their ``where`` to 0."""
        self._live -= count
        self._stale += count
        if self._stale > 4096 and 2 * self._stale > self._live:
            self._compact(True)

    def pop(self) -> int:
        log, where = self._log, self.where
        head = self._head
        while True:
            b = int(log[head])
            head += 1
            if where[b] == head:
                break
            self._stale -= 1
        where[b] = 0
        self._live -= 1
        self._head = head
        if head >= 4096 and 2 * head >= self._end:  # move the entries past the spent head (amortized O(1))
            self._compact(False)
        return b

    def dropped(self, block: int) -> None:
        if self.where[block]:
            self.remove(block)

    def moved(self, src: int, dst: int, block_hash: Hashable, evictable: bool) -> None:
        """Exact: an evictable ``dst`` takes ``src``'s entry in the log, so its place in the order."""
        where = self.where
        w = where[src]
        if w:
            self._log[int(w) - 1] = dst
            where[dst] = w
            where[src] = 0

    def clear(self) -> None:
        """Make no block evictable (the pool's ``reset_prefix_cache``)."""
        where = self.where
        for b in self.order():
            where[b] = 0
        self._head = self._end = self._live = self._stale = 0

    def _compact(self, live_only: bool) -> None:
        """Move the entries from the head on (only the live ones when ``live_only``) to the front of the log,
        in place, each live entry's ``where`` renumbered to its new position (ascending: a renumbered entry
        is never taken for a later one, whose stale entries all come before it)."""
        log, where, out = self._log, self.where, 0
        for i in range(self._head, self._end):
            b = int(log[i])
            live = where[b] == i + 1
            if live or not live_only:
                log[out] = b
                out += 1
                if live:
                    where[b] = out
        self._head, self._end = 0, out
        if live_only:
            self._stale = 0

    def order(self) -> list[int]:
        return [int(b) for b in self.live()]

    def live(self) -> vec[i32]:
        """:meth:`order` as a vector (4 bytes a block, no Python int per block: for integrity checks)."""
        log, where = self._log, self.where
        out = vec[i32](capacity=self._live)
        for i in range(self._head, self._end):
            if where[int(log[i])] == i + 1:
                out = append(out, log[i])
        return out

    def __len__(self) -> int:
        return self._live
