"""kvpool: the memory layer under an LLM inference engine's KV cache.

Layers, bottom up (a module never imports one above it): the ground (errors, numbers, units, options),
events and model configs, the spec, the planner, the allocators, storage, the tiers, the request path, the
consumers (engine, trace, metrics, integrations), bench, and the command line. Each module's rank is in the
design page's table (docs/DESIGN.md, "Layers") and in tests/test_layers.py, which checks every import.
Public names are imported lazily, so ``import kvpool`` stays cheap and pulls in no optional dependency.
"""

from __future__ import annotations

from kvpool import _native
from kvpool._lazy import lazy_exports

_native.activate()  # compiled or interpreted hot modules: decided before any of them is imported

from kvpool.errors import (  # noqa: E402
    AsleepError,
    ConfigError,
    DoubleFreeError,
    DriverError,
    InsufficientMemoryError,
    IntegrityError,
    InvalidArgumentError,
    InvalidIdError,
    KVPoolError,
    MemoryLimitError,
    OutOfBlocksError,
    PinLimitError,
    TraceFormatError,
)
from kvpool.spec import AttentionKind, KVCacheGroup, KVCacheSpec, LayerKind, parse_kv_dtype  # noqa: E402

__version__ = "0.1.0"

_LAZY = {
    "MemoryReadings": "kvpool.spec.planner",
    "PoolPlan": "kvpool.spec.planner",
    "plan_pool": "kvpool.spec.planner",
    "profile_cuda_memory": "kvpool.spec.planner",
    "BlockPool": "kvpool.allocators.block_pool",
    "block_hashes": "kvpool.allocators.hashing",
    "hash_block": "kvpool.allocators.hashing",
    "BlockHasher": "kvpool.allocators.hashing",
    "TokenToKVPoolAllocator": "kvpool.allocators.token",
    "ReqToTokenPool": "kvpool.allocators.req_to_token",
    "KVCacheCoordinator": "kvpool.allocators.groups",
    "SWATokenToKVPoolAllocator": "kvpool.allocators.swa_token",
    "PagedKVCache": "kvpool.storage.paged",
    "slot_mapping": "kvpool.storage.paged",
    "MLAKVCache": "kvpool.storage.mla",
    "HostKVCache": "kvpool.storage.host",
    "PageArena": "kvpool.storage.arena",
    "ElasticConfig": "kvpool.storage.arena",
    "MemoryBudget": "kvpool.storage.arena",
    "LLMEngine": "kvpool.engine.engine",
    "SamplingParams": "kvpool.engine.sampling",
}

__all__ = [
    "AsleepError", "AttentionKind", "ConfigError", "DoubleFreeError", "DriverError",
    "InsufficientMemoryError", "IntegrityError", "InvalidArgumentError", "InvalidIdError", "KVCacheGroup",
    "KVCacheSpec", "KVPoolError", "LayerKind", "MemoryLimitError", "OutOfBlocksError", "PinLimitError",
    "TraceFormatError", "parse_kv_dtype", *_LAZY,
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
