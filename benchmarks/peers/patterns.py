"""The operation patterns every side of the peer comparison times, in one place (stdlib only: the peers'
venvs import it too, kvpool is not installed there).

Each pattern takes the operations as callables, so kvpool, vLLM and SGLang run the same loop and only
the calls differ. Times are medians over ``repeat`` runs with the cycle collector off, in ns per block
(or per alloc + free pair), each run on a fresh pool built outside the timed region.

A side script times its rows once per line it reads on stdin and answers each with one JSON line
(:func:`serve`), so the runner (``kvpool.bench.peers``: ``kvpool bench alloc``, ``compare.py``) starts every
side once and alternates them round by round; run by hand on a terminal, it times one round.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

#: Pool sizes and counts of the patterns (the same for every side).
BLOCKS = 32_768       # block pools: blocks handed out per run (vLLM's pool gets one more, its null block)
SLOTS = 65_536        # token allocators: slots in the pool
PAIRS = 2_048         # token allocators: alloc + free pairs per run
PAGE = 16             # paged token allocator: tokens per page
HASH_TOKENS = 4_096   # block hashing: tokens per sequence, hashed in blocks of HASH_BLOCK
HASH_BLOCK = 16
REPEAT = int(os.environ.get("PEER_REPEAT", "5"))  # compare.py --repeat


def _median(run: Callable[[], float], repeat: int) -> float:
    gc.collect()
    gc.disable()
    try:
        return statistics.median(run() for _ in range(repeat))
    finally:
        gc.enable()


def alloc_free_per_block(make_pool: Callable[[], Any], alloc: Callable[[Any, int], list],
                         free: Callable[[Any, list], None], n: int, repeat: int = REPEAT) -> float:
    """ns per block of: allocate ``n`` blocks per call until ``BLOCKS`` are out, then free each chunk
    tail first (vLLM's free order), timed together."""
    def run() -> float:
        pool = make_pool()
        start = time.perf_counter_ns()
        chunks = [alloc(pool, n) for _ in range(BLOCKS // n)]
        for chunk in chunks:
            free(pool, chunk)
        return (time.perf_counter_ns() - start) / BLOCKS

    return _median(run, repeat)


def evicting_alloc_per_block(make_cached_pool: Callable[[], Any], alloc: Callable[[Any, int], list], n: int,
                             repeat: int = REPEAT) -> float:
    """ns per block of: allocate ``n`` blocks per call until ``BLOCKS`` are out of a pool whose free blocks
    are all cached (``make_cached_pool``: every block published under its own hash, then freed), so every
    block handed out is first evicted, its hash dropped from the prefix index."""
    def run() -> float:
        pool = make_cached_pool()
        start = time.perf_counter_ns()
        for _ in range(BLOCKS // n):
            alloc(pool, n)
        return (time.perf_counter_ns() - start) / BLOCKS

    return _median(run, repeat)


def hash_per_block(hash_sequence: Callable[[list[int]], list], repeat: int = REPEAT) -> float:
    """ns per block of chaining the hashes of a ``HASH_TOKENS``-token sequence (fixed pseudo-random token ids)
    in blocks of ``HASH_BLOCK`` tokens; ``hash_sequence(tokens)`` returns one hash per full block."""
    tokens = [(i * 2_654_435_761) % 152_000 for i in range(HASH_TOKENS)]

    def run() -> float:
        start = time.perf_counter_ns()
        hashes = hash_sequence(tokens)
        elapsed = time.perf_counter_ns() - start
        assert len(hashes) == HASH_TOKENS // HASH_BLOCK
        return elapsed / len(hashes)

    return _median(run, repeat)


def pairs_per_pair(make_allocator: Callable[[], Any], alloc: Callable[[Any], Any],
                   free: Callable[[Any, Any], None], repeat: int = REPEAT) -> float:
    """ns per pair of: ``PAIRS`` allocations, then each one freed (SGLang's own benchmark pattern), on an
    allocator whose first pass over its memory is done before the timed pass."""
    def run() -> float:
        allocator = make_allocator()
        for handle in [alloc(allocator) for _ in range(PAIRS)]:  # warm: first touch of the memory
            free(allocator, handle)
        start = time.perf_counter_ns()
        handles = [alloc(allocator) for _ in range(PAIRS)]
        for handle in handles:
            free(allocator, handle)
        return (time.perf_counter_ns() - start) / PAIRS

    return _median(run, repeat)


def report(side: str, version: str, rows: dict[str, float], **extra: str) -> None:
    """One JSON line on stdout: what the comparison reads back."""
    json.dump({"side": side, "version": version, "ns": rows, **extra}, sys.stdout)
    print(flush=True)


def serve(side: str, version: str, rows: Callable[[], dict[str, float]], **extra: str) -> None:
    """Time ``rows()`` and :func:`report` it once per line read on stdin, until stdin closes (once when it
    is a terminal): the runner's rounds, the imports done once."""
    if sys.stdin.isatty():
        report(side, version, rows(), **extra)
        return
    for _ in sys.stdin:
        report(side, version, rows(), **extra)
