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
from kvpool.requests.page_aware import order_free_blocks, page_aware_victims
from kvpool.storage.page_map import BlockPages


class BlockMemory(Protocol):
    """What the request path needs of a store whose memory follows its blocks
    (:class:`~kvpool.storage.elastic.ElasticMemory` has it): commit the pages under blocks about to be
    written, release blocks whose KV is worth nothing now, and say which blocks are live."""

    def commit_blocks(self, block_ids: Iterable[int]) -> int: ...

    def release_blocks(self, block_ids: Iterable[int]) -> int: ...

    def trim(self) -> int: ...

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
        On a refused commit, give back the reserve's empty pages and evict page-aware (:meth:`shrink`: as
        many whole pages as the blocks need, then every page that can be freed) and try again; return
        False (nothing committed) when it is still refused."""
        null, store = self.null_block, self.store
        blocks = [b for table in tables for b in table if b != null]
        needed = self._pages_needed(blocks) or None
        for make_room in (store.trim, lambda: self.shrink(needed) + store.trim(),
                          lambda: self.shrink() + store.trim(), None):
            try:
                store.commit_blocks(blocks)
                return True
            except InsufficientMemoryError:
                if make_room is None:
                    break
                make_room()
        self.refused += 1
        return False

    def emptied(self, blocks: Iterable[int]) -> int:
        """Release those of ``blocks`` that hold no KV now (ref count 0, no hash) and are live; return the
        bytes given back. The pool's free blocks are then put in page-aware order
        (:func:`~kvpool.requests.page_aware.order_free_blocks`)."""
        pool, store, null = self._pool(), self.store, self.null_block
        dead = [b for b in dict.fromkeys(blocks) if b != null and pool.ref_count(b) == 0
                and pool.block_hash(b) is None and store.is_live(b)]
        given = store.release_blocks(dead) if dead else 0
        pages = self.pages
        if pages is not None:
            order_free_blocks(pool, pages)
        return given

    def shrink(self, max_pages: int | None = None) -> int:
        """Evict page-aware (:func:`~kvpool.requests.page_aware.page_aware_victims`: the cached free blocks
        of the pages whose every live block is cached free, fewest blocks first; up to ``max_pages`` such
        pages, None: all of them) and release their pages; their hashes leave the prefix index, as
        ``evict_blocks`` does. A store without pages evicts every cached free block. Return the bytes given
        back."""
        pool, pages = self._pool(), self.pages
        victims = (pool.evictable_blocks() if pages is None
                   else page_aware_victims(pool, pages, max_pages=max_pages))
        if not victims:
            return 0
        pool.evict_blocks(victims)
        return self.emptied(victims)

    @property
    def pages(self) -> BlockPages | None:
        """The store's :class:`~kvpool.storage.page_map.BlockPages` (None: a store without pages)."""
        return getattr(self.store, "pages", None)

    def _pages_needed(self, blocks: list[int]) -> int | None:
        """Pages that committing ``blocks`` would add (None: unknown, a store without pages)."""
        pages = self.pages
        if pages is None:
            return None
        return len({p for b in blocks if not pages.is_live(b) for p in pages.map.pages_of(b)
                    if not pages.live_on(p)})

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
