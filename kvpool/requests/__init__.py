"""The request path: one :class:`Request`, the :class:`KVCacheManager` that runs its KV life on the pool,
and the :class:`Scheduler` that the engine and the trace replay both step; for a recurrent hybrid, the
:class:`RequestStates` beside the KV (state slots, :class:`StateCheckpoints` under a :class:`SavePolicy`)."""

from kvpool.requests.kv_manager import KVCacheManager, PrefixCacheStats, blocks_needed
from kvpool.requests.request import Request, RequestStatus
from kvpool.requests.scheduler import Scheduler, SchedulerOutput
from kvpool.requests.state_checkpoints import RequestStates, SavePolicy, StateCheckpoints

__all__ = ["KVCacheManager", "PrefixCacheStats", "Request", "RequestStates", "RequestStatus", "SavePolicy",
           "Scheduler", "SchedulerOutput", "StateCheckpoints", "blocks_needed"]
