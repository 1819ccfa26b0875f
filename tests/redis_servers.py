"""Real Redis servers for the tier tests: a single server, one that takes ``DEBUG SLEEP`` (to stall it on
purpose: :class:`Stall`), one busy in a Lua script (:class:`Busy`) and a three-node Redis Cluster on
loopback ports 27100-27199 (this project's range for tier tests), each a child process stopped at the end,
even on failure. Needs Debian's ``redis-server`` and ``redis-cli`` (``.ci/run`` installs them); without
them the tests that need a server are skipped with that reason. And a hostile stand-in,
:class:`FakeRedis`: a server in a thread that answers what a test tells it, as slowly as it is told."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

PORTS = range(27100, 27200)
START_TIMEOUT_S = 15.0
ATTEMPTS = 5  # several test runs on one machine may race for a port: start again on another
_used: set[int] = set()


def free_port() -> int:
    """A port of the range that nothing listens on and no server of this run took (the scan starts at an
    offset of this process's id, so concurrent runs rarely probe the same ports)."""
    start = os.getpid() % len(PORTS)
    for i in range(len(PORTS)):
        port = PORTS[(start + i) % len(PORTS)]
        if port in _used:
            continue
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                _used.add(port)
                return port
    raise RuntimeError("no free port in 27100-27199")


def _need_redis() -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server not installed (apt-get install -y redis-server)")


def die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL when the process that started it dies, even by SIGKILL,
    so no server outlives a test run that was killed (prctl PR_SET_PDEATHSIG; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _cli(port: int, *args: str, timeout: float = 10.0) -> str:
    out = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args], capture_output=True,
                         text=True, timeout=timeout)
    return out.stdout


class Server:
    """One ``redis-server`` child process on ``port`` (started by :meth:`start`)."""

    def __init__(self, port: int, folder: Path, *extra: str) -> None:
        self.port, self.folder, self.extra = port, folder, extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> Server:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly",
             "no", "--dir", str(self.folder), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
        deadline = time.monotonic() + START_TIMEOUT_S
        while _cli(self.port, "ping").strip() != "PONG":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on {self.port} did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """Kill the server (SIGKILL: no goodbye, as a crash) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def cli(self, *args: str) -> str:
        return _cli(self.port, *args)


def _started(folder: Path, *extra: str) -> Server:
    """A server on a free port, trying another port when one is taken meanwhile."""
    for attempt in range(ATTEMPTS):
        try:
            return Server(free_port(), folder, *extra).start()
        except RuntimeError:
            if attempt == ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


@contextmanager
def redis_server(folder: Path, *extra: str) -> Iterator[Server]:
    """A started single server, stopped on exit."""
    _need_redis()
    server = _started(folder, *extra)
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def redis_cluster(folder: Path) -> Iterator[list[Server]]:
    """Three masters, no replicas, slots split by ``redis-cli --cluster create``; stopped on exit."""
    _need_redis()
    nodes = []
    try:
        for i in range(3):
            options = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                       "--cluster-node-timeout", "2000")
            nodes.append(_started(folder / f"node{i}", *options))
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        subprocess.run(["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0",
                        "--cluster-yes"], capture_output=True, timeout=30, check=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all("cluster_state:ok" in n.cli("cluster", "info") for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture(scope="session")
def redis_single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the whole session (tests use distinct namespaces, so they never meet)."""
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    with redis_cluster(tmp_path_factory.mktemp("redis-cluster")) as nodes:
        yield nodes


@pytest.fixture(scope="session")
def redis_stalling(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of its own that takes ``DEBUG SLEEP`` (Redis 7 refuses DEBUG unless it is enabled)."""
    with redis_server(tmp_path_factory.mktemp("redis-stall"), "--enable-debug-command", "yes") as server:
        yield server


class Stall:
    """``with Stall(url, seconds):`` the server at ``url`` runs ``DEBUG SLEEP seconds`` (sent from a
    thread, on a connection of its own) and answers no one meanwhile. Entering returns once the server is
    asleep (a probe's PING stays unanswered for 50 ms); leaving waits until it is awake again."""

    def __init__(self, url: str, seconds: float) -> None:
        self.url, self.seconds = url, seconds
        self.thread = threading.Thread(target=self._sleep, name="redis-stall")

    def _sleep(self) -> None:
        import redis

        client = redis.Redis.from_url(self.url, socket_timeout=self.seconds + 10)
        client.execute_command("DEBUG", "SLEEP", self.seconds)
        client.close()

    def __enter__(self) -> Stall:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        probe = redis.Redis.from_url(self.url, socket_timeout=0.05, retry=Retry(NoBackoff(), 0))
        probe.ping()
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                try:
                    probe.ping()
                except redis.TimeoutError:
                    return self
                time.sleep(0.01)
        finally:
            probe.close()
        raise RuntimeError("the Redis server never went to sleep")

    def __exit__(self, *exc: object) -> None:
        self.thread.join(timeout=self.seconds + 10)


class Busy:
    """``with Busy(url):`` the server at ``url`` (started with ``--busy-reply-threshold`` a few ms) runs a
    Lua script that never ends, from a thread, so that every other client's command is answered ``-BUSY``
    (Redis 7). Entering returns once a probe's PING gets -BUSY; leaving kills the script (``SCRIPT KILL``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.thread = threading.Thread(target=self._spin, name="redis-busy")

    def _spin(self) -> None:
        import redis

        client = redis.Redis.from_url(self.url, socket_timeout=60)
        try:
            client.eval("while true do end", 0)
        except redis.ResponseError:  # "Script killed by user"
            pass
        finally:
            client.close()

    def __enter__(self) -> Busy:
        import redis

        self.thread.start()
        probe = redis.Redis.from_url(self.url, socket_timeout=5)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                try:
                    probe.ping()
                except redis.ResponseError as exc:
                    if str(exc).startswith("BUSY"):
                        return self
                    raise
                time.sleep(0.01)
        finally:
            probe.close()
        raise RuntimeError("the Redis server never got busy")

    def __exit__(self, *exc: object) -> None:
        import redis

        client = redis.Redis.from_url(self.url, socket_timeout=5)
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.thread.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(redis.ResponseError):  # NOTBUSY: not started yet, or ended
                client.script_kill()
            self.thread.join(timeout=0.1)
        client.close()


class FakeRedis:
    """``with FakeRedis() as fake:`` a stand-in Redis on a loopback port (``fake.url``), one thread per
    connection: what a broken server, or one run by someone hostile, may send. It speaks RESP2 (it refuses
    ``HELLO``: redis-py falls back to RESP2), or RESP3 with ``protocol=3`` (it answers ``HELLO 3`` as Redis
    7 does). It keeps hashes in a dict and answers ``HSET``, ``HMGET``, ``EXISTS``, ``DEL``, ``EXPIRE`` and
    ``SCAN ... MATCH`` as Redis does, ``PING``, ``INFO`` (not a cluster), ``CLIENT`` and ``SELECT`` as a
    plain server; others ``-ERR``.

    What a test sets (at the start, or while it runs): ``replies[COMMAND]``, raw bytes sent instead of
    each such command's reply (``b"EXISTS"``, ...); ``trickle``, the commands whose replies go out in
    ``pieces`` pieces ``trickle_s`` seconds apart (a byte at a time for a reply shorter than that);
    ``flood[COMMAND] = (head, filler)``, the head then the filler over and over, ``flood_bytes`` in all, as
    fast as the client takes them, instead of the reply (``flooded``: the bytes the socket took before the
    client hung up)."""

    def __init__(self, replies: dict[bytes, bytes] | None = None, *, protocol: int = 2) -> None:
        self.replies: dict[bytes, bytes] = dict(replies or {})
        self.protocol = protocol
        self.trickle: set[bytes] = set()
        self.trickle_s, self.pieces = 0.2, 30
        self.flood: dict[bytes, tuple[bytes, bytes]] = {}
        self.flood_bytes, self.flooded = 0, 0
        self.hashes: dict[bytes, dict[bytes, bytes]] = {}
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stopped = False
        threading.Thread(target=self._accept, name="fake-redis", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stopped = True
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="fake-redis-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while not self._stopped:
                command = self._command(reader)
                if command is None:
                    return
                self._answer(conn, command)
        except OSError:
            return
        finally:
            reader.close()

    @staticmethod
    def _command(reader: Any) -> list[bytes] | None:
        """One command (a RESP array of bulk strings) from the client, or None when it hung up."""
        head = reader.readline()
        if not head:
            return None
        args = []
        for _ in range(int(head[1:])):
            size = int(reader.readline()[1:])
            args.append(reader.read(size + 2)[:-2])
        return args

    def _answer(self, conn: socket.socket, args: list[bytes]) -> None:
        name = args[0].upper()
        if name in self.flood:
            self._flood(conn, *self.flood[name])
            return
        reply = self.replies.get(name) or self._reply(name, args[1:])
        if name not in self.trickle:
            conn.sendall(reply)
            return
        step = max(1, -(-len(reply) // self.pieces))
        for i in range(0, len(reply), step):
            conn.sendall(reply[i:i + step])
            time.sleep(self.trickle_s)

    def _flood(self, conn: socket.socket, head: bytes, filler: bytes) -> None:
        piece = filler * (65536 // len(filler))
        sent = 0
        try:
            conn.sendall(head)
            while sent < self.flood_bytes:
                conn.sendall(piece)
                sent += len(piece)
        finally:
            self.flooded = sent

    def _reply(self, name: bytes, args: list[bytes]) -> bytes:
        hashes = self.hashes
        if name == b"PING":
            return b"+PONG\r\n"
        if name == b"HELLO" and self.protocol == 3:
            return b"%3\r\n+server\r\n+redis\r\n+version\r\n+7.0.0\r\n+proto\r\n:3\r\n"
        if name in (b"CLIENT", b"SELECT"):
            return b"+OK\r\n"
        if name == b"INFO":
            return _bulk(b"# Cluster\r\ncluster_enabled:0\r\n")
        if name == b"HSET":
            value = hashes.setdefault(args[0], {})
            added = sum(field not in value for field in args[1::2])
            value.update(zip(args[1::2], args[2::2], strict=True))
            return b":%d\r\n" % added
        if name == b"HMGET":
            value = hashes.get(args[0], {})
            return b"*%d\r\n" % (len(args) - 1) + b"".join(
                _bulk(value[f]) if f in value else b"$-1\r\n" for f in args[1:])
        if name in (b"EXISTS", b"DEL"):
            found = sum(key in hashes for key in args)
            if name == b"DEL":
                for key in args:
                    hashes.pop(key, None)
            return b":%d\r\n" % found
        if name == b"EXPIRE":
            return b":%d\r\n" % (args[0] in hashes)
        if name == b"SCAN":
            match = args[args.index(b"MATCH") + 1] if b"MATCH" in args else b"*"
            names = [k for k in hashes if fnmatch.fnmatchcase(k.decode(), match.decode())]
            return b"*2\r\n" + _bulk(b"0") + b"*%d\r\n" % len(names) + b"".join(map(_bulk, names))
        return b"-ERR unknown command '%s'\r\n" % name


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)
