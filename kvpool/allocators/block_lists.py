"""Intrusive doubly linked lists of block ids (:class:`BlockLists`): the queues of the S3-FIFO, SIEVE and
lineage policies (:mod:`kvpool.allocators.queue_policies`, :mod:`kvpool.allocators.prefix_policies`). Two
int arrays over the block ids (``next``, ``prev``; the sentinels are the ids past the last block), so a
block costs a few list slots and no object. Compiled with the allocators' hot path.
"""

from __future__ import annotations

from kvpool.allocators.arrays import extend_flags

#: Where a block is: in no queue (not cached, or in use and passed over), or linked in one.
OUT = 0


class BlockLists:
    """Circular doubly linked lists of block ids over two int arrays, one sentinel per list (ids
    ``num_blocks + k``). ``linked[b]`` is the list holding ``b`` (1 + its index), 0 when in none. The block
    ids covered grow with the pool's (:meth:`grow`), the sentinels moving past them."""

    def __init__(self, num_blocks: int, num_lists: int) -> None:
        size = num_blocks + num_lists
        self.base = num_blocks
        self.next = list(range(size))
        self.prev = list(range(size))
        self.linked = bytearray(num_blocks)
        self.sizes = [0] * num_lists

    def grow(self, num_blocks: int) -> int:
        """Cover block ids below ``num_blocks`` (unlinked), the sentinels moved past them, every link to a
        sentinel renumbered (O(num_blocks): called in chunks that grow by an eighth, so O(1) amortized per
        block). Returns how far the sentinels moved (0: nothing to grow)."""
        old = self.base
        shift = num_blocks - old
        if shift <= 0:
            return 0
        nxt = [v + shift if v >= old else v for v in self.next]
        prv = [v + shift if v >= old else v for v in self.prev]
        self.next = nxt[:old] + list(range(old, num_blocks)) + nxt[old:]  # a new id links to itself
        self.prev = prv[:old] + list(range(old, num_blocks)) + prv[old:]
        self.base = num_blocks
        extend_flags(self.linked, num_blocks)
        return shift

    def head(self, lst: int) -> int:
        """The oldest block of list ``lst`` (its sentinel when empty)."""
        return self.next[self.base + lst]

    def append(self, lst: int, block: int) -> None:
        """Link ``block`` at the tail (newest end) of list ``lst``."""
        s = self.base + lst
        last = self.prev[s]
        self.next[last] = block
        self.prev[block] = last
        self.next[block] = s
        self.prev[s] = block
        self.linked[block] = lst + 1
        self.sizes[lst] += 1

    def unlink(self, block: int) -> None:
        nxt, prv = self.next[block], self.prev[block]
        self.next[prv] = nxt
        self.prev[nxt] = prv
        self.sizes[self.linked[block] - 1] -= 1
        self.linked[block] = OUT

    def items(self, lst: int) -> list[int]:
        """Blocks of list ``lst``, oldest first (O(length))."""
        out, s = [], self.base + lst
        b = self.next[s]
        while b != s:
            out.append(b)
            b = self.next[b]
        return out
