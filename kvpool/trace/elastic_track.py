"""What a replay on a model of an elastic pool records (``ReplayConfig(elastic_block_bytes=...)``, ``kvpool
replay --elastic``): the peak of the committed bytes (taken at every step), the committed bytes against the
used and cached blocks' bytes over simulated time (at the timeline's samples: the source design's
"utilization" knob, measured), what is left after the cached blocks are evicted and their pages given
back (``LLMEngine.trim``), and the compactions run after each step (``ReplayConfig.elastic_compact``,
:mod:`kvpool.requests.compaction`): the blocks they moved and the time they took.
"""

from __future__ import annotations

from typing import Any

from kvpool.requests.block_memory import PoolMemory
from kvpool.requests.compaction import Compactor

#: One sample: (simulated seconds, committed bytes, bytes of the blocks in use, bytes of the cached free
#: blocks).
MemorySample = tuple[float, int, int, int]


class CommittedTrack:
    """The committed bytes of ``memory`` (the replay's :class:`PoolMemory` over a
    :class:`~kvpool.storage.elastic.PageModel`) over a replay, blocks of ``block_bytes`` bytes; ``samples``
    only when ``record`` (the replay records a timeline); ``compactor``: the pool's (None: no
    compaction)."""

    def __init__(self, memory: PoolMemory, block_bytes: int, record: bool,
                 compactor: Compactor | None = None) -> None:
        self.memory, self.block_bytes, self.compactor = memory, block_bytes, compactor
        self.peak = 0
        self.samples: list[MemorySample] | None = [] if record else None

    def compact(self) -> None:
        """Compact the pool if due (after each step's update, where the engine runs its compactor)."""
        if self.compactor is not None:
            self.compactor.compact()

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
        does), ``blocks_moved`` and ``compaction_s`` (the compactions' blocks and seconds) and
        ``memory_timeline`` (the samples). Trims the model: call once, at the end."""
        memory = self.memory
        final = memory.store.committed_bytes
        memory.shrink()
        memory.store.trim()
        return {"peak_committed_bytes": max(self.peak, final), "final_committed_bytes": final,
                "trimmed_committed_bytes": memory.store.committed_bytes,
                "blocks_moved": 0 if self.compactor is None else self.compactor.stats.moved,
                "compaction_s": 0.0 if self.compactor is None else self.compactor.stats.seconds,
                "memory_timeline": self.samples or []}
