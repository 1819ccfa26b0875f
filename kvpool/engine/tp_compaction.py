"""Compaction under tensor parallelism: rank 0's block moves shipped to the other ranks in the pool log.

A compaction (:mod:`kvpool.requests.compaction`) moves live blocks off the emptiest pages of an elastic
KV cache into the holes of the fullest. Each rank holds its own shard of every block (its KV heads), so
every rank must make the same moves in its own pool and its own KV cache, in the same order. Rank 0
alone decides (:mod:`kvpool.engine.distributed`); its compaction's calls reach the log as the request
path's do: the commit of the destinations and the release of the sources (``memory.commit_blocks``,
``memory.release_blocks``: :mod:`kvpool.engine.tp_memory`), each ``move_block`` (the pool call, replayed
and its result compared: :mod:`kvpool.engine.pool_log`), the free stack's page order (``reorder_free``),
and the copy: :func:`record_moves` stands in front of rank 0's copy and appends it as ``(MOVE, (pairs,),
{}, None)``, after the commit and before the first ``move_block``, so a follower replaying the log copies
its own shard (:func:`apply_moves`: ``copy_blocks``) before its pool moves and its pages are released.
The followers keep no block tables (each step's tables come from rank 0), so no rename is shipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvpool.errors import IntegrityError, KVPoolError

#: The log record of one compaction's copy: ``(MOVE, (pairs,), {}, None)``, ``pairs`` a list of
#: ``(src, dst)`` block ids.
MOVE = "kv.copy_blocks"

BlockCopy = Callable[[list[tuple[int, int]]], object]


def record_moves(copy: BlockCopy, recorder: Any) -> BlockCopy:
    """``copy`` (rank 0's own: its cache's ``copy_blocks``), each call also appended to ``recorder.log`` (a
    :class:`~kvpool.engine.pool_log.RecordingPool`'s, read at each call: it is drained per message) once it
    returned (a copy that raises copied nothing and is not logged)."""

    def copy_and_record(pairs: list[tuple[int, int]]) -> None:
        copy(pairs)
        recorder.log.append((MOVE, ([(int(s), int(d)) for s, d in pairs],), {}, None))

    return copy_and_record


def has_moves(log: Sequence[tuple[str, tuple, dict[str, Any], Any]]) -> bool:
    """Whether rank 0's ``log`` holds a compaction's copy (a follower completes its tiers' jobs first, as
    rank 0 did before it planned the moves)."""
    return any(record[0] == MOVE for record in log)


def apply_moves(cache: Any, args: tuple, rank: int) -> None:
    """A follower's side of one :data:`MOVE` record: the same whole-block copies in this rank's KV
    ``cache`` (its shard, every layer).

    Raises:
        IntegrityError: this rank has no KV cache, or the copy is refused here (an id this rank's cache
            does not have: the ranks' caches differ).
    """
    if cache is None:
        raise IntegrityError(f"rank {rank}: rank 0 shipped a compaction's copy but this rank has no KV cache")
    (pairs,) = args
    try:
        cache.copy_blocks(pairs)
    except KVPoolError as exc:
        raise IntegrityError(f"rank {rank}: rank 0's compaction copy failed here ({exc})") from exc
