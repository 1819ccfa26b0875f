"""The subscriber side of the KV event stream: :class:`SequenceTracker` (the ordering and replay
bookkeeping, no sockets, no clock of its own) and :class:`KVEventSubscriber` (ZMQ sockets around it).

**What a subscriber delivers.** Batches in sequence order, each once. With a replay endpoint it asks the
publisher's replay socket for what it lacks: everything from 0 when it joins late, every gap, and (after
``idle_s`` without a message; ``replay_timeout_s`` while the replay socket is silent) anything published
since. A batch is counted ``missed`` only when the
publisher could not give it: the reply to a request that started at or before it, and was sent after a later
batch was known to exist, did not hold it (the publisher dropped it, or no longer keeps it). A gap that opens
while a request is outstanding is asked for again after that request's end marker. Three things end the
wait early, each counted: a request unanswered for ``replay_timeout_s`` (``replay_timeouts``: what it was to
fill is missed, delivery goes on), more than ``max_pending`` batches waiting behind a gap (``overflows``: the
oldest gap is given up), and a publisher restarted on the same endpoint (``restarts``: a live sequence number
at or below the last live one; the old stream's waiting batches are delivered, its gaps missed, and the
count starts again from 0).

**Limits.** A restarted publisher is recognised by its live stream only: one whose first batch the
subscriber hears is numbered past the last one it heard from the old publisher looks like a gap, and a
replay reply from the new publisher that arrives before its first live batch is taken for the old stream's.

This module sits on :mod:`kvpool.events.wire` (the wire types) and :mod:`kvpool.events.transport` (endpoints,
sockets); :mod:`kvpool.events` exports its names.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec

from kvpool.events.transport import END_SEQ, MAX_SEQ, check_endpoint, open_socket, require_zmq
from kvpool.events.wire import KVEventBatch
from kvpool.numeric import as_int, as_real


@dataclass
class _Request:
    """An outstanding replay request: from ``start``, sent when ``known`` was the highest sequence number
    known to exist (-1: none), last heard of at ``heard`` (seconds); ``top``: its highest reply frame."""

    start: int
    known: int
    heard: float
    top: int = -1


@dataclass(frozen=True)
class SubscriberStats:
    """A subscriber's counters (see the module docstring): batches ``delivered``, ``missed`` (never to be
    had), ``malformed`` (undecodable), publisher ``restarts``, ``replay_timeouts``, ``overflows``."""

    delivered: int
    missed: int
    malformed: int
    restarts: int
    replay_timeouts: int
    overflows: int


class SequenceTracker:
    """Orders one stream's batches by sequence number and decides when to ask the replay socket.

    The caller feeds it what arrives (:meth:`live`, :meth:`replay_frame`, :meth:`replay_end`, each with the
    time ``now`` in monotonic seconds), asks :meth:`poll` whether to send a replay request (and from which
    sequence number), and takes batches out with :meth:`pop`. ``generation`` goes up whenever an outstanding
    request is abandoned (timed out, or the publisher restarted): the caller then reads replies on a fresh
    replay socket, so a late reply to the old request is never taken for a new one's. Payloads are opaque.

    Raises:
        InvalidArgumentError: a negative idle period or timeout, or ``max_pending`` < 1.
    """

    def __init__(self, *, replay: bool, idle_s: float = 0.2, replay_timeout_s: float = 2.0,
                 max_pending: int = 10_000, now: float = 0.0) -> None:
        self.replay = replay
        self.idle_s = as_real(idle_s, "idle_s", minimum=0.0, open_min=True)
        self.replay_timeout_s = as_real(replay_timeout_s, "replay_timeout_s", minimum=0.0, open_min=True)
        self.max_pending = as_int(max_pending, "max_pending", minimum=1)
        self.generation = self.delivered = self.missed = 0
        self.restarts = self.replay_timeouts = self.overflows = 0
        self.last_heard = now
        self._ready: deque[tuple[int, Any]] = deque()  # an old stream's batches, after a restart
        self._request: _Request | None = None
        self._replay_alive = True  # False after a timeout, until the replay socket answers again
        self._new_stream()

    def _new_stream(self) -> None:
        self.next: int | None = 0 if self.replay else None  # the next sequence number to hand out
        self.last_live: int | None = None  # the last live sequence number heard
        self._pending: dict[int, Any] = {}  # received, >= next
        self._seen = -1  # the highest sequence number received from this stream
        self._settled = -1  # gaps at or below it cannot be filled: skipped, counted missed

    # ---- what arrives
    def live(self, seq: int, payload: Any, now: float) -> None:
        """A batch from the PUB socket."""
        self.last_heard = now
        if self.last_live is not None and seq <= self.last_live:
            self._restart()
        self.last_live = seq
        if self.next is None:
            self.next = seq
        self._store(seq, payload)
        if not self.replay:
            self._settle(seq - 1)  # nowhere to ask: a gap is missed at once

    def replay_frame(self, seq: int, payload: Any, now: float) -> None:
        """A batch from the replay socket (ignored when no request is outstanding)."""
        req = self._request
        if req is None:
            return
        req.heard = self.last_heard = now
        req.top, self._replay_alive = max(req.top, seq), True
        self._store(seq, payload)

    def replay_end(self, now: float) -> None:
        """The end marker of the outstanding request's reply: every gap it had to cover is missed; a gap it
        could not cover (opened after it was sent) is asked for again."""
        req = self._request
        if req is None:
            return
        self._request, self.last_heard, self._replay_alive = None, now, True
        self._settle(max(req.top, req.known))

    # ---- what to do
    def poll(self, now: float) -> int | None:
        """The start of a replay request to send now, or None. A request unanswered for
        ``replay_timeout_s`` is abandoned first: the gaps it was to fill are missed."""
        req = self._request
        if req is not None:
            if now - req.heard >= self.replay_timeout_s:
                self.replay_timeouts += 1
                self._abandon()
                self._replay_alive, self.last_heard = False, now
                self._settle(self._seen)
            return None
        if not self.replay or self.next is None or self.next > MAX_SEQ:  # past the last sequence number
            return None
        silence = self.idle_s if self._replay_alive else self.replay_timeout_s  # (slower when it is silent)
        idle = now - self.last_heard >= silence
        if not (idle or self._unresolved()):
            return None
        self._request = _Request(self.next, self._seen, now)
        self.last_heard = now
        return self.next

    def pop(self) -> tuple[int, Any] | None:
        """The next batch in order as ``(seq, payload)``, or None while it has not come."""
        got = self._ready.popleft() if self._ready else self._pop_pending()
        self.delivered += got is not None
        return got

    def give_up(self) -> None:
        """Stop waiting: every gap below the highest batch received is missed (what an exiting consumer
        does, so as to get the batches waiting behind a gap)."""
        self._abandon()
        self._settle(self._seen)

    @property
    def pending(self) -> int:
        """Batches received and waiting (behind a gap, or for :meth:`pop`)."""
        return len(self._pending) + len(self._ready)

    @property
    def waiting(self) -> bool:
        """Whether a replay request is outstanding."""
        return self._request is not None

    # ---- the bookkeeping
    def _store(self, seq: int, payload: Any) -> None:
        assert self.next is not None
        if seq < self.next or seq in self._pending:
            return  # had it already (live and replay overlap)
        if len(self._pending) >= self.max_pending and self.next not in self._pending:
            self.overflows += 1  # give up the oldest gap rather than grow without bound
            self._settle(min(self._pending))
        self._pending[seq] = payload
        self._seen = max(self._seen, seq)

    def _settle(self, upto: int) -> None:
        self._settled = max(self._settled, upto)

    def _skip_settled(self) -> None:
        """Move past gaps at or below the settled mark, counting them missed, up to a batch received."""
        if self.next is None or self.next > self._settled or self.next in self._pending or not self._pending:
            return
        target = min(min(self._pending), self._settled + 1)
        self.missed += target - self.next
        self.next = target

    def _unresolved(self) -> bool:
        """Whether a batch below the highest one received is neither here nor settled (ask for it)."""
        assert self.next is not None
        lo = max(self.next, self._settled + 1)
        return self._seen >= lo and sum(s >= lo for s in self._pending) < self._seen - lo + 1

    def _pop_pending(self) -> tuple[int, Any] | None:
        self._skip_settled()
        seq = self.next
        if seq is None or seq not in self._pending:
            return None
        self.next = seq + 1
        return seq, self._pending.pop(seq)

    def _abandon(self) -> None:
        if self._request is not None:
            self._request = None
            self.generation += 1

    def _restart(self) -> None:
        """The publisher started again from 0: hand out what the old stream left (its gaps missed)."""
        self.restarts += 1
        self._abandon()
        self._replay_alive = True  # a new publisher: its replay socket may answer
        self._settle(self._seen)
        while (got := self._pop_pending()) is not None:
            self._ready.append(got)
        self._new_stream()


class KVEventSubscriber:
    """Receives a :class:`~kvpool.events.transport.ZmqEventPublisher`'s (or vLLM's) batches in sequence order.

    Connects a SUB socket to ``endpoint`` (subscribed to ``topic``) and, with ``replay_endpoint``, a DEALER
    to the publisher's replay socket, and fills gaps from it as the module docstring says: ``idle_s``
    seconds of silence ask for anything published since, a request unanswered for ``replay_timeout_s``
    seconds is given up, at most ``max_pending`` batches wait behind a gap. Counters: ``missed``,
    ``malformed``, ``restarts``, ``replay_timeouts`` and :attr:`stats`. ``hwm``: the sockets' receive
    high-water marks, in messages (a whole replay should fit).

    Raises:
        ConfigError: a malformed endpoint.
        InvalidArgumentError: a bad period, timeout or bound.
        ImportError: pyzmq is not installed.
    """

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 idle_s: float = 0.2, replay_timeout_s: float = 2.0, max_pending: int = 10_000,
                 hwm: int = 1_000_000) -> None:
        zmq = require_zmq()
        check_endpoint(endpoint)
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint)
        self._tracker = SequenceTracker(replay=replay_endpoint is not None, idle_s=idle_s,
                                        replay_timeout_s=replay_timeout_s, max_pending=max_pending,
                                        now=time.monotonic())
        self._replay_endpoint, self._hwm, self._gen = replay_endpoint, hwm, 0
        self._ctx = zmq.Context()
        self._sub = open_socket(self._ctx, zmq.SUB, endpoint, bind=False, hwm=hwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._replay = None
        if replay_endpoint is not None:
            self._open_replay()
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self.malformed = 0

    @property
    def missed(self) -> int:
        """Batches never to be had (see the module docstring)."""
        return self._tracker.missed

    @property
    def restarts(self) -> int:
        """Times the publisher was seen to start again from 0."""
        return self._tracker.restarts

    @property
    def replay_timeouts(self) -> int:
        """Replay requests given up unanswered."""
        return self._tracker.replay_timeouts

    @property
    def stats(self) -> SubscriberStats:
        t = self._tracker
        return SubscriberStats(t.delivered, t.missed, self.malformed, t.restarts, t.replay_timeouts,
                               t.overflows)

    def recv(self, timeout: float | None = None) -> tuple[int, KVEventBatch] | None:
        """The next batch in sequence order as ``(seq, batch)``, waiting up to ``timeout`` seconds (None:
        forever); None when none came in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            got = self._deliver()
            if got is None:
                self._service()
                got = self._deliver()
            if got is not None:
                return got
            wait = min(self._tracker.idle_s, self._tracker.replay_timeout_s)  # (then poll the tracker again)
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            if wait <= 0:
                return None
            self._take(dict(self._poller.poll(max(1, int(wait * 1000)))))

    def drain(self) -> list[tuple[int, KVEventBatch]]:
        """The batches received and not yet handed out, in order, every gap before them given up (counted
        missed): what a consumer that stops calls last."""
        self._tracker.give_up()
        out = []
        while (got := self._deliver()) is not None:
            out.append(got)
        return out

    def _deliver(self) -> tuple[int, KVEventBatch] | None:
        while (got := self._tracker.pop()) is not None:
            try:
                return got[0], self._decode(got[1])
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.malformed += 1
        return None

    def _service(self) -> None:
        """Send the replay request the tracker asks for; a fresh replay socket after it abandoned one."""
        start = self._tracker.poll(time.monotonic())
        if self._tracker.generation != self._gen:
            self._open_replay()
        if start is not None and self._replay is not None:
            zmq = require_zmq()
            with contextlib.suppress(zmq.Again):  # no room to queue it: unanswered, it times out
                self._replay.send_multipart((b"", start.to_bytes(8, "big")), flags=zmq.NOBLOCK)

    def _take(self, ready: dict) -> None:
        now = time.monotonic()
        if self._sub in ready:  # live first: a restarted publisher is recognised before its replies
            frames = self._sub.recv_multipart()
            if len(frames) == 3 and len(frames[1]) == 8:
                self._tracker.live(int.from_bytes(frames[1], "big"), frames[2], now)
            else:
                self.malformed += 1
        if self._replay is not None and self._replay in ready and self._tracker.generation == self._gen:
            self._take_replay(self._replay.recv_multipart(), now)

    def _take_replay(self, frames: list[bytes], now: float) -> None:
        if len(frames) != 4 or len(frames[2]) != 8:
            self.malformed += 1
        elif frames[2] == END_SEQ:
            self._tracker.replay_end(now)
        else:
            self._tracker.replay_frame(int.from_bytes(frames[2], "big"), frames[3], now)

    def _open_replay(self) -> None:
        """(Re)connect the DEALER: a new socket never sees replies meant for the one before it."""
        zmq = require_zmq()
        if self._replay is not None:
            self._poller.unregister(self._replay)
            self._replay.close(linger=0)
        self._replay = open_socket(self._ctx, zmq.DEALER, self._replay_endpoint, bind=False, hwm=self._hwm)
        self._poller.register(self._replay, zmq.POLLIN)
        self._gen = self._tracker.generation

    def close(self) -> None:
        for sock in (self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
