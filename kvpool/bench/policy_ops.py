"""A policy's own bookkeeping per evicted block, for ``kvpool bench alloc``: the calls a pool makes on its
:class:`~kvpool.allocators.policy_base.EvictionPolicy` over a cached block's life from its last free to
its eviction, timed on the policy alone.

``evicting allocate(1) [policy]`` times the pool's whole call: the argument check, the pool's eviction path
(the victim's hash dropped from the prefix index, the list handed back) and the policy's ``pop``; it leaves
out the policy's share of the free that made the block evictable (``released``, untimed in its setup). This
row times the policy's share of both ends and nothing of the pool's: ``released([b], [b], 0)`` for each of
``k`` published blocks (one free call each, as a request of one block), then ``k`` calls of ``pop``.
"""

from __future__ import annotations

from typing import Any

from kvpool.allocators.policies import make_policy
from kvpool.bench.timing import median_ns


def policy_cycle_ns(size: int, k: int, repeat: int, policy: str) -> float:
    """Median ns per block of ``released`` + ``pop`` on a ``policy`` bound to a pool of ``size`` blocks,
    over ``k`` published blocks (each freed alone, then all evicted)."""
    state: dict[str, Any] = {}

    def fresh() -> None:
        p = make_policy(policy)
        p.bind(size)
        for b in range(k):
            p.published(b, b)
        state["policy"], state["singles"] = p, [[b] for b in range(k)]

    def cycle() -> None:
        p = state["policy"]
        released, pop = p.released, p.pop
        for ids in state["singles"]:
            released(ids, ids, 0)
        for _ in range(k):
            pop()

    return median_ns(cycle, ops=k, repeat=repeat, setup=fresh)
