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
that answers a byte at a time is cut off there (`kvpool.tiers._redis_clients` shuts its sockets) and the
call is a miss, as for a dead server. Replies the tier reads itself (:mod:`kvpool.tiers._resp`) are bounded
in bytes: a line (an integer, an error, a length) of at most ``LINE_BYTES``, a field of at most a block's
value; more is a fault of the medium, found before the rest is read.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Hashable, Sequence
from typing import Any

import redis
import torch

from kvpool.errors import ConfigError, IntegrityError
from kvpool.numeric import as_optional_int, as_real
from kvpool.tiers._redis_clients import FAULTS, ThreadClients
from kvpool.tiers._resp import ARRAY_ITEMS, LINE_BYTES, SMALL_VALUE, pack, send_packed  # noqa: F401 (re-exported)
from kvpool.tiers.auth import TierKey, redact_url, require_auth_key
from kvpool.tiers.backend import HEADER_BYTES, Namespace, TierBackend, block_keys, encode_header, verify_parts

SCHEMES = ("redis", "rediss")
#: Bytes of values per pipeline at most (a batch of big blocks is split).
PIPELINE_BYTES = 64 * 2**20
_FIELDS = (b"h", b"p")


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
        timeout = as_real(timeout_s, "timeout_s", minimum=0, open_min=True, finite=True)
        retry = as_real(retry_s, "retry_s", minimum=0, finite=True)
        self._ttl = as_optional_int(ttl_s, "ttl_s", minimum=1)
        self.url = check_url(url)
        self.auth_key = require_auth_key(auth_key, "a Redis tier")
        self._clients = ThreadClients(self.url, cluster=cluster, timeout_s=timeout, retry_s=retry)
        self._key_head = f"{prefix}:{namespace.tag}:".encode()
        self._stored_keys = 0
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
        return self._clients.here() is not None

    @property
    def cluster(self) -> bool | None:
        """Whether the server is a cluster (None until the first connection asked it, if not given)."""
        return self._clients.cluster

    @property
    def last_error(self) -> str | None:
        """Why the last call that lost the server lost it (None once a client connects again)."""
        return self._clients.last_error

    def check_integrity(self) -> None:
        """Counters are non-negative; a tier without a client is waiting to retry."""
        s = self.stats()
        if min(s.to_dict().values()) < 0 or self._stored_keys < 0:
            raise IntegrityError(f"redis tier counters went negative: {s}")
        clientless = not self._clients.any_client()
        if clientless and self.last_error is None and (s.errors or s.store_failures):
            raise IntegrityError("redis tier lost its client without recording why")

    def close(self) -> None:
        """Close every idle thread's client now, and a busy one when its call ends; later calls miss."""
        self._clients.close()

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
        with self._clients.using() as client:
            if client is None:
                self._count_unreachable(command)
                return None
            try:
                if self.cluster:
                    done = self._cluster_pipeline(client, command, names, values)
                else:
                    per_name = 2 if command == "hset" and self._ttl is not None else 1
                    packed = pack(command, names, values, self._ttl)
                    field = max(HEADER_BYTES, self.block_bytes) if command == "hmget" else LINE_BYTES
                    done = send_packed(client, packed, per_name * len(names), field)
            except FAULTS as exc:
                self._clients.lose(exc)
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
        with self._clients.using() as client:
            if client is None:
                return None
            names = []
            try:
                for name in client.scan_iter(match=self._key_head + b"*", count=1000):
                    names.append(name)
                    self._clients.extend_deadline()
            except FAULTS as exc:
                self._clients.lose(exc)
                return None
            return names

    def _count_unreachable(self, command: str) -> None:
        if command in ("hmget", "exists"):
            self._count("errors")

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self._stats, what, getattr(self._stats, what) + 1)


def _is_int(reply: Any, *values: int) -> bool:
    """Whether ``reply`` is an integer reply equal to one of ``values`` (never an error, a bool or bytes)."""
    return type(reply) is int and reply in values


def _bad_url(url: object, why: str) -> ConfigError:
    """The error for a refused URL: it names the URL with its password hidden (:func:`redact_url`)."""
    return ConfigError(f"bad Redis URL {redact_url(url)!r}: {why}")
