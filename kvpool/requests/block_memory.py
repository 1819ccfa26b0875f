"""The hook between the request path's blocks and the memory under them (issue 32's elastic KV cache).

A :class:`~kvpool.requests.kv_manager.KVCacheManager` built with ``memory=`` (a store on a page arena, such
as an elastic :class:`~kvpool.storage.paged.PagedKVCache`) keeps the store's **live** blocks equal to the
pool's blocks that hold KV: those in use and the cached free ones (their KV is the prefix cache). It tells
the store through :class:`PoolMemory`, at the three places where a block changes between holding KV and
not:

* handed out (admission, each step's new blocks, a restore from the tiers): ``commit_blocks`` before the
  forward writes them; an evicted cached block handed out again is live already (a no-op);
* emptied (a request's end or preemption, blocks a window left behind, a restore that stopped early):
  each block left with ref count 0 and no hash is released (``release_blocks``), and a page with no live
  block left goes back to the device;
* nothing else: a block freed with a hash stays committed as prefix cache until it is handed out again.

So an elastic pool's committed bytes follow its used and cached blocks, to within the pages that blocks
share (:mod:`kvpool.storage.page_map`) and the arena's reserve. When a commit is refused (the arena's limit,
a :class:`~kvpool.storage.arena.MemoryBudget` shared with another engine, or the device out of memory), the
pool's own cached free blocks are evicted (their pages given back) and the commit tried once more; if it is
still refused, the request path treats it as a pool that is short (admission waits, a running request is
preempted), never as an error mid-step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from kvpool.allocators.block_pool import CACHED, IN_USE, PINNED
from kvpool.errors import InsufficientMemoryError, IntegrityError


class BlockMemory(Protocol):
    """What the request path needs of a store whose memory follows its blocks
    (:class:`~kvpool.storage.elastic.ElasticMemory` has it): commit the pages under blocks about to be
    written, release blocks whose KV is worth nothing now, and say which blocks are live."""

    def commit_blocks(self, block_ids: Iterable[int]) -> int: ...

    def release_blocks(self, block_ids: Iterable[int]) -> int: ...

    def is_live(self, block: int) -> bool: ...

    def live_blocks(self) -> list[int]: ...


class PoolMemory:
    """Keeps ``store``'s live blocks equal to the pool's used and cached blocks.

    Args:
        store: the :class:`BlockMemory` (every block free and not live when this starts; the null block,
            if any, is committed here once, since kernels may read it).
        pool: returns the :class:`~kvpool.allocators.block_pool.BlockPool` (the manager's, read at each
            call).
        null_block: the pool's null block id (-1 or None: none).
    """

    def __init__(self, store: BlockMemory, pool: Callable[[], Any], null_block: int | None) -> None:
        self.store, self._pool = store, pool
        self.null_block = null_block if null_block is not None and null_block >= 0 else -1
        self.refused = 0  # commits refused even after evicting the cached free blocks
        if self.null_block >= 0:
            store.commit_blocks([self.null_block])

    def handed_out(self, tables: Sequence[Sequence[int]]) -> bool:
        """Commit the blocks of ``tables`` that are not live (a request's block tables after an allocation).
        On a refused commit, evict the pool's cached free blocks and try once more; return False (nothing
        committed) when it is still refused."""
        null = self.null_block
        blocks = [b for table in tables for b in table if b != null]
        try:
            self.store.commit_blocks(blocks)
            return True
        except InsufficientMemoryError:
            if not self.shrink():
                self.refused += 1
                return False
        try:
            self.store.commit_blocks(blocks)
            return True
        except InsufficientMemoryError:
            self.refused += 1
            return False

    def emptied(self, blocks: Iterable[int]) -> int:
        """Release those of ``blocks`` that hold no KV now (ref count 0, no hash) and are live; return the
        bytes given back."""
        pool, store, null = self._pool(), self.store, self.null_block
        dead = [b for b in dict.fromkeys(blocks) if b != null and pool.ref_count(b) == 0
                and pool.block_hash(b) is None and store.is_live(b)]
        return store.release_blocks(dead) if dead else 0

    def shrink(self) -> int:
        """Evict every cached free block of the pool (their hashes leave the prefix index, as
        ``evict_blocks`` does) and release their pages; return the bytes given back."""
        pool = self._pool()
        victims = pool.evictable_blocks()
        if not victims:
            return 0
        pool.evict_blocks(victims)
        return self.emptied(victims)

    def release_all(self) -> int:
        """Release every live block that holds no KV now (after the prefix cache was emptied and every
        request freed: all of them but the null block); return the bytes given back."""
        return self.emptied(self.store.live_blocks())

    def check(self) -> None:
        """IntegrityError unless the live blocks are exactly the pool's used and cached blocks (the null
        block aside)."""
        states, null = self._pool().block_states(), self.null_block
        holding = {b for b, s in enumerate(states) if s in (IN_USE, CACHED, PINNED)}
        live = set(self.store.live_blocks()) - {null}
        if live - holding:
            raise IntegrityError(f"blocks {sorted(live - holding)[:8]} are committed but hold no KV")
        if holding - live:
            raise IntegrityError(f"blocks {sorted(holding - live)[:8]} hold KV but are not committed")
