"""The BlockPool operations ``kvpool bench alloc`` times, each a function of the pool class it times, so that
one loop times this tree's pool in-process and another kvpool tree's pool in a subprocess
(``kvpool bench alloc --against PATH``: :mod:`kvpool.bench.against`).

Only the pool's public calls are used (``BlockPool(num_blocks, policy=...)``, ``allocate``, ``free``,
``touch``, ``cache_blocks``, ``num_evictable_blocks``), the ones every kvpool release has. This module imports
its sibling :mod:`kvpool.bench.timing` relatively and nothing else of kvpool: run on behalf of another tree
it is loaded from this tree's folder, while ``kvpool`` is that tree's (:data:`SIDE`).

Each timer returns the median ns per block over ``repeat`` runs (:func:`~kvpool.bench.timing.median_ns`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .timing import median_ns

#: The ops of :func:`rows`, as ``kvpool bench alloc`` names its rows (``{n}``: the block count of a call).
POOL_OPS = ("allocate (n={n})", "free (n={n})", "allocate({n})+free", "evicting allocate({n})")
POLICY_OPS = ("free(1) of a cached block [{p}]", "touch(1) on a cached free block [{p}]",
              "evicting allocate(1) [{p}]")


def alloc_free_ns(factory: Callable[[], Any], n: int, k: int, repeat: int) -> dict[str, float]:
    """Median ns per block of allocate(n) x k/n, then of freeing every chunk tail first; and their sum."""
    state: dict[str, Any] = {}

    def fresh() -> None:
        state["pool"], state["chunks"] = factory(), []

    def allocate() -> None:
        alloc = state["pool"].allocate
        state["chunks"] = [alloc(n) for _ in range(k // n)]

    def filled() -> None:
        fresh()
        allocate()
        state["chunks"] = [chunk[::-1] for chunk in state["chunks"]]

    def free() -> None:
        release = state["pool"].free
        for chunk in state["chunks"]:
            release(chunk)

    a = median_ns(allocate, ops=k, repeat=repeat, setup=fresh)
    f = median_ns(free, ops=k, repeat=repeat, setup=filled)
    return {"allocate": a, "free": f, "allocate+free": a + f}


def cached_free_ns(pool_cls: Callable[..., Any], size: int, k: int, repeat: int, policy: str = "lru"
                   ) -> float:
    """free([b]) of k published blocks, one per call (each becomes cached free: evictable)."""
    state: dict[str, Any] = {}

    def fill() -> None:
        pool = state["pool"] = pool_cls(size, policy=policy)
        blocks = pool.allocate(k)
        pool.cache_blocks(blocks, range(k))
        state["singles"] = [[b] for b in blocks]

    def free() -> None:
        release = state["pool"].free
        for ids in state["singles"]:
            release(ids)

    return median_ns(free, ops=k, repeat=repeat, setup=fill)


def touch_ns(pool_cls: Callable[..., Any], size: int, k: int, repeat: int, policy: str = "lru") -> float:
    """touch([b]) of k cached free blocks, one per call (a 1-block prefix hit revived from the LRU)."""
    pool = pool_cls(size, policy=policy)
    blocks = pool.allocate(k)
    pool.cache_blocks(blocks, range(k))
    singles = [[b] for b in blocks]

    def reset() -> None:
        if pool.num_evictable_blocks < k:
            pool.free(blocks)

    def touch() -> None:
        for ids in singles:
            pool.touch(ids)

    pool.free(blocks)
    return median_ns(touch, ops=k, repeat=repeat, setup=reset)


def evict_case(pool: Any, n: int, k: int, sink: Any = None) -> tuple[Callable[[], None], Callable[[], None]]:
    """(timed, setup) of allocate(n) x k/n on ``pool`` (fresh, more than k blocks) when the only free blocks
    are k cached ones (the rest of the pool is held); ``sink``: the pool's event sink, whose events the
    loop converts."""
    pool.allocate(pool.num_blocks - k)
    state: dict[str, list[list[int]]] = {"chunks": []}

    def fill_lru() -> None:
        for chunk in state["chunks"]:
            pool.free(chunk)
        blocks = pool.allocate(k)
        pool.cache_blocks(blocks, range(k))
        pool.free(blocks[::-1])
        if sink is not None:
            sink.take_events()  # the fill's events are not the timed loop's

    def allocate() -> None:
        state["chunks"] = [pool.allocate(n) for _ in range(k // n)]
        if sink is not None:
            sink.take_events()  # the loop's events, converted: part of what it costs

    return allocate, fill_lru


def evict_ns(pool_cls: Callable[..., Any], size: int, n: int, k: int, repeat: int, policy: str = "lru"
             ) -> float:
    """Median ns per block of :func:`evict_case` on a fresh pool of ``size`` blocks under ``policy``."""
    timed, setup = evict_case(pool_cls(size, policy=policy), n, k)
    return median_ns(timed, ops=k, repeat=repeat, setup=setup)


def rows(pool_cls: Callable[..., Any], policies: tuple[str, ...], sizes: list[int], ops: int, repeat: int
         ) -> dict[str, float]:
    """Every op of :data:`POOL_OPS` (n = 1 and 256) and of :data:`POLICY_OPS` (each of ``policies``) on
    pools of each of ``sizes``: ``"op @ size"`` -> median ns per block, for :mod:`kvpool.bench.against`."""
    out: dict[str, float] = {}
    for size in sizes:
        k = min(size, ops)
        for n in (1, 256):
            phases = alloc_free_ns(lambda size=size: pool_cls(size), n, k // n * n, repeat)
            for op, phase in zip(POOL_OPS, ("allocate", "free", "allocate+free"), strict=False):
                out[f"{op.format(n=n)} @ {size}"] = phases[phase]
            out[f"{POOL_OPS[3].format(n=n)} @ {size}"] = evict_ns(pool_cls, size, n, k // n * n, repeat)
        for policy in policies:
            free_op, touch_op, evict_op = (op.format(p=policy) for op in POLICY_OPS)
            out[f"{free_op} @ {size}"] = cached_free_ns(pool_cls, size, k, repeat, policy)
            out[f"{touch_op} @ {size}"] = touch_ns(pool_cls, size, k, repeat, policy)
            out[f"{evict_op} @ {size}"] = evict_ns(pool_cls, size, 1, k, repeat, policy)
    return out
