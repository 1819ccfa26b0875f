"""The request path: one :class:`Request`, the :class:`KVCacheManager` that runs its KV life on the pool,
and the :class:`Scheduler` that the engine and the trace replay both step."""

from kvpool.requests.kv_manager import KVCacheManager, PrefixCacheStats, blocks_needed
from kvpool.requests.request import Request, RequestStatus
from kvpool.requests.scheduler import Scheduler, SchedulerOutput

__all__ = ["KVCacheManager", "PrefixCacheStats", "Request", "RequestStatus", "Scheduler", "SchedulerOutput",
           "blocks_needed"]
