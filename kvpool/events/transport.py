"""The ZMQ transport of KV events, vLLM's ``ZmqEventPublisher`` protocol: endpoints, sockets and
:class:`ZmqEventPublisher`.

:class:`ZmqEventPublisher` (``pyzmq``) sends each batch as vLLM's ZMQ publisher does: multipart ``(topic,
seq as 8-byte big-endian, msgpack payload)`` on a PUB socket, and keeps the last ``buffer_steps`` batches for
vLLM's replay protocol on a ROUTER socket. A full queue drops the batch and counts it; its sequence number is
skipped, so a subscriber sees the gap. Replay never holds up the live stream (a bounded share of reply frames
per live batch), and :meth:`ZmqEventPublisher.close` drains from the sending thread. The subscriber side
(:mod:`kvpool.events.subscriber`) opens its sockets with :func:`open_socket` and checks its endpoints with
:func:`check_endpoint`.

``pyzmq`` is needed for the sockets only (:func:`require_zmq` says so when it is missing).
"""

from __future__ import annotations

import bisect
import itertools
import operator
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from kvpool.errors import ConfigError
from kvpool.events.publishers import EventPublisher
from kvpool.events.wire import KVEventBatch
from kvpool.numeric import as_int

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay socket's end-of-replay marker."""
MAX_SEQ = (1 << 64) - 1
"""The last sequence number an 8-byte sequence frame carries."""

_TCP = re.compile(r"^tcp://(\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})$")


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if ZMQ can use it: ``tcp://HOST:PORT`` (HOST a name, an IPv4 address, ``[IPv6]`` or
    ``*``; PORT 1-65535), ``ipc://PATH`` or ``inproc://NAME``.

    Raises:
        ConfigError: anything else, naming the endpoint.
    """
    match = _TCP.match(endpoint) if isinstance(endpoint, str) else None
    if match and 1 <= int(match.group(2)) <= 65535:
        return endpoint
    if isinstance(endpoint, str) and re.match(r"^(ipc|inproc)://.+$", endpoint):
        return endpoint
    raise ConfigError(f"malformed ZMQ endpoint {endpoint!r}: expected tcp://HOST:PORT (port 1-65535), "
                      "ipc://PATH or inproc://NAME")


def require_zmq() -> Any:
    """The ``zmq`` module (pyzmq).

    Raises:
        ImportError: pyzmq is not installed.
    """
    try:
        import zmq
    except ImportError:
        raise ImportError("ZMQ KV events need pyzmq: pip install pyzmq") from None
    return zmq


def open_socket(ctx: Any, kind: int, endpoint: str, bind: bool, hwm: int) -> Any:
    """A socket of ``kind`` bound (or connected) to ``endpoint`` with high-water marks ``hwm`` (set first:
    ZMQ applies them to later binds and connects only); ConfigError for an address in use."""
    zmq = require_zmq()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    try:
        sock.bind(endpoint) if bind else sock.connect(endpoint)
    except zmq.ZMQError as exc:
        sock.close()
        why = zmq.strerror(exc.errno).lower()
        raise ConfigError(f"cannot {'bind' if bind else 'connect'} {endpoint}: {why}") from None
    return sock


class _Replays:
    """The replay requests being answered: a cursor each into the kept batches (ascending sequence
    numbers), answered a few frames at a time, round-robin, up to the last batch kept when it came."""

    def __init__(self, buffer: deque[tuple[int, bytes]], topic: bytes) -> None:
        self._buffer, self._topic = buffer, topic
        self._active: deque[list[Any]] = deque()  # [identity, next seq, last seq to send]

    def __len__(self) -> int:
        return len(self._active)

    def add(self, identity: bytes, start: int) -> None:
        self._active.append([identity, start, self._buffer[-1][0] if self._buffer else -1])

    def frames(self, budget: int) -> list[tuple[bytes, ...]]:
        """Up to ``budget`` ROUTER messages, each reply ending with its end marker."""
        out: list[tuple[bytes, ...]] = []
        while self._active and len(out) < budget:
            frame = self._frame(self._active[0])
            out.append(frame)
            if frame[3] is END_SEQ:
                self._active.popleft()
            else:
                self._active.rotate(-1)
        return out

    def _frame(self, cursor: list[Any]) -> tuple[bytes, ...]:
        identity, start, last = cursor
        i = bisect.bisect_left(self._buffer, start, key=operator.itemgetter(0))
        if i == len(self._buffer) or self._buffer[i][0] > last:  # (batches the buffer let go are gaps)
            return identity, b"", b"", END_SEQ, b""
        seq, payload = self._buffer[i]
        cursor[1] = seq + 1
        return identity, b"", self._topic, seq.to_bytes(8, "big"), payload


class ZmqEventPublisher(EventPublisher):
    """Publishes batches as vLLM's ``ZmqEventPublisher`` does (byte for byte), from a background thread.

    Each batch gets the next sequence number (0, 1, ...) when :meth:`publish` takes it and goes into a
    bounded queue of ``max_queue_size`` batches (full: dropped, counted, its number skipped); the thread
    encodes it (msgpack) and sends ``(topic, seq.to_bytes(8, "big"), payload)`` on a PUB socket (high-water
    mark ``hwm`` messages per subscriber: past it ZMQ drops for that subscriber, the sender never blocks)
    and keeps the last ``buffer_steps`` for replay.

    ``endpoint`` is bound (kvpool binds every address; a subscriber connects), or connected with
    ``connect=True`` (to a subscriber or proxy that binds; vLLM connects unless the address holds ``*``,
    ``::``, ``ipc://`` or ``inproc://``). ``replay_endpoint``: a ROUTER socket (always bound) answering
    vLLM's replay request ``(identity, b"", start_seq as 8 bytes)`` with ``(identity, b"", topic, seq,
    payload)`` for each kept batch from ``start_seq`` on, then ``(identity, b"", b"", END_SEQ, b"")``.
    ``data_parallel_rank`` is written into batches that carry none (vLLM writes its rank, 0 by default).
    A batch the thread cannot encode (a value msgpack cannot carry, e.g. in a caller's extra keys) is
    skipped and counted in ``unsent_batches``; its number is a gap, as a dropped batch's.

    Replay never holds up the live stream: the thread takes up to ``MAX_REPLAYS`` requests at a time (the
    rest wait in the socket) and sends at most ``REPLAY_FRAMES_PER_BATCH`` of their frames, round-robin,
    before each live batch. A reply holds the batches kept from ``start_seq`` up to the last one kept when
    the request was taken. Counters: ``sent_batches``, ``replay_frames``, ``undelivered_batches`` (still
    queued when :meth:`close` ran out of time); ``thread_error`` says why the thread stopped, if it failed.

    Raises:
        ConfigError: a malformed endpoint, or one that cannot be bound (an address in use).
        ImportError: pyzmq is not installed.
    """

    REPLAY_FRAMES_PER_BATCH = 64
    MAX_REPLAYS = 64

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 connect: bool = False, buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, data_parallel_rank: int = 0) -> None:
        super().__init__()
        zmq = require_zmq()
        check_endpoint(endpoint)
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint)
        buffer_steps, hwm, max_queue_size = (as_int(value, name, minimum=1) for name, value in (
            ("buffer_steps", buffer_steps), ("hwm", hwm), ("max_queue_size", max_queue_size)))
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self._topic, self._rank = topic.encode(), data_parallel_rank
        self._ctx = zmq.Context()
        self._replay = None
        try:
            self._pub = open_socket(self._ctx, zmq.PUB, endpoint, bind=not connect, hwm=hwm)
            if replay_endpoint is not None:  # room for a whole replay and its end marker
                self._replay = open_socket(self._ctx, zmq.ROUTER, replay_endpoint, bind=True,
                                     hwm=2 * (buffer_steps + 1))
        except BaseException:
            self._pub_close()
            raise
        self._seq = itertools.count()
        self.unsent_batches = 0  # taken, but not encodable: skipped by the sending thread (a gap)
        self.sent_batches = self.replay_frames = self.undelivered_batches = 0
        self.thread_error: str | None = None
        self._queue: queue.Queue[tuple[int, KVEventBatch]] = queue.Queue(max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._replays = _Replays(self._buffer, self._topic)
        self._stop, self._abort = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-kv-events", daemon=True)
        self._thread.start()

    @property
    def last_seq(self) -> int:
        """The sequence number of the latest batch taken (-1 before the first)."""
        return self.published_batches + self.dropped_batches - 1

    def _offer(self, batch: KVEventBatch) -> bool:
        seq = next(self._seq)
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            return False
        return True

    def _run(self) -> None:
        """The sending thread: it alone touches the sockets, and closes them when it ends."""
        encode = msgspec.msgpack.Encoder().encode
        try:
            while self._step(encode):
                pass
        except Exception as exc:  # never raise from the thread: keep what happened for the owner
            self.thread_error = f"{type(exc).__name__}: {exc}"
        finally:
            self.undelivered_batches = self._queue.qsize()
            self._pub_close(linger_ms=0 if self._abort.is_set() else 1000)  # let the last messages leave

    def _step(self, encode: Callable[[Any], bytes]) -> bool:
        """Answer a bounded share of the replay requests, then send one live batch; False: stop now."""
        stopping = self._stop.is_set()
        if self._abort.is_set():
            return False
        if self._replay is not None and not stopping:
            self._serve_replays()
        try:  # with replay work waiting, do not wait for a batch; when stopping, drain what is queued
            seq, batch = (self._queue.get_nowait() if stopping or len(self._replays)
                          else self._queue.get(timeout=0.02))
        except queue.Empty:
            return not stopping
        try:
            payload = encode(batch)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
            self.unsent_batches += 1  # a value msgpack cannot carry (an extra key): a gap, not a
            return True  # dead thread that would silently drop every later batch
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.sent_batches += 1
        return True

    def _serve_replays(self) -> None:
        """Take new requests (up to ``MAX_REPLAYS`` being answered) and send ``REPLAY_FRAMES_PER_BATCH``
        frames of them; anything that is not a replay request is ignored, as vLLM does."""
        while len(self._replays) < self.MAX_REPLAYS and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) == 3 and len(frames[2]) == 8:
                self._replays.add(frames[0], int.from_bytes(frames[2], "big"))
        frames = self._replays.frames(self.REPLAY_FRAMES_PER_BATCH)
        for frame in frames:
            self._replay.send_multipart(frame)  # a ROUTER never blocks: past a peer's hwm it drops
        self.replay_frames += len(frames)
        if frames:
            time.sleep(0)  # let the caller's threads have the interpreter between shares

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (waiting up to ``timeout`` seconds; replies still being sent are cut
        short), then close the sockets (the sending thread does, so that none closes under it). Batches
        left unsent when the time is up are counted in ``undelivered_batches``. Idempotent."""
        if self._closed:
            return
        super().close()
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abort.set()  # it ends after the step it is in
            self._thread.join()
        self.undelivered_batches = self._queue.qsize()  # (one taken while it closed included)

    def _pub_close(self, linger_ms: int = 0) -> None:
        """Close the sockets: the PUB socket's last messages get ``linger_ms`` to leave; replies still
        queued for a client that does not read them are dropped at once."""
        if getattr(self, "_pub", None) is not None:
            self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


