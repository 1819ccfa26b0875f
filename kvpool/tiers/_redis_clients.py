"""The connections of a Redis tier (:class:`~kvpool.tiers.redis.RedisTier`): a redis-py client per thread,
the retry interval after a lost server, and the deadline of each call.

Each thread that calls the tier gets a client of its own (a ``threading.local``), so a timeout or a dead
connection on one thread drops that thread's client only; no thread ever closes a client another thread is
using (:meth:`ThreadClients.close` closes the idle ones, a busy one is closed by its own thread when its call
ends). The retry interval is shared: once any thread finds the server gone, no thread connects again before
``retry_s`` has passed. Each call runs under a deadline (:class:`_Watchdog` shuts a late call's sockets).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

#: What a call into redis-py may raise for a fault of the medium: anything (see
#: :mod:`kvpool.tiers.redis`). Only redis-py calls run under it.
FAULTS = (Exception,)


class ThreadClients:
    """The redis-py clients of the server at ``url``, one per calling thread.

    Args:
        url: a checked ``redis://`` or ``rediss://`` URL.
        cluster: True/False to say whether ``url`` is a cluster; None asks the server (``INFO cluster``) on
            the first connection, and ``cluster`` holds the answer from then on.
        timeout_s: the deadline of each call (its connect, sends and replies together), in seconds.
        retry_s: how long the clients wait, once the server is lost, before any thread connects again.
    """

    def __init__(self, url: str, *, cluster: bool | None, timeout_s: float, retry_s: float) -> None:
        self.url, self.cluster = url, cluster
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._local = threading.local()  # .client: this thread's client, or None; .alarm: its call's deadline
        self._clients: dict[threading.Thread, Any] = {}  # every thread's live client (close() closes them)
        self._busy: set[threading.Thread] = set()  # threads inside a call on their client
        self._closed = False
        self._down_until = 0.0

    def here(self) -> Any:
        """The calling thread's client, or None."""
        return getattr(self._local, "client", None)

    def any_client(self) -> bool:
        """Whether any thread holds a live client."""
        with self._lock:
            return bool(self._clients)

    def extend_deadline(self) -> None:
        """Move the calling thread's call deadline ``timeout_s`` on from now (a long call that progresses)."""
        self._local.alarm.due = time.monotonic() + self.timeout_s

    @contextlib.contextmanager
    def using(self) -> Iterator[Any]:
        """This thread's client for one call (None: none can be had now), marked busy meanwhile so that
        :meth:`close` on another thread leaves it open; closed here at the end if the clients closed."""
        me, client = threading.current_thread(), None
        with self._lock:
            self._busy.add(me)  # before the client is had: close() never takes it from under the call
        alarm = self._local.alarm = _WATCHDOG.arm(self.timeout_s)  # the call's deadline, connect included
        try:
            client = alarm.target = self._connect()
            yield client
        finally:
            _WATCHDOG.disarm(alarm)
            with self._lock:
                self._busy.discard(me)
                closing = client is not None and self._closed and self._clients.get(me) is client
                if closing:
                    del self._clients[me]
            if closing:
                self._local.client = None
                with contextlib.suppress(*FAULTS):
                    client.close()

    def lose(self, exc: BaseException) -> None:
        """Drop the calling thread's client (only that one) and wait ``retry_s`` before any thread
        connects again."""
        client, self._local.client = self.here(), None
        alarm = getattr(self._local, "alarm", None)
        why = (f"TimeoutError: the call took longer than timeout_s={self.timeout_s:g} s (its deadline)"
               if alarm is not None and alarm.fired else f"{type(exc).__name__}: {exc}")
        with self._lock:
            if self._clients.get(threading.current_thread()) is client:
                self._clients.pop(threading.current_thread(), None)
            self._down_until = time.monotonic() + self.retry_s
            self.last_error = why
        if client is not None:
            with contextlib.suppress(*FAULTS):
                client.close()

    def close(self) -> None:
        """Close every idle thread's client now, and a busy one when its call ends; later calls get none."""
        with self._lock:
            self._closed = True
            self.last_error = self.last_error or "closed"
            idle = [t for t in self._clients if t not in self._busy]
            clients = [self._clients.pop(t) for t in idle]
        for client in clients:
            with contextlib.suppress(*FAULTS):
                client.close()

    def _connect(self) -> Any:
        """The calling thread's client, connecting first when it has none and the retry interval has
        passed (the connect runs outside the lock: a stalled server never holds up another thread)."""
        if self._closed:
            return None
        client = self.here()
        if client is not None:
            return client
        with self._lock:
            if self._closed or time.monotonic() < self._down_until:
                return None
        try:
            client = self._open()
        except FAULTS as exc:
            self.lose(exc)
            return None
        with self._lock:
            if self._closed:
                client.close()
                return None
            self._drop_ended_threads()
            self._clients[threading.current_thread()] = client
            self.last_error = None
        self._local.client = client
        return client

    def _open(self) -> Any:
        """A new client of the server (a cluster client when the server says it is one)."""
        options = dict(socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                       retry=Retry(NoBackoff(), 0))
        alarm = self._local.alarm
        client = alarm.target = redis.Redis.from_url(self.url, **options)
        try:
            if self.cluster is None:
                self.cluster = client.info("cluster").get("cluster_enabled") == 1
            if self.cluster:
                client.close()
                client = alarm.target = RedisCluster.from_url(self.url, **options)
            else:
                client.ping()
        except BaseException:
            with contextlib.suppress(*FAULTS):
                client.close()
            raise
        return client

    def _drop_ended_threads(self) -> None:
        """Close the clients of threads that have ended (under the lock)."""
        for thread in [t for t in self._clients if not t.is_alive()]:
            with contextlib.suppress(*FAULTS):
                self._clients.pop(thread).close()


# ---- the deadline of each call -------------------------------------------------------------------------


class _Alarm:
    """One call's deadline (``due``, on ``time.monotonic``): ``target`` is the client its sockets are shut
    on once it passes (set when the call has one); ``fired`` says that happened."""

    __slots__ = ("due", "target", "fired")

    def __init__(self, due: float) -> None:
        self.due, self.target, self.fired = due, None, False


class _Watchdog:
    """Cuts off the calls that pass their deadline: one daemon thread for the process, which shuts every
    connection of a late call's client (redis-py's ``disconnect``: a ``shutdown`` wakes a read or a send
    blocked on another thread, which then raises) and again every ``AGAIN_S`` until the call ends (a connect
    under way has no socket to shut yet). The thread sleeps until the earliest deadline armed; arming a call
    wakes it only when that call is due sooner (calls of one timeout never are), and a call that ends just
    disarms. A late call's client is dropped by the tier, as on any fault."""

    AGAIN_S = 0.05

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: set[_Alarm] = set()
        self._until = math.inf  # when the thread wakes next (inf: when told)
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float) -> _Alarm:
        alarm = _Alarm(time.monotonic() + seconds)
        with self._cond:
            self._armed.add(alarm)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvpool-redis-deadlines", daemon=True)
                self._thread.start()
            elif alarm.due < self._until:
                self._cond.notify()
        return alarm

    def disarm(self, alarm: _Alarm) -> None:
        with self._cond:
            self._armed.discard(alarm)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                late = [a for a in self._armed if a.due <= now]
                for alarm in late:
                    alarm.fired, alarm.due = True, now + self.AGAIN_S
                self._until = min((a.due for a in self._armed), default=math.inf)
                if not late:
                    self._cond.wait(None if self._until == math.inf else self._until - now)
                    continue
            for alarm in late:  # outside the lock: a shutdown may take a moment
                _shut(alarm.target)

    def _forget(self) -> None:
        """In a forked child: no thread yet, nothing armed (the parent's calls are not the child's)."""
        self._cond, self._armed, self._until, self._thread = threading.Condition(), set(), math.inf, None


_WATCHDOG = _Watchdog()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCHDOG._forget)


def _shut(client: Any) -> None:
    """Shut every connection of ``client`` (a redis-py client; None: nothing yet), in use or not."""
    if client is None:
        return
    with contextlib.suppress(*FAULTS):
        if isinstance(client, RedisCluster):
            client.disconnect_connection_pools()
        else:
            client.connection_pool.disconnect()
