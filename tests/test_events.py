"""KV events: the wire format against structs declared here as vLLM 0.33 declares them, the sink, the
publishers (queue, ZMQ PUB + replay ROUTER) and the subscriber. Servers take free ports of 27200-27299."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest
from _ports import free_port, tcp

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from kvpool.errors import ConfigError, InvalidArgumentError  # noqa: E402
from kvpool.events import (  # noqa: E402
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventSink,
    KVEventSubscriber,
    NullEventPublisher,
    QueueEventPublisher,
    ZmqEventPublisher,
    check_endpoint,
    wire_hash,
)

# ---- vLLM 0.33's declarations (vllm/distributed/kv_events.py), written out independently of kvpool ------


class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


H = [bytes([i]) * 16 for i in range(8)]  # 16-byte hashes, as kvpool's block_hashes gives


def _wait_for(fn, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError("timed out")


# ---- hashes and the sink -------------------------------------------------------------------------------


def test_wire_hash_formats() -> None:
    h = bytes(range(16))
    assert wire_hash(h) is h
    assert wire_hash(h, "int64") == 0x08090A0B0C0D0E0F  # the last 8 bytes, big-endian (vLLM's int mapping)
    assert wire_hash(123) == 123 and wire_hash(2**64 - 1, "int64") == 2**64 - 1
    for bad in (-1, 2**64, "abc", (1, 2), True):
        with pytest.raises(InvalidArgumentError):
            wire_hash(bad)
    with pytest.raises(InvalidArgumentError):
        wire_hash(h, "hex")


def test_sink_splits_runs_and_slices_tokens() -> None:
    pub = QueueEventPublisher()
    sink = KVEventSink(pub, block_size=2, medium="CPU", group_idx=3)
    tokens = [10, 11, 20, 21, 30, 31, 40, 41]
    keys = [(("lora", "sql", "/adapters/sql", ""),), None, (("mm", "img", 4), ("salt", "t")), None]
    sink.check_publish(H[:4], H[7], 4, tokens, keys)
    sink.stored(H[:4], [0, 2, 3], H[7], tokens, keys, "sql")  # block 1's hash was held elsewhere
    assert sink.pending_events == 2 and sink.flush(ts=12.5) == 2
    batch = pub.get(timeout=1)
    assert batch.ts == 12.5 and pub.published_batches == 1
    first, second = batch.events
    assert first == BlockStored([H[0]], H[7], [10, 11], 2, None, "CPU", "sql", [("sql",)], 3,
                                "full_attention")
    assert second == BlockStored([H[2], H[3]], H[1], [30, 31, 40, 41], 2, None, "CPU", "sql",
                                 [(("img", 4), "t"), None], 3, "full_attention")
    sink.removed([H[0], 5])
    sink.removed([])  # nothing left the index: no event
    sink.cleared()
    sink.flush()
    assert pub.get(timeout=1).events == [BlockRemoved([H[0], 5], "CPU", 3), AllBlocksCleared()]
    assert sink.flush() == 0 and pub.published_batches == 2  # an empty buffer publishes nothing


def test_sink_refuses_what_it_cannot_send() -> None:
    sink = KVEventSink(QueueEventPublisher(), block_size=4)
    with pytest.raises(InvalidArgumentError, match="bytes or an int"):
        sink.check_publish([H[0], ("a", 1)], None, 2, None, None)
    with pytest.raises(InvalidArgumentError, match="bytes or an int"):
        sink.check_publish([H[0]], -5, 1, None, None)  # the parent hash too
    with pytest.raises(InvalidArgumentError, match="8 tokens"):
        sink.check_publish(H[:2], None, 2, [1, 2, 3], None)
    with pytest.raises(InvalidArgumentError, match="one entry per block"):
        sink.check_publish(H[:2], None, 2, None, [None])
    with pytest.raises(InvalidArgumentError):
        KVEventSink(QueueEventPublisher(), block_size=0)
    with pytest.raises(InvalidArgumentError):
        KVEventSink(QueueEventPublisher(), block_size=4, hash_format="hex")


def test_sink_flushes_itself_at_its_bound() -> None:
    pub = QueueEventPublisher()
    sink = KVEventSink(pub, block_size=1, max_batch_events=3)
    for _ in range(7):
        sink.cleared()
    sink.removed([1])
    sink.removed([2])  # joins the removal before it: no new event
    assert [len(b.events) for b in pub.drain()] == [3, 3] and sink.pending_events == 2


def test_a_call_past_the_bound_fills_the_batch_and_keeps_the_rest() -> None:
    # max_batch_events=2: one storing call of three runs (positions 0, 2, 4 of five) is three events; the
    # sink publishes exactly two when the second is recorded, as if each went out when recorded, and keeps
    # the third; a removal then starts a new event (the last one kept is a BlockStored).
    pub = QueueEventPublisher()
    sink = KVEventSink(pub, block_size=1, max_batch_events=2)
    sink.check_and_store(H[:5], [0, 2, 4], None, [10, 11, 12, 13, 14], None, None)
    batches = pub.drain()
    assert [b.events for b in batches] == [[BlockStored([H[0]], None, [10], 1, None, "GPU", None, [None], 0,
                                                        "full_attention"),
                                            BlockStored([H[2]], H[1], [12], 1, None, "GPU", None, [None], 0,
                                                        "full_attention")]]
    assert sink.pending_events == 1
    sink.removed([H[4]])  # the second event: the batch goes out
    sink.removed([H[3]])  # after a flush: a new event
    assert [b.events for b in pub.drain()] == [
        [BlockStored([H[4]], H[3], [14], 1, None, "GPU", None, [None], 0, "full_attention"),
         BlockRemoved([H[4]], "GPU", 0)]]
    assert sink.take_events() == [BlockRemoved([H[3]], "GPU", 0)]


def test_removals_join_per_group_and_medium_until_something_comes_between() -> None:
    # Keys (group, hash); int64 hashes (the last 8 bytes). A removal naming groups 0 then 1 is two events:
    # with a reset before them the first fills the batch of two, the second is kept and the next removal of
    # group 1 joins it; one of the CPU sink recording into the same buffer does not, nor one of group 0.
    pub = QueueEventPublisher()
    sink = KVEventSink(pub, block_size=1, max_batch_events=2, hash_format="int64")
    sink.use_groups(lambda key: key, {0: ("full_attention", None), 1: ("sliding_window", 4)})
    host = sink.for_medium("CPU")
    wire = [int.from_bytes(h[8:], "big") for h in H]
    sink.cleared()
    sink.removed([(0, H[1]), (1, H[2])])
    assert [b.events for b in pub.drain()] == [[AllBlocksCleared(), BlockRemoved([wire[1]], "GPU", 0)]]
    sink.removed([(1, H[3])])
    assert sink.pending_events == 1
    host.removed([(1, H[4])])
    assert [b.events for b in pub.drain()] == [[BlockRemoved(wire[2:4], "GPU", 1),
                                                BlockRemoved([wire[4]], "CPU", 1)]]
    sink.removed([(1, H[5])])
    sink.removed([(0, H[6])])
    assert sink.take_events() == [] and [b.events for b in pub.drain()] == [
        [BlockRemoved([wire[5]], "GPU", 1), BlockRemoved([wire[6]], "GPU", 0)]]


def test_the_sink_keeps_its_own_copy_of_what_a_call_named() -> None:
    # Events are built when taken: a caller that reuses its lists after the call changes nothing sent.
    from kvpool.allocators.block_pool import BlockPool

    sink = KVEventSink(QueueEventPublisher(), block_size=2)
    pool = BlockPool(4, event_sink=sink)
    blocks = pool.allocate(2)
    hashes, tokens, keys = [H[0], H[1]], [1, 2, 3, 4], [None, (("salt", "s"),)]
    pool.cache_blocks(blocks, hashes, token_ids=tokens, extra_keys=keys)
    hashes[1], tokens[3], keys[1] = H[7], 99, None
    assert sink.take_events() == [BlockStored([H[0], H[1]], None, [1, 2, 3, 4], 2, None, "GPU", None,
                                              [None, ("s",)], 0, "full_attention")]


def test_a_sink_flushing_itself_into_a_closed_publisher_never_breaks_the_pool() -> None:
    # An evicting allocate records BlockRemoved after taking the victim; the sink then fills up and flushes
    # itself. A closed publisher used to raise there, leaving the victim neither in use nor free.
    from kvpool.allocators.block_pool import BlockPool

    pub = QueueEventPublisher()
    pool = BlockPool(2, event_sink=KVEventSink(pub, block_size=1, max_batch_events=1))
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [1, 2])  # BlockStored: a full sink, published
    pool.free(blocks)
    pub.close()
    assert pool.allocate(1) == [blocks[0]]  # evicts hash 1; its BlockRemoved batch is dropped, counted
    pool.check_integrity()
    assert (pub.published_batches, pub.dropped_batches, pub.dropped_events) == (1, 1, 1) and pub.closed
    owner = KVEventSink(pub, block_size=1)
    owner.cleared()
    with pytest.raises(InvalidArgumentError, match="closed"):  # the owner's own flush still says so
        owner.flush()


def test_token_ids_are_integers_by_the_rule_and_msgpack_can_carry_them() -> None:
    import numpy as np
    import torch

    pub = QueueEventPublisher()
    sink = KVEventSink(pub, block_size=2)
    for tokens in ([np.int64(5), 6], torch.tensor([5, 6]), np.array([5, 6])):
        sink.check_publish([H[0]], None, 1, tokens, None)
        sink.stored([H[0]], [0], None, tokens, None, None)
    events = [e for b in (sink.flush(), *pub.drain()) if not isinstance(b, int) for e in b.events]
    assert [type(t) for e in events for t in e.token_ids] == [int] * 6  # plain ints: encodable
    msgspec.msgpack.encode(KVEventBatch(0.0, events))
    for bad in ([1.5, 2], [True, 2], ["1", "2"], [2**64, 0], [-(2**63) - 1, 0]):
        with pytest.raises(InvalidArgumentError, match="token_ids"):
            sink.check_publish([H[0]], None, 1, bad, None)


def test_an_unencodable_batch_is_skipped_not_the_end_of_the_stream() -> None:
    # An extra key msgpack cannot carry used to kill the sending thread: every later batch was lost silently
    live = tcp(free_port())
    pub = ZmqEventPublisher(live)
    try:
        with KVEventSubscriber(live) as sub:
            _wait_for(lambda: pub.publish(KVEventBatch(0.0, [AllBlocksCleared()])) or sub.recv(timeout=0.05))
            bad = BlockStored([H[1]], None, [], 1, None, "GPU", None, extra_keys=[(object(),)])
            pub.publish(KVEventBatch(0.0, [bad]))
            pub.publish(KVEventBatch(0.0, [BlockRemoved([H[2]], "GPU", 0)]))
            seq, batch = _wait_for(lambda: sub.recv(timeout=0.05))
            assert batch.events[0].block_hashes == [H[2]] and pub.unsent_batches == 1
    finally:
        pub.close()


def test_a_sink_for_another_medium_shares_the_buffer() -> None:
    pub = QueueEventPublisher()
    device = KVEventSink(pub, block_size=1)
    host = device.for_medium("CPU")
    device.removed([1])
    host.removed([2])  # another medium: not joined to the device's removal
    device.removed([3])
    host.cleared()
    assert host.pending_events == device.pending_events == 4 and device.flush() == 4
    assert pub.get(timeout=1).events == [BlockRemoved([1], "GPU", 0), BlockRemoved([2], "CPU", 0),
                                         BlockRemoved([3], "GPU", 0), AllBlocksCleared()]
    assert host.pending_events == 0


def test_queue_publisher_drops_and_counts_when_full() -> None:
    pub = QueueEventPublisher(maxsize=2)
    for i in range(5):
        pub.publish(KVEventBatch(float(i), [AllBlocksCleared(), AllBlocksCleared()]))
    assert (pub.published_batches, pub.dropped_batches, pub.dropped_events) == (2, 3, 6)
    assert [b.ts for b in pub.drain()] == [0.0, 1.0]
    pub.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        pub.publish(KVEventBatch(0.0, []))
    assert NullEventPublisher().enabled is False and pub.enabled is True


# ---- the ZMQ wire ---------------------------------------------------------------------------------------


def _sub(ctx: Any, port: int, topic: bytes = b"") -> Any:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _joined(pub: ZmqEventPublisher, sub: Any) -> None:
    """Publish probes until the subscription has reached the publisher (ZMQ's slow joiner)."""
    sink = KVEventSink(pub, block_size=1)

    def probe() -> bool:
        sink.cleared()
        sink.flush()
        return bool(sub.poll(50))

    _wait_for(probe)
    while sub.poll(100):
        sub.recv_multipart()


def test_zmq_stream_decodes_with_vllm_structs_field_by_field() -> None:
    ctx = zmq.Context()
    port = free_port()
    pub = ZmqEventPublisher(tcp(port), topic="kv@engine0", data_parallel_rank=2)
    sub = _sub(ctx, port, b"kv@engine0")
    try:
        _joined(pub, sub)
        base = pub.last_seq + 1
        sink = KVEventSink(pub, block_size=4, medium="GPU", group_idx=0)
        tokens = list(range(100, 112))
        keys = [(("salt", "tenant-a"),), None, None]
        sink.stored([H[1], H[2], 99], range(3), H[0], tokens, keys, "ad")
        sink.flush(ts=1700000000.25)
        sink.removed([H[2], 99])
        sink.cleared()
        sink.flush(ts=1700000001.5)
        frames = [sub.recv_multipart() for _ in range(2)]
    finally:
        pub.close()
        sub.close(linger=0)
        ctx.term()
    decode = msgspec.msgpack.Decoder(VKVEventBatch).decode
    assert [f[0] for f in frames] == [b"kv@engine0"] * 2
    assert [f[1] for f in frames] == [base.to_bytes(8, "big"), (base + 1).to_bytes(8, "big")]
    one, two = decode(frames[0][2]), decode(frames[1][2])
    assert (one.ts, one.data_parallel_rank, len(one.events)) == (1700000000.25, 2, 1)
    stored = one.events[0]
    assert isinstance(stored, VBlockStored)
    assert stored.block_hashes == [H[1], H[2], 99]
    assert stored.parent_block_hash == H[0]
    assert stored.token_ids == tokens
    assert stored.block_size == 4
    assert stored.lora_id is None and stored.lora_name == "ad"  # kvpool's LoRA has no int id
    assert stored.medium == "GPU"
    assert stored.extra_keys == [("tenant-a",), None, None]
    assert stored.group_idx == 0
    assert stored.kv_cache_spec_kind == "full_attention" and stored.kv_cache_spec_sliding_window is None
    assert (stored.locality, stored.ownership, stored.session_id, stored.lookahead_token_ids) == (None,) * 4
    assert (two.ts, two.data_parallel_rank) == (1700000001.5, 2)
    removed, cleared = two.events
    assert isinstance(removed, VBlockRemoved) and isinstance(cleared, VAllBlocksCleared)
    assert (removed.block_hashes, removed.medium, removed.group_idx) == ([H[2], 99], "GPU", 0)
    # byte for byte what vLLM's structs encode for the same batch
    assert frames[1][2] == msgspec.msgpack.encode(two)
    raw = msgspec.msgpack.decode(frames[0][2])  # the untyped shape: [ts, [{"type": ...}], rank]
    assert raw[0] == 1700000000.25 and raw[2] == 2 and raw[1][0]["type"] == "BlockStored"
    assert "extra_keys" in raw[1][0] and "session_id" not in raw[1][0]  # defaults left out


def test_absent_subscriber_never_blocks_and_drops_are_counted() -> None:
    pub = ZmqEventPublisher(tcp(free_port()), max_queue_size=4, hwm=8)
    try:
        batch = KVEventBatch(0.0, [AllBlocksCleared()])
        start = time.perf_counter()
        for _ in range(20_000):
            pub.publish(batch)
        assert time.perf_counter() - start < 5.0
        assert pub.published_batches + pub.dropped_batches == 20_000 and pub.last_seq == 19_999
        assert pub.dropped_events == pub.dropped_batches
    finally:
        pub.close()


def test_replay_socket_speaks_vllms_protocol() -> None:
    ctx = zmq.Context()
    replay = tcp(free_port())
    pub = ZmqEventPublisher(tcp(free_port()), replay_endpoint=replay, topic="t", buffer_steps=3)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(replay)
    try:
        for i in range(5):  # seq 0..4; the buffer keeps 2, 3, 4
            pub.publish(KVEventBatch(float(i), [BlockRemoved([i], "GPU", 0)]))
        _wait_for(lambda: pub._queue.empty())
        time.sleep(0.1)
        dealer.send_multipart((b"", (3).to_bytes(8, "big")))
        replies = [dealer.recv_multipart() for _ in range(3)]
    finally:
        pub.close()
        dealer.close(linger=0)
        ctx.term()
    decode = msgspec.msgpack.Decoder(VKVEventBatch).decode
    assert [r[:3] for r in replies[:2]] == [[b"", b"t", seq.to_bytes(8, "big")] for seq in (3, 4)]
    assert [decode(r[3]).events[0].block_hashes for r in replies[:2]] == [[3], [4]]
    assert replies[2] == [b"", b"", END_SEQ, b""]


def test_late_subscriber_catches_up_through_replay() -> None:
    live, replay = tcp(free_port()), tcp(free_port())
    pub = ZmqEventPublisher(live, replay_endpoint=replay)
    try:
        sink = KVEventSink(pub, block_size=1)
        for i in range(30):  # all sent before anyone subscribes
            sink.removed([i])
            sink.flush()
        with KVEventSubscriber(live, replay_endpoint=replay) as sub:
            got = [sub.recv(timeout=5) for _ in range(30)]
            for i in range(30, 40):  # then live
                sink.removed([i])
                sink.flush()
            got += [sub.recv(timeout=5) for _ in range(10)]
            assert sub.missed == 0
    finally:
        pub.close()
    assert [seq for seq, _ in got] == list(range(40))
    assert [batch.events[0].block_hashes for _, batch in got] == [[i] for i in range(40)]


def test_subscriber_without_replay_counts_gaps() -> None:
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUB)  # a hand-driven publisher: sequence numbers 0, 1, then 5
    live = tcp(free_port())
    raw.bind(live)

    def send(seq: int, h: int) -> None:
        payload = msgspec.msgpack.encode(VKVEventBatch(0.0, [VBlockRemoved([h], "GPU")]))
        raw.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    try:
        with KVEventSubscriber(live) as sub:
            first = _wait_for(lambda: send(0, 0) or sub.recv(timeout=0.05))
            send(1, 1)
            send(5, 5)
            got = [sub.recv(timeout=5), sub.recv(timeout=5)]
            assert sub.missed == 3
    finally:
        raw.close(linger=0)
        ctx.term()
    assert first[0] == 0 and [(seq, b.events[0].block_hashes) for seq, b in got] == [(1, [1]), (5, [5])]


def test_the_last_sequence_number_is_no_crash_and_nan_prints_as_null() -> None:
    # A publisher's seq 2**64 - 1 made the subscriber ask its replay socket for 2**64: OverflowError, a
    # traceback from `kvpool events`. And a NaN timestamp printed as NaN, which no JSON parser reads.
    from kvpool.cli.events import event_dict

    ctx = zmq.Context()
    raw, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    live, replay = tcp(free_port()), tcp(free_port())
    raw.bind(live)
    router.bind(replay)
    payload = msgspec.msgpack.encode(VKVEventBatch(float("nan"), [VBlockRemoved([7], "GPU")]))
    try:
        with KVEventSubscriber(live, replay_endpoint=replay, idle_s=0.05) as sub:
            def step():
                raw.send_multipart((b"", (2**64 - 1).to_bytes(8, "big"), payload))
                while router.poll(0):  # answer every replay request: nothing kept
                    ident = router.recv_multipart()[0]
                    router.send_multipart((ident, b"", b"", END_SEQ, b""))
                return sub.recv(timeout=0.05)
            seq, batch = _wait_for(step)
            assert seq == 2**64 - 1 and sub.recv(timeout=0.3) is None  # idle asks: none past the last
    finally:
        raw.close(linger=0)
        router.close(linger=0)
        ctx.term()
    assert event_dict(seq, batch.ts, None, batch.events[0])["ts"] is None


def test_endpoints_are_checked() -> None:
    for good in ("tcp://127.0.0.1:5557", "tcp://*:5557", "tcp://localhost:1", "tcp://[::1]:80", "ipc:///tmp/x",
                 "inproc://kv"):
        assert check_endpoint(good) == good
    for bad in ("127.0.0.1:5557", "tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://127.0.0.1:65536",
                "udp://1.2.3.4:5", "tcp://a b:1", ""):
        with pytest.raises(ConfigError, match="malformed ZMQ endpoint"):
            check_endpoint(bad)


def test_port_in_use_is_one_config_error() -> None:
    in_use = pytest.raises(ConfigError, match="address already in use")
    a, b, c, d = (tcp(free_port()) for _ in range(4))
    with ZmqEventPublisher(a), in_use:
        ZmqEventPublisher(a)
    with ZmqEventPublisher(b, replay_endpoint=c):
        with pytest.raises(ConfigError, match=f"{c}: address already in use"):
            ZmqEventPublisher(d, replay_endpoint=c)
        ZmqEventPublisher(d).close()  # the failed one released d


# ---- kvpool events (the CLI) ----------------------------------------------------------------------------


def _kvpool(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpool", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_events_prints_one_line_per_event() -> None:
    import json

    live, replay = tcp(free_port()), tcp(free_port())
    pub = ZmqEventPublisher(live, replay_endpoint=replay)
    try:
        sink = KVEventSink(pub, block_size=2, medium="CPU")
        sink.stored([H[1], H[2]], range(2), None, [1, 2, 3, 4], None, None)
        sink.removed([H[1]])
        sink.flush()
        sink.cleared()
        sink.flush()
        human = _kvpool("events", live, "--kv-events-replay", replay, "--max-events", "3")
        as_json = _kvpool("events", live, "--kv-events-replay", replay, "--json", "--timeout", "1")
    finally:
        pub.close()
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    assert lines == [f"#0 BlockStored group 0 CPU: 2 blocks x 2 tokens (4 token ids) parent - "
                     f"[{H[1].hex()[:12]} {H[2].hex()[:12]}]",
                     f"#0 BlockRemoved group 0 CPU: 1 block [{H[1].hex()[:12]}]", "#1 AllBlocksCleared"]
    rows = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [r["type"] for r in rows] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert rows[0]["block_hashes"] == [H[1].hex(), H[2].hex()] and rows[0]["token_ids"] == [1, 2, 3, 4]
    assert rows[0]["seq"] == 0 and rows[2]["seq"] == 1 and rows[0]["data_parallel_rank"] == 0


@pytest.mark.parametrize("args", [["tcp://127.0.0.1"], ["tcp://127.0.0.1:1", "--kv-events-replay", "nope"]])
def test_cli_events_bad_endpoint_is_one_line(args: list[str], capsys: pytest.CaptureFixture) -> None:
    from kvpool.cli import main

    assert main(["events", *args, "--timeout", "0.1"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith("kvpool events: error: malformed ZMQ endpoint")
