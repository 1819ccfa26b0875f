"""Publishers of KV event batches: the base every publisher keeps (its counters, closing), the null
publisher and a bounded in-process queue. :mod:`kvpool.events.transport` adds the ZMQ publisher.

**Publishers** never block the caller. :class:`NullEventPublisher` drops everything (a pool given it gets no
sink); :class:`QueueEventPublisher` is a bounded in-process queue. A full queue drops the batch and counts it
(``dropped_batches``, ``dropped_events``).
"""

from __future__ import annotations

import queue

from kvpool.errors import InvalidArgumentError
from kvpool.events.wire import KVEventBatch
from kvpool.numeric import as_int


class EventPublisher:
    """Takes :class:`KVEventBatch` es and sends them somewhere; :meth:`publish` never blocks.

    Counters: ``published_batches`` / ``published_events`` (accepted), ``dropped_batches`` /
    ``dropped_events`` (refused because a bounded buffer was full, or, from a sink flushing itself, because
    the publisher was closed). ``enabled`` is False only for the null publisher: an engine given it records
    nothing. Use as a context manager, or call :meth:`close`.
    """

    enabled = True

    def __init__(self) -> None:
        self.published_batches = self.published_events = self.dropped_batches = self.dropped_events = 0
        self._closed = False

    def publish(self, batch: KVEventBatch) -> None:
        """Hand one batch over (or drop and count it).

        Raises:
            InvalidArgumentError: the publisher is closed.
        """
        if self._closed:
            raise InvalidArgumentError(f"{type(self).__name__} is closed")
        self.offer(batch)

    def offer(self, batch: KVEventBatch) -> bool:
        """:meth:`publish` that never raises: a closed publisher drops and counts the batch. What a sink
        calls in the middle of a pool's call (see :meth:`KVEventSink.flush`). Returns whether it was taken."""
        taken = not self._closed and self._offer(batch)
        if taken:
            self.published_batches += 1
            self.published_events += len(batch.events)
        else:
            self.dropped_batches += 1
            self.dropped_events += len(batch.events)
        return taken

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def _offer(self, batch: KVEventBatch) -> bool:
        """Take the batch; False when it had to be dropped."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop; batches already accepted are delivered first. Idempotent."""
        self._closed = True

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullEventPublisher(EventPublisher):
    """Publishes nothing (the default): an engine given it attaches no sink, so recording costs nothing."""

    enabled = False

    def _offer(self, batch: KVEventBatch) -> bool:
        return True


class QueueEventPublisher(EventPublisher):
    """A bounded in-process queue of batches (a router in the same process, tests).

    ``maxsize`` batches at most; a batch that finds it full is dropped and counted. :meth:`get` and
    :meth:`drain` take batches out, from any thread.
    """

    def __init__(self, maxsize: int = 10_000) -> None:
        super().__init__()
        maxsize = as_int(maxsize, "maxsize", minimum=1)
        self._queue: queue.Queue[KVEventBatch] = queue.Queue(maxsize)

    def _offer(self, batch: KVEventBatch) -> bool:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            return False
        return True

    def get(self, timeout: float | None = None) -> KVEventBatch | None:
        """The oldest batch, waiting up to ``timeout`` seconds (None: forever); None if none came."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def drain(self) -> list[KVEventBatch]:
        """Every batch queued now, oldest first."""
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

