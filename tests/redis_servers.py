"""Real Redis servers for the tier tests: a single server, one that takes ``DEBUG SLEEP`` (to stall it on
purpose: :class:`Stall`) and a three-node Redis Cluster on loopback ports 27100-27199 (this project's range
for tier tests), each a child process stopped at the end, even on failure. Needs Debian's
``redis-server`` and ``redis-cli`` (``.ci/run`` installs them); without them the tests that need a server
are skipped with that reason."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
