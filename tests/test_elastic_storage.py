"""The stores on a page arena (``elastic=``): the same KV as a fixed cache given the same calls, views that
never move, memory that follows the live blocks, sleep and wake, the host tier, and bad input.

The reference for every value is a fixed (``elastic=False``) cache given the same stores: an elastic cache
must read exactly what it reads, for every block that is live.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from kvpool.allocators.block_pool import BlockPool
from kvpool.errors import AsleepError, ConfigError, DoubleFreeError, MemoryLimitError
from kvpool.spec import KVCacheSpec
from kvpool.spec.state import RecurrentKind, RecurrentStateSpec
from kvpool.storage.arena import ElasticConfig, MemoryBudget
from kvpool.storage.host import HostKVCache
from kvpool.storage.mla import MLAKVCache
from kvpool.storage.paged import PagedKVCache, slot_mapping
from kvpool.storage.state import RecurrentStateCache
from kvpool.tiers.backend import Namespace
from kvpool.tiers.host import HostTier

PAGE = 16384
CFG = ElasticConfig(page_size=PAGE)
MiB = 2**20
# 2 x 2 layers x 16 x 2 x 64 x fp16 = 16 KiB per block: one block per page block-major
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, block_size=16)


def views(cache: PagedKVCache) -> list[int]:
    return [cache.k_cache(layer).data_ptr() for layer in range(cache.num_layers)] + [
        cache.v_cache(layer).data_ptr() for layer in range(cache.num_layers)]


def store_tokens(caches: list[PagedKVCache], blocks: list[int], seed: int) -> None:
    """Write every slot of ``blocks`` in every layer of each cache, the same values in each."""
    gen = torch.Generator().manual_seed(seed)
    slots = slot_mapping(blocks, range(len(blocks) * SPEC.block_size), SPEC.block_size)
    for layer in range(SPEC.num_layers):
        k = torch.randn(len(slots), 2, 64, generator=gen).half()
        v = torch.randn(len(slots), 2, 64, generator=gen).half()
        for cache in caches:
            cache.store_kv(k, v, slots, layer)


def same_kv(a: PagedKVCache, b: PagedKVCache, blocks: list[int]) -> bool:
    n = len(blocks) * SPEC.block_size
    return all(torch.equal(x, y) for layer in range(SPEC.num_layers)
               for x, y in zip(a.gather(layer, blocks, n), b.gather(layer, blocks, n), strict=True))


@pytest.mark.parametrize("packed", [True, False])
def test_an_elastic_cache_reads_what_a_fixed_one_reads_and_never_moves(packed: bool) -> None:
    fixed = PagedKVCache(SPEC, 64)
    cache = PagedKVCache(SPEC, 64, elastic=CFG, packed=packed)
    assert cache.packed is packed and cache.committed_bytes == 0
    addresses = views(cache)
    cache.commit_blocks(range(8))
    store_tokens([fixed, cache], list(range(8)), seed=1)
    assert same_kv(fixed, cache, list(range(8)))
    cache.release_blocks([2, 3, 5])
    assert same_kv(fixed, cache, [0, 1, 4, 6, 7])  # the live blocks kept their KV
    cache.commit_blocks([40, 41, 2])
    store_tokens([fixed, cache], [40, 41, 2], seed=2)
    assert same_kv(fixed, cache, [0, 1, 2, 4, 6, 7, 40, 41])
    for c in (fixed, cache):
        c.copy_blocks([(40, 6)])
    assert same_kv(fixed, cache, [6, 40])
    assert views(cache) == addresses  # the tensor and every view kept their address
    cache.pages.check_integrity()


def test_block_major_memory_follows_live_blocks_page_by_page() -> None:
    """16 KiB blocks on 16 KiB pages: one page per block, so committed bytes = live blocks x 16 KiB."""
    cache = PagedKVCache(SPEC, 64, elastic=CFG)
    assert cache.bytes_per_block == PAGE and cache.pages.map.unit_bytes() == PAGE
    cache.commit_blocks([0, 9, 33])
    assert cache.committed_bytes == 3 * PAGE
    cache.release_blocks([9])
    assert cache.committed_bytes == 2 * PAGE
    cache.commit_blocks([9])
    assert all(int(x.abs().max()) == 0 for x in cache.gather(1, [9], 16))  # a fresh page reads 0


def test_strips_commit_a_page_in_every_strip() -> None:
    """[2, L, N, ...]: a strip block is 16 x 2 x 64 x 2 B = 4 KiB, 4 to a 16 KiB page, 2 x 2 strips: block 0
    commits 4 pages (64 KiB) that also hold blocks 1-3."""
    cache = PagedKVCache(SPEC, 64, elastic=CFG, packed=False)
    assert cache.commit_blocks([0]) == 4 * PAGE
    assert cache.commit_blocks([1, 2, 3]) == 0
    assert cache.release_blocks([0, 1, 2]) == 0 and cache.release_blocks([3]) == 4 * PAGE


def test_sleep_gives_everything_back_and_wake_reads_zero_at_the_same_addresses() -> None:
    cache = PagedKVCache(SPEC, 64, elastic=CFG)
    addresses = views(cache)
    cache.commit_blocks(range(6))
    store_tokens([cache], list(range(6)), seed=3)
    assert cache.sleep() == 6 * PAGE and cache.committed_bytes == 0
    for call in (lambda: cache.commit_blocks([10]), lambda: cache.release_blocks([1]), cache.trim):
        with pytest.raises(AsleepError):
            call()
    assert cache.wake() == 6 * PAGE and views(cache) == addresses
    k, v = cache.gather(0, list(range(6)), 96)
    assert int(k.abs().max()) == 0 and int(v.abs().max()) == 0
    store_tokens([cache], list(range(6)), seed=4)  # and it works as before
    cache.pages.check_integrity()


def test_limits_refuse_and_change_nothing() -> None:
    budget = MemoryBudget(5 * PAGE)
    a = PagedKVCache(SPEC, 64, elastic=ElasticConfig(page_size=PAGE, budget=budget))
    b = PagedKVCache(SPEC, 64, elastic=ElasticConfig(page_size=PAGE, budget=budget, limit_bytes=2 * PAGE))
    a.commit_blocks(range(3))
    with pytest.raises(MemoryLimitError):
        b.commit_blocks(range(3))  # its own limit: 2 pages
    b.commit_blocks(range(2))
    with pytest.raises(MemoryLimitError):
        a.commit_blocks([3])  # the shared budget: 5 pages in all
    assert a.pages.live_blocks() == [0, 1, 2] and budget.committed_bytes == 5 * PAGE
    b.release_blocks([0, 1])
    a.commit_blocks([3, 4])
    assert budget.committed_bytes == 5 * PAGE


def test_mla_and_state_caches_on_an_arena() -> None:
    mla_spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=40, dtype=torch.bfloat16, block_size=8,
                           attention="mla", kv_lora_rank=32, qk_rope_head_dim=8)
    fixed, mla = MLAKVCache(mla_spec, 32), MLAKVCache(mla_spec, 32, elastic=ElasticConfig(page_size=4096))
    mla.commit_blocks([3, 4])
    gen = torch.Generator().manual_seed(5)
    c_kv, k_pe = torch.randn(16, 32, generator=gen).bfloat16(), torch.randn(16, 8, generator=gen).bfloat16()
    slots = slot_mapping([3, 4], range(16), 8)
    for cache in (fixed, mla):
        cache.store_latent(c_kv, k_pe, slots, 1)
    assert torch.equal(mla.gather(1, [3, 4], 16), fixed.gather(1, [3, 4], 16))
    spec = RecurrentStateSpec(RecurrentKind.GATED_DELTA_NET, (0, 1, 3), (64, 3), (4, 8, 8), torch.bfloat16,
                              torch.float32, 4)
    state = RecurrentStateCache(spec, 9, elastic=ElasticConfig(page_size=4096))
    assert state.committed_bytes == 0
    view = state.ssm_view(3, 2)
    state.commit_blocks([2, 5])
    view.fill_(2.0)
    state.copy_slots([(2, 5)])
    assert torch.equal(state.ssm_view(3, 5), view) and view.data_ptr() == state.ssm_view(3, 2).data_ptr()
    state.release_blocks([2])  # 1 KiB of SSM state per slot and layer: slot 5 shares slot 2's pages
    assert float(state.ssm_view(3, 2).min()) == 2.0
    state.release_blocks([5])
    assert state.committed_bytes == 0
    state.commit_blocks([2])
    assert int(state.ssm_view(3, 2).abs().max()) == 0


def test_host_cache_commits_on_allocate_and_gives_back_on_free() -> None:
    device = PagedKVCache(SPEC, 16)
    pool = BlockPool(16)
    blocks = pool.allocate(4)
    store_tokens([device], blocks, seed=6)
    host = HostKVCache.like(device, 32, elastic=CFG)
    assert not host.cache.packed and host.stats()["elastic"]["committed_bytes"] == 0
    host_ids = host.swap_out(device, blocks, pool=pool)
    committed = host.cache.committed_bytes
    assert committed > 0
    pool.free(blocks[::-1])
    back = pool.allocate(4)
    host.swap_in(device, host_ids, back)
    reference = PagedKVCache(SPEC, 16)
    store_tokens([reference], blocks, seed=6)
    n = 4 * SPEC.block_size
    for layer in range(2):
        got, want = device.gather(layer, back, n), reference.gather(layer, blocks, n)
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    host.free(host_ids)
    assert host.cache.committed_bytes == 0
    with pytest.raises(DoubleFreeError):
        host.cache.release_blocks(host_ids)


def test_host_tier_memory_shrinks_when_its_blocks_are_deleted() -> None:
    device = PagedKVCache(SPEC, 16, elastic=CFG)
    tier = HostTier(64, Namespace("m", "float16", "L", 0, 1, 0, "blake2b"), like=device, elastic=CFG)
    rows = torch.randint(0, 255, (10, device.bytes_per_block), dtype=torch.uint8)
    assert tier.set(list(range(10)), rows) == 10
    assert tier.host.cache.committed_bytes == 10 * PAGE  # block-major, like the device cache
    out = torch.empty_like(rows)
    assert tier.get(list(range(10)), out) == 10 and torch.equal(out, rows)
    assert tier.delete(list(range(6))) == 6
    assert tier.host.cache.committed_bytes == 4 * PAGE
    tier.check_integrity()


@pytest.mark.parametrize("kwargs", [{"pin_memory": True}, {"device": "meta"}, {"elastic": "yes"},
                                    {"layout": "HND", "packed": True},
                                    {"elastic": ElasticConfig(page_size=1000)}])
def test_bad_elastic_options_are_config_errors(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        PagedKVCache(SPEC, 8, **{"elastic": CFG, **kwargs})


def test_packed_false_cannot_hold_layers_of_two_shapes() -> None:
    mixed = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=2,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                        layer_head_dims=[4, 8])
    with pytest.raises(ConfigError):
        PagedKVCache(mixed, 8, packed=False)


def test_a_fixed_cache_has_no_pages_to_commit() -> None:
    cache = PagedKVCache(SPEC, 8)
    assert cache.pages is None and cache.committed_bytes is None and cache.stats()["elastic"] is None
    with pytest.raises(ConfigError):
        cache.commit_blocks([0])


@pytest.mark.slow
def test_a_4_gib_elastic_pool_commits_nothing_before_use_and_gives_back_what_it_releases() -> None:
    """Issue 32: a pool planned for 4 GiB commits < 64 MiB before its first request (RSS in a fresh
    process); after 10% of its blocks are written RSS has grown by ~their bytes, and after they are
    released it has fallen back by them. 4 layers x 8 heads x 128 x fp16, 16-token blocks: 256 KiB a block,
    16,384 blocks = 4 GiB; 1,638 blocks = 409.5 MiB (8 blocks to a 2 MiB page: 205 pages, 410 MiB)."""
    code = textwrap.dedent("""
        import torch, psutil
        from kvpool.spec import KVCacheSpec
        from kvpool.storage.paged import PagedKVCache, block_slots
        rss = lambda: psutil.Process().memory_info().rss
        spec = KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.float16, block_size=16)
        k = torch.full((1638 * 16, 8, 128), 1.5, dtype=torch.float16)
        slots = block_slots(torch.arange(1638), 1638 * 16, 16)
        start = rss()
        cache = PagedKVCache(spec, 16384, elastic=True)
        built = rss()
        cache.commit_blocks(range(1638))
        for layer in range(4):
            cache.store_kv(k, k, slots, layer)
        used = rss()
        cache.release_blocks(range(1638))
        print(cache.nbytes, built - start, used - built, used - rss(), cache.committed_bytes)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    nbytes, built, grown, fallen, left = (int(x) for x in out.split())
    assert nbytes == 4 << 30 and built < 64 * MiB and left == 0
    assert 410 * MiB <= grown <= 410 * MiB + 32 * MiB
    assert 410 * MiB - 8 * MiB <= fallen <= 410 * MiB + 8 * MiB
