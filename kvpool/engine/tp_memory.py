"""An elastic KV cache under tensor parallelism: every rank's shard on its own page arena, its pages
committed and released in step with rank 0's.

Rank 0 alone decides (:mod:`kvpool.engine.distributed`): its request path commits the pages under the
blocks it hands out and releases those of the blocks left holding no KV
(:class:`~kvpool.requests.block_memory.PoolMemory`), and puts the pool's free blocks in page-aware order
(``BlockPool.reorder_free``). The other ranks replay rank 0's pool calls, so they must replay these too,
in the same order between the pool calls: :class:`RecordingMemory` stands in front of rank 0's cache and
logs each ``commit_blocks`` / ``release_blocks`` / ``trim`` into the pool's log (as ``memory.<name>``),
and the pool's log holds ``reorder_free`` (its key is rank 0's; each follower orders by its own pages,
which the replayed commits keep identical). :func:`apply_memory_call` is a follower's side. Each rank's
shard has the same blocks and, with the KV heads split evenly, the same bytes a block, so the same pages
(a follower checks each call's result against rank 0's).

Three more things follow rank 0's: a restore from the tiers, where every rank loads into blocks it must
commit first as rank 0 did (:class:`LeadRestoreMemory` ships rank 0's commit mid-restore,
:class:`FollowRestoreMemory` applies it); the engine's ``sleep`` (every rank releases every page after
replaying rank 0's releases) and ``wake`` (:func:`wake_agreed`: every rank commits again, or none does).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from kvpool.engine.tp_group import follow_call
from kvpool.errors import InsufficientMemoryError, IntegrityError
from kvpool.requests.page_aware import order_free_blocks

#: The calls on rank 0's elastic cache that change its pages, logged for the followers.
MEMORY_CALLS = ("commit_blocks", "release_blocks", "trim")
REORDER = "reorder_free"


class RecordingMemory:
    """Rank 0's elastic cache, as :class:`PoolMemory` sees it: the calls of :data:`MEMORY_CALLS` are
    applied and, when they return, appended to ``recorder.log`` (a :class:`RecordingPool`'s, read at each
    call: it is drained per message); every read passes through."""

    def __init__(self, store: Any, recorder: Any) -> None:
        self.store, self.recorder = store, recorder

    def __getattr__(self, name: str) -> Any:
        if name in ("store", "recorder"):
            raise AttributeError(name)
        return getattr(self.store, name)

    def commit_blocks(self, block_ids: Iterable[int]) -> int:
        return self._call("commit_blocks", list(block_ids))

    def release_blocks(self, block_ids: Iterable[int]) -> int:
        return self._call("release_blocks", list(block_ids))

    def trim(self) -> int:
        return self._call("trim")

    def _call(self, name: str, *args: Any) -> int:
        result = getattr(self.store, name)(*args)
        self.recorder.log.append((f"memory.{name}", args, {}, result))
        return result


def is_memory_call(name: str) -> bool:
    """Whether a logged call is one of this module's (a follower applies it: :func:`apply_memory_call`)."""
    return name == REORDER or (name.startswith("memory.") and name[7:] in MEMORY_CALLS)


def apply_memory_call(pool: Any, cache: Any, name: str, args: tuple, expected: Any, rank: int) -> None:
    """Apply one logged call of rank 0's memory to this rank's ``cache`` (its elastic KV cache) and
    ``pool``; IntegrityError where this rank has no elastic cache, the call raises here, or its result
    differs from rank 0's."""
    if cache is None or not cache.elastic:
        raise IntegrityError(f"rank {rank}: rank 0 shipped {name} but this rank's KV cache is not elastic")
    if name == REORDER:
        order_free_blocks(pool, cache.pages)
        return
    follow_call(getattr(cache, name[7:]), name, args, {}, expected, rank, "pages")


def memory_digest(cache: Any) -> bytes:
    """32 bytes naming an elastic ``cache``'s live blocks and committed pages, after its own integrity check
    (IntegrityError); 32 zero bytes for a cache that is not elastic (or None)."""
    if cache is None or not cache.elastic:
        return bytes(32)
    cache.pages.check_integrity()
    state = (cache.live_blocks(), cache.pages.arena.committed_pages())
    return hashlib.sha256(repr(state).encode()).digest()


class LeadRestoreMemory:
    """Rank 0's :class:`~kvpool.requests.block_memory.PoolMemory` as a restore from the tiers sees it
    (``OffloadManager.memory``). Every rank runs the same restore on its own pool and tiers, and each must
    commit the blocks it loads into before it loads them, as rank 0 decided (its commit may have trimmed,
    evicted or been refused): so :meth:`handed_out` ships the memory calls it made at once, with its
    result, through ``send("commit", result)``; :meth:`emptied`'s calls go with the next message."""

    def __init__(self, memory: Any, send: Any) -> None:
        self.memory, self.send = memory, send

    def handed_out(self, tables: Any) -> bool:
        committed = self.memory.handed_out(tables)
        self.send("commit", committed)
        return committed

    def emptied(self, blocks: Iterable[int]) -> int:
        return self.memory.emptied(blocks)


class FollowRestoreMemory:
    """A follower's side of :class:`LeadRestoreMemory`: :meth:`handed_out` receives rank 0's ``commit``
    message (``receive()``: ``(kind, log, result)``), applies its log (``apply(log)``) and returns rank 0's
    result; :meth:`emptied` does nothing (rank 0's releases arrive in its next message's log)."""

    def __init__(self, receive: Any, apply: Any, rank: int) -> None:
        self.receive, self.apply, self.rank = receive, apply, rank

    def handed_out(self, tables: Any) -> bool:
        kind, log, committed = self.receive()
        if kind != "commit":
            raise IntegrityError(f"rank {self.rank}: rank 0 sent {kind!r} where a restore's commit was due")
        self.apply(log)
        return bool(committed)

    def emptied(self, blocks: Iterable[int]) -> int:
        return 0


def committed_bytes(runner: Any) -> int:
    """The bytes a runner's KV cache and recurrent states hold committed (a fixed cache: all of it)."""
    cache = runner.cache
    held = cache.nbytes if cache.committed_bytes is None else cache.committed_bytes
    return held + sum(state.committed_bytes or 0 for state in runner.recurrent.caches)


def wake_agreed(tp: Any, runner: Any) -> int:
    """Collective: every rank wakes its ``runner`` (:meth:`~kvpool.engine.runner.ModelRunner.wake`), and
    all of them stay awake only when all of them could (``min_int`` of each rank's success); otherwise the
    ranks that woke sleep again and every rank raises (its own error, or InsufficientMemoryError naming
    the other ranks). Returns this rank's bytes committed."""
    try:
        taken, error = runner.wake(), None
    except InsufficientMemoryError as exc:  # a MemoryLimitError too
        taken, error = 0, exc
    if tp.min_int(0 if error is not None else 1):
        return taken
    if error is not None:
        raise error
    runner.sleep()
    raise InsufficientMemoryError(f"rank {tp.rank} woke but another tensor-parallel rank could not commit "
                                  "its KV memory: every rank sleeps still")
