"""Allocation, freeing and touching of a block pool's blocks, and eviction from its cached free blocks: the
hot path of :class:`~kvpool.allocators.block_pool.BlockPool` (a layer of it, :class:`PoolAlloc`; see
:mod:`kvpool.allocators.pool_core`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvpool.allocators.arrays import (
    grown_i32,
    next_capacity,
    release_freed_memory,
)
from kvpool.allocators.pool_core import (
    PoolCore,
    _ints,
    _without_null,
)
from kvpool.allocators.prefix_index import NO_HASH
from kvpool.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidIdError,
    OutOfBlocksError,
)
from kvpool.numeric import IntArg, as_id_list, as_int
from kvpool.units import plural

if TYPE_CHECKING:
    from kvpool.events.sink import KVEventSink


class PoolAlloc(PoolCore):
    """allocate / free / touch and eviction of a block pool: see
    :class:`~kvpool.allocators.block_pool.BlockPool`."""

    # ---- allocation -------------------------------------------------------------------------------------

    def allocate(self, n: IntArg) -> list[int]:
        """Hand out ``n`` blocks, each with ref count 1: uncached free blocks first, then cached free blocks
        in the policy's eviction order (each loses its hash before it is handed out, so a stale entry never
        matches).

        Raises:
            InvalidArgumentError: ``n`` is negative or not an integer.
            OutOfBlocksError: fewer than ``n`` free blocks (cached free included); nothing is handed out.
        """
        free = self._free
        if type(n) is int and n == 1:  # fast path: one block
            if free:
                block = free.pop()
            elif self._fresh < self._n:
                block = self._fresh
                if block >= len(self._ref):
                    self._grow(block + 1)
                self._fresh = block + 1
            elif self._tail:
                block = self._tail.pop()
            elif len(self._lru) if self._lru is not None else len(self._policy):
                block = self._evict_one()
            else:
                block = -1
            if block >= 0:
                self._ref[block] = 1
                return [block]
        n = self._check_count(n)
        k = len(free)
        if n <= k:
            ids = free[k - n:]
            del free[k - n:]
            ids.reverse()
        else:
            ids = free[::-1]
            free.clear()
            if self._fresh < self._n:
                ids += self._take_fresh(n - k)
            if n > len(ids) and self._tail:
                ids += self._take_tail(n - len(ids))
            if n > len(ids):
                ids += self._evict(n - len(ids))
        ref = self._ref
        for block in ids:
            ref[block] = 1
        return ids

    def _take_fresh(self, m: int) -> range:
        """Up to ``m`` ids never handed out, ascending (the per-block arrays grown to cover them)."""
        fresh = self._fresh
        end = min(fresh + m, self._n)
        if end > len(self._ref):
            self._grow(end)
        self._fresh = end
        return range(fresh, end)

    def _take_tail(self, m: int) -> list[int]:
        """Up to ``m`` blocks of the bottom of the free stack, below the ids never handed out."""
        tail = self._tail
        k = max(0, len(tail) - m)
        ids = tail[k:]
        del tail[k:]
        ids.reverse()
        return ids

    def _grow(self, needed: int) -> None:
        """Extend the per-block arrays (the pool's, its index's and its policy's) to cover ids below
        ``needed``: by a chunk, at least an eighth (:func:`~kvpool.allocators.arrays.next_capacity`)."""
        capacity = next_capacity(len(self._ref), needed, self._n, self._chunk)
        self._ref = grown_i32(self._ref, capacity, 0)
        self._idx.grow(capacity)
        self._policy.grow(capacity)
        release_freed_memory(8 * capacity)  # the old arrays' pages

    def allocate_tensor(self, n: IntArg, dtype: Any = None) -> Any:
        """:meth:`allocate` as a 1-D CPU tensor: ``[n]`` block ids of ``dtype`` (``torch.int32``, the
        default, as kernels' block tables are, or ``torch.int64``), for a block table row; the ids are
        converted in one C-level call, no Python loop over them. ``free``, ``touch`` and ``cache_blocks``
        take such tensors (any integer dtype) back.

        Raises:
            InvalidArgumentError: ``dtype`` is neither int32 nor int64, or as :meth:`allocate`.
            OutOfBlocksError: as :meth:`allocate`.
        """
        import torch  # here, not at the top: a pool without tensors (a replay) imports no torch

        dtype = torch.int32 if dtype is None else dtype
        if dtype is not torch.int32 and dtype is not torch.int64:
            raise InvalidArgumentError(f"block id tensors are torch.int32 or torch.int64, got {dtype!r}")
        return torch.tensor(self.allocate(n), dtype=dtype)

    def _check_count(self, n: IntArg) -> int:
        if type(n) is not int or n < 0:
            n = as_int(n, "block count", minimum=0)
        if n > self._num_uncached_free + self.num_evictable_blocks:
            raise OutOfBlocksError(f"asked for {plural(n, 'block')}, {self.num_free_blocks} free of "
                                   f"{self._n}")
        return n

    def _evict(self, m: int) -> list[int]:
        """Take ``m`` blocks from the LRU head, dropping their hashes from the index first."""
        lru, idx = self._lru, self._idx
        if lru is None or self._on_evict is not None or idx.dups:
            return self._evict_and_tell(m)
        if self._sink is not None:
            return self._evict_recorded(m, self._sink)
        out = []
        for _ in range(m):
            block = lru.pop()
            idx.remove(block)
            out.append(block)
        self._evictions += m
        return out

    def _evict_one(self) -> int:
        """:meth:`_evict` of one block, without a list on the common path (LRU, nobody to tell)."""
        lru, idx = self._lru, self._idx
        if lru is None or self._on_evict is not None or self._sink is not None or idx.dups:
            return self._evict(1)[0]
        block = lru.pop()
        idx.remove(block)
        self._evictions += 1
        return block

    def _evict_recorded(self, m: int, sink: KVEventSink) -> list[int]:
        """:meth:`_evict` (LRU, every hash held by one block) telling ``sink`` the hashes that left."""
        lru = self._lru
        assert lru is not None
        idx, out, gone = self._idx, [], []
        for _ in range(m):
            block = lru.pop()
            gone.append(idx.hash_of(block))
            idx.remove(block)
            out.append(block)
        self._evictions += m
        rec = self._rec
        if rec is None or not rec.removed(gone):
            sink.removed(gone)
        return out

    def _evict_and_tell(self, m: int) -> list[int]:
        """:meth:`_evict` for any policy and with duplicate holders, then tell the event sink the hash of
        every evicted block, and the eviction listener the ids and hashes of those whose hash left the index
        (no other block holds it)."""
        idx, lru, out, gone = self._idx, self._lru, [], []
        if lru is not None:
            out = [lru.pop() for _ in range(m)]
        else:
            pop = self._policy.pop  # bound once: a policy may be an interpreted subclass
            out = [pop() for _ in range(m)]
        self._evictions += m
        if self._sink is None and self._on_evict is None:  # nobody to tell: no hash read back
            for block in out:
                idx.remove(block)
            return out
        last = []  # positions of the blocks that held the last copy of their hash
        for i, block in enumerate(out):
            gone.append(idx.hash_of(block))
            if idx.remove(block):
                last.append(i)
        if self._sink is not None:
            self._sink.removed(gone)
        if self._on_evict is not None and last:
            if len(last) < m:
                self._on_evict([out[i] for i in last], [gone[i] for i in last])
            else:
                self._on_evict(out, gone)
        return out

    def free(self, block_ids: Iterable[int], priority: IntArg = 0) -> None:
        """Drop one reference from each block; a block that reaches 0 becomes free.

        Pass ids in **eviction order, first to evict first**: a request frees its blocks tail first
        (``reversed(block_table)``), so the shared head of a prefix becomes evictable last and, by recency,
        is evicted last. Blocks without a hash go to the free stack (reused first); hashed ones join the
        policy's order (LRU: the tail). ``priority`` is the freeing request's retention priority: only the
        ``priority`` policy reads it (higher = kept longer).

        Raises:
            InvalidArgumentError: ``priority`` not an integer.
            InvalidIdError: an id out of range, not an integer, or repeated in the call (the null block
                aside).
            DoubleFreeError: an id whose ref count is already 0.
        """
        ids = block_ids if type(block_ids) is list else as_id_list(block_ids, "block ids")
        ref = self._ref
        marked = False  # whether the ids' ref counts are complemented (checked, release to restore them)
        if len(ids) != 1 or type(ids[0]) is not int or not 0 <= ids[0] < len(ref) or ref[ids[0]] <= 0:
            ids = _ints(ids)  # general path; a single valid id skips it (the null block never does)
            if self._reserved:
                ids = _without_null(ids)
            unreferenced = self._check_ids(ids, True)
            marked = unreferenced < 0 and type(priority) is int
            if not marked:
                self._restore(ids, len(ids))
            if unreferenced >= 0:
                raise DoubleFreeError(f"block {ids[unreferenced]} is not allocated (ref count 0)")
        level = priority if type(priority) is int else as_int(priority, "priority")  # the priority policy's:
        # checked before anything changes (a falsy None or 0.0 too)
        self._release(ids, level, marked)

    def _release(self, ids: list[int], level: int, marked: bool = False) -> None:
        """:meth:`free` of ids known valid: distinct ints in range, each referenced, none the null block
        (what :meth:`free` checks first; a :class:`~kvpool.allocators.groups.KVCacheCoordinator` frees its
        own tables, which hold such ids, through here). ``marked``: their ref counts are complemented, as
        :meth:`_check_ids` left them (restored here, in the same pass)."""
        free, key, ref = self._free, self._idx.key, self._ref
        chunk: list[int] = []  # the call's newly evictable blocks, in order (LRU: one chunk of its queue)
        for block in ids:
            r = ref[block]
            r = (~r if marked else r) - 1
            ref[block] = r
            if r == 0:
                if key[block] == NO_HASH:
                    free.append(block)
                else:
                    chunk.append(block)
        if not chunk:
            return
        if self._lru is not None:
            self._lru.insert_chunk(chunk)
            return
        policy = self._policy  # any policy but LRU, through its interface
        if self._insert_each:
            for block in chunk:
                policy.insert(block, level)
        else:
            policy.released(ids, chunk, level)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a prefix hit). A cached free block leaves the LRU and is
        revived in place with its hash; an in-use block is simply shared.

        Raises:
            InvalidIdError: an id out of range, not an integer, repeated (the null block aside), or free
                without a cached hash.
        """
        ids = block_ids if type(block_ids) is list else as_id_list(block_ids, "block ids")
        ref, lru, key = self._ref, self._lru, self._idx.key
        single_ok = len(ids) == 1 and type(ids[0]) is int and 0 <= ids[0] < len(ref) and (
            ref[ids[0]] > 0 or key[ids[0]] != NO_HASH)
        if not single_ok:  # general path; a single valid id skips it (the null block never does)
            ids = self._checked_touch(ids)
        if lru is None:
            self._revive(ids)
            return
        valid: list[int] = ids  # typed: each id a native int below (an untyped one boxes the vectors)
        where, revived = lru.where, 0
        for block in valid:
            r = ref[block]
            if r == 0:
                where[block] = 0
                revived += 1
            ref[block] = r + 1
        if revived:
            lru.removed(revived)

    def _revive(self, ids: list[int]) -> None:
        """``touch`` of valid ids through the policy interface: a hit on each hashed block, and each
        cached free one leaves the eviction order."""
        ref, idx, policy = self._ref, self._idx, self._policy
        for block in ids:
            if idx.holds(block):
                policy.hit(block)
                if ref[block] == 0:
                    policy.remove(block)
            ref[block] = ref[block] + 1

    def _checked_touch(self, ids: list[int]) -> list[int]:
        """The ids of a touch call as Python ints without the null block, once every one of them is valid."""
        ids = _ints(ids)
        if self._reserved:
            ids = _without_null(ids)
        if self._check_ids(ids) >= 0:
            for block in ids:
                if self._ref_of(block) == 0 and not self._holds(block):
                    raise InvalidIdError(f"block {block} is free and holds no cached hash: allocate it")
        return ids

    def reorder_free(self, key: Callable[[int], Any]) -> None:
        """Reorder the free stack (freed blocks without a hash, handed out before the ids never handed
        out) so that ``allocate`` hands out the block with the smallest ``key(block)`` first. Not on the
        hot path: O(F log F) for F such blocks; an elastic pool's page-aware order
        (:mod:`kvpool.requests.page_aware`) calls it when blocks are freed."""
        self._free.sort(key=key, reverse=True)  # pop() takes the end

    def evictable_blocks(self) -> list[int]:
        """Cached free block ids in eviction order, next victim first. O(number of cached free blocks)
        for LRU, O(n log n) for the heap-ordered policies."""
        lru = self._lru
        return lru.order() if lru is not None else self._policy.order()
