"""kvpool's eviction policies and tiers inside real engines: vLLM's CPU offload tier and SGLang's HiCache.

Three plug points of the engines run in their scheduler process on host memory:

* :mod:`kvpool.integrations.vllm`: one vLLM ``CachePolicy`` per kvpool eviction policy (the CPU offload
  tier's order) and ``KvpoolTier``, a vLLM ``SecondaryTierManager`` over kvpool's disk and Redis tiers;
* :mod:`kvpool.integrations.sglang`: ``KvpoolHiCacheStorage``, an SGLang ``HiCacheStorage`` (L3) backend
  over the same tiers.

Those two modules import their engine at load (they subclass its classes), so only the engine imports them,
by the module path its configuration names. The logic underneath needs no engine and is tested without one:
:mod:`~kvpool.integrations.keys` (engine keys to tier keys, the one place they are mapped),
:mod:`~kvpool.integrations.offload_policy` (a kvpool policy keyed by the engine's keys),
:mod:`~kvpool.integrations.tier_jobs` (tier copies on a worker thread) and
:mod:`~kvpool.integrations.page_store` (SGLang's page calls over a tier). Nothing else in kvpool imports
this package, and kvpool never depends on vLLM or SGLang (kvpool's ``vllm`` and ``sglang`` extras name the
releases these adapters are tested against).
"""
