"""S3-FIFO and SIEVE give libCacheSim's exact hits and misses (issue 33): the authors' simulator
(``libcachesim`` 0.3.5, its C ``S3FIFO.c`` and ``Sieve.c`` with their defaults: small queue 10%, ghost 90%,
promotion after 2 hits, a 2-bit clock in the main queue) against a kvpool ``BlockPool`` driven as a cache on
the same key sequence: each access looks its key up; a hit touches and frees the block, a miss allocates one
block (evicting when the pool is full), publishes the key on it and frees it. Three seeded sequences mix a
skewed popularity with scans of one-off keys, at two pool sizes; skipped where libcachesim is not installed
(it is in the ``dev`` extra)."""

from __future__ import annotations

import random

import pytest

from kvpool.allocators.block_pool import BlockPool
from kvpool.allocators.queue_policies import S3FIFOPolicy, SievePolicy

lc = pytest.importorskip("libcachesim", reason="libcachesim (the dev extra) is the reference")

REFERENCES = {"s3fifo": (lambda size: lc.S3FIFO(size), S3FIFOPolicy), "sieve": (lambda size: lc.Sieve(size),
                                                                             SievePolicy)}


def key_sequence(seed: int, n: int = 20_000, keys: int = 2_000) -> list[int]:
    """Skewed reuse (key ``int(keys * u**3)``: a few hot keys, a long tail) with scans: runs of 20 to 200
    keys never seen again (a run starts at 0.2% of the accesses: about a sixth of them)."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        if rng.random() < 0.002:
            start = 10**9 + len(out)
            out += range(start, start + rng.randrange(20, 200))
        else:
            out.append(int(keys * rng.random() ** 3))
    return out[:n]


def reference_hits(make, size: int, keys: list[int]) -> list[bool]:
    cache, req = make(size), lc.Request()
    req.obj_size = 1
    hits = []
    for key in keys:
        req.obj_id = key
        hits.append(bool(cache.get(req)))
    return hits


def pool_hits(policy, size: int, keys: list[int]) -> list[bool]:
    pool = BlockPool(size, policy=policy)
    hits = access(pool, keys)
    pool.check_integrity()
    return hits


def access(pool: BlockPool, keys: list[int]) -> list[bool]:
    """Each key as a one-block prefix: a hit is touched and freed, a miss allocated, published and freed."""
    hits = []
    for key in keys:
        hit = pool.lookup([key])
        if hit:
            pool.touch(hit)
            pool.free(hit)
        else:
            block = pool.allocate(1)
            pool.cache_blocks(block, [key])
            pool.free(block)
        hits.append(bool(hit))
    return hits


@pytest.mark.parametrize("size", [100, 600])
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name", list(REFERENCES))
def test_same_hits_and_misses_as_libcachesim(name: str, seed: int, size: int) -> None:
    make, policy = REFERENCES[name]
    keys = key_sequence(seed)
    theirs, ours = reference_hits(make, size, keys), pool_hits(policy(), size, keys)
    assert sum(theirs) > 3_000, "the sequence must hit often enough to exercise promotion and the clock"
    first = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=True)) if a != b), None)
    assert first is None, f"{name}: first different access at {first}: libCacheSim hit {theirs[first]}"


def test_s3fifo_evicts_a_scan_before_the_reused_keys() -> None:
    # hand count: a pool of 20 blocks (small queue 2, main 18); keys 0-9 hit twice each in the small queue
    # move to the main queue; a scan of 100 one-off keys then passes through the small queue alone
    pool = BlockPool(20, policy="s3fifo")
    access(pool, [k for k in range(10) for _ in range(3)] + list(range(100, 200)))
    assert all(pool.get_cached_block(k) is not None for k in range(10))
