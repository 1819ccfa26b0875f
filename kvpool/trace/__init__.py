"""Real serving traces (Mooncake JSONL, Azure CSV) and their replay through the block pool.

``load_trace`` reads a trace (default: the shipped Mooncake conversation trace); ``run_replay`` runs it
through :class:`kvpool.allocators.block_pool.BlockPool` and returns a :class:`ReplayResult`.
"""

from kvpool.trace.loaders import Trace, TraceRequest, load_trace, shipped_trace_path
from kvpool.trace.replay import ReplayConfig, ReplayResult, run_replay

__all__ = [
    "ReplayConfig", "ReplayResult", "Trace", "TraceRequest", "load_trace", "run_replay", "shipped_trace_path",
]
