"""Allocators: bookkeeping of blocks, pages and slots (no KV tensors).

``BlockPool`` (block tables with prefix caching, vLLM / nano-vllm style), ``BlockHasher`` /
``block_hashes`` / ``hash_block`` (chained prefix hashes from a secret root), ``TokenToKVPoolAllocator``
(token slots or pages, SGLang style), ``ReqToTokenPool`` (request -> slot table), ``KVCacheCoordinator`` (a
block table per KV cache group of a hybrid model over one ``BlockPool``), ``SWATokenToKVPoolAllocator``
(full and sliding-window token slots), ``StatePool`` (the recurrent state slots of a hybrid model's requests)
and ``HybridReqToTokenPool`` (SGLang's request table with a state slot per request). Imported lazily, like
the package root.
"""

from __future__ import annotations

from kvpool._lazy import lazy_exports

_LAZY = {
    "BlockPool": "kvpool.allocators.block_pool",
    "BlockPoolStats": "kvpool.allocators.block_pool",
    "block_hashes": "kvpool.allocators.hashing",
    "hash_block": "kvpool.allocators.hashing",
    "BlockHasher": "kvpool.allocators.hashing",
    "block_extra_keys": "kvpool.allocators.hashing",
    "LoRAIdentity": "kvpool.allocators.hashing",
    "TokenToKVPoolAllocator": "kvpool.allocators.token",
    "ReqToTokenPool": "kvpool.allocators.req_to_token",
    "KVCacheCoordinator": "kvpool.allocators.groups",
    "CacheHit": "kvpool.allocators.groups",
    "group_key": "kvpool.allocators.groups",
    "SWATokenToKVPoolAllocator": "kvpool.allocators.swa_token",
    "StatePool": "kvpool.allocators.state_pool",
    "HybridReqToTokenPool": "kvpool.allocators.req_to_token",
}

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
