"""The spec package: what memory a model needs, and how much of it a device gives.

Bottom up (a module imports only the ones before it): ``config_sizes`` (what a config's size may be),
``hf_layers`` (each layer's kind and shape in a config), ``hf_config`` (the KV fields of a Hugging Face
``config.json``, and the built-in configs), ``kinds`` (one class per kind of memory, the owner of its
rules: full attention, sliding window, chunked local, recurrent state), ``kv_dtypes`` (the KV cache dtype
names), ``kv_groups`` (the layer kinds and KV cache groups), ``kv`` (:class:`KVCacheSpec`: the shape and
bytes of one model's KV per rank), ``state`` (the
recurrent state of attention / recurrent hybrids), ``memory`` (:class:`ModelMemory`: all of a model's
memory, read once from its config), ``device_memory`` (readings of a live device), ``planner`` (memory
readings in, a :class:`PoolPlan` out) and
``state_planner`` (the same for a hybrid's KV and state). The names of the old module ``kvpool.spec``
are here as they were; the other public names are imported on first use.
"""

from __future__ import annotations

from kvpool._lazy import lazy_exports
from kvpool.spec.kv import (
    NO_FLOAT16_MODEL_TYPES,
    AttentionKind,
    KVCacheGroup,
    KVCacheSpec,
    LayerKind,
    LayerShape,
    auto_kv_dtype,
    cdiv,
    kv_cache_groups,
    parse_kv_dtype,
)

_LAZY = {
    "KV_DTYPES": "kvpool.spec.kv_dtypes",  # imports torch: made at first use
    "BUILTIN_CONFIGS": "kvpool.spec.hf_config",
    "load_config": "kvpool.spec.hf_config",
    "read_kv_fields": "kvpool.spec.hf_config",
    "HybridSpec": "kvpool.spec.state",
    "RecurrentStateSpec": "kvpool.spec.state",
    "RecurrentKind": "kvpool.spec.state",
    "LayerRole": "kvpool.spec.state",
    "ModelMemory": "kvpool.spec.memory",
    "MemoryKind": "kvpool.spec.kinds",
    "MemoryReadings": "kvpool.spec.device_memory",
    "PoolPlan": "kvpool.spec.planner",
    "plan_pool": "kvpool.spec.planner",
    "profile_cuda_memory": "kvpool.spec.device_memory",
    "plan_state_memory": "kvpool.spec.state_planner",
    "StatePlan": "kvpool.spec.state_planner",
}

__all__ = ["KV_DTYPES", "NO_FLOAT16_MODEL_TYPES", "AttentionKind", "KVCacheGroup", "KVCacheSpec", "LayerKind",
           "LayerShape", "auto_kv_dtype", "cdiv", "kv_cache_groups", "parse_kv_dtype", *_LAZY]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
