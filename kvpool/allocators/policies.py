"""Eviction policies: the order in which a :class:`~kvpool.allocators.block_pool.BlockPool` evicts its
cached free blocks, behind one small interface the pool calls.

Contract. A policy holds exactly the pool's **evictable** blocks (ref count 0, a published hash, not
pinned) and decides which one ``allocate`` evicts next. Block ids are ints in ``[0, num_blocks)``. The
pool validates every argument before it calls the policy, so a policy never sees a bad id and never
raises; it calls:

* ``bind(num_blocks)`` once, when the pool is built (a policy serves one pool);
* ``published(block, block_hash)``: an in-use block now holds ``block_hash`` in the prefix index;
* ``hit(block)``: a prefix hit touched a cached block (in use or evictable; before ``remove``);
* ``missed(block_hash)``: a hash looked up and not cached is about to be stored, before the allocation
  that makes room for it (only when the pool's caller reports it: :meth:`BlockPool.missed`; ARC adapts);
* ``insert(block, priority)``: the block's last reference was freed; ``priority`` is the freeing request's
  retention priority (only ``priority`` reads it);
* ``remove(block)``: an evictable block was revived by ``touch`` (a hit) or pinned: no longer evictable;
* ``pop()``: evict: remove and return the next victim (only called while ``len(policy) > 0``); the pool
  then drops its hash;
* ``dropped(block)``: the block's hash left the index without an eviction (``evict_blocks``,
  ``reset_prefix_cache``); the policy removes it if it is evictable and forgets the block.

``order()`` lists the evictable blocks, next victim first (O(n log n), for tests and inspection).
Every other call is O(1) or O(log n) in the number of blocks, as each class says. Ties in a policy's key
are broken by recency: the block freed least recently goes first, as in LRU.

``lru`` is the pool's default and stays on its fast path (the pool calls :class:`LRUPolicy`'s chunk queue
directly); the other policies are called through this interface. ``belady`` (the offline
farthest-next-use bound) needs the future of a trace and lives in :mod:`kvpool.trace.belady`.

:class:`FrequencyAdmission` is the publish-side filter: a hash is admitted to the prefix index only once
it has been offered ``min_count`` times (Dynamo's frequency-based admission; TinyLFU's bounded counts).
"""

from __future__ import annotations

import heapq
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable

from mypy_extensions import mypyc_attr

from kvpool.errors import InvalidArgumentError
from kvpool.numeric import IntArg, RealArg, as_int, as_optional_int, as_real

#: Policy names a pool accepts (``belady`` needs a trace: :mod:`kvpool.trace.belady`).
POLICIES = ("lru", "fifo", "lfu", "slru", "priority", "arc", "arc-vllm")


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, yet subclassed outside (trace.belady)
class EvictionPolicy(ABC):
    """The order of a pool's evictable blocks (see the module docstring for the calls and their order)."""

    name = ""

    def __init__(self) -> None:
        self._n = 0

    def bind(self, num_blocks: int) -> None:
        """Size the per-block state for a pool of ``num_blocks``; called once by the pool.

        Raises:
            InvalidArgumentError: the policy already serves a pool.
        """
        if self._n:
            raise InvalidArgumentError(f"this {self.name} policy already serves a pool: give each pool one")
        self._n = num_blocks
        self._bound(num_blocks)

    def _bound(self, num_blocks: int) -> None:
        """Allocate per-block state (subclasses)."""
        return None  # default: nothing to record

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


# ---- LRU and FIFO ---------------------------------------------------------------------------------------


class LRUPolicy(EvictionPolicy):
    """Least recently used: evict the block freed longest ago; a hit revives it in place. O(1) per call
    (amortized).

    The order of vLLM's ``FreeKVCacheBlockQueue`` and nano-vllm's free deque (which double as LRUs), kept
    as a **log**: each :meth:`insert_chunk` (one ``free`` call's blocks, in order) appends its blocks to
    ``_log`` and, beside each, the call's **mark** (an int object of its own, compared by identity) to
    ``_marks``; ``where[b]`` is the mark of ``b``'s live entry (None: not evictable). A revived block
    only loses its ``where``: its entry stays behind, stale, and :meth:`pop` skips it (an entry is live
    exactly when its mark is ``where`` of its block; a block is at most once in one call). Stale entries
    are swept out when they outnumber the live ones, so memory stays O(evictable blocks) and every call
    O(1) amortized. This costs three list stores per block where an ``OrderedDict`` costs a hash-table
    insert and a node, and it allocates no object the garbage collector tracks (a tuple or list per call
    would set off collections, each walking the pool's per-block lists while they are young). The pool
    calls :meth:`insert_chunk` and :meth:`pop` directly on its fast path (head = next victim), and revives
    a touched block itself: ``where[b] = None`` for each, then :meth:`removed` with their count.
    """

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.where: list[object] = []  # block -> the mark of its live entry, or None
        self._log: list[int] = []  # blocks, oldest entry first; _log[:_head] are spent
        self._marks: list[object] = []  # the mark of each entry of _log
        self._head = 0  # the entry the next victim is looked for at
        self._calls = 0  # insert_chunk calls so far: each one's mark is its number, a fresh int object
        self._live = 0  # evictable blocks (live entries)
        self._stale = 0  # entries of revived blocks not yet skipped or swept

    def _bound(self, num_blocks: int) -> None:
        self.where = [None] * num_blocks

    def insert(self, block: int, priority: int) -> None:
        self.insert_chunk([block])

    def insert_chunk(self, blocks: list[int]) -> None:
        """Append ``blocks`` (distinct ids, none evictable), oldest first."""
        self._calls += 1
        mark: object = self._calls  # one object for the whole call (boxed once when compiled)
        where, log, marks = self.where, self._log, self._marks
        for b in blocks:
            where[b] = mark
            log.append(b)
            marks.append(mark)
        self._live += len(blocks)

    def remove(self, block: int) -> None:
        self.where[block] = None
        self.removed(1)

    def removed(self, count: int) -> None:
        """``count`` evictable blocks left the queue: the caller set their ``where`` to None."""
        self._live -= count
        self._stale += count
        if self._stale > 4096 and self._stale > self._live:
            self._sweep()

    def pop(self) -> int:
        log, marks, where = self._log, self._marks, self.where
        head = self._head
        while True:
            b = log[head]
            mark = marks[head]
            head += 1
            if where[b] is mark:
                break
            self._stale -= 1
        where[b] = None
        self._live -= 1
        if head >= 4096 and 2 * head >= len(log):  # drop the spent entries (amortized O(1))
            del log[:head]
            del marks[:head]
            head = 0
        self._head = head
        return b

    def dropped(self, block: int) -> None:
        if self.where[block] is not None:
            self.remove(block)

    def clear(self) -> None:
        """Make no block evictable (the pool's ``reset_prefix_cache``)."""
        for b in self.order():
            self.where[b] = None
        self._log, self._marks, self._head, self._live, self._stale = [], [], 0, 0, 0

    def _sweep(self) -> None:
        """Keep only the live entries, in order (each keeps its mark)."""
        where = self.where
        self._log = self.order()
        self._marks = [where[b] for b in self._log]  # a live entry's mark is its block's where
        self._head = self._stale = 0

    def order(self) -> list[int]:
        log, marks, where = self._log, self._marks, self.where
        return [log[i] for i in range(self._head, len(log)) if where[log[i]] is marks[i]]

    def __len__(self) -> int:
        return self._live


#: Sequence numbers stay below this, so ``major * SEQ_SPAN + seq`` orders by (major, seq) in one int.
SEQ_SPAN = 1 << 48


class KeyedHeap:
    """A min-heap of blocks by an int key, with O(log n) push and pop and O(1) lazy removal: ``_live[b]``
    is the stamp of ``b``'s one live entry (0: not in the heap). Stale entries are skipped on pop and swept
    out when they outnumber the live ones (amortized O(1) per call). A two-part key ``(major, seq)`` is
    packed as ``major * SEQ_SPAN + seq`` (ints compare fastest)."""

    def __init__(self, num_blocks: int) -> None:
        self._heap: list[tuple[int, int, int]] = []
        self._live = [0] * num_blocks
        self._stamp = 0
        self._size = 0

    def push(self, block: int, key: int) -> None:
        if self._live[block]:
            self._size -= 1
        self._stamp += 1
        self._live[block] = self._stamp
        self._size += 1
        heapq.heappush(self._heap, (key, self._stamp, block))

    def discard(self, block: int) -> bool:
        """Remove ``block`` if present; returns whether it was."""
        if not self._live[block]:
            return False
        self._live[block] = 0
        self._size -= 1
        if len(self._heap) > 2 * self._size + 64:
            self._heap = [e for e in self._heap if self._live[e[2]] == e[1]]
            heapq.heapify(self._heap)
        return True

    def pop(self) -> int:
        heap, live = self._heap, self._live
        while True:
            _, stamp, block = heapq.heappop(heap)
            if live[block] == stamp:
                live[block] = 0
                self._size -= 1
                return block

    def key(self, block: int) -> int | None:
        """The live key of ``block`` (O(n): for inspection), or None."""
        stamp = self._live[block]
        return next((k for k, s, b in self._heap if b == block and s == stamp), None) if stamp else None

    def order(self) -> list[int]:
        live = self._live
        return [b for _, s, b in sorted(e for e in self._heap if live[e[2]] == e[1])]

    def __contains__(self, block: int) -> bool:
        return self._live[block] != 0

    def __len__(self) -> int:
        return self._size


class _HeapPolicy(EvictionPolicy):
    """A policy whose order is a key computed when a block becomes evictable, kept in a :class:`KeyedHeap`.
    ``_freed`` counts frees, the recency tie-break of every key (smaller = freed earlier = evicted first)."""

    def __init__(self) -> None:
        super().__init__()
        self._heap = KeyedHeap(0)
        self._freed = 0

    def _bound(self, num_blocks: int) -> None:
        self._heap = KeyedHeap(num_blocks)

    def remove(self, block: int) -> None:
        self._heap.discard(block)

    def pop(self) -> int:
        return self._heap.pop()

    def dropped(self, block: int) -> None:
        self._heap.discard(block)

    def order(self) -> list[int]:
        return self._heap.order()

    def __len__(self) -> int:
        return len(self._heap)



class FIFOPolicy(_HeapPolicy):
    """First in, first out: evict the block whose hash was published longest ago, however recently it was
    hit (SGLang's ``fifo``: node creation time; LMCache's FIFO). O(log n) per call (a heap keyed by the
    publish sequence number)."""

    name = "fifo"

    def _bound(self, num_blocks: int) -> None:
        super()._bound(num_blocks)
        self._born = [0] * num_blocks
        self._published = 0

    def published(self, block: int, block_hash: Hashable) -> None:
        self._published += 1
        self._born[block] = self._published

    def insert(self, block: int, priority: int) -> None:
        self._heap.push(block, self._born[block])


class LFUPolicy(_HeapPolicy):
    """Least frequently used: evict the block with the fewest prefix hits since its hash was published,
    ties by recency (least recently freed first): SGLang's ``lfu`` key ``(hit_count, last_access_time)``.
    O(log n) per call (a heap keyed by ``(hits, free sequence)``)."""

    name = "lfu"

    def _bound(self, num_blocks: int) -> None:
        super()._bound(num_blocks)
        self.hits = [0] * num_blocks

    def published(self, block: int, block_hash: Hashable) -> None:
        self.hits[block] = 0

    def hit(self, block: int) -> None:
        self.hits[block] += 1

    def insert(self, block: int, priority: int) -> None:
        self._freed += 1
        self._heap.push(block, self.hits[block] * SEQ_SPAN + self._freed)


class PriorityPolicy(_HeapPolicy):
    """Retention priority, then recency: evict the lowest priority first, the least recently freed first
    within a priority. A block keeps the priority of the request that freed it last for ``retention_s``
    seconds after that free; then its priority decays to 0 (the default). Higher priority = kept longer;
    negative priorities are evicted before the default. SGLang's ``priority`` strategy (key
    ``(priority, last_access_time)``) plus the time decay vLLM users asked for (vllm#23083).

    ``clock()`` gives seconds (default ``time.monotonic``; the replay passes its simulated clock). O(log n)
    per call, amortized: expired blocks are re-keyed once each, in free order, before an eviction.

    Raises:
        InvalidArgumentError: ``retention_s`` not a finite number > 0.
    """

    name = "priority"

    def __init__(self, retention_s: RealArg = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.retention_s = as_real(retention_s, "retention_s", minimum=0.0, open_min=True, finite=True)
        self.clock = clock
        self._expiring: OrderedDict[int, tuple[float, int]] = OrderedDict()  # block -> (freed at, seq)

    def insert(self, block: int, priority: int) -> None:
        self._freed += 1
        self._heap.push(block, priority * SEQ_SPAN + self._freed)
        if priority:
            self._expiring[block] = (self.clock(), self._freed)

    def remove(self, block: int) -> None:
        self._heap.discard(block)
        if self._expiring:
            self._expiring.pop(block, None)

    def dropped(self, block: int) -> None:
        self.remove(block)

    def pop(self) -> int:
        if not self._expiring:
            return self._heap.pop()
        self._expire()
        block = self._heap.pop()
        self._expiring.pop(block, None)
        return block

    def order(self) -> list[int]:
        self._expire()
        return super().order()

    def _expire(self) -> None:
        """Decay to priority 0 every block idle for ``retention_s`` (the queue is in free order)."""
        deadline = self.clock() - self.retention_s
        expiring = self._expiring
        while expiring:
            block, (freed_at, seq) = next(iter(expiring.items()))
            if freed_at > deadline:
                break
            del expiring[block]
            self._heap.push(block, seq)


# ---- segmented and adaptive ----------------------------------------------------------------------------


class SLRUPolicy(EvictionPolicy):
    """Segmented LRU (Karedla, Love and Wherry, "Caching strategies to improve disk system performance",
    IEEE Computer 27(3), 1994): a published block starts in the **probation** segment; a prefix hit
    promotes it to **protected**. Eviction takes the probation segment's LRU head first, the protected
    segment's only when probation has no evictable block. The protected segment holds at most
    ``protected_fraction * num_blocks`` evictable blocks: past that its LRU head is demoted to the
    probation tail (and must be hit again to return). Segments hold evictable blocks only: an in-use block
    cannot be evicted, so it counts against neither. O(1) per call.

    Raises:
        InvalidArgumentError: ``protected_fraction`` not in (0, 1].
    """

    name = "slru"

    def __init__(self, protected_fraction: RealArg = 0.8) -> None:
        super().__init__()
        self.protected_fraction = as_real(protected_fraction, "protected_fraction", minimum=0.0, maximum=1.0,
                                          open_min=True)
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()
        self._cap = 1
        self._promoted = bytearray()

    def _bound(self, num_blocks: int) -> None:
        self._cap = max(1, int(self.protected_fraction * num_blocks))
        self._promoted = bytearray(num_blocks)

    def published(self, block: int, block_hash: Hashable) -> None:
        self._promoted[block] = 0

    def hit(self, block: int) -> None:
        self._promoted[block] = 1

    def insert(self, block: int, priority: int) -> None:
        if not self._promoted[block]:
            self.probation[block] = None
            return
        self.protected[block] = None
        if len(self.protected) > self._cap:
            demoted = self.protected.popitem(False)[0]
            self._promoted[demoted] = 0
            self.probation[demoted] = None

    def remove(self, block: int) -> None:
        if block in self.probation:
            del self.probation[block]
        else:
            del self.protected[block]

    def pop(self) -> int:
        return (self.probation if self.probation else self.protected).popitem(False)[0]

    def dropped(self, block: int) -> None:
        self.probation.pop(block, None)
        self.protected.pop(block, None)
        self._promoted[block] = 0

    def order(self) -> list[int]:
        return [*self.probation, *self.protected]

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)


#: ARC's variants: Megiddo and Modha's algorithm, and vLLM 0.33's ``arc`` (``ARCPolicy.__doc__``).
ARC_VARIANTS = ("paper", "vllm")


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache",
    FAST 2003). Cached blocks are in T1 (published, not hit since) or T2 (hit at least once); evicted hashes
    are remembered in the ghost lists B1 (from T1) and B2 (from T2). A miss on a hash found in B1 grows the
    target size ``p`` of T1 by ``max(|B2| / |B1|, 1)`` (at most ``c = num_blocks``), one found in B2 shrinks
    it by ``max(|B1| / |B2|, 1)`` (at least 0).

    ``variant="paper"`` (policy ``arc``, the default) is the paper's: a ghost hit enters T2; eviction takes
    the LRU evictable block of T1 while ``|T1| > p`` (or ``|T1| == p`` when the miss was found in B2, the
    paper's tie rule), else of T2 (T1 when T2 has none); ``|T1| + |B1| <= c`` and
    ``|T1| + |T2| + |B1| + |B2| <= 2c``. ``variant="vllm"`` (policy ``arc-vllm``) is vLLM 0.33's ``arc``
    (``vllm/v1/kv_offload/cpu/policies/arc.py``), which departs from the paper in four rules: a ghost hit
    enters T1 (it is promoted only by a later hit); eviction takes T1 while ``|T1| >= int(p)``; a hit on a
    T2 block moves it to T2's MRU end; B1 and B2 are bounded by ``c`` each (trimmed after an eviction only),
    and a ghost that misses again moves to its list's MRU end.

    The target adapts when the pool's caller reports the miss (:meth:`missed`, before the allocation that
    makes room for it, as the paper and vLLM's ``on_store_miss`` do); a hash published from a ghost list
    without that report adapts it at :meth:`published`, after the eviction (kvpool's pool evicts before it
    knows the hash). Adapted to a pool where in-use blocks cannot be evicted: |T1| and |T2| count every
    cached block, but only evictable ones are victims, each list's evictable part in free order (kvpool's
    recency: a free is a use). O(1) per call.

    Raises:
        InvalidArgumentError: ``variant`` not one of :data:`ARC_VARIANTS`.
    """

    name = "arc"

    def __init__(self, variant: str = "paper") -> None:
        super().__init__()
        if variant not in ARC_VARIANTS:
            raise InvalidArgumentError(f"ARC variant must be one of {', '.join(ARC_VARIANTS)}, "
                                       f"got {variant!r}")
        self.variant = variant
        self.vllm = variant == "vllm"
        if self.vllm:
            self.name = "arc-vllm"
        self.p = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()  # evictable part of T1, LRU head first
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()  # ghost hashes, oldest first
        self.b2: OrderedDict[Hashable, None] = OrderedDict()
        self.size_t1 = self.size_t2 = 0
        self._in_t2 = bytearray()
        self._hash: list[Hashable | None] = []
        self._returning: OrderedDict[Hashable, None] = OrderedDict()  # ghosts missed, not yet published
        self._tie = False  # the last miss was found in B2 (the paper's tie rule for the next eviction)

    def _bound(self, num_blocks: int) -> None:
        self._in_t2 = bytearray(num_blocks)
        self._hash = [None] * num_blocks

    def missed(self, block_hash: Hashable) -> None:
        in_b1, in_b2 = block_hash in self.b1, block_hash in self.b2
        self._tie = in_b2
        if not (in_b1 or in_b2):
            self._returning.pop(block_hash, None)
            return
        self._adapt(in_b1)
        if self.vllm:
            (self.b1 if in_b1 else self.b2).move_to_end(block_hash)
        returning = self._returning
        returning[block_hash] = None
        returning.move_to_end(block_hash)
        if len(returning) > self._n:
            returning.popitem(False)

    def _adapt(self, from_b1: bool) -> None:
        n1, n2 = len(self.b1), len(self.b2)
        if from_b1:
            self.p = min(float(self._n), self.p + max(n2 / n1, 1.0))
        else:
            self.p = max(0.0, self.p - max(n1 / n2, 1.0))

    def published(self, block: int, block_hash: Hashable) -> None:
        b1, b2 = self.b1, self.b2
        ghost = block_hash in self._returning
        if ghost:
            del self._returning[block_hash]
        elif block_hash in b1 or block_hash in b2:
            ghost = True
            self._adapt(block_hash in b1)
        self._tie = False
        if self.vllm:  # vLLM's insert leaves neither list holding the key
            b1.pop(block_hash, None)
            b2.pop(block_hash, None)
        elif block_hash in b1:  # (a hash two holders left can be in both: it leaves the one it hit)
            del b1[block_hash]
        elif block_hash in b2:
            del b2[block_hash]
        to_t2 = ghost and not self.vllm
        self._in_t2[block] = 1 if to_t2 else 0
        if to_t2:
            self.size_t2 += 1
        else:
            self.size_t1 += 1
        self._hash[block] = block_hash
        if not self.vllm:
            self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self._n
        if self.vllm:
            while len(self.b1) > c:
                self.b1.popitem(False)
            while len(self.b2) > c:
                self.b2.popitem(False)
            return
        while self.b1 and self.size_t1 + len(self.b1) > c:
            self.b1.popitem(False)
        while self.b2 and self.size_t1 + self.size_t2 + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(False)

    def hit(self, block: int) -> None:
        if self._in_t2[block]:
            if self.vllm and block in self.t2:
                self.t2.move_to_end(block)
            return
        self._in_t2[block] = 1
        self.size_t1 -= 1
        self.size_t2 += 1
        if block in self.t1:  # evictable: the pool's ``remove`` follows and looks for it in T2
            del self.t1[block]
            self.t2[block] = None

    def insert(self, block: int, priority: int) -> None:
        (self.t2 if self._in_t2[block] else self.t1)[block] = None

    def remove(self, block: int) -> None:
        (self.t2 if self._in_t2[block] else self.t1).pop(block)

    def _from_t1(self, size_t1: int) -> bool:
        """Whether the next victim comes from T1 when T1 has ``size_t1`` cached blocks."""
        if self.vllm:
            return size_t1 >= int(self.p)
        return size_t1 > self.p or (self._tie and size_t1 == self.p)

    def pop(self) -> int:
        from_t1 = bool(self.t1) and (self._from_t1(self.size_t1) or not self.t2)
        block = (self.t1 if from_t1 else self.t2).popitem(False)[0]
        (self.b1 if from_t1 else self.b2)[self._hash[block]] = None
        self._forget(block)
        self._trim_ghosts()
        return block

    def dropped(self, block: int) -> None:
        if self._hash[block] is None:
            return
        (self.t2 if self._in_t2[block] else self.t1).pop(block, None)
        self._forget(block)

    def _forget(self, block: int) -> None:
        if self._in_t2[block]:
            self.size_t2 -= 1
        else:
            self.size_t1 -= 1
        self._in_t2[block] = 0
        self._hash[block] = None

    def order(self) -> list[int]:
        """The next victim is exact; later ones assume no publish, hit or miss in between (``p`` stays)."""
        t1, t2 = list(self.t1), list(self.t2)
        out, size_t1 = [], self.size_t1
        while t1 or t2:
            if t1 and (self._from_t1(size_t1) or not t2):
                out.append(t1.pop(0))
                size_t1 -= 1
            else:
                out.append(t2.pop(0))
        return out

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


def make_policy(name: object, *, retention_s: RealArg = 60.0, clock: Callable[[], float] = time.monotonic,
                protected_fraction: RealArg = 0.8) -> EvictionPolicy:
    """A fresh policy by name (:data:`POLICIES`); the options apply to ``priority`` and ``slru`` only.

    Raises:
        InvalidArgumentError: an unknown name, ``belady`` (it needs a trace's future: replay a trace with
            ``policy="belady"``), or a bad option.
    """
    if name == "lru":
        return LRUPolicy()
    if name == "fifo":
        return FIFOPolicy()
    if name == "lfu":
        return LFUPolicy()
    if name == "slru":
        return SLRUPolicy(protected_fraction)
    if name == "priority":
        return PriorityPolicy(retention_s, clock)
    if name == "arc":
        return ARCPolicy()
    if name == "arc-vllm":
        return ARCPolicy("vllm")
    if name == "belady":
        raise InvalidArgumentError("policy 'belady' evicts by the future of a trace, which only the replay "
                                   "knows: use it through kvpool.trace (run_replay, kvpool replay --policy "
                                   "belady)")
    raise InvalidArgumentError(f"unknown eviction policy {name!r}: choose one of {', '.join(POLICIES)}")


# ---- admission ------------------------------------------------------------------------------------------


class FrequencyAdmission:
    """Admit a hash only once it has been offered ``min_count`` times (frequency-based admission, as
    NVIDIA Dynamo's KV block manager applies it before offloading; ``min_count=1`` admits everything).

    Counts are kept for at most ``max_tracked`` hashes (default: 4 x the blocks of what binds it: a pool's,
    or an offload manager's device pool and bounded tiers together; else 65,536); when that many are
    tracked, every count is halved and the zeros dropped (TinyLFU's reset, Einziger, Friedman and Manes, ACM
    TOS 2017), so memory stays bounded and old popularity fades. With ``min_count=2`` every tracked count is
    1, so a reset forgets them all: a hash is admitted only when offered again within ``max_tracked`` other
    hashes. A hash that is admitted stops being counted. O(1) amortized per offer.

    Raises:
        InvalidArgumentError: ``min_count`` or ``max_tracked`` not an integer >= 1.
    """

    def __init__(self, min_count: IntArg = 2, max_tracked: IntArg | None = None) -> None:
        self.min_count = as_int(min_count, "min_count", minimum=1)
        self.max_tracked = as_optional_int(max_tracked, "max_tracked", minimum=1)
        self.counts: dict[Hashable, int] = {}

    def bind(self, num_blocks: int) -> None:
        """Default ``max_tracked`` to 4 x ``num_blocks`` (called by the pool or the offload manager it
        filters for)."""
        if self.max_tracked is None:
            self.max_tracked = 4 * num_blocks

    def admit(self, block_hash: Hashable) -> bool:
        """Count one offer of ``block_hash``; True when it has now been offered ``min_count`` times."""
        counts = self.counts
        seen = counts.get(block_hash, 0) + 1
        if seen >= self.min_count:
            counts.pop(block_hash, None)
            return True
        if block_hash not in counts and len(counts) >= (self.max_tracked or 65536):
            self._halve()
        self.counts[block_hash] = seen
        return False

    def _halve(self) -> None:
        self.counts = {h: c // 2 for h, c in self.counts.items() if c > 1}
