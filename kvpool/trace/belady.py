"""The offline bound: Belady's farthest-next-use eviction, for a replay that knows its trace's future.

Belady's MIN (Belady, "A study of replacement algorithms for a virtual-storage computer", IBM Systems
Journal 5(2), 1966; Mattson et al. 1970 proved it optimal) evicts the cached block whose next use lies
farthest in the future. Here a "use" of a block hash is a request, in the order the replay first admits
requests, whose full prompt blocks include that hash; a hash with no later use goes first. Prefix caching
adds a dependency MIN does not know: a block hits only when its whole prefix hits. The next use of a child
is never earlier than its parent's (every request holding the child holds the parent), and ties go to the
deeper block, so **a child always leaves before its parent**. With that dependency (and blocks that are in
use, hence not evictable, at eviction time) farthest-next-use is a strong reference, not a proven optimum:
``tests/test_belady.py`` compares it with an exhaustive search over every eviction choice on small traces.

:class:`TraceFuture` precomputes, for each admitted request and each of its prompt blocks, the position
of the next request using that block (O(total prompt blocks) time and memory). :class:`BeladyPolicy` is
an :class:`~kvpool.allocators.policies.EvictionPolicy` fed by it: the replay calls :meth:`BeladyPolicy.
admitted` at each request's first admission, before it touches or allocates anything, and the policy
re-keys every cached block of that request. O(log n) per pool call (a heap of ranks).
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence

from kvpool.allocators.arrays import extend_to
from kvpool.allocators.groups import group_key, split_group_key
from kvpool.allocators.policies import EvictionPolicy, KeyedHeap
from kvpool.errors import IntegrityError
from kvpool.trace.loaders import TraceRequest


class TraceFuture:
    """When each prompt block of a trace is next used, in the replay's admission order.

    ``requests`` are every request the replay will admit, in the order it first admits them
    (:func:`kvpool.trace.replay_config.admission_order`). ``next_use(i)[j]`` is the position of the next
    request using the j-th prompt block hash of request ``i``, or :attr:`never` (``len(requests)``).
    """

    def __init__(self, requests: Sequence[TraceRequest], block_size: int) -> None:
        self.requests = list(requests)
        self.block_size = block_size
        self.never = len(self.requests)
        self.max_depth = max((r.input_tokens // block_size for r in self.requests), default=0)
        last: dict[Hashable, int] = {}
        nexts: list[array] = [array("l")] * len(self.requests)
        for i in range(len(self.requests) - 1, -1, -1):
            hashes = self.requests[i].block_hashes(block_size)
            nexts[i] = array("l", [last.get(h, self.never) for h in hashes])
            for h in hashes:
                last[h] = i
        del last
        self._next = nexts

    def next_use(self, i: int) -> array:
        """Positions of the next use of each prompt block of admitted request ``i``."""
        return self._next[i]


class BeladyPolicy(EvictionPolicy):
    """Evict the evictable block whose hash is next used farthest ahead (never used again first), the
    deeper block first on a tie (child before parent). Rank of a block holding a hash seen at depth ``j``
    with next use ``u``: ``u * (max_depth + 1) + j``; the highest rank goes first. A block whose hash another
    block holds too (two requests computed it) is a spare: the next use hits the other one, so spares go
    before every other block, and the last holder of a hash gets its rank back.

    Only the replay can drive it: it must call :meth:`admitted` for every request it admits for the first
    time, in the future's order (an out-of-order call raises :class:`IntegrityError`).
    """

    name = "belady"

    def __init__(self, future: TraceFuture, num_groups: int = 1) -> None:
        super().__init__()
        self.future = future
        self.num_groups = num_groups  # a hybrid model's blocks of group g hold the key (g, hash)
        self._width = future.max_depth + 1
        self._never = (future.never + 1) * self._width  # above every finite rank
        self._rank: dict[Hashable, int] = {}  # hashes with a next use: their rank from now on
        self._spare = self._never + 1  # above every rank: a hash held by another block too
        self._holders: dict[Hashable, list[int]] = {}  # cached key -> its blocks (as the pool's index)
        self._heap = KeyedHeap()
        self._hash: list[Hashable | None] = []  # per block, extended by grow()
        self.position = 0  # requests admitted so far

    def grow(self, capacity: int) -> None:
        self._heap.grow(capacity)
        extend_to(self._hash, capacity, None)

    def admitted(self, req: TraceRequest, hashes: Sequence[Hashable]) -> None:
        """``req`` (block hashes ``hashes``) is admitted for the first time: each of its hashes is now next
        used at the following request that holds it, in every KV cache group. Call before touching or
        allocating its blocks."""
        i, future = self.position, self.future
        if i >= len(future.requests) or future.requests[i] is not req:
            raise IntegrityError(f"belady expected admitted request #{i} of its future, got another one")
        self.position = i + 1
        width, never, rank, holders, heap = self._width, future.never, self._rank, self._holders, self._heap
        for j, (h, u) in enumerate(zip(hashes, future.next_use(i), strict=True)):
            if u < never:
                rank[h] = u * width + j
            else:
                rank.pop(h, None)
            for g in range(self.num_groups):
                blocks = holders.get(group_key(g, h))
                if blocks is not None and len(blocks) == 1 and blocks[0] in heap:
                    heap.push(blocks[0], -(u * width + j))

    def published(self, block: int, block_hash: Hashable) -> None:
        blocks = self._holders.setdefault(block_hash, [])
        blocks.append(block)
        self._hash[block] = block_hash
        if len(blocks) == 2 and blocks[0] in self._heap:  # the other holder is a spare now
            self._heap.push(blocks[0], -self._spare)

    def insert(self, block: int, priority: int) -> None:
        self._heap.push(block, -self._rank_of(block))

    def _rank_of(self, block: int) -> int:
        key = self._hash[block]
        if key is None:
            return self._never
        if len(self._holders[key]) > 1:
            return self._spare
        return self._rank.get(split_group_key(key)[1], self._never)

    def remove(self, block: int) -> None:
        self._heap.discard(block)

    def pop(self) -> int:
        block = self._heap.pop()
        self._forget(block)
        return block

    def dropped(self, block: int) -> None:
        self._heap.discard(block)
        self._forget(block)

    def _forget(self, block: int) -> None:
        h = self._hash[block]
        self._hash[block] = None
        if h is None:
            return
        blocks = self._holders[h]
        blocks.remove(block)
        if not blocks:
            del self._holders[h]
        elif len(blocks) == 1 and blocks[0] in self._heap:  # the last holder: its own rank again
            self._heap.push(blocks[0], -self._rank_of(blocks[0]))

    def order(self) -> list[int]:
        return self._heap.order()

    def __len__(self) -> int:
        return len(self._heap)
