"""Page-aware choices on an elastic pool (issue 32, item 2): which free blocks to hand out, which cached
blocks to evict, so that memory is committed and given back by whole pages.

An elastic store gives a page back to the device only once no live block is on it
(:class:`~kvpool.storage.page_map.BlockPages`). The pool's own orders know nothing of pages: its free
stack hands out the last freed block first, and its eviction policy picks cached blocks by age. Both
scatter live blocks, and a page holding a single live block costs the whole page. Two choices here fix
that, both made only for an elastic pool (a :class:`~kvpool.requests.block_memory.PoolMemory`), off the
pool's hot path:

* **Allocation** (:func:`order_free_blocks`): the free stack is reordered by
  :meth:`BlockPages.placement <kvpool.storage.page_map.BlockPages.placement>` each time blocks are
  emptied, so the pool hands out blocks on committed pages first (the fullest page first), then fills one
  uncommitted page before the next; the ids never handed out come after, ascending (one page after
  another).
* **Eviction** (:func:`page_aware_victims`): when memory must be given back, evict the cached free blocks
  of the pages whose every live block is cached free, the pages with the fewest such blocks first (the
  least prefix cache lost per page freed), ties to the page whose oldest block the policy would evict
  first. An age-only choice (LRU) of as many blocks may free no page at all: kvcached's ``bench_evict``
  (4,096 cached blocks of 16 KiB on 2 MiB pages, 128 a page; every 8th block touched again so that LRU
  spares it; 3,584 evicted) frees 0.03 GB by LRU and 0.88 GB page-aware; ``kvpool bench memory`` runs the
  same shape here.
"""

from __future__ import annotations

from typing import Any

from kvpool.storage.page_map import BlockPages


def freeable_pages(pool: Any, pages: BlockPages) -> list[tuple[int, list[int]]]:
    """The committed pages that evicting cached free blocks would give back: those whose every live block
    is a cached free block of ``pool`` (a :class:`~kvpool.allocators.block_pool.BlockPool`), as ``(page,
    its cached blocks in eviction order)``, cheapest first: fewest blocks, then the page whose first block
    the pool's policy would evict soonest. O(cached free blocks x pages a block touches)."""
    order = pool.evictable_blocks()  # eviction order, next victim first
    on_page: dict[int, list[int]] = {}
    for block in order:
        if pages.is_live(block):
            for page in pages.map.pages_of(block):
                on_page.setdefault(page, []).append(block)
    rank = {b: i for i, b in enumerate(order)}
    whole = [(len(blocks), rank[blocks[0]], page, blocks) for page, blocks in on_page.items()
             if len(blocks) == pages.live_on(page)]
    whole.sort()
    return [(page, blocks) for _, _, page, blocks in whole]


def page_aware_victims(pool: Any, pages: BlockPages, *, count: int | None = None,
                       max_pages: int | None = None) -> list[int]:
    """Cached free blocks of ``pool`` to evict so that whole pages of ``pages`` are given back, in the order
    of :func:`freeable_pages`, up to ``count`` blocks (then, if the freeable pages hold fewer, the other
    cached free blocks in the pool's eviction order, as the policy alone would pick them) or until
    ``max_pages`` pages would be freed. Neither: every block of every freeable page (and no other: evicting
    a block on a page that keeps a used block gives nothing back). Evict them with
    ``pool.evict_blocks``."""
    chosen: dict[int, None] = {}
    for freed, (_, blocks) in enumerate(freeable_pages(pool, pages)):
        if (count is not None and len(chosen) >= count) or (max_pages is not None and freed >= max_pages):
            break
        chosen.update(dict.fromkeys(blocks))
    victims = list(chosen)
    if count is None:
        return victims
    if len(victims) < count:
        victims += [b for b in pool.evictable_blocks() if b not in chosen][:count - len(victims)]
    return victims[:count]


def order_free_blocks(pool: Any, pages: BlockPages) -> None:
    """Reorder ``pool``'s free stack so that it hands out blocks on committed pages first, the fullest page
    first, then one uncommitted page's blocks before the next (:meth:`BlockPages.placement
    <kvpool.storage.page_map.BlockPages.placement>`)."""
    pool.reorder_free(pages.placement)
