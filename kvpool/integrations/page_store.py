"""SGLang's page calls over kvpool tiers, without SGLang: one tier per host pool (its page bytes), pages keyed
by :func:`~kvpool.integrations.keys.page_tier_key`, and the per-pool hit rule of HiCache's hybrid (v2) calls.

A page is one row of ``page_bytes``; :meth:`PageStore.get` and :meth:`PageStore.set` move rows of a CPU
``uint8 [n, page_bytes]`` tensor, which the SGLang backend gathers from / scatters into its host pool (or
points straight at the host pool where a page's bytes are contiguous there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvpool.errors import InvalidArgumentError
from kvpool.integrations.keys import page_tier_key
from kvpool.tiers.backend import TierBackend

#: HiCache's per-pool hit rules (``PoolHitPolicy`` values).
ALL_PAGES, TRAILING_PAGES = "all_pages", "trailing_pages"


class PageStore:
    """Pages of SGLang's host pools in kvpool tiers, one tier per pool, opened by
    ``open_tier(pool_name, page_bytes)`` when the pool is attached."""

    def __init__(self, open_tier: Callable[[str, int], TierBackend]) -> None:
        self._open = open_tier
        self.tiers: dict[str, TierBackend] = {}

    def attach(self, pool: str, page_bytes: int) -> TierBackend:
        """The tier of ``pool`` (opened on first use; ``page_bytes`` must match after that).

        Raises:
            InvalidArgumentError: ``pool`` attached before with another page size.
        """
        tier = self.tiers.get(pool)
        if tier is None:
            tier = self.tiers[pool] = self._open(pool, page_bytes)
        elif tier.block_bytes != page_bytes:
            raise InvalidArgumentError(f"pool {pool!r} holds {tier.block_bytes}-byte pages, not {page_bytes}")
        return tier

    def exists(self, pool: str, keys: Sequence[str]) -> int:
        """How many leading pages of ``keys`` ``pool``'s tier holds (0 for a pool never attached)."""
        tier = self.tiers.get(pool)
        return tier.exists([page_tier_key(k) for k in keys]) if tier is not None and keys else 0

    def get(self, pool: str, keys: Sequence[str], rows: torch.Tensor) -> int:
        """Load the leading stored pages into ``rows[i]``; how many (each checked: a miss stops it)."""
        return self.tiers[pool].get([page_tier_key(k) for k in keys], rows) if keys else 0

    def set(self, pool: str, keys: Sequence[str], rows: torch.Tensor) -> list[bool]:
        """Store ``rows[i]`` under ``keys[i]``; per page, whether the tier holds it afterwards."""
        if not keys:
            return []
        tier = self.tiers[pool]
        names = [page_tier_key(k) for k in keys]
        if tier.set(names, rows) == len(names):
            return [True] * len(names)
        return [tier.exists([name]) == 1 for name in names]

    def clear(self) -> None:
        for tier in self.tiers.values():
            tier.clear()

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()


def hit_prefix(kv_pages: int, pools: Sequence[tuple[str, str, int]],
               has: Callable[[str, int], bool]) -> tuple[int, dict[str, int], list[int]]:
    """HiCache's v2 hit rule: the usable prefix when ``kv_pages`` leading KV pages are stored and each extra
    pool ``(name, rule, trailing)`` must hold, for a prefix of p pages, every page of [0, p) (``all_pages``)
    or its last ``trailing`` pages (``trailing_pages``); ``has(name, i)`` says whether page i of a pool is
    stored. Returns (pages usable, pages each pool covers, every usable prefix length). A pool with any
    other rule covers nothing (a miss, never a guess)."""
    restorable = list(range(1, kv_pages + 1))
    counts: dict[str, int] = {"kv": kv_pages} if kv_pages else {}
    for name, rule, trailing in pools:
        if not restorable:
            break
        if rule == ALL_PAGES:
            boundary = next((i for i in range(kv_pages) if not has(name, i)), kv_pages)
            ok = set(range(1, boundary + 1))
        elif rule == TRAILING_PAGES:
            span = max(1, trailing)
            ok = {p for p in range(1, kv_pages + 1) if all(has(name, i) for i in range(max(0, p - span), p))}
            boundary = max(ok, default=0)
        else:
            ok, boundary = set(), 0
        if boundary:
            counts[name] = boundary
        restorable = [p for p in restorable if p in ok]
    return (restorable[-1] if restorable else 0), counts, restorable
