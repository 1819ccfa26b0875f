"""Tiers under the device pool: storage backends keyed by block hash and the offload manager chaining them.

``TierBackend`` (the interface, :mod:`kvpool.tiers.backend`), ``HostTier`` (CPU memory, the existing
``HostKVCache``), ``FileTier`` (a directory), ``RedisTier`` (a Redis server or cluster; needs redis-py),
``OffloadManager`` (device -> host -> disk -> remote), ``TierKey`` (the fleet secret that authenticates
disk and Redis values, :mod:`kvpool.tiers.auth`). Imported lazily; kvpool's ``tiers`` extra brings
redis-py, xxhash and blake3.
"""

from __future__ import annotations

from kvpool._lazy import lazy_exports

_LAZY = {
    "Namespace": "kvpool.tiers.backend",
    "TierBackend": "kvpool.tiers.backend",
    "TierStats": "kvpool.tiers.backend",
    "weights_fingerprint": "kvpool.tiers.backend",
    "config_fingerprint": "kvpool.tiers.backend",
    "TierKey": "kvpool.tiers.auth",
    "HostTier": "kvpool.tiers.host",
    "FileTier": "kvpool.tiers.file",
    "RedisTier": "kvpool.tiers.redis",
    "OffloadManager": "kvpool.tiers.manager",
    "PrefixHit": "kvpool.tiers.single_group",
}

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
