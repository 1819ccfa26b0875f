"""``PartialIndex``: prefix matching finer than a block, the bookkeeping of a hit that ends inside a block.

A **match unit** is ``U`` tokens, a divisor of the block size ``B`` (``m = B / U`` units per block). Besides
its chained block hashes, a request has chained **unit hashes**, one per full unit of its tokens, hashed as
the block hashes are (a unit hash names its whole prefix: the same unit hash means the same tokens from the
first one on). The block hash stays what it is, so the pool, its KV events and the tiers still see one hash
per full block; this index only says, for a unit hash, which cached full block holds that unit, so that a
request whose longest cached prefix ends inside a block can copy the matched units out of it
(copy-on-partial-reuse: TensorRT-LLM's ``enable_partial_reuse`` / ``copy_on_partial_reuse``, vLLM's
``prefix_match_unit``).

The index maps each of a published block's first ``m - 1`` unit hashes to the **block hash** of the block
(its last unit ends with the block: a match there is a full-block hit). It is content-addressed: any device
block holding that block hash holds those units, so an entry is never wrong, only possibly not cached any
more; the caller checks the block hash in the pool's prefix index. Entries whose block left the pool are
dropped when a lookup finds them so, and in one sweep whenever the index holds more than twice ``capacity``
entries (amortized O(1) per registration). Memory: one dict entry per unit (about 200 bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from kvpool.errors import ConfigError
from kvpool.numeric import as_int


def check_match_unit(match_unit: object, block_size: int) -> int:
    """``match_unit`` as an int: tokens per unit, an integer in ``[1, block_size]`` that divides
    ``block_size``. Raises :class:`ConfigError` otherwise: 0, a negative, a bool, a float, a string, or a
    non-divisor."""
    unit = as_int(match_unit, "match_unit", minimum=1, error=ConfigError)
    if unit > block_size or block_size % unit:
        raise ConfigError(f"match_unit must divide the block size {block_size}, got {unit}")
    return unit


class PartialIndex:
    """Unit hash -> the block hash of a cached full block that holds that unit (see the module docstring).

    Args:
        units_per_block: ``m = block_size / match_unit`` (>= 2 for the index to hold anything).
        capacity: the entries the caller expects live at once (e.g. ``num_blocks * (m - 1)``): a sweep runs
            when the index holds more than twice that.
    """

    def __init__(self, units_per_block: int, capacity: int) -> None:
        self.units_per_block = as_int(units_per_block, "units_per_block", minimum=1)
        self.capacity = max(1024, as_int(capacity, "capacity", minimum=0))
        self._block_of: dict[Hashable, Hashable] = {}
        self.sweeps = 0

    def __len__(self) -> int:
        return len(self._block_of)

    def register(self, unit_hashes: Sequence[Hashable], block_hashes: Sequence[Hashable], first: int,
                 cached: Callable[[Hashable], bool]) -> None:
        """Index the units of full blocks ``first, first + 1, ...`` (one per hash of ``block_hashes``, the
        request's block hashes from block ``first`` on): block ``i``'s units are ``unit_hashes[i * m : (i +
        1) * m - 1]`` (``unit_hashes`` is the request's whole list; blocks it does not cover are skipped).
        ``cached(block_hash)`` says whether a block hash is still in the pool (the sweep asks it)."""
        m, out = self.units_per_block, self._block_of
        if m < 2:
            return
        for j, block_hash in enumerate(block_hashes):
            start = (first + j) * m
            if start + m - 1 > len(unit_hashes):
                break
            for u in unit_hashes[start:start + m - 1]:
                out[u] = block_hash
        if len(out) > 2 * self.capacity:
            self.sweep(cached)
            self.capacity = max(self.capacity, len(out))  # all live: sweep again only once it doubles

    def longest(self, unit_hashes: Sequence[Hashable], block: int, max_units: int,
                cached: Callable[[Hashable], bool]) -> tuple[int, Hashable | None]:
        """``(k, block hash)``: the most leading units ``k`` (``0 <= k <= min(max_units, m - 1)``) of block
        position ``block`` that a cached block holds, and that block's hash; ``(0, None)`` when none. Scans
        down from the longest (at most ``m - 1`` lookups); entries whose block is no longer ``cached`` are
        dropped on the way."""
        m, index = self.units_per_block, self._block_of
        start = block * m
        k = min(max_units, m - 1, len(unit_hashes) - start)
        while k > 0:
            u = unit_hashes[start + k - 1]
            block_hash = index.get(u)
            if block_hash is not None:
                if cached(block_hash):
                    return k, block_hash
                del index[u]
            k -= 1
        return 0, None

    def sweep(self, cached: Callable[[Hashable], bool]) -> int:
        """Drop every entry whose block hash is not ``cached``; returns how many were dropped."""
        stale = [u for u, h in self._block_of.items() if not cached(h)]
        for u in stale:
            del self._block_of[u]
        self.sweeps += 1
        return len(stale)

    def clear(self) -> None:
        """Forget every entry (the pool's prefix cache was reset)."""
        self._block_of.clear()
