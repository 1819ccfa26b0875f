"""A Redis server that trickles, floods or answers errors, against the Redis tier, on both of its ways to
read replies: the tier's own reader (redis-py's plain connection, the default) and redis-py's parser (where
the tier cannot read the socket itself: another redis-py layout, hiredis).

* A call has a deadline of ``timeout_s`` in all: a server sending its reply a piece every 0.2 s (each read
  answered well within the 0.5 s timeout) is cut off there, a miss, instead of being waited for as long as
  it trickles (the tier held ``exists`` / ``get`` / ``set`` 12-30 s against a 0.5 s timeout).
* The tier's own reader takes at most a line's or a value's bytes: a server flooding one reply line, or
  announcing a field of a terabyte, is cut off at once (the flood's bytes the socket took are counted by
  the fake server), instead of being read to its end.
* Only an ``EXISTS`` reply of 1 is a held block: an error reply (a real Redis 7's ``-BUSY`` in a Lua script,
  ``-NOPERM`` under an ACL, the fake's ``-LOADING``) or another number is a counted error, and 0 a miss.

Expected values: the fake server's replies are written here; each trickled reply takes 30 x 0.2 = 6 s, so a
call that returns its data was not cut off (no timing is asserted).
"""

from __future__ import annotations

import pytest
import torch

redis = pytest.importorskip("redis")

from redis_servers import Busy, FakeRedis, redis_server  # noqa: E402

from kvpool.spec import KVCacheSpec  # noqa: E402
from kvpool.storage.paged import PagedKVCache  # noqa: E402
from kvpool.tiers.auth import TierKey  # noqa: E402
from kvpool.tiers.backend import HEADER_BYTES, Namespace, block_key  # noqa: E402
from kvpool.tiers.redis import RedisTier  # noqa: E402

DEVICE = PagedKVCache(KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_size=4), 8)
BPB = DEVICE.bytes_per_block  # 2 (K, V) x 2 layers x 4 tokens x 2 heads x 8 x 2 B = 512
NS = Namespace.for_cache(DEVICE, model="replies")
KEY = TierKey("kvpool tests: a tier key of 16+ bytes")
READERS = ("tier", "redis-py")


def rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, BPB), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def keys(n: int, base: int = 0) -> list[bytes]:
    return [block_key(base + i) for i in range(n)]


@pytest.fixture(params=READERS)
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Who reads the replies: the tier, or (no SocketBuffer, as in another redis-py layout) redis-py."""
    if request.param == "redis-py":
        import kvpool.tiers._resp as resp

        monkeypatch.setattr(resp, "SocketBuffer", None)
    return request.param


def tier_of(url: str, **kwargs) -> RedisTier:
    options = {"timeout_s": 0.5, "retry_s": 0.0, **kwargs}
    return RedisTier(url, NS, block_bytes=BPB, auth_key=KEY, **options)


# ---- a deadline per call ----------------------------------------------------------------------------------

def test_the_fake_server_answers_as_redis(reader: str) -> None:
    with FakeRedis() as fake:
        t = tier_of(fake.url)
        out = torch.zeros(4, BPB, dtype=torch.uint8)
        assert t.set(keys(4), rows(4)) == 4 and t.exists(keys(6)) == 4
        assert t.get(keys(4), out) == 4 and torch.equal(out, rows(4))
        assert t.delete(keys(1)) == 1 and t.exists(keys(4)) == 0 and t.clear() == 3
        assert t.stats().errors == 0 and t.last_error is None


@pytest.mark.parametrize("command", [b"EXISTS", b"HMGET", b"HSET"])
def test_a_trickling_server_is_cut_off_at_the_call_deadline(reader: str, command: bytes) -> None:
    with FakeRedis() as fake:
        t = tier_of(fake.url)
        assert t.set(keys(8), rows(8)) == 8
        fake.trickle = {command}
        out = torch.zeros(8, BPB, dtype=torch.uint8)
        if command == b"EXISTS":  # 8 x ":1\r\n": a byte every 0.2 s, 6.4 s in all
            assert t.exists(keys(8)) == 0
        elif command == b"HMGET":  # 8 values of 512 + 64 bytes, in 30 pieces
            assert t.get(keys(8), out) == 0
        else:
            assert t.set(keys(8, base=8), rows(8)) == 0 and t.stats().store_failures == 8
        assert "deadline" in t.last_error
        assert t.stats().errors == (0 if command == b"HSET" else 1)  # (a failed store is no lookup error)
        fake.trickle = set()  # it answers at once again: so does the tier (no retry interval here)
        assert t.exists(keys(8)) == 8 and t.get(keys(8), out) == 8 and torch.equal(out, rows(8))


@pytest.mark.parametrize("command", [b"INFO", b"PING"])
def test_a_server_trickling_its_handshake_is_cut_off_too(reader: str, command: bytes) -> None:
    with FakeRedis() as fake:
        fake.trickle = {command}  # the first connect asks INFO cluster, then PING
        t = tier_of(fake.url)
        assert t.exists(keys(1)) == 0 and t.stats().errors == 1 and "deadline" in t.last_error
        fake.trickle = set()
        assert t.set(keys(1), rows(1)) == 1 and t.exists(keys(1)) == 1


# ---- a bound on the bytes the tier reads ------------------------------------------------------------------

FLOOD = 40 * 2**20


@pytest.mark.parametrize("command, head, filler", [
    (b"EXISTS", b":", b"1"),  # one integer line that never ends
    (b"HMGET", b"*2\r\n$%d\r\n%s\r\n$1099511627776\r\n" % (HEADER_BYTES, b"h" * HEADER_BYTES), b"p"),  # 1 TiB
    (b"HSET", b"-ERR ", b"e"),  # an error line that never ends
])
def test_the_tier_reads_at_most_a_reply_s_bytes(command: bytes, head: bytes, filler: bytes) -> None:
    with FakeRedis() as fake:
        t = tier_of(fake.url, timeout_s=5.0)
        assert t.set(keys(2), rows(2)) == 2
        fake.flood, fake.flood_bytes = {command: (head, filler)}, FLOOD
        if command == b"HSET":
            assert t.set(keys(2, base=2), rows(2)) == 0
        elif command == b"EXISTS":
            assert t.exists(keys(2)) == 0
        else:
            assert t.get(keys(2), torch.zeros(2, BPB, dtype=torch.uint8)) == 0
        assert "InvalidResponse" in t.last_error
        # the tier hung up after a line of LINE_BYTES or at the length: the socket took its buffers' worth
        assert fake.flooded < FLOOD // 2


# ---- only EXISTS 1 is a held block ------------------------------------------------------------------------

@pytest.mark.parametrize("reply", [b"-BUSY Redis is busy running a script.\r\n",
                                   b"-LOADING Redis is loading the dataset in memory\r\n",
                                   b"-NOPERM this user has no permissions to run the 'exists' command\r\n",
                                   b":-1\r\n", b":2\r\n", b"$1\r\n1\r\n", b"+1\r\n"])
def test_an_exists_reply_other_than_1_is_no_held_block(reader: str, reply: bytes) -> None:
    with FakeRedis() as fake:
        t = tier_of(fake.url)
        assert t.set(keys(1), rows(1)) == 1  # (the real value is there: the reply is what is wrong)
        fake.replies[b"EXISTS"] = reply
        assert t.exists(keys(8)) == 0
        assert t.stats().errors == 1  # a fault of the medium, counted once: the run ends at it
        fake.replies[b"EXISTS"] = b":0\r\n"
        assert t.exists(keys(1)) == 0 and t.stats().errors == 1  # 0: a plain miss


def test_hmget_and_hset_error_replies_are_errors_not_corrupt_values(reader: str) -> None:
    with FakeRedis() as fake:
        t = tier_of(fake.url)
        assert t.set(keys(2), rows(2)) == 2
        fake.replies[b"HMGET"] = b"-LOADING Redis is loading the dataset in memory\r\n"
        assert t.get(keys(2), torch.zeros(2, BPB, dtype=torch.uint8)) == 0
        assert (t.stats().errors, t.stats().corrupt) == (1, 0)
        fake.replies[b"HMGET"] = b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
        assert t.get(keys(2), torch.zeros(2, BPB, dtype=torch.uint8)) == 0
        assert (t.stats().errors, t.stats().corrupt) == (1, 1)  # someone else's value under the key
        for reply in (b":-1\r\n", b":3\r\n", b"-BUSY\r\n"):  # HSET of two fields answers 0, 1 or 2
            fake.replies[b"HSET"] = reply
            assert t.set(keys(2, base=4), rows(2)) == 0
        assert t.stats().store_failures == 6 and t.num_blocks == 2


def test_a_real_redis_busy_in_a_script_holds_no_block(reader: str, tmp_path) -> None:
    with redis_server(tmp_path, "--busy-reply-threshold", "20") as server:
        t = tier_of(server.url, timeout_s=5.0)
        assert t.set(keys(2), rows(2)) == 2 and t.exists(keys(8)) == 2
        with Busy(server.url):  # every command of another client: -BUSY
            assert t.exists(keys(8)) == 0 and t.stats().errors == 1
            assert t.get(keys(2), torch.zeros(2, BPB, dtype=torch.uint8)) == 0
            assert (t.stats().errors, t.stats().corrupt) == (2, 0)
        assert t.exists(keys(8)) == 2


def test_a_real_redis_acl_without_exists_holds_no_block(reader: str, tmp_path) -> None:
    with redis_server(tmp_path) as server:
        server.cli("ACL", "SETUSER", "kvpool", "on", "nopass", "~*", "+@all", "-exists")
        host = server.url.removeprefix("redis://")
        t = tier_of(f"redis://kvpool@{host}", timeout_s=5.0)
        assert t.set(keys(2), rows(2)) == 2  # HSET is allowed: the blocks are there
        assert t.exists(keys(2)) == 0 and t.stats().errors == 1
        out = torch.zeros(2, BPB, dtype=torch.uint8)
        assert t.get(keys(2), out) == 2 and torch.equal(out, rows(2))
