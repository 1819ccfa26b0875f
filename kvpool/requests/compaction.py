"""Compaction of an elastic pool (issue 32): move live blocks off sparse pages so that the committed pages
follow the blocks holding KV.

An elastic store gives a page back only once no live block is on it
(:class:`~kvpool.storage.page_map.BlockPages`), and the page-aware order
(:mod:`kvpool.requests.page_aware`) fills holes before it commits a page. Holes still appear between
allocations: a finished request's unhashed last blocks are freed, and the pages they leave keep other live
blocks (in use, or cached free), so they stay committed. :class:`Compactor` closes that gap:

* **When.** The live blocks (those in use, the cached free ones, and the null block: the store's live
  blocks, :class:`~kvpool.requests.block_memory.PoolMemory`) need ``ceil(live / blocks_per_page)`` pages
  packed (:func:`packed_pages`). When the pages holding them pass that by more than ``slack_pages`` (1 by
  default: the whole pool is one page group, whatever its KV cache groups; the arena's reserve of empty
  pages is apart), :meth:`Compactor.compact` packs them down to that count. The check is O(1); a plan is
  O(blocks).
* **What moves** (:func:`plan_moves`): every live block of the emptiest page goes to the holes (free
  blocks) of the fullest pages, page after page, until the pages holding live blocks are the packed count
  (always reachable: while ``pages > ceil(live / per_page)`` the other pages hold at least as many holes
  as the emptiest page holds blocks). Pinned blocks and the null block stay (their holders name them by
  id); a page holding one is never emptied.
* **A move** ``src -> dst``: ``dst`` is committed (its page is, already), the KV of ``src`` is copied into
  ``dst`` (``copy``: the engine's whole-block copy, every layer's K and V, every KV cache group's layers,
  an MLA latent alike: :meth:`PagedKVCache.copy_blocks <kvpool.storage.paged.PagedKVCache.copy_blocks>`;
  a replay copies nothing), the pool moves the ref count, the hash (its prefix index entry) and the
  eviction policy's entry (:meth:`BlockPool.move_block <kvpool.allocators.block_pool.BlockPool.move_block>`),
  every running request's block table names ``dst`` instead (:meth:`KVCacheCoordinator.rename_blocks
  <kvpool.allocators.groups.KVCacheCoordinator.rename_blocks>`), and ``src`` is released, so the emptied
  pages go back to the device (past the reserve). **No KV event**: the events name hashes, not block ids,
  and every hash stays on the device, so for the events' consumers nothing was removed or stored.
* **Between steps** only (the engine runs it after a step's update, the replay at the same point),
  never while a kernel reads the tables. With tiers attached, their copies and stores in flight are
  completed first (:meth:`OffloadManager.synchronize <kvpool.tiers.manager.OffloadManager.synchronize>`:
  a device <-> host copy names its device blocks by id, and a write-through store holds its blocks until
  it lands), then the plan is made: no job names a block that moves. Under tensor parallelism rank 0
  decides and every pool call, page call and copy of a compaction goes to the other ranks in the pool log
  (:mod:`kvpool.engine.tp_compaction`).
* **Layouts.** Block-major (one strip), and the ``[2, L, N, ...]`` layout when each strip starts on a
  page (``N x`` a block's bytes in a strip a multiple of the page): block ``b`` is on page ``b //
  per_page`` of every strip, so a page row (one page a strip) is emptied as one page is. A layout
  whose blocks straddle pages, or whose strips start inside a page (a block's pages then group
  differently in each strip), is left as it is: its pages are shared by neighbours that differ from
  strip to strip, so the packed count is no longer ``ceil(live / per_page)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.allocators.block_pool import CACHED, FREE, IN_USE
from kvpool.requests.page_aware import order_free_blocks
from kvpool.storage.page_map import BlockPages

#: ``(src, dst)`` block pairs of one compaction.
Moves = list[tuple[int, int]]


def blocks_per_page(pages: BlockPages) -> int | None:
    """Blocks on each page when the store's blocks tile its pages, else None (nothing to compact): every
    strip (one block-major; K or V of one layer in the ``[2, L, N, ...]`` layout) starts on a page, all at
    the same stride, a block no longer than the stride, a page a multiple of it and at least 2 blocks. Then
    block ``b`` lies on page ``b // per_page`` of each strip: the strips' pages go in *page rows* (one
    page of each strip), committed and released together."""
    strips, size = pages.map.strips, pages.map.page_size
    stride = strips[0].stride
    if any(s.offset % size or s.stride != stride or s.length > stride for s in strips) \
            or size % stride or size < 2 * stride:
        return None
    return size // stride


def packed_pages(num_live: int, per_page: int) -> int:
    """Pages (page rows) ``num_live`` blocks need packed, ``per_page`` a page: ``ceil(num_live /
    per_page)``."""
    return -(-num_live // per_page)


def holding_pages(pages: BlockPages) -> int:
    """Page rows holding a live block (the committed pages less the reserve of empty ones, over the
    strips; the pages of a row holding a live block are all committed). O(1)."""
    return (pages.arena.num_committed - pages.num_reserve) // len(pages.map.strips)


def plan_moves(pages: BlockPages, states: bytes | bytearray, *, target: int | None = None) -> Moves:
    """The moves that pack the live blocks of ``pages`` into ``target`` pages (default: the packed count),
    from the emptiest page into the holes of the fullest, page by page, stopping where no further page can
    be emptied. ``states``: the pool's :meth:`~kvpool.allocators.block_pool.BlockPool.block_states` (a live
    block moves when it is ``IN_USE`` or ``CACHED``; a hole is a ``FREE`` block that is not live, below
    :attr:`~BlockPages.usable_blocks`). Empty when the blocks do not tile the pages. O(blocks)."""
    per_page = blocks_per_page(pages)
    if per_page is None:
        return []
    target = packed_pages(pages.num_live, per_page) if target is None else target
    live: dict[int, list[int]] = {}  # page (counted from the store's first) -> its live blocks
    for b in pages.live_blocks():
        live.setdefault(b // per_page, []).append(b)
    usable = pages.usable_blocks
    sparse = [page for page, on in live.items() if len(on) < per_page]  # a full page neither gives nor takes
    # (a FREE block is never live: PoolMemory releases what holds no KV)
    holes = {page: [b for b in range(page * per_page, min((page + 1) * per_page, usable))
                    if states[b] == FREE] for page in sparse}
    order = sorted(sparse, key=lambda p: (len(live[p]), -p))  # emptiest first; the last pages first
    return _pack(order, live, holes, states, target - (len(live) - len(sparse)))


def _pack(order: Sequence[int], live: dict[int, list[int]], holes: dict[int, list[int]],
          states: bytes | bytearray, target: int) -> Moves:
    """Empty ``order``'s pages from the front into the holes of its pages from the back."""
    moves: Moves = []
    lo, hi = 0, len(order) - 1
    spare = list(holes[order[hi]]) if order else []  # the holes left on page order[hi]
    remaining = len(order)
    while remaining > target and lo < hi:
        blocks = live[order[lo]]
        if any(states[b] not in (IN_USE, CACHED) for b in blocks):  # pinned, the null block
            lo += 1
            continue
        got: list[int] = []
        j, left = hi, list(spare)
        while len(got) < len(blocks):
            take = left[:len(blocks) - len(got)]
            got += take
            left = left[len(take):]
            if len(got) < len(blocks):
                j -= 1
                if j <= lo:
                    break
                left = list(holes[order[j]])
        if len(got) < len(blocks):
            break
        moves += zip(blocks, got, strict=True)
        hi, spare = j, left
        lo += 1
        remaining -= 1
    return moves


@dataclass
class CompactionStats:
    """Counters of a :class:`Compactor`: ``runs`` (compactions that moved blocks), ``moved`` (blocks
    moved), ``released_bytes`` (bytes of the pages given back by them) and ``seconds`` (wall time in
    :meth:`Compactor.compact`, every call counted, those that found nothing to do included)."""

    runs: int = 0
    moved: int = 0
    released_bytes: int = 0
    seconds: float = 0.0


class Compactor:
    """Packs the live blocks of an elastic :class:`~kvpool.requests.kv_manager.KVCacheManager`'s store.

    Args:
        kv: the manager (built with ``memory=``: its ``memory`` is a
            :class:`~kvpool.requests.block_memory.PoolMemory`; a manager without one is left alone).
        copy: copies whole blocks' KV, ``copy([(src, dst), ...])`` (the engine: its cache's
            ``copy_blocks``); None for a store that holds no KV (a replay's page model).
        slack_pages: pages holding live blocks allowed past the packed count before a compaction runs.
    """

    def __init__(self, kv: Any, copy: Callable[[Moves], object] | None = None, *, slack_pages: int = 1
                 ) -> None:
        self.kv, self.copy, self.slack_pages = kv, copy, slack_pages
        self.stats = CompactionStats()

    def due(self) -> bool:
        """Whether the pages holding live blocks pass the packed count by more than ``slack_pages``. O(1)."""
        pages = self._pages()
        per_page = None if pages is None else blocks_per_page(pages)
        if pages is None or per_page is None:
            return False
        return holding_pages(pages) > packed_pages(pages.num_live, per_page) + self.slack_pages

    def compact(self, *, force: bool = False) -> int:
        """Pack the live blocks when :meth:`due` (``force``: whenever a page can be emptied); return the
        blocks moved. With tiers attached, their jobs in flight are completed first."""
        start = time.perf_counter()
        try:
            pages = self._pages()
            if pages is None or not (force or self.due()):
                return 0
            tiers = getattr(self.kv, "tiers", None)
            if tiers is not None:  # no copy in flight names a block by id, no store holds one
                tiers.synchronize()
            moves = plan_moves(pages, self.kv.pool.block_states())
            if moves:
                self._apply(moves, pages)
            return len(moves)
        finally:
            self.stats.seconds += time.perf_counter() - start

    def _apply(self, moves: Moves, pages: BlockPages) -> None:
        """Commit the destinations, copy, move in the pool and the tables, release the sources (the pool
        calls through the request path's pool: a tensor-parallel leader's records them)."""
        pool, memory = self.kv.pool, self.kv.memory
        memory.store.commit_blocks([dst for _, dst in moves])  # on committed pages: nothing new
        if self.copy is not None:
            self.copy(moves)
        for src, dst in moves:
            pool.move_block(src, dst)
        self.kv.coordinator.rename_blocks(dict(moves))
        released = memory.store.release_blocks([src for src, _ in moves])
        order_free_blocks(pool, pages)
        self.stats.runs += 1
        self.stats.moved += len(moves)
        self.stats.released_bytes += released

    def _pages(self) -> BlockPages | None:
        memory = self.kv.memory
        return None if memory is None else memory.pages
