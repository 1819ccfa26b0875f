"""The physical KV tensors: the paged K/V cache, the MLA latent cache and the host tier with swapping.

The names are imported on first use (they import torch; a module of this package that holds no tensor, such
as the page model of a trace replay, imports none)."""

from kvpool._lazy import lazy_exports

_LAZY = {
    "HostKVCache": "kvpool.storage.host",
    "MLAKVCache": "kvpool.storage.mla",
    "PagedKVCache": "kvpool.storage.paged",
    "dequantize": "kvpool.storage.slots",
    "slot_mapping": "kvpool.storage.slots",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
