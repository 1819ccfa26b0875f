"""Intrusive doubly linked lists of block ids: :class:`BlockLists`, the queues of the FIFO, S3-FIFO, SIEVE
and tlru policies (:mod:`kvpool.allocators.policies`, :mod:`kvpool.allocators.queue_policies`,
:mod:`kvpool.allocators.prefix_policies`); :class:`LevelQueues`, a FIFO per level, those of lfu, priority
and lineage. Both keep ``librt.vecs`` vectors of ints over the block ids (4 or 8 bytes a block, read and
written natively when compiled) and no object per block. Compiled with the allocators' hot path.
"""

from __future__ import annotations

import heapq
from typing import Final

from librt.vecs import append, vec
from mypy_extensions import i32, i64, u8

from kvpool.allocators.arrays import grown_i32, grown_i64, grown_u8

#: Where a block is: in no queue (not cached, or in use and passed over), or linked in one.
OUT: Final = 0


class BlockLists:
    """Circular doubly linked lists of block ids over two int arrays, one sentinel per list (ids
    ``num_blocks + k``). ``linked[b]`` is the list holding ``b`` (1 + its index), 0 when in none. The block
    ids covered grow with the pool's (:meth:`grow`), the sentinels moving past them."""

    def __init__(self, num_blocks: int, num_lists: int) -> None:
        size = num_blocks + num_lists
        self.base = num_blocks
        self.next: vec[i32] = vec[i32](range(size))
        self.prev: vec[i32] = vec[i32](range(size))
        self.linked: vec[u8] = grown_u8(vec[u8](), num_blocks)
        self.sizes = [0] * num_lists

    def grow(self, num_blocks: int) -> int:
        """Cover block ids below ``num_blocks`` (unlinked), the sentinels moved past them, every link to a
        sentinel renumbered (O(num_blocks): called in chunks that grow by an eighth, so O(1) amortized per
        block). Returns how far the sentinels moved (0: nothing to grow)."""
        old = self.base
        shift = num_blocks - old
        if shift <= 0:
            return 0
        self.next = _shifted(self.next, old, shift)
        self.prev = _shifted(self.prev, old, shift)
        self.base = num_blocks
        self.linked = grown_u8(self.linked, num_blocks)
        return shift

    def head(self, lst: int) -> int:
        """The oldest block of list ``lst`` (its sentinel when empty)."""
        return int(self.next[self.base + lst])

    def append(self, lst: int, block: int) -> None:
        """Link ``block`` at the tail (newest end) of list ``lst``."""
        s = self.base + lst
        last = int(self.prev[s])
        self.next[last] = block
        self.prev[block] = last
        self.next[block] = s
        self.prev[s] = block
        self.linked[block] = lst + 1
        self.sizes[lst] += 1

    def unlink(self, block: int) -> None:
        nxt, prv = int(self.next[block]), int(self.prev[block])
        self.next[prv] = nxt
        self.prev[nxt] = prv
        self.sizes[int(self.linked[block]) - 1] -= 1
        self.linked[block] = OUT

    def items(self, lst: int) -> list[int]:
        """Blocks of list ``lst``, oldest first (O(length))."""
        out, s = [], self.base + lst
        b = int(self.next[s])
        while b != s:
            out.append(b)
            b = int(self.next[b])
        return out


def _shifted(links: vec[i32], old: int, shift: int) -> vec[i32]:
    """``links`` of :class:`BlockLists` with ``shift`` more block ids: the links of the ``old`` block ids
    kept (those to a sentinel, ``>= old``, moved by ``shift``), the new ids linked to themselves, then the
    sentinels' links (moved alike)."""
    out = vec[i32](capacity=len(links) + shift)
    for i in range(len(links)):
        if i == old:
            for b in range(old, old + shift):
                out = append(out, b)
        v = int(links[i])
        out = append(out, v + shift if v >= old else v)
    return out


class LevelQueues:
    """Evictable blocks ordered by ``(offset of their level + stamp, stamp)``: one FIFO (intrusive, over
    ``nxt``/``prv`` int vectors) per level, so push, discard and pop are O(1) where a heap is O(log n).
    Within a level, stamps are pushed in increasing order, so the head is the level's smallest key;
    :meth:`pop` takes the smallest head. ``strict`` (the default): levels are strictly ordered (the key
    ``level x SEQ_SPAN + stamp``): the lowest non-empty level, found through a small heap of the levels that
    turned non-empty (O(log levels) when a level empties or fills). Otherwise levels interleave by
    ``offsets[level]`` (ints the caller sets and may change at any time: each level's FIFO stays in order):
    the smallest head of the non-empty levels, O(non-empty levels) a pop, for a bounded number of levels.
    Ties on the key go to the smaller stamp, as :class:`~kvpool.allocators.policy_base.KeyedHeap` breaks
    them (its push order). Levels are ints >= 0; within a level, stamps must not decrease from one push to
    the next (pushes to different levels may come in any stamp order)."""

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict
        self.offsets: list[int] = []  # per level, when not strict (a level past the list: offset 0)
        self.nxt: vec[i32] = vec[i32]()
        self.prv: vec[i32] = vec[i32]()
        self.level: vec[i32] = vec[i32]()  # per block: its level, -1 when in no queue
        self.stamp: vec[i64] = vec[i64]()
        self.head: list[int] = []  # per level: oldest block, -1 when empty
        self.tail: list[int] = []
        self.count: list[int] = []
        self.size = 0
        self._lows: list[int] = []  # strict: a heap of levels that may be non-empty
        self._listed: list[bool] = []  # strict: the level is in _lows
        self._active: list[int] = []  # not strict: the non-empty levels

    def grow(self, capacity: int) -> None:
        """Cover block ids below ``capacity`` (in no queue)."""
        if capacity > len(self.level):
            self.nxt = grown_i32(self.nxt, capacity, -1)
            self.prv = grown_i32(self.prv, capacity, -1)
            self.level = grown_i32(self.level, capacity, -1)
            self.stamp = grown_i64(self.stamp, capacity, 0)

    def push(self, block: int, level: int, stamp: int) -> None:
        """Queue ``block`` at ``level`` (moving it if queued), newest of its level."""
        if self.level[block] >= 0:
            self.discard(block)
        while level >= len(self.head):
            self.head.append(-1)
            self.tail.append(-1)
            self.count.append(0)
            self._listed.append(False)
        last = self.tail[level]
        self.prv[block] = last
        self.nxt[block] = -1
        if last < 0:
            self.head[level] = block
            if not self.strict:
                self._active.append(level)
            elif not self._listed[level]:
                self._listed[level] = True
                heapq.heappush(self._lows, level)
        else:
            self.nxt[last] = block
        self.tail[level] = block
        self.count[level] += 1
        self.level[block] = level
        self.stamp[block] = stamp
        self.size += 1

    def discard(self, block: int) -> bool:
        """Unqueue ``block`` if queued; returns whether it was."""
        level = int(self.level[block])
        if level < 0:
            return False
        before, after = int(self.prv[block]), int(self.nxt[block])
        if before < 0:
            self.head[level] = after
        else:
            self.nxt[before] = after
        if after < 0:
            self.tail[level] = before
        else:
            self.prv[after] = before
        self.count[level] -= 1
        if after < 0 and before < 0 and not self.strict:
            self._active.remove(level)
        self.level[block] = -1
        self.size -= 1
        return True

    def _lowest(self) -> int:
        """Strict mode: the lowest non-empty level (the queue is not empty)."""
        lows, head = self._lows, self.head
        while head[lows[0]] < 0:
            self._listed[heapq.heappop(lows)] = False
        return lows[0]

    def first(self) -> int:
        """The next block :meth:`pop` takes (the queue is not empty)."""
        if self.strict:
            return self.head[self._lowest()]
        offsets, head, stamp = self.offsets, self.head, self.stamp
        best, best_key, best_stamp = -1, 0, 0
        for level in self._active:
            block = head[level]
            s = int(stamp[block])
            key = (offsets[level] if level < len(offsets) else 0) + s
            if best < 0 or key < best_key or (key == best_key and s < best_stamp):
                best, best_key, best_stamp = block, key, s
        return best

    def pop(self) -> int:
        """Unqueue and return the block of the smallest key (IndexError when empty)."""
        if not self.size:
            raise IndexError("pop from an empty LevelQueues")
        block = self.first()
        self.discard(block)
        return block

    def order(self) -> list[int]:
        """Queued blocks, next popped first (O(n log n))."""
        out = []
        for level in range(len(self.head)):
            offset = level << 62 if self.strict else (self.offsets[level] if level < len(self.offsets) else 0)
            b = self.head[level]
            while b >= 0:
                s = int(self.stamp[b])
                out.append((offset + s, s, b))
                b = int(self.nxt[b])
        return [b for _, _, b in sorted(out)]

    def __contains__(self, block: int) -> bool:
        return self.level[block] >= 0

    def __len__(self) -> int:
        return self.size
