"""The offload manager against a brute-force model of the tier chain (what must hit where, and what each
tier holds, in LRU order, after every request), bit-exact KV through every tier, and the faults of the
issue with real servers (a Redis killed mid-run or never there, damaged files): every one a miss, the KV
always right, the pools whole at the end.

The model is plain OrderedDicts following the rules the manager documents: a request looks its chain up
block by block (device first, then the tiers in order); device hits are touched, blocks below are loaded
into new device blocks; in eviction mode the device's evictions go to the host tier, the host's to the
disk, the disk's to the remote tier; with write-through each published block goes to every tier; a batch
store refreshes the keys held first, then inserts the new ones in order (a host batch larger than the room
sends its first blocks on down)."""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpool.allocators.block_pool import BlockPool
from kvpool.allocators.policies import FrequencyAdmission
from kvpool.errors import InvalidArgumentError, OutOfBlocksError
from kvpool.spec import KVCacheSpec
from kvpool.storage.paged import PagedKVCache
from kvpool.tiers.auth import TierKey
from kvpool.tiers.backend import HEADER_BYTES, Namespace, block_key
from kvpool.tiers.file import FileTier
from kvpool.tiers.host import HostTier
from kvpool.tiers.manager import OffloadManager

redis = pytest.importorskip("redis")

#: These tests drive the manager through its single-group API (deprecated, still working: see the last test).
pytestmark = pytest.mark.filterwarnings("ignore:OffloadManager.* single-group tier API:DeprecationWarning")
from kvpool.tiers.redis import RedisTier  # noqa: E402

# ---- the model ---------------------------------------------------------------------------------------

class ChainModel:
    """Device pool of ``device`` blocks; tiers by name with a capacity in blocks (None: unbounded)."""

    def __init__(self, device: int, tiers: list[tuple[str, int | None]], write_through: bool,
                 min_count: int = 1) -> None:
        self.min_count = min_count  # frequency admission: a hash enters the tiers at its min_count-th offer
        self.offers: dict[int, int] = {}
        self.refused = 0
        self.free = device  # uncached free device blocks
        self.dev: OrderedDict[int, None] = OrderedDict()  # cached free device blocks, LRU order
        self.in_use: set[int] = set()  # hashes published on in-use device blocks
        self.tiers = [(name, cap, OrderedDict()) for name, cap in tiers]
        self.wt = write_through
        self.held: set[int] = set()  # host keys held during a load

    def where(self, h: int) -> int | None:
        if h in self.dev or h in self.in_use:
            return 0
        for t, (_, _, lru) in enumerate(self.tiers):
            if h in lru:
                return t + 1
        return None

    def request(self, hashes: list[int], extra: int) -> list[int]:
        """Run one request (its chain plus ``extra`` unhashed blocks) start to end; return where each
        block of its found prefix came from."""
        found = []
        for h in hashes:
            w = self.where(h)
            if w is None:
                break
            found.append(w)
        prefix = hashes[:len(found)]
        below = [h for h, w in zip(prefix, found, strict=True) if w]
        for h, w in zip(prefix, found, strict=True):
            if w == 0 and h in self.dev:
                del self.dev[h]
                self.in_use.add(h)
        for t, (name, _, lru) in enumerate(self.tiers):  # refresh / hold what is about to be loaded
            mine = [h for h, w in zip(prefix, found, strict=True) if w == t + 1]
            if name == "host":
                self.held = set(mine)
            elif name == "disk":
                for h in mine:
                    lru.move_to_end(h)
        self.allocate(len(below))
        for t, (name, _, lru) in enumerate(self.tiers):  # the loads' refreshes
            mine = [h for h, w in zip(prefix, found, strict=True) if w == t + 1]
            if name == "host":
                for h in reversed(mine):
                    lru.move_to_end(h)
                self.held = set()
            elif name == "disk":
                for h in mine:
                    lru.move_to_end(h)
        self.in_use |= set(below)
        new = hashes[len(found):]
        self.allocate(len(new) + extra)
        published = [h for h in new if self.where(h) != 0]
        self.in_use |= set(published)
        if self.wt:
            self.store_all(self.admitted(published))
        mine = list(prefix) + [h for h in new if h in published]
        for h in reversed(hashes):  # free tail first: hashed blocks join the LRU
            if h in self.in_use and h in mine:
                self.in_use.discard(h)
                self.dev[h] = None
        self.free += (len(new) - len(published)) + extra
        return found

    def allocate(self, n: int) -> None:
        take = min(n, self.free)
        self.free -= take
        evicted = [self.dev.popitem(last=False)[0] for _ in range(n - take)]
        if evicted and not self.wt and self.tiers:
            self.store(0, self.admitted(evicted))

    def admitted(self, batch: list[int]) -> list[int]:
        """Count one offer of each hash; keep those offered min_count times (their count starts over)."""
        keep = []
        for h in batch:
            self.offers[h] = self.offers.get(h, 0) + 1
            if self.offers[h] >= self.min_count:
                del self.offers[h]
                keep.append(h)
        self.refused += len(batch) - len(keep)
        return keep

    def store(self, t: int, batch: list[int]) -> None:
        """Eviction mode: ``batch`` arrives at tier ``t`` (cascading what it evicts to ``t + 1``)."""
        if t >= len(self.tiers):
            return
        name, cap, lru = self.tiers[t]
        for h in batch:
            if h in lru:
                lru.move_to_end(h)
        new = list(dict.fromkeys(h for h in batch if h not in lru))
        if name == "host":
            room = cap - len(self.held)
            left_out, new = new[:max(0, len(new) - room)], new[max(0, len(new) - room):]
            over = len(lru) + len(new) - cap
            victims = [h for h in lru if h not in self.held][:max(0, over)]
            for h in victims:
                del lru[h]
            for h in new:
                lru[h] = None
            self.store(t + 1, victims + left_out)
        else:
            for h in new:
                if cap is not None and len(lru) == cap:
                    self.store(t + 1, [lru.popitem(last=False)[0]])
                lru[h] = None

    def store_all(self, batch: list[int]) -> None:
        """Write-through: ``batch`` into every tier; what a tier evicts is dropped."""
        for name, cap, lru in self.tiers:
            for h in batch:
                if h in lru:
                    lru.move_to_end(h)
            new = [h for h in batch if h not in lru]
            if name == "host":
                new = new[max(0, len(new) - cap):]
            for h in new:
                if cap is not None and len(lru) == cap:
                    lru.popitem(last=False)
                lru[h] = None


# ---- building the real chain ------------------------------------------------------------------------

NS = Namespace("model-test", "none", "hash-only", hash_scheme="trace")
KEY = TierKey("kvpool tests: a tier key of 16+ bytes")  # the fleet secret of these tests


def build(kinds: list[tuple[str, int | None]], tmp_path: Path, redis_url: str | None, *, device: int,
          write_through: bool, asynchronous: bool = False, cache: PagedKVCache | None = None,
          ns: Namespace = NS, admission: FrequencyAdmission | None = None) -> OffloadManager:
    bpb = cache.bytes_per_block if cache is not None else 0
    tiers = []
    for name, cap in kinds:
        if name == "host":
            tiers.append(HostTier(cap, ns, like=cache))
        elif name == "disk":
            tiers.append(FileTier(tmp_path / "disk", ns, capacity_bytes=cap * (HEADER_BYTES + bpb),
                                  block_bytes=bpb, auth_key=KEY))
        else:
            tiers.append(RedisTier(redis_url, ns, block_bytes=bpb, auth_key=KEY))
    return OffloadManager(BlockPool(device), tiers, cache=cache, write_through=write_through,
                          asynchronous=asynchronous, staging_blocks=8, admission=admission)


def run_request(m: OffloadManager, hashes: list[int], extra: int, fill=None) -> tuple[list[int], list[int]]:
    """What a consumer does: look up, acquire, allocate the rest, publish, free tail first. ``fill(ids,
    hashes)`` writes the new blocks' KV (data mode). Returns (where, device ids of the prefix)."""
    hit = m.lookup(hashes)
    got = m.acquire(hit)
    fresh = m.pool.allocate(len(hashes) - len(got) + extra)
    new_ids, new_hashes = fresh[:len(hashes) - len(got)], hashes[len(got):]
    if fill is not None:
        fill(new_ids, new_hashes)
    m.pool.cache_blocks(new_ids, new_hashes)  # with write-through the manager stores what the pool publishes
    m.pool.free((got + fresh)[::-1])
    return hit.where[:len(got)], got


def workload(seed: int, n: int, longest: int = 5) -> Iterator[tuple[list[int], int]]:
    """Conversations that grow turn by turn (shared prefixes) up to ``longest`` blocks, then start over as a
    new conversation; some revisited after long gaps. Plus 0-1 unhashed (decode) blocks each."""
    rng = random.Random(seed)
    turns: dict[int, int] = {}
    ids = list(range(8))
    for _ in range(n):
        slot = rng.randrange(8)
        turns[ids[slot]] = turns.get(ids[slot], 0) + rng.randint(1, 2)
        if turns[ids[slot]] > longest:
            ids[slot] += 8
            turns[ids[slot]] = 1
        conv = ids[slot]
        yield [conv * 1000 + i for i in range(turns[conv])], rng.randint(0, 1)


def tier_contents(m: OffloadManager) -> list[list[int]]:
    out = []
    for tier in m.tiers:
        if isinstance(tier, HostTier):
            out.append([tier.pool.block_hash(b) for b in tier.pool.evictable_blocks()])
        elif isinstance(tier, FileTier):
            out.append([int.from_bytes(k, "big", signed=True) for k in tier._index])
        else:
            out.append(None)  # the server's set is checked by membership
    return out


DEVICE_BLOCKS = 6
def remote_keys(tier: RedisTier, candidates: set[int]) -> set[int]:
    """Which of ``candidates`` the Redis server holds under the tier's namespace (one pipeline)."""
    order = sorted(candidates)
    pipe = redis.Redis.from_url(tier.url).pipeline()
    for h in order:
        pipe.exists(tier._name(block_key(h)))
    return {h for h, there in zip(order, pipe.execute(), strict=True) if there}


CHAINS = [
    [("host", 10)],
    [("disk", 11)],
    [("remote", None)],
    [("host", 8), ("disk", 12)],
    [("host", 8), ("remote", None)],
    [("host", 7), ("disk", 9), ("remote", None)],
]


#: Chains with frequency admission (kinds, write-through, min_count).
ADMITTED_CHAINS = [([("host", 8), ("disk", 12)], False, 2), ([("host", 7), ("remote", None)], True, 2),
                   ([("disk", 11)], False, 3)]


def chain_case(kinds, write_through: bool, min_count: int = 1):
    return pytest.param(kinds, write_through, min_count,
                        id="+".join(n for n, _ in kinds) + ("-write-through" if write_through else "-evict")
                        + (f"-admit{min_count}" if min_count > 1 else ""))


@pytest.mark.parametrize(("kinds", "write_through", "min_count"),
                         [chain_case(k, wt) for k in CHAINS for wt in (False, True)]
                         + [chain_case(*case) for case in ADMITTED_CHAINS])
def test_chain_matches_the_brute_force_model(kinds, write_through: bool, min_count: int, tmp_path: Path,
                                             request) -> None:
    redis_url = request.getfixturevalue("redis_single").url if any(n == "remote" for n, _ in kinds) else None
    ns = Namespace("model-test", "none", "hash-only", hash_scheme=f"{request.node.name}")
    admission = FrequencyAdmission(min_count, max_tracked=1 << 20) if min_count > 1 else None  # no halving
    m = build(kinds, tmp_path, redis_url, device=DEVICE_BLOCKS, write_through=write_through, ns=ns,
              admission=admission)
    model = ChainModel(DEVICE_BLOCKS, kinds, write_through, min_count)
    hits_by_tier = [0] * (len(kinds) + 1)
    seen: set[int] = set()
    for i, (hashes, extra) in enumerate(workload(seed=len(kinds) * 2 + write_through, n=300)):
        want = model.request(hashes, extra)
        got, _ = run_request(m, hashes, extra)
        assert got == want, f"request {i}: {hashes}"
        for w in got:
            hits_by_tier[w] += 1
        for (name, _, lru), held in zip(model.tiers, tier_contents(m), strict=True):
            if held is not None:
                assert held == list(lru), f"request {i}: the {name} tier's LRU"
            else:
                seen.update(hashes)
                assert remote_keys(m.tiers[-1], seen) == set(lru), f"request {i}: the remote tier's keys"
        assert [m.pool.block_hash(b) for b in m.pool.evictable_blocks()] == list(model.dev)
    assert all(hits_by_tier), f"every place served hits: {hits_by_tier}"  # the workload reaches each tier
    if min_count > 1:  # the filter kept blocks out: the offers it refused, as the model counted them
        assert m.stats()["not_admitted"] == model.refused > 0
    m.check_integrity()
    assert m.pool.num_used_blocks == 0
    m.close()


def test_an_unbounded_lower_tier_loses_nothing(tmp_path: Path) -> None:
    """Whatever the device size, device + unbounded host hits every block an unbounded device would."""
    requests = [r for r in workload(seed=7, n=200) if len(r[0]) + r[1] <= 8]
    oracle = build([], tmp_path, None, device=10_000, write_through=False)
    want = [len(run_request(oracle, h, e)[0]) for h, e in requests]
    for device in (8, 12, 30):
        m = build([("host", 10_000)], tmp_path, None, device=device, write_through=False)
        assert [len(run_request(m, h, e)[0]) for h, e in requests] == want
        m.close()


# ---- bit-exact KV through every tier -------------------------------------------------------------------

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=4)


def kv_of(h: int, cache: PagedKVCache) -> torch.Tensor:
    """The block content a hash stands for: random bits (NaN payloads included) seeded by the hash."""
    shape = cache.buffer[:, :, 0].shape
    gen = torch.Generator().manual_seed(h)
    return torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int32).to(torch.int16)


def data_run(m: OffloadManager, cache: PagedKVCache, n: int, seed: int) -> list[int]:
    """Requests that write kv_of(hash) into new blocks and check every acquired block holds exactly its
    hash's KV; returns the hits per place."""

    def fill(ids: list[int], hashes: list[int]) -> None:
        for b, h in zip(ids, hashes, strict=True):
            cache.buffer[:, :, b].view(torch.int16).copy_(kv_of(h, cache))

    hits = [0] * (len(m.tiers) + 1)
    for hashes, extra in workload(seed=seed, n=n):
        if len(hashes) + extra > cache.num_blocks:
            continue
        where, got = run_request(m, hashes, extra, fill)
        for b, h, w in zip(got, hashes[:len(got)], where, strict=True):
            assert torch.equal(cache.buffer[:, :, b].view(torch.int16), kv_of(h, cache)), (h, w)
            hits[w] += 1
    return hits


@pytest.mark.parametrize("asynchronous", [False, True], ids=["inline", "worker"])
@pytest.mark.parametrize("write_through", [False, True], ids=["evict", "write-through"])
def test_kv_round_trips_bit_exact_through_every_tier(asynchronous: bool, write_through: bool, tmp_path: Path,
                                                      redis_single, request) -> None:
    cache = PagedKVCache(SPEC, DEVICE_BLOCKS, layout="HND")
    ns = Namespace.for_cache(cache, model=request.node.name)
    m = build(CHAINS[-1], tmp_path, redis_single.url, device=DEVICE_BLOCKS,
              write_through=write_through, asynchronous=asynchronous, cache=cache, ns=ns)
    hits = data_run(m, cache, 150, seed=3)  # checks every acquired block's bits
    m.synchronize()
    assert all(hits), f"hits per place (device, host, disk, remote): {hits}"
    # inline, a block found is always loaded; with the worker, its own disk evictions may move a block
    # down between the lookup and the load in a disk this small (9 blocks, 8 staged): a counted miss there,
    # then found below or a failed load
    assert m.load_failures == 0 if not asynchronous else m.load_failures <= m.stats()["disk"]["missing"]
    assert m.pool.num_used_blocks == 0
    m.check_integrity()
    m.close()


def test_tier_admission_tracks_four_times_the_chain(tmp_path: Path, redis_single) -> None:
    # 4 x (device 10 + host 20 + disk 30 values; Redis bounds nothing) = 240; the device alone gave 40,
    # fewer hashes than a trace evicts between two offers of one block
    m = build([("host", 20), ("disk", 30), ("redis", None)], tmp_path, redis_single.url, device=10,
              write_through=False, admission=FrequencyAdmission(2))
    assert m.admission.max_tracked == 4 * (10 + 20 + 30) == 240
    assert [t.capacity_blocks for t in m.tiers] == [20, 30, None]
    given = build([("host", 20)], tmp_path / "b", None, device=10, write_through=False,
                  admission=FrequencyAdmission(2, max_tracked=7))
    assert given.admission.max_tracked == 7  # a bound given is kept
    m.close()
    given.close()


def test_bad_chains_are_refused(tmp_path: Path) -> None:
    cache = PagedKVCache(SPEC, 4)
    ns = Namespace.for_cache(cache, model="x")
    disk = FileTier(tmp_path, ns, capacity_bytes=10**6, block_bytes=cache.bytes_per_block, auth_key=KEY)
    with pytest.raises(InvalidArgumentError, match="host tier must come first"):
        OffloadManager(BlockPool(4), [disk, HostTier(2, ns, like=cache)], cache=cache)
    with pytest.raises(InvalidArgumentError, match="B blocks"):
        OffloadManager(BlockPool(4), [HostTier(2, ns)], cache=cache)  # hash-only tier, data manager
    with pytest.raises(InvalidArgumentError, match="FrequencyAdmission"):
        OffloadManager(BlockPool(4), [], cache=cache, admission=2)
    shared = FrequencyAdmission(2)
    with pytest.raises(InvalidArgumentError, match="not the pool's"):  # one filter would count two streams
        OffloadManager(BlockPool(4, admission=shared), [], cache=cache, admission=shared)
    pool = BlockPool(4)
    OffloadManager(pool, [], cache=cache)
    with pytest.raises(InvalidArgumentError, match="listener"):
        OffloadManager(pool, [], cache=cache)  # one manager per pool


def test_acquire_without_room_changes_nothing(tmp_path: Path) -> None:
    m = build([("host", 8)], tmp_path, None, device=4, write_through=True)
    run_request(m, [1, 2, 3, 4], 0)
    m.pool.allocate(4)  # everything evicted and taken: nothing is free
    hit = m.lookup([1, 2, 3])
    assert hit.where == [1, 1, 1]
    with pytest.raises(OutOfBlocksError):
        m.acquire(hit)
    assert m.pool.num_free_blocks == 0 and m.tiers[0].pool.num_used_blocks == 0


def test_a_stale_device_hit_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    # The hit names device blocks 0 (hash 1) and 1 (hash 2). Another request then takes block 1 (evicted
    # first: freed first, tail first). Acquiring the old hit touched block 1 anyway: the request would have
    # run on the other request's KV for its second block.
    m = build([("host", 8)], tmp_path, None, device=10, write_through=False)
    run_request(m, [1, 2], 0)
    hit = m.lookup([1, 2])
    assert (hit.where, hit.device_ids) == ([0, 0], [0, 1])
    other = m.pool.allocate(9)  # the 8 uncached blocks, then block 1 (hash 2 goes to the host)
    m.pool.free(other[:3])
    assert 1 in other and m.pool.block_hash(1) is None

    def state() -> tuple:
        pool = m.pool
        return [pool.ref_count(b) for b in range(10)], pool.num_free_blocks, m.tiers[0].pool.num_used_blocks

    before = state()
    with pytest.raises(InvalidArgumentError, match="stale"):
        m.acquire(hit)
    assert state() == before
    fresh = m.lookup([1, 2])  # looked up again: block 0 on the device, hash 2 on the host
    assert fresh.where == [0, 1] and m.acquire(fresh)[0] == 0
    m.check_integrity()


# ---- faults through the manager -------------------------------------------------------------------------

def test_redis_killed_mid_run_is_a_miss_and_the_kv_stays_right(tmp_path: Path) -> None:
    from redis_servers import redis_server

    cache = PagedKVCache(SPEC, 10)
    with redis_server(tmp_path / "r") as server:
        ns = Namespace.for_cache(cache, model="killed")
        m = build([("host", 2), ("remote", None)], tmp_path, server.url, device=10, write_through=False,
                  cache=cache, ns=ns)
        m.tiers[-1]._retry = 0.05
        before = data_run(m, cache, 60, seed=4)
        assert before[2] > 0  # the remote tier served hits while it lived
        server.stop()
        data_run(m, cache, 60, seed=5)  # every block is checked inside
        s = m.stats()["remote"]
        assert s["store_failures"] > 0 or s["errors"] > 0
        assert m.pool.num_used_blocks == 0 and m.tiers[0].pool.num_used_blocks == 0
        m.check_integrity()
        m.close()


def test_unreachable_redis_at_start_only_loses_its_hits(tmp_path: Path) -> None:
    from redis_servers import free_port

    cache = PagedKVCache(SPEC, 10)
    ns = Namespace.for_cache(cache, model="never-there")
    m = build([("host", 2), ("remote", None)], tmp_path, f"redis://127.0.0.1:{free_port()}", device=10,
              write_through=False, cache=cache, ns=ns)
    hits = data_run(m, cache, 80, seed=6)
    assert hits[2] == 0 and hits[1] > 0 and m.stats()["remote"]["store_failures"] > 0
    m.check_integrity()


def test_damaged_disk_blocks_end_the_prefix_and_are_counted(tmp_path: Path) -> None:
    cache = PagedKVCache(SPEC, 10)
    ns = Namespace.for_cache(cache, model="damaged")
    m = build([("disk", 40)], tmp_path, None, device=10, write_through=True, cache=cache, ns=ns)
    fill = lambda ids, hs: [cache.buffer[:, :, b].view(torch.int16).copy_(kv_of(h, cache))  # noqa: E731
                            for b, h in zip(ids, hs, strict=True)]
    run_request(m, [1, 2, 3, 4, 5, 6], 0, fill)
    m.pool.allocate(10)  # push everything off the device
    m.pool.free(list(range(10)))
    disk = m.tiers[0]
    path, at = disk._value_at(block_key(4))  # its own file, or its slot in a segment file
    raw = bytearray(path.read_bytes())
    raw[at + disk.value_bytes - 1] ^= 0xFF  # the payload's last byte
    path.write_bytes(bytes(raw))
    hit = m.lookup([1, 2, 3, 4, 5, 6])
    assert hit.where == [1] * 6  # the index still lists it: the damage shows when it is read
    got = m.acquire(hit)
    assert len(got) == 3 and m.load_failures == 1 and disk.stats().unauthenticated == 1  # its MAC fails
    for b, h in zip(got, [1, 2, 3], strict=True):
        assert torch.equal(cache.buffer[:, :, b].view(torch.int16), kv_of(h, cache))
    m.pool.free(got[::-1])
    assert m.pool.num_used_blocks == 0
    m.check_integrity()


def test_a_stalling_redis_under_the_worker_is_only_misses(tmp_path: Path, redis_stalling, request) -> None:
    # The review's failure at the manager: the writer thread stores into Redis while the engine thread looks
    # up and loads from it; a stall made one thread's timeout close the shared client under the other, and
    # the ValueError escaped: from a lookup on the engine thread, or as a counted writer error. Now every
    # request completes with bit-exact KV (data_run checks each acquired block), and nothing raised.
    from redis_servers import Stall

    cache = PagedKVCache(SPEC, DEVICE_BLOCKS, layout="HND")
    ns = Namespace.for_cache(cache, model=request.node.name)
    remote = RedisTier(redis_stalling.url, ns, block_bytes=cache.bytes_per_block, auth_key=KEY,
                       timeout_s=0.1, retry_s=0.0)
    m = OffloadManager(BlockPool(DEVICE_BLOCKS), [HostTier(3, ns, like=cache), remote], cache=cache,
                       write_through=True, asynchronous=True, staging_blocks=8)
    done = threading.Event()

    def stalls() -> None:
        while not done.is_set():
            with Stall(redis_stalling.url, 0.2):
                pass
            time.sleep(0.05)

    staller = threading.Thread(target=stalls, name="stalls")
    staller.start()
    try:
        data_run(m, cache, 60, seed=7)
    finally:
        done.set()
        staller.join(timeout=10)
    m.synchronize()
    s = m.stats()["remote"]
    assert s["errors"] + s["store_failures"] > 0  # the stalls were met, as misses
    assert m.stats()["writer_errors"] == 0 and m.pool.num_used_blocks == 0
    m.check_integrity()
    m.close()


def test_the_single_group_api_warns_and_still_works(tmp_path: Path) -> None:
    """lookup, num_blocks_to_allocate and acquire are no part of kvpool's request path (issue 31): each
    warns, naming the path to use, at the caller's line, and still gives what it gave."""
    m = build([("host", 8)], tmp_path, None, device=4, write_through=True)
    with pytest.warns(DeprecationWarning, match="KVCacheManager.attach_tiers") as caught:
        run_request(m, [1, 2, 3], 0)  # published, then evicted into the host tier by the next request
        run_request(m, [4, 5, 6, 7], 0)
        hit = m.lookup([1, 2, 3])
        assert hit.where == [1, 1, 1]  # all three in tier 0, the host
        assert m.num_blocks_to_allocate(hit, 3) == 3
        assert len(m.acquire(hit)) == 3
    assert {w.filename for w in caught} == {__file__}
