"""BlockPool's eviction listener and get_cached_block: what the offload manager relies on. Expected ids and
hashes are worked out by hand from the LRU order (free appends to the tail, allocate evicts the head)."""

import pytest

from kvpool.allocators.block_pool import BlockPool
from kvpool.errors import InvalidArgumentError


def cached_pool() -> tuple[BlockPool, list]:
    """4 blocks, all cached free: LRU order 2, 1, 0, 3 (freed in that order), hashes h0..h3."""
    pool = BlockPool(4)
    calls: list = []
    ids = pool.allocate(4)
    pool.cache_blocks(ids, ["h0", "h1", "h2", "h3"])
    pool.free([2, 1, 0, 3])
    pool.set_eviction_listener(lambda blocks, hashes: calls.append((list(blocks), list(hashes))))
    return pool, calls


def test_listener_sees_evicted_blocks_in_eviction_order() -> None:
    pool, calls = cached_pool()
    assert pool.allocate(1) == [2]  # the fast path evicts the LRU head
    assert calls == [([2], ["h2"])]
    assert pool.allocate(2) == [1, 0]
    assert calls[-1] == ([1, 0], ["h1", "h0"])
    assert pool.get_cached_block("h1") is None and pool.get_cached_block("h3") == 3
    pool.check_integrity()


def test_no_call_without_eviction_and_none_removes_it() -> None:
    pool, calls = cached_pool()
    pool.touch([3])
    pool.free([3])
    assert calls == []  # touching and freeing evict nothing
    pool.set_eviction_listener(None)
    pool.allocate(4)
    assert calls == [] and pool.num_cached_blocks == 0


def test_uncached_free_blocks_go_first_without_a_call() -> None:
    pool = BlockPool(3)
    calls: list = []
    pool.set_eviction_listener(lambda b, h: calls.append(b))
    (a,) = pool.allocate(1)
    pool.cache_blocks([a], ["x"])
    pool.free([a])
    assert pool.allocate(2) == [1, 2] and calls == []  # the two never-used blocks, no eviction
    assert pool.allocate(1) == [a] and calls == [[a]]


def test_a_second_listener_is_refused() -> None:
    pool, _ = cached_pool()
    with pytest.raises(InvalidArgumentError):
        pool.set_eviction_listener(lambda b, h: None)
    with pytest.raises(InvalidArgumentError):
        BlockPool(2).set_eviction_listener("not callable")  # type: ignore[arg-type]


def test_get_cached_block_counts_no_stats() -> None:
    pool, _ = cached_pool()
    before = pool.stats
    assert pool.get_cached_block("h0") == 0 and pool.get_cached_block("nope") is None
    assert pool.stats == before
    with pytest.raises(InvalidArgumentError):
        pool.get_cached_block(["unhashable"])
    assert BlockPool(2, enable_caching=False).get_cached_block("h0") is None
