"""What a replay on a model of an elastic pool records (``ReplayConfig(elastic_block_bytes=...)``, ``kvpool
replay --elastic``): the peak of the committed bytes (taken at every step), the committed bytes against the
used and cached blocks' bytes over simulated time (at the timeline's samples: the source design's
"utilization" knob, measured), and what is left after the cached blocks are evicted and their pages given
back (``LLMEngine.trim``).
"""

from __future__ import annotations

from typing import Any

from kvpool.requests.block_memory import PoolMemory

#: One sample: (simulated seconds, committed bytes, bytes of the blocks in use, bytes of the cached free
#: blocks).
MemorySample = tuple[float, int, int, int]


class CommittedTrack:
    """The committed bytes of ``memory`` (the replay's :class:`PoolMemory` over a
    :class:`~kvpool.storage.elastic.PageModel`) over a replay, blocks of ``block_bytes`` bytes; ``samples``
    only when ``record`` (the replay records a timeline)."""

    def __init__(self, memory: PoolMemory, block_bytes: int, record: bool) -> None:
        self.memory, self.block_bytes = memory, block_bytes
        self.peak = 0
        self.samples: list[MemorySample] | None = [] if record else None

    def count(self) -> None:
        """Take the peak (each step)."""
        self.peak = max(self.peak, self.memory.store.committed_bytes)

    def sample(self, now: float, pool: Any) -> None:
        """Record one :data:`MemorySample` of ``pool`` (the replay's BlockPool) at ``now``."""
        if self.samples is not None:
            cached = pool.num_evictable_blocks
            used = pool.num_used_blocks * self.block_bytes
            self.samples.append((now, self.memory.store.committed_bytes, used, cached * self.block_bytes))

    def report(self) -> dict[str, Any]:
        """``peak_committed_bytes``, ``final_committed_bytes`` (at the end: the cached blocks' pages),
        ``trimmed_committed_bytes`` (after evicting them page-aware and a trim: what ``LLMEngine.trim``
        does) and ``memory_timeline`` (the samples). Trims the model: call once, at the end."""
        memory = self.memory
        final = memory.store.committed_bytes
        memory.shrink()
        memory.store.trim()
        return {"peak_committed_bytes": max(self.peak, final), "final_committed_bytes": final,
                "trimmed_committed_bytes": memory.store.committed_bytes,
                "memory_timeline": self.samples or []}
