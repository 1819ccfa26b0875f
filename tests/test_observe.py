"""The consumers observed: a real ZMQ subscriber in another process (``kvpool events --json``) rebuilds the
set of cached block hashes from the events alone, and it must equal the pool's own prefix index at the end
of an engine run with evictions and of a 2,000-request Mooncake replay with a bounded pool; ``/metrics``
scraped over HTTP during a run against the engine's state; bad observability options. Servers take free
ports of 27200-27299."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from _ports import free_port, tcp

pytest.importorskip("msgspec")
pytest.importorskip("zmq")
pytest.importorskip("prometheus_client")
pytest.importorskip("transformers")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvpool.allocators.block_pool import BlockPool  # noqa: E402
from kvpool.cli import main  # noqa: E402
from kvpool.engine.engine import LLMEngine  # noqa: E402
from kvpool.engine.models import load_model  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402
from kvpool.events import ZmqEventPublisher  # noqa: E402
from kvpool.metrics import KVPoolCollector, MetricsServer  # noqa: E402
from kvpool.trace import ReplayConfig, load_trace, run_replay  # noqa: E402

BASE = list(range(7, 71))  # 64 tokens
PROMPTS = [BASE, BASE[:40] + [200, 201, 202, 203, 204, 205, 206, 207], [99, 98, 97] * 12, BASE[:33],
           list(range(120, 170)), BASE]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny() -> object:
    return load_model("tiny-llama", seed=1).model


class Subscriber:
    """``kvpool events ENDPOINT --replay ... --json`` in another process; its lines read by a thread."""

    def __init__(self, live: str, replay: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvpool", "events", live, "--replay", replay,
                                      "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def events(self, count: int, timeout: float = 120) -> list[dict]:
        """The first ``count`` events it printed."""
        out, deadline = [], time.monotonic() + timeout
        while len(out) < count:
            try:
                out.append(json.loads(self.lines.get(timeout=max(0.1, deadline - time.monotonic()))))
            except queue.Empty:
                err = self.proc.stderr.read() if self.proc.poll() is not None else ""
                raise AssertionError(f"subscriber printed {len(out)} of {count} events; {err}") from None
        return out

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def rebuilt(events: list[dict]) -> Counter:
    """The blocks holding each hash according to the events alone (one event entry per block)."""
    cached: Counter = Counter()
    for e in events:
        if e["type"] == "BlockStored":
            cached.update(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            assert all(cached[h] > 0 for h in e["block_hashes"])
            cached.subtract(e["block_hashes"])
        else:
            cached.clear()
    return +cached


def index_of(pool: BlockPool) -> Counter:
    """The pool's own blocks per hash, in the form the JSON lines give (bytes as hex, ints as ints)."""
    hashes = [pool.block_hash(b) for b in range(pool.num_blocks)]
    return Counter(h.hex() if isinstance(h, bytes) else h for h in hashes if h is not None)


def observed_run(publisher_kwargs: dict, run) -> tuple[list[dict], object]:
    """Start the subscriber, then the publisher, call ``run(publisher)``; returns every event the other
    process printed (as many as were published) and what ``run`` returned."""
    live, replay = tcp(free_port()), tcp(free_port())
    sub = Subscriber(live, replay)
    pub = ZmqEventPublisher(live, replay_endpoint=replay, **publisher_kwargs)
    try:
        result = run(pub)
        assert pub.dropped_batches == 0
        events = sub.events(pub.published_events)
    finally:
        pub.close()
        sub.close()
    return events, result


def test_engine_run_with_evictions_rebuilds_the_prefix_index(tiny: object) -> None:
    def run(pub: ZmqEventPublisher) -> LLMEngine:
        engine = LLMEngine(tiny, num_blocks=22, block_size=4, max_num_batched_tokens=32, kv_events=pub)
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=10))
        return engine

    events, engine = observed_run({}, run)
    pool = engine.pool
    assert pool.stats.evictions > 0 and engine.stats.preemptions > 0  # the run evicted and preempted
    assert {e["type"] for e in events} == {"BlockStored", "BlockRemoved"}
    assert rebuilt(events) == index_of(pool) and len(index_of(pool)) > 0
    first = events[0]  # the first prompt's first published blocks, with their tokens
    assert first["parent_block_hash"] is None and first["block_size"] == 4 and first["medium"] == "GPU"
    assert first["token_ids"] == BASE[:4 * len(first["block_hashes"])] and first["group_idx"] == 0
    assert all(len(bytes.fromhex(h)) == 16 for e in events for h in e["block_hashes"])


def test_hybrid_engine_events_name_each_group() -> None:
    """tiny-gemma2: group 0 sliding (window 16), group 1 full, one pool. Each event names its group, kind
    and window; the (group, hash) pairs the stream leaves equal the pool's keys read by the coordinator."""
    from kvpool.allocators.groups import split_group_key
    from kvpool.events import BlockRemoved, BlockStored, QueueEventPublisher

    pub = QueueEventPublisher(100_000)
    engine = LLMEngine(load_model("tiny-gemma2", seed=1).model, num_blocks=40, block_size=4,
                       max_num_batched_tokens=32, kv_events=pub)
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=10))
    events = [e for batch in pub.drain() for e in batch.events]
    cached: Counter = Counter()
    for e in events:
        if isinstance(e, BlockStored):
            assert (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == \
                {0: ("sliding_window", 16), 1: ("full_attention", None)}[e.group_idx]
            assert len(e.token_ids) == 4 * len(e.block_hashes)
            cached.update((e.group_idx, h) for h in e.block_hashes)
        else:
            assert isinstance(e, BlockRemoved)
            cached.subtract((e.group_idx, h) for h in e.block_hashes)
    pool = engine.pool
    keys = [pool.block_hash(b) for b in range(pool.num_blocks)]
    assert +cached == Counter(split_group_key(k) for k in keys if k is not None)
    assert {g for g, _ in +cached} == {0, 1}
    assert engine.stats.preemptions > 0 and pool.stats.evictions > 0
    first_full = next(e for e in events if isinstance(e, BlockStored) and e.group_idx == 1)
    assert first_full.parent_block_hash is None and first_full.token_ids == BASE[:len(first_full.token_ids)]


def test_a_host_tier_publishes_into_the_engines_batches() -> None:
    """A device pool too small for the prompts, a host tier under it: the events of medium GPU leave the
    device pool's index, those of medium CPU the host tier's, batch by batch in one stream."""
    pytest.importorskip("xxhash")
    from kvpool.events import BlockStored, QueueEventPublisher
    from kvpool.tiers.backend import Namespace
    from kvpool.tiers.host import HostTier

    pub = QueueEventPublisher(100_000)
    engine = LLMEngine(load_model("tiny-llama", seed=1).model, num_blocks=20, block_size=4, kv_events=pub)
    host = HostTier(12, Namespace.for_cache(engine.cache, model="tiny-llama"), like=engine.cache)
    engine.enable_offload([host])
    for prompt in PROMPTS:  # one at a time: each evicts the one before into the host tier
        engine.generate([prompt], SamplingParams(max_new_tokens=6))
    engine.offload.close()
    cached: dict[str, set] = {"GPU": set(), "CPU": set()}
    for event in (e for batch in pub.drain() for e in batch.events):
        if isinstance(event, BlockStored):
            cached[event.medium].update(event.block_hashes)
        else:
            cached[event.medium].difference_update(event.block_hashes)
    assert cached["GPU"] == {engine.pool.block_hash(b) for b in range(20)} - {None}
    assert cached["CPU"] == {host.pool.block_hash(b) for b in range(12)} - {None} != set()
    assert host.stats().stored > 12  # the host tier evicted too


@pytest.mark.slow  # ~10 s: 2,000 requests and 35,000 events through another process
def test_mooncake_replay_with_a_bounded_pool_rebuilds_the_prefix_index() -> None:
    requests = load_trace(max_requests=2000).requests
    pool_box: dict = {}

    def run(pub: ZmqEventPublisher) -> object:
        from kvpool.events import KVEventSink

        pool = pool_box["pool"] = BlockPool(20_000, event_sink=KVEventSink(pub, block_size=16))
        return run_replay(requests, ReplayConfig(block_size=16, num_blocks=20_000, timing="trace"), pool=pool)

    events, result = observed_run({"buffer_steps": 100_000}, run)
    assert result.evictions > 0 and result.requests_completed + result.requests_rejected == 2000
    assert rebuilt(events) == index_of(pool_box["pool"]) and len(index_of(pool_box["pool"])) > 1000
    stored = sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockStored")
    removed = sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockRemoved")
    assert removed == result.evictions  # every eviction, and nothing else, removed a hash
    assert stored - removed == pool_box["pool"].num_cached_blocks == sum(index_of(pool_box["pool"]).values())


def scrape(url: str) -> dict:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, s.labels.get("state")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if not s.name.endswith("_created")}


def test_metrics_scraped_during_a_run_match_the_engine(tiny: object) -> None:
    engine = LLMEngine(tiny, num_blocks=22, block_size=4, max_num_batched_tokens=32)
    collector = KVPoolCollector(preemptions=lambda: engine.stats.preemptions)
    collector.add_pool(engine.pool, block_size=4, token_slots_used=engine.num_token_slots_used,
                       stats=engine.kv_manager.prefix_cache_stats)
    scraped: list[tuple[dict, dict]] = []
    looked_up = {"queried": 0, "hit": 0}  # every admission the engine makes, each counted once
    admit = engine.kv_manager.admit

    def tallied_admit(req: object, budget: int) -> object:
        chunk = admit(req, budget)
        if chunk is not None:  # admitted: it could hit the full blocks of its first num_tokens - 1 tokens
            looked_up["queried"] += min(len(req.block_hashes), (req.num_tokens - 1) // 4)
            looked_up["hit"] += req.num_computed_tokens // 4
        return chunk

    engine.kv_manager.admit = tallied_admit  # type: ignore[method-assign]

    def on_step(_: int) -> None:  # the engine waits between steps: scrape and work out the truth by hand
        got = scrape(server.url)
        tables = {}
        for req in engine.running:
            for i, b in enumerate(engine.kv.block_tables(req.request_id)[0]):  # one group: tiny-llama
                tables[b] = max(tables.get(b, 0), min(4, req.num_computed_tokens - 4 * i))
        truth = {"used": len(tables), "tokens": sum(tables.values()), "hit_tokens": 4 * looked_up["hit"],
                 "queried_tokens": 4 * looked_up["queried"], "preemptions": engine.stats.preemptions}
        scraped.append((got, truth))

    with MetricsServer(collector, free_port()) as server:
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=10), on_step=on_step)
        final = scrape(server.url)
    assert len(scraped) == engine.stats.steps and engine.stats.preemptions > 0
    for got, truth in scraped:
        assert got[("kvpool_blocks", "used")] == truth["used"]
        assert got[("kvpool_blocks", "used")] + got[("kvpool_blocks", "evictable")] + \
            got[("kvpool_blocks", "free")] == got[("kvpool_blocks_capacity", None)] == 22
        assert got[("kvpool_token_slots_used", None)] == truth["tokens"]
        assert got[("kvpool_prefix_cache_hit_tokens_total", None)] == truth["hit_tokens"]
        assert got[("kvpool_prefix_cache_queried_tokens_total", None)] == truth["queried_tokens"]
        assert got[("kvpool_preemptions_total", None)] == truth["preemptions"]
    assert final[("kvpool_blocks", "used")] == 0 and final[("kvpool_token_slots_used", None)] == 0
    assert final[("kvpool_evicted_blocks_total", None)] == engine.pool.stats.evictions > 0
    hit_tokens = final[("kvpool_prefix_cache_hit_tokens_total", None)]  # every admission's hit, once
    assert hit_tokens == 4 * looked_up["hit"] == engine.stats.prefix_hit_tokens > 0
    assert any(g[("kvpool_token_slot_usage_ratio", None)] < g[("kvpool_block_usage_ratio", None)]
               for g, _ in scraped)  # partly filled blocks: token usage below block usage


def test_metrics_count_tier_hits_once_and_export_the_host_pool(tiny: object) -> None:
    """Issue 20, item 7: with a host tier the prefix-hit counters count every admission's hit once, the
    blocks found on the device and the blocks restored from the tier alike (they read 0 before), and the
    host tier's own pool is exported with ``tier="host"``."""
    import argparse

    from prometheus_client.parser import text_string_to_metric_families as families

    from kvpool.allocators.hashing import BlockHasher
    from kvpool.cli._observe import Observers

    # 18 blocks: the 64-token prompt (17) fits alone; the 50-token one (14) pushes most of it out
    engine = LLMEngine(tiny, num_blocks=18, block_size=4, hasher=BlockHasher("sha256", shared=True))
    engine.enable_offload(["host://?blocks=64"])
    options = argparse.Namespace(kv_events=None, metrics_port=free_port(), metrics_host="127.0.0.1")
    with Observers(options) as observers:
        observers.watch_engine(engine)
        for prompt in PROMPTS:  # one at a time: the unrelated prompts push the shared blocks to the host
            engine.generate([prompt], SamplingParams(max_new_tokens=4))
        text = urllib.request.urlopen(observers.server.url, timeout=10).read().decode()
    page = {(s.name, s.labels.get("tier"), s.labels.get("state")): s.value
            for f in families(text) for s in f.samples}
    places = engine.kv_manager.hits_by_place()
    assert places["host"] > 0 and places["device"] > 0
    hit = page[("kvpool_prefix_cache_hit_blocks_total", "device", None)]
    assert hit == sum(places.values()) == engine.stats.prefix_hit_tokens // 4
    host = engine.offload.host.pool
    assert page[("kvpool_blocks_capacity", "host", None)] == 64
    assert page[("kvpool_blocks", "host", "evictable")] == host.num_evictable_blocks > 0
    engine.offload.close()


@pytest.mark.slow  # ~20 s: a whole kvpool generate in a subprocess
def test_generate_cli_serves_metrics_and_events_while_it_runs() -> None:
    live, replay, metrics = tcp(free_port()), tcp(free_port()), free_port()
    sub = Subscriber(live, replay)
    args = ["generate", "--model", "tiny-llama", "--num-blocks", "64", "--block-size", "4",
            "--max-new-tokens", "150", "--threads", "1", "--prompt", "a shared prefix, then one",
            "--prompt", "a shared prefix, then two", "--kv-events", live, "--kv-events-replay", replay,
            "--metrics-port", str(metrics), "--json"]
    proc = subprocess.Popen([sys.executable, "-m", "kvpool", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        got, deadline = None, time.monotonic() + 120
        while got is None and proc.poll() is None and time.monotonic() < deadline:
            try:  # the server answers from the start; the pool's numbers come once the engine exists
                page = scrape(f"http://127.0.0.1:{metrics}/metrics")
                got = page if ("kvpool_blocks_capacity", None) in page else None
            except OSError:
                pass
            time.sleep(0.2)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        stats = json.loads(out)["stats"]
        events = sub.events(1)
    finally:
        proc.kill()
        sub.close()
    assert got is not None, "no /metrics answer while generate ran"
    assert got[("kvpool_blocks_capacity", None)] == 64 and got[("kvpool_token_slots_capacity", None)] == 256
    assert got[("kvpool_blocks", "used")] + got[("kvpool_blocks", "evictable")] + \
        got[("kvpool_blocks", "free")] == 64
    # the counters count every lookup, retries of a request that waits for room included (the exact values
    # are checked in process, above): a scrape can exceed the admitted hits, never the queried tokens
    hit, queried = (got[("kvpool_prefix_cache_hit_tokens_total", None)],
                    got[("kvpool_prefix_cache_queried_tokens_total", None)])
    assert hit % 4 == 0 and hit <= queried and stats["prefix_hit_tokens"] > 0
    assert ("kvpool_preemptions_total", None) in got and ("kvpool_kv_events_dropped_total", None) in got
    assert events[0]["type"] == "BlockStored" and events[0]["block_size"] == 4


@pytest.mark.parametrize("extra, message", [
    (["--kv-events", "tcp://127.0.0.1"], "malformed ZMQ endpoint"),
    (["--kv-events", "tcp://127.0.0.1:80000"], "malformed ZMQ endpoint"),
    (["--kv-events-replay", "tcp://127.0.0.1:5558"], "--kv-events-replay needs --kv-events"),
    (["--metrics-port", "70000"], "metrics port must be an integer in [1, 65535]"),
])
def test_bad_observability_options_are_one_line(extra: list[str], message: str,
                                                 capsys: pytest.CaptureFixture) -> None:
    for command in (["generate", "--model", "tiny-llama"], ["replay", "--max-requests", "5"]):
        if command[0] == "replay" and "--metrics-port" in extra:
            continue  # replay publishes events only
        assert main([*command, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_ports_in_use_are_one_line(capsys: pytest.CaptureFixture) -> None:
    port = free_port()
    with ZmqEventPublisher(tcp(port)):
        for command in (["generate", "--model", "tiny-llama"], ["replay", "--max-requests", "5"]):
            assert main([*command, "--kv-events", tcp(port)]) == 2
            err = capsys.readouterr().err
            assert err == f"kvpool {command[0]}: error: cannot bind {tcp(port)}: address already in use\n"
    with MetricsServer(KVPoolCollector(), port):
        assert main(["generate", "--model", "tiny-llama", "--metrics-port", str(port)]) == 2
        err = capsys.readouterr().err
        assert err == (f"kvpool generate: error: cannot serve metrics on 127.0.0.1:{port}: "
                       "address already in use\n")
