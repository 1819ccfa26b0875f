"""kvpool's secondary tier inside vLLM (tested with vLLM 0.33.0 and 0.34.0): :class:`KvpoolTier`, a
``SecondaryTierManager`` over kvpool's disk and Redis tiers, below the CPU primary of
``TieringOffloadingSpec`` (configured with ``"module_path": "kvpool.integrations.vllm"``, which re-exports
it; see :mod:`kvpool.integrations.vllm`). Imports vLLM: only vLLM's configuration loads this module.

The tier reads which interface the installed vLLM has from its base classes (:data:`TIER_TOUCH`,
:data:`DEFERRED_RELEASE`, :data:`LOOKUP_MARK_PRESENT`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Iterable
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
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvpool.errors import ConfigError
from kvpool.integrations.keys import offload_tier_key
from kvpool.integrations.tier_jobs import JobDone, TierJobs, open_tier
from kvpool.tiers.backend import Namespace

#: vLLM's ``SecondaryTierManager`` has ``touch`` (0.33; gone in 0.34).
TIER_TOUCH = hasattr(SecondaryTierManager, "touch")
#: vLLM's ``JobResult`` has ``deferred_release`` (0.34): a failed load may hold its primary chunks.
DEFERRED_RELEASE = "deferred_release" in {f.name for f in dataclasses.fields(JobResult)}
#: vLLM's ``AsyncLookupManager`` has ``mark_present`` (0.34): a completed store answers pending lookups.
LOOKUP_MARK_PRESENT = hasattr(AsyncLookupManager, "mark_present")


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
