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
dropped when a lookup finds them so, and in one sweep whenever more than :data:`SWEEP_AT` times
``capacity`` blocks were registered since the last one: the sweep asks the pool once per distinct block
hash it holds, so it costs amortized O(1) pool lookups (and ``m - 1`` dict reads) per registered block.
Memory: one dict entry per unit, nothing per block; the entries are ints or the caller's hashes only, so
the garbage collector never traverses them (a tracked object per block made registration several times
slower on the whole trace). Compiled with mypyc (:mod:`kvpool._native`): the replay's per-block cost.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from itertools import chain

from kvpool.errors import ConfigError
from kvpool.numeric import as_int

#: ``lookup(block_hash)``: where the pool holds a block hash (its block id), None where it does not (the
#: pool's ``get_cached_block``).
Lookup = Callable[[Hashable], object]
#: A sweep runs when more than this many times ``capacity`` blocks were registered since the last one (or
#: since the start): it then asks ``lookup`` about each distinct block hash it holds, so a registered block
#: costs at most ``SWEEP_AT / (SWEEP_AT - 1)`` lookups in sweeps.
SWEEP_AT = 4


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
        capacity: the blocks the caller expects cached at once (the pool's ``num_blocks``): a sweep runs
            once more than :data:`SWEEP_AT` times that were registered since the last one.
    """

    def __init__(self, units_per_block: int, capacity: int) -> None:
        self.units_per_block = as_int(units_per_block, "units_per_block", minimum=1)
        self.capacity = max(1024, as_int(capacity, "capacity", minimum=0))
        self._block_of: dict[Hashable, Hashable] = {}  # unit hash -> block hash
        self._tracked = 0  # blocks registered since the last sweep (those it kept included)
        self.sweeps = 0

    def __len__(self) -> int:
        return len(self._block_of)

    def register(self, unit_hashes: Sequence[Hashable], block_hashes: Sequence[Hashable], first: int,
                 lookup: Lookup) -> None:
        """Index the units of full blocks ``first, first + 1, ...`` (one per hash of ``block_hashes``, the
        request's block hashes from block ``first`` on): block ``i``'s units are ``unit_hashes[i * m : (i +
        1) * m - 1]`` (``unit_hashes`` is the request's whole list; blocks it does not cover are skipped).
        ``lookup(block_hash)`` is None where a block hash is no longer in the pool (the sweep asks it)."""
        m = self.units_per_block
        n = min(len(block_hashes), len(unit_hashes) // m - first) if m > 1 else 0
        if n <= 0:
            return
        keys = list(unit_hashes[first * m:(first + n) * m])
        del keys[m - 1::m]  # each block's last unit: a full-block hit
        blocks = list(block_hashes[:n])
        values: Iterable[Hashable] = blocks
        if m > 2:  # each block hash m - 1 times in a row
            values = chain.from_iterable(zip(*[blocks] * (m - 1), strict=True))
        self._block_of.update(zip(keys, values, strict=True))
        self._tracked += n
        if self._tracked > SWEEP_AT * self.capacity:
            self.sweep(lookup)
            self.capacity = max(self.capacity, self._tracked)  # all live: next sweep once it grows

    def longest(self, unit_hashes: Sequence[Hashable], block: int, max_units: int, lookup: Lookup
                ) -> tuple[int, Hashable | None]:
        """``(k, block hash)``: the most leading units ``k`` (``0 <= k <= min(max_units, m - 1)``) of block
        position ``block`` that a cached block holds, and that block's hash; ``(0, None)`` when none. Scans
        down from the longest (at most ``m - 1`` lookups); entries whose block ``lookup`` no longer finds are
        dropped on the way."""
        m, index = self.units_per_block, self._block_of
        start = block * m
        k = min(max_units, m - 1, len(unit_hashes) - start)
        while k > 0:
            u = unit_hashes[start + k - 1]
            block_hash = index.get(u)
            if block_hash is not None:
                if lookup(block_hash) is not None:
                    return k, block_hash
                del index[u]
            k -= 1
        return 0, None

    def sweep(self, lookup: Lookup) -> int:
        """Keep only the entries of blocks ``lookup`` still finds (asked once per distinct block hash the
        entries name); returns how many distinct block hashes were dropped."""
        live: dict[Hashable, bool] = {}
        for h in self._block_of.values():
            if h not in live:
                live[h] = lookup(h) is not None
        self._block_of = {u: h for u, h in self._block_of.items() if live[h]}
        kept = sum(live.values())
        self._tracked = kept
        self.sweeps += 1
        return len(live) - kept

    def clear(self) -> None:
        """Forget every entry (the pool's prefix cache was reset)."""
        self._block_of.clear()
        self._tracked = 0
