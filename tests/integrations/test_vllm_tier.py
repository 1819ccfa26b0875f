"""Conformance of kvpool's tiers as a vLLM secondary tier (``KvpoolTier`` below the CPU primary of
``TieringOffloadingManager``; vLLM 0.33.0 and 0.34.0), run by tests/integrations/run.sh in each vLLM venv;
skipped without vLLM.

Every chunk a request loads is compared byte for byte with what was stored under its key (tier_harness.py),
so a wrong hit fails the test wherever it happens."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: tests/integrations/run.sh runs this file "
                    "in the peer venv (benchmarks/peers/setup.sh)")

import tier_harness as t  # noqa: E402
from redis_servers import redis_server  # noqa: E402
from vllm_harness import trace_keys  # noqa: E402

from kvpool.errors import ConfigError  # noqa: E402
from kvpool.integrations import vllm as kv  # noqa: E402
from kvpool.integrations.keys import offload_tier_key  # noqa: E402
from kvpool.tiers.backend import HEADER_BYTES  # noqa: E402

REQUESTS = 200
PRIMARY = 64  # chunks in the CPU primary: far fewer than the slice's blocks, so most are evicted there
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def requests() -> list[list[bytes]]:
    return trace_keys(REQUESTS)


def disk(path: Path) -> dict:
    return {"tier": "disk", "directory": str(path), "capacity_bytes": 1 << 30, "model": "conformance"}


def run(manager, region, requests, start: int = 0) -> t.Driver:
    driver = t.Driver(manager, region)
    for i, hashes in enumerate(requests):
        driver.request(f"r{start + i}", hashes)
    driver.settle()
    return driver


def restart(config: dict, hashes: list[bytes], folder: Path) -> dict:
    """Ask a fresh process for ``hashes`` through a new manager on the same tier."""
    listing = folder / "hashes.txt"
    listing.write_text("\n".join(h.hex() for h in hashes))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent.parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", "import tier_harness; tier_harness.restart_main()",
                           json.dumps(config), str(listing)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def primary_evicted(manager, stored: set) -> list[bytes]:
    return sorted(k for k in stored if manager.primary_tier._policy.get(k) is None)


def test_disk_tier_cascades_promotes_and_survives_a_restart(requests, tmp_path: Path) -> None:
    manager, region = t.build(PRIMARY, disk(tmp_path))
    driver = run(manager, region, requests)
    tier = manager.secondary_tiers[0].tier
    stored = driver.tally.stored
    assert len(stored) > 5 * PRIMARY
    # every store cascaded: each stored block is in the kvpool tier
    assert sum(tier.exists([offload_tier_key(k)]) for k in stored) == len(stored)
    # blocks evicted from the primary come back from the tier, bit-exact
    gone = primary_evicted(manager, stored)
    assert len(gone) > len(stored) // 2
    sample = gone[:100]
    before = driver.tally.promoted
    hits = sum(driver.request(f"back{i}", [k[:-4]], store=False) for i, k in enumerate(sample))
    assert hits == len(sample) and driver.tally.promoted - before == len(sample)
    print(f"\ndisk: {len(stored)} blocks stored and cascaded, {driver.tally.promoted} promoted from the "
          f"tier, {driver.tally.checked} loads checked bit-exact; {len(sample)}/{len(sample)} "
          "primary-evicted blocks hit")
    manager.shutdown()
    again = restart(disk(tmp_path), [k[:-4] for k in sorted(stored)[:200]], tmp_path)
    assert again == {"asked": 200, "found": 200, "checked": 200}
    print(f"restarted process: {again['found']}/{again['asked']} blocks found on disk, bit-exact")


def test_disk_faults_are_misses_never_wrong_hits(requests, tmp_path: Path) -> None:
    manager, region = t.build(PRIMARY, disk(tmp_path))
    driver = run(manager, region, requests[:100])
    tier = manager.secondary_tiers[0].tier
    rng = random.Random(22)
    stored = sorted(driver.tally.stored)
    flipped = rng.sample(stored, len(stored) // 20)  # 5% of the blocks on disk: one payload byte flipped
    for key in flipped:  # in its own file or its slot of a segment file, wherever the tier put it
        path, at = tier._value_at(offload_tier_key(key))
        data = bytearray(path.read_bytes())
        data[at + HEADER_BYTES + 100] ^= 0xFF
        path.write_bytes(bytes(data))
    get, injected = tier.get, []

    def flaky_get(keys, out):  # 5% of the tier's loads fail as an I/O error would: nothing loaded
        if rng.random() < 0.05:
            injected.append(len(keys))
            return 0
        return get(keys, out)

    tier.get = flaky_get
    for i, k in enumerate(primary_evicted(manager, driver.tally.stored)):
        driver.request(f"back{i}", [k[:-4]], store=False)
    driver.settle()
    tally, stats = driver.tally, tier.stats()
    caught = stats.corrupt + stats.unauthenticated  # a flipped payload byte fails the value's MAC
    print(f"\ndisk faults: {len(flipped)} values flipped, {caught} damaged loads caught, "
          f"{len(injected)} loads failed by injection (retried by vLLM), "
          f"{tally.failed_promotions} promotions ended as misses, {tally.promoted} promoted and "
          f"{tally.checked} loads checked bit-exact")
    assert caught > 0 and injected and tally.failed_promotions >= caught and tally.promoted > 0
    manager.shutdown()


def test_redis_tier_restart_faults_and_a_killed_server(requests, tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as server:
        config = {"tier": "redis", "url": server.url, "model": "conformance", "timeout_s": 0.5,
                  "retry_s": 0.2}
        manager, region = t.build(PRIMARY, config)
        driver = run(manager, region, requests[:100])
        stored = driver.tally.stored
        gone = primary_evicted(manager, stored)
        assert len(gone) > len(stored) // 2
        again = restart(config, [k[:-4] for k in gone[:100]], tmp_path)
        assert again == {"asked": 100, "found": 100, "checked": 100}
        tier = manager.secondary_tiers[0].tier
        rng = random.Random(22)
        get, injected = tier.get, []

        def flaky_get(keys, out):
            if rng.random() < 0.05:
                injected.append(len(keys))
                return 0
            return get(keys, out)

        tier.get = flaky_get
        for i, k in enumerate(gone[:150]):
            if i == 100:
                server.stop()  # Redis killed mid-run: from here on every load fails
            driver.request(f"back{i}", [k[:-4]], store=False)
        for i, hashes in enumerate(requests[100:120]):  # stores keep going (their cascades fail)
            driver.request(f"late{i}", hashes)
        driver.settle()
        tally = driver.tally
        print(f"\nredis: restarted process found {again['found']}/{again['asked']}; {tally.promoted} "
              f"promoted, {tally.checked} loads checked bit-exact, {len(injected)} loads failed by "
              "injection, "
              f"server killed after 100 of 150 lookups: {tally.misses} misses, {tally.failed_promotions} "
              "promotions ended as misses")
        assert injected and tally.promoted > 0 and tally.misses >= 50
        manager.shutdown()


def fresh_hashes(base: int, n: int) -> list[bytes]:
    """``n`` block hashes no trace request shares (32 bytes from ``base``)."""
    return [(base + i).to_bytes(32, "big") for i in range(n)]


@pytest.mark.skipif(not kv.DEFERRED_RELEASE, reason="this vLLM has no JobResult.deferred_release (0.34+)")
def test_a_late_load_holds_its_primary_chunk_until_its_write_lands(tmp_path: Path) -> None:
    """vLLM 0.34: a promotion whose read stalls past ``load_timeout_s`` fails at once (a miss: vLLM
    recomputes), and its primary chunk stays out of vLLM's free pool until the read ends: a store made
    meanwhile, which takes every other chunk of the 8-chunk primary, never gets it (so the late write cannot
    land in another block), every block it stored reads back bit-exact after the late write, and once the
    write has landed vLLM frees the chunk and the next store gets it."""
    manager, region = t.build(8, {**disk(tmp_path), "load_timeout_s": 0.0})
    driver = t.Driver(manager, region)
    tier = manager.secondary_tiers[0]
    (late_hash,) = fresh_hashes(1 << 40, 1)
    for name, hashes in (("first", [late_hash]), ("fill1", fresh_hashes(2 << 40, 7)),
                         ("fill2", fresh_hashes(3 << 40, 7))):
        driver.request(name, hashes)
        driver.settle()
    late_key = t.make_offload_key(late_hash, 0)
    assert manager.primary_tier._policy.get(late_key) is None  # evicted from the primary, on disk only
    assert tier.tier.exists([offload_tier_key(late_key)]) == 1
    gate, started, loads = threading.Event(), threading.Event(), []
    get, submit_load = tier.tier.get, tier.submit_load

    def stalled_get(keys, out):  # the medium stalls: the read lands only when the gate opens
        started.set()
        assert gate.wait(120)
        return get(keys, out)

    def recording_submit_load(job):
        loads.append(job.chunk_ids.tolist())
        submit_load(job)

    tier.tier.get, tier.submit_load = stalled_get, recording_submit_load
    ctx = t.ReqContext("late")
    manager.on_new_request(ctx)
    assert manager.lookup(late_key, ctx) is t.LookupResult.HIT_PENDING
    driver.end_step()  # the promotion's load is submitted; its read reaches the medium and stalls
    assert started.wait(60)
    assert manager.lookup(late_key, ctx) is t.LookupResult.MISS  # given up at its deadline: a miss
    (held,) = loads
    assert len(held) == 1
    manager.on_request_finished(ctx)
    driver.end_step()
    meanwhile = fresh_hashes(4 << 40, 7)
    since = len(driver.allocated)
    driver.request("meanwhile", meanwhile)  # takes the 7 other chunks while the read is stalled
    assert len(driver.allocated) - since == 7, "the store must take every chunk it can"
    assert held[0] not in driver.allocated[since:], "a chunk the late read may write was handed out"
    assert manager.primary_tier.num_deferred_release_chunks == 1
    gate.set()
    driver.settle()  # the read lands in the held chunk; vLLM frees it on its next poll
    assert manager.primary_tier.num_deferred_release_chunks == 0
    for i, h in enumerate(meanwhile):  # bit-exact: the late write landed in none of them
        assert driver.request(f"check{i}", [h], store=False) == 1
    since = len(driver.allocated)
    driver.request("after", fresh_hashes(5 << 40, 7))
    assert held[0] in driver.allocated[since:]  # free again, and the next store gets it
    print(f"\ndeferred release: chunk {held[0]} held while the stalled read ran; the 7 chunks stored "
          f"meanwhile read back bit-exact; the next store got chunk {held[0]}")
    manager.shutdown()


@pytest.mark.skipif(kv.DEFERRED_RELEASE, reason="this vLLM has JobResult.deferred_release")
def test_load_timeout_is_refused_without_deferred_release(tmp_path: Path) -> None:
    """vLLM 0.33 frees a failed load's chunks at once: a load given up while its read runs could write into
    a chunk already given to another block, so the option is refused."""
    with pytest.raises(ConfigError, match="load_timeout_s needs vLLM 0.34"):
        t.build(8, {**disk(tmp_path), "load_timeout_s": 1.0})
