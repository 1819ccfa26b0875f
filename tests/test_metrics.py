"""Prometheus metrics: the collector's numbers against pool states worked out by hand, scraped over HTTP.
Servers take free ports of 27200-27299."""

from __future__ import annotations

import urllib.request

import pytest
from _ports import free_port

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvpool.allocators.block_pool import BlockPool  # noqa: E402
from kvpool.errors import ConfigError, InvalidArgumentError  # noqa: E402
from kvpool.events import AllBlocksCleared, KVEventBatch, QueueEventPublisher  # noqa: E402
from kvpool.metrics import KVPoolCollector, MetricsServer  # noqa: E402


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``url`` as {(name, sorted labels): value}."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def key(name: str, tier: str = "device", **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """A sample's key; pool metrics carry tier and group 0."""
    return name, tuple(sorted({"tier": tier, "group": "0", **labels}.items()))


def test_scraped_numbers_match_a_pool_worked_by_hand() -> None:
    pool = BlockPool(10)
    a = pool.allocate(4)                      # 4 used
    pool.cache_blocks(a[:3], [b"h0", b"h1", b"h2"])
    pool.free(a[::-1])                        # 3 evictable (hashed), 7 uncached free
    assert pool.lookup([b"h0", b"h1", b"zz", b"h2"]) == a[:2]   # 4 queried, 2 hits
    pool.touch(a[:2])                         # 2 used again, 1 evictable
    pool.allocate(8)                          # 7 free first, then evicts h2's block: 10 used
    pub = QueueEventPublisher(maxsize=1)
    pub.publish(KVEventBatch(0.0, [AllBlocksCleared(), AllBlocksCleared()]))
    pub.publish(KVEventBatch(0.0, [AllBlocksCleared()] * 3))  # dropped: the queue holds one
    collector = KVPoolCollector(preemptions=lambda: 7, publisher=pub)
    collector.add_pool(pool, block_size=16, token_slots_used=lambda: 123)
    host = BlockPool(4)
    host.allocate(1)
    collector.add_pool(host, block_size=16, tier="host")
    with MetricsServer(collector, free_port()) as server:
        got = scrape(server.url)
    assert got[key("kvpool_blocks", state="used")] == 10
    assert got[key("kvpool_blocks", state="evictable")] == 0
    assert got[key("kvpool_blocks", state="free")] == 0
    assert got[key("kvpool_blocks_capacity")] == 10
    assert got[key("kvpool_cached_blocks")] == 2
    assert got[key("kvpool_block_usage_ratio")] == 1.0
    assert got[key("kvpool_token_slots_capacity")] == 160
    assert got[key("kvpool_token_slots_used")] == 123
    assert got[key("kvpool_token_slot_usage_ratio")] == 123 / 160
    assert got[key("kvpool_prefix_cache_queried_blocks_total")] == 4
    assert got[key("kvpool_prefix_cache_hit_blocks_total")] == 2
    assert got[key("kvpool_prefix_cache_queried_tokens_total")] == 64
    assert got[key("kvpool_prefix_cache_hit_tokens_total")] == 32
    assert got[key("kvpool_evicted_blocks_total")] == 1
    assert got[("kvpool_preemptions_total", ())] == 7
    assert got[("kvpool_kv_event_batches_published_total", ())] == 1
    assert got[("kvpool_kv_events_published_total", ())] == 2
    assert got[("kvpool_kv_events_dropped_total", ())] == 3
    assert got[("kvpool_kv_event_batches_dropped_total", ())] == 1
    assert got[key("kvpool_blocks", "host", state="used")] == 1
    assert got[key("kvpool_blocks", "host", state="free")] == 3
    assert key("kvpool_token_slots_used", "host") not in got  # not given for that pool


def test_every_name_follows_the_conventions() -> None:
    collector = KVPoolCollector(preemptions=lambda: 0, publisher=QueueEventPublisher())
    collector.add_pool(BlockPool(2), block_size=1, token_slots_used=lambda: 0)
    for family in collector.collect():
        assert family.name.startswith("kvpool_") and family.name == family.name.lower()
        for sample in family.samples:
            names = (f"{family.name}_total", f"{family.name}_created")
            assert family.type != "counter" or sample.name in names


def test_bad_input_is_refused() -> None:
    collector = KVPoolCollector().add_pool(BlockPool(2), block_size=4)
    with pytest.raises(InvalidArgumentError, match="already added"):
        collector.add_pool(BlockPool(2), block_size=4)
    with pytest.raises(InvalidArgumentError):
        collector.add_pool(BlockPool(2), block_size=0, tier="host")
    for port in (0, 70000, True, "8000"):
        with pytest.raises(ConfigError, match=r"port must be an integer in \[1, 65535\]"):
            MetricsServer(collector, port)
    port = free_port()
    with MetricsServer(collector, port), pytest.raises(ConfigError, match=f"{port}: address already in use"):
        MetricsServer(KVPoolCollector(), port)
