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

import logging
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

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
from kvpool.integrations.offload_policy import OffloadPolicy
from kvpool.integrations.vllm_tier import (  # noqa: F401 (the tier's names, re-exported: vLLM loads it from here)
    DEFERRED_RELEASE,
    LOOKUP_MARK_PRESENT,
    TIER_TOUCH,
    KvpoolTier,
)
from kvpool.numeric import as_int

logger = logging.getLogger(__name__)

#: The ``kv_transfer_params`` entry holding a request's retention priority.
PRIORITY_PARAM = "kvpool_priority"

#: vLLM's ``CachePolicy`` has ``touch`` (0.33, abstract; gone in 0.34, where ``on_request_finished`` is).
POLICY_TOUCH = hasattr(CachePolicy, "touch")


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
