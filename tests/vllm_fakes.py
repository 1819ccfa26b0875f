"""Stand-ins for the vLLM classes kvpool.integrations.vllm subclasses and imports, as each release declares
them, for the default suite where vLLM is not installed (the real releases: tests/integrations).

Each fake has only what the module touches, with the abstract methods and the fields of the release's own
files (the wheels' ``vllm/v1/kv_offload/base.py``, ``cpu/policies/base.py``, ``tiering/base.py``,
``tiering/async_lookup.py``):

====================================  ===================================  =================================
                                      0.33.0                               0.34.0
====================================  ===================================  =================================
``CachePolicy`` abstract methods      get insert remove touch evict clear  get insert remove
                                                                           on_request_finished evict clear
``SecondaryTierManager.touch``        yes (a no-op)                        no
``JobResult.deferred_release``        no                                   ``threading.Event | None``
``AsyncLookupManager.mark_present``   no                                   yes
====================================  ===================================  =================================

:func:`installed` puts one release's modules in ``sys.modules`` and imports kvpool.integrations.vllm
against them.
"""

from __future__ import annotations

import enum
import importlib
import sys
import threading
import types
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

RELEASES = ("0.33.0", "0.34.0")
MODULES = ("vllm", "vllm.v1", "vllm.v1.kv_offload", "vllm.v1.kv_offload.base", "vllm.v1.kv_offload.cpu",
           "vllm.v1.kv_offload.cpu.policies", "vllm.v1.kv_offload.cpu.policies.base",
           "vllm.v1.kv_offload.tiering", "vllm.v1.kv_offload.tiering.async_lookup",
           "vllm.v1.kv_offload.tiering.base")


class LookupResult(enum.Enum):
    MISS = enum.auto()
    HIT = enum.auto()
    HIT_PENDING = enum.auto()
    RETRY = enum.auto()


class Medium(enum.Enum):
    CPU = enum.auto()
    STORAGE = enum.auto()


@dataclass
class ReqContext:
    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    positions: dict[bytes, int] = field(default_factory=dict)

    def get_offload_key_position(self, key: bytes) -> int | None:
        return self.positions.get(key)


class RequestOffloadingContext:
    pass


@dataclass
class ScheduleEndContext:
    new_req_ids: tuple = ()
    preempted_req_ids: tuple = ()


class ChunkStatus:
    """A chunk: ``ref_cnt`` -1 while being stored, then the readers in flight."""

    def __init__(self, chunk_id: int) -> None:
        self.ref_cnt, self.chunk_id = -1, chunk_id


def order_request_keys(key_groups: Sequence[Sequence[bytes]], req_context: ReqContext) -> list[bytes]:
    keys = [key for group in key_groups for key in group]
    positions = {k: p for k in keys if (p := req_context.get_offload_key_position(k)) is not None}
    if len(positions) == len(keys):
        keys.sort(key=positions.__getitem__)
    return keys


@dataclass
class TransferJob:
    job_id: int
    keys: Collection[bytes]
    chunk_ids: np.ndarray
    is_promotion: bool
    req_context: ReqContext


class _Policy(ABC):
    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity

    @abstractmethod
    def get(self, key): ...

    @abstractmethod
    def insert(self, key, chunk, req_context): ...

    @abstractmethod
    def remove(self, key): ...

    @abstractmethod
    def evict(self, n, protected): ...

    @abstractmethod
    def clear(self): ...

    def on_store_miss(self, keys, req_context) -> None:
        return

    def on_request_access(self, keys, req_context) -> None:
        return

    def mark_evictable(self, key) -> None:
        return

    def mark_non_evictable(self, key) -> None:
        return


class _Tier(ABC):
    medium: Any = None

    def __init__(self, offloading_spec, primary_kv_view, tier_type, backpressure_detector=None) -> None:
        self.tier_type = tier_type

    @abstractmethod
    def lookup(self, key, req_context): ...

    @abstractmethod
    def submit_store(self, job_metadata): ...

    @abstractmethod
    def submit_load(self, job_metadata): ...

    @abstractmethod
    def get_finished_jobs(self): ...

    @abstractmethod
    def on_new_request(self, req_context): ...

    @abstractmethod
    def drain_jobs(self): ...


class _Lookups(ABC):
    def __init__(self, tier_type: str) -> None:
        self.tier_type = tier_type

    @abstractmethod
    def batch_lookup(self, keys, req_context): ...


def release_classes(release: str) -> dict[str, type]:
    """``CachePolicy``, ``SecondaryTierManager``, ``JobResult`` and ``AsyncLookupManager`` of ``release``."""
    if release == "0.33.0":
        class CachePolicy(_Policy):
            @abstractmethod
            def touch(self, keys, req_context): ...

            def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context) -> None:
                for keys in key_groups:
                    self.touch(keys, req_context)

        class SecondaryTierManager(_Tier):
            def touch(self, keys, req_context) -> None:
                return

        @dataclass
        class JobResult:
            job_id: int
            success: bool
            successful_keys: Collection[bytes] | None = None
            transfer_time: float | None = None
            transfer_bytes: int | None = None

        class AsyncLookupManager(_Lookups):
            pass
    elif release == "0.34.0":
        class CachePolicy(_Policy):  # type: ignore[no-redef]
            @abstractmethod
            def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context): ...

        class SecondaryTierManager(_Tier):  # type: ignore[no-redef]
            pass

        @dataclass
        class JobResult:  # type: ignore[no-redef]
            job_id: int
            success: bool
            successful_keys: Collection[bytes] | None = None
            transfer_time: float | None = None
            transfer_bytes: int | None = None
            deferred_release: threading.Event | None = None

        class AsyncLookupManager(_Lookups):  # type: ignore[no-redef]
            def mark_present(self, keys) -> None:
                return
    else:
        raise ValueError(f"no fake of vLLM {release}")
    return {"CachePolicy": CachePolicy, "SecondaryTierManager": SecondaryTierManager, "JobResult": JobResult,
            "AsyncLookupManager": AsyncLookupManager}


#: kvpool's modules that import vLLM (each imported afresh against a fake release).
ADAPTERS = ("vllm_tier", "vllm")


def installed(release: str, monkeypatch) -> types.ModuleType:
    """kvpool.integrations.vllm imported afresh against the fake ``release`` (``monkeypatch`` restores
    ``sys.modules`` afterwards)."""
    classes = release_classes(release)
    contents = {
        "vllm.v1.kv_offload.base": {"LookupResult": LookupResult, "Medium": Medium, "OffloadKey": bytes,
                                    "ReqContext": ReqContext,
                                    "RequestOffloadingContext": RequestOffloadingContext,
                                    "ScheduleEndContext": ScheduleEndContext},
        "vllm.v1.kv_offload.cpu.policies.base": {"CachePolicy": classes["CachePolicy"],
                                                 "ChunkStatus": ChunkStatus,
                                                 "order_request_keys": order_request_keys},
        "vllm.v1.kv_offload.tiering.async_lookup": {"AsyncLookupManager": classes["AsyncLookupManager"]},
        "vllm.v1.kv_offload.tiering.base": {"JobResult": classes["JobResult"],
                                            "SecondaryTierManager": classes["SecondaryTierManager"],
                                            "TransferJob": TransferJob},
    }
    for name in MODULES:
        module = types.ModuleType(name)
        module.__dict__.update(contents.get(name, {}))
        monkeypatch.setitem(sys.modules, name, module)
    for adapter in ADAPTERS:
        monkeypatch.delitem(sys.modules, f"kvpool.integrations.{adapter}", raising=False)
        monkeypatch.setattr(importlib.import_module("kvpool.integrations"), adapter, None, raising=False)
    module = importlib.import_module("kvpool.integrations.vllm")
    for adapter in ADAPTERS:  # the next import sees the real vLLM again
        monkeypatch.delitem(sys.modules, f"kvpool.integrations.{adapter}")
    return module
