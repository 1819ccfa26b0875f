"""Each tier backend against its contract: bit-exact round trips, prefix semantics of exists/get, LRU order
against a brute-force OrderedDict model, and every fault of the issue with the real medium (a tmpfs that
fills up, truncated / flipped / foreign files, a Redis server killed mid-run or never there, a Redis that
evicts by its own maxmemory policy, a three-node Redis Cluster). Expected values come from the model, from
hand arithmetic (noted), or from bytes written by the test itself."""

from __future__ import annotations

import os
import pickle
import random
import struct
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash

from kvpool.errors import ConfigError, IntegrityError, InvalidArgumentError
from kvpool.spec import KVCacheSpec
from kvpool.storage.paged import PagedKVCache
from kvpool.tiers.auth import TierKey
from kvpool.tiers.backend import (
    HEADER_BYTES,
    Namespace,
    block_key,
    block_layout,
    encode_header,
    gather_rows,
    scatter_rows,
    verify_value,
    weights_fingerprint,
)
from kvpool.tiers.file import FileTier
from kvpool.tiers.host import HostTier

redis = pytest.importorskip("redis")
from kvpool.tiers.redis import RedisTier  # noqa: E402

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, block_size=4)
DEVICE = PagedKVCache(SPEC, 8)
BPB = DEVICE.bytes_per_block  # 2 (K, V) x 2 layers x 4 tokens x 2 heads x 8 x 2 B = 512
NS = Namespace.for_cache(DEVICE, model="tiny")
OTHER = Namespace.for_cache(DEVICE, model="another")
KEY = TierKey("kvpool tests: a tier key of 16+ bytes")  # the fleet secret of these tests
KEY0 = block_key(0)


def rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, BPB), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def keys(n: int, base: int = 0) -> list[bytes]:
    return [block_key(base + i) for i in range(n)]


# ---- namespace, keys, the value format ---------------------------------------------------------------

def test_bytes_per_block_by_hand() -> None:
    assert BPB == 2 * 2 * 4 * 2 * 8 * 2 == 512


def test_namespace_digest_separates_every_field() -> None:
    base = Namespace("m", "bfloat16", "L", 0, 2, 0, "blake2b")
    variants = [Namespace("n", "bfloat16", "L", 0, 2, 0, "blake2b"), Namespace("m", "float16", "L", 0, 2, 0,
                "blake2b"), Namespace("m", "bfloat16", "K", 0, 2, 0, "blake2b"),
                Namespace("m", "bfloat16", "L", 1, 2, 0, "blake2b"), Namespace("m", "bfloat16", "L", 0, 2, 1,
                "blake2b"), Namespace("m", "bfloat16", "L", 0, 2, 0, "xxh3_128"),
                Namespace("mb", "float16", "L", 0, 2, 0, "blake2b")]  # no concatenation collision
    digests = {v.digest for v in [base, *variants]}
    assert len(digests) == 8 and all(len(d) == 16 for d in digests)
    assert Namespace("m", "bfloat16", "L", 0, 2, 0, "blake2b").digest == base.digest  # stable
    for bad in [dict(tp_rank=2, tp_size=2), dict(layer_group=-1), dict(tp_rank=True)]:
        with pytest.raises(InvalidArgumentError):
            Namespace("m", "d", "l", **bad)


def test_namespace_for_cache_reads_dtype_and_layout() -> None:
    assert NS.kv_dtype == "float16" and NS.layout == block_layout(DEVICE) == "PagedKVCache/NHD/2x2x4x2x8"
    hnd = PagedKVCache(SPEC, 8, layout="HND")
    assert Namespace.for_cache(hnd, model="tiny").digest != NS.digest


def test_weights_fingerprint_follows_the_bits() -> None:
    a = [torch.ones(3, 4), torch.zeros(2)]
    assert weights_fingerprint(a) == weights_fingerprint([t.clone() for t in a])
    b = [torch.ones(3, 4), torch.tensor([0.0, -0.0])]  # -0.0 == 0.0 but its bits differ
    assert weights_fingerprint(a) != weights_fingerprint(b)
    assert weights_fingerprint([torch.ones(12)]) != weights_fingerprint([torch.ones(3, 4)])  # shape counts


def test_config_fingerprint_follows_what_computes_the_kv() -> None:
    # The same weights with another rope_theta compute other keys: generate's namespace used the weights
    # alone, so two such processes on one Redis would have shared wrong KV.
    from kvpool.tiers.backend import config_fingerprint

    base = {"model_type": "llama", "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "torch_dtype": torch.float32,
            "_name_or_path": "/a/b", "transformers_version": "5.24.0"}
    same = {**base, "_name_or_path": "/elsewhere", "transformers_version": "5.25.0"}  # loaded elsewhere
    assert config_fingerprint(base) == config_fingerprint(dict(reversed(same.items())))
    for change in ({"rope_theta": 500000.0}, {"rope_scaling": {"type": "yarn", "factor": 4.0}},
                   {"rms_norm_eps": 1e-6}, {"torch_dtype": torch.bfloat16}):
        assert config_fingerprint({**base, **change}) != config_fingerprint(base), change
    assert len(config_fingerprint(base)) == 32


def test_block_key_forms() -> None:
    h = bytes(range(16))
    assert block_key(h) == h
    assert block_key(1) == bytes(15) + b"\x01" and block_key(-1) == b"\xff" * 16
    for bad in ["abc", b"short", True, 2**127, 1.0]:
        with pytest.raises(InvalidArgumentError):
            block_key(bad)


def why_not(value: bytes, ns: Namespace = NS, key: bytes = KEY0, key_of_tier: TierKey = KEY) -> str | None:
    """Why ``value`` is a miss for block ``key`` of ``ns`` in a tier of key ``key_of_tier`` (None: served)."""
    return verify_value(value, ns.digest, key, 512, auth_key=key_of_tier)[0]


def test_every_flipped_byte_of_a_value_is_detected() -> None:
    payload = bytes(range(256)) * 2
    value = encode_header(NS.digest, KEY0, payload, auth_key=KEY) + payload
    assert len(value) == HEADER_BYTES + 512 and why_not(value) is None
    for pos in range(len(value)):
        flipped = bytearray(value)
        flipped[pos] ^= 0x10
        assert why_not(bytes(flipped)) is not None, pos
    assert why_not(value[:-1]) == "corrupt"  # truncated
    assert why_not(value, ns=OTHER) == "foreign"
    assert why_not(value, key=keys(2)[1]) == "foreign"  # copied under another key
    assert why_not(value, key_of_tier=TierKey("another fleet's secret, 16+ bytes")) == "unauthenticated"


def test_gather_and_scatter_rows_are_bit_exact() -> None:
    cache = PagedKVCache(SPEC, 8, layout="HND")
    bits = torch.randint(-(2**15), 2**15, cache.buffer.shape, dtype=torch.int32)
    cache.buffer.view(torch.int16).copy_(bits)
    out = torch.empty(3, BPB, dtype=torch.uint8)
    gather_rows(cache, [5, 0, 2], out)
    for i, b in enumerate([5, 0, 2]):  # row i = block b's bytes, K then V, layer by layer
        want = cache.buffer[:, :, b].contiguous().view(torch.uint8).flatten()
        assert torch.equal(out[i], want)
    other = PagedKVCache(SPEC, 8, layout="HND", zero=True)
    scatter_rows(other, [1, 7, 3], out)
    for src, dst in zip([5, 0, 2], [1, 7, 3], strict=True):
        assert torch.equal(other.buffer[:, :, dst].view(torch.int16),
                           cache.buffer[:, :, src].view(torch.int16))


# ---- every backend: the contract --------------------------------------------------------------------

@pytest.fixture(params=["host", "file", "redis", "cluster"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator:
    """A tier of ample capacity and 512-byte blocks, in a namespace of its own."""
    ns = Namespace.for_cache(DEVICE, model=f"contract-{request.node.name}")
    if request.param == "host":
        t = HostTier(64, ns, like=DEVICE)
    elif request.param == "file":
        t = FileTier(tmp_path / "disk", ns, capacity_bytes=64 * (HEADER_BYTES + BPB), block_bytes=BPB,
                     auth_key=KEY)
    elif request.param == "redis":
        t = RedisTier(request.getfixturevalue("redis_single").url, ns, block_bytes=BPB, auth_key=KEY)
    else:
        t = RedisTier(request.getfixturevalue("redis_cluster_nodes")[0].url, ns, block_bytes=BPB,
                      auth_key=KEY)
    yield t
    t.close()


def test_round_trip_is_bit_exact(tier) -> None:
    data = rows(20, seed=1)
    assert tier.set(keys(20), data) == 20
    out = torch.zeros(20, BPB, dtype=torch.uint8)
    assert tier.get(keys(20), out) == 20
    assert torch.equal(out, data)
    s = tier.stats()
    assert (s.stored, s.stored_bytes, s.loaded, s.loaded_bytes, s.misses) == (20, 20 * BPB, 20, 20 * BPB, 0)
    tier.check_integrity()


def test_exists_and_get_stop_at_the_first_missing_block(tier) -> None:
    data = rows(10, seed=2)
    tier.set(keys(10), data)
    ask = keys(4) + keys(1, base=500) + keys(5, base=4)  # a gap at position 4
    assert tier.exists(ask) == 4
    out = torch.zeros(10, BPB, dtype=torch.uint8)
    assert tier.get(ask, out) == 4 and torch.equal(out[:4], data[:4])
    assert tier.stats().missing == 1  # one get that stopped, at one missing block
    assert tier.exists([]) == 0 and tier.get([], out) == 0 and tier.exists(keys(1, base=500)) == 0


def test_a_stored_key_is_kept_and_delete_removes(tier) -> None:
    data = rows(4, seed=3)
    tier.set(keys(4), data)
    assert tier.set(keys(2), rows(2, seed=99)) == 2  # already held: refreshed, not rewritten
    assert tier.stats().stored == (6 if tier.medium == "remote" else 4)  # Redis writes again (no index)
    assert tier.num_blocks == 4  # a rewrite is no new block (Redis counted it twice)
    out = torch.zeros(4, BPB, dtype=torch.uint8)
    tier.get(keys(4), out)
    assert torch.equal(out[2:], data[2:])
    if tier.medium != "remote":
        assert torch.equal(out[:2], data[:2])
    assert tier.delete(keys(2)) == 2 and tier.exists(keys(4)) == 0 and tier.exists(keys(2, base=2)) == 2
    tier.check_integrity()


def test_bad_rows_are_refused_before_anything_changes(tier) -> None:
    for bad in [torch.zeros(2, BPB, dtype=torch.float32), torch.zeros(1, BPB, dtype=torch.uint8),
                torch.zeros(2, BPB + 1, dtype=torch.uint8), torch.zeros(BPB, 2, dtype=torch.uint8).t(), None]:
        with pytest.raises(InvalidArgumentError):
            tier.set(keys(2), bad)
    assert tier.exists(keys(2)) == 0 and tier.stats().stored == 0


# ---- LRU order against a brute-force model ---------------------------------------------------------

def lru_model_run(tier, capacity: int, seed: int) -> None:
    """Random set/get/refresh/delete batches; the model is an OrderedDict of keys (set: refresh the held
    ones first, then insert the new ones in order, evicting the oldest; a read refreshes the chain tail
    first, so its head ends most recent). Compares membership and contents after every call."""
    rng = random.Random(seed)
    model: OrderedDict[int, int] = OrderedDict()  # key -> seed of its row
    universe = 24
    for step in range(150):
        op = rng.choice(["set", "set", "get", "delete"])
        ks = rng.sample(range(universe), rng.randint(1, 5))
        if op == "set":
            seeds = [1000 * step + k for k in ks]
            data = torch.cat([rows(1, seed=s) for s in seeds])
            tier.set(keys_of(ks), data)
            held = [k for k in ks if k in model]
            for k in held:
                model.move_to_end(k)
            for k, s in zip(ks, seeds, strict=True):
                if k not in model:
                    if len(model) == capacity:
                        model.popitem(last=False)
                    model[k] = s
        elif op == "get":
            out = torch.zeros(len(ks), BPB, dtype=torch.uint8)
            want = 0
            while want < len(ks) and ks[want] in model:
                want += 1
            assert tier.get(keys_of(ks), out) == want
            for i in range(want):
                assert torch.equal(out[i], rows(1, seed=model[ks[i]])[0])
            refresh(model, ks[:want], tier)
        else:
            assert tier.delete(keys_of(ks)) == sum(k in model for k in ks)
            for k in ks:
                model.pop(k, None)
        assert [k for k in range(universe) if tier.exists(keys_of([k]))] == sorted(model)
    tier.check_integrity()


def keys_of(ks: list[int]) -> list:
    return [block_key(k) for k in ks]


def refresh(model: OrderedDict, ks: list[int], tier) -> None:
    """How a read refreshes: the host tier frees a chain tail first (its head ends most recent), the file
    tier moves each block to the tail in order as it reads it."""
    for k in (ks[::-1] if tier.medium == "host" else ks):
        model.move_to_end(k)


def test_host_tier_lru_matches_the_model() -> None:
    lru_model_run(HostTier(6, NS, like=DEVICE), 6, seed=4)


def test_file_tier_lru_matches_the_model(tmp_path: Path) -> None:
    lru_model_run(FileTier(tmp_path, NS, capacity_bytes=6 * (HEADER_BYTES + BPB) + 100, block_bytes=BPB,
                           auth_key=KEY), 6,
                  seed=5)


def test_file_tier_keeps_its_blocks_across_a_restart_oldest_first(tmp_path: Path) -> None:
    t = FileTier(tmp_path, NS, capacity_bytes=10 * (HEADER_BYTES + BPB), block_bytes=BPB, auth_key=KEY)
    for i in range(5):
        t.set(keys(1, base=i), rows(1, seed=i))
        os.utime(t._path(block_key(i)), ns=(10**18 + i * 10**9,) * 2)  # distinct mtimes: i is older
    t.close()
    again = FileTier(tmp_path, NS, capacity_bytes=3 * (HEADER_BYTES + BPB), block_bytes=BPB, auth_key=KEY)
    assert [k for k in range(5) if again.exists(keys(1, base=k))] == [2, 3, 4]  # the 2 oldest evicted
    out = torch.zeros(1, BPB, dtype=torch.uint8)
    assert again.get(keys(1, base=4), out) == 1 and torch.equal(out, rows(1, seed=4))
    again.check_integrity()


def test_hash_only_tiers_store_headers(tmp_path: Path) -> None:
    host = HostTier(3, NS)  # a batch larger than the tier: its first block is evicted at once
    assert host.set([1, 2, 3, 4], None) == 3 and host.exists([2, 3, 4]) == 3 and host.exists([1]) == 0
    disk = FileTier(tmp_path, NS, capacity_bytes=2 * HEADER_BYTES, block_bytes=0, auth_key=KEY)
    assert disk.set([1, 2, 3], None) == 2 and disk.exists([2, 3]) == 2 and disk.exists([1]) == 0
    assert host.stats().evictions == disk.stats().evictions == 1
    assert disk.get([2, 3], None) == 2 and disk.used_bytes == 2 * HEADER_BYTES


# ---- faults: the disk -----------------------------------------------------------------------------

def stored_file(tmp_path: Path, n: int = 3) -> tuple[FileTier, torch.Tensor]:
    t = FileTier(tmp_path, NS, capacity_bytes=100 * (HEADER_BYTES + BPB), block_bytes=BPB, auth_key=KEY)
    data = rows(n, seed=6)
    assert t.set(keys(n), data) == n
    return t, data


@pytest.fixture(params=["in turn", "overlapped"])
def load_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a disk test both ways: MACs computed and checked in turn, and on the MAC thread while the block
    is written or the next one read (``overlap_bytes`` at most the tests' 512-byte blocks)."""
    monkeypatch.setattr(FileTier, "overlap_bytes", 0 if request.param == "in turn" else 1)
    return request.param


@pytest.mark.parametrize("damage", ["truncate", "flip payload", "flip header", "append", "empty"])
def test_a_damaged_file_is_a_counted_miss_and_is_deleted(tmp_path: Path, damage: str, load_path: str,
                                                          per_file: None) -> None:
    t, data = stored_file(tmp_path)
    path = t._path(block_key(1))
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[:-7]
    elif damage == "flip payload":
        raw[HEADER_BYTES + 100] ^= 1
    elif damage == "flip header":
        raw[40] ^= 1  # inside the payload length field
    elif damage == "append":
        raw += b"x"
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))
    if damage in ("truncate", "append", "empty"):  # the index still has the old size: said so, by name
        with pytest.raises(IntegrityError, match="1 file and the index disagree"):
            t.check_integrity()
    out = torch.zeros(3, BPB, dtype=torch.uint8)
    assert t.get(keys(3), out) == 1 and torch.equal(out[0], data[0])
    why = "unauthenticated" if damage == "flip payload" else "corrupt"  # a MAC tells no flip from a forgery
    assert t.stats().to_dict()[why] == t.stats().misses == 1 and not path.exists() and t.exists(keys(3)) == 1
    t.check_integrity()


def test_a_value_of_another_namespace_is_a_foreign_miss(tmp_path: Path, load_path: str,
                                                        per_file: None) -> None:
    t, _ = stored_file(tmp_path)
    other = FileTier(tmp_path / "o", OTHER, capacity_bytes=10 * (HEADER_BYTES + BPB), block_bytes=BPB,
                     auth_key=KEY)
    other.set(keys(1, base=1), rows(1, seed=7))
    os.replace(other._path(block_key(1)), t._path(block_key(1)))  # another model's block under our name
    out = torch.zeros(3, BPB, dtype=torch.uint8)
    assert t.get(keys(3), out) == 1 and t.stats().foreign == 1


def test_a_file_deleted_behind_the_tiers_back_is_missing(tmp_path: Path, per_file: None) -> None:
    t, _ = stored_file(tmp_path)
    t._path(block_key(0)).unlink()
    assert t.get(keys(3), torch.zeros(3, BPB, dtype=torch.uint8)) == 0 and t.stats().missing == 1
    t.check_integrity()


def test_a_load_refreshes_exactly_the_blocks_it_returns(tmp_path: Path, load_path: str,
                                                        per_file: None) -> None:
    t, data = stored_file(tmp_path, n=5)  # LRU order 0 1 2 3 4
    path = t._path(block_key(3))
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES] ^= 1
    path.write_bytes(bytes(raw))
    out = torch.zeros(5, BPB, dtype=torch.uint8)
    assert t.get(keys(5), out) == 3 and torch.equal(out[:3], data[:3])
    # 0, 1, 2 read and moved to the tail in order; 3 is a miss and dropped; 4 (after it) is left alone
    assert list(t._index) == [block_key(i) for i in (4, 0, 1, 2)]
    assert t.stats().loaded == 3 and t.stats().unauthenticated == 1
    t.check_integrity()


def test_a_full_disk_is_a_counted_store_failure(tiny_tmpfs: Path, load_path: str) -> None:
    t = FileTier(tiny_tmpfs, NS, capacity_bytes=10**9, block_bytes=BPB, auth_key=KEY)  # more than it holds
    data = rows(400, seed=8)
    stored = t.set(keys(400), data)
    s = t.stats()
    assert 0 < stored < 400 and s.store_failures == 400 - stored and s.stored == stored
    assert not list(tiny_tmpfs.glob("*/*/*.tmp*"))  # no half-written temporary file is left
    out = torch.zeros(stored, BPB, dtype=torch.uint8)
    assert t.get(keys(stored), out) == stored and torch.equal(out, data[:stored])
    t.check_integrity()


# ---- faults and order: values in segment files (the default for small values) ---------------------------

SEGMENT_DAMAGE = {  # the byte of block 1's value flipped in its segment, and the reason of the miss
    "flip payload": (HEADER_BYTES + 100, "unauthenticated"),
    "flip header": (40, "corrupt"),  # inside the payload length field
    "flip key": (30, "foreign"),  # inside the key field: another block's value, as the header says
}


@pytest.mark.parametrize("damage", list(SEGMENT_DAMAGE))
def test_a_damaged_value_in_a_segment_is_a_counted_miss_and_is_erased(tmp_path: Path, damage: str,
                                                                      load_path: str) -> None:
    t, data = stored_file(tmp_path)  # one store: one segment, its values in order
    path, at = t._value_at(block_key(1))
    assert t._value_at(block_key(0)) == (path, 0) and at == t.value_bytes == HEADER_BYTES + BPB
    where, why = SEGMENT_DAMAGE[damage]
    raw = bytearray(path.read_bytes())
    raw[at + where] ^= 1
    path.write_bytes(bytes(raw))
    out = torch.zeros(3, BPB, dtype=torch.uint8)
    assert t.get(keys(3), out) == 1 and torch.equal(out[0], data[0])
    assert t.stats().to_dict()[why] == t.stats().misses == 1 and t.exists(keys(3)) == 1
    assert path.read_bytes()[at:at + HEADER_BYTES] == bytes(HEADER_BYTES)  # erased: a restart skips it
    assert t.get(keys(1, base=2), out) == 1 and torch.equal(out[0], data[2])  # its neighbours still serve
    t.check_integrity()


def test_a_segment_cut_or_deleted_behind_the_tiers_back(tmp_path: Path, load_path: str) -> None:
    t, data = stored_file(tmp_path)
    path, _ = t._value_at(block_key(0))
    path.write_bytes(path.read_bytes()[:-7])  # the last value torn
    with pytest.raises(IntegrityError, match="1 segment file"):
        t.check_integrity()
    out = torch.zeros(3, BPB, dtype=torch.uint8)
    assert t.get(keys(3), out) == 2 and torch.equal(out[:2], data[:2]) and t.stats().corrupt == 1
    path.unlink()
    assert t.get(keys(2), out) == 0 and t.stats().missing == 1 and t.stats().misses == 2


def test_segments_across_a_restart_in_write_order_without_what_left(tmp_path: Path) -> None:
    value = HEADER_BYTES + BPB
    t = FileTier(tmp_path, NS, capacity_bytes=10 * value, block_bytes=BPB, auth_key=KEY)
    data = rows(5, seed=9)
    assert t.set(keys(3), data[:3]) == 3 and t.set(keys(2, base=3), data[3:]) == 2  # two segments
    assert t.delete(keys(1, base=1)) == 1  # a dead slot in the first
    t.close()
    again = FileTier(tmp_path, NS, capacity_bytes=10 * value, block_bytes=BPB, auth_key=KEY)
    assert list(again._index) == [block_key(k) for k in (0, 2, 3, 4)]  # written in that order; 1 deleted
    out = torch.zeros(1, BPB, dtype=torch.uint8)
    for k in (0, 2, 3, 4):
        assert again.get(keys(1, base=k), out) == 1 and torch.equal(out[0], data[k])
    again.check_integrity()
    again.close()
    small = FileTier(tmp_path, NS, capacity_bytes=2 * value, block_bytes=BPB, auth_key=KEY)
    assert list(small._index) == [block_key(3), block_key(4)]  # the oldest evicted down to the capacity
    small.check_integrity()


#: Names int(name, 16) reads as a segment number (so a restart indexed their values), none of which is the
#: 16 lowercase hex digits the tier writes, reads and deletes: their values were never read nor removed, and
#: check_integrity() failed for good (found by renaming a segment after a kill -9).
NOT_SEGMENT_NAMES = ["0", "1f", "0x0", "0_0", " 0", "+0", "0000000000000000 ", "000000000000000A",
                     "00000000000000000", "000000000000000"]


@pytest.mark.parametrize("name", NOT_SEGMENT_NAMES)
def test_a_segment_under_another_name_is_deleted_at_start(tmp_path: Path, name: str) -> None:
    t, _ = stored_file(tmp_path)
    path, _ = t._value_at(block_key(0))
    assert path.name == "0000000000000000"  # the first segment: 16 lowercase hex digits
    t.close()
    path.rename(path.with_name(name))
    again = FileTier(tmp_path, NS, capacity_bytes=100 * (HEADER_BYTES + BPB), block_bytes=BPB, auth_key=KEY)
    assert not path.with_name(name).exists() and not list(path.parent.iterdir())  # deleted, as documented
    assert again.exists(keys(3)) == 0 and again.num_blocks == 0
    again.check_integrity()
    assert again.set(keys(3), rows(3)) == 3  # and the tier goes on (its next segment after the others)
    again.check_integrity()


@pytest.mark.parametrize("move", ["upper case", "spaced", "another subfolder", "a folder"])
def test_a_value_file_under_another_name_is_deleted_at_start(tmp_path: Path, move: str,
                                                             per_file: None) -> None:
    """The same for a file per value: bytes.fromhex also takes upper case and spaces, and a file in
    another subfolder than its name's first two digits was indexed but read and deleted at its own place;
    a folder where a file belongs was left, and check_integrity() failed on it for good."""
    t = FileTier(tmp_path, NS, capacity_bytes=100 * (HEADER_BYTES + BPB), block_bytes=BPB, auth_key=KEY)
    ks, data = [block_key(k) for k in (0, 0xABCDEF, 2)], rows(3, seed=6)  # the second one's name has letters
    assert t.set(ks, data) == 3
    path = t._path(ks[1])
    t.close()
    if move == "upper case":
        path.rename(path.with_name(path.name.upper()))
    elif move == "spaced":
        path.rename(path.with_name(path.name[:2] + " " + path.name[2:]))
    elif move == "another subfolder":
        (path.parent.parent / "zz").mkdir()
        path.rename(path.parent.parent / "zz" / path.name)
    else:
        path.unlink()
        path.mkdir()
        (path / "inside").write_bytes(b"x")
    again = FileTier(tmp_path, NS, capacity_bytes=100 * (HEADER_BYTES + BPB), block_bytes=BPB, auth_key=KEY)
    again.check_integrity()
    assert sorted(p.name for p in path.parent.parent.glob("*/*")) == sorted(
        again._path(k).name for k in (ks[0], ks[2]))
    out = torch.zeros(1, BPB, dtype=torch.uint8)
    assert again.exists(ks[:1]) == 1 and again.exists(ks[1:2]) == 0
    assert again.get(ks[2:], out) == 1 and torch.equal(out[0], data[2])


def test_segments_are_compacted_and_keep_the_lru_order(tmp_path: Path) -> None:
    # Per-value eviction in LRU order over segments of several values, against a brute-force LRU; dead
    # slots force compactions (which move values, never their order) and stay within the capacity.
    cap = 4
    t = FileTier(tmp_path, NS, capacity_bytes=cap * (HEADER_BYTES + BPB), block_bytes=BPB, auth_key=KEY)
    data = {k: rows(1, seed=100 + k)[0] for k in range(40)}
    model: OrderedDict[int, None] = OrderedDict()
    rng, stores = random.Random(11), 0
    for _ in range(80):
        batch = rng.sample(range(40), rng.randint(2, 4))
        if model and rng.random() < 0.6:  # one value of an older segment kept alive: the others die around it
            k = rng.choice(list(model))
            t.refresh(keys_of([k]))
            model.move_to_end(k)
        new = [k for k in batch if k not in model]
        for k in batch:
            if k in model:
                model.move_to_end(k)
        while len(model) + len(new) > cap:
            model.popitem(last=False)
        model.update(dict.fromkeys(new))
        stores += bool(new)
        assert t.set(keys_of(batch), torch.stack([data[k] for k in batch])) == len(batch)
        assert list(t._index) == [block_key(k) for k in model]
        t.check_integrity()  # dead slots hold at most the capacity
    held = list(model)
    out = torch.zeros(len(held), BPB, dtype=torch.uint8)
    assert t.get(keys_of(held), out) == len(held)
    assert torch.equal(out, torch.stack([data[k] for k in held]))
    assert t._segments._next > stores  # more segments written than stores of new values: compactions


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_bad_directory_is_a_config_error(tmp_path: Path, where: str) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ConfigError, match="disk tier"):
        FileTier(f if where == "a file" else f / "sub", NS, capacity_bytes=1000, block_bytes=BPB,
                 auth_key=KEY)


def test_one_file_tier_per_namespace_directory(tmp_path: Path) -> None:
    """Two tiers on one folder would each index and evict the same files: the second is refused, saying
    whose the folder is (a second tier of this process was refused as "another process")."""
    t = FileTier(tmp_path, NS, capacity_bytes=1000, block_bytes=BPB, auth_key=KEY)
    with pytest.raises(ConfigError, match="another FileTier of this process holds it"):
        FileTier(tmp_path, NS, capacity_bytes=1000, block_bytes=BPB, auth_key=KEY)
    (tmp_path / "link").symlink_to(tmp_path)
    with pytest.raises(ConfigError, match="another FileTier of this process"):  # the folder by another path
        FileTier(tmp_path / "link", NS, capacity_bytes=1000, block_bytes=BPB, auth_key=KEY)
    FileTier(tmp_path, OTHER, capacity_bytes=1000, block_bytes=BPB, auth_key=KEY).close()  # another namespace
    t.close()
    FileTier(tmp_path, NS, capacity_bytes=1000, block_bytes=BPB, auth_key=KEY).close()


def test_a_folder_another_process_holds_is_refused_as_such(tmp_path: Path) -> None:
    import subprocess
    import sys

    FileTier(tmp_path, NS, capacity_bytes=1000, block_bytes=BPB, auth_key=KEY).close()  # made, then let go
    lock = tmp_path / NS.tag / ".lock"
    hold = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
            "print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match="another process holds it"):
            FileTier(tmp_path, NS, capacity_bytes=1000, block_bytes=BPB, auth_key=KEY)
    finally:
        holder.communicate("", timeout=30)
    FileTier(tmp_path, NS, capacity_bytes=1000, block_bytes=BPB, auth_key=KEY).close()  # its turn now


def test_a_block_larger_than_the_disk_tier_is_refused(tmp_path: Path) -> None:
    t = FileTier(tmp_path, NS, capacity_bytes=BPB, block_bytes=BPB, auth_key=KEY)  # the header does not fit
    assert t.set(keys(1), rows(1)) == 0 and t.stats().store_failures == 1 and t.num_blocks == 0


# ---- forged values: someone who can write the folder or the server, but lacks the fleet's key ------------

V1_HEADER = struct.Struct("<4sHH16s16sQQQ")  # format 1: magic, version, flags, ns, key, length, XXH3-64, 0
V2_SIGNED = struct.Struct("<4sHH16s16sQ")  # format 2 without its tag: what the MAC covers, then the payload
EVIL = rows(1, seed=666)[0].numpy().tobytes()  # the KV a forger wants a victim to compute with


def forged(how: str, key: bytes, authentic: bytes) -> bytes:
    """A value a forger writes under block ``key`` of NS, made without KEY. ``authentic``: the value stored
    there (header + payload), which a forger can read."""
    if how == "format 1 header":  # the review's attack: swap the payload, recompute the unkeyed header
        checksum = xxhash.xxh3_64_intdigest(EVIL)
        return V1_HEADER.pack(b"KVPB", 1, 0, NS.digest, key, len(EVIL), checksum, 0) + EVIL
    signed = V2_SIGNED.pack(b"KVPB", 2, 0, NS.digest, key, len(EVIL))
    if how == "guessed tag":
        return signed + bytes(16) + EVIL
    if how == "kept tag":  # the authentic header, a new payload
        return authentic[:HEADER_BYTES] + EVIL
    if how == "another key's tag":  # a fleet with another secret, or the public key, signed it
        return encode_header(NS.digest, key, EVIL, auth_key=TierKey("not this fleet's secret!")) + EVIL
    if how == "public key":
        return encode_header(NS.digest, key, EVIL, auth_key=TierKey.public()) + EVIL
    assert how == "another block's value, renamed"  # an authentic value moved under key, its header edited
    other = block_key(2)
    value = encode_header(NS.digest, other, EVIL, auth_key=KEY) + EVIL  # as the fleet stored block 2
    return value[:24] + key + value[40:]  # the header's key field (bytes 24-39) rewritten, the tag kept


FORGERIES = ["format 1 header", "guessed tag", "kept tag", "another key's tag", "public key",
             "another block's value, renamed"]


class Medium:
    """Raw read/write of one stored value of a file or Redis tier, as a forger does it."""

    def __init__(self, tier) -> None:
        self.tier = tier
        self.client = redis.Redis.from_url(tier.url) if tier.medium == "remote" else None

    def read(self, key: bytes) -> bytes:
        if self.client is None:  # a file of its own, or a slot of a segment file
            path, at = self.tier._value_at(key)
            return path.read_bytes()[at:at + self.tier.value_bytes]
        return b"".join(self.client.hmget(self.tier._name(key), ["h", "p"]))

    def write(self, key: bytes, value: bytes) -> None:
        if self.client is None:
            path, at = self.tier._value_at(key)
            raw = path.read_bytes()
            segmented = self.tier._segments is not None
            path.write_bytes(raw[:at] + value + raw[at + self.tier.value_bytes:] if segmented else value)
        else:
            fields = {"h": value[:HEADER_BYTES], "p": value[HEADER_BYTES:]}
            self.client.hset(self.tier._name(key), mapping=fields)


@pytest.fixture(params=["file", "redis"])
def shared_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator:
    """A disk or a Redis tier holding blocks 0-2 (``rows(3, seed=6)``), keyed by KEY."""
    ns = NS
    if request.param == "file":
        t = FileTier(tmp_path, ns, capacity_bytes=100 * (HEADER_BYTES + BPB), block_bytes=BPB, auth_key=KEY)
    else:
        t = RedisTier(request.getfixturevalue("redis_single").url, ns, block_bytes=BPB, auth_key=KEY,
                      prefix=f"forged-{request.node.name}")
    assert t.set(keys(3), rows(3, seed=6)) == 3
    yield t
    t.clear()
    t.close()


def value_gone(t: FileTier, key: bytes) -> bool:
    """``key``'s value is off the disk: its file deleted, or its segment slot zeroed (or the segment gone)."""
    if t._segments is None:
        return not t._path(key).exists()
    return key not in t._segments.where and key not in t._index


@pytest.mark.parametrize("how", FORGERIES)
def test_a_forged_value_is_an_unauthenticated_miss_never_served(shared_tier, how: str) -> None:
    medium = Medium(shared_tier)
    medium.write(block_key(1), forged(how, block_key(1), medium.read(block_key(1))))
    out = torch.zeros(3, BPB, dtype=torch.uint8)
    assert shared_tier.get(keys(3), out) == 1 and torch.equal(out[0], rows(3, seed=6)[0])
    s = shared_tier.stats()
    assert (s.unauthenticated, s.misses, s.loaded) == (1, 1, 1)
    if shared_tier.medium == "disk":  # the forged file (or slot) is deleted: the block is plainly missing now
        assert shared_tier.exists(keys(3)) == 1 and value_gone(shared_tier, block_key(1))


def test_an_old_authentic_value_of_the_same_key_is_served(shared_tier) -> None:
    # What a store operator can replay: a value the fleet once stored under this very key. The key is the
    # block's chained hash in this namespace (same tokens, model, config, dtype, layout), so that value is
    # KV the fleet computed for the same prefix. (Here the two payloads differ only to tell them apart.)
    medium = Medium(shared_tier)
    old = medium.read(block_key(0))
    shared_tier.delete(keys(1))
    assert shared_tier.set(keys(1), rows(1, seed=7)) == 1  # block 0 stored again, other bytes
    medium.write(block_key(0), old)
    out = torch.zeros(1, BPB, dtype=torch.uint8)
    assert shared_tier.get(keys(1), out) == 1 and torch.equal(out[0], rows(3, seed=6)[0])


def test_the_mac_is_blake3_keyed_over_the_header_fields_and_the_payload(tmp_path: Path) -> None:
    # The formula of kvpool.tiers.auth, computed here with the blake3 package alone: the key is BLAKE3's
    # derive_key of the secret, the tag keyed BLAKE3 over the first 48 header bytes then the payload.
    import blake3

    secret = b"a fleet secret of 16+ bytes"
    t = FileTier(tmp_path, NS, capacity_bytes=10**6, block_bytes=BPB, auth_key=TierKey(secret))
    t.set(keys(1, base=9), rows(1, seed=8))
    raw = t._path(block_key(9)).read_bytes()
    assert raw[:48] == struct.pack("<4sHH16s16sQ", b"KVPB", 2, 0, NS.digest, block_key(9), BPB)
    mac_key = blake3.blake3(secret, derive_key_context="kvpool 2025-06 tier value MAC key v1").digest(32)
    assert raw[48:64] == blake3.blake3(raw[:48] + raw[64:], key=mac_key).digest(16)
    assert raw[64:] == rows(1, seed=8).numpy().tobytes()


def test_tiers_that_leave_the_process_need_a_key(tmp_path: Path, redis_single) -> None:
    for make in (lambda **k: FileTier(tmp_path / "d", NS, capacity_bytes=10**4, block_bytes=BPB, **k),
                 lambda **k: RedisTier(redis_single.url, NS, block_bytes=BPB, **k)):
        with pytest.raises(ConfigError, match=r"auth_key=TierKey.from_env\(\).*KVPOOL_TIER_KEY"):
            make()
        with pytest.raises(ConfigError, match="at least 16 bytes"):
            make(auth_key="too short")
        make(auth_key="a secret given as text, 16+ bytes").close()
    HostTier(2, NS, like=DEVICE).close()  # memory of this process: no key


def test_the_public_key_is_an_explicit_opt_out(tmp_path: Path, per_file: None) -> None:
    # A tier keyed by TierKey.public() still finds faults, but serves what anyone forges with that key.
    public = FileTier(tmp_path / "p", NS, capacity_bytes=10**5, block_bytes=BPB, auth_key=TierKey.public())
    assert public.set(keys(2), rows(2)) == 2 and not public.auth_key.authenticates and KEY.authenticates
    Medium(public).write(block_key(1), forged("public key", block_key(1), b""))
    out = torch.zeros(2, BPB, dtype=torch.uint8)
    assert public.get(keys(2), out) == 2 and out[1].numpy().tobytes() == EVIL
    keyed = FileTier(tmp_path / "k", NS, capacity_bytes=10**5, block_bytes=BPB, auth_key=KEY)
    assert keyed.set(keys(1), rows(1)) == 1
    os.replace(public._path(block_key(0)), keyed._path(block_key(0)))  # the public tier's file, moved in
    assert keyed.get(keys(1), out) == 0 and keyed.stats().unauthenticated == 1  # not signed by the fleet


def test_tier_keys_from_the_environment() -> None:
    tier, seed = "a tier secret of 16+ bytes", "a hash seed of 16+ bytes"
    both = TierKey.from_env({"KVPOOL_TIER_KEY": tier, "KVPOOL_HASH_SEED": seed})
    from_seed = TierKey.from_env({"KVPOOL_HASH_SEED": seed})
    assert (both.source, from_seed.source) == ("KVPOOL_TIER_KEY", "KVPOOL_HASH_SEED")
    assert both.tag(b"h", b"p") == TierKey(tier).tag(b"h", b"p") != TierKey(seed).tag(b"h", b"p")
    assert from_seed.tag(b"h", b"p") == TierKey(seed).tag(b"h", b"p")
    assert TierKey.from_env({}) is None
    with pytest.raises(ConfigError, match=r"\$KVPOOL_TIER_KEY must be at least 16 bytes") as err:
        TierKey.from_env({"KVPOOL_TIER_KEY": "tooshort", "KVPOOL_HASH_SEED": seed})
    assert "tooshort" not in str(err.value)
    assert repr(both) == "TierKey(source='KVPOOL_TIER_KEY')" and tier not in repr(both)
    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(both)


# ---- faults: Redis --------------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "redis://", "redis://127.0.0.1", "redis://h:x",
                                 "redis://h:99999", "redis://h:1/notadb", "127.0.0.1:6379",
                                 # redis-py reads ?options only at the first connect, where a bad one raised
                                 # out of every call: refused up front (and a DB that is not ASCII digits)
                                 "redis://127.0.0.1:6379/?socket_timeout=abc", "redis://127.0.0.1:6379/0?foo=1",
                                 "redis://127.0.0.1:6379/0#x", "redis://h:1/\u00b2", "redis://h:1/99999999999"])
def test_a_bad_redis_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="Redis URL"):
        RedisTier(url, NS, block_bytes=BPB, auth_key=KEY)


def test_unreachable_at_start_is_a_miss_and_costs_one_connect_per_interval() -> None:
    from redis_servers import free_port

    t = RedisTier(f"redis://127.0.0.1:{free_port()}", NS, block_bytes=BPB, retry_s=60, auth_key=KEY)
    start = time.perf_counter()
    out = torch.zeros(4, BPB, dtype=torch.uint8)
    assert t.set(keys(4), rows(4)) == 0 and t.exists(keys(4)) == 0 and t.get(keys(4), out) == 0
    for _ in range(100):
        t.exists(keys(4))
    assert time.perf_counter() - start < 5  # refused connects are instant; the retry interval holds the rest
    s = t.stats()
    assert s.store_failures == 4 and s.errors == 102 and not t.connected and "Connection" in t.last_error


def test_redis_killed_mid_run_then_back(tmp_path: Path) -> None:
    from redis_servers import redis_server

    with redis_server(tmp_path) as server:
        t = RedisTier(server.url, NS, block_bytes=BPB, retry_s=0.2, auth_key=KEY)
        assert t.set(keys(5), rows(5)) == 5
        server.stop()
        out = torch.zeros(5, BPB, dtype=torch.uint8)
        assert t.get(keys(5), out) == 0 and t.set(keys(2, base=10), rows(2)) == 0
        assert t.stats().errors >= 1 and t.stats().store_failures == 2
        server.start()  # a fresh, empty server on the same port
        time.sleep(0.25)
        assert t.exists(keys(5)) == 0  # its data died with it: a miss, not an error
        assert t.set(keys(3), rows(3, seed=9)) == 3 and t.get(keys(3), out) == 3
        assert torch.equal(out[:3], rows(3, seed=9))


def test_values_tampered_in_redis_are_misses(redis_single) -> None:
    ns = Namespace.for_cache(DEVICE, model="tampered")
    t = RedisTier(redis_single.url, ns, block_bytes=BPB, auth_key=KEY)
    t.set(keys(4), rows(4))
    client = redis.Redis.from_url(redis_single.url)
    name = lambda k: t._name(block_key(k))  # noqa: E731  (a hash: h = the header, p = the payload)
    payload = client.hget(name(1), "p")
    client.hset(name(1), "p", payload[:-1])  # truncated
    out = torch.zeros(4, BPB, dtype=torch.uint8)
    assert t.get(keys(4), out) == 1 and t.stats().corrupt == 1
    client.hset(name(1), "p", payload[:7] + bytes([payload[7] ^ 1]) + payload[8:])  # one bit flipped
    assert t.get(keys(4), out) == 1 and t.stats().unauthenticated == 1  # its MAC fails
    client.hset(name(1), "p", payload)
    client.hset(name(2), mapping=client.hgetall(name(3)))  # block 3's value under block 2's key
    assert t.get(keys(4), out) == 2 and t.stats().foreign == 1
    other = RedisTier(redis_single.url, OTHER, block_bytes=BPB, auth_key=KEY)
    other.set(keys(1, base=2), rows(1, seed=5))
    client.hset(name(2), mapping=client.hgetall(other._name(block_key(2))))  # another namespace's value
    assert t.get(keys(4), out) == 2 and t.stats().foreign == 2
    client.hdel(name(2), "h")  # the header gone
    assert t.get(keys(4), out) == 2 and t.stats().corrupt == 2
    client.delete(name(2))
    client.set(name(2), b"not a value")  # a string where a block's hash belongs
    assert t.get(keys(4), out) == 2 and t.stats().corrupt == 3 and t.stats().errors == 0


def test_keys_evicted_by_redis_maxmemory_are_missing(tmp_path: Path) -> None:
    from redis_servers import redis_server

    big = 64 * 1024
    ns = Namespace("m", "uint8", "flat", hash_scheme="test")
    with redis_server(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru") as server:
        t = RedisTier(server.url, ns, block_bytes=big, auth_key=KEY)
        gen = torch.Generator().manual_seed(1)
        data = torch.randint(0, 256, (200, big), generator=gen, dtype=torch.uint8)
        for i in range(200):  # 12.5 MiB through a 2 MiB server, one block at a time
            t.set(keys(1, base=i), data[i:i + 1])
        present = [i for i in range(200) if t.exists(keys(1, base=i))]
        assert 0 < len(present) < 100 and 199 in present  # the oldest went; the newest stays
        out = torch.zeros(1, big, dtype=torch.uint8)
        assert t.get(keys(1, base=0), out) == 0 and t.stats().missing == 1
        assert t.get(keys(1, base=199), out) == 1 and torch.equal(out[0], data[199])


def test_redis_cluster_spreads_blocks_over_its_nodes(redis_cluster_nodes) -> None:
    ns = Namespace.for_cache(DEVICE, model="spread")
    t = RedisTier(redis_cluster_nodes[0].url, ns, block_bytes=BPB, auth_key=KEY)
    assert t.set(keys(60), rows(60)) == 60 and t.cluster is True
    counts = [int(n.cli("dbsize").strip()) for n in redis_cluster_nodes]
    assert all(c > 0 for c in counts)  # 60 keys over 16384 slots split three ways
    via_other_node = RedisTier(redis_cluster_nodes[2].url, ns, block_bytes=BPB, auth_key=KEY)
    out = torch.zeros(60, BPB, dtype=torch.uint8)
    assert via_other_node.get(keys(60), out) == 60 and torch.equal(out, rows(60))


def test_redis_replies_read_by_redis_py_alone_give_the_same_results(redis_single, monkeypatch) -> None:
    """Where redis-py has no SocketBuffer (another layout), its own parser reads the integer replies too."""
    import kvpool.tiers._resp as resp

    monkeypatch.setattr(resp, "SocketBuffer", None)
    t = RedisTier(redis_single.url, Namespace.for_cache(DEVICE, model="parser-only"), block_bytes=BPB,
                  auth_key=KEY)
    t.clear()
    out = torch.zeros(3, BPB, dtype=torch.uint8)
    assert t.set(keys(3), rows(3, seed=4)) == 3 and t.exists(keys(5)) == 3
    assert t.get(keys(3), out) == 3 and torch.equal(out, rows(3, seed=4))
    assert t.delete(keys(2)) == 2 and t.exists(keys(3)) == 0  # a prefix: the first key is gone
    assert t.stats().errors == 0
