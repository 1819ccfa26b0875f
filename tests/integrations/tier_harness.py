"""Drive vLLM's ``TieringOffloadingManager`` (0.33.0 or 0.34.0: CPU primary + kvpool's tier below it) the way
its scheduler does, writing and checking real bytes: a stored chunk's row holds :func:`pattern` of its key,
and every chunk a request loads is compared with it, so a wrong hit cannot pass unseen."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

ROW_BYTES = 4096
MODULE = "kvpool.integrations.vllm"


def pattern(key: bytes) -> np.ndarray:
    """The bytes a chunk of ``key`` holds: BLAKE2b-512 of the key, repeated."""
    seed = np.frombuffer(hashlib.blake2b(key).digest(), dtype=np.uint8)
    return np.resize(seed, ROW_BYTES)


class Region:
    """The primary tier's host memory (vLLM's SharedOffloadRegion, here plain process memory)."""

    def __init__(self, num_chunks: int) -> None:
        self.tensor = torch.zeros((num_chunks, ROW_BYTES), dtype=torch.int8)
        self.array = self.tensor.numpy().view(np.uint8)

    def create_kv_memoryview(self) -> memoryview:
        return memoryview(self.tensor.numpy())

    def cleanup(self) -> None:
        return None


def build(num_chunks: int, tier_config: dict, policy: str = "KvpoolLRU") -> tuple[TieringOffloadingManager,
                                                                                     Region]:
    region = Region(num_chunks)
    primary = CPUPrimaryTierOffloadingManager(num_chunks=num_chunks, mmap_region=region, cache_policy=policy,
                                              cache_policy_module_path=MODULE)
    spec = SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=False))
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "KvpoolTier", "module_path": MODULE, **tier_config}, primary.get_kv_memoryview(), spec)
    manager = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier], tier_poll_interval_s=0)
    return manager, region


@dataclass
class Tally:
    """Blocks per outcome over a run."""

    primary_hits: int = 0
    promoted: int = 0  # hits that came up from the kvpool tier
    misses: int = 0
    failed_promotions: int = 0  # lookups that promoted but ended in a miss (a fault surfaced as a miss)
    stored: set = field(default_factory=set)
    checked: int = 0  # loaded chunks compared byte for byte with their pattern


class Driver:
    def __init__(self, manager: TieringOffloadingManager, region: Region) -> None:
        self.m, self.region, self.tally, self.step = manager, region, Tally(), 0
        self.allocated: list[int] = []  # the primary chunks given to stores, in order

    def end_step(self) -> None:
        self.m.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def _prefix(self, keys: list[bytes], ctx: ReqContext, timeout_s: float = 20.0) -> int:
        """The request's cached prefix as its scheduler finds it: passes of lookups, each from the first key,
        until one sees no pending promotion; then the leading HITs (tallied: from the primary, promoted
        from the kvpool tier, or a promotion that ended as a miss)."""
        promoting: set[bytes] = set()
        deadline = time.monotonic() + timeout_s
        while True:
            hits, pending = 0, False
            for key in keys:
                result = self.m.lookup(key, ctx)
                if result is LookupResult.HIT:
                    hits += 1
                    continue
                if result is not LookupResult.MISS:
                    pending = True
                    promoting.add(key) if result is LookupResult.HIT_PENDING else None
                break
            if not pending:
                break
            assert time.monotonic() < deadline, "lookups did not settle"
            self.end_step()
            time.sleep(0.001)
        tally = self.tally
        tally.promoted += sum(k in promoting for k in keys[:hits])
        tally.primary_hits += hits - sum(k in promoting for k in keys[:hits])
        if hits < len(keys):
            tally.misses += 1
            tally.failed_promotions += keys[hits] in promoting
        return hits

    def request(self, name: str, hashes: list[bytes], store: bool = True) -> int:
        """One request: its cached prefix loaded and checked, the rest stored. Returns its hit blocks."""
        keys = [make_offload_key(h, 0) for h in hashes]
        ctx = ReqContext(name)
        self.m.on_new_request(ctx)
        hits = self._prefix(keys, ctx)
        if hits:
            spec = self.m.prepare_load(keys[:hits], ctx)
            for key, chunk in zip(keys[:hits], spec.chunk_ids.tolist(), strict=True):
                assert np.array_equal(self.region.array[chunk], pattern(key)), f"wrong KV for {key.hex()}"
                self.tally.checked += 1
            self.m.complete_load(keys[:hits], ctx)
        if store and hits < len(keys):
            out = self.m.prepare_store(keys[hits:], ctx)
            if out is None:  # the primary's chunks are pinned by cascades in flight: a later step retries
                self.settle()
                out = self.m.prepare_store(keys[hits:], ctx)
            if out is not None and out.keys_to_store:
                chunks = out.store_spec.chunk_ids.tolist()
                self.allocated += chunks
                for key, chunk in zip(out.keys_to_store, chunks, strict=True):
                    self.region.array[chunk] = pattern(key)
                self.m.complete_store(out.keys_to_store, ctx)
                self.tally.stored.update(out.keys_to_store)
        self.m.on_request_finished(ctx)
        self.end_step()
        return hits

    def settle(self) -> None:
        """Let every cascade and promotion finish."""
        self.m.secondary_tiers[0].drain_jobs()
        for _ in range(2):
            self.end_step()


def restart_main() -> None:
    """``python -c 'import tier_harness; tier_harness.restart_main()' CONFIG_JSON HASHES_FILE``: a fresh
    process builds the manager on the same tier and asks for each block once (a one-block request);
    prints a JSON line of the tally."""
    import json
    import sys

    config = json.loads(sys.argv[1])
    with open(sys.argv[2]) as listing:
        hashes = [bytes.fromhex(line) for line in listing.read().split()]
    manager, region = build(16, config)
    driver = Driver(manager, region)
    found = sum(driver.request(f"again{i}", [h], store=False) for i, h in enumerate(hashes))
    manager.shutdown()
    print(json.dumps({"asked": len(hashes), "found": found, "checked": driver.tally.checked}))
