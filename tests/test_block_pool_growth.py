"""Bookkeeping that grows with the blocks handed out: the prefix index against a dict model, the per-block
arrays in chunks, and the bytes a pool takes following the blocks it holds (tracemalloc: the vectors'
buffers are Python allocations, counted the same compiled or interpreted)."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from kvpool import BlockPool, OutOfBlocksError
from kvpool.allocators.arrays import GROWTH_CHUNK, next_capacity
from kvpool.allocators.policies import POLICIES, make_policy
from kvpool.allocators.prefix_index import NO_HASH, PrefixIndex


def _hash(rng: random.Random, kind: str) -> object:
    """A hash from a small universe (so holders collide and leave often) of one kind."""
    v = rng.randrange(40)
    return {"int": v * 1_000_003 - 20, "bytes": v.to_bytes(16, "big"), "tuple": (1, v),
            "edge": (NO_HASH, NO_HASH + 1, -1, 0, 2**63 - 1, 2**63, -(2**64), -(2**63), True, 1.0)[v % 10]
            }[kind]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["int", "bytes", "tuple", "edge"])
def test_prefix_index_answers_as_a_dict_of_holders_in_publish_order(seed: int, kind: str) -> None:
    # The model: hash -> its holders in publish order (lookups find the first); block -> hash. An int hash
    # equals only int hashes (True and 1.0 are their own hashes here: the index's rule, not Python's).
    rng, n = random.Random(seed), 300
    index, holders, held = PrefixIndex(), {}, {}
    index.grow(n)

    def key(h: object) -> tuple[str, object]:
        return ("int" if type(h) is int else "other", h)

    for _ in range(4000):
        b = rng.randrange(n)
        if b in held:  # the block's hash leaves it
            h = held.pop(b)
            holders[key(h)].remove(b)
            assert index.remove(b) == (not holders[key(h)])
            if not holders[key(h)]:
                del holders[key(h)]
        else:
            h = _hash(rng, kind)
            entered = key(h) not in holders
            assert index.publish(b, h) == entered
            holders.setdefault(key(h), []).append(b)
            held[b] = h
        probe = _hash(rng, kind)
        assert index.find(probe) == holders.get(key(probe), [-1])[0]
    assert index.problems() == ""
    assert len(index) == len(holders) and index.num_holders == len(held)
    for b in range(n):
        h = index.hash_of(b)
        assert (b in held) == index.holds(b) and (h is None if b not in held else key(h) == key(held[b]))
    assert index.first_holders() == sorted(blocks[0] for blocks in holders.values())
    index.clear()
    assert (len(index), index.num_holders, index.problems()) == (0, 0, "")
    assert not any(index.holds(b) for b in range(n))


def test_prefix_index_survives_resizes_and_clustered_keys() -> None:
    # 100,000 int keys in strides that share their low bits (multiples of 2**20, from 2**20) and 100,000
    # consecutive ids: the table doubles from 8 slots to 524,288 (200,000 > 3/4 of 262,144) and every key is
    # still found; removing every other one (backward shifts through clusters) leaves the rest findable
    index = PrefixIndex()
    index.grow(200_000)
    keys = [i << 20 for i in range(1, 100_001)] + list(range(100_000))
    for b, k in enumerate(keys):
        assert index.publish(b, k)
    assert len(index._slots) == 524_288
    for b in range(0, 200_000, 2):
        assert index.remove(b)
    assert all(index.find(k) == (b if b % 2 else -1) for b, k in enumerate(keys))
    assert index.problems() == ""


def test_next_capacity_grows_by_a_chunk_or_an_eighth_up_to_the_pool() -> None:
    # by hand: from 16,384, one more id grows by a chunk (16,384); from 1,000,000 by an eighth (125,000);
    # a call needing more than that gets what it needs; never past the pool
    assert next_capacity(16_384, 16_385, 10**9) == 32_768
    assert next_capacity(1_000_000, 1_000_001, 10**9) == 1_125_000
    assert next_capacity(1_000_000, 2_000_000, 10**9) == 2_000_000
    assert next_capacity(1_000_000, 1_000_001, 1_000_010) == 1_000_010
    assert next_capacity(3, 4, 9, chunk=2) == 5


@pytest.fixture
def roomy_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 GiB available, whatever the machine has free now: the 300,000,000-block pools below (8.94 GiB with
    every block in use) pass the memory check on a busy machine too."""
    psutil = pytest.importorskip("psutil")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 64 << 30})())


@pytest.mark.usefixtures("roomy_machine")
def test_a_huge_pool_takes_what_it_holds() -> None:
    # 300,000,000 blocks: the arrays cover one chunk (16,384 ids) until more are handed out; 10 requests
    # of 1,000 blocks each (cached, freed) cover 10,000 ids: no growth
    pool = BlockPool(300_000_000)
    assert (pool.capacity, pool.high_water_mark) == (GROWTH_CHUNK, 0)
    for r in range(10):
        blocks = pool.allocate(1000)
        pool.cache_blocks(blocks, [r * 1000 + i for i in range(1000)])
        pool.free(blocks[::-1])
    assert (pool.capacity, pool.high_water_mark, pool.num_cached_blocks) == (GROWTH_CHUNK, 10_000, 10_000)
    pool.check_integrity()
    # 20,000 more: ids never handed out go before cached ones (10,000..29,999); the arrays grow by a chunk
    pool.free(pool.allocate(20_000))
    assert (pool.capacity, pool.high_water_mark, pool.num_evictable_blocks) == (32_768, 30_000, 10_000)
    assert pool.block_hash(299_999_999) is None and pool.ref_count(299_999_999) == 0
    pool.check_integrity()


def _traced_bytes(build) -> tuple[int, object]:
    """Bytes held after ``build()`` (the result kept alive), by tracemalloc."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = build()
        return tracemalloc.get_traced_memory()[0] - before, kept
    finally:
        tracemalloc.stop()


def _fill(num_blocks: int, held: int) -> BlockPool:
    """A pool of ``num_blocks`` that has handed out ``held`` blocks, each published under an int hash and
    freed: all cached (the unbounded replay's end state)."""
    pool = BlockPool(num_blocks)
    for start in range(0, held, 1000):
        blocks = pool.allocate(1000)
        pool.cache_blocks(blocks, range(start * 7, (start + 1000) * 7, 7))
        pool.free(blocks[::-1])
    return pool


@pytest.mark.usefixtures("roomy_machine")
def test_bookkeeping_bytes_follow_the_blocks_held_not_the_pool_size() -> None:
    # The same 200,000 cached blocks in a pool of 250,000 and of 300,000,000: the bytes are the same
    # (the arrays follow the 200,000 ids handed out), at most 40 per block held: ref count 4 + hash key 8
    # + LRU position 4 + log entry 4 + index slot 4 at 200,000 / 262,144 = 5.2, and a growth margin
    small, _ = _traced_bytes(lambda: _fill(250_000, 200_000))
    huge, pool = _traced_bytes(lambda: _fill(300_000_000, 200_000))
    assert pool.num_cached_blocks == 200_000
    assert abs(huge - small) < 0.05 * small
    assert huge / 200_000 <= 40, huge / 200_000
    empty, _ = _traced_bytes(lambda: BlockPool(300_000_000))
    assert empty < 16_384 * 40  # one chunk of ids, whatever the pool's size


def _requests_log(name: str, chunk: int) -> list[object]:
    """A seeded run of requests (conversations of int hash chains, each request announced waiting one step
    before it is admitted, freed later with a priority) on a 64-block pool whose arrays grow by ``chunk``
    ids: what it handed out, its evictions and its eviction order after every step."""
    rng, log, live = random.Random(7), [], []
    pool = BlockPool(64, policy=make_policy(name, clock=lambda: 0.0), growth_chunk=chunk)
    nxt = [c * 100 + i for c in [rng.randrange(8)] for i in range(rng.randrange(1, 10))]
    pool.waiting(nxt, 1)
    for _ in range(700):
        if live and rng.random() < 0.45:
            blocks, priority = live.pop(rng.randrange(len(live)))
            pool.free(blocks[::-1], priority)
        else:
            hashes, nxt = nxt, [c * 100 + i for c in [rng.randrange(8)] for i in range(rng.randrange(1, 10))]
            pool.waiting(nxt, 1)
            pool.waiting(hashes, -1)
            hit = pool.lookup(hashes)
            pool.touch(hit)
            try:
                new = pool.allocate(len(hashes) - len(hit))
            except OutOfBlocksError:
                pool.free(hit[::-1])
                new = []
            else:
                pool.cache_blocks(new, hashes[len(hit):])
                live.append((hit + new, rng.randrange(3)))
            log.append((hit, new))
        log.append((pool.evictable_blocks(), pool.stats.evictions))
    pool.check_integrity()
    assert pool.stats.evictions > 50  # the pool was under pressure
    return log


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_evicts_the_same_whether_its_state_grows_or_not(name: str) -> None:
    # The reference: the same requests on a pool whose arrays, and its policy's, cover every id from the
    # start (growth chunk = the pool); pools growing 1 and 3 ids at a time must hand out, hit and evict the
    # same blocks in the same order at every step
    whole = _requests_log(name, 64)
    assert _requests_log(name, 1) == whole
    assert _requests_log(name, 3) == whole
