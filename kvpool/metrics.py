"""Prometheus metrics of the pool: a ``prometheus-client`` collector that reads the pools' counters when
scraped, and a small HTTP server for ``/metrics``.

Contract: the collector holds no counters of its own and costs the pool nothing between scrapes; each
scrape reads the pool's O(1) properties (and, where given, the consumer's callables). Every pool metric
carries the labels ``tier`` (``device`` for the pool the engine allocates from, a tier's name otherwise)
and ``group`` (the KV cache group index; ``0`` for a model with one group). Names follow Prometheus
conventions (``kvpool_`` prefix, counters end in ``_total``, the unit in the name):

======================================  =======  ==========================================================
name                                    type     what
======================================  =======  ==========================================================
``kvpool_blocks``                       gauge    blocks by ``state``: ``used`` (ref count > 0), ``evictable``
                                                 (cached free), ``free`` (uncached free); they sum to the
                                                 capacity
``kvpool_blocks_capacity``              gauge    blocks the pool can hand out
``kvpool_cached_blocks``                gauge    blocks in the prefix index (in use or evictable)
``kvpool_block_usage_ratio``            gauge    used / capacity (what vLLM calls KV cache usage)
``kvpool_token_slots_capacity``         gauge    capacity x block_size
``kvpool_token_slots_used``             gauge    token slots holding KV (given by the consumer: a partly
                                                 filled block counts its tokens, not its size)
``kvpool_token_slot_usage_ratio``       gauge    token_slots_used / token_slots_capacity
``kvpool_prefix_cache_queried_blocks``  counter  full blocks looked up in the prefix cache
``kvpool_prefix_cache_hit_blocks``      counter  of those, blocks found (the cached prefix)
``kvpool_prefix_cache_queried_tokens``  counter  queried blocks x block_size
``kvpool_prefix_cache_hit_tokens``      counter  hit blocks x block_size
``kvpool_evicted_blocks``               counter  cached blocks recycled by allocation (their hash dropped)
``kvpool_preemptions``                  counter  requests preempted by the consumer (no tier/group label)
``kvpool_kv_event_batches_published``   counter  event batches a publisher accepted
``kvpool_kv_events_published``          counter  events in those batches
``kvpool_kv_event_batches_dropped``     counter  event batches dropped on a full buffer
``kvpool_kv_events_dropped``            counter  events in those dropped batches
``kvpool_state_slots_used``             gauge    recurrent state slots held by running requests (hybrids)
``kvpool_state_slots_capacity``         gauge    state slots for requests (the checkpoint slots apart)
``kvpool_state_checkpoints``            gauge    state checkpoints held for prefix caching
``kvpool_state_checkpoints_capacity``   gauge    checkpoints held at most (0: none kept)
``kvpool_state_checkpoints_saved``      counter  checkpoints stored
``kvpool_state_checkpoint_hits``        counter  admissions restored from a checkpoint
``kvpool_state_checkpoints_evicted``    counter  checkpoints evicted (least recently used)
``kvpool_kv_tokens_without_state``      counter  tokens whose KV was cached but past the last checkpoint
``kvpool_kv_memory_bytes``              gauge    the KV cache's bytes by ``state``: ``reserved`` (the whole
                                                 cache), ``committed`` (physical memory held: an elastic
                                                 cache's pages), ``used`` (blocks in use), ``cached`` (cached
                                                 free blocks); given by the consumer
``kvpool_cache_read_tokens``            counter  prompt tokens served from the cache, by ``tier`` (where the
                                                 hit's blocks were found: ``device``, ``host``, ``disk``...)
``kvpool_cache_creation_tokens``        counter  prompt tokens computed and written to the prefix cache
``kvpool_cache_uncached_tokens``        counter  prompt tokens computed and not cached (read + creation +
                                                 uncached = the prompt tokens of the admitted requests)
``kvpool_sessions_open``                gauge    sessions open (:mod:`kvpool.requests.sessions`)
``kvpool_session_kept_blocks``          gauge    blocks the sessions and retained ranges keep (pinned)
======================================  =======  ==========================================================

(Counters are exposed with the ``_total`` suffix, e.g. ``kvpool_evicted_blocks_total``.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric

from kvpool.errors import ConfigError, InvalidArgumentError
from kvpool.numeric import as_int

if TYPE_CHECKING:
    from kvpool.allocators.block_pool import BlockPool
    from kvpool.events.publishers import EventPublisher

POOL_LABELS = ("tier", "group")
MEMORY_STATES = ("reserved", "committed", "used", "cached")


@dataclass(frozen=True)
class _Source:
    pool: BlockPool
    block_size: int
    labels: tuple[str, str]
    token_slots_used: Callable[[], int] | None
    stats: Callable[[], Any]


class KVPoolCollector:
    """A collector over one or more pools (tiers, KV cache groups), registered with a prometheus-client
    ``CollectorRegistry``: ``registry.register(KVPoolCollector().add_pool(pool, block_size=16))``.

    Args:
        preemptions: returns the consumer's preemption count (``kvpool_preemptions_total``); also a
            settable attribute.
        publisher: the KV event publisher whose counters to export.
    """

    def __init__(self, *, preemptions: Callable[[], int] | None = None,
                 publisher: EventPublisher | None = None) -> None:
        self._sources: list[_Source] = []
        self.preemptions, self._publisher = preemptions, publisher
        self._states: Any = None
        self._memory: Callable[[], dict[str, Any]] | None = None
        self._usage: Any = None

    def add_states(self, states: Any) -> KVPoolCollector:
        """Export a recurrent hybrid's state slots and checkpoints (a
        :class:`~kvpool.requests.state_checkpoints.RequestStates`: its slot counts and ``stats``, read at
        each scrape); returns self. Raises InvalidArgumentError when states are added already."""
        if self._states is not None:
            raise InvalidArgumentError("recurrent states are already added")
        self._states = states
        return self

    def add_memory(self, stats: Callable[[], dict[str, Any]]) -> KVPoolCollector:
        """Export the KV cache's memory: ``stats()`` returns bytes under ``reserved``, ``committed``,
        ``used`` and ``cached`` (:meth:`kvpool.engine.engine.LLMEngine.memory_stats`), read at each scrape;
        returns self. Raises InvalidArgumentError when memory is added already."""
        if self._memory is not None:
            raise InvalidArgumentError("the KV memory is already added")
        self._memory = stats
        return self

    def add_usage(self, kv: Any) -> KVPoolCollector:
        """Export a :class:`~kvpool.requests.kv_manager.KVCacheManager`'s cached-token sums (its ``usage``)
        and sessions (its ``sessions``), read at each scrape; returns self. Raises InvalidArgumentError when
        they are added already."""
        if self._usage is not None:
            raise InvalidArgumentError("the cache usage is already added")
        self._usage = kv
        return self

    def add_pool(self, pool: BlockPool, *, block_size: int, tier: str = "device", group: int | str = 0,
                 token_slots_used: Callable[[], int] | None = None, stats: Callable[[], Any] | None = None
                 ) -> KVPoolCollector:
        """Export ``pool`` (blocks of ``block_size`` tokens) under ``tier``/``group``; returns self.
        ``stats()`` returns the prefix-cache counters (``hits``, ``misses``, ``evictions``, in blocks):
        by default ``pool.stats`` (counted by ``lookup``); a KV cache coordinator counts its own hits
        (``lambda: coordinator.stats``).

        Raises:
            InvalidArgumentError: a bad block size, or a tier/group already added.
        """
        block_size = as_int(block_size, "block_size", minimum=1)
        labels = (str(tier), str(group))
        if any(s.labels == labels for s in self._sources):
            raise InvalidArgumentError(f"a pool for tier={labels[0]} group={labels[1]} is already added")
        self._sources.append(_Source(pool, block_size, labels, token_slots_used,
                                     stats if stats is not None else lambda: pool.stats))
        return self

    def describe(self) -> Iterator[Metric]:
        """The metric families, without samples (lets a registry refuse duplicate names)."""
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        """Read every source now."""
        families = {f.name: f for f in self._families()}

        def put(name: str, labels: tuple[str, ...], value: float) -> None:
            families[name].add_metric(labels, value)

        for s in self._sources:
            self._collect_pool(s, put)
        if self.preemptions is not None:
            put("kvpool_preemptions", (), self.preemptions())
        pub = self._publisher
        if pub is not None:
            put("kvpool_kv_event_batches_published", (), pub.published_batches)
            put("kvpool_kv_events_published", (), pub.published_events)
            put("kvpool_kv_event_batches_dropped", (), pub.dropped_batches)
            put("kvpool_kv_events_dropped", (), pub.dropped_events)
        if self._states is not None:
            self._collect_states(self._states, put)
        if self._usage is not None:
            usage, sessions = self._usage.usage, self._usage.sessions
            for tier, n in usage.read_tokens.items():
                put("kvpool_cache_read_tokens", (tier,), n)
            put("kvpool_cache_creation_tokens", (), usage.creation_tokens)
            put("kvpool_cache_uncached_tokens", (), usage.uncached_tokens)
            put("kvpool_sessions_open", (), sessions.num_open)
            put("kvpool_session_kept_blocks", (), sessions.num_kept_blocks)
        if self._memory is not None:
            memory = self._memory()
            for state in MEMORY_STATES:
                put("kvpool_kv_memory_bytes", (state,), memory[state])
        yield from families.values()

    @staticmethod
    def _collect_states(states: Any, put: Callable[[str, tuple[str, ...], float], None]) -> None:
        ckpt, stats = states.checkpoints, states.stats
        put("kvpool_state_slots_used", (), states.num_request_slots)
        put("kvpool_state_slots_capacity", (), states.num_request_capacity)
        put("kvpool_state_checkpoints", (), len(ckpt))
        put("kvpool_state_checkpoints_capacity", (), ckpt.capacity if ckpt.capacity is not None else -1)
        put("kvpool_state_checkpoints_saved", (), stats.saved)
        put("kvpool_state_checkpoint_hits", (), stats.restored)
        put("kvpool_state_checkpoints_evicted", (), stats.evicted)
        put("kvpool_kv_tokens_without_state", (), stats.kv_only_tokens)

    @staticmethod
    def _collect_pool(s: _Source, put: Callable[[str, tuple[str, ...], float], None]) -> None:
        pool, bs, labels = s.pool, s.block_size, s.labels
        used, evictable = pool.num_used_blocks, pool.num_evictable_blocks
        free = pool.num_free_blocks - evictable
        capacity = used + evictable + free
        for state, value in (("used", used), ("evictable", evictable), ("free", free)):
            put("kvpool_blocks", (*labels, state), value)
        put("kvpool_blocks_capacity", labels, capacity)
        put("kvpool_cached_blocks", labels, pool.num_cached_blocks)
        put("kvpool_block_usage_ratio", labels, used / capacity if capacity else 0.0)
        put("kvpool_token_slots_capacity", labels, capacity * bs)
        if s.token_slots_used is not None:
            slots = s.token_slots_used()
            put("kvpool_token_slots_used", labels, slots)
            put("kvpool_token_slot_usage_ratio", labels, slots / (capacity * bs) if capacity else 0.0)
        stats = s.stats()
        queried = stats.hits + stats.misses
        put("kvpool_prefix_cache_queried_blocks", labels, queried)
        put("kvpool_prefix_cache_hit_blocks", labels, stats.hits)
        put("kvpool_prefix_cache_queried_tokens", labels, queried * bs)
        put("kvpool_prefix_cache_hit_tokens", labels, stats.hits * bs)
        put("kvpool_evicted_blocks", labels, stats.evictions)

    def _families(self) -> list[Metric]:
        g, c = GaugeMetricFamily, CounterMetricFamily
        pool = list(POOL_LABELS)
        out: list[Metric] = [
            g("kvpool_blocks", "Blocks by state: used (ref count > 0), evictable (cached free), "
              "free (uncached)", labels=[*pool, "state"]),
            g("kvpool_blocks_capacity", "Blocks the pool can hand out", labels=pool),
            g("kvpool_cached_blocks", "Blocks in the prefix index (in use or evictable)", labels=pool),
            g("kvpool_block_usage_ratio", "Used blocks / capacity", labels=pool),
            g("kvpool_token_slots_capacity", "Token slots: capacity x block size", labels=pool),
            g("kvpool_token_slots_used", "Token slots holding KV", labels=pool),
            g("kvpool_token_slot_usage_ratio", "Token slots used / token slot capacity", labels=pool),
            c("kvpool_prefix_cache_queried_blocks", "Full blocks looked up in the prefix cache", labels=pool),
            c("kvpool_prefix_cache_hit_blocks", "Looked-up blocks found in the prefix cache", labels=pool),
            c("kvpool_prefix_cache_queried_tokens", "Queried blocks x block size", labels=pool),
            c("kvpool_prefix_cache_hit_tokens", "Hit blocks x block size", labels=pool),
            c("kvpool_evicted_blocks", "Cached blocks recycled by allocation", labels=pool),
        ]
        if self.preemptions is not None:
            out.append(c("kvpool_preemptions", "Requests preempted (by recompute)", labels=[]))
        if self._publisher is not None:
            out += [c("kvpool_kv_event_batches_published", "KV event batches accepted", labels=[]),
                    c("kvpool_kv_events_published", "KV events in accepted batches", labels=[]),
                    c("kvpool_kv_event_batches_dropped", "KV event batches dropped, buffer full", labels=[]),
                    c("kvpool_kv_events_dropped", "KV events in dropped batches", labels=[])]
        if self._states is not None:
            out += [g("kvpool_state_slots_used", "Recurrent state slots held by running requests", labels=[]),
                    g("kvpool_state_slots_capacity", "State slots for running requests", labels=[]),
                    g("kvpool_state_checkpoints", "State checkpoints held for prefix caching", labels=[]),
                    g("kvpool_state_checkpoints_capacity", "State checkpoints held at most (-1: no bound)",
                      labels=[]),
                    c("kvpool_state_checkpoints_saved", "State checkpoints stored", labels=[]),
                    c("kvpool_state_checkpoint_hits", "Admissions restored from a state checkpoint",
                      labels=[]),
                    c("kvpool_state_checkpoints_evicted", "State checkpoints evicted", labels=[]),
                    c("kvpool_kv_tokens_without_state", "Tokens whose KV was cached but lay past the last "
                      "state checkpoint", labels=[])]
        if self._usage is not None:
            out += [c("kvpool_cache_read_tokens", "Prompt tokens served from the cache, by where the hit was "
                      "found", labels=["tier"]),
                    c("kvpool_cache_creation_tokens", "Prompt tokens computed and written to the prefix "
                      "cache", labels=[]),
                    c("kvpool_cache_uncached_tokens", "Prompt tokens computed and not cached", labels=[]),
                    g("kvpool_sessions_open", "Sessions open", labels=[]),
                    g("kvpool_session_kept_blocks", "Blocks kept (pinned) by sessions and retained ranges",
                      labels=[])]
        if self._memory is not None:
            out.append(g("kvpool_kv_memory_bytes", "KV cache bytes by state: reserved, committed (physical "
                         "memory held), used (blocks in use), cached (cached free blocks)", labels=["state"]))
        return out


class MetricsServer:
    """``/metrics`` over HTTP for ``collector`` on ``host:port``, from a daemon thread, until :meth:`close`.

    Raises:
        ConfigError: the port is not in 1-65535 or cannot be bound (in use, or a host that is not local).
    """

    def __init__(self, collector: KVPoolCollector, port: int, host: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server

        port = as_int(port, "metrics port", minimum=1, maximum=65535, error=ConfigError)
        self.registry = CollectorRegistry()
        self.registry.register(collector)
        try:
            self._server, self._thread = start_http_server(port, host, registry=self.registry)
        except OSError as exc:
            why = (exc.strerror or str(exc)).lower()
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {why}") from None
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
