"""The eviction policy interface every :class:`~kvpool.allocators.block_pool.BlockPool` policy implements
(:class:`EvictionPolicy`; the calls the pool makes and their order: :mod:`kvpool.allocators.policies`), and
the keyed heap the heap-ordered policies share. A module of its own so that each policy family's module
imports only this one; :mod:`kvpool.allocators.policies` re-exports both names.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Hashable

from mypy_extensions import mypyc_attr

from kvpool.errors import InvalidArgumentError


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
