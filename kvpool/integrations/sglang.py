"""kvpool inside SGLang (tested with SGLang 0.5.23): ``KvpoolHiCacheStorage``, a HiCache L3 storage backend
(``sglang/srt/mem_cache/hicache_storage.py``, ``HiCacheStorage``) over kvpool's disk and Redis tiers.
Imports SGLang: only SGLang's backend factory loads this module::

    python -m sglang.launch_server ... --enable-hierarchical-cache --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvpool", "module_path":
        "kvpool.integrations.sglang", "class_name": "KvpoolHiCacheStorage", "interface_v1": 1,
        "tier": "disk", "directory": "/var/cache/kvpool", "capacity_bytes": 107374182400}'

(``"tier": "redis", "url": "redis://HOST:PORT"`` for Redis). ``interface_v1: 1`` makes HiCache call the
zero-copy pair ``batch_get_v1`` / ``batch_set_v1`` with host pool indices: a page whose bytes are contiguous
in the host pool (MLA, ``page_first``) moves straight between the pool and the tier; otherwise (MHA's K and
V halves) through one staging copy per batch. Without it HiCache uses ``batch_get`` / ``batch_set`` on its
own page tensors. Hybrid models (Mamba, SWA, DSA pools) use the v2 calls; each host pool gets its own tier
(its own page size), named in the namespace.

Keys: SGLang's page hash strings, mapped by :func:`kvpool.integrations.keys.page_tier_key`; the namespace
holds the model, the TP rank and size (MLA: rank 0 of 1, its KV being the same on every rank), the pool,
its dtype and page bytes, so pages of another model, rank, pool or layout never match. A page that is
missing, corrupt or unreadable is a miss (``False``), never wrong KV.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvpool.integrations.page_store import PageStore, hit_prefix
from kvpool.integrations.tier_jobs import open_tier
from kvpool.tiers.backend import Namespace, TierBackend

logger = logging.getLogger(__name__)

KV = str(PoolName.KV)
_TIER_OPTIONS = ("directory", "capacity_bytes", "url", "prefix", "timeout_s", "retry_s", "ttl_s", "auth_key")


class KvpoolHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage in a kvpool tier (``extra_config["tier"]``: ``"disk"`` or ``"redis"``, with
    that tier's options, as :func:`~kvpool.integrations.tier_jobs.open_tier` takes them).

    Raises:
        ConfigError: an unknown tier kind or a missing option.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.config = storage_config
        self.kind = extra.get("tier", "disk")
        self.options = {k: extra[k] for k in _TIER_OPTIONS if k in extra}
        mla = bool(storage_config.is_mla_model)
        self.tp = (0, 1) if mla else (storage_config.tp_rank, storage_config.tp_size)
        self.store = PageStore(self._open)
        self._dtypes: dict[str, str] = {}

    def _open(self, pool: str, page_bytes: int) -> TierBackend:
        c = self.config
        layout = f"sglang/{pool}/pp{c.pp_rank}of{c.pp_size}/{page_bytes}B"
        ns = Namespace(c.model_name or "", self._dtypes.get(pool, ""), layout, self.tp[0], self.tp[1],
                       hash_scheme="sglang-page-hash")
        return open_tier(self.kind, ns, page_bytes, **self.options)

    # ---- host pools -------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._attach(KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._attach(str(host_pool_name), host_pool)

    def _attach(self, pool: str, host_pool: Any) -> None:
        page = host_pool.get_dummy_flat_data_page()
        self._dtypes[pool] = str(page.dtype).removeprefix("torch.")
        self.store.attach(pool, page.numel() * page.element_size())

    def _host(self, pool: str) -> Any:
        return self.mem_pool_host if pool == KV else self.registered_pools[pool]

    def _page_bytes(self, pool: str) -> int:
        return self.store.tiers[pool].block_bytes

    # ---- zero copy (v1) and hybrid pools (v2) ------------------------------------------------------

    def _page_starts(self, host: Any, keys: list[str], host_indices: torch.Tensor) -> list[int] | None:
        page = getattr(host, "page_size", 1) or 1
        if host_indices.numel() != len(keys) * page:
            logger.error("kvpool HiCache: %d host indices for %d pages of %d", host_indices.numel(),
                         len(keys), page)
            return None
        return host_indices[::page].tolist()

    def _direct_rows(self, host: Any, starts: list[int]) -> torch.Tensor | None:
        """The host pool's own bytes of these pages as ``[n, page_bytes]`` rows, when they lie there
        contiguous and consecutive (no copy needed), else None."""
        pages = [host.get_data_page(s, flat=False) for s in starts]
        if not all(p.is_contiguous() for p in pages):
            return None
        first = pages[0].view(-1).view(torch.uint8)
        n, width = len(pages), first.numel()
        base = first.data_ptr()
        if any(p.data_ptr() != base + i * width for i, p in enumerate(pages)):
            return None
        return torch.as_strided(first, (n, width), (width, 1))

    def _get_pages(self, pool: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        host = self._host(pool)
        starts = self._page_starts(host, keys, host_indices)
        if starts is None or not keys:
            return [False] * len(keys)
        rows = self._direct_rows(host, starts)
        if rows is not None:
            got = self.store.get(pool, keys, rows)
        else:
            rows = torch.empty((len(keys), self._page_bytes(pool)), dtype=torch.uint8)
            got = self.store.get(pool, keys, rows)
            dtype = host.get_dummy_flat_data_page().dtype
            for i in range(got):
                host.set_from_flat_data_page(starts[i], rows[i].view(dtype))
        return [True] * got + [False] * (len(keys) - got)

    def _set_pages(self, pool: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        host = self._host(pool)
        starts = self._page_starts(host, keys, host_indices)
        if starts is None or not keys:
            return [False] * len(keys)
        rows = self._direct_rows(host, starts)
        if rows is None:
            rows = torch.stack([host.get_data_page(s, flat=True).contiguous().view(torch.uint8)
                                for s in starts])
        return self.store.set(pool, keys, rows)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._get_pages(KV, keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._set_pages(KV, keys, host_indices)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return {t.name: self._get_pages(str(t.name), list(t.keys or []), t.host_indices)
                if t.host_indices is not None else [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return {t.name: self._set_pages(str(t.name), list(t.keys or []), t.host_indices)
                if t.host_indices is not None else [False] * len(t.keys or []) for t in transfers}

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        kv_pages = self.store.exists(KV, keys)
        pools = [(str(t.name), str(t.hit_policy.value if hasattr(t.hit_policy, "value") else t.hit_policy),
                  len(t.keys or [])) for t in pool_transfers or []]

        def has(pool: str, i: int) -> bool:
            return self.store.exists(pool, [keys[i]]) == 1

        final, counts, restorable = hit_prefix(kv_pages, pools, has)
        counts = {(PoolName.KV if k == "kv" else k): v for k, v in counts.items()}
        return PoolTransferResult(final, counts, restorable)

    # ---- the generic page calls ---------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.store.exists(KV, [key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self.store.exists(KV, keys)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        if target_location is None or KV not in self.store.tiers:
            return None
        out = target_location if target_location.is_contiguous() else target_location.contiguous()
        row = out.view(-1).view(torch.uint8).view(1, -1)
        if row.shape[1] != self._page_bytes(KV) or self.store.get(KV, [key], row) != 1:
            return None
        if out is not target_location:
            target_location.copy_(out)
        return target_location

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        locations = target_locations or [None] * len(keys)
        return [self.get(k, loc) for k, loc in zip(keys, locations, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        if value is None or KV not in self.store.tiers:
            return False
        row = value.contiguous().view(-1).view(torch.uint8).view(1, -1)
        return row.shape[1] == self._page_bytes(KV) and self.store.set(KV, [key], row) == [True]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return all(self.set(k, v) for k, v in zip(keys, values or [], strict=True))

    def clear(self) -> bool:
        self.store.clear()
        return True

    def close(self) -> None:
        self.store.close()

    def get_stats(self) -> None:
        return None  # HiCache's storage metrics are its own type; each tier counts its own: tier.stats()
