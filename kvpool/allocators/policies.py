"""Eviction policies: the order in which a :class:`~kvpool.allocators.block_pool.BlockPool` evicts its
cached free blocks, behind one small interface the pool calls.

Contract. A policy holds exactly the pool's **evictable** blocks (ref count 0, a published hash, not
pinned) and decides which one ``allocate`` evicts next. Block ids are ints in ``[0, num_blocks)``. The
pool validates every argument before it calls the policy, so a policy never sees a bad id and never
raises; it calls:

* ``bind(num_blocks, capacity)`` once, when the pool is built (a policy serves one pool);
* ``grow(capacity)``: block ids below ``capacity`` may be named from now on. The pool's per-block state
  covers the ids it has handed out, not the whole pool, and grows in chunks as that high-water mark rises
  (:mod:`kvpool.allocators.arrays`); a policy with per-block state extends it here, so that it too costs
  what the pool holds;
* ``published(block, block_hash)``: an in-use block now holds ``block_hash`` in the prefix index;
* ``hit(block)``: a prefix hit touched a cached block (in use or evictable; before ``remove``);
* ``missed(block_hash)``: a hash looked up and not cached is about to be stored, before the allocation
  that makes room for it (only when the pool's caller reports it: :meth:`BlockPool.missed`; ARC adapts);
* ``released(blocks, evictable, priority)``: one ``free`` call's blocks, in the call's order (a request
  frees its block table tail first), and those of them now evictable, in the same order; the default
  calls ``insert(block, priority)`` for each evictable one: the block's last reference was freed;
  ``priority`` is the freeing request's retention priority (only ``priority`` reads it). A policy that
  reads a request's sequence (``tlru``, ``lineage``) takes the whole call here;
* ``waiting(block_hash, count)``: ``count`` more (negative: fewer) waiting requests will look
  ``block_hash`` up (only when the policy's ``reads_waiting`` is True: the queue-informed variants);
* ``remove(block)``: an evictable block was revived by ``touch`` (a hit) or pinned: no longer evictable;
* ``pop()``: evict: remove and return the next victim (only called while ``len(policy) > 0``); the pool
  then drops its hash;
* ``dropped(block)``: the block's hash left the index without an eviction (``evict_blocks``,
  ``reset_prefix_cache``); the policy removes it if it is evictable and forgets the block;
* ``moved(src, dst, block_hash, evictable)``: a compaction moved block ``src``'s KV and hash into the free
  block ``dst`` (:meth:`BlockPool.move_block <kvpool.allocators.block_pool.BlockPool.move_block>`); the
  default forgets ``src`` and takes ``dst`` as newly published (and released when ``evictable``), LRU
  keeps its place.

``order()`` lists the evictable blocks, next victim first (O(n log n), for tests and inspection).
Every other call is O(1) or O(log n) in the number of blocks, as each class says. Ties in a policy's key
are broken by recency: the block freed least recently goes first, as in LRU.

``lru`` is the pool's default and stays on its fast path (the pool calls :class:`LRUPolicy`'s chunk queue
directly); the other policies are called through this interface. The families, a module each:
this one (``fifo``, ``lfu``, ``priority``, ``slru``; ``lru`` is in :mod:`kvpool.allocators.policy_base`,
beside the interface, so that every family can build on it), :mod:`kvpool.allocators.arc` (``arc``,
``arc-vllm``), :mod:`kvpool.allocators.queue_policies` (``s3fifo``, ``sieve``: scan-resistant queues,
exactly as libCacheSim), :mod:`kvpool.allocators.prefix_policies` (``tlru``, ``lineage``, and the
queue-informed ``queue-lru``, ``queue-lineage``: policies that read the prefix tree or the waiting
queue). :func:`make_policy` builds any of them by name. ``belady`` (the offline
farthest-next-use bound) needs the future of a trace and lives in :mod:`kvpool.trace.belady`.

:class:`FrequencyAdmission` is the publish-side filter: a hash is admitted to the prefix index only once
it has been offered ``min_count`` times (Dynamo's frequency-based admission; TinyLFU's bounded counts).
"""

from __future__ import annotations

import importlib
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Final

from librt.vecs import vec
from mypy_extensions import i64, u8

from kvpool.allocators.arc import ARC_VARIANTS, ARCPolicy
from kvpool.allocators.arrays import extend_to, grown_i64, grown_u8
from kvpool.allocators.block_lists import BlockLists, LevelQueues
from kvpool.allocators.policy_base import SEQ_SPAN, EvictionPolicy, KeyedHeap, LRUPolicy
from kvpool.errors import InvalidArgumentError
from kvpool.numeric import IntArg, RealArg, as_int, as_optional_int, as_real

__all__ = ["ARC_VARIANTS", "POLICIES", "SEQ_SPAN", "ARCPolicy", "EvictionPolicy", "FIFOPolicy",
           "FrequencyAdmission", "KeyedHeap", "LFUPolicy", "LRUPolicy", "PriorityPolicy", "SLRUPolicy",
           "ValuedAdmission", "make_policy"]

#: Policy names a pool accepts (``belady`` needs a trace: :mod:`kvpool.trace.belady`).
POLICIES = ("lru", "fifo", "lfu", "slru", "priority", "arc", "arc-vllm", "s3fifo", "sieve", "tlru", "lineage",
            "queue-lru", "queue-lineage")


# ---- FIFO -----------------------------------------------------------------------------------------------


class FIFOPolicy(EvictionPolicy):
    """First in, first out: evict the block whose hash was published longest ago, however recently it was
    hit (SGLang's ``fifo``: node creation time; LMCache's FIFO).

    The cached blocks are linked in publish order, in use or not
    (:class:`~kvpool.allocators.block_lists.BlockLists`); a hit does not move a block. :meth:`pop` takes the
    list's head; an in-use block it finds there leaves the list (it is older than every block still in it),
    and once freed waits in a small heap by publish order (:class:`KeyedHeap`), whose blocks go before the
    list's. O(1) per call, amortized (each in-use block is passed over at most once per use), plus O(log r)
    for the r evictable blocks passed over while in use (a prefix running requests held when its turn came).
    """

    name = "fifo"

    def __init__(self) -> None:
        super().__init__()
        self._q = BlockLists(0, 1)  # cached blocks in publish order, less those passed over in use
        self._back = KeyedHeap()  # evictable blocks passed over in use, keyed by publish order
        self._born: vec[i64] = vec[i64]()  # per block: its publish sequence number
        self._evictable: vec[u8] = vec[u8]()
        self._cached: vec[u8] = vec[u8]()
        self._published = 0
        self._live = 0

    def grow(self, capacity: int) -> None:
        self._q.grow(capacity)
        self._back.grow(capacity)
        if capacity > len(self._born):
            self._born = grown_i64(self._born, capacity, 0)
        self._evictable = grown_u8(self._evictable, capacity)
        self._cached = grown_u8(self._cached, capacity)

    def published(self, block: int, block_hash: Hashable) -> None:
        self._published += 1
        self._born[block] = self._published
        if self._cached[block]:  # published again while in use: it takes its new place
            self._unqueue(block)
        self._cached[block] = 1
        self._q.append(0, block)

    def insert(self, block: int, priority: int) -> None:
        self._evictable[block] = 1
        self._live += 1
        if not self._q.linked[block]:  # passed over while in use
            self._back.push(block, int(self._born[block]))

    def remove(self, block: int) -> None:
        self._evictable[block] = 0
        self._live -= 1
        if not self._q.linked[block]:
            self._back.discard(block)

    def pop(self) -> int:
        if len(self._back):
            block = self._back.pop()
        else:
            q, evictable = self._q, self._evictable
            block = q.head(0)
            while not evictable[block]:  # in use: passed over (the list holds an evictable block)
                q.unlink(block)
                block = q.head(0)
            q.unlink(block)
        self._evictable[block] = 0
        self._cached[block] = 0
        self._live -= 1
        return block

    def dropped(self, block: int) -> None:
        if not self._cached[block]:
            return
        if self._evictable[block]:
            self._evictable[block] = 0
            self._live -= 1
        self._unqueue(block)
        self._cached[block] = 0

    def _unqueue(self, block: int) -> None:
        if self._q.linked[block]:
            self._q.unlink(block)
        else:
            self._back.discard(block)

    def order(self) -> list[int]:
        evictable = self._evictable
        return self._back.order() + [b for b in self._q.items(0) if evictable[b]]

    def __len__(self) -> int:
        return self._live


class LFUPolicy(EvictionPolicy):
    """Least frequently used: evict the block with the fewest prefix hits since its hash was published,
    ties by recency (least recently freed first): SGLang's ``lfu`` key ``(hit_count, last_access_time)``.
    O(1) per call: a FIFO per hit count (:class:`~kvpool.allocators.block_lists.LevelQueues`, the order of
    a heap keyed by ``(hits, free sequence)``), plus O(log k) when one of the k hit counts present among
    evictable blocks empties or fills."""

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self.hits: list[int] = []
        self._queues = LevelQueues()
        self._freed = 0

    def grow(self, capacity: int) -> None:
        self._queues.grow(capacity)
        extend_to(self.hits, capacity, 0)

    def published(self, block: int, block_hash: Hashable) -> None:
        self.hits[block] = 0

    def hit(self, block: int) -> None:
        self.hits[block] += 1

    def insert(self, block: int, priority: int) -> None:
        self._freed += 1
        self._queues.push(block, self.hits[block], self._freed)

    def remove(self, block: int) -> None:
        self._queues.discard(block)

    def pop(self) -> int:
        return self._queues.pop()

    def dropped(self, block: int) -> None:
        self._queues.discard(block)

    def order(self) -> list[int]:
        return self._queues.order()

    def __len__(self) -> int:
        return len(self._queues)


class PriorityPolicy(EvictionPolicy):
    """Retention priority, then recency: evict the lowest priority first, the least recently freed first
    within a priority. A block keeps the priority of the request that freed it last for ``retention_s``
    seconds after that free; then its priority decays to 0 (the default). Higher priority = kept longer;
    negative priorities are evicted before the default. SGLang's ``priority`` strategy (key
    ``(priority, last_access_time)``) plus the time decay vLLM users asked for (vllm#23083).

    ``clock()`` gives seconds (default ``time.monotonic``; the replay passes its simulated clock). A FIFO per
    priority (:class:`~kvpool.allocators.block_lists.LevelQueues`, each level offset by ``priority x
    SEQ_SPAN``), and one for the blocks whose priority decayed (at offset 0, merged with priority 0's by free
    order): O(1) per call, plus O(p) per eviction for the p priorities among the evictable blocks (the
    levels of priorities no block holds are reused once 16 are kept). Expired blocks move to the decayed
    FIFO once each, in free order, before an eviction.

    Raises:
        InvalidArgumentError: ``retention_s`` not a finite number > 0.
    """

    name = "priority"

    def __init__(self, retention_s: RealArg = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.retention_s = as_real(retention_s, "retention_s", minimum=0.0, open_min=True, finite=True)
        self.clock = clock
        self._queues = LevelQueues(False)
        self._queues.offsets = [0, 0]  # level 0: decayed blocks; level 1: priority 0
        self._levels: dict[int, int] = {0: 1}  # priority -> its level
        self._freed = 0
        self._expiring: OrderedDict[int, tuple[float, int]] = OrderedDict()  # block -> (freed at, seq)

    def grow(self, capacity: int) -> None:
        self._queues.grow(capacity)

    def insert(self, block: int, priority: int) -> None:
        self._freed += 1
        level = 1 if priority == 0 else self._level(priority)
        self._queues.push(block, level, self._freed)
        if priority:
            self._expiring[block] = (self.clock(), self._freed)

    def _level(self, priority: int) -> int:
        """The level of ``priority`` (a new one, or one no evictable block holds any more, for a new
        priority)."""
        level = self._levels.get(priority, -1)
        if level >= 0:
            return level
        queues, levels = self._queues, self._levels
        if len(levels) >= _PRIORITY_LEVELS:
            for p, kept in list(levels.items()):
                if p and not queues.count[kept]:
                    del levels[p]
        level = next((lv for lv in range(2, len(queues.offsets)) if lv not in levels.values()),
                     len(queues.offsets))
        if level == len(queues.offsets):
            queues.offsets.append(0)
        queues.offsets[level] = priority * SEQ_SPAN
        levels[priority] = level
        return level

    def remove(self, block: int) -> None:
        self._queues.discard(block)
        if self._expiring:
            self._expiring.pop(block, None)

    def dropped(self, block: int) -> None:
        self.remove(block)

    def pop(self) -> int:
        if not self._expiring:
            return self._queues.pop()
        self._expire()
        block = self._queues.pop()
        self._expiring.pop(block, None)
        return block

    def order(self) -> list[int]:
        self._expire()
        return self._queues.order()

    def _expire(self) -> None:
        """Decay to priority 0 every block idle for ``retention_s`` (the queue is in free order)."""
        deadline = self.clock() - self.retention_s
        expiring = self._expiring
        while expiring:
            block, (freed_at, seq) = next(iter(expiring.items()))
            if freed_at > deadline:
                break
            del expiring[block]
            self._queues.push(block, 0, seq)

    def __len__(self) -> int:
        return len(self._queues)


#: Priority levels :class:`PriorityPolicy` keeps before it reuses those of priorities no block holds.
_PRIORITY_LEVELS: Final = 16


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
        self._promoted: vec[u8] = vec[u8]()

    def _bound(self, num_blocks: int) -> None:
        self._cap = max(1, int(self.protected_fraction * num_blocks))

    def grow(self, capacity: int) -> None:
        self._promoted = grown_u8(self._promoted, capacity)

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


def make_policy(name: object, *, retention_s: RealArg = 60.0, clock: Callable[[], float] = time.monotonic,
                protected_fraction: RealArg = 0.8) -> EvictionPolicy:
    """A fresh policy by name (:data:`POLICIES`); the options apply to ``priority`` and ``slru`` only (each
    class takes its own options: build it directly to change them).

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
    if name in ("arc", "arc-vllm"):
        return ARCPolicy("vllm" if name == "arc-vllm" else "paper")
    if name in ("s3fifo", "sieve"):
        queues = _policies_module("queue_policies")
        return queues.S3FIFOPolicy() if name == "s3fifo" else queues.SievePolicy()
    if name in ("tlru", "lineage", "queue-lru", "queue-lineage"):
        return _policies_module("prefix_policies").prefix_policy(str(name))
    if name == "belady":
        raise InvalidArgumentError("policy 'belady' evicts by the future of a trace, which only the replay "
                                   "knows: use it through kvpool.trace (run_replay, kvpool replay --policy "
                                   "belady)")
    raise InvalidArgumentError(f"unknown eviction policy {name!r}: choose one of {', '.join(POLICIES)}")


def _policies_module(name: str) -> Any:
    """``kvpool.allocators.<name>`` (which imports this module, hence imported here at first use). Through
    ``importlib``, not an import statement: compiled code's own imports of a module of its build pass the
    import system's finders, and :mod:`kvpool._native`'s finder gives a compiled module its sources'
    docstrings and signatures as it is imported."""
    return importlib.import_module(f"kvpool.allocators.{name}")


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


class ValuedAdmission(FrequencyAdmission):
    """Tier admission by the device policy's own signal: an evicted block goes down to the tiers only when
    the pool's eviction policy values it (:meth:`EvictionPolicy.valued`: for ``s3fifo`` a block that reached
    the main queue, for ``sieve`` a visited one, for ``lineage`` a reused one; every block for a policy
    without the signal), so one-hit wonders are not written below. For an
    :class:`~kvpool.tiers.manager.OffloadManager` only (the device pool's own filter must count offers:
    :class:`FrequencyAdmission`); it admits every hash offered by hash alone."""

    def __init__(self) -> None:
        super().__init__(1)
