"""Scan-resistant queue policies: S3-FIFO and SIEVE on the pool's
:class:`~kvpool.allocators.policies.EvictionPolicy` interface, each evicting exactly as libCacheSim (the
authors' simulator, ``libCacheSim/cache/eviction/S3FIFO.c`` and ``Sieve.c``; its Python bindings,
``libcachesim`` 0.3.5, are the reference of ``tests/test_queue_policies.py``) on a plain key sequence.

Both keep every cached block of the pool in their queues, in the order a cache would: a block joins its
queue when its hash is published (libCacheSim's insert), a hit does not move it. Adapted to a pool, where a
block in use cannot be evicted: an in-use block keeps its place while the queue's head or the hand has not
reached it; when it does, the block leaves the queue (in O(1), no walk over it again) and rejoins at the
tail, as a fresh insert would, once its last reference is freed. So each in-use block is passed over at most
once per use, and every call is O(1) amortized. On a key sequence where only the block being stored is in
use when the pool evicts (one access at a time, as a cache simulator runs), they evict what libCacheSim
evicts, in the same order.

The queues are intrusive doubly linked lists over per-block int arrays
(:class:`~kvpool.allocators.block_lists.BlockLists`), so a block costs a few list slots and no object.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Final

from librt.vecs import vec
from mypy_extensions import u8

from kvpool.allocators.arrays import extend_to, grown_u8
from kvpool.allocators.block_lists import OUT, BlockLists
from kvpool.allocators.policy_base import EvictionPolicy
from kvpool.numeric import IntArg, RealArg, as_int, as_real

_SMALL: Final = 0
_MAIN: Final = 1


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang, Zhang, Qiu, Yue and Rashmi, "FIFO queues are all you need for cache eviction", SOSP
    2023), as libCacheSim's ``S3FIFO.c`` implements it: a small FIFO of ``small_ratio`` x the pool's blocks,
    a main FIFO of the rest, and a ghost FIFO of the hashes evicted from the small queue (at most
    ``int(ghost_ratio x num_blocks) + 1``: libCacheSim's ghost FIFO of that size evicts only past it, as the
    comparison with it shows). A published hash enters the main queue when it is in the ghost (a second use
    soon after a first), else the small queue (the main queue until the first eviction, once the small queue
    is full). A hit adds 1 to the block's count; the block does not move. Eviction takes the small queue's
    head when the main queue holds at most its share and the small queue has an evictable block, else the
    main queue's head. The small queue's head moves to the main queue when it was hit
    ``move_to_main_threshold`` times or more (count reset to 0), else it is evicted and its hash joins the
    ghost; the main queue's head goes back to its tail with its count ``min(count, 3) - 1`` while the count
    is >= 1 (a 2-bit clock), else it is evicted. One-hit wonders thus leave from the small queue without
    disturbing the main one: the scan resistance. Sizes count every cached block of a queue, in use or not.
    O(1) amortized per call. :meth:`valued`: the block was promoted to, or entered, the main queue.

    Raises:
        InvalidArgumentError: ``small_ratio`` not in (0, 1], ``ghost_ratio`` not a finite number >= 0, or a
            threshold < 1.
    """

    name = "s3fifo"

    def __init__(self, small_ratio: RealArg = 0.1, ghost_ratio: RealArg = 0.9,
                 move_to_main_threshold: IntArg = 2) -> None:
        super().__init__()
        self.small_ratio = as_real(small_ratio, "small_ratio", minimum=0.0, maximum=1.0, open_min=True)
        self.ghost_ratio = as_real(ghost_ratio, "ghost_ratio", minimum=0.0, finite=True)
        self.threshold = as_int(move_to_main_threshold, "move_to_main_threshold", minimum=1)
        self._q = BlockLists(0, 2)
        self._freq: list[int] = []
        self._evictable: vec[u8] = vec[u8]()
        self._member: vec[u8] = vec[u8]()  # 1 + the queue whose share a cached block counts in (0: none)
        self._hash: list[Hashable | None] = []
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._cached = [0, 0]  # cached blocks counted in each queue's share (in use or not)
        self._live = [0, 0]  # evictable blocks linked in each queue
        self._small_cap = self._main_cap = self._ghost_cap = 0
        self._has_evicted = False

    def _bound(self, num_blocks: int) -> None:
        # libCacheSim: small = (int64)(size * ratio), main = size - small, ghost = (int64)(size * ratio)
        self._small_cap = int(num_blocks * self.small_ratio)
        self._main_cap = num_blocks - self._small_cap
        self._ghost_cap = int(num_blocks * self.ghost_ratio)

    def grow(self, capacity: int) -> None:
        self._q.grow(capacity)
        extend_to(self._freq, capacity, 0)
        self._evictable = grown_u8(self._evictable, capacity)
        self._member = grown_u8(self._member, capacity)
        extend_to(self._hash, capacity, None)

    def published(self, block: int, block_hash: Hashable) -> None:
        ghost = self._ghost
        if block_hash in ghost:  # a use soon after one evicted from the small queue
            del ghost[block_hash]
            queue = _MAIN
        elif not self._has_evicted and self._cached[_SMALL] >= self._small_cap:
            queue = _MAIN  # before the first eviction, a full small queue sends inserts to the main one
        else:
            queue = _SMALL
        self._hash[block] = block_hash
        self._freq[block] = 0
        self._member[block] = queue + 1
        self._cached[queue] += 1
        self._q.append(queue, block)

    def hit(self, block: int) -> None:
        self._freq[block] += 1

    def insert(self, block: int, priority: int) -> None:
        queue = self._member[block] - 1
        self._evictable[block] = 1
        self._live[queue] += 1
        if self._q.linked[block] == OUT:  # passed over while in use: back at the tail
            self._q.append(queue, block)

    def remove(self, block: int) -> None:
        self._evictable[block] = 0
        self._live[self._member[block] - 1] -= 1

    def pop(self) -> int:
        self._has_evicted = True
        while True:
            if (self._cached[_MAIN] > self._main_cap or not self._live[_SMALL]) and self._live[_MAIN]:
                victim = self._evict_main()
            else:
                victim = self._evict_small()
            if victim >= 0:
                return victim

    def _evict_small(self) -> int:
        """Walk the small queue's head: promote what was hit enough, evict the first other block (-1: the
        small queue ran out of evictable blocks, having promoted some)."""
        q, freq, sentinel = self._q, self._freq, self._q.base + _SMALL
        while self._live[_SMALL]:
            block = q.head(_SMALL)
            if block == sentinel:
                break
            q.unlink(block)
            if not self._evictable[block]:
                continue  # in use: rejoins at the tail when freed
            if freq[block] >= self.threshold:
                freq[block] = 0
                self._move(block, _MAIN)
                continue
            ghost, key = self._ghost, self._hash[block]
            self._forget(block, _SMALL)
            if self._ghost_cap and key not in ghost:
                if len(ghost) > self._ghost_cap:  # libCacheSim's ghost FIFO holds one hash past its size
                    ghost.popitem(False)
                ghost[key] = None
            return block
        return -1

    def _evict_main(self) -> int:
        q, freq, sentinel = self._q, self._freq, self._q.base + _MAIN
        while self._live[_MAIN]:
            block = q.head(_MAIN)
            if block == sentinel:
                break
            q.unlink(block)
            if not self._evictable[block]:
                continue
            f = freq[block]
            if f >= 1:
                freq[block] = min(f, 3) - 1
                q.append(_MAIN, block)
                continue
            self._forget(block, _MAIN)
            return block
        return -1

    def _move(self, block: int, queue: int) -> None:
        """An evictable block of the small queue (unlinked) joins the main queue's tail."""
        self._cached[_SMALL] -= 1
        self._live[_SMALL] -= 1
        self._cached[queue] += 1
        self._live[queue] += 1
        self._member[block] = queue + 1
        self._q.append(queue, block)

    def _forget(self, block: int, queue: int) -> None:
        """``block`` (unlinked, evictable, of ``queue``) leaves the cache."""
        self._cached[queue] -= 1
        self._live[queue] -= 1
        self._evictable[block] = 0
        self._member[block] = 0
        self._hash[block] = None

    def dropped(self, block: int) -> None:
        member = self._member[block]
        if not member:
            return
        if self._q.linked[block] != OUT:
            self._q.unlink(block)
        if self._evictable[block]:
            self._live[member - 1] -= 1
            self._evictable[block] = 0
        self._cached[member - 1] -= 1
        self._member[block] = 0
        self._hash[block] = None

    def valued(self, block: int) -> bool:
        """The block entered or was promoted to the main queue (hit in the small queue, or published from
        the ghost): not a one-hit wonder."""
        return self._member[block] == _MAIN + 1 or self._freq[block] > 0

    def order(self) -> list[int]:
        """The evictable blocks, next victim first: :meth:`pop`'s walk replayed on copies (O(n) per
        victim at worst; for tests and inspection)."""
        ev, freq = self._evictable, list(self._freq)
        queues = [[b for b in self._q.items(lst) if ev[b]] for lst in (_SMALL, _MAIN)]
        queues[_SMALL] += [b for b in range(len(ev)) if ev[b] and not self._q.linked[b] and
                           self._member[b] == _SMALL + 1]
        queues[_MAIN] += [b for b in range(len(ev)) if ev[b] and not self._q.linked[b] and
                          self._member[b] == _MAIN + 1]
        cached, out = list(self._cached), []
        while queues[_SMALL] or queues[_MAIN]:
            if (cached[_MAIN] > self._main_cap or not queues[_SMALL]) and queues[_MAIN]:
                block = queues[_MAIN].pop(0)
                if freq[block] >= 1:
                    freq[block] = min(freq[block], 3) - 1
                    queues[_MAIN].append(block)
                    continue
                cached[_MAIN] -= 1
            else:
                block = queues[_SMALL].pop(0)
                cached[_SMALL] -= 1
                if freq[block] >= self.threshold:
                    freq[block] = 0
                    cached[_MAIN] += 1
                    queues[_MAIN].append(block)
                    continue
            out.append(block)
        return out

    def __len__(self) -> int:
        return self._live[_SMALL] + self._live[_MAIN]


class SievePolicy(EvictionPolicy):
    """SIEVE (Zhang, Yang, Yue, Vigfusson and Rashmi, "SIEVE is simpler than LRU", NSDI 2024), as
    libCacheSim's ``Sieve.c`` implements it: one FIFO of the cached blocks, newest at the head, and a hand
    that starts at the tail (the oldest). A hit sets the block's visited bit; nothing moves. Eviction walks
    the hand from the tail towards the head (wrapping to the tail), clearing visited bits, and evicts the
    first block whose bit is clear; the hand then rests on its newer neighbour. Newly published blocks that
    are never hit go at the hand's next pass, so one-hit wonders leave quickly while hit blocks stay where
    they are. O(1) amortized per call (each pass over a block clears a bit a hit set). :meth:`valued`: the
    block was hit since it was published.
    """

    name = "sieve"

    def __init__(self) -> None:
        super().__init__()
        self._q = BlockLists(0, 1)
        self._visited: vec[u8] = vec[u8]()
        self._evictable: vec[u8] = vec[u8]()
        self._cached: vec[u8] = vec[u8]()
        self._hand = 0  # the next block the hand looks at; the sentinel: start at the tail
        self._live = 0

    def grow(self, capacity: int) -> None:
        old = self._q.base
        shift = self._q.grow(capacity)
        if self._hand >= old:  # on the sentinel: it moved
            self._hand += shift
        self._visited = grown_u8(self._visited, capacity)
        self._evictable = grown_u8(self._evictable, capacity)
        self._cached = grown_u8(self._cached, capacity)

    # The list runs oldest (the sentinel's next) to newest (its prev); libCacheSim's head is the newest.

    def published(self, block: int, block_hash: Hashable) -> None:
        self._visited[block] = 0
        self._cached[block] = 1
        self._q.append(0, block)

    def hit(self, block: int) -> None:
        self._visited[block] = 1

    def insert(self, block: int, priority: int) -> None:
        self._evictable[block] = 1
        self._live += 1
        if self._q.linked[block] == OUT:
            self._q.append(0, block)

    def remove(self, block: int) -> None:
        self._evictable[block] = 0
        self._live -= 1

    def pop(self) -> int:
        q, visited, evictable, sentinel = self._q, self._visited, self._evictable, self._q.base
        block = self._hand if self._hand != sentinel else q.head(0)
        while True:
            if block == sentinel:  # past the newest: wrap to the tail
                block = q.head(0)
                continue
            newer = q.next[block]
            if not evictable[block]:  # in use: leaves the queue, rejoins at the head when freed
                if block == self._hand:
                    self._hand = newer
                q.unlink(block)
                block = newer
                continue
            if visited[block]:
                visited[block] = 0
                block = newer
                continue
            break
        self._hand = q.next[block]
        q.unlink(block)
        evictable[block] = 0
        self._cached[block] = 0
        self._live -= 1
        return block

    def dropped(self, block: int) -> None:
        if not self._cached[block]:
            return
        if self._q.linked[block] != OUT:
            if block == self._hand:
                self._hand = self._q.next[block]
            self._q.unlink(block)
        if self._evictable[block]:
            self._evictable[block] = 0
            self._live -= 1
        self._cached[block] = 0
        self._visited[block] = 0

    def valued(self, block: int) -> bool:
        return bool(self._visited[block])

    def order(self) -> list[int]:
        """The evictable blocks, next victim first: the hand's walk replayed on copies (for tests and
        inspection)."""
        ev, visited = self._evictable, [int(v) for v in self._visited]
        items = [b for b in self._q.items(0) if ev[b]]
        items += [b for b in range(len(ev)) if ev[b] and not self._q.linked[b]]  # they rejoin at the head
        hand = self._hand
        at = next((i for i, b in enumerate(items) if b == hand), None)
        if at is None:  # the hand rests on an in-use block or the sentinel: the next evictable one, or 0
            walk, linked = self._q.items(0), set(items)
            start = walk.index(hand) if hand in walk else len(walk)
            at = next((items.index(b) for b in walk[start:] if b in linked), 0)
        out, i = [], at
        while items:
            i %= len(items)
            block = items[i]
            if visited[block]:
                visited[block] = 0
                i += 1
                continue
            out.append(items.pop(i))
        return out

    def __len__(self) -> int:
        return self._live

