"""The single-group tier API of :class:`~kvpool.tiers.manager.OffloadManager` (``lookup``,
``num_blocks_to_allocate``, ``acquire``, :class:`PrefixHit`, ``on_published``): deprecated. kvpool's
request path attaches tiers with ``KVCacheManager.attach_tiers`` and restores a hit for every KV cache group
with :meth:`~kvpool.tiers.manager.OffloadManager.probe` and
:meth:`~kvpool.tiers.manager.OffloadManager.restore`; these methods still work, each with a
``DeprecationWarning`` (the manager takes them from :class:`SingleGroupAPI`).
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.errors import InvalidArgumentError
from kvpool.tiers.loader import tier_code, tier_of

DEVICE = 0  # PrefixHit.where value of a device block; tier i of the manager is where == i + 1


#: Why :meth:`OffloadManager.lookup`, :meth:`~OffloadManager.num_blocks_to_allocate` and
#: :meth:`~OffloadManager.acquire` warn: kvpool's request path (every KV cache group) does not use them.
SINGLE_GROUP_DEPRECATED = ("OffloadManager.{name} (the single-group tier API: lookup, "
                           "num_blocks_to_allocate, acquire, PrefixHit) is deprecated: attach tiers with "
                           "KVCacheManager.attach_tiers and admit requests with KVCacheManager.admit, which "
                           "restore a hit from the tiers for every KV cache group")


def _single_group_deprecated(name: str) -> None:
    warnings.warn(SINGLE_GROUP_DEPRECATED.format(name=name), DeprecationWarning, stacklevel=3)


@dataclass
class PrefixHit:
    """Deprecated with :meth:`OffloadManager.lookup`, which returns it. The longest prefix of ``hashes``
    held somewhere: ``where[i]`` is 0 for the device (block ``device_ids[i]``) or ``t + 1`` for
    ``manager.tiers[t]`` (``device_ids[i]`` None)."""

    hashes: list[Hashable]
    where: list[int] = field(default_factory=list)
    device_ids: list[int | None] = field(default_factory=list)
    device_prefix: int = 0  # the leading blocks all on the device

    def __len__(self) -> int:
        return len(self.where)


class SingleGroupAPI:
    """The deprecated methods of :class:`~kvpool.tiers.manager.OffloadManager` for one sequence of hashes
    (a pool of one KV cache group), over its ``pool``, ``probe`` and ``restore``."""

    pool: Any
    device_hits: int
    _ops: int

    def lookup(self, hashes: Sequence[Hashable]) -> PrefixHit:
        """Deprecated (:data:`SINGLE_GROUP_DEPRECATED`). The longest prefix of ``hashes`` (group 0's keys:
        the hashes themselves) held on the device or in any tier. Counts the device pool's lookup stats;
        changes nothing else."""
        _single_group_deprecated("lookup")
        hashes = list(hashes)
        device = self.pool.lookup(hashes)
        hit = PrefixHit(hashes, [DEVICE] * len(device), list(device), len(device))
        locate = self.probe()
        for i in range(len(device), len(hashes)):
            where = locate(0, hashes, i)
            if where is None:
                break
            hit.where.append(DEVICE if where >= 0 else tier_of(where) + 1)
            hit.device_ids.append(where if where >= 0 else None)
        self._ops += min(len(hit) + 1, len(hashes))
        return hit

    def num_blocks_to_allocate(self, hit: PrefixHit, num_blocks: int) -> int:
        """Deprecated (:data:`SINGLE_GROUP_DEPRECATED`). Free device blocks taking ``hit`` plus ``num_blocks
        - len(hit)`` new blocks consumes: all but the device hits that are in use already (as
        :meth:`BlockPool.num_blocks_to_allocate`)."""
        _single_group_deprecated("num_blocks_to_allocate")
        ref = self.pool.ref_count
        return num_blocks - sum(1 for b in hit.device_ids if b is not None and ref(b) > 0)

    def acquire(self, hit: PrefixHit) -> list[int]:
        """Deprecated (:data:`SINGLE_GROUP_DEPRECATED`). Device blocks for ``hit``'s prefix, each with a
        reference held for the caller: the blocks found below are restored
        (:meth:`~kvpool.tiers.manager.OffloadManager.restore`), then the prefix on the device is touched.
        Returns the block ids of the prefix actually available (shorter than ``hit`` when a load failed).
        Raises :class:`OutOfBlocksError` (nothing changed) when the pool cannot give the new blocks: check
        :meth:`num_blocks_to_allocate` first; :class:`InvalidArgumentError` (nothing changed) for a stale
        hit, a device block of which no longer holds its hash (evicted, maybe handed to another request,
        since the lookup: look up again)."""
        _single_group_deprecated("acquire")
        cached = self.pool.get_cached_block
        for i, b in enumerate(hit.device_ids):
            if b is not None and cached(hit.hashes[i]) != b:
                raise InvalidArgumentError(f"stale prefix hit: device block {b} no longer holds the hash it "
                                           "was found under; look it up again")
        plan = [(h, b if b is not None else tier_code(w - 1))
                for h, b, w in zip(hit.hashes[:len(hit)], hit.device_ids, hit.where, strict=True)]
        self.restore(plan)
        ids = self._device_prefix(hit)
        self.pool.touch(ids)
        self.device_hits += sum(1 for w in hit.where[:len(ids)] if w == DEVICE)
        self._ops += len(ids)
        return ids

    def _device_prefix(self, hit: PrefixHit) -> list[int]:
        ids, cached = [], self.pool.get_cached_block
        for h in hit.hashes[:len(hit)]:
            b = cached(h)
            if b is None:
                break
            ids.append(b)
        return ids

    def on_published(self, block_ids: Sequence[int], hashes: Sequence[Hashable]) -> None:
        """Deprecated and a no-op: with write-through the manager listens to the pool's publishes itself
        (:meth:`BlockPool.set_publish_listener`), so every published block is stored once."""
        warnings.warn("OffloadManager.on_published is a no-op: with write_through the manager stores every "
                      "block the pool publishes", DeprecationWarning, stacklevel=2)
