"""Options the consumers share to be observed: KV events over ZMQ (``--kv-events``, generate and replay) and
a Prometheus ``/metrics`` server (``--metrics-port``, generate). Both bind before any work starts, so a
malformed endpoint or a port in use fails at once (one line, exit 2)."""

from __future__ import annotations

import argparse
from typing import Any

from kvpool.cli._args import positive_int
from kvpool.errors import ConfigError


def add_event_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV cache events (vLLM's ZMQ wire format; kvpool events reads them)")
    group.add_argument("--kv-events", metavar="ENDPOINT",
                       help="publish KV cache events on this ZMQ address (bound), e.g. tcp://127.0.0.1:5557")
    group.add_argument("--kv-events-replay", metavar="ENDPOINT",
                       help="serve missed event batches on this address (vLLM's replay socket)")


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Prometheus metrics")
    group.add_argument("--metrics-port", type=positive_int, metavar="P",
                       help="serve the pool's metrics at http://HOST:P/metrics while it runs")
    group.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                       help="address the metrics server binds (default: 127.0.0.1; 0.0.0.0 for all)")


class Observers:
    """The publisher and the metrics server the options ask for (each None when not asked for); a context
    manager that closes both (the publisher sends what it still holds first)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.publisher: Any = None
        self.collector: Any = None
        self.server: Any = None
        replay = getattr(args, "kv_events_replay", None)
        if replay is not None and args.kv_events is None:
            raise ConfigError("--kv-events-replay needs --kv-events")
        try:
            if args.kv_events is not None:
                from kvpool.events.transport import ZmqEventPublisher

                self.publisher = ZmqEventPublisher(args.kv_events, replay_endpoint=replay)
            if getattr(args, "metrics_port", None) is not None:
                from kvpool.metrics import KVPoolCollector, MetricsServer

                self.collector = KVPoolCollector(publisher=self.publisher)
                self.server = MetricsServer(self.collector, args.metrics_port, args.metrics_host)
        except BaseException:
            self.close()
            raise

    def event_sink(self, *, block_size: int) -> Any:
        """A sink for a pool of ``block_size``-token blocks that publishes to ``publisher``, or None."""
        if self.publisher is None:
            return None
        from kvpool.events.sink import KVEventSink

        return KVEventSink(self.publisher, block_size=block_size)

    def watch_engine(self, engine: Any) -> None:
        """Export ``engine``'s pool, prefix hits (every admission's, wherever the blocks were found: the
        device or a tier), preemptions and KV memory (reserved, committed, used, cached bytes) on the metrics
        server, if there is one, and its cached-token accounting and sessions; with tiers attached (call it
        after them), the host tier's pool too, labelled ``tier="host"``; a recurrent hybrid's state slots and
        checkpoints."""
        if self.collector is None:
            return
        self.collector.preemptions = lambda: engine.stats.preemptions
        self.collector.add_pool(engine.pool, block_size=engine.block_size,
                                stats=engine.kv_manager.prefix_cache_stats,
                                token_slots_used=engine.num_token_slots_used)
        if getattr(engine, "states", None) is not None:
            self.collector.add_states(engine.states)
        self.collector.add_memory(engine.memory_stats)
        self.collector.add_usage(engine.kv_manager)
        host = engine.offload.host if engine.offload is not None else None
        if host is not None:
            self.collector.add_pool(host.pool, block_size=engine.block_size, tier="host")

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.publisher is not None:
            self.publisher.close()

    def __enter__(self) -> Observers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
