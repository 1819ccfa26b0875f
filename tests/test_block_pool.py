"""Pinned behaviour of BlockPool: eviction order, revival, stale hashes, admission, errors, integrity.

Expected values are worked out by hand in each test's comments (which block goes where, and why).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool import (
    BlockPool,
    DoubleFreeError,
    InsufficientMemoryError,
    IntegrityError,
    InvalidArgumentError,
    InvalidIdError,
    KVPoolError,
    OutOfBlocksError,
)
from kvpool.allocators import BlockPoolStats


def snapshot(pool: BlockPool) -> tuple:
    """Everything observable through the public API (used to prove a failed call changed nothing)."""
    n = pool.num_blocks
    return ([pool.ref_count(b) for b in range(n)], [pool.block_hash(b) for b in range(n)],
            pool.evictable_blocks(), pool.num_free_blocks, pool.num_cached_blocks, pool.stats)


def run_request(pool: BlockPool, hashes: list[str]) -> list[int]:
    """Admit a request whose blocks are all full: reuse its cached prefix, allocate the rest, publish."""
    hit = pool.lookup(hashes)
    pool.touch(hit)
    blocks = hit + pool.allocate(len(hashes) - len(hit))
    pool.cache_blocks(blocks, hashes)
    return blocks


def test_fresh_pool_hands_out_ids_in_order_and_counts() -> None:
    pool = BlockPool(10)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(1) == [3]
    # 4 of 10 used: usage 0.4, 6 free, none cached.
    assert (pool.num_used_blocks, pool.num_free_blocks, pool.num_cached_blocks) == (4, 6, 0)
    assert pool.usage == pytest.approx(0.4)
    assert [pool.ref_count(b) for b in range(5)] == [1, 1, 1, 1, 0]
    pool.check_integrity()


def test_eviction_order_after_two_requests_sharing_three_blocks() -> None:
    pool = BlockPool(10)
    a = run_request(pool, ["p0", "p1", "p2", "a3", "a4"])  # blocks 0..4
    b = run_request(pool, ["p0", "p1", "p2", "b3", "b4"])  # hits 0,1,2 (ref 2) + new blocks 5, 6
    assert a == [0, 1, 2, 3, 4] and b == [0, 1, 2, 5, 6]
    assert [pool.ref_count(i) for i in range(7)] == [2, 2, 2, 1, 1, 1, 1]
    pool.free(reversed(a))  # 4, 3 reach 0 and join the LRU; 2, 1, 0 drop to ref 1
    pool.free(reversed(b))  # 6, 5 then the shared 2, 1, 0 reach 0, in that order
    assert pool.evictable_blocks() == [4, 3, 6, 5, 2, 1, 0]
    # allocate(5): the 3 uncached blocks 7, 8, 9 first (stack order 7, 8, 9), then evict 4 and 3 (LRU head).
    assert pool.allocate(5) == [7, 8, 9, 4, 3]
    assert pool.stats.evictions == 2
    assert pool.lookup(["p0", "p1", "p2", "a3", "a4"]) == [0, 1, 2]  # a3 left the index with block 3
    assert pool.lookup(["p0", "p1", "p2", "b3", "b4"]) == [0, 1, 2, 5, 6]
    pool.check_integrity()


def test_hit_after_free_revives_the_same_block_ids() -> None:
    pool = BlockPool(8)
    first = run_request(pool, ["h0", "h1", "h2", "h3"])
    pool.free(reversed(first))
    assert pool.num_evictable_blocks == 4 and pool.num_free_blocks == 8
    hit = pool.lookup(["h0", "h1", "h2", "h3", "h4"])
    assert hit == first == [0, 1, 2, 3]
    assert all(pool.ref_count(b) == 0 for b in hit)  # lookup changes no ref count
    pool.touch(hit)
    assert [pool.ref_count(b) for b in hit] == [1, 1, 1, 1]
    assert [pool.block_hash(b) for b in hit] == ["h0", "h1", "h2", "h3"]  # revived in place, hash kept
    assert pool.num_evictable_blocks == 0 and pool.num_free_blocks == 4
    pool.check_integrity()


def test_stale_hash_never_matches_after_recycling_one_block_1000_times() -> None:
    pool = BlockPool(1)
    for i in range(1000):
        (block,) = pool.allocate(1)
        assert block == 0
        assert pool.lookup([f"h{i - 1}"]) == []  # the previous hash left the index when block 0 was recycled
        pool.cache_blocks([block], [f"h{i}"])
        pool.free([block])
        assert pool.lookup([f"h{i}"]) == [0]
        assert pool.num_cached_blocks <= pool.num_blocks
    assert pool.stats.evictions == 999  # every allocation after the first evicts the one cached block
    pool.check_integrity()


def test_reserve_then_abort_100_times_ends_with_all_blocks_free() -> None:
    pool = BlockPool(10)
    running = run_request(pool, ["r0", "r1"])
    for i in range(100):
        reserved = pool.allocate(4)  # a queued request's reservation
        assert pool.num_free_blocks == 10 - 2 - 4
        pool.cache_blocks(reserved[:1], [f"q{i}"])  # sometimes a block was already written before the abort
        pool.free(reversed(reserved))
    pool.free(reversed(running))
    assert pool.num_free_blocks == 10 and pool.num_used_blocks == 0 and pool.usage == 0.0
    pool.check_integrity()


def test_republishing_the_same_hash_is_a_no_op() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    pool.cache_blocks([0], ["h"])
    pool.cache_blocks([0], ["h"])
    assert pool.num_cached_blocks == 1 and pool.lookup(["h"]) == [0]


def test_lookup_counts_hits_and_misses_in_blocks() -> None:
    pool = BlockPool(4)
    run_request(pool, ["a", "b"])  # its own lookup: 0 hits, 2 misses
    assert pool.lookup(["a", "b", "x", "b"]) == [0, 1]  # stops at the first miss: 2 hits, 2 misses
    stats = pool.stats
    assert (stats.hits, stats.misses) == (2, 4)
    assert stats.hit_rate == pytest.approx(2 / 6)


def test_unpublished_block_never_matches() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    assert pool.lookup(["a"]) == []
    assert pool.num_cached_blocks == 0


def test_shared_in_use_block_survives_one_free() -> None:
    pool = BlockPool(3)
    blocks = run_request(pool, ["s"])
    pool.touch(blocks)  # a second request shares block 0: ref 2
    pool.free(blocks)
    assert pool.ref_count(0) == 1 and pool.num_evictable_blocks == 0
    pool.free(blocks)
    assert pool.ref_count(0) == 0 and pool.evictable_blocks() == [0]


def test_caching_disabled_publishes_nothing() -> None:
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, ["a", "b"])
    assert pool.lookup(["a", "b"]) == [] and pool.num_cached_blocks == 0
    pool.touch(blocks)  # sharing still works without caching
    pool.free(blocks)
    pool.free(reversed(blocks))
    assert pool.num_evictable_blocks == 0 and pool.num_free_blocks == 4
    assert pool.allocate(4) == [0, 1, 2, 3]  # stack pops 0 (freed last), then 1, then the untouched 2, 3
    pool.check_integrity()


# ---- admission ------------------------------------------------------------------------------------------


def test_admission_counts_hits_on_in_use_blocks_as_free() -> None:
    pool = BlockPool(8)
    run_request(pool, ["p0", "p1", "p2", "p3"])  # in use, 4 free left
    # 8 blocks, 4 cached in use: needs 8 - 4 = 4 new blocks, and 4 are free.
    assert pool.num_blocks_to_allocate(["p0", "p1", "p2", "p3"], 8) == 4
    assert pool.can_allocate(["p0", "p1", "p2", "p3"], 8)
    assert not pool.can_allocate(["p0", "p1", "p2", "x"], 8)  # 3 hits: 8 - 3 = 5 > 4
    run_request(pool, ["p0", "p1", "p2", "p3", "n4", "n5", "n6", "n7"])  # and it does fit exactly
    assert pool.num_free_blocks == 0
    pool.check_integrity()


def test_admission_counts_hits_on_cached_free_blocks_as_consuming() -> None:
    pool = BlockPool(8)
    pool.free(reversed(run_request(pool, ["p0", "p1", "p2", "p3"])))  # 8 free, 4 of them cached
    # The 4 hits are free blocks: touching them takes them out of the free set, so all 8 count.
    assert pool.num_blocks_to_allocate(["p0", "p1", "p2", "p3"], 8) == 8
    assert pool.can_allocate(["p0", "p1", "p2", "p3"], 8)
    assert not pool.can_allocate(["p0", "p1", "p2", "p3"], 9)
    assert pool.stats.hits == 0  # admission does not count stats
    run_request(pool, ["p0", "p1", "p2", "p3", "n4", "n5", "n6", "n7"])
    assert pool.num_free_blocks == 0 and pool.stats.evictions == 0
    pool.check_integrity()


def test_admission_rejects_fewer_blocks_than_hashes() -> None:
    with pytest.raises(InvalidArgumentError):
        BlockPool(4).num_blocks_to_allocate(["a", "b"], 1)


# ---- errors are typed and atomic ------------------------------------------------------------------------


@pytest.fixture
def busy_pool() -> BlockPool:
    """10 blocks: 0..3 in use (0 and 1 published), 4, 5 cached free ("c4", "c5"), 6..9 uncached free."""
    pool = BlockPool(10)
    blocks = pool.allocate(6)
    pool.cache_blocks([0, 1, 4, 5], ["h0", "h1", "c4", "c5"])
    pool.free([4, 5])
    assert blocks == [0, 1, 2, 3, 4, 5]
    return pool


BAD_CALLS = [
    ("allocate 7 of 6 free", lambda p: p.allocate(7), OutOfBlocksError),
    ("allocate -1", lambda p: p.allocate(-1), InvalidArgumentError),
    ("allocate 1.0", lambda p: p.allocate(1.0), InvalidArgumentError),
    ("allocate True", lambda p: p.allocate(True), InvalidArgumentError),
    ("free a free block", lambda p: p.free([0, 6]), DoubleFreeError),
    ("free a cached free block", lambda p: p.free([3, 4]), DoubleFreeError),
    ("free out of range", lambda p: p.free([0, 10]), InvalidIdError),
    ("free negative", lambda p: p.free([-1]), InvalidIdError),
    ("free duplicate", lambda p: p.free([2, 2]), InvalidIdError),
    ("free non-int", lambda p: p.free([0, 1.5, 2]), InvalidIdError),
    ("free str", lambda p: p.free(["0"]), InvalidIdError),
    ("touch uncached free", lambda p: p.touch([0, 7]), InvalidIdError),
    ("touch duplicate", lambda p: p.touch([4, 4]), InvalidIdError),
    ("touch out of range", lambda p: p.touch([4, 99]), InvalidIdError),
    ("cache unallocated", lambda p: p.cache_blocks([2, 7], ["x", "y"]), InvalidIdError),
    ("cache cached free", lambda p: p.cache_blocks([2, 4], ["x", "y"]), InvalidIdError),
    ("cache different hash", lambda p: p.cache_blocks([2, 0], ["x", "other"]), InvalidIdError),
    ("cache length mismatch", lambda p: p.cache_blocks([2, 3], ["x"]), InvalidArgumentError),
    ("cache unhashable", lambda p: p.cache_blocks([2, 3], ["x", ["list"]]), InvalidArgumentError),
    ("cache None hash", lambda p: p.cache_blocks([2], [None]), InvalidArgumentError),
    ("cache duplicate id", lambda p: p.cache_blocks([2, 2], ["x", "y"]), InvalidIdError),
    ("lookup unhashable", lambda p: p.lookup(["h0", ["list"]]), InvalidArgumentError),
    ("ref_count out of range", lambda p: p.ref_count(10), InvalidIdError),
    ("evict_blocks out of range", lambda p: p.evict_blocks([0, 10]), InvalidIdError),
    ("evict_blocks duplicate", lambda p: p.evict_blocks([4, 4]), InvalidIdError),
    ("evict_blocks non-int", lambda p: p.evict_blocks([0, "1"]), InvalidIdError),
    ("evict_blocks bool", lambda p: p.evict_blocks([True]), InvalidIdError),
]


@pytest.mark.parametrize(("name", "call", "error"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_call_raises_typed_error_and_changes_nothing(busy_pool: BlockPool, name: str, call,
                                                          error: type[KVPoolError]) -> None:
    before = snapshot(busy_pool)
    with pytest.raises(error):
        call(busy_pool)
    assert issubclass(error, KVPoolError)
    assert snapshot(busy_pool) == before
    busy_pool.check_integrity()
    # and the pool still works: 6 free blocks, uncached 6..9 first, then LRU head 4, 5
    assert sorted(busy_pool.allocate(6)) == [4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("num_blocks", [0, -3, 2.0, True])
def test_bad_pool_size(num_blocks: object) -> None:
    with pytest.raises(InvalidArgumentError):
        BlockPool(num_blocks)  # type: ignore[arg-type]


def test_allocate_zero_and_empty_calls_are_no_ops(busy_pool: BlockPool) -> None:
    before = snapshot(busy_pool)
    assert busy_pool.allocate(0) == []
    busy_pool.free([])
    busy_pool.touch([])
    busy_pool.cache_blocks([], [])
    assert busy_pool.lookup([]) == []
    assert snapshot(busy_pool) == before


# ---- check_integrity catches corruption -----------------------------------------------------------------


CORRUPTIONS = {  # how to break a busy pool -> the invariant check_integrity must name
    "negative ref": (lambda p: p._ref.__setitem__(7, -1), "negative"),
    "id twice in free stack": (lambda p: (p.free([3]), p._free.append(3)), "twice"),
    "lost block": (lambda p: (p.free([3]), p._free.pop()), "!= total"),
    # (the free stack's never-used bottom, ids 6..9, is implicit: listing one of them is a corruption)
    "freed id also never used": (lambda p: p._free.append(p.high_water_mark), "free-stack"),
    "never-used id referenced": (lambda p: p._ref.__setitem__(p.high_water_mark, 1), "never handed out"),
    "evictable but referenced": (lambda p: p._ref.__setitem__(4, 1), "evictable"),
    "hashed block in free stack": (lambda p: p._free.append(4), "free-stack"),
    # the index's slot of "c4" names block 5 (which holds "c5")
    "index names wrong block": (lambda p: p._idx._slots.__setitem__(p._idx._slot_of(4), 5 + 1), "index entr"),
    "hash not indexed": (lambda p: p._idx._hold(2, 12345, 12345, False), "not indexed"),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_check_integrity_detects_corruption(busy_pool: BlockPool, name: str) -> None:
    corrupt, message = CORRUPTIONS[name]
    busy_pool.check_integrity()
    corrupt(busy_pool)
    with pytest.raises(IntegrityError, match=message):
        busy_pool.check_integrity()


def test_ids_may_come_as_tensor_tuple_or_iterator() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(3)  # [0, 1, 2]
    pool.cache_blocks(torch.tensor(blocks), ("a", "b", "c"))
    pool.touch((0, 1))
    pool.free(torch.tensor([2, 1, 0]))  # 2 reaches 0; 1 and 0 drop to ref 1
    assert pool.evictable_blocks() == [2] and pool.ref_count(0) == 1
    pool.free(iter([1, 0]))
    assert pool.evictable_blocks() == [2, 1, 0]
    assert all(type(b) is int for b in pool.allocate(6))
    with pytest.raises(InvalidIdError):
        pool.free(torch.tensor([3, 3]))
    pool.check_integrity()


def test_pool_size_does_not_change_behaviour_at_one_million_blocks() -> None:
    pool = BlockPool(1 << 20)
    assert pool.allocate(2) == [0, 1]
    pool.cache_blocks([0, 1], ["a", "b"])
    pool.free([1, 0])
    assert pool.evictable_blocks() == [1, 0]
    assert pool.num_free_blocks == 1 << 20


# ---- regressions: ids that are not exact ints, non-iterables, a NaN hash ---------------------------------

@pytest.mark.parametrize("bad", [
    [torch.tensor(0), torch.tensor(0)],  # 0-d tensors hash by identity: a repeat must still be caught
    [np.int64(1), 1],                    # the same id twice, once as a numpy int
    [True],                              # a bool is not a block id (True == 1)
    [0, True],
    [np.True_],
    [torch.tensor(True)],
    [1.0],
    torch.tensor([True]),
    torch.tensor(0),                     # a 0-d tensor is one id, not a sequence of them
    np.int64(0),
    torch.tensor([0], device="meta"),    # no values to read
])
def test_ids_must_be_integers_never_bools(bad: list) -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    before = snapshot(pool)
    hashes = ["h"] * (len(bad) if getattr(bad, "ndim", 1) else 1)   # a scalar: one hash
    for call in (pool.free, pool.touch, lambda ids: pool.cache_blocks(ids, hashes)):
        with pytest.raises(InvalidIdError):
            call(bad)
        assert snapshot(pool) == before
    pool.check_integrity()


@pytest.mark.parametrize("wrap", [np.int64, np.int32, torch.tensor,
                                  lambda b: torch.tensor(b, dtype=torch.int16)],
                         ids=["np.int64", "np.int32", "0-d tensor", "0-d int16 tensor"])
def test_numpy_ints_and_0d_tensors_are_ids(wrap) -> None:
    """The rule of kvpool.numeric: an integer scalar of any kind is the id it holds (converted, so the LRU
    and the index see the Python int: the block is evicted and found like any other)."""
    pool = BlockPool(4)
    blocks = pool.allocate(2)                      # [0, 1]
    pool.cache_blocks([wrap(0), wrap(1)], ["a", "b"])
    pool.touch([wrap(1)])
    assert pool.ref_count(wrap(1)) == 2 and pool.block_hash(wrap(0)) == "a"
    pool.free([wrap(1), wrap(0)])
    pool.free([wrap(1)])
    assert pool.evictable_blocks() == [0, 1]       # by hand: 0 reached ref 0 first, then 1
    assert pool.lookup(["a", "b"]) == blocks
    pool.check_integrity()


@pytest.mark.parametrize("count", [torch.tensor([1, 2]), torch.tensor([1]), True, 1.0, "1", None])
def test_allocate_rejects_what_is_not_one_integer_count(count) -> None:
    pool = BlockPool(4)
    with pytest.raises(InvalidArgumentError):
        pool.allocate(count)
    assert pool.num_free_blocks == 4
    with pytest.raises(InvalidArgumentError):
        pool.num_blocks_to_allocate([], count)


def test_allocate_takes_a_0d_tensor_count() -> None:
    assert BlockPool(4).allocate(torch.tensor(2)) == [0, 1]


@pytest.mark.parametrize("n", [2**63, 2**62, 10**19, 2**31 - 1])
def test_a_pool_past_32_bit_block_ids_is_a_typed_error(n: int) -> None:
    with pytest.raises(InvalidArgumentError, match="past the largest pool, 2,147,483,646 blocks"):
        BlockPool(n)


def test_a_pool_too_large_for_memory_is_refused_naming_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 GiB available; 100M blocks x 32 B = 3.2e9 B = 2.98 GiB needed once every block is in use
    psutil = pytest.importorskip("psutil")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 1 << 30})())
    with pytest.raises(InsufficientMemoryError,
                       match=r"100,000,000 blocks needs 2\.98 GiB .* 1\.00 GiB available"):
        BlockPool(100_000_000)
    assert BlockPool(30_000_000).num_blocks == 30_000_000  # 0.89 GiB: fits


def test_free_of_a_tensor_still_works() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(torch.tensor(blocks[::-1]))
    assert pool.num_used_blocks == 0
    pool.check_integrity()


@pytest.mark.parametrize("call", ["free", "touch", "lookup"])
def test_a_non_iterable_argument_is_an_invalid_argument(call: str) -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(InvalidArgumentError):
        getattr(pool, call)(None)
    assert snapshot(pool) == before


def test_a_nan_hash_keeps_integrity() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    nan = float("nan")
    pool.cache_blocks([block], [nan])
    pool.cache_blocks([block], [nan])  # republishing the hash the block holds is a no-op
    pool.check_integrity()
    assert pool.lookup([nan]) == [block]


# ---- vLLM parity: reset_prefix_cache, evict_blocks, the null block ---------------------------------------
# Expected behaviour from vLLM's BlockPool (vllm/v1/core/block_pool.py): reset_prefix_cache refuses while a
# block other than the null block is in use; evict_blocks drops hashes of in-use and free blocks alike and
# leaves ref counts alone; the null block (id 0) is never handed out and usage excludes it.


def test_reset_prefix_cache_refuses_while_a_block_is_in_use(busy_pool: BlockPool) -> None:
    before = snapshot(busy_pool)
    assert busy_pool.reset_prefix_cache() is False  # blocks 0..3 are in use
    assert snapshot(busy_pool) == before


def test_reset_prefix_cache_drops_every_hash_and_keeps_the_free_order() -> None:
    pool = BlockPool(8)
    a = run_request(pool, ["a0", "a1", "a2"])  # blocks 0, 1, 2, published
    scratch = pool.allocate(2)                  # blocks 3, 4, never published
    pool.free(reversed(a))                      # LRU: 2, 1, 0
    pool.free(scratch)                          # free stack (pop order): 4, 3, then the untouched 5, 6, 7
    pool.lookup(["a0"])                         # 1 hit
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(["a0", "a1", "a2"]) == []  # 3 misses
    assert (pool.num_cached_blocks, pool.num_evictable_blocks, pool.num_free_blocks) == (0, 0, 8)
    assert all(pool.block_hash(b) is None for b in range(8))
    assert pool.stats == BlockPoolStats(hits=1, misses=6, evictions=0)  # counters are cumulative
    pool.check_integrity()
    # Same order as before the reset: the stack (4, 3, 5, 6, 7), then the former LRU head first (2, 1, 0);
    # none of them is an eviction any more.
    assert pool.allocate(8) == [4, 3, 5, 6, 7, 2, 1, 0]
    assert pool.stats.evictions == 0


def test_reset_prefix_cache_on_an_empty_or_uncached_pool_succeeds() -> None:
    assert BlockPool(4).reset_prefix_cache() is True
    assert BlockPool(4, enable_caching=False).reset_prefix_cache() is True
    assert BlockPool(4, reserve_null_block=True).reset_prefix_cache() is True  # the null block: not in use


def test_evict_blocks_unpublishes_an_in_use_block_and_keeps_its_ref_count() -> None:
    pool = BlockPool(8)
    blocks = run_request(pool, ["h0", "h1"])  # 0, 1 in use, published
    pool.evict_blocks({1})
    assert pool.ref_count(1) == 1 and pool.block_hash(1) is None
    assert pool.lookup(["h0", "h1"]) == [0]
    pool.free(reversed(blocks))  # block 1 has no hash now: free stack, not the LRU
    assert pool.evictable_blocks() == [0]
    assert pool.allocate(1) == [1]
    pool.check_integrity()


def test_evict_blocks_turns_cached_free_blocks_into_uncached_free_ones() -> None:
    pool = BlockPool(6)
    pool.free(reversed(run_request(pool, ["h0", "h1", "h2", "h3"])))  # LRU: 3, 2, 1, 0; stack: 4, 5
    pool.evict_blocks([0, 1])
    assert pool.evictable_blocks() == [3, 2]
    assert pool.lookup(["h0"]) == [] and pool.lookup(["h2", "h3"]) == [2, 3]
    assert (pool.num_free_blocks, pool.num_cached_blocks, pool.stats.evictions) == (6, 2, 0)
    # The stack pops 1 and 0 (pushed in that order), then 4, 5; only then the LRU head, 3.
    assert pool.allocate(5) == [1, 0, 4, 5, 3]
    assert pool.stats.evictions == 1
    pool.check_integrity()


def test_evict_blocks_leaves_unhashed_blocks_alone() -> None:
    pool = BlockPool(4)
    pool.allocate(1)  # block 0 in use, no hash; 1..3 free
    before = snapshot(pool)
    pool.evict_blocks([0, 2, 3])
    pool.evict_blocks([])
    assert snapshot(pool) == before
    assert pool.allocate(3) == [1, 2, 3]


def test_null_block_is_never_handed_out_and_usage_excludes_it() -> None:
    pool = BlockPool(11, reserve_null_block=True)  # vLLM: 11 blocks, 10 usable
    assert (pool.null_block, pool.num_blocks, pool.num_free_blocks, pool.num_used_blocks) == (0, 11, 10, 0)
    assert pool.usage == 0.0
    assert pool.allocate(5) == [1, 2, 3, 4, 5]
    assert pool.usage == pytest.approx(0.5)      # 5 / 10
    assert pool.allocate(5) == [6, 7, 8, 9, 10]
    assert pool.usage == pytest.approx(1.0)      # 10 / 10
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    pool.check_integrity()
    assert BlockPool(3).null_block is None and BlockPool(3).allocate(1) == [0]


def test_null_block_is_skipped_by_free_touch_cache_and_evict() -> None:
    pool = BlockPool(6, reserve_null_block=True)
    blocks = pool.allocate(2)                    # [1, 2]
    table = [0, 0, 0] + blocks                   # a sliding-window table: three skipped blocks, then 1, 2
    pool.cache_blocks(table, ["n0", "n1", "n2", "h1", "h2"])
    assert pool.lookup(["n0"]) == [] and pool.lookup(["h1", "h2"]) == [1, 2]
    pool.touch(table)                            # 1, 2 -> ref 2; the null block stays at 0
    pool.touch([0])
    assert [pool.ref_count(b) for b in range(3)] == [0, 2, 2]
    pool.free(reversed(table))
    pool.free([0])
    pool.evict_blocks([0])
    assert [pool.ref_count(b) for b in range(3)] == [0, 1, 1]
    pool.free(reversed(table))                   # 2, 1 reach 0 and join the LRU; the null block never does
    assert pool.evictable_blocks() == [2, 1] and pool.num_free_blocks == 5 and pool.block_hash(0) is None
    assert sorted(pool.allocate(5)) == [1, 2, 3, 4, 5]
    pool.check_integrity()


def test_null_block_is_only_zero_and_other_errors_still_raise() -> None:
    pool = BlockPool(4, reserve_null_block=True)
    pool.allocate(1)  # block 1
    before = snapshot(pool)
    for call, ids, error in [(pool.free, [0, 2], DoubleFreeError), (pool.free, [0, False], InvalidIdError),
                             (pool.touch, [0, 0.0], InvalidIdError), (pool.free, [1, 1, 0], InvalidIdError),
                             (pool.evict_blocks, [0, 4], InvalidIdError)]:
        with pytest.raises(error):
            call(ids)
        assert snapshot(pool) == before
    with pytest.raises(InvalidIdError):
        pool.cache_blocks([0, 2], ["a", "b"])  # block 2 is not allocated
    assert snapshot(pool) == before


@pytest.mark.parametrize("num_blocks", [1, 0])
def test_a_null_block_pool_needs_two_blocks(num_blocks: int) -> None:
    with pytest.raises(InvalidArgumentError):
        BlockPool(num_blocks, reserve_null_block=True)


@pytest.mark.parametrize(("name", "corrupt"), [
    ("null block in the free stack", lambda p: p._free.append(0)),
    ("null block referenced", lambda p: p._ref.__setitem__(0, 1)),
])
def test_check_integrity_guards_the_null_block(name: str, corrupt) -> None:
    pool = BlockPool(4, reserve_null_block=True)
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(IntegrityError, match="null block"):
        pool.check_integrity()


# ---- batched tensor forms --------------------------------------------------------------------------------


def test_allocate_tensor_hands_out_what_allocate_would_as_int32_or_int64():
    pool = BlockPool(8)
    row = pool.allocate_tensor(3)                      # a fresh pool hands out 0, 1, 2 (the stack's top)
    assert row.dtype == torch.int32 and row.tolist() == [0, 1, 2]
    wide = pool.allocate_tensor(2, torch.int64)
    assert wide.dtype == torch.int64 and wide.tolist() == [3, 4]
    for bad in (torch.float32, torch.bool, "int32"):
        with pytest.raises(InvalidArgumentError):
            pool.allocate_tensor(1, bad)
    with pytest.raises(OutOfBlocksError):
        pool.allocate_tensor(4)                        # 3 free
    assert pool.num_free_blocks == 3
    pool.free(row.flip(0))                             # int32 tensors come back as they are
    pool.free(np.array([4, 3], dtype=np.int32))        # numpy int32 too
    assert pool.num_free_blocks == 8
    assert pool.allocate(5) == [3, 4, 0, 1, 2]         # freed last, handed out first
    pool.check_integrity()


def test_block_hashes_of_reads_each_blocks_hash(busy_pool: BlockPool) -> None:
    # busy_pool's docstring: 0, 1 published "h0", "h1"; 4, 5 cached free "c4", "c5"; the rest unhashed
    assert busy_pool.block_hashes_of([5, 0, 2, 0, 9]) == ["c5", "h0", None, "h0", None]
    assert busy_pool.block_hashes_of(()) == []
    for bad in ([10], [-1], [True], ["1"]):
        with pytest.raises(InvalidIdError):
            busy_pool.block_hashes_of(bad)


def test_never_used_ids_come_after_freed_ones_in_order() -> None:
    # the stack's bottom (ids never handed out) is implicit: freed blocks first (last freed first), then the
    # unused ids ascending, then evictions; the same order a materialised stack of every id gives
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2] and pool.allocate(1) == [3]
    pool.free([1, 2])
    assert pool.num_free_blocks == 6
    assert pool.allocate(4) == [2, 1, 4, 5]
    pool.cache_blocks([0], ["h0"])
    pool.free([0])
    assert pool.allocate(1) == [6] and pool.allocate(2) == [7, 0]  # 0 evicted last: it holds a hash
    assert pool.num_free_blocks == 0 and pool.stats.evictions == 1
    pool.check_integrity()
