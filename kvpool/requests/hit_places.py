"""Where a prefix hit was found, and the counters of hits by place: :class:`PrefixCacheStats`, and how
:class:`~kvpool.requests.kv_manager.KVCacheManager` reads a probed hit (a
:class:`~kvpool.allocators.group_tables.CacheHit` whose codes below -1 name blocks held in a tier): whether it
needs a restore (:func:`held_below`), what to restore (:func:`restore_plan`) and where each hit block came
from (:func:`hit_places`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpool.allocators.groups import CacheHit, group_key

if TYPE_CHECKING:
    from kvpool.tiers.manager import OffloadManager

#: The place of a hit block found on the device (tiers' places are their media: ``host``, ``disk``, ...).
DEVICE = "device"


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters of admissions, in blocks of ``block_size`` tokens: ``requests`` admitted,
    ``queried_blocks`` (the blocks each admission could have hit: its full blocks of the first
    ``num_tokens - 1`` tokens), ``hit_blocks`` (the prefix found), split in ``by_place`` by where each hit
    block was found (``device``, then each tier's medium)."""

    requests: int = 0
    queried_blocks: int = 0
    hit_blocks: int = 0
    by_place: dict[str, int] = field(default_factory=lambda: {DEVICE: 0})

    def record(self, queried: int, places: dict[str, int]) -> None:
        self.requests += 1
        self.queried_blocks += queried
        for place, n in places.items():
            self.hit_blocks += n
            self.by_place[place] = self.by_place.get(place, 0) + n

    def places(self, tiers: OffloadManager | None) -> dict[str, int]:
        """Hit blocks by place: ``device``, then each medium of ``tiers``' chain (0 where none)."""
        places = {DEVICE: self.by_place.get(DEVICE, 0)}
        for tier in tiers.tiers if tiers is not None else ():
            places[tier.medium] = places.get(tier.medium, 0) + self.by_place.get(tier.medium, 0)
        return places


def held_below(hit: CacheHit) -> bool:
    """Whether a probed hit names blocks held in a tier (codes below -1)."""
    return any(b < -1 for blocks in hit.blocks for b in blocks)


def restore_plan(hit: CacheHit, null: int, num_groups: int
                 ) -> tuple[list[tuple[Hashable, int]], Hashable | None]:
    """``(key, where)`` of every block ``hit`` needs, position by position, every one of ``num_groups``
    groups at a position (``null``: the null block, needing nothing); and the hash before the first such
    position (None: position 0), the parent of what it restores."""
    plan = [(group_key(g, hit.block_hashes[i]), hit.blocks[g][i])
            for i in range(hit.num_blocks) for g in range(num_groups)
            if hit.blocks[g][i] != null]
    first = next((i for i in range(hit.num_blocks) if any(b[i] != null for b in hit.blocks)), 0)
    return plan, hit.block_hashes[first - 1] if first else None


def hit_places(hit: CacheHit, loaded: dict[Hashable, int], null: int, num_groups: int,
               tiers: OffloadManager | None) -> dict[str, int]:
    """Hit blocks by where they were found: a prefix position counts for the tier its first group's
    block came from (``loaded``: the keys a restore loaded, with the index of their tier in ``tiers``),
    else for the device."""
    if not loaded or tiers is None:
        return {DEVICE: hit.num_blocks}
    places = {DEVICE: 0}
    for i in range(hit.num_blocks):
        place = DEVICE
        for g in range(num_groups):
            if hit.blocks[g][i] != null:
                t = loaded.get(group_key(g, hit.block_hashes[i]))
                place = DEVICE if t is None else tiers.tiers[t].medium
                break
        places[place] = places.get(place, 0) + 1
    return places
