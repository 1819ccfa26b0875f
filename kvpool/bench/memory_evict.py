"""``kvpool bench memory``'s eviction table: the bytes page-aware eviction gives back against LRU eviction of
as many blocks, in kvcached's ``bench_evict`` shape (``benchmarks/bench_frag`` of kvcached: 4,096 cached
blocks of 16 KiB on 2 MiB pages, 128 blocks a page; every ``stride``-th block touched again, so that an
age-only policy spares it; 3,584 blocks evicted, down to 512).

Each row builds a :class:`~kvpool.allocators.block_pool.BlockPool` (LRU) over a
:class:`~kvpool.storage.elastic.PageModel` (the pages a block-major elastic cache of those blocks commits,
counted without memory) through the request path's hook (:class:`~kvpool.requests.block_memory.PoolMemory`),
twice: once evicting the LRU victims (``pool.evictable_blocks()[:n]``), once the page-aware ones
(:func:`~kvpool.requests.page_aware.page_aware_victims` with ``count=n``). Freed = the committed bytes before
minus after, with no reserve (every emptied page is given back at once).
"""

from __future__ import annotations

from typing import Any

from kvpool.allocators.block_pool import BlockPool
from kvpool.requests.block_memory import PoolMemory
from kvpool.requests.page_aware import page_aware_victims
from kvpool.storage.arena import DEFAULT_PAGE_SIZE
from kvpool.storage.elastic import PageModel

#: kvcached's bench_evict: cached blocks, blocks kept, bytes per block (16 tokens x 8 heads x 64 x fp16)
CACHED, KEEP, BLOCK_BYTES = 4096, 512, 16 * 1024
STRIDES = (1, 2, 4, 8)


def evicted_bytes(stride: int, page_aware: bool, *, cached: int = CACHED, keep: int = KEEP,
                  block_bytes: int = BLOCK_BYTES, page_size: int = DEFAULT_PAGE_SIZE) -> dict[str, int]:
    """Cache ``cached`` blocks, touch every ``stride``-th again, evict ``cached - keep``; return the bytes
    committed before and after and the blocks evicted."""
    pool = BlockPool(cached)
    memory = PoolMemory(PageModel(cached, block_bytes, page_size=page_size), lambda: pool, None)
    blocks = pool.allocate(cached)
    memory.handed_out([blocks])
    pool.cache_blocks(blocks, [f"h{b}" for b in blocks])
    pool.free(blocks)  # block 0 first to evict
    hot = blocks[::stride]
    pool.touch(hot)
    pool.free(hot)  # now the newest: LRU spares them
    before = memory.store.committed_bytes
    n = cached - keep
    victims = page_aware_victims(pool, memory.pages, count=n) if page_aware else pool.evictable_blocks()[:n]
    pool.evict_blocks(victims)
    memory.emptied(victims)
    return {"before": before, "after": memory.store.committed_bytes, "evicted": len(victims)}


def eviction_rows(page_size: int = DEFAULT_PAGE_SIZE) -> list[dict[str, Any]]:
    """One row per stride of :data:`STRIDES`: bytes freed by LRU and page-aware eviction of as many blocks."""
    rows = []
    for stride in STRIDES:
        lru, aware = (evicted_bytes(stride, p, page_size=page_size) for p in (False, True))
        freed_lru, freed_aware = lru["before"] - lru["after"], aware["before"] - aware["after"]
        rows.append({"stride": stride, "evicted": lru["evicted"], "blocks_per_page": page_size // BLOCK_BYTES,
                     "freed_lru": freed_lru, "freed_page_aware": freed_aware,
                     "ratio": freed_aware / freed_lru if freed_lru else float("inf")})
    return rows
