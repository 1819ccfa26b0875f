"""The pool aware of pages (issue 32, item 2): blocks handed out on committed pages first, a fresh page filled
before another is committed, and page-aware eviction when memory must be given back.

Pools here sit on a :class:`PageModel` (the pages of a block-major elastic cache, counted without memory)
through the request path's hook :class:`PoolMemory`, so block ``b`` of ``bpb`` bytes is on page
``b * bpb // page``. Expected bytes are counted by hand in the comments; kvcached's own ``bench_evict``
(benchmarks/bench_frag, 4,096 cached blocks of 16 KiB on 2 MiB pages, every 8th touched, 3,584 evicted)
measured 0.03 GB freed by LRU against 0.88 GB page-aware (28 pages x 2 MiB x 16 per-layer K/V pages).
"""

from __future__ import annotations

import pytest

from kvpool.allocators.block_pool import BlockPool
from kvpool.bench.memory_evict import evicted_bytes, eviction_rows
from kvpool.errors import MemoryLimitError
from kvpool.requests import block_memory
from kvpool.requests.block_memory import PoolMemory
from kvpool.requests.page_aware import freeable_pages, page_aware_victims
from kvpool.storage.arena import CountingBackend, PageArena
from kvpool.storage.elastic import ElasticMemory, PageModel
from kvpool.storage.page_map import BlockPages, PageMap, Strip

MiB = 2**20
PAGE = 4096


def model_pool(num_blocks: int = 64, per_page: int = 4, limit: int | None = None
               ) -> tuple[BlockPool, PoolMemory]:
    pool = BlockPool(num_blocks)
    store = PageModel(num_blocks, PAGE // per_page, page_size=PAGE)
    if limit is not None:
        store.pages.arena.set_limit(limit)
    return pool, PoolMemory(store, lambda: pool, None)


def test_kvcached_shape_page_aware_frees_whole_pages_lru_frees_none() -> None:
    # 4,096 blocks of 16 KiB = 32 pages of 128. Every 8th block is touched again, so LRU's 3,584 victims are
    # exactly the cold blocks: each page keeps its 16 hot blocks and no page is freed (0 B). Page-aware
    # eviction takes 28 whole pages (28 x 128 = 3,584 blocks): 28 x 2 MiB = 56 MiB.
    lru, aware = evicted_bytes(8, False), evicted_bytes(8, True)
    assert lru == {"before": 64 * MiB, "after": 64 * MiB, "evicted": 3584}
    assert aware == {"before": 64 * MiB, "after": 4 * 2 * MiB, "evicted": 3584}  # 4 pages left
    freed_aware, freed_lru = aware["before"] - aware["after"], lru["before"] - lru["after"]
    assert freed_aware >= 25 * freed_lru and freed_aware == 56 * MiB


def test_eviction_rows_against_lru_by_hand() -> None:
    # LRU evicts the cold blocks, then the oldest hot ones (lowest ids first). Stride 1: blocks 0-3,583 = 28
    # pages. Stride 2: 2,048 cold + hot 0..3,070 = blocks 0-3,071 all gone: 24 pages. Stride 4: 3,072 cold +
    # 512 hot (0..2,044): blocks 0-2,047: 16 pages. Stride 8: none. Page-aware: 28 pages every time.
    rows = eviction_rows()
    assert [r["freed_lru"] // (2 * MiB) for r in rows] == [28, 24, 16, 0]
    assert [r["freed_page_aware"] // (2 * MiB) for r in rows] == [28, 28, 28, 28]
    assert rows[-1]["ratio"] == float("inf") and rows[2]["ratio"] == pytest.approx(28 / 16)
    assert {r["blocks_per_page"] for r in rows} == {128}


def test_freeable_pages_are_the_pages_with_no_used_block_cheapest_first() -> None:
    pool, memory = model_pool()
    blocks = pool.allocate(12)  # pages 0, 1, 2 (4 blocks each)
    memory.handed_out([blocks])
    pool.cache_blocks(blocks, [f"h{b}" for b in blocks])
    pool.free(blocks[:4] + blocks[8:])  # pages 0 and 2 all cached; page 1 still in use
    pages = memory.pages
    assert [p for p, _ in freeable_pages(pool, pages)] == [0, 2]  # both 4 blocks; page 0's oldest first
    assert page_aware_victims(pool, pages, max_pages=1) == [0, 1, 2, 3]
    assert page_aware_victims(pool, pages) == [0, 1, 2, 3, 8, 9, 10, 11]


def test_blocks_on_committed_pages_are_handed_out_first() -> None:
    # 4 blocks a page. 16 blocks handed out (pages 0-3). A request holding 1, 2, 3 and one holding 4-7 end:
    # page 0 keeps block 0, page 1 is given back. Then 3 blocks: page-aware, 1, 2, 3 (page 0, committed:
    # nothing new, 4 pages); the free stack's own order would hand out 4, 7, 6 (the last freed first) and
    # commit page 1 again (5 pages).
    def run() -> tuple[list[int], int]:
        pool, memory = model_pool()
        pool.allocate(16)
        memory.handed_out([list(range(16))])
        for request in ([1, 2, 3], [5, 6, 7, 4]):
            pool.free(request)
            memory.emptied(request)
        assert memory.store.committed_bytes == 3 * PAGE
        got = pool.allocate(3)
        memory.handed_out([got])
        return got, memory.store.committed_bytes

    assert run() == ([1, 2, 3], 3 * PAGE)
    original = block_memory.order_free_blocks
    block_memory.order_free_blocks = lambda pool, pages: None
    try:
        assert run() == ([4, 7, 6], 4 * PAGE)  # the pool's own order, for comparison
    finally:
        block_memory.order_free_blocks = original


def test_a_fresh_page_is_filled_before_another_is_committed() -> None:
    # Blocks 4-15 freed in the order 15, 4, 11, 8, 5, ...: pages 1-3 all given back. Handing out 4 blocks
    # one at a time must fill one page (the lowest) before another: 4, 5, 6, 7 on page 1, one page committed.
    pool, memory = model_pool()
    pool.allocate(16)
    memory.handed_out([list(range(16))])
    freed = [15, 4, 11, 8, 5, 12, 6, 9, 13, 7, 10, 14]
    pool.free(freed)
    memory.emptied(freed)
    assert memory.store.committed_bytes == PAGE
    got = []
    for _ in range(4):
        got += pool.allocate(1)
        memory.handed_out([got])
    assert got == [4, 5, 6, 7] and memory.store.committed_bytes == 2 * PAGE


def test_a_refused_commit_evicts_only_whole_pages() -> None:
    # Limit 4 pages. Pages 0-3 hold blocks 0-15, all cached but block 1 (in use). A new block needs a fifth
    # page: the commit is refused, then one whole page of cached blocks (page 1: blocks 4-7, the cheapest
    # tie broken by the oldest block) is evicted and the commit goes through; pages 2-3 stay cached, and
    # page 0's cached blocks too (evicting them would free nothing: block 1 keeps the page).
    pool, memory = model_pool(limit=4 * PAGE)
    blocks = pool.allocate(16)
    memory.handed_out([blocks])
    pool.cache_blocks(blocks, [f"h{b}" for b in blocks])
    pool.free([b for b in blocks if b != 1])
    assert pool.num_free_blocks == 48 + 15  # never handed out + cached
    new = pool.allocate(1)  # a fresh id (16, page 4)
    assert new == [16]
    assert memory.handed_out([new])
    assert memory.store.committed_bytes == 4 * PAGE
    assert sorted(pool.evictable_blocks()) == [0, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15]
    memory.check()


def test_a_limit_too_small_for_one_page_is_still_refused() -> None:
    pool, memory = model_pool(limit=PAGE)
    blocks = pool.allocate(5)  # pages 0 and 1: two pages past a one-page limit
    assert not memory.handed_out([blocks]) and memory.refused == 1
    assert memory.store.committed_bytes == 0
    with pytest.raises(MemoryLimitError):
        memory.store.commit_blocks(blocks)


def test_blocks_straddling_pages_free_a_page_only_with_both_neighbours() -> None:
    # Blocks of 3 KiB on 4 KiB pages: block 1 is bytes 3-6 KiB (pages 0 and 1). Page 0 holds blocks 0, 1.
    arena = PageArena(8 * 3072, page_size=PAGE, backend=CountingBackend)
    pages = BlockPages(arena, PageMap([Strip(0, 3072, 3072)], 8, PAGE))
    pool = BlockPool(8)
    store = ElasticMemory()
    store.pages = pages
    memory = PoolMemory(store, lambda: pool, None)
    blocks = pool.allocate(4)  # bytes 0-12 KiB: pages 0, 1, 2
    memory.handed_out([blocks])
    pool.cache_blocks(blocks, ["a", "b", "c", "d"])
    pool.free([0, 1])  # page 0: blocks 0, 1 both cached; page 1: blocks 1, 2 (2 in use)
    assert [p for p, _ in freeable_pages(pool, pages)] == [0]
    assert memory.shrink() == PAGE and sorted(pages.live_blocks()) == [2, 3]




def test_a_refused_commit_gives_the_reserve_back_before_evicting() -> None:
    # Limit 4 pages, a reserve of 1. Blocks 0-11 cached (pages 0-2); blocks 12-15 held no hash and were
    # emptied: page 3 stays committed as the reserve (4 pages). Committing block 16 (page 4) is refused,
    # then the reserve's page is given back and the commit goes through, nothing evicted. A second block on
    # page 5 then needs a cached page evicted: page 0 (blocks 0-3, the oldest), pages 1-2 stay cached.
    pool = BlockPool(64)
    store = PageModel(64, PAGE // 4, page_size=PAGE, reserve_pages=1)
    store.pages.arena.set_limit(4 * PAGE)
    memory = PoolMemory(store, lambda: pool, None)
    blocks = pool.allocate(16)
    memory.handed_out([blocks])
    pool.cache_blocks(blocks[:12], [f"h{b}" for b in blocks[:12]])
    pool.free(blocks)
    memory.emptied(blocks[12:])
    assert store.committed_bytes == 4 * PAGE and store.pages.num_reserve == 1
    assert memory.handed_out([[16]])
    assert store.committed_bytes == 4 * PAGE and len(pool.evictable_blocks()) == 12
    assert memory.handed_out([[20]])
    assert store.committed_bytes == 4 * PAGE
    assert sorted(pool.evictable_blocks()) == list(range(4, 12)) and memory.refused == 0
