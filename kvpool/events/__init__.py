"""KV cache events in vLLM's wire format: the event types, the sink a pool records into, the publishers
and the subscriber.

KV-aware routers (Dynamo's KV router, llm-d's KV indexer) learn which engine holds which prefix from the
event stream vLLM publishes; an engine on kvpool joins such a fleet by publishing the same stream.

The package, bottom up (a module imports only the ones before it; ``tests/test_layers.py`` checks the order):

* :mod:`~kvpool.events.wire`: the event types as vLLM 0.33 declares them, and the wire form of block hashes;
* :mod:`~kvpool.events.buffer`: the buffer a sink records into, compiled with the pool's hot path (it
  imports nothing of kvpool, so a pool imports it without ``msgspec``);
* :mod:`~kvpool.events.publishers`: the publisher base, the null publisher, a bounded in-process queue;
* :mod:`~kvpool.events.sink`: :class:`KVEventSink`, what a pool records into, flushed once per engine step;
* :mod:`~kvpool.events.transport`: vLLM's ZMQ protocol: endpoints, sockets, :class:`ZmqEventPublisher`;
* :mod:`~kvpool.events.subscriber`: :class:`KVEventSubscriber`, which receives the batches in order, fills
  gaps from the replay socket and follows a publisher restarted on the same endpoint.

Every public name of those modules is exported here and imported on first use, so importing the package
imports none of them (nor ``msgspec``). ``msgspec`` is needed for the event types and the sink, ``pyzmq``
for the ZMQ classes (both in kvpool's ``events`` extra).
"""

from __future__ import annotations

from kvpool._lazy import lazy_exports

_LAZY = {
    "WireHash": "kvpool.events.wire",
    "MEDIUM_GPU": "kvpool.events.wire",
    "MEDIUM_CPU": "kvpool.events.wire",
    "MEDIUM_STORAGE": "kvpool.events.wire",
    "FULL_ATTENTION": "kvpool.events.wire",
    "SPEC_KINDS": "kvpool.events.wire",
    "EventBatch": "kvpool.events.wire",
    "KVCacheEvent": "kvpool.events.wire",
    "BlockStored": "kvpool.events.wire",
    "BlockRemoved": "kvpool.events.wire",
    "AllBlocksCleared": "kvpool.events.wire",
    "KVEventBatch": "kvpool.events.wire",
    "HASH_FORMATS": "kvpool.events.wire",
    "wire_hash": "kvpool.events.wire",
    "wire_extra_keys": "kvpool.events.wire",
    "wire_hash_or_none": "kvpool.events.wire",
    "wire_token_ids": "kvpool.events.wire",
    "TOKEN_MIN": "kvpool.events.wire",
    "TOKEN_MAX": "kvpool.events.wire",
    "EventBuffer": "kvpool.events.buffer",
    "EventRecorder": "kvpool.events.buffer",
    "EventPublisher": "kvpool.events.publishers",
    "NullEventPublisher": "kvpool.events.publishers",
    "QueueEventPublisher": "kvpool.events.publishers",
    "KeySplit": "kvpool.events.sink",
    "KVEventSink": "kvpool.events.sink",
    "END_SEQ": "kvpool.events.transport",
    "MAX_SEQ": "kvpool.events.transport",
    "check_endpoint": "kvpool.events.transport",
    "open_socket": "kvpool.events.transport",
    "require_zmq": "kvpool.events.transport",
    "ZmqEventPublisher": "kvpool.events.transport",
    "KVEventSubscriber": "kvpool.events.subscriber",
    "SequenceTracker": "kvpool.events.subscriber",
    "SubscriberStats": "kvpool.events.subscriber",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
