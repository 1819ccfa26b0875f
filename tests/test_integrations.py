"""kvpool.integrations without vLLM or SGLang: key mapping, the offload policy adapter against a brute-force
LRU, tier jobs on a real FileTier (a load given up at its deadline holds its rows until its I/O ends), the
vLLM adapters against stand-ins of vLLM 0.33's and 0.34's base classes (tests/vllm_fakes.py), and HiCache's
v2 hit rule (the engines' own runs: tests/integrations)."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import random
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import vllm_fakes

from kvpool.allocators.policies import ARCPolicy, LRUPolicy
from kvpool.errors import ConfigError, InvalidArgumentError
from kvpool.integrations.keys import group_of, offload_tier_key, page_tier_key, tier_key
from kvpool.integrations.offload_policy import OffloadPolicy
from kvpool.integrations.page_store import hit_prefix
from kvpool.integrations.tier_jobs import TierJobs, open_tier, slot_runs
from kvpool.tiers.auth import TierKey
from kvpool.tiers.backend import HEADER_BYTES, Namespace
from kvpool.tiers.file import FileTier


def test_tier_key_is_a_digest_then_the_group() -> None:
    h = bytes(range(32))
    key = tier_key(h, 3)
    assert key == hashlib.blake2b(h, digest_size=12, person=b"kvpool-vllm").digest() + b"\0\0\0\3"
    assert group_of(key) == 3 and len(key) == 16
    assert offload_tier_key(h + (3).to_bytes(4, "big")) == key
    assert tier_key(h, 4) != key and page_tier_key(h.hex()) != tier_key(h.hex().encode())
    for bad in (lambda: tier_key("x"), lambda: tier_key(h, -1), lambda: tier_key(h, 2**32),
                lambda: offload_tier_key(b"abc"), lambda: page_tier_key(b"ab"), lambda: tier_key(h, 0, "x")):
        with pytest.raises(InvalidArgumentError):
            bad()


def test_offload_policy_lru_against_a_brute_force_list() -> None:
    rng = random.Random(7)
    cap = 12
    core = OffloadPolicy(cap, LRUPolicy)
    brute: list[str] = []  # the evictable keys, least recently released first
    evictable: set[str] = set()
    free = list(range(cap))
    pinned: set[str] = set()
    for step in range(3000):
        op = rng.random()
        keys = list(core.chunks)
        if op < 0.35:  # store n keys: evict what is missing, then insert and complete
            new = [f"k{step}.{i}" for i in range(rng.randint(1, 4))]
            protected = set(rng.sample(keys, min(len(keys), 2)))
            need = len(new) - len(free)
            held = sorted((k for k in protected if k in evictable), key=brute.index) if need > 0 else []
            fits = need <= len(evictable) - len(held)
            expect = [k for k in brute if k not in held][:max(0, need)] if fits else None
            got = core.evict(need, protected) if need > 0 else []
            assert (None if got is None else [k for k, _ in got]) == expect
            if got is None:
                continue
            brute = [k for k in brute if k not in held and k not in expect] + held
            evictable -= set(expect)
            free += [c.chunk_id for _, c in got]
            for key in new:
                core.insert(key, SimpleNamespace(chunk_id=free.pop(), ref_cnt=-1))
                core.mark_evictable(key)
                brute.append(key)
                evictable.add(key)
        elif op < 0.55 and evictable - pinned:  # a load pins, later it completes
            key = rng.choice(sorted(evictable - pinned))
            core.mark_non_evictable(key)
            brute.remove(key)
            evictable.discard(key)
            pinned.add(key)
        elif op < 0.7 and pinned:
            key = rng.choice(sorted(pinned))
            pinned.discard(key)
            core.mark_evictable(key)
            brute.append(key)
            evictable.add(key)
        elif keys:  # a reuse of a few keys, head first: applied tail first
            used = rng.sample(keys, min(len(keys), 3))
            core.access(used)
            for key in reversed(used):
                if key in evictable:
                    brute.remove(key)
                    brute.append(key)
        assert core.order() == brute
    assert core.num_evictable == len(brute) > 0


def test_offload_policy_remove_and_clear() -> None:
    core = OffloadPolicy(4, LRUPolicy)
    core.insert("a", SimpleNamespace(chunk_id=0, ref_cnt=0))
    core.insert("b", SimpleNamespace(chunk_id=1, ref_cnt=-1))
    core.remove("b")  # a failed store
    assert core.order() == ["a"] and core.get("b") is None and core.evict(2, set()) is None
    assert core.evict(1, {"a"}) is None and [k for k, _ in core.evict(1, set())] == ["a"]
    core.insert("c", SimpleNamespace(chunk_id=0, ref_cnt=0))
    core.clear()
    assert len(core) == 0 and core.order() == []


@pytest.mark.parametrize(("variant", "report", "victim"), [
    ("paper", True, "c"),  # p = 1 before the eviction: |T1| = 1 is not > 1, T2 gives c
    ("paper", False, "b"),  # unreported, p moves only when "a" is published: |T1| = 1 > 0, T1 gives b
    ("vllm", True, "b"),  # vLLM's rule: |T1| = 1 >= int(1), T1 gives b
])
def test_offload_policy_reports_store_misses_before_the_eviction(variant: str, report: bool,
                                                                 victim: str) -> None:
    core = OffloadPolicy(3, lambda: ARCPolicy(variant))
    for i, key in enumerate("abc"):
        core.insert(key, SimpleNamespace(chunk_id=i, ref_cnt=0))
    core.access(["c"])  # c reused: T2
    assert [k for k, _ in core.evict(1, set())] == ["a"]  # |T1| = 2 > p = 0: a, to B1
    if report:
        core.missed(["a", "c"])  # a store offers a (a B1 ghost) and c (cached: skipped)
    assert core.policy.p == (1.0 if report else 0.0)  # p += max(|B2| / |B1|, 1)
    assert [k for k, _ in core.evict(1, set())] == [victim]


def test_slot_runs() -> None:
    assert slot_runs([3, 4, 5, 9, 1, 2]) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]
    assert slot_runs([]) == []


def test_tier_jobs_copy_rows_and_a_corrupt_block_ends_a_load(tmp_path) -> None:
    ns = Namespace("m", "uint8", "rows/64")
    tier = FileTier(tmp_path, ns, capacity_bytes=1 << 20, block_bytes=64, auth_key=TierKey.public())
    rows = torch.zeros((8, 64), dtype=torch.uint8)
    rows[:4] = torch.arange(256, dtype=torch.uint8).view(4, 64)
    jobs = TierJobs(tier, rows)
    keys = [bytes([i]) * 16 for i in range(4)]
    jobs.submit_store(1, keys, [0, 1, 2, 3])
    jobs.drain()
    (done,) = jobs.finished()
    assert (done.job_id, done.ok, done.moved) == (1, True, 4)
    path, at = tier._value_at(keys[2])  # its own file, or its slot in a segment file
    raw = bytearray(path.read_bytes())
    raw[at + HEADER_BYTES] ^= 1
    path.write_bytes(bytes(raw))
    jobs.submit_load(2, keys, [4, 5, 7, 6])  # rows 4, 5 consecutive; 7 then 6
    jobs.drain()
    (done,) = jobs.finished()
    assert (done.is_load, done.moved, done.total) == (True, 2, 4)
    assert torch.equal(rows[4:6], rows[0:2])
    jobs.close()


class GatedTier:
    """A real FileTier whose ``get`` waits for ``gate`` before its I/O (a stalled medium): ``started`` is
    set when a load reached the medium."""

    def __init__(self, tier: FileTier) -> None:
        self.tier, self.block_bytes, self._get = tier, tier.block_bytes, tier.get
        self.gate, self.started = threading.Event(), threading.Event()
        self.calls = 0

    def get(self, keys, out) -> int:
        self.calls += 1
        self.started.set()
        self.gate.wait()
        return self._get(keys, out)

    def set(self, keys, rows) -> int:
        return self.tier.set(keys, rows)

    def close(self) -> None:
        self.tier.close()


def test_tier_jobs_give_up_a_late_load_and_hold_its_rows_until_its_io_ends(tmp_path) -> None:
    """With ``load_timeout_s``, a load still running at its deadline is reported failed at once (moved 0)
    with a release event that stays clear while the worker may still write its rows, and is set once the
    write has landed; the job is not reported a second time. A load given up before it began never
    reaches the medium (its event is set when the worker skips it)."""
    ns = Namespace("m", "uint8", "rows/64")
    gated = GatedTier(FileTier(tmp_path, ns, capacity_bytes=1 << 20, block_bytes=64,
                               auth_key=TierKey.public()))
    rows = torch.zeros((8, 64), dtype=torch.uint8)
    rows[:2] = 7
    now = [100.0]
    jobs = TierJobs(gated, rows, load_timeout_s=5.0, clock=lambda: now[0])
    keys = [b"a" * 16, b"b" * 16]
    jobs.submit_store(1, keys, [0, 1])
    jobs.drain()
    assert [d.ok for d in jobs.finished()] == [True]
    jobs.submit_load(2, keys, [4, 5])  # deadline 105
    jobs.submit_load(3, keys, [6, 7])  # queued behind it, deadline 105
    assert gated.started.wait(30)
    now[0] = 104.9
    assert jobs.finished() == []  # before the deadline: nothing to report
    now[0] = 105.0
    late = {d.job_id: d for d in jobs.finished()}
    assert sorted(late) == [2, 3]
    for d in late.values():
        assert (d.is_load, d.ok, d.moved, d.total, d.nbytes) == (True, False, 0, 2, 0)
        assert d.released is not None and not d.released.is_set()
    assert rows[4:8].sum() == 0  # the stalled read has not written yet
    gated.gate.set()
    assert late[2].released.wait(30) and late[3].released.wait(30)
    assert torch.equal(rows[4:6], rows[0:2])  # the late write landed in the held rows
    jobs.drain()
    assert gated.calls == 1 and rows[6:8].sum() == 0  # job 3 was skipped: never read, rows untouched
    assert jobs.finished() == []  # each job reported once
    jobs.submit_load(4, keys, [6, 7])  # in time: reported when its I/O ends, no event
    jobs.drain()
    (done,) = jobs.finished()
    assert (done.job_id, done.ok, done.released) == (4, True, None)
    jobs.close()


def test_tier_jobs_without_a_deadline_report_a_load_when_its_io_ends(tmp_path) -> None:
    ns = Namespace("m", "uint8", "rows/64")
    gated = GatedTier(FileTier(tmp_path, ns, capacity_bytes=1 << 20, block_bytes=64,
                               auth_key=TierKey.public()))
    now = [0.0]
    jobs = TierJobs(gated, torch.zeros((4, 64), dtype=torch.uint8), clock=lambda: now[0])
    jobs.submit_load(1, [b"a" * 16], [0])
    assert gated.started.wait(30)
    now[0] = 1e9
    assert jobs.finished() == []
    gated.gate.set()
    jobs.drain()
    (done,) = jobs.finished()
    assert (done.ok, done.moved, done.released) == (False, 0, None)  # a miss, reported after its I/O
    for bad in (-1.0, float("nan"), "5"):
        with pytest.raises(ConfigError, match="load_timeout_s"):
            TierJobs(gated, torch.zeros((4, 64), dtype=torch.uint8), load_timeout_s=bad)
    jobs.close()


#: The fakes stand in only where vLLM cannot be imported; tests/integrations runs the real releases.
FAKE_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                               reason="vLLM is installed: tests/integrations runs the adapters on it")


def _offload_key(i: int) -> bytes:
    return bytes([i]) * 32 + (0).to_bytes(4, "big")  # a 32-byte block hash, KV cache group 0


@FAKE_VLLM
@pytest.mark.parametrize("release", vllm_fakes.RELEASES)
def test_vllm_adapters_follow_the_release_interface(release: str, monkeypatch) -> None:
    """The adapters read the interface from vLLM's base classes: ``touch`` exactly where the release declares
    it, nothing left abstract (vLLM 0.34 makes ``on_request_finished`` abstract), and on both releases a
    request's end is the recency: an LRU of four chunks a, b, c, d (stored in that order) whose request
    reused a and b evicts c, d, then b, a (a request frees its blocks tail first, so its head is the most
    recent)."""
    kv = vllm_fakes.installed(release, monkeypatch)
    old = release == "0.33.0"
    assert kv.POLICY_TOUCH is kv.TIER_TOUCH is old
    assert kv.DEFERRED_RELEASE is kv.LOOKUP_MARK_PRESENT is (not old)
    for cls in [*kv.POLICY_CLASSES.values(), kv.KvpoolTier]:
        assert not inspect.isabstract(cls), cls
        assert hasattr(cls, "touch") == old, cls
    policy = kv.KvpoolLRU(4)
    a, b, c, d = (_offload_key(i) for i in range(4))
    ctx = vllm_fakes.ReqContext("r", positions={a: 1, b: 2})
    for i, key in enumerate((a, b, c, d)):
        chunk = vllm_fakes.ChunkStatus(i)
        policy.insert(key, chunk, ctx)
        chunk.ref_cnt = 0
        policy.mark_evictable(key)
    policy.on_request_finished([[b, a]], set(), {a, b}, ctx)  # positions put a before b
    assert [k for k, _ in policy.evict(2, set())] == [c, d]
    assert [k for k, _ in policy.evict(2, set())] == [b, a]


@FAKE_VLLM
def test_kvpool_tier_holds_a_late_loads_chunks_until_its_io_ends(monkeypatch, tmp_path) -> None:
    """vLLM 0.34: a load past ``load_timeout_s`` is reported failed at once with ``deferred_release``, an
    event clear while the stalled read may still write the primary chunks and set once it has written
    them; meanwhile its keys look up as misses (they are on disk: a hit after). 0.33 has no such field, so
    the option is refused there."""
    kv = vllm_fakes.installed("0.34.0", monkeypatch)
    region = torch.zeros((8, 64), dtype=torch.uint8)
    region[0:2] = torch.arange(128, dtype=torch.uint8).view(2, 64)
    tier = kv.KvpoolTier(None, memoryview(region.numpy()), "kvpool", tier="disk", directory=str(tmp_path),
                         capacity_bytes=1 << 20, auth_key="public", load_timeout_s=0.0)
    keys, ctx = [_offload_key(1), _offload_key(2)], vllm_fakes.ReqContext("r")
    tier.submit_store(vllm_fakes.TransferJob(1, keys, np.array([0, 1]), False, ctx))
    tier.drain_jobs()
    assert [(r.job_id, r.success, r.deferred_release) for r in tier.get_finished_jobs()] == [(1, True, None)]
    gated = GatedTier(tier.tier)
    monkeypatch.setattr(tier.tier, "get", gated.get)
    tier.submit_load(vllm_fakes.TransferJob(2, keys, np.array([4, 5]), True, ctx))
    assert gated.started.wait(30)
    (late,) = tier.get_finished_jobs()
    assert (late.job_id, late.success, late.successful_keys) == (2, False, None)
    assert not late.deferred_release.is_set() and region[4:6].sum() == 0
    hit, miss = vllm_fakes.LookupResult.HIT, vllm_fakes.LookupResult.MISS
    assert [tier.lookup(k, ctx) for k in [*keys, _offload_key(3)]] == [miss, miss, miss]
    gated.gate.set()
    assert late.deferred_release.wait(30)
    assert torch.equal(region[4:6], region[0:2])  # the late write landed in the chunks vLLM held
    tier.drain_jobs()
    assert tier.get_finished_jobs() == []
    assert [tier.lookup(k, ctx) for k in [*keys, _offload_key(3)]] == [hit, hit, miss]
    tier.shutdown()
    kv = vllm_fakes.installed("0.33.0", monkeypatch)
    with pytest.raises(ConfigError, match="load_timeout_s needs vLLM 0.34"):
        kv.KvpoolTier(None, memoryview(region.numpy()), "kvpool", tier="disk", directory=str(tmp_path / "b"),
                      capacity_bytes=1 << 20, auth_key="public", load_timeout_s=1.0)
    assert not (tmp_path / "b").exists()  # refused before the tier is opened


def test_open_tier_takes_the_fleet_secret_from_the_environment(tmp_path, monkeypatch) -> None:
    """An engine's JSON configuration carries no secret: open_tier reads $KVPOOL_TIER_KEY, refuses to open
    an unauthenticated tier without one, and opens a public one only when told "public"."""
    ns = Namespace("m", "uint8", "rows/64")
    monkeypatch.delenv("KVPOOL_TIER_KEY", raising=False)
    monkeypatch.delenv("KVPOOL_HASH_SEED", raising=False)
    with pytest.raises(ConfigError, match="KVPOOL_TIER_KEY"):
        open_tier("disk", ns, 64, directory=tmp_path / "a", capacity_bytes=1 << 20)
    assert not (tmp_path / "a").exists()
    public = open_tier("disk", ns, 64, directory=tmp_path / "b", capacity_bytes=1 << 20, auth_key="public")
    assert not public.auth_key.authenticates
    monkeypatch.setenv("KVPOOL_TIER_KEY", "a fleet secret of 16+ bytes")
    keyed = open_tier("disk", ns, 64, directory=tmp_path / "c", capacity_bytes=1 << 20)
    assert keyed.auth_key.source == "KVPOOL_TIER_KEY"
    public.close()
    keyed.close()


def test_hit_prefix_folds_pool_rules() -> None:
    stored = {"swa": {4, 5, 6, 7}, "dsa": {0, 1, 2, 3, 4}}
    def has(pool: str, i: int) -> bool:
        return i in stored[pool]

    assert hit_prefix(8, [("swa", "trailing_pages", 2)], has) == (8, {"kv": 8, "swa": 8}, [6, 7, 8])
    assert hit_prefix(8, [("dsa", "all_pages", 0)], has) == (5, {"kv": 8, "dsa": 5}, [1, 2, 3, 4, 5])
    assert hit_prefix(8, [("dsa", "block_groups", 4)], has) == (0, {"kv": 8}, [])
    assert hit_prefix(0, [("swa", "trailing_pages", 2)], has) == (0, {}, [])
