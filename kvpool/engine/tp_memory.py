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
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from kvpool.errors import IntegrityError, KVPoolError
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
    try:
        result = getattr(cache, name[7:])(*args)
    except KVPoolError as exc:
        raise IntegrityError(f"rank {rank}: rank 0's {name} raised here ({exc}): the pages diverged") from exc
    if result != expected:
        raise IntegrityError(f"rank {rank}: {name} returned {result!r} where rank 0's returned {expected!r}")


def memory_digest(cache: Any) -> bytes:
    """32 bytes naming an elastic ``cache``'s live blocks and committed pages, after its own integrity check
    (IntegrityError); 32 zero bytes for a cache that is not elastic (or None)."""
    if cache is None or not cache.elastic:
        return bytes(32)
    cache.pages.check_integrity()
    state = (cache.live_blocks(), cache.pages.arena.committed_pages())
    return hashlib.sha256(repr(state).encode()).digest()
