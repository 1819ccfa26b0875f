"""Conformance of ``KvpoolHiCacheStorage`` as SGLang 0.5.23's HiCache L3 backend, loaded by SGLang's own
factory (``--hicache-storage-backend dynamic``) and wrapped in its ``HiCacheStorageFailureInjector`` at
failure probability 0.05; run by tests/integrations/run.sh in the SGLang venv, skipped without SGLang."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip(
    "sglang",
    reason="SGLang is not installed here: tests/integrations/run.sh runs this "
    "file in the peer venv (benchmarks/peers/setup.sh)",
)

import sglang_harness as sh  # noqa: E402
import torch  # noqa: E402
from redis_servers import redis_server  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvpool.tiers.backend import HEADER_BYTES  # noqa: E402

PAGES = 96
TRIES = 50


def make(monkeypatch, tier: dict, host):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.05")
    backend = StorageBackendFactory.create_backend("dynamic", sh.storage_config(sh.kvpool_extra(tier)), host)
    assert isinstance(backend, HiCacheStorageFailureInjector)
    backend.register_mem_pool_host(host)
    return backend


def fill(host, pages: int, seed: int) -> tuple[torch.Tensor, list[str], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    idx = host.alloc(pages * sh.PAGE)
    keys = [f"{seed:08x}{i:056x}" for i in range(pages)]
    data = []
    for i in range(pages):
        page = torch.randn(host.get_dummy_flat_data_page().shape, generator=gen).to(host.dtype)
        host.set_from_flat_data_page(int(idx[i * sh.PAGE]), page)
        data.append(page)
    return idx, keys, data


def retry(call, n: int) -> tuple[list[bool], int]:
    """Call until every page is True or TRIES calls; returns the last answer and the injected failures."""
    failures, ok = 0, [False] * n
    for _ in range(TRIES):
        ok = call()
        if all(ok):
            break
        failures += 1
    return ok, failures


def round_trip(backend, host, keys, idx, data, flipped: set[str] = frozenset()) -> dict:
    """Store the pages (v1, retried past injected failures), clear the host copy, read them back into
    other host slots (v1): every page reported read must be bit-exact."""
    ok, set_failures = retry(lambda: backend.batch_set_v1(keys, idx), len(keys))
    assert all(ok), "a page could not be stored in 50 tries"
    return {"set_failures": set_failures}


def read_back(backend, host, keys, data, expect_missing: set[str] = frozenset()) -> dict:
    dst = host.alloc(len(keys) * sh.PAGE)
    wrong = good = missed = injected = 0
    for i, key in enumerate(keys):
        page_idx = dst[i * sh.PAGE : (i + 1) * sh.PAGE]
        for _ in range(TRIES):
            if backend.batch_get_v1([key], page_idx)[0]:
                got = host.get_data_page(int(page_idx[0]), flat=True)
                if torch.equal(got, data[i]):
                    good += 1
                else:
                    wrong += 1
                break
            injected += 1
            if key in expect_missing and injected:
                missed += 1
                break
    host.free(dst)
    return {"good": good, "wrong": wrong, "missed": missed, "injected": injected}


def test_disk_pages_round_trip_through_the_failure_injector(monkeypatch, tmp_path: Path) -> None:
    host = sh.host_pool()
    backend = make(monkeypatch, {"tier": "disk", "directory": str(tmp_path), "capacity_bytes": 1 << 30}, host)
    idx, keys, data = fill(host, PAGES, 1)
    stored = round_trip(backend, host, keys, idx, data)
    assert backend.batch_exists(keys) in range(PAGES + 1)  # the injector may fail it: 0
    got = read_back(backend, host, keys, data)
    print(
        f"\ndisk v1: {PAGES} pages stored ({stored['set_failures']} injected set failures), read back: "
        f"{got['good']} bit-exact, {got['wrong']} wrong, {got['injected']} injected get failures"
    )
    assert got == {**got, "good": PAGES, "wrong": 0}
    # flip one payload byte in 5% of the files: those pages are misses, never wrong KV
    rng = random.Random(5)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file() and len(p.name) == 32)
    for path in rng.sample(files, len(files) // 20):
        raw = bytearray(path.read_bytes())
        raw[HEADER_BYTES + 7] ^= 0x40
        path.write_bytes(bytes(raw))
    got = read_back(backend, host, keys, data, expect_missing=set(keys))
    print(
        f"disk v1 after flipping {len(files) // 20} files: {got['good']} bit-exact, {got['wrong']} wrong, "
        f"{got['missed']} pages missed"
    )
    assert got["wrong"] == 0 and got["good"] >= PAGES - len(files) // 20 - got["missed"]
    backend.close()


def test_redis_generic_and_v1_calls(monkeypatch, tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as server:
        host = sh.host_pool()
        backend = make(monkeypatch, {"tier": "redis", "url": server.url}, host)
        idx, keys, data = fill(host, PAGES, 2)
        round_trip(backend, host, keys, idx, data)
        got = read_back(backend, host, keys, data)
        assert got["good"] == PAGES and got["wrong"] == 0
        # the generic (v0) calls HiCache makes without interface_v1: its own flat page tensors
        page = host.get_dummy_flat_data_page()
        outs = [torch.empty_like(page) for _ in keys[:8]]
        for _ in range(TRIES):
            res = backend.batch_get(keys[:8], outs)
            if all(r is not None for r in res):
                break
        assert all(torch.equal(o, d) for o, d in zip(outs, data[:8], strict=True))
        server.stop()  # a dead server: misses, never wrong KV
        assert backend.batch_get_v1(keys[:4], idx[: 4 * sh.PAGE]) == [False] * 4
        print(
            f"\nredis v1: {got['good']} pages bit-exact ({got['injected']} injected get failures); "
            "killed server: every page a miss"
        )
        backend.close()


def test_hybrid_pools_v2(monkeypatch, tmp_path: Path) -> None:
    host, swa = sh.host_pool(), sh.host_pool(tokens=1024)
    backend = make(monkeypatch, {"tier": "disk", "directory": str(tmp_path), "capacity_bytes": 1 << 30}, host)
    backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    idx, keys, data = fill(host, 8, 3)
    sidx, _, sdata = fill(swa, 8, 4)
    retry(lambda: backend.batch_set_v1(keys, idx), 8)
    ok, _ = retry(
        lambda: backend.batch_set_v2(
            [PoolTransfer(PoolName.SWA, host_indices=sidx[4 * sh.PAGE :], keys=keys[4:])]
        )[PoolName.SWA],
        4,
    )
    assert all(ok)
    trailing = PoolTransfer(PoolName.SWA, keys=keys[6:8], hit_policy="trailing_pages")
    for _ in range(TRIES):
        res = backend.batch_exists_v2(keys, [trailing])
        if res.kv_hit_pages:
            break
    # SWA holds pages 4..7: a prefix p is usable when its last 2 pages are there: p = 6, 7, 8
    assert (res.kv_hit_pages, res.restorable_prefix_pages) == (8, [6, 7, 8])
    dst = swa.alloc(4 * sh.PAGE)
    ok, _ = retry(
        lambda: backend.batch_get_v2([PoolTransfer(PoolName.SWA, host_indices=dst, keys=keys[4:])])[
            PoolName.SWA
        ],
        4,
    )
    assert all(ok) and all(
        torch.equal(swa.get_data_page(int(dst[i * sh.PAGE]), flat=True), sdata[4 + i]) for i in range(4)
    )
    backend.close()
