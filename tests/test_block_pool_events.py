"""BlockPool's KV event hooks: each change of the prefix index, case by case, and a random run whose event
stream, replayed into a count of holders per hash, equals the pool's blocks after every operation."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("msgspec")

from collections import Counter  # noqa: E402

from kvpool.allocators.block_pool import BlockPool  # noqa: E402
from kvpool.allocators.hashing import LoRAIdentity, block_extra_keys  # noqa: E402
from kvpool.errors import InvalidArgumentError, InvalidIdError  # noqa: E402
from kvpool.events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventSink,
    QueueEventPublisher,
)

H = [bytes([i]) * 16 for i in range(32)]


def recorded(num_blocks: int = 8, block_size: int = 2, **pool_kwargs: object
             ) -> tuple[BlockPool, KVEventSink]:
    sink = KVEventSink(QueueEventPublisher(), block_size=block_size, medium="CPU", group_idx=0)
    return BlockPool(num_blocks, event_sink=sink, **pool_kwargs), sink


def stored(hashes: list, parent: object, tokens: list[int], block_size: int = 2, lora: str | None = None,
           keys: list | None = None) -> BlockStored:
    """The BlockStored a sink of ``recorded()`` must send."""
    return BlockStored(hashes, parent, tokens, block_size, None, "CPU", lora, keys or [None] * len(hashes), 0,
                       "full_attention")


def test_cache_blocks_reports_new_hashes_with_parent_tokens_and_keys() -> None:
    pool, sink = recorded()
    a = pool.allocate(3)
    lora = LoRAIdentity("sql", path="/adapters/sql")
    keys = block_extra_keys(4, 2, lora=lora, cache_salt="t")  # block 0: lora + salt, block 1: lora
    pool.cache_blocks(a[:2], H[:2], token_ids=[1, 2, 3, 4], lora_name=lora.name, extra_keys=keys)
    pool.cache_blocks(a[1:3], H[1:3], parent_hash=H[0], token_ids=[3, 4, 5, 6])  # a[1] already holds H[1]
    pool.cache_blocks(a[:1], H[:1])  # re-publishing: nothing new
    assert sink.take_events() == [
        stored(H[:2], None, [1, 2, 3, 4], lora="sql", keys=[("sql", "t"), ("sql",)]),
        stored([H[2]], H[1], [5, 6]),
    ]


def test_a_hash_held_by_another_block_is_reported_for_this_block_too() -> None:
    pool, sink = recorded()
    a, b = pool.allocate(1), pool.allocate(3)
    pool.cache_blocks(a, [H[1]])
    sink.take_events()
    pool.cache_blocks(b, H[:3], token_ids=[1, 2, 3, 4, 5, 6])  # b[1] is a second holder of H[1]
    assert sink.take_events() == [stored(H[:3], None, [1, 2, 3, 4, 5, 6])]
    assert pool.block_hash(b[1]) == H[1] and pool.get_cached_block(H[1]) == a[0]
    pool.free(a)
    pool.free(b[::-1])  # LRU: a[0], b[2], b[1], b[0]
    pool.allocate(5)  # 4 free blocks, then a[0]: H[1] stays, on b[1]; still one BlockRemoved per block
    assert sink.take_events() == [BlockRemoved([H[1]], "CPU", 0)]
    assert pool.get_cached_block(H[1]) == b[1]


def test_null_block_positions_keep_the_token_slices_in_line() -> None:
    pool, sink = recorded(reserve_null_block=True)
    a = pool.allocate(2)
    pool.cache_blocks([0, a[0], 0, a[1]], H[:4], token_ids=list(range(8)))
    assert sink.take_events() == [stored([H[1]], H[0], [2, 3]), stored([H[3]], H[2], [6, 7])]


def test_eviction_reports_the_hashes_it_drops_in_lru_order() -> None:
    pool, sink = recorded(num_blocks=5)
    a = pool.allocate(5)
    pool.cache_blocks(a, H[:5])
    pool.free(a[::-1])  # LRU: a[4], a[3], a[2], a[1], a[0]
    sink.take_events()
    pool.allocate(1)
    pool.allocate(2)  # a removal right after a removal joins it
    assert sink.take_events() == [BlockRemoved([H[4], H[3], H[2]], "CPU", 0)]
    b = pool.allocate(1)  # evicts H[1]
    pool.cache_blocks(b, [H[9]])
    pool.allocate(1)  # evicts H[0]: a new event, after the store
    assert sink.take_events() == [BlockRemoved([H[1]], "CPU", 0), stored([H[9]], None, []),
                                  BlockRemoved([H[0]], "CPU", 0)]
    assert pool.stats.evictions == 5


def test_evict_blocks_and_reset_are_reported() -> None:
    pool, sink = recorded()
    a = pool.allocate(3)
    pool.cache_blocks(a, H[:3])
    sink.take_events()
    pool.evict_blocks([a[2], a[0]])
    pool.evict_blocks([a[2]])  # holds no hash now: nothing left the index
    assert pool.reset_prefix_cache() is False  # blocks in use: no reset, no event
    pool.free(a[::-1])
    assert pool.reset_prefix_cache() is True
    assert sink.take_events() == [BlockRemoved([H[2], H[0]], "CPU", 0), AllBlocksCleared()]


def test_a_call_the_sink_refuses_changes_nothing() -> None:
    pool, sink = recorded()
    a = pool.allocate(2)
    before = repr(pool)
    with pytest.raises(InvalidArgumentError, match="bytes or an int"):
        pool.cache_blocks(a, [H[0], "not-a-wire-hash"])
    with pytest.raises(InvalidArgumentError, match="4 tokens"):
        pool.cache_blocks(a, H[:2], token_ids=[1, 2, 3])
    with pytest.raises(InvalidIdError):  # the pool's own checks still come first
        pool.cache_blocks([a[0], 99], H[:2])
    assert repr(pool) == before and pool.block_hash(a[0]) is None and sink.pending_events == 0
    pool.check_integrity()


def test_no_sink_and_no_caching_record_nothing() -> None:
    plain = BlockPool(4)
    plain.cache_blocks(plain.allocate(1), ["any hashable works without a sink"])
    assert plain.event_sink is None
    pool, sink = recorded(enable_caching=False)
    pool.cache_blocks(pool.allocate(2), H[:2], token_ids=[1, 2, 3, 4])
    assert sink.pending_events == 0


def test_events_replayed_into_counts_equal_the_blocks_after_every_operation() -> None:
    """5,000 random operations (seeded): allocate (evicting), touch of hits, publish, free, evict_blocks,
    reset; after each, the holders per hash the stream counts (a BlockStored adds one per hash, a
    BlockRemoved takes one) equal the pool's blocks holding each hash."""
    rng = random.Random(13)
    pool, sink = recorded(num_blocks=24, block_size=1)
    cached: Counter = Counter()
    held: list[list[int]] = []
    universe = list(range(40))  # int hashes: a small universe so hits, duplicates and evictions happen

    def apply() -> None:
        for event in sink.take_events():
            if isinstance(event, BlockStored):
                cached.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert all(cached[h] > 0 for h in event.block_hashes), "a hash removed that was not stored"
                cached.subtract(event.block_hashes)
            else:
                cached.clear()

    for _ in range(5000):
        op = rng.random()
        if op < 0.35 and pool.num_free_blocks:
            blocks = pool.allocate(rng.randint(1, min(4, pool.num_free_blocks)))
            hashes = rng.sample(universe, len(blocks))
            pool.cache_blocks(blocks, hashes, token_ids=hashes)
            held.append(blocks)
        elif op < 0.5:
            hit = pool.lookup(rng.sample(universe, 3))
            if hit:
                pool.touch(hit)
                held.append(hit)
        elif op < 0.85 and held:
            pool.free(held.pop(rng.randrange(len(held)))[::-1])
        elif op < 0.97:
            pool.evict_blocks(rng.sample(range(24), rng.randint(0, 3)))
        elif not held:
            assert pool.reset_prefix_cache()
        apply()
        assert +cached == Counter(h for h in map(pool.block_hash, range(24)) if h is not None)
    pool.check_integrity()
    assert pool.num_cached_blocks > len({pool.block_hash(b) for b in range(24)} - {None})  # duplicates


def test_an_eviction_listener_and_the_sink_both_hear_an_eviction() -> None:
    pool, sink = recorded(num_blocks=2)
    heard: list = []
    pool.set_eviction_listener(lambda ids, hashes: heard.append((list(ids), list(hashes))))
    a = pool.allocate(2)
    pool.cache_blocks(a, H[:2])
    pool.free(a[::-1])
    sink.take_events()
    pool.allocate(2)
    assert heard == [([a[1], a[0]], [H[1], H[0]])]
    assert sink.take_events() == [BlockRemoved([H[1], H[0]], "CPU", 0)]


def test_a_hybrid_replay_names_each_group() -> None:
    """A sliding (W 32) and a full group over one pool, 40 trace requests sharing prefixes: the (group,
    hash) pairs the events leave equal the coordinator's pool keys, and each store names its kind."""
    import time

    from kvpool.allocators.groups import split_group_key
    from kvpool.spec import LayerKind, kv_cache_groups
    from kvpool.trace import ReplayConfig
    from kvpool.trace.loaders import TraceRequest
    from kvpool.trace.replayer import Replayer

    groups = kv_cache_groups([LayerKind.SLIDING, LayerKind.FULL], {LayerKind.SLIDING: 32}, 16)
    requests = [TraceRequest(float(i), 600, 40, hash_ids=(i % 3, 10 + i % 5)) for i in range(40)]
    pub = QueueEventPublisher(100_000)
    config = ReplayConfig(block_size=16, groups=groups, timing="trace", num_blocks=200)
    replayer = Replayer(requests, config, event_sink=KVEventSink(pub, block_size=16))
    result = replayer.run(time.perf_counter())
    cached: Counter = Counter()
    for event in (e for batch in pub.drain() for e in batch.events):
        if isinstance(event, BlockStored):
            assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == \
                {0: ("sliding_window", 32), 1: ("full_attention", None)}[event.group_idx]
            cached.update((event.group_idx, h) for h in event.block_hashes)
        else:
            assert isinstance(event, BlockRemoved)
            cached.subtract((event.group_idx, h) for h in event.block_hashes)
    pool = replayer.kv.pool
    keys = [pool.block_hash(b) for b in range(200)]
    assert +cached == Counter(split_group_key(k) for k in keys if k is not None)
    assert {g for g, _ in +cached} == {0, 1} and result.evictions > 0 and result.hit_blocks > 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_call_without_token_ids_reports_none_under_every_path(policy: str) -> None:
    # LRU records through the one-call path, LFU checks first and reports after: the same event either way
    pool, sink = recorded(policy=policy)
    a = pool.allocate(2)
    pool.cache_blocks(a, H[:2])
    pool.cache_blocks(a, H[:2], token_ids=[1, 2, 3, 4])  # already published: nothing new
    assert sink.take_events() == [stored(H[:2], None, [])]


def test_a_sink_attached_to_a_filled_pool_first_announces_each_hash_it_holds() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    pool.cache_blocks(a, H[:3])
    pool.free(a[1:])  # cached and evictable: still in the index
    dup = pool.allocate(1)
    pool.cache_blocks(dup, [H[0]])  # a second holder of H[0]: one hash, one event
    sink = KVEventSink(QueueEventPublisher(), block_size=2, medium="CPU", group_idx=0)
    pool.attach_event_sink(sink)
    assert sink.take_events() == [stored([h], None, []) for h in H[:3]]
    pool.free(pool.allocate(5))  # 5 of the 6 free blocks: one evicted hash leaves (LRU: H[1], freed first)
    assert sink.take_events() == [BlockRemoved([H[1]], "CPU", 0)]


def test_attaching_a_sink_that_cannot_send_a_held_hash_records_nothing() -> None:
    pool = BlockPool(4)
    pool.cache_blocks(pool.allocate(1), [(1, 2)])  # a tuple hash: no int64 wire form
    sink = KVEventSink(QueueEventPublisher(), block_size=2, hash_format="int64")
    with pytest.raises(InvalidArgumentError):
        pool.attach_event_sink(sink)
    assert pool.event_sink is None and sink.pending_events == 0
    other, _ = recorded()
    with pytest.raises(InvalidArgumentError, match="has an event sink already"):
        other.attach_event_sink(KVEventSink(QueueEventPublisher(), block_size=2))


def test_a_manager_with_events_takes_a_host_tier_that_holds_blocks_and_announces_them() -> None:
    from kvpool.requests.kv_manager import KVCacheManager
    from kvpool.spec import KVCacheGroup, LayerKind
    from kvpool.tiers.backend import Namespace
    from kvpool.tiers.host import HostTier

    host = HostTier(8, Namespace("model-test", "none", "hash-only", hash_scheme="trace"))
    assert host.set(H[:2], None) == 2  # filled before the events were on
    sink = KVEventSink(QueueEventPublisher(), block_size=2)
    kv = KVCacheManager((KVCacheGroup(0, LayerKind.FULL, None, (0,), 1, 2),), 16, event_sink=sink)
    kv.attach_tiers([host], asynchronous=False)
    cpu = [e for e in sink.take_events() if e.medium == "CPU"]
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in cpu] == [([H[0]], None, []),
                                                                                 ([H[1]], None, [])]
    assert host.exists(H[:2]) == 2
