"""HostKVCache: bit-exact swap round trips, atomic failures, reference holding, and both tiers' counters
through random sequences of swap, free and allocate (a brute-force model tracks every request's KV)."""

from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.allocators.block_pool import BlockPool
from kvpool.errors import DoubleFreeError, InvalidArgumentError, InvalidIdError, OutOfBlocksError
from kvpool.spec import KVCacheSpec
from kvpool.storage.host import HostKVCache, _InFlight
from kvpool.storage.mla import MLAKVCache
from kvpool.storage.paged import PagedKVCache

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float16, block_size=4)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def randomize(cache, blocks: list[int], gen: torch.Generator) -> None:
    """Random bit patterns (NaN payloads included) into whole blocks, every layer, K and V."""
    shape = list(cache.buffer.shape)
    shape[cache.block_dim] = len(blocks)
    data = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int32).to(torch.int16)
    cache.buffer.view(torch.int16).index_copy_(cache.block_dim, torch.tensor(blocks, dtype=torch.int64), data)


def blocks_of(cache, blocks: list[int]) -> torch.Tensor:
    return bits(cache.buffer.index_select(cache.block_dim, torch.tensor(blocks, dtype=torch.int64)))


def assert_counters(pool: BlockPool) -> None:
    pool.check_integrity()
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_swap_round_trip_is_bit_exact(layout: str) -> None:
    gen = torch.Generator().manual_seed(0)
    device = PagedKVCache(SPEC, 8, layout=layout)
    host = HostKVCache.like(device, 5)
    randomize(device, list(range(8)), gen)
    src = [6, 1, 3]
    want = blocks_of(device, src)
    host_ids = host.swap_out(device, src)
    assert len(host_ids) == 3 and host.num_free_blocks == 2
    assert torch.equal(blocks_of(host.cache, host_ids), want)
    randomize(device, src, gen)  # the device blocks are reused meanwhile
    host.swap_in(device, host_ids, [0, 7, 2])
    assert torch.equal(blocks_of(device, [0, 7, 2]), want)
    host.free(host_ids)
    assert host.num_free_blocks == 5 and host.num_in_flight == 0 and host.poll() == 0


def test_mla_swap_round_trip() -> None:
    mla = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=12, dtype=torch.bfloat16, block_size=2,
                      attention="mla", kv_lora_rank=8, qk_rope_head_dim=4)
    gen = torch.Generator().manual_seed(1)
    device, host = MLAKVCache(mla, 4), HostKVCache(mla, 3)
    assert isinstance(host.cache, MLAKVCache)
    randomize(device, [0, 1, 2, 3], gen)
    want = blocks_of(device, [2, 0])
    host_ids = host.swap_out(device, [2, 0])
    randomize(device, [0, 1, 2, 3], gen)
    host.swap_in(device, host_ids, [1, 3])
    assert torch.equal(blocks_of(device, [1, 3]), want)


def test_source_blocks_reference_released_at_once_on_cpu() -> None:
    device, pool = PagedKVCache(SPEC, 8), BlockPool(8)
    host = HostKVCache.like(device, 4)
    ids = pool.allocate(3)
    host.swap_out(device, ids, pool=pool)
    assert [pool.ref_count(b) for b in ids] == [1, 1, 1]  # touched for the copy, released when it finished
    pool.free(ids[::-1])
    assert pool.num_free_blocks == 8
    assert_counters(pool)


def test_swapping_out_an_eviction_victim_keeps_its_lru_position() -> None:
    """Issue 9, item 4: offloading the LRU head (touch then free moved it to the MRU end) made the pool
    evict another block next. Blocks 0, 1, 2 are published and freed in that order: the LRU is [0, 1, 2]."""
    device, pool = PagedKVCache(SPEC, 3), BlockPool(3)
    host = HostKVCache.like(device, 4)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, ["a", "b", "c"])
    pool.free(blocks)
    assert pool.evictable_blocks() == [0, 1, 2]
    host.swap_out(device, [0], pool=pool)          # the victim goes to the host tier first
    assert pool.evictable_blocks() == [0, 1, 2] and pool.ref_count(0) == 0
    assert pool.allocate(1) == [0]                 # by hand: the head of [0, 1, 2] is evicted
    assert_counters(pool)


def test_sources_in_use_are_held_and_cached_free_ones_are_not() -> None:
    from kvpool.storage.host import _source_states

    pool = BlockPool(4)
    pool.allocate(2)                               # [0, 1] in use
    pool.cache_blocks([1], ["h"])
    cached = pool.allocate(1)                      # [2], published then freed: cached free
    pool.cache_blocks(cached, ["c"])
    pool.free(cached)
    assert _source_states(pool, [0, 2, 1]) == ([0, 1], True)
    assert _source_states(pool, [1]) == ([1], False) and _source_states(None, [3]) == ([], False)
    with pytest.raises(InvalidIdError, match="block 3 is free"):  # free and unhashed: no KV in it
        _source_states(pool, [0, 3])
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 0, 0] and pool.evictable_blocks() == [2]


class FakeEvent:
    """Stands in for a CUDA event: ``done`` flips when the test says the copy finished."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_in_flight_copy_holds_source_blocks_until_completion() -> None:
    """The CUDA bookkeeping without a GPU: a copy in flight keeps its device blocks referenced (a request
    freeing them only defers reuse); poll() releases them once the event reports completion."""
    device, pool = PagedKVCache(SPEC, 4), BlockPool(4)
    host = HostKVCache.like(device, 4)
    ids = pool.allocate(2)
    pool.touch(ids)  # what swap_out does before queueing the copy
    event, finished = FakeEvent(), []
    host._in_flight.append(_InFlight(event, frozenset({0}), lambda: finished.append(1),
                                     lambda: pool.free(ids[::-1])))
    pool.free(ids[::-1])  # the request is preempted meanwhile
    assert pool.num_free_blocks == 2 and pool.allocate(2) == [2, 3]  # its blocks are not handed out
    assert host.poll() == 1 and finished == []
    event.done = True
    assert host.poll() == 0 and finished == [1] and pool.num_free_blocks == 2
    assert_counters(pool)


def test_free_and_swap_in_wait_for_a_copy_landing_in_their_host_blocks() -> None:
    device = PagedKVCache(SPEC, 4)
    host = HostKVCache.like(device, 4)
    host_ids = host.pool.allocate(2)
    events, done = [FakeEvent(), FakeEvent()], []
    host._in_flight.extend([_InFlight(events[0], frozenset({host_ids[0]}), lambda: done.append(0)),
                            _InFlight(events[1], frozenset({host_ids[1]}), lambda: done.append(1))])
    host.swap_in(device, [host_ids[0]], [3])  # must complete copy 0 first, not copy 1
    assert done == [0] and host.num_in_flight == 1
    host.free(host_ids)
    assert done == [0, 1] and host.num_in_flight == 0 and host.num_free_blocks == 4


def test_swap_out_when_host_is_full_changes_nothing() -> None:
    gen = torch.Generator().manual_seed(2)
    device, pool = PagedKVCache(SPEC, 8), BlockPool(8)
    host = HostKVCache.like(device, 2)
    randomize(host.cache, [0, 1], gen)
    before = bits(host.cache.buffer).clone()
    ids = pool.allocate(3)
    with pytest.raises(OutOfBlocksError):
        host.swap_out(device, ids, pool=pool)
    assert [pool.ref_count(b) for b in ids] == [1, 1, 1] and host.num_free_blocks == 2
    assert torch.equal(bits(host.cache.buffer), before)
    assert_counters(pool)
    assert_counters(host.pool)


@pytest.mark.parametrize(("ids", "error"), [([0, 8], InvalidIdError), ([1, 1], InvalidIdError),
                                            ([-1], InvalidIdError), ([0.5], InvalidArgumentError)])
def test_swap_out_bad_ids_changes_nothing(ids: list, error: type) -> None:
    device = PagedKVCache(SPEC, 8)
    host = HostKVCache.like(device, 4)
    with pytest.raises(error):
        host.swap_out(device, ids)
    assert host.num_free_blocks == 4


def test_device_pool_touch_failure_returns_host_blocks() -> None:
    device, pool = PagedKVCache(SPEC, 8), BlockPool(8)
    host = HostKVCache.like(device, 4)
    with pytest.raises(InvalidIdError):  # block 5 is free in the device pool: nothing to hold
        host.swap_out(device, [5], pool=pool)
    assert host.num_free_blocks == 4 and pool.num_free_blocks == 8


@pytest.mark.parametrize("other", [
    PagedKVCache(SPEC, 8, dtype=torch.float32),
    PagedKVCache(SPEC, 8, layout="HND"),
    PagedKVCache(KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=4, dtype=torch.float16, block_size=4), 8),
])
def test_incompatible_device_cache_rejected(other: PagedKVCache) -> None:
    host = HostKVCache(SPEC, 4)
    with pytest.raises(InvalidArgumentError, match="cannot swap"):
        host.swap_out(other, [0])
    assert host.num_free_blocks == 4


def test_bad_swap_in_and_free() -> None:
    device = PagedKVCache(SPEC, 8)
    host = HostKVCache.like(device, 4)
    host_ids = host.swap_out(device, [0, 1])
    with pytest.raises(InvalidIdError, match="not allocated"):
        host.swap_in(device, [host_ids[0], 3], [4, 5])
    with pytest.raises(InvalidArgumentError):
        host.swap_in(device, host_ids, [4])
    with pytest.raises(InvalidIdError):
        host.swap_in(device, host_ids, [4, 4])
    host.free(host_ids)
    with pytest.raises(DoubleFreeError):
        host.free(host_ids)


def test_stats_and_pinning_default() -> None:
    host = HostKVCache(SPEC, 3)
    stats = host.stats()
    assert stats["pinned"] == torch.cuda.is_available() and stats["free_blocks"] == 3
    assert stats["nbytes"] == 3 * SPEC.bytes_per_block


OPS = st.lists(st.tuples(st.sampled_from(["new", "swap_out", "swap_in", "finish"]), st.integers(1, 4),
                         st.integers(0, 10**6)), max_size=40)


@settings(max_examples=60)
@given(OPS)
def test_random_swap_sequences_keep_both_tiers_consistent(ops: list[tuple[str, int, int]]) -> None:
    """Requests come, swap out, swap back in and finish in random order; a model holds each request's KV
    bits. After every step both pools pass check_integrity, free + used == total, used equals what the model
    says is resident in that tier, and every request's KV reads back bit for bit."""
    gen = torch.Generator().manual_seed(3)
    device, pool = PagedKVCache(SPEC, 8), BlockPool(8)
    host = HostKVCache.like(device, 6)
    resident: deque[tuple[list[int], torch.Tensor]] = deque()  # (device blocks, their bits)
    swapped: deque[tuple[list[int], torch.Tensor]] = deque()  # (host blocks, their bits)
    for op, n, pick in ops:
        if op == "new" and pool.num_free_blocks >= n:
            ids = pool.allocate(n)
            randomize(device, ids, gen)
            resident.append((ids, blocks_of(device, ids)))
        elif op == "swap_out" and resident:
            i = pick % len(resident)
            ids, data = resident[i]
            if host.num_free_blocks < len(ids):
                with pytest.raises(OutOfBlocksError):
                    host.swap_out(device, ids, pool=pool)
            else:
                host_ids = host.swap_out(device, ids, pool=pool)
                pool.free(ids[::-1])
                randomize(device, ids, gen)  # freed device memory gets overwritten
                del resident[i]
                swapped.append((host_ids, data))
        elif op == "swap_in" and swapped:
            i = pick % len(swapped)
            host_ids, data = swapped[i]
            if pool.num_free_blocks >= len(host_ids):
                ids = pool.allocate(len(host_ids))
                host.swap_in(device, host_ids, ids)
                host.free(host_ids)
                del swapped[i]
                resident.append((ids, data))
        elif op == "finish" and resident:
            i = pick % len(resident)
            pool.free(resident[i][0][::-1])
            del resident[i]
        for tier in (pool, host.pool):
            assert_counters(tier)
        assert pool.num_used_blocks == sum(len(ids) for ids, _ in resident)
        assert host.pool.num_used_blocks == sum(len(ids) for ids, _ in swapped)
        for ids, data in resident:
            assert torch.equal(blocks_of(device, ids), data)
        for ids, data in swapped:
            assert torch.equal(blocks_of(host.cache, ids), data)


def test_free_takes_a_tensor_and_rejects_a_repeat() -> None:
    host = HostKVCache(SPEC, 4)
    host_ids = host.pool.allocate(2)
    with pytest.raises(InvalidIdError):
        host.free(torch.tensor([host_ids[0], host_ids[0]]))  # would drive a ref count below zero
    assert host.num_free_blocks == 2
    host.free(torch.tensor(host_ids))
    assert host.num_free_blocks == 4
    host.pool.check_integrity()
