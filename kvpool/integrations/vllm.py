"""kvpool inside vLLM (tested with vLLM 0.33.0 and 0.34.0): eviction policies for the CPU offload tier and a
secondary tier over kvpool's disk and Redis tiers. Imports vLLM: only vLLM's configuration loads this module.

**Releases.** The module reads which interface the installed vLLM has from its base classes
(:data:`POLICY_TOUCH`, :data:`TIER_TOUCH`, :data:`DEFERRED_RELEASE`): vLLM 0.33 has ``CachePolicy.touch``
(abstract) and ``SecondaryTierManager.touch``; 0.34 removed both (a chunk's recency comes from
``on_request_finished`` alone, abstract there) and added ``JobResult.deferred_release``. The adapters
define ``touch`` only where the base class has it, and :class:`KvpoolTier`'s ``load_timeout_s`` (a load
reported failed at a deadline while its I/O may still write) needs ``deferred_release``.

**Policies** (``vllm/v1/kv_offload/cpu/policies/base.py``, ``CachePolicy``): :class:`KvpoolLRU`,
:class:`KvpoolFIFO`, :class:`KvpoolLFU`, :class:`KvpoolSLRU`, :class:`KvpoolPriority`, :class:`KvpoolARC`,
:class:`KvpoolARCVllm` (``arc-vllm``: vLLM's own ARC rules), :class:`KvpoolS3FIFO`, :class:`KvpoolSieve`,
:class:`KvpoolTLRU`, :class:`KvpoolLineage`, each kvpool's policy of that name
(:mod:`kvpool.allocators.policies`) driven as
:class:`~kvpool.integrations.offload_policy.OffloadPolicy` describes. vLLM loads one by class name::

    kv_connector_extra_config = {"cpu_bytes_to_use": 8 << 30, "eviction_policy": "KvpoolLFU",
                                 "cache_policy_module_path": "kvpool.integrations.vllm"}

A request's retention priority (``KvpoolPriority``) is ``kv_transfer_params["kvpool_priority"]`` (an int,
default 0; higher is kept longer). Options are class attributes: subclass to change them
(``KvpoolSLRU.protected_fraction``, ``KvpoolPriority.retention_s`` and ``clock``).

**Tier** (``vllm/v1/kv_offload/tiering/base.py``, ``SecondaryTierManager``): :class:`KvpoolTier`, a tier
below the CPU primary of ``TieringOffloadingSpec``::

    {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 << 30,
     "secondary_tiers": [{"type": "KvpoolTier", "module_path": "kvpool.integrations.vllm",
                          "tier": "disk", "directory": "/var/cache/kvpool", "capacity_bytes": 100 << 30,
                          "model": "Qwen/Qwen3-8B"}]}

(``"tier": "redis", "url": "redis://HOST:PORT"`` for Redis). Keys map to tier keys in
:func:`kvpool.integrations.keys.offload_tier_key`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Collection, Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvpool.allocators.policies import (
    ARCPolicy,
    EvictionPolicy,
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
    PriorityPolicy,
    SLRUPolicy,
    make_policy,
)
from kvpool.errors import ConfigError
from kvpool.integrations.keys import offload_tier_key
from kvpool.integrations.offload_policy import OffloadPolicy
from kvpool.integrations.tier_jobs import JobDone, TierJobs, open_tier
from kvpool.numeric import as_int
from kvpool.tiers.backend import Namespace

logger = logging.getLogger(__name__)

#: The ``kv_transfer_params`` entry holding a request's retention priority.
PRIORITY_PARAM = "kvpool_priority"

#: vLLM's ``CachePolicy`` has ``touch`` (0.33, abstract; gone in 0.34, where ``on_request_finished`` is).
POLICY_TOUCH = hasattr(CachePolicy, "touch")
#: vLLM's ``SecondaryTierManager`` has ``touch`` (0.33; gone in 0.34).
TIER_TOUCH = hasattr(SecondaryTierManager, "touch")
#: vLLM's ``JobResult`` has ``deferred_release`` (0.34): a failed load may hold its primary chunks.
DEFERRED_RELEASE = "deferred_release" in {f.name for f in dataclasses.fields(JobResult)}
#: vLLM's ``AsyncLookupManager`` has ``mark_present`` (0.34): a completed store answers pending lookups.
LOOKUP_MARK_PRESENT = hasattr(AsyncLookupManager, "mark_present")


def request_priority(req_context: ReqContext) -> int:
    """The retention priority a request asks for (``kv_transfer_params["kvpool_priority"]``, default 0).

    Raises:
        InvalidArgumentError: a value that is not an integer.
    """
    params = req_context.kv_transfer_params
    if not params or PRIORITY_PARAM not in params:
        return 0
    return as_int(params[PRIORITY_PARAM], PRIORITY_PARAM)


class KvpoolCachePolicy(CachePolicy):
    """A vLLM ``CachePolicy`` over the kvpool policy :meth:`make_policy` builds (see
    :class:`~kvpool.integrations.offload_policy.OffloadPolicy` for how each call maps)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.core = OffloadPolicy(cache_capacity, self.make_policy)

    @classmethod
    def make_policy(cls) -> EvictionPolicy:
        raise NotImplementedError

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.core.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.core.insert(key, chunk, request_priority(req_context))

    def remove(self, key: OffloadKey) -> None:
        self.core.remove(key)

    if POLICY_TOUCH:
        def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
            """vLLM 0.33's recency call (its connector no longer makes it; kept while the base has it)."""
            self.core.access(list(keys), request_priority(req_context))

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.core.missed(list(keys))  # no access: ARC adapts its target to a ghost before the eviction

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.core.set_priority(list(keys), request_priority(req_context))

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set,
                            reused_keys: set, req_context: ReqContext) -> None:
        used = insertion_only_keys | reused_keys
        if used:
            order = order_request_keys(key_groups, req_context)
            self.core.access([k for k in order if k in used], request_priority(req_context), reused_keys)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        return self.core.evict(n, protected)

    def clear(self) -> None:
        self.core.clear()

    def mark_evictable(self, key: OffloadKey) -> None:
        self.core.mark_evictable(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self.core.mark_non_evictable(key)


class KvpoolLRU(KvpoolCachePolicy):
    """kvpool's ``lru``: the chunk that became evictable longest ago goes first."""

    @classmethod
    def make_policy(cls) -> EvictionPolicy:
        return LRUPolicy()


class KvpoolFIFO(KvpoolCachePolicy):
    """kvpool's ``fifo``: the chunk stored longest ago goes first, however recently it was read."""

    @classmethod
    def make_policy(cls) -> EvictionPolicy:
        return FIFOPolicy()


class KvpoolLFU(KvpoolCachePolicy):
    """kvpool's ``lfu``: fewest reuses since stored first, ties by recency."""

    @classmethod
    def make_policy(cls) -> EvictionPolicy:
        return LFUPolicy()


class KvpoolSLRU(KvpoolCachePolicy):
    """kvpool's ``slru``: probation (stored, not reused) before protected (reused); ``protected_fraction``
    of the chunks at most in protected."""

    protected_fraction: ClassVar[float] = 0.8

    @classmethod
    def make_policy(cls) -> EvictionPolicy:
        return SLRUPolicy(cls.protected_fraction)


class KvpoolPriority(KvpoolCachePolicy):
    """kvpool's ``priority``: lowest retention priority first (``kv_transfer_params["kvpool_priority"]``),
    decaying to 0 ``retention_s`` seconds after the chunk became evictable; ties by recency."""

    retention_s: ClassVar[float] = 60.0
    clock: ClassVar[Any] = None  # None: time.monotonic

    @classmethod
    def make_policy(cls) -> EvictionPolicy:
        if cls.clock is None:
            return PriorityPolicy(cls.retention_s)
        return PriorityPolicy(cls.retention_s, cls.clock)


class KvpoolARC(KvpoolCachePolicy):
    """kvpool's ``arc``: Megiddo and Modha's ARC (:class:`~kvpool.allocators.policies.ARCPolicy`;
    docs/integrations.md: how it differs from vLLM's built-in ``arc``)."""

    @classmethod
    def make_policy(cls) -> EvictionPolicy:
        return ARCPolicy()


class KvpoolARCVllm(KvpoolCachePolicy):
    """kvpool's ``arc-vllm``: ARC with vLLM 0.33's rules (``ARCPolicy(variant="vllm")``), which evicts as
    vLLM's built-in ``arc`` does; for a fleet that wants vLLM's ``arc`` with kvpool's other pieces."""

    @classmethod
    def make_policy(cls) -> EvictionPolicy:
        return ARCPolicy("vllm")

    if POLICY_TOUCH:
        def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
            """As vLLM 0.33's ``arc.touch``: a hit for each ready chunk (a chunk still being stored stays in
            T1), a miss observed for each absent key (a ghost adapts the target)."""
            keys, core = list(keys), self.core
            ready = {k for k in keys if (c := core.chunks.get(k)) is not None and c.ref_cnt >= 0}
            core.access(keys, request_priority(req_context), ready)
            core.missed(keys)


class KvpoolS3FIFO(KvpoolCachePolicy):
    """kvpool's ``s3fifo`` (S3-FIFO as libCacheSim evicts: :mod:`kvpool.allocators.queue_policies`)."""

    @classmethod
    def make_policy(cls) -> EvictionPolicy:
        return make_policy("s3fifo")


class KvpoolSieve(KvpoolCachePolicy):
    """kvpool's ``sieve`` (SIEVE as libCacheSim evicts: :mod:`kvpool.allocators.queue_policies`)."""

    @classmethod
    def make_policy(cls) -> EvictionPolicy:
        return make_policy("sieve")


class KvpoolTLRU(KvpoolCachePolicy):
    """kvpool's ``tlru`` (:mod:`kvpool.allocators.prefix_policies`); the tier frees chunk by chunk, so every
    chunk counts as a sequence's head: LRU order with the TEL-safe rule of one-chunk sequences."""

    @classmethod
    def make_policy(cls) -> EvictionPolicy:
        return make_policy("tlru")


class KvpoolLineage(KvpoolCachePolicy):
    """kvpool's ``lineage`` (:mod:`kvpool.allocators.prefix_policies`); the tier frees chunk by chunk, so a
    chunk's generation comes from its own reuse (hits, a remembered hash)."""

    @classmethod
    def make_policy(cls) -> EvictionPolicy:
        return make_policy("lineage")


#: The policy adapters by kvpool policy name (the queue-informed ones need kvpool's scheduler: none here).
POLICY_CLASSES = {"s3fifo": KvpoolS3FIFO, "sieve": KvpoolSieve, "tlru": KvpoolTLRU, "lineage": KvpoolLineage,
                  "lru": KvpoolLRU, "fifo": KvpoolFIFO, "lfu": KvpoolLFU, "slru": KvpoolSLRU,
                  "priority": KvpoolPriority, "arc": KvpoolARC, "arc-vllm": KvpoolARCVllm}


# ---- the secondary tier -----------------------------------------------------------------------------


class _TierLookups(AsyncLookupManager):
    """vLLM's non-blocking lookup front end, asking the kvpool tier from its thread."""

    def __init__(self, tier: Any, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return [self._tier.exists([offload_tier_key(k)]) == 1 for k in keys]


class KvpoolTier(SecondaryTierManager):
    """A vLLM secondary tier over a kvpool :class:`~kvpool.tiers.file.FileTier` (``tier="disk"``) or
    :class:`~kvpool.tiers.redis.RedisTier` (``tier="redis"``), a block per primary-tier chunk.

    Stores and loads copy between the primary tier's memory and the kvpool tier on a worker thread
    (:class:`~kvpool.integrations.tier_jobs.TierJobs`); ``submit_store`` / ``submit_load`` only queue. A load
    that finds a block missing, corrupt, foreign or unreadable ends there: the blocks before it are reported
    loaded (``successful_keys``), the rest failed, so vLLM frees their primary chunks and recomputes them;
    a failed block is never reported loaded. A lookup asks the tier's index (disk: in memory) or, with
    ``async_lookup`` (the default for Redis), vLLM's ``AsyncLookupManager`` on its thread (RETRY until the
    answer is in; a completed store marks its keys present where vLLM has ``mark_present``, 0.34).

    With ``load_timeout_s`` (vLLM 0.34: ``JobResult.deferred_release``), a load not finished that many
    seconds after its submission is reported failed at once (vLLM recomputes its blocks), with an event
    set when the worker's I/O can no longer write its primary chunks; vLLM keeps the chunks out of its free
    pool until then, so a late write never lands in a chunk given to another block. Until then a lookup of
    the load's keys is a miss (a new promotion would queue behind the stalled read).

    Args (the tier's entry in ``secondary_tiers``, besides ``type`` and ``module_path``):
        tier: ``"disk"`` or ``"redis"``.
        model: the model's identity, part of the namespace (blocks of another model never match).
        directory, capacity_bytes: the disk tier's folder and bound (bytes, values with their headers).
        url, prefix, timeout_s, retry_s, ttl_s: the Redis tier's (:class:`~kvpool.tiers.redis.RedisTier`).
        auth_key: ``"public"`` to opt out of authenticated values; by default the fleet's secret comes from
            ``$KVPOOL_TIER_KEY`` (or ``$KVPOOL_HASH_SEED``), never from the configuration
            (:func:`~kvpool.integrations.tier_jobs.open_tier`).
        kv_dtype, tp_rank, tp_size: further namespace fields (default ``"vllm"``, 0, 1).
        async_lookup: look up on a thread (default: True for Redis, False for disk).
        load_timeout_s: seconds a load may take before it is reported failed (None: it is reported when its
            I/O ends; the only choice before vLLM 0.34).

    Raises:
        ConfigError: an unknown tier kind or a missing option (from the tier); ``load_timeout_s`` negative,
            or given to a vLLM without ``JobResult.deferred_release``.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str, *,
                 tier: str = "disk", model: str = "", directory: str | None = None,
                 capacity_bytes: int | None = None, url: str | None = None, prefix: str = "kvpool",
                 timeout_s: float = 2.0, retry_s: float = 1.0, ttl_s: int | None = None,
                 kv_dtype: str = "vllm", tp_rank: int = 0, tp_size: int = 1, async_lookup: bool | None = None,
                 backpressure_detector: Any = None, locality: str | None = None,
                 auth_key: str | None = None, load_timeout_s: float | None = None) -> None:
        if load_timeout_s is not None and not DEFERRED_RELEASE:
            raise ConfigError("load_timeout_s needs vLLM 0.34 or later (JobResult.deferred_release): "
                              "this vLLM frees a failed load's chunks at once, while its read could still "
                              "write them")
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        rows = torch.from_numpy(np.asarray(primary_kv_view)).view(torch.uint8)
        rows = rows.view(rows.shape[0], -1)
        namespace = Namespace(model, kv_dtype, f"vllm-offload-chunk/{rows.shape[1]}B", tp_rank, tp_size,
                              hash_scheme="vllm-offload-key")
        self.tier = open_tier(tier, namespace, rows.shape[1], directory=directory,
                              capacity_bytes=capacity_bytes, url=url, prefix=prefix, timeout_s=timeout_s,
                              retry_s=retry_s, ttl_s=ttl_s, auth_key=auth_key)
        self.jobs = TierJobs(self.tier, rows, name=f"kvpool-{tier_type}", load_timeout_s=load_timeout_s)
        self._keys: dict[int, list[OffloadKey]] = {}
        self._stalled: dict[OffloadKey, threading.Event] = {}  # keys of loads given up, until their read ends
        use_async = tier == "redis" if async_lookup is None else bool(async_lookup)
        self._lookups = _TierLookups(self.tier, tier_type) if use_async else None

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        stalled = self._stalled.get(key)
        if stalled is not None and not stalled.is_set():
            return LookupResult.MISS  # its last read is still stalled: another would wait behind it
        if self._lookups is not None:
            found = self._lookups.lookup(key, req_context)
            if found is None:
                return LookupResult.RETRY
        else:
            found = self.tier.exists([offload_tier_key(key)]) == 1
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._keys[job_metadata.job_id] = keys
        self.jobs.submit_store(job_metadata.job_id, [offload_tier_key(k) for k in keys],
                               job_metadata.chunk_ids.tolist())

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._keys[job_metadata.job_id] = keys
        self.jobs.submit_load(job_metadata.job_id, [offload_tier_key(k) for k in keys],
                              job_metadata.chunk_ids.tolist())

    def get_finished_jobs(self) -> Iterable[JobResult]:
        if self._stalled:
            self._stalled = {k: ev for k, ev in self._stalled.items() if not ev.is_set()}
        return [self._result(done) for done in self.jobs.finished()]

    def _result(self, done: JobDone) -> JobResult:
        keys = self._keys.pop(done.job_id)
        if done.ok or not done.is_load:
            if done.ok and not done.is_load and self._lookups is not None and LOOKUP_MARK_PRESENT:
                self._lookups.mark_present(keys)
            return JobResult(done.job_id, done.ok, transfer_time=done.seconds, transfer_bytes=done.nbytes)
        if self._lookups is not None:
            self._lookups.mark_miss(keys[done.moved:])
        held: dict[str, Any] = {}
        if done.released is not None:
            held["deferred_release"] = done.released
            self._stalled.update(dict.fromkeys(keys, done.released))
        return JobResult(done.job_id, False, successful_keys=tuple(keys[:done.moved]) or None,
                         transfer_time=done.seconds, transfer_bytes=done.nbytes, **held)

    def has_pending_work(self) -> bool:
        return self.jobs.pending > 0

    if TIER_TOUCH:
        def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
            """vLLM 0.33's recency call: the tier's LRU (disk) moves the keys to its tail. On 0.34 a load is
            the tier's only use of a block (the disk tier's ``get`` refreshes it)."""
            self.tier.refresh([offload_tier_key(k) for k in keys])

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self._lookups is not None:
            self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._lookups is not None:
            self._lookups.flush()

    def drain_jobs(self) -> None:
        self.jobs.drain()

    def shutdown(self) -> None:
        if self._lookups is not None:
            self._lookups.shutdown()
        self.jobs.close()

    def config_info(self) -> dict[str, Any]:
        return {}
