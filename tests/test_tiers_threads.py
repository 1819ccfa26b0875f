"""The tiers' thread contract (kvpool.tiers.backend.TierBackend): one tier called from two threads at once,
as the offload manager calls it (the engine thread reads, the writer thread stores), under every fault of
the backend fault suite (tests/test_tiers_backends.py) and a Redis that stalls (``DEBUG SLEEP``). Whatever
the interleaving, no call raises, every fault is a counted miss or store failure of the call that met it,
what a get returns is bit-exact, and the tier's invariants hold. Threads start together at a barrier and
are joined with a deadline; Redis calls use short socket timeouts, so each test is bounded in time."""

from __future__ import annotations

import os
import random
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool.tiers.auth import TierKey
from kvpool.tiers.backend import HEADER_BYTES, Namespace, block_key
from kvpool.tiers.file import FileTier
from kvpool.tiers.host import HostTier

redis = pytest.importorskip("redis")
from redis_servers import FakeRedis, Stall  # noqa: E402

from kvpool.tiers.redis import RedisTier  # noqa: E402

BPB = 512
NS = Namespace("threads", "uint8", f"flat/{BPB}", hash_scheme="test")
KEY = TierKey("kvpool tests: a tier key of 16+ bytes")
JOIN_S = 20.0  # no test here needs more; a thread still running then is a hang, reported as a failure


def keys(n: int, base: int = 0) -> list[bytes]:
    return [block_key(base + i) for i in range(n)]


def rows_of(ks: list[int]) -> torch.Tensor:
    """Block k's bytes are a function of k alone, so whichever thread wrote a block, a get of it must
    return exactly these."""
    return torch.stack([torch.randint(0, 256, (BPB,), generator=torch.Generator().manual_seed(k),
                                      dtype=torch.uint8) for k in ks])


def both(*calls: Callable[[], Any]) -> list[Any]:
    """Run each call on its own thread, released together by a barrier; their results in order. An
    exception on any thread is raised here (a fault that escaped a tier call fails the test)."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=JOIN_S)
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 (reported on the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"tier-caller-{i}") for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN_S)
    assert not any(t.is_alive() for t in threads), "a tier call hung"
    if errors:
        raise errors[0]
    return results


def get_n(tier, ks: list[bytes]) -> int:
    return tier.get(ks, torch.zeros(len(ks), BPB, dtype=torch.uint8))


# ---- every tier, both threads at once, with overlapping keys ---------------------------------------------

@pytest.fixture(params=["host", "file", "redis"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator:
    if request.param == "host":
        from kvpool.spec import KVCacheSpec
        from kvpool.storage.paged import PagedKVCache

        like = PagedKVCache(KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float16,
                                        block_size=2), 2)
        assert like.bytes_per_block == BPB  # 2 (K, V) x 1 layer x 2 tokens x 1 head x 64 x 2 B
        t = HostTier(12, NS, like=like)
    elif request.param == "file":
        t = FileTier(tmp_path, NS, capacity_bytes=12 * (HEADER_BYTES + BPB), block_bytes=BPB, auth_key=KEY)
    else:
        t = RedisTier(request.getfixturevalue("redis_single").url, NS, block_bytes=BPB, auth_key=KEY,
                      prefix=f"threads-{request.node.name}")
    yield t
    t.clear()
    t.close()


def random_calls(tier, seed: int, steps: int = 150) -> Callable[[], int]:
    """``steps`` seeded random set / get / exists / refresh / delete calls on 20 keys (more than the
    bounded tiers hold, so stores evict); each get's returned blocks are checked bit by bit."""
    def run() -> int:
        rng = random.Random(seed)
        loaded = 0
        for _ in range(steps):
            ks = rng.sample(range(20), rng.randint(1, 4))
            op = rng.choice(["set", "set", "get", "get", "exists", "refresh", "delete"])
            if op == "set":
                assert tier.set(keys_of(ks), rows_of(ks)) <= len(ks)
            elif op == "get":
                out = torch.zeros(len(ks), BPB, dtype=torch.uint8)
                n = tier.get(keys_of(ks), out)
                assert torch.equal(out[:n], rows_of(ks)[:n]), "a get returned other bytes than stored"
                loaded += n
            elif op == "exists":
                assert 0 <= tier.exists(keys_of(ks)) <= len(ks)
            elif op == "refresh":
                tier.refresh(keys_of(ks))
            else:
                tier.delete(keys_of(ks))
        return loaded
    return run


def keys_of(ks: list[int]) -> list[bytes]:
    return [block_key(k) for k in ks]


def test_two_threads_on_one_tier_keep_its_invariants(tier) -> None:
    # The file tier before its write lock: two stores of one key both indexed it (used_bytes counted it
    # twice) and a reader's removal of a file raced a store of the same key (indexed, no file).
    loaded = 0
    for round_ in range(3):
        loaded += sum(both(random_calls(tier, seed=2 * round_), random_calls(tier, seed=2 * round_ + 1)))
        tier.check_integrity()
    assert loaded == tier.stats().loaded > 0
    s = tier.stats()
    assert s.misses == s.missing and s.store_failures == 0  # the media were sound: only absent keys
    if tier.medium == "disk":
        assert tier.used_bytes == tier.num_blocks * (HEADER_BYTES + BPB) <= tier.capacity_bytes


# ---- Redis: a server that stalls --------------------------------------------------------------------------

class Worker:
    """A thread that runs the calls given to it, one at a time (a tier's second thread, as the writer)."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Callable[..., Any], tuple, threading.Event, list]] = []
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="tier-worker", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.jobs:
                    self.cond.wait()
                fn, args, done, box = self.jobs.pop(0)
            if fn is None:
                return
            try:
                box.append((True, fn(*args)))
            except BaseException as exc:  # noqa: BLE001 (raised again by call)
                box.append((False, exc))
            done.set()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        done, box = threading.Event(), []
        with self.cond:
            self.jobs.append((fn, args, done, box))
            self.cond.notify()
        assert done.wait(JOIN_S), "a tier call hung on the worker thread"
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        with self.cond:
            self.jobs.append((None, (), threading.Event(), []))  # type: ignore[arg-type]
            self.cond.notify()
        self.thread.join(timeout=JOIN_S)


def test_a_timeout_on_one_thread_leaves_the_other_threads_client(redis_stalling) -> None:
    # The shared client: the engine thread's timeout closed it under the writer's thread too, and the
    # retry interval then kept both off the server. One client per thread: the other thread's connection
    # is untouched and serves it as soon as the server answers again.
    t = RedisTier(redis_stalling.url, NS, block_bytes=BPB, auth_key=KEY, timeout_s=0.2, retry_s=60,
                  prefix="stall-one")
    writer = Worker()
    assert writer.call(t.set, keys(4), rows_of(list(range(4)))) == 4  # the writer thread's own client
    with Stall(redis_stalling.url, 1.0):
        assert get_n(t, keys(4)) == 0  # this thread's call times out: a miss, its client dropped
    assert t.stats().errors == 1 and not t.connected and "Timeout" in t.last_error
    out = torch.zeros(4, BPB, dtype=torch.uint8)
    assert writer.call(t.get, keys(4), out) == 4 and torch.equal(out, rows_of(list(range(4))))
    assert writer.call(lambda: t.connected) and get_n(t, keys(4)) == 0  # this thread waits its 60 s
    writer.stop()
    t.clear()
    t.close()


def test_both_threads_call_through_a_stalling_server(redis_stalling) -> None:
    # The review's failure: while the server stalls, the writer's set and the engine's exists/get time out
    # on their own schedules; with one shared client, one thread's timeout closed the socket under the
    # other's pipeline and redis-py raised ValueError('I/O operation on closed file'), out of the tier.
    t = RedisTier(redis_stalling.url, NS, block_bytes=BPB, auth_key=KEY, timeout_s=0.15, retry_s=0.0,
                  prefix="stall-both")
    ks, data = keys(16), rows_of(list(range(16)))
    assert t.set(ks, data) == 16
    stop = threading.Event()

    def store() -> int:
        n = 0
        while not stop.is_set():
            n += t.set(ks, data)
        return n

    def read() -> int:
        n, out = 0, torch.zeros(16, BPB, dtype=torch.uint8)
        while not stop.is_set():
            t.exists(ks)
            got = t.get(ks, out)
            assert torch.equal(out[:got], data[:got])
            n += got
        return n

    def stalls() -> None:
        for _ in range(4):
            time.sleep(0.15)
            with Stall(redis_stalling.url, 0.4):
                pass
        stop.set()

    stored, loaded, _ = both(store, read, stalls)
    s = t.stats()
    assert s.errors + s.store_failures > 0 and s.misses == s.errors  # the stalls were met, as misses
    assert stored > 0 and loaded > 0
    assert both(lambda: t.set(ks, data), lambda: get_n(t, ks)) == [16, 16]  # awake: both threads served
    t.check_integrity()
    t.clear()
    t.close()


def test_close_while_another_thread_calls_is_a_miss_there(redis_stalling) -> None:
    t = RedisTier(redis_stalling.url, NS, block_bytes=BPB, auth_key=KEY, timeout_s=0.5, prefix="close")
    ks, data = keys(8), rows_of(list(range(8)))
    stop, calls = threading.Event(), []

    def busy() -> None:
        while not stop.is_set():
            calls.append(t.set(ks, data) + get_n(t, ks))

    def closer() -> None:
        time.sleep(0.2)
        t.close()
        time.sleep(0.1)
        stop.set()

    both(busy, closer)
    assert calls and t.set(ks, data) == 0 and get_n(t, ks) == 0  # closed: unusable, never raising


# ---- Redis: the backend suite's faults, both threads at once ----------------------------------------------

def test_unreachable_from_both_threads_costs_one_connect_per_interval() -> None:
    from redis_servers import free_port

    t = RedisTier(f"redis://127.0.0.1:{free_port()}", NS, block_bytes=BPB, auth_key=KEY, retry_s=60)
    start = time.perf_counter()
    calls = lambda: [t.exists(keys(4)) + get_n(t, keys(4)) + t.set(keys(4), rows_of([0, 1, 2, 3]))  # noqa: E731
                     for _ in range(50)]
    assert both(calls, calls) == [[0] * 50, [0] * 50]
    assert time.perf_counter() - start < 5  # refused connects are instant; the interval holds the rest
    s = t.stats()
    assert (s.errors, s.store_failures) == (2 * 50 * 2, 2 * 50 * 4) and "Connection" in t.last_error


def test_redis_killed_under_both_threads_then_back(tmp_path: Path) -> None:
    from redis_servers import redis_server

    with redis_server(tmp_path) as server:
        t = RedisTier(server.url, NS, block_bytes=BPB, auth_key=KEY, retry_s=0.1, timeout_s=0.5)
        data = rows_of(list(range(5)))
        assert both(lambda: t.set(keys(5), data), lambda: t.exists(keys(5)))[0] == 5
        server.stop()
        assert both(lambda: get_n(t, keys(5)), lambda: t.set(keys(2, base=10), data[:2])) == [0, 0]
        assert t.stats().errors >= 1 and t.stats().store_failures == 2
        server.start()  # empty, on the same port
        time.sleep(0.15)
        assert both(lambda: t.exists(keys(5)), lambda: t.exists(keys(5))) == [0, 0]  # reconnected, empty
        assert both(lambda: t.set(keys(3), data[:3]), lambda: t.set(keys(3), data[:3])) == [3, 3]
        out = [torch.zeros(3, BPB, dtype=torch.uint8) for _ in range(2)]
        assert both(lambda: t.get(keys(3), out[0]), lambda: t.get(keys(3), out[1])) == [3, 3]
        assert torch.equal(out[0], data[:3]) and torch.equal(out[1], data[:3])
        t.close()


TAMPERINGS = {  # what a bad value under block 1 is, and the reason it is counted by
    "truncated payload": (lambda h, p: {"h": h, "p": p[:-1]}, "corrupt"),
    "flipped bit": (lambda h, p: {"h": h, "p": p[:7] + bytes([p[7] ^ 1]) + p[8:]}, "unauthenticated"),
    "another block's value": (None, "foreign"),
    "forged payload": (lambda h, p: {"h": h, "p": bytes(len(p))}, "unauthenticated"),
    "no header": (lambda h, p: {"p": p}, "corrupt"),
}


@pytest.mark.parametrize("damage", list(TAMPERINGS))
def test_values_tampered_in_redis_are_misses_on_both_threads(redis_single, damage: str) -> None:
    t = RedisTier(redis_single.url, NS, block_bytes=BPB, auth_key=KEY, prefix=f"tamper-{damage}")
    t.set(keys(3), rows_of([0, 1, 2]))
    client = redis.Redis.from_url(redis_single.url)
    name = t._name(block_key(1))
    make, why = TAMPERINGS[damage]
    header, payload = client.hmget(name, ["h", "p"])
    fields = client.hgetall(t._name(block_key(2))) if make is None else make(header, payload)
    client.delete(name)
    client.hset(name, mapping=fields)
    assert both(lambda: get_n(t, keys(3)), lambda: get_n(t, keys(3))) == [1, 1]
    s = t.stats()
    assert getattr(s, why) == s.misses == 2 and s.errors == 0  # Redis keeps the bad value: both see it
    t.clear()
    t.close()


def test_maxmemory_evictions_under_both_threads_are_missing(tmp_path: Path) -> None:
    from redis_servers import redis_server

    big = 64 * 1024
    ns = Namespace("m", "uint8", "flat", hash_scheme="test")
    with redis_server(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru") as server:
        t = RedisTier(server.url, ns, block_bytes=big, auth_key=KEY)
        block = torch.full((1, big), 7, dtype=torch.uint8)
        store = lambda base: lambda: sum(t.set(keys(1, base=base + i), block) for i in range(100))  # noqa: E731
        assert both(store(0), store(1000)) == [100, 100]  # 12.5 MiB through a 2 MiB server, two writers
        present = [k for k in [*range(100), *range(1000, 1100)] if t.exists(keys(1, base=k))]
        assert 0 < len(present) < 100
        gone = next(k for k in range(100) if k not in present)
        out = torch.zeros(1, big, dtype=torch.uint8)
        assert both(lambda: t.get(keys(1, base=gone), out), lambda: get_n_big(t, gone, big)) == [0, 0]
        assert t.stats().missing == 2 and t.stats().errors == 0
        t.close()


def get_n_big(t, k: int, big: int) -> int:
    return t.get(keys(1, base=k), torch.zeros(1, big, dtype=torch.uint8))


def test_a_cluster_serves_both_threads_with_their_own_clients(redis_cluster_nodes) -> None:
    t = RedisTier(redis_cluster_nodes[0].url, NS, block_bytes=BPB, auth_key=KEY, prefix="cluster-threads")
    data = rows_of(list(range(30)))
    assert both(lambda: t.set(keys(30), data), lambda: t.set(keys(30), data)) == [30, 30]
    out = [torch.zeros(30, BPB, dtype=torch.uint8) for _ in range(2)]
    assert both(lambda: t.get(keys(30), out[0]), lambda: t.get(keys(30), out[1])) == [30, 30]
    assert torch.equal(out[0], data) and torch.equal(out[1], data) and t.cluster is True
    t.clear()
    t.close()


# ---- the disk: the backend suite's faults, both threads at once -------------------------------------------

def stored_file(tmp_path: Path) -> FileTier:
    t = FileTier(tmp_path, NS, capacity_bytes=100 * (HEADER_BYTES + BPB), block_bytes=BPB, auth_key=KEY)
    assert t.set(keys(3), rows_of([0, 1, 2])) == 3
    return t


FILE_DAMAGE = {  # raw file bytes -> damaged bytes, and the reason the first reader counts
    "truncate": (lambda raw: raw[:-7], "corrupt"),
    "flip payload": (lambda raw: raw[:HEADER_BYTES + 100] + bytes([raw[HEADER_BYTES + 100] ^ 1])
                     + raw[HEADER_BYTES + 101:], "unauthenticated"),
    "flip header": (lambda raw: raw[:40] + bytes([raw[40] ^ 1]) + raw[41:], "corrupt"),
    "append": (lambda raw: raw + b"x", "corrupt"),
    "empty": (lambda raw: b"", "corrupt"),
    "forged": (lambda raw: raw[:HEADER_BYTES] + bytes(len(raw) - HEADER_BYTES), "unauthenticated"),
}


@pytest.mark.parametrize("damage", list(FILE_DAMAGE))
def test_a_damaged_file_read_by_both_threads(tmp_path: Path, damage: str, per_file: None) -> None:
    t = stored_file(tmp_path)
    path = t._path(block_key(1))
    make, why = FILE_DAMAGE[damage]
    path.write_bytes(make(path.read_bytes()))
    out = [torch.zeros(3, BPB, dtype=torch.uint8) for _ in range(2)]
    assert both(lambda: t.get(keys(3), out[0]), lambda: t.get(keys(3), out[1])) == [1, 1]
    assert torch.equal(out[0][0], rows_of([0])[0]) and torch.equal(out[1][0], rows_of([0])[0])
    s = t.stats()
    # the first reader meets the damage and deletes the file; the second meets it too, or finds it gone
    assert s.misses == 2 and getattr(s, why) >= 1 and getattr(s, why) + s.missing == 2
    assert not path.exists() and t.exists(keys(3)) == 1
    t.check_integrity()


def test_a_reader_meeting_a_bad_file_never_waits_for_a_store(tmp_path: Path, per_file: None) -> None:
    # A store holds the folder while its evictions cascade into the tier below (a Redis that may stall):
    # a read that meets a bad file meanwhile counts its miss and returns; the file goes when the store ends.
    t = FileTier(tmp_path, NS, capacity_bytes=3 * (HEADER_BYTES + BPB), block_bytes=BPB, auth_key=KEY)
    assert t.set(keys(3), rows_of([0, 1, 2])) == 3
    path = t._path(block_key(1))
    path.write_bytes(path.read_bytes()[:-1])
    below_entered, below_free = threading.Event(), threading.Event()

    def stalled_below(ks: list[bytes], payloads: list[bytes]) -> None:
        below_entered.set()
        assert below_free.wait(JOIN_S)

    t.set_eviction_listener(stalled_below)
    store = threading.Thread(target=lambda: t.set(keys(1, base=7), rows_of([7])), name="store")
    store.start()  # evicts block 0 to make room: its cascade waits below, the store holds the folder
    assert below_entered.wait(JOIN_S)
    reader = Worker()
    started = time.monotonic()
    assert reader.call(lambda: get_n(t, keys(2, base=1))) == 0 and time.monotonic() - started < 2
    assert t.stats().corrupt == 1 and path.exists()  # counted now; removed by whoever changes the folder
    below_free.set()
    store.join(JOIN_S)
    reader.stop()
    assert not path.exists() and t.exists(keys(1, base=1)) == 0 and t.exists(keys(1, base=7)) == 1
    t.check_integrity()


def test_a_file_deleted_behind_both_threads_is_missing(tmp_path: Path, per_file: None) -> None:
    t = stored_file(tmp_path)
    t._path(block_key(0)).unlink()
    assert both(lambda: get_n(t, keys(3)), lambda: get_n(t, keys(3))) == [0, 0]
    assert t.stats().missing == t.stats().misses == 2
    t.check_integrity()


def test_a_foreign_file_read_by_both_threads(tmp_path: Path, per_file: None) -> None:
    t = stored_file(tmp_path)
    other = FileTier(tmp_path / "o", Namespace("other", "uint8", f"flat/{BPB}"),
                     capacity_bytes=10 * (HEADER_BYTES + BPB), block_bytes=BPB, auth_key=KEY)
    other.set(keys(1, base=1), rows_of([9]))
    os.replace(other._path(block_key(1)), t._path(block_key(1)))
    assert both(lambda: get_n(t, keys(3)), lambda: get_n(t, keys(3))) == [1, 1]
    s = t.stats()
    assert s.misses == 2 and s.foreign >= 1 and s.foreign + s.missing == 2
    t.check_integrity()


def test_a_full_disk_under_two_writers(tiny_tmpfs: Path) -> None:
    t = FileTier(tiny_tmpfs, NS, capacity_bytes=10**9, block_bytes=BPB, auth_key=KEY)  # more than the disk
    a, b = list(range(200)), list(range(1000, 1200))
    stored = both(lambda: t.set(keys_of(a), rows_of(a)), lambda: t.set(keys_of(b), rows_of(b)))
    s = t.stats()
    assert 0 < sum(stored) < 400 and s.store_failures == 400 - sum(stored) and s.stored == sum(stored)
    held = [k for k in a + b if t.exists(keys_of([k]))]
    assert len(held) == sum(stored)
    out = [torch.zeros(len(held), BPB, dtype=torch.uint8) for _ in range(2)]
    got = both(lambda: t.get(keys_of(held), out[0]), lambda: t.get(keys_of(held), out[1]))
    assert got == [len(held)] * 2
    assert torch.equal(out[0], rows_of(held)) and torch.equal(out[1], rows_of(held))
    t.check_integrity()
    t.close()


# ---- a broken or hostile server: replies redis-py parses into anything ------------------------------------

#: The answer to redis-py's HELLO 3 (a RESP3 map of the fields it reads back).
def resp_value(header: bytes, payload: bytes) -> bytes:
    return b"*2\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(header), header, len(payload), payload)


#: The shape of block 0's value, every header field right, but a tag made without the key
FORGED = resp_value(struct.pack("<4sHH16s16sQ", b"KVPB", 2, 0, NS.digest, block_key(0), BPB) + bytes(16),
                    bytes(BPB))
HOSTILE_HMGET = {  # an HMGET reply, and the reason a get counts it by
    "an integer": (b":7\r\n", "corrupt"),
    "two integers": (b"*2\r\n:1\r\n:2\r\n", "corrupt"),
    "one field": (b"*1\r\n$1\r\nx\r\n", "corrupt"),
    "three fields": (b"*3\r\n$1\r\na\r\n$1\r\nb\r\n$1\r\nc\r\n", "corrupt"),
    "a nil array": (b"*-1\r\n", "corrupt"),
    "an integer that is none": (b":notanumber\r\n", "errors"),  # redis-py's int() raises ValueError
    "no RESP at all": (b"?garbage\r\n", "errors"),
    "a forged value": (FORGED, "unauthenticated"),
}


@pytest.mark.parametrize("reply", list(HOSTILE_HMGET))
def test_hostile_replies_are_misses_on_both_threads(reply: str) -> None:
    answer, why = HOSTILE_HMGET[reply]
    server = FakeRedis({b"EXISTS": b":1\r\n", b"HMGET": answer, b"HSET": b"+OK\r\n"}, protocol=3)
    try:
        t = RedisTier(server.url, NS, block_bytes=BPB, auth_key=KEY, cluster=False, timeout_s=1.0, retry_s=0)
        assert both(lambda: t.exists(keys(1)), lambda: t.exists(keys(1))) == [1, 1]  # it says so; get checks
        assert both(lambda: get_n(t, keys(1)), lambda: get_n(t, keys(1))) == [0, 0]
        assert both(lambda: t.set(keys(1), rows_of([0])), lambda: t.set(keys(1), rows_of([0]))) == [0, 0]
        s = t.stats()
        assert getattr(s, why) == s.misses == 2 and s.store_failures == 2 and s.loaded == 0
        t.close()
    finally:
        server.close()


HOSTILE_INTEGER = {  # an EXISTS reply the tier reads itself (an integer per command, or an error line)
    "not a number": b":notanumber\r\n",
    "a status": b"+OK\r\n",
    "a bulk string": b"$1\r\n1\r\n",
}


@pytest.mark.parametrize("reply", list(HOSTILE_INTEGER))
def test_hostile_integer_replies_are_errors_on_both_threads(reply: str) -> None:
    server = FakeRedis({b"EXISTS": HOSTILE_INTEGER[reply], b"DEL": b"-ERR no\r\n"}, protocol=3)
    try:
        t = RedisTier(server.url, NS, block_bytes=BPB, auth_key=KEY, cluster=False, timeout_s=1.0, retry_s=0)
        assert both(lambda: t.exists(keys(1)), lambda: t.exists(keys(1))) == [0, 0]
        assert t.stats().errors == 2  # each call a fault of the medium: its connection dropped
        assert t.delete(keys(2)) == 0 and t.stats().errors == 2  # error lines are replies: the stream in step
        t.close()
    finally:
        server.close()
