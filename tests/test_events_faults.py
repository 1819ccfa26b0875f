"""KV event stream faults over real ZMQ sockets (ports from 27200-27299, see _ports): a publisher restarted
on the same endpoint, a replay socket that never answers, a client flooding the replay socket, a gap that
opens while a replay request is out, and `kvpool events` when the replay socket or the publisher is gone.
Time limits here only bound a failure; no test asserts how long anything took."""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from typing import Any

import pytest
from _ports import free_port, tcp

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from kvpool.events import (  # noqa: E402
    END_SEQ,
    BlockRemoved,
    KVEventBatch,
    KVEventSubscriber,
    ZmqEventPublisher,
)
from kvpool.events.transport import _Replays  # noqa: E402


def _batch(h: int) -> KVEventBatch:
    return KVEventBatch(0.0, [BlockRemoved([h], "GPU", 0)])


def _hash(batch: KVEventBatch) -> int:
    return batch.events[0].block_hashes[0]


def _pump(sub: KVEventSubscriber, done, got: list, *, each=None, limit: float = 30.0) -> list:
    """recv into ``got`` (calling ``each()`` between tries) until ``done(got)``; AssertionError after
    ``limit`` seconds (a failure bound, not a measurement)."""
    deadline = time.monotonic() + limit
    while not done(got):
        assert time.monotonic() < deadline, f"timed out with {len(got)} batches: {[s for s, _ in got][-5:]}"
        if each is not None:
            each()
        one = sub.recv(timeout=0.05)
        if one is not None:
            got.append(one)
    return got


def _sent(pub: ZmqEventPublisher, count: int) -> None:
    """Wait until the publisher's thread has sent ``count`` batches (AssertionError after 30 s)."""
    deadline = time.monotonic() + 30
    while pub.sent_batches < count:
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch) -> list:
    """Exceptions that escape any thread while the test runs."""
    errors: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    return errors


# ---- item 3: a publisher restarted on the same endpoint -------------------------------------------------


def test_a_publisher_restarted_on_the_same_endpoint_is_followed_from_0() -> None:
    live, replay = tcp(free_port()), tcp(free_port())
    old = ZmqEventPublisher(live, replay_endpoint=replay)
    n = iter(range(10**6))
    try:
        with KVEventSubscriber(live, replay_endpoint=replay) as sub:
            got = _pump(sub, lambda g: g and g[-1][0] >= 40, [], each=lambda: old.publish(_batch(next(n))))
            _pump(sub, lambda g: g[-1][0] >= old.last_seq, got)
            old.close()
            new = ZmqEventPublisher(live, replay_endpoint=replay)  # numbers from 0 again
            try:
                k = iter(range(1000, 10**6))
                after = _pump(sub, lambda g: len(g) >= 5, [], each=lambda: new.publish(_batch(next(k))))
                _pump(sub, lambda g: g[-1][0] >= new.last_seq, after)  # all the new one sent
            finally:
                new.close()
            assert (sub.restarts, sub.missed) == (1, 0)
    finally:
        old.close()
    assert [seq for seq, _ in got] == list(range(len(got)))
    # the new publisher's batches from its 0, each once, even those sent before the SUB reconnected
    assert [(seq, _hash(b)) for seq, b in after] == [(i, 1000 + i) for i in range(len(after))]


# ---- item 4: a replay socket that never answers ----------------------------------------------------------


def test_a_replay_socket_that_never_answers_times_out_and_delivery_goes_on() -> None:
    live = tcp(free_port())
    nobody = tcp(free_port())  # nothing is bound there
    pub = ZmqEventPublisher(live)  # and the publisher has no replay socket
    n = iter(range(10**6))
    try:
        for _ in range(10):  # before anyone subscribes: the subscriber joins late
            pub.publish(_batch(next(n)))
        _sent(pub, 10)
        with KVEventSubscriber(live, replay_endpoint=nobody, replay_timeout_s=0.5) as sub:
            got = _pump(sub, lambda g: len(g) >= 3, [], each=lambda: pub.publish(_batch(next(n))))
            first = got[0][0]
            assert first >= 10 and sub.missed == first and sub.replay_timeouts >= 1  # 0 .. first-1
            assert [seq for seq, _ in got] == list(range(first, first + len(got)))
            assert [_hash(b) for _, b in got] == [seq for seq, _ in got]
    finally:
        pub.close()


def test_batches_behind_an_unanswered_gap_are_bounded() -> None:
    live, nobody = tcp(free_port()), tcp(free_port())
    pub = ZmqEventPublisher(live)
    n = iter(range(10**6))
    try:
        pub.publish(_batch(next(n)))  # seq 0 before anyone listens: the gap
        _sent(pub, 1)
        with KVEventSubscriber(live, replay_endpoint=nobody, replay_timeout_s=3600, max_pending=8) as sub:
            def each() -> None:
                pub.publish(_batch(next(n)))
                assert sub._tracker.pending <= 8

            got = _pump(sub, lambda g: len(g) >= 3, [], each=each)
            assert sub.stats.overflows == 1 and sub.replay_timeouts == 0  # not the hour-long timeout
            assert sub.missed == got[0][0] >= 1
    finally:
        pub.close()


# ---- item 5: a replay flood does not stop the live stream; close under load ----------------------------


def test_replies_are_served_a_bounded_share_at_a_time_round_robin() -> None:
    buffer = deque((seq, b"p%d" % seq) for seq in (3, 4, 6))  # 5 was dropped
    replays = _Replays(buffer, b"t")
    replays.add(b"A", 4)
    replays.add(b"B", 0)
    buffer.append((7, b"p7"))  # after the requests came: not in their replies
    first = replays.frames(3)
    assert [(f[0], f[3]) for f in first] == [(b"A", (4).to_bytes(8, "big")), (b"B", (3).to_bytes(8, "big")),
                                             (b"A", (6).to_bytes(8, "big"))]
    rest = replays.frames(100)
    assert [(f[0], int.from_bytes(f[3], "big", signed=True)) for f in rest] == [
        (b"B", 4), (b"A", -1), (b"B", 6), (b"B", -1)]
    assert rest[1] == (b"A", b"", b"", END_SEQ, b"") and len(replays) == 0


def test_a_replay_flood_never_stops_the_live_stream_and_close_drains(thread_errors: list) -> None:
    live, replay = tcp(free_port()), tcp(free_port())
    pub = ZmqEventPublisher(live, replay_endpoint=replay, buffer_steps=2000)
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)  # asks for the whole buffer again and again, never reads a reply
    flood.setsockopt(zmq.SNDHWM, 10_000)
    flood.connect(replay)
    try:
        for i in range(2000):
            pub.publish(_batch(i))
        for _ in range(3000):  # 6 million reply frames: minutes of work, answered all at once before
            flood.send_multipart((b"", (0).to_bytes(8, "big")))
        _sent(pub, 2000)
        deadline = time.monotonic() + 30
        while pub.replay_frames == 0:  # the flood has reached the publisher
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with KVEventSubscriber(live) as sub:
            n = iter(range(2000, 10**6))
            got = _pump(sub, bool, [], each=lambda: pub.publish(_batch(next(n))))
            start = pub.last_seq + 1
            for i in range(500):  # live batches during the flood, then close at once
                pub.publish(_batch(10**6 + i))
            pub.close()
            got = _pump(sub, lambda g: g and g[-1][0] >= start + 499, [])
    finally:
        pub.close()
        flood.close(linger=0)
        ctx.term()
    assert [(seq, _hash(b)) for seq, b in got if seq >= start] == [(start + i, 10**6 + i) for i in range(500)]
    assert (pub.undelivered_batches, pub.thread_error, thread_errors) == (0, None, [])
    assert pub.sent_batches + pub.unsent_batches == pub.published_batches


class _StuckPublisher(ZmqEventPublisher):
    """A sending thread that sends nothing until close gives up on it."""

    def _step(self, encode: Any) -> bool:
        self._abort.wait()
        return super()._step(encode)


def test_close_out_of_time_counts_what_it_could_not_send(thread_errors: list) -> None:
    pub = _StuckPublisher(tcp(free_port()), replay_endpoint=tcp(free_port()))
    for i in range(1000):
        pub.publish(_batch(i))
    pub.close(timeout=0.01)
    assert (pub.sent_batches, pub.undelivered_batches, pub.published_batches) == (0, 1000, 1000)
    assert pub.thread_error is None and thread_errors == [] and not pub._thread.is_alive()


# ---- item 6: a gap that opens while a replay request is out ----------------------------------------------


class _ScriptedPublisher:
    """A hand-driven PUB + ROUTER pair: every batch kept; live sends chosen by the test."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.live, self.replay = tcp(free_port()), tcp(free_port())
        self.pub, self.router = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.ROUTER)
        self.pub.bind(self.live)
        self.router.bind(self.replay)
        self.kept: dict[int, bytes] = {}

    def publish(self, seq: int, *, live: bool = True) -> None:
        self.kept[seq] = msgspec.msgpack.encode(_batch(seq))
        if live:
            self.pub.send_multipart((b"", seq.to_bytes(8, "big"), self.kept[seq]))

    def request(self) -> tuple[bytes, int] | None:
        if not self.router.poll(0):
            return None
        ident, _, start = self.router.recv_multipart()
        return ident, int.from_bytes(start, "big")

    def answer(self, ident: bytes, start: int, upto: int) -> None:
        """The reply as the publisher makes it when it keeps batches ``start .. upto``."""
        for seq in range(start, upto + 1):
            self.router.send_multipart((ident, b"", b"", seq.to_bytes(8, "big"), self.kept[seq]))
        self.router.send_multipart((ident, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


def _request(sub: KVEventSubscriber, p: _ScriptedPublisher, got: list) -> tuple[bytes, int]:
    """Run the subscriber (its batches into ``got``) until it sends a replay request; that request."""
    asked: list = []
    _pump(sub, lambda _: bool(asked) or asked.extend(filter(None, [p.request()])) or bool(asked), got)
    return asked[0]


def test_a_gap_opened_while_a_request_is_out_is_asked_for_again() -> None:
    p = _ScriptedPublisher()
    n = iter(range(10**6))
    try:
        with KVEventSubscriber(p.live, replay_endpoint=p.replay, idle_s=3600, replay_timeout_s=3600) as sub:
            def answer_all() -> None:
                while (req := p.request()) is not None:
                    p.answer(*req, max(p.kept))

            got = _pump(sub, bool, [], each=lambda: p.publish(next(n)) or answer_all())  # joined
            s = max(p.kept)
            _pump(sub, lambda g: g[-1][0] == s, got, each=answer_all)
            p.publish(s + 1, live=False)  # lost on the way
            p.publish(s + 2)
            ident, start = _request(sub, p, got)
            assert start == s + 1
            p.publish(s + 3, live=False)  # a newer gap while the request is out
            p.publish(s + 4)
            _pump(sub, lambda _: sub._tracker.last_live == s + 4, got)  # heard s + 4
            p.answer(ident, start, s + 2)  # the reply made before s + 3 existed
            again = _request(sub, p, got)
            assert again[1] == s + 3  # the missing one asked for, not skipped as missed
            p.answer(*again, s + 4)
            _pump(sub, lambda g: g[-1][0] == s + 4, got)
            assert sub.missed == 0
    finally:
        p.close()
    assert [(seq, _hash(b)) for seq, b in got] == [(i, i) for i in range(s + 5)]


# ---- issue 23 item 5: kvpool events --kv-events-replay when the replay socket is gone; no publisher --------


def test_cli_events_with_its_replay_socket_gone_skips_ahead_and_says_what_it_missed(
        capsys: pytest.CaptureFixture) -> None:
    import json

    from kvpool.cli import main

    live, nobody = tcp(free_port()), tcp(free_port())
    pub = ZmqEventPublisher(live)
    out: list[str] = []
    err: list[str] = []

    def publish_until_it_prints() -> None:  # the CLI runs in this process, on the main thread
        deadline, i = time.monotonic() + 60, 5
        while not out and time.monotonic() < deadline:
            pub.publish(_batch(i))
            i += 1
            time.sleep(0.02)
            got = capsys.readouterr()
            out.append(got.out)
            err.append(got.err)
            out[:] = [text for text in out if text]

    try:
        for i in range(5):  # before the CLI subscribes
            pub.publish(_batch(i))
        _sent(pub, 5)
        feeder = threading.Thread(target=publish_until_it_prints)
        feeder.start()
        rc = main(["events", live, "--kv-events-replay", nobody, "--json", "--timeout", "3"])
        feeder.join()
    finally:
        pub.close()
    rest = capsys.readouterr()
    seqs = [json.loads(line)["seq"] for line in "".join([*out, rest.out]).splitlines()]
    assert rc == 0 and seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] >= 5
    (line,) = "".join([*err, rest.err]).splitlines()
    assert re.fullmatch(rf"kvpool events: {seqs[0]:,} messages missed, 0 malformed \({nobody} did not "
                        r"answer \d+ replay requests?\)", line), line


def test_cli_events_with_no_publisher_says_so(capsys: pytest.CaptureFixture) -> None:
    from kvpool.cli import main

    live = tcp(free_port())
    assert main(["events", live, "--kv-events-replay", tcp(free_port()), "--timeout", "0.3"]) == 0
    done = capsys.readouterr()
    assert done.out == "" and done.err.splitlines() == [f"kvpool events: no batch from {live} in 0.3 s"]
