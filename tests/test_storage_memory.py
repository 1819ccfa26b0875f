"""Section 4, lazy commit: a 4 GiB ``torch.empty`` CPU pool costs resident memory only for what is written.

Expected figures by hand: spec 4 layers x 8 KV heads x 128 dims x 2 bytes (float16), 16-token blocks:
2 x 4 x 16 x 8 x 128 x 2 B = 256 KiB per block, so 16,384 blocks = 4 GiB. Writing the first 1,638 blocks
(10%) of every layer, K and V, writes 1,638 x 256 KiB = 409.5 MiB; RSS should grow by about that (Linux
commits 4 KiB pages on first write), not by 4 GiB.
"""

import pytest
import torch

from kvpool.spec import KVCacheSpec
from kvpool.storage.paged import PagedKVCache, block_slots

psutil = pytest.importorskip("psutil")

MiB = 2**20


def rss() -> int:
    return psutil.Process().memory_info().rss


def test_4gib_pool_grows_resident_memory_only_by_what_is_written() -> None:
    spec = KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.float16, block_size=16)
    written_blocks = 1638
    tokens = written_blocks * 16
    k = torch.full((tokens, 8, 128), 1.5, dtype=torch.float16)  # sources allocated before the baseline
    slots = block_slots(torch.arange(written_blocks), tokens, 16)
    start = rss()
    cache = PagedKVCache(spec, 16384)
    assert cache.nbytes == 4 * 2**30
    after_alloc = rss()
    assert after_alloc - start < 64 * MiB  # reserved, not committed
    for layer in range(4):
        cache.store_kv(k, k, slots, layer)
    growth = rss() - after_alloc
    written = written_blocks * 256 * 1024
    assert written == int(409.5 * MiB)
    assert 0.8 * written <= growth <= 1.25 * written + 32 * MiB, f"RSS grew {growth / MiB:.0f} MiB"
    stats = cache.stats()
    assert stats["nbytes"] == 4 * 2**30
    assert 0.8 * written <= stats["rss_growth_bytes"] <= 1.25 * written + 64 * MiB
    assert torch.equal(cache.gather(3, [written_blocks - 1], 16)[1], k[:16])


def test_resident_bytes_are_the_caches_own_not_the_processes() -> None:
    """Issue 9, item 15: ``rss_growth_bytes`` is the whole process's (8.8 MB for a 128 KiB cache);
    ``resident_bytes`` counts this buffer's own pages (mincore), whatever else the process allocates."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.float16, block_size=16)
    cache = PagedKVCache(spec, 512)  # 2 x 2 x 512 x 16 x 8 x 128 x 2 B = 64 MiB (torch.empty)
    assert cache.nbytes == 64 * MiB
    page, before = 4096, cache.resident_bytes()  # a fresh mapping: ~0 (more if the allocator reused pages)
    cache.k_cache(0)[:64].fill_(1.0)  # layer 0's K of blocks 0..63: 64 x 16 x 8 x 128 x 2 B = 2 MiB
    written = cache.resident_bytes()
    assert 2 * MiB <= written <= before + 2 * MiB + 2 * page
    other = torch.ones(32 * MiB // 4, dtype=torch.float32)  # 32 MiB the process writes elsewhere
    stats = cache.stats()
    assert stats["resident_bytes"] == written  # the process's other memory is not the cache's
    assert stats["rss_bytes"] >= written + other.nbytes and stats["rss_growth_bytes"] is not None
    small = PagedKVCache(KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float16,
                                     block_size=16), 32, zero=True)  # 2 x 32 x 16 x 64 x 2 B = 128 KiB
    assert small.stats()["resident_bytes"] == small.nbytes == 128 * 1024  # zeroed: every byte resident
