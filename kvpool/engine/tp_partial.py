"""Partial hits under tensor parallelism: rank 0's token copies shipped to the other ranks in the pool log.

A prefix hit that ends inside a block copies the matched token slots of a cached block into the request's
fresh block (:mod:`kvpool.requests.partial_hits`). Each rank holds its own shard of every block (its KV
heads), so every rank must make the same copy in its own KV cache. Rank 0 alone decides which
(:mod:`kvpool.engine.distributed`): :func:`record_copies` stands in front of its copy and appends each one
to the pool's log as ``(COPY, (pairs, num_tokens), {}, None)``, between the pool calls that hold and release
the source (``touch`` then ``free``), so a follower replaying the log (:func:`kvpool.engine.pool_log.replay`)
copies in the same order, before the step that reads the copied slots: :func:`apply_copy`, the same
:func:`~kvpool.storage.block_copy.copy_token_prefix` on its own shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpool.errors import IntegrityError, KVPoolError
from kvpool.storage.block_copy import copy_token_prefix

#: The log record of one copy: ``(COPY, (pairs, num_tokens), {}, None)``, ``pairs`` a list of ``(src, dst)``.
COPY = "kv.copy_token_prefix"

TokenCopy = Callable[[list[tuple[int, int]], int], None]


def record_copies(copy: TokenCopy, recorder: Any) -> TokenCopy:
    """``copy`` (rank 0's own), each call also appended to ``recorder.log`` (a
    :class:`~kvpool.engine.pool_log.RecordingPool`'s, read at each call: it is drained per message) once it
    returned (a copy that raises copied nothing and is not logged)."""

    def copy_and_record(pairs: list[tuple[int, int]], num_tokens: int) -> None:
        copy(pairs, num_tokens)
        recorder.log.append((COPY, ([(int(s), int(d)) for s, d in pairs], int(num_tokens)), {}, None))

    return copy_and_record


def apply_copy(cache: Any, args: tuple, rank: int) -> None:
    """A follower's side of one :data:`COPY` record: the same copy in this rank's KV ``cache`` (its shard).

    Raises:
        IntegrityError: this rank has no KV cache, or the copy is refused here (an id or a token count this
            rank's cache does not have: the ranks' caches differ).
    """
    if cache is None:
        raise IntegrityError(f"rank {rank}: rank 0 shipped a partial-hit copy but this rank has no KV cache")
    pairs, num_tokens = args
    try:
        copy_token_prefix(cache, pairs, num_tokens)
    except KVPoolError as exc:
        raise IntegrityError(f"rank {rank}: rank 0's partial-hit copy failed here ({exc})") from exc
