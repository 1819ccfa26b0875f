"""``RedisTier``: blocks in a Redis server or a Redis Cluster (redis-py), shared by every process that uses
the same server and namespace.

Key of a block: ``<prefix>:<namespace tag>:<32 hex digits of the block key>``; value: a hash of two fields,
``h`` the 64-byte header with its MAC and ``p`` the payload (:mod:`kvpool.tiers.backend`), so the payload
goes to the socket straight from the tier's rows, never copied into one string first (``HSET`` /
``HMGET``: one key, written and evicted as a whole). Calls are pipelined (``EXISTS``/``HMGET``/``HSET``
batches; on a cluster redis-py's cluster pipeline splits them by node). Capacity is the server's business: set
``maxmemory`` and an eviction policy (``allkeys-lru``) there; a key the server evicted is a miss.

Faults never raise: a server that is down, killed mid-run or unreachable at start makes every call a miss
(``errors``) or a store failure; the tier then waits ``retry_s`` seconds before it tries to connect again,
so a dead server costs one failed connect per interval, not one per call. Whether the URL names a cluster
is asked of the server (``INFO cluster``) on the first connection, unless ``cluster`` says so.

Threads: each thread that calls the tier gets a client of its own (a ``threading.local``; the offload
manager's engine thread reads, its writer thread stores), so a timeout or a dead connection on one thread
drops that thread's client only, never the socket under another thread's pipeline; no thread ever closes a
client another thread is using (:meth:`RedisTier.close` closes the idle ones, a busy one is closed by its
own thread when its call ends). The retry interval is shared: once any thread finds the server gone, no
thread connects again before ``retry_s`` has passed. Clients of threads that ended are closed when the next
one connects.

The server is not trusted: whatever redis-py raises during a call (its own errors, a socket's, and what
its reply parsing raises on bytes from a broken or hostile server: ``ValueError``, ``IndexError``, ...) is
a fault of the medium, and a reply of the wrong shape is a ``corrupt`` miss. Each call has a deadline,
``timeout_s`` for the whole call (its connect, sends and replies together, not per socket read): a server
that answers a byte at a time is cut off there (:class:`_Watchdog` shuts the call's sockets) and the call is
a miss, as for a dead server. Replies the tier reads itself are bounded in bytes: a line (an integer, an
error, a length) of at most ``LINE_BYTES``, a field of at most a block's value; more is a fault of the
medium, found before the rest is read.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import urllib.parse
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import redis
import torch
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

try:  # redis-py's buffered reader: the integer replies are read by the tier only where it is the plain one
    from redis._parsers.socket import SocketBuffer
except ImportError:  # another redis-py layout: its own parser reads every reply
    SocketBuffer = None

from kvpool.errors import ConfigError, IntegrityError
from kvpool.numeric import as_optional_int, as_real
from kvpool.tiers.auth import TierKey, redact_url, require_auth_key
from kvpool.tiers.backend import HEADER_BYTES, Namespace, TierBackend, block_keys, encode_header, verify_parts

SCHEMES = ("redis", "rediss")
#: Bytes of values per pipeline at most (a batch of big blocks is split).
PIPELINE_BYTES = 64 * 2**20
#: What a call into redis-py may raise for a fault of the medium: anything (see the module docstring). Only
#: redis-py calls run under it.
_FAULTS = (Exception,)
_FIELDS = (b"h", b"p")
#: Payload bytes up to which a value is sent as ``bytes`` (redis-py's own buffer cutoff: 6,000).
SMALL_VALUE = 6000
#: Bytes of one reply line the tier reads (``:<int>``, ``-<error>``, ``$<len>``, ``*<len>``) at most: Redis's
#: longest error messages are ~100 bytes.
LINE_BYTES = 1024
#: Replies in an array the tier reads at most (``HMGET`` answers 2; a few more are read, as a ``corrupt``
#: value, not a fault).
ARRAY_ITEMS = 8


def check_url(url: str) -> str:
    """``url`` if it reads ``redis://HOST:PORT[/DB]`` (or ``rediss://``, user and password allowed; DB in
    ASCII digits); ConfigError naming what is wrong otherwise. A query string (redis-py's connection
    options: its values are only parsed at the first connection, which must never raise) or a fragment is
    refused: the tier sets its own timeouts (``timeout_s``)."""
    if not isinstance(url, str):
        raise _bad_url(url, "expected a str")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except (ValueError, TypeError):
        raise _bad_url(url, "the port must be a number in 0-65535") from None
    if parts.scheme not in SCHEMES or not parts.hostname:
        raise _bad_url(url, "expected redis://HOST:PORT (or rediss://)")
    if port is None or not port > 0:
        raise _bad_url(url, "give the port, e.g. redis://127.0.0.1:6379")
    db = parts.path.strip("/")
    if db and not (db.isascii() and db.isdigit() and int(db) < 2**31):
        raise _bad_url(url, "the path may only name a database number")
    if parts.query or parts.fragment or url.rstrip().endswith(("?", "#")):
        raise _bad_url(url, "no ?options or #fragment (give redis://HOST:PORT[/DB])")
    return url


class RedisTier(TierBackend):
    """Blocks under ``namespace`` in the Redis (or Redis Cluster) at ``url``.

    Args:
        url: ``redis://HOST:PORT[/DB]`` or ``rediss://...`` (any node of a cluster).
        namespace: as for every tier.
        block_bytes: as for every tier (``block_bytes=0``: hash-only values).
        prefix: the first part of every key.
        cluster: True/False to say whether ``url`` is a cluster; None asks the server.
        timeout_s: the deadline of each call (its connect, sends and replies together), in seconds.
        retry_s: how long a tier that lost its server waits before it connects again.
        ttl_s: an expiry for every stored value (None: none; the server's maxmemory policy evicts).
        auth_key: the fleet's :class:`~kvpool.tiers.auth.TierKey` (str or bytes: a secret) that signs and
            verifies every value (``TierKey.from_env()``; ``TierKey.public()`` to opt out).

    Raises:
        ConfigError: a malformed URL, no ``auth_key`` (an unreachable server is not an error: its calls
            miss).
    """

    medium = "remote"

    def __init__(self, url: str, namespace: Namespace, *, block_bytes: int, prefix: str = "kvpool",
                 cluster: bool | None = None, timeout_s: float = 2.0, retry_s: float = 1.0,
                 ttl_s: int | None = None, auth_key: TierKey | str | bytes | None = None) -> None:
        super().__init__(namespace, block_bytes)
        self._timeout = as_real(timeout_s, "timeout_s", minimum=0, open_min=True, finite=True)
        self._retry = as_real(retry_s, "retry_s", minimum=0, finite=True)
        self._ttl = as_optional_int(ttl_s, "ttl_s", minimum=1)
        self.url = check_url(url)
        self.auth_key = require_auth_key(auth_key, "a Redis tier")
        self.cluster = cluster
        self._key_head = f"{prefix}:{namespace.tag}:".encode()
        self._local = threading.local()  # .client: this thread's client, or None
        self._clients: dict[threading.Thread, Any] = {}  # every thread's live client (close() closes them)
        self._busy: set[threading.Thread] = set()  # threads inside a call on their client
        self._closed = False
        self._down_until = 0.0
        self._stored_keys = 0
        self.last_error: str | None = None
        self._per_pipeline = max(1, PIPELINE_BYTES // self.value_bytes)

    # ---- the interface ------------------------------------------------------------------------------

    def exists(self, keys: Sequence[Hashable]) -> int:
        """Leading keys present, asked in growing pipelines (64, 256, 1024, ... keys: one round trip for
        a probe's first window) that stop at a miss; each key is converted when its pipeline is built. A key
        is present only when ``EXISTS`` answers 1; 0 is a miss, and any other reply (an error such as
        ``-BUSY``, ``-LOADING``, ``-NOPERM``, another number, another type) a counted error that ends the
        run there."""
        n, step = 0, 64
        while n < len(keys):
            part = [self._name(k) for k in block_keys(keys[n:n + step])]
            found = self._pipelined("exists", part)
            if found is None:
                return n
            for present in found:
                if not _is_int(present, 1):
                    if not _is_int(present, 0):
                        self._count("errors")
                    return n
                n += 1
            step *= 4
        return n

    def get(self, keys: Sequence[Hashable], out: torch.Tensor | None) -> int:
        names = self._check_rows(keys, out, "out")
        n = 0
        while n < len(names):
            part = names[n:n + self._per_pipeline]
            values = self._pipelined("hmget", [self._name(k) for k in part])
            if values is None:
                break
            ok = self._take(part, values, out, n)
            n += ok
            if ok < len(part):
                break
        with self._lock:
            self._stats.loaded += n
            self._stats.loaded_bytes += n * self.block_bytes
        return n

    def set(self, keys: Sequence[Hashable], blocks: torch.Tensor | None) -> int:
        names = self._check_rows(keys, blocks, "blocks")
        stored = 0
        for start in range(0, len(names), self._per_pipeline):
            part = names[start:start + self._per_pipeline]
            values = [self._value(k, blocks[start + i] if blocks is not None and self.block_bytes else None)
                      for i, k in enumerate(part)]
            done = self._pipelined("hset", [self._name(k) for k in part], values) or []
            # HSET of two fields answers the fields it added: 2 for a new block, 0 (or 1) for a key that
            # was there (a rewrite); anything else is a failed store
            ok = sum(1 for r in done if _is_int(r, 0, 1, 2))
            fresh = sum(1 for r in done if _is_int(r, 2))
            with self._lock:
                self._stats.stored += ok
                self._stats.stored_bytes += ok * self.block_bytes
                self._stats.store_failures += len(part) - ok
                self._stored_keys += fresh
            stored += ok
        return stored

    def delete(self, keys: Sequence[Hashable]) -> int:
        names = [self._name(k) for k in block_keys(keys)]
        done = (self._pipelined("delete", names) if names else []) or []
        gone = sum(1 for r in done if _is_int(r, 1))  # DEL of one key: 1 when it was there
        with self._lock:
            self._stored_keys = max(0, self._stored_keys - gone)
        return gone

    def clear(self) -> int:
        """Delete every key of this namespace (SCAN then DEL, every node of a cluster); 0 when the server
        cannot be reached."""
        names = self._scan()
        if names is None:
            return 0
        gone = 0
        for start in range(0, len(names), 1000):
            done = self._pipelined("delete", names[start:start + 1000]) or []
            gone += sum(1 for r in done if _is_int(r, 1))
        with self._lock:
            self._stored_keys = 0
        return gone

    @property
    def capacity_bytes(self) -> int | None:
        return None  # the server's maxmemory, and its eviction policy, bound it

    @property
    def used_bytes(self) -> int:
        """Bytes of the values this tier stored and did not delete (the server may have evicted some)."""
        return self._stored_keys * self.value_bytes

    @property
    def num_blocks(self) -> int:
        return self._stored_keys

    @property
    def connected(self) -> bool:
        """Whether the calling thread holds a live client (after its last call)."""
        return self._here() is not None

    def check_integrity(self) -> None:
        """Counters are non-negative; a tier without a client is waiting to retry."""
        s = self.stats()
        if min(s.to_dict().values()) < 0 or self._stored_keys < 0:
            raise IntegrityError(f"redis tier counters went negative: {s}")
        with self._lock:
            clientless = not self._clients
        if clientless and self.last_error is None and (s.errors or s.store_failures):
            raise IntegrityError("redis tier lost its client without recording why")

    def close(self) -> None:
        """Close every idle thread's client now, and a busy one when its call ends; later calls miss."""
        with self._lock:
            self._closed = True
            self.last_error = self.last_error or "closed"
            idle = [t for t in self._clients if t not in self._busy]
            clients = [self._clients.pop(t) for t in idle]
        for client in clients:
            with contextlib.suppress(*_FAULTS):
                client.close()

    # ---- redis --------------------------------------------------------------------------------------

    def _name(self, key: bytes) -> bytes:
        return self._key_head + key.hex().encode()

    def _value(self, key: bytes, row: torch.Tensor | None) -> tuple[bytes, Any]:
        """A value's two fields, header then payload. A payload of up to ``SMALL_VALUE`` bytes goes as
        ``bytes`` (joined with the other small pieces of the pipeline into one buffer); a larger one as a
        view of the row, never copied, sent with a ``sendall`` of its own."""
        payload: Any = memoryview(row.numpy()) if row is not None else b""
        header = encode_header(self._ns, key, payload, auth_key=self.auth_key)
        if len(payload) <= SMALL_VALUE and not isinstance(payload, bytes):
            payload = bytes(payload)
        return header, payload

    def _take(self, keys: list[bytes], values: list[Any], out: torch.Tensor | None, start: int) -> int:
        """Verify fetched ``[header, payload]`` pairs into ``out[start:]``; how many leading ones were good
        (the first bad one is counted as a miss)."""
        for i, (key, value) in enumerate(zip(keys, values, strict=True)):
            if isinstance(value, redis.ResponseError) and str(value).startswith("WRONGTYPE"):
                why = "corrupt"  # not a hash: someone else's value
            elif isinstance(value, Exception):
                why = "errors"  # -BUSY, -LOADING, -NOPERM, ...: the server could not answer
            elif not (isinstance(value, list) and len(value) == 2
                      and all(v is None or isinstance(v, bytes) for v in value)):
                why = "corrupt"  # no HMGET of two fields answers this: a broken or hostile server
            elif value[0] is None or value[1] is None:
                why = "missing" if value[0] is None and value[1] is None else "corrupt"
            else:
                header, payload = value
                why = verify_parts(header, payload, self._ns, key, self.block_bytes, auth_key=self.auth_key)
            if why is not None:
                with self._lock:
                    setattr(self._stats, why, getattr(self._stats, why) + 1)
                return i
            if out is not None and self.block_bytes:
                memoryview(out[start + i].numpy())[:] = payload
        return len(keys)

    def _pipelined(self, command: str, names: list[bytes], values: list[tuple[bytes, Any]] | None = None
                   ) -> list[Any] | None:
        """Run ``command`` once per name in one pipeline (one reply per name, an error reply as its
        ``ResponseError``); None when the server cannot be reached (the call is counted as an error and the
        client dropped until ``retry_s`` has passed)."""
        with self._using() as client:
            if client is None:
                self._count_unreachable(command)
                return None
            try:
                if self.cluster:
                    done = self._cluster_pipeline(client, command, names, values)
                else:
                    per_name = 2 if command == "hset" and self._ttl is not None else 1
                    packed = _pack(command, names, values, self._ttl)
                    field = max(HEADER_BYTES, self.block_bytes) if command == "hmget" else LINE_BYTES
                    done = _send_packed(client, packed, per_name * len(names), field)
            except _FAULTS as exc:
                self._lose(exc)
                self._count_unreachable(command)
                return None
        return done[::2] if command == "hset" and self._ttl is not None else done

    def _cluster_pipeline(self, client: Any, command: str, names: list[bytes],
                          values: list[tuple[bytes, Any]] | None) -> list[Any]:
        """The pipeline through redis-py's cluster pipeline (it splits the commands by node)."""
        pipe = client.pipeline()
        for i, name in enumerate(names):
            if command == "hset":
                header, payload = values[i]  # type: ignore[index]
                pipe.hset(name, mapping={b"h": header, b"p": payload})
                if self._ttl is not None:
                    pipe.expire(name, self._ttl)
            elif command == "hmget":
                pipe.hmget(name, _FIELDS)
            else:
                getattr(pipe, command)(name)
        return pipe.execute(raise_on_error=False)

    def _scan(self) -> list[bytes] | None:
        """Every key name of this namespace (SCAN, every node of a cluster); None when it cannot be had.
        Each name that comes moves the call's deadline ``timeout_s`` on (a scan of many keys takes many
        round trips)."""
        with self._using() as client:
            if client is None:
                return None
            alarm = self._local.alarm
            names = []
            try:
                for name in client.scan_iter(match=self._key_head + b"*", count=1000):
                    names.append(name)
                    alarm.due = time.monotonic() + self._timeout
            except _FAULTS as exc:
                self._lose(exc)
                return None
            return names

    def _count_unreachable(self, command: str) -> None:
        if command in ("hmget", "exists"):
            self._count("errors")

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self._stats, what, getattr(self._stats, what) + 1)

    def _here(self) -> Any:
        """The calling thread's client, or None."""
        return getattr(self._local, "client", None)

    @contextlib.contextmanager
    def _using(self) -> Iterator[Any]:
        """This thread's client for one call (None: none can be had now), marked busy meanwhile so that
        :meth:`close` on another thread leaves it open; closed here at the end if the tier closed."""
        me, client = threading.current_thread(), None
        with self._lock:
            self._busy.add(me)  # before the client is had: close() never takes it from under the call
        alarm = self._local.alarm = _WATCHDOG.arm(self._timeout)  # the call's deadline, connect included
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
                with contextlib.suppress(*_FAULTS):
                    client.close()

    def _connect(self) -> Any:
        """The calling thread's client, connecting first when it has none and the retry interval has
        passed (the connect runs outside the lock: a stalled server never holds up another thread)."""
        if self._closed:
            return None
        client = self._here()
        if client is not None:
            return client
        with self._lock:
            if self._closed or time.monotonic() < self._down_until:
                return None
        try:
            client = self._open()
        except _FAULTS as exc:
            self._lose(exc)
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
        options = dict(socket_timeout=self._timeout, socket_connect_timeout=self._timeout,
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
            with contextlib.suppress(*_FAULTS):
                client.close()
            raise
        return client

    def _drop_ended_threads(self) -> None:
        """Close the clients of threads that have ended (under the lock)."""
        for thread in [t for t in self._clients if not t.is_alive()]:
            with contextlib.suppress(*_FAULTS):
                self._clients.pop(thread).close()

    def _lose(self, exc: BaseException) -> None:
        """Drop the calling thread's client (only that one) and wait ``retry_s`` before any thread
        connects again."""
        client, self._local.client = self._here(), None
        alarm = getattr(self._local, "alarm", None)
        why = (f"TimeoutError: the call took longer than timeout_s={self._timeout:g} s (its deadline)"
               if alarm is not None and alarm.fired else f"{type(exc).__name__}: {exc}")
        with self._lock:
            if self._clients.get(threading.current_thread()) is client:
                self._clients.pop(threading.current_thread(), None)
            self._down_until = time.monotonic() + self._retry
            self.last_error = why
        if client is not None:
            with contextlib.suppress(*_FAULTS):
                client.close()


def _is_int(reply: Any, *values: int) -> bool:
    """Whether ``reply`` is an integer reply equal to one of ``values`` (never an error, a bool or bytes)."""
    return type(reply) is int and reply in values


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
    with contextlib.suppress(*_FAULTS):
        if isinstance(client, RedisCluster):
            client.disconnect_connection_pools()
        else:
            client.connection_pool.disconnect()


# ---- one server: the pipeline packed here ------------------------------------------------------------------
# redis-py's pipeline packs each command through its generic packer and runs each reply through its command
# machinery: ~20 us of Python per command, most of a small-value store's time (a tier replay's profile). The
# hot commands are few and fixed, so they are packed here in one buffer (the same bytes on the wire as its
# pipeline sends) and their replies read here too, within bounds, where the connection is redis-py's plain
# one (else with redis-py's own parser).

_HSET = b"*6\r\n$4\r\nHSET\r\n$%d\r\n%b\r\n$1\r\nh\r\n$%d\r\n%b\r\n$1\r\np\r\n$%d\r\n"
_EXPIRE = b"*3\r\n$6\r\nEXPIRE\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n"
_ONE_KEY = {"exists": b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%b\r\n",
            "hmget": b"*4\r\n$5\r\nHMGET\r\n$%d\r\n%b\r\n$1\r\nh\r\n$1\r\np\r\n",
            "delete": b"*2\r\n$3\r\nDEL\r\n$%d\r\n%b\r\n"}


def _pack(command: str, names: list[bytes], values: list[tuple[bytes, Any]] | None, ttl: int | None
          ) -> list[Any]:
    """The RESP of ``command`` once per name (``hset``: of ``values``' header and payload fields, each
    followed by ``EXPIRE name ttl`` when ``ttl`` is given), as buffers to send in order: small pieces joined,
    a payload larger than ``SMALL_VALUE`` a buffer of its own (a view, not copied)."""
    if command != "hset":
        head = _ONE_KEY[command]
        return [b"".join([head % (len(name), name) for name in names])]
    out: list[Any] = []
    parts: list[bytes] = []
    expire = b"%d" % ttl if ttl is not None else None
    for name, (header, payload) in zip(names, values, strict=True):  # type: ignore[arg-type]
        size = len(payload) if isinstance(payload, bytes) else payload.nbytes
        parts.append(_HSET % (len(name), name, len(header), header, size))
        if isinstance(payload, bytes):
            parts.append(payload)
        else:
            out.append(b"".join(parts))
            out.append(payload)
            parts = []
        parts.append(b"\r\n")
        if expire is not None:
            parts.append(_EXPIRE % (len(name), name, len(expire), expire))
    out.append(b"".join(parts))
    return out


def _send_packed(client: redis.Redis, buffers: list[Any], replies: int, field_bytes: int) -> list[Any]:
    """Send ``buffers`` on one of ``client``'s connections and read ``replies`` replies (an error reply
    as its ``ResponseError``): by :func:`_read_replies` (fields of at most ``field_bytes``) where the
    connection is redis-py's plain one with nothing buffered, else by redis-py's parser. Any other exception
    drops that connection (its stream is out of step) and propagates."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command(buffers)
        sock = _plain_socket(conn)
        if sock is not None:
            return _read_replies(sock, replies, field_bytes)
        done: list[Any] = []
        while len(done) < replies:
            try:
                done.append(conn.read_response())
            except redis.ResponseError as exc:
                done.append(exc)
        return done
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _plain_socket(conn: Any) -> Any:
    """The socket of ``conn`` when redis-py's plain reader (a ``SocketBuffer``) holds nothing unread, so the
    tier may read the replies from it; None otherwise (another parser, such as hiredis, or another layout:
    redis-py's parser reads them)."""
    buffer = getattr(getattr(conn, "_parser", None), "_buffer", None)
    sock = getattr(conn, "_sock", None)
    if sock is None or SocketBuffer is None or not isinstance(buffer, SocketBuffer) or buffer.unread_bytes():
        return None
    return sock


def _read_replies(sock: Any, n: int, field_bytes: int) -> list[Any]:
    """``n`` replies read from ``sock`` (RESP2 or RESP3: redis-py speaks RESP3 where the server does): an
    integer (``:``), an error (``-`` or ``!``, its ``ResponseError``), a simple string (``+``, bytes), a bulk
    string (``$``, bytes; None for ``$-1``), a null (``_``) or an array (``*``) of at most ``ARRAY_ITEMS`` of
    those (``HMGET``'s two fields; None for ``*-1``); the caller judges the shape. redis-py's parser costs
    ~5 us of Python per reply; this reads each reply's lines and fields from one buffer. Bounds, checked
    as the bytes come: a line of at most ``LINE_BYTES``, a bulk string of at most ``field_bytes``, an array
    of at most ``ARRAY_ITEMS``, so a server cannot make the tier buffer more than the call's replies can
    hold. Anything else (a longer line, field or array, another type, a nested array, a malformed number,
    bytes past the last reply, a closed connection) raises: a fault of the medium (the caller drops the
    connection)."""
    data, pos, out = bytearray(), 0, []
    while len(out) < n:
        got = _reply(data, pos, field_bytes) if data else None
        if got is None:  # incomplete: more bytes
            chunk = sock.recv(65536)
            if not chunk:
                raise redis.ConnectionError("the server closed the connection")
            data += chunk
            if not out and data.endswith(b"\r\n") and data.count(b"\r\n") == n:
                integers = _integer_lines(data, n)  # the common case of EXISTS, HSET, DEL, at once
                if integers is not None:
                    return integers
            continue
        value, pos = got
        out.append(value)
    if pos != len(data):
        raise redis.InvalidResponse("more bytes than replies")
    return out


def _integer_lines(data: bytearray, n: int) -> list[int] | None:
    """The ``n`` lines of ``data`` (exactly ``n``, each ended by CRLF) as non-negative integer replies
    (``:<1-19 digits>``) read at once; None when any line is another reply (:func:`_reply` reads them)."""
    out = []
    for line in bytes(data).split(b"\r\n", n)[:n]:
        digits = line[1:]
        if line[:1] != b":" or not (0 < len(digits) < 20 and digits.isdigit()):
            return None
        out.append(int(digits))
    return out


def _reply(data: bytearray, pos: int, field_bytes: int) -> tuple[Any, int] | None:
    """The reply at ``data[pos:]`` and where it ends, or None while it is incomplete (see
    :func:`_read_replies`): a scalar, or an array of at most ``ARRAY_ITEMS`` scalars."""
    got = _line(data, pos)
    if got is None:
        return None
    kind, line, end = got
    if kind != b"*":
        return _scalar(data, kind, line, end, field_bytes)
    size = _number(line, nil=True)
    if size < 0:
        return None, end
    if size > ARRAY_ITEMS:
        raise redis.InvalidResponse(f"an array of {size} replies")
    items = []
    for _ in range(size):
        got = _line(data, end)
        item = None if got is None else _scalar(data, *got, field_bytes)
        if item is None:
            return None
        items.append(item[0])
        end = item[1]
    return items, end


def _scalar(data: bytearray, kind: bytes, line: bytes, end: int, field_bytes: int) -> tuple[Any, int] | None:
    """The reply of one line ``kind`` + ``line`` (its data from ``end``): an integer, an error, a simple
    string, a bulk string (bytes; None for nil) or a null; None while a bulk string is incomplete."""
    if kind == b":":
        return _number(line), end
    if kind == b"$":
        return _bulk(data, line, end, field_bytes)
    if kind == b"-":
        return redis.ResponseError(line.decode(errors="replace")), end
    if kind == b"+":
        return line, end
    if kind == b"_":
        return _null(line, end)
    if kind == b"!":  # RESP3's error as a bulk string
        got = _bulk(data, line, end, LINE_BYTES)
        return None if got is None else (redis.ResponseError(got[0].decode(errors="replace")), got[1])
    raise redis.InvalidResponse(f"not a reply the tier asked for: {kind + line[:32]!r}")


def _null(line: bytes, end: int) -> tuple[None, int]:
    """RESP3's null (``_``)."""
    if line:
        raise redis.InvalidResponse(f"not a RESP3 null: {line[:32]!r}")
    return None, end


def _line(data: bytearray, pos: int) -> tuple[bytes, bytes, int] | None:
    """The line at ``data[pos:]``: (its type byte, the rest, where the next begins); None while its CRLF
    has not come (InvalidResponse past ``LINE_BYTES``)."""
    end = data.find(b"\r\n", pos, pos + LINE_BYTES)
    if end < 0:
        if len(data) - pos >= LINE_BYTES:
            raise redis.InvalidResponse(f"a reply line longer than {LINE_BYTES} bytes")
        return None
    return bytes(data[pos:pos + 1]), bytes(data[pos + 1:end]), end + 2


def _bulk(data: bytearray, line: bytes, end: int, field_bytes: int) -> tuple[bytes | None, int] | None:
    """The bulk string whose ``$<len>`` line is ``line`` (its data from ``end``): (the bytes, where the
    next reply begins), (None, ...) for ``$-1``; None while it is incomplete."""
    size = _number(line, nil=True)
    if size < 0:
        return None, end
    if size > field_bytes:
        raise redis.InvalidResponse(f"a {size}-byte field, more than a value holds ({field_bytes})")
    if len(data) < end + size + 2:
        return None
    if data[end + size:end + size + 2] != b"\r\n":
        raise redis.InvalidResponse("a bulk string not ended by CRLF")
    return bytes(memoryview(data)[end:end + size]), end + size + 2  # (one copy)


def _number(line: bytes, *, nil: bool = False) -> int:
    """A RESP integer: an optional minus and 1-19 ASCII digits (``int()`` would also take ``+1``, ``1_0``,
    `` 1``). ``nil``: a length, at least -1 (nil)."""
    digits = line[1:] if line[:1] == b"-" else line
    if not (0 < len(digits) < 20 and digits.isdigit()) or (nil and line[:1] == b"-" and digits != b"1"):
        raise redis.InvalidResponse(f"not a RESP {'length' if nil else 'integer'}: {line[:32]!r}")
    return int(line)


def _bad_url(url: object, why: str) -> ConfigError:
    """The error for a refused URL: it names the URL with its password hidden (:func:`redact_url`)."""
    return ConfigError(f"bad Redis URL {redact_url(url)!r}: {why}")
