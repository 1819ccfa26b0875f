"""The physical KV tensors: the paged K/V cache, the MLA latent cache and the host tier with swapping."""

from kvpool.storage.host import HostKVCache
from kvpool.storage.mla import MLAKVCache
from kvpool.storage.paged import PagedKVCache, dequantize, slot_mapping

__all__ = ["HostKVCache", "MLAKVCache", "PagedKVCache", "dequantize", "slot_mapping"]
