"""Rank 0's pool calls, logged and replayed on the other tensor-parallel ranks: :class:`RecordingPool` (rank
0's ``BlockPool`` with a log of every call that changes it), :func:`replay` (a follower applies the log and
compares each result), and the checks that the ranks' pools agree (:func:`check_batch_blocks`,
:func:`pool_digest`, :func:`check_across_ranks`). :mod:`kvpool.engine.distributed` ships the log.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from kvpool.engine.tp_compaction import MOVE, apply_moves
from kvpool.engine.tp_group import TPGroup, follow_call
from kvpool.engine.tp_memory import REORDER, apply_memory_call, is_memory_call, memory_digest
from kvpool.engine.tp_partial import COPY, apply_copy
from kvpool.engine.tp_state import apply_state_call, is_state_call, state_digest
from kvpool.errors import IntegrityError
from kvpool.requests.no_state import NO_STATE, StateSide
from kvpool.spec import cdiv

_RECORDED = ("allocate", "free", "touch", "cache_blocks", "lookup", "evict_blocks", "reset_prefix_cache",
             "pin", "pin_prefix", "unpin", "move_block")


class RecordingPool:
    """Rank 0's ``BlockPool`` with a log of every call that changes it, for the followers to replay.

    The calls of :data:`_RECORDED` go to the pool and, when they return, are logged as ``(name, args,
    kwargs, result)`` (one that raises changed nothing, so nothing is logged; iterables are logged as
    lists); everything else (reads, counters) passes straight through. :meth:`check_integrity` is the
    cross-rank check: it calls ``on_check``.
    """

    def __init__(self, pool: Any, on_check: Callable[[], None]) -> None:
        self.pool = pool
        self.log: list[tuple[str, tuple, dict[str, Any], Any]] = []
        self._on_check = on_check

    def __getattr__(self, name: str) -> Any:  # reads only: every recorded call is defined below
        if name == "pool":  # not set yet (unpickling, copying): no recursion
            raise AttributeError(name)
        return getattr(self.pool, name)

    def drain(self) -> list[tuple[str, tuple, dict[str, Any], Any]]:
        log, self.log = self.log, []
        return log

    def allocate(self, n: int) -> list[int]:
        return self._call("allocate", n)

    def free(self, block_ids: Iterable[int], *args: Any, **kwargs: Any) -> None:
        self._call("free", list(block_ids), *args, **kwargs)

    def touch(self, block_ids: Iterable[int]) -> None:
        self._call("touch", list(block_ids))

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[Hashable], **kwargs: Any) -> None:
        self._call("cache_blocks", list(block_ids), list(block_hashes), **kwargs)

    def lookup(self, block_hashes: Iterable[Hashable]) -> list[int]:
        return self._call("lookup", list(block_hashes))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self._call("evict_blocks", list(block_ids))

    def reset_prefix_cache(self) -> bool:
        return self._call("reset_prefix_cache")

    def pin(self, block_ids: Iterable[int]) -> None:
        self._call("pin", list(block_ids))

    def pin_prefix(self, block_hashes: Sequence[Hashable]) -> list[int]:
        return self._call("pin_prefix", list(block_hashes))

    def unpin(self, block_ids: Iterable[int]) -> None:
        self._call("unpin", list(block_ids))

    def move_block(self, src: int, dst: int) -> None:  # a compaction: tp_compaction
        self._call("move_block", int(src), int(dst))

    def reorder_free(self, key: Callable[[int], Any]) -> None:  # an elastic pool's page order: tp_memory
        self.pool.reorder_free(key)
        self.log.append((REORDER, (), {}, None))

    def check_integrity(self) -> None:
        """Check every rank's pool and that all of them hold the same state (a collective)."""
        self._on_check()

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.pool, name)(*args, **kwargs)
        self.log.append((name, args, kwargs, result))
        return result


def replay(pool: Any, log: Sequence[tuple[str, tuple, dict[str, Any], Any]], rank: int,
           cache: Any = None, states: Any = None) -> None:
    """Apply rank 0's logged pool calls to ``pool`` (its memory calls and partial-hit copies to this rank's
    ``cache``: :mod:`kvpool.engine.tp_memory`, :mod:`kvpool.engine.tp_partial`; its state slot calls to this
    rank's ``states``: :mod:`kvpool.engine.tp_state`); IntegrityError at the first result that differs."""
    for name, args, kwargs, expected in log:
        if is_memory_call(name):
            apply_memory_call(pool, cache, name, args, expected, rank)
            continue
        if is_state_call(name):
            apply_state_call(states, name, args, expected, rank)
            continue
        if name == COPY:
            apply_copy(cache, args, rank)
            continue
        if name == MOVE:
            apply_moves(cache, args, rank)
            continue
        if name not in _RECORDED:
            raise IntegrityError(f"rank {rank}: rank 0 shipped an unknown pool call {name!r}")
        follow_call(getattr(pool, name), name, args, kwargs, expected, rank, "pools")


def check_batch_blocks(pool: Any, spans: Iterable[tuple[Sequence[list[int]], int, int]], block_size: int,
                       rank: int) -> None:
    """Every block a step writes (tokens ``start .. end - 1`` of each span, in each group's table) is in use
    in ``pool``."""
    for tables, start, end in spans:
        for table in tables:
            for block in table[start // block_size:cdiv(end, block_size)]:
                if pool.ref_count(block) == 0:
                    raise IntegrityError(f"rank {rank}: the step writes KV into block {block}, which this "
                                         f"rank's pool holds free")


def pool_digest(pool: Any) -> bytes:
    """SHA-256 of a ``BlockPool``'s state as its public reads show it: every block's ref count and hash, the
    eviction order of the cached free blocks, the pins and the prefix-cache counters. O(num_blocks)."""
    n = pool.num_blocks
    state = ([pool.ref_count(b) for b in range(n)], [pool.block_hash(b) for b in range(n)],
             pool.evictable_blocks(), sorted(pool.pinned_blocks().items()), pool.num_free_blocks,
             repr(pool.stats))
    return hashlib.sha256(repr(state).encode()).digest()


def check_across_ranks(tp: TPGroup, pool: Any, cache: Any = None, states: StateSide = NO_STATE) -> None:
    """Collective: ``pool.check_integrity()`` on every rank, then the ranks' :func:`pool_digest` compared
    (with their elastic caches' pages and their state slots: ``states``, the engine's state side, a
    hybrid's ``RequestStates``).

    Raises:
        IntegrityError: this rank's invariants are broken, or (on every rank) the digests differ.
    """
    broken: IntegrityError | None = None
    try:
        pool.check_integrity()
        digest = pool_digest(pool) + memory_digest(cache) + state_digest(states)
    except IntegrityError as exc:
        broken, digest = exc, bytes(96)  # still take part, so no rank waits for this one
    digests = tp.all_gather_bytes(digest)
    if broken is not None:
        raise broken
    if len(set(digests)) > 1:
        found = ", ".join(f"rank {r}: {d.hex()[:16]}/{d.hex()[64:80]}" for r, d in enumerate(digests))
        raise IntegrityError(f"the pool state differs across tensor-parallel ranks ({found})")
