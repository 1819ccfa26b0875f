"""``PartialHits``: prefix hits finer than a block on the request path (copy-on-partial-reuse).

With a match unit of ``U`` tokens (a divisor of the block size ``B``), a request whose longest cached
prefix of full blocks (``n`` blocks, found as always) is followed by ``k`` more units that a cached full
block also starts with gets those ``k * U`` tokens without computing them: at admission the cached block
(the **source**, in every KV cache group) is held, the request's fresh block ``n`` is allocated as usual,
the first ``k * U`` token slots of the source are copied into it (every layer's K and V: the engine's
``copy``, :func:`kvpool.storage.block_copy.copy_token_prefix`), and the source is released. The request's
prefill then starts at token ``n * B + k * U``, a position inside block ``n``. The block it fills is a
new block: it is published under its own block hash once full, so the pool, its KV events (one per full
block) and the tiers are unchanged. TensorRT-LLM's ``copy_on_partial_reuse`` and vLLM's
``prefix_match_unit`` serve the same hits.

Where it applies (:meth:`KVCacheManager.admit <kvpool.requests.kv_manager.KVCacheManager.admit>`):

* after the full-block hit (device blocks and blocks restored from the tiers alike); the source must be a
  block on the device: a unit match is looked up in the device pool only (:class:`PartialIndex` entries
  name device blocks through their block hashes);
* at most up to the request's ``num_tokens - 1`` tokens, as a full-block hit (the last prompt token is
  always computed);
* every attention group, windows included: the full-block hit at ``n`` blocks already holds every group's
  tokens a position ``p`` in ``[n * B, (n + 1) * B)`` attends to outside block ``n`` (a sliding window of
  ``W`` at ``p`` reads ``[p - W, p)``, inside ``[n * B - W, n * B)`` and block ``n``; a chunk starts at or
  before ``n * B``), and block ``n`` is copied in every group;
* with recurrent state (a hybrid's SSM / conv state), only where the state was also checkpointed at the
  hit's unit boundary: :class:`~kvpool.requests.unit_states.StatePartialHits` (saves at unit boundaries,
  the hit cut to the last unit with both its KV and its state).

The copies are counted (:class:`PartialHitStats`): admissions with a partial hit, the tokens they gained,
and the blocks and token slots copied (every group).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvpool.allocators.groups import group_key
from kvpool.allocators.hashing import BlockHasher
from kvpool.allocators.partial_index import PartialIndex, check_match_unit
from kvpool.requests.request import Request

#: ``copy(pairs, num_tokens)``: copy the first ``num_tokens`` token slots of block ``src`` into block
#: ``dst`` for each ``(src, dst)`` of ``pairs``, every layer's K and V (the engine's KV store).
TokenCopy = Callable[[list[tuple[int, int]], int], None]


@dataclass
class PartialHitStats:
    """Partial hits over admissions: ``hits`` (admissions that copied), ``tokens`` (the tokens they gained,
    once per admission: what a hit-token count adds), ``copied_blocks`` and ``copied_tokens`` (blocks and
    token slots copied, every KV cache group)."""

    hits: int = 0
    tokens: int = 0
    copied_blocks: int = 0
    copied_tokens: int = 0

    def record(self, tokens: int, blocks: int) -> None:
        self.hits += 1
        self.tokens += tokens
        self.copied_blocks += blocks
        self.copied_tokens += tokens * blocks


@dataclass(frozen=True)
class PartialHit:
    """A partial hit held for one admission: ``tokens`` (``k * U``) at block position ``block``, copied from
    ``sources`` (one held block per group)."""

    block: int
    tokens: int
    sources: tuple[int, ...]


class PartialHits:
    """Unit hashes, the :class:`PartialIndex` and the copies of partial hits, for one
    :class:`~kvpool.requests.kv_manager.KVCacheManager` (see the module docstring).

    Args:
        match_unit: tokens per unit, dividing ``block_size``.
        block_size: the KV cache groups' block size.
        num_groups: KV cache groups (a copy per group).
        num_blocks: pool blocks (sizes the index's sweeps).
        hasher: hashes the units of requests with token ids (None: requests bring ``unit_hashes``, as a
            trace's do).

    Raises:
        ConfigError: ``match_unit`` not an integer >= 1 dividing ``block_size``.
    """

    def __init__(self, match_unit: object, block_size: int, num_groups: int, num_blocks: int,
                 hasher: BlockHasher | None = None) -> None:
        self.unit = check_match_unit(match_unit, block_size)
        self.block_size, self.num_groups, self.hasher = block_size, num_groups, hasher
        m = block_size // self.unit
        self.index = PartialIndex(m, num_blocks)
        #: The engine's KV copy (None: counted only, a replay).
        self.copy: TokenCopy | None = None
        self.stats, self.first_stats = PartialHitStats(), PartialHitStats()

    def joint(self, req: Request, kv_blocks: int, j: int) -> int:
        """The blocks a hit of ``kv_blocks`` blocks whose state joint is ``j`` is cut to: ``j`` (no state
        here; :class:`~kvpool.requests.unit_states.StatePartialHits` may go past it)."""
        return j

    def refused(self, req: Request) -> bool:
        """Whether :meth:`hold` left a hit the admission must cut back: never here."""
        return False

    def units(self, req: Request) -> list[Hashable]:
        """``req``'s unit hashes, those of its token ids hashed first where missing (chained on the last)."""
        if self.hasher is not None and req.prompt_token_ids is not None:
            done = len(req.unit_hashes) * self.unit
            if req.num_tokens - done >= self.unit:
                parent = req.unit_hashes[-1] if req.unit_hashes else None
                req.unit_hashes += self.hasher.block_hashes(req.token_ids[done:], self.unit, parent=parent)
        return req.unit_hashes

    def hold(self, req: Request, num_hit_blocks: int, pool: Any, fits: Callable[[PartialHit], bool]
             ) -> PartialHit | None:
        """The partial hit past ``req``'s ``num_hit_blocks`` hit blocks, its source blocks touched in every
        group (held until :meth:`copy_into` or :meth:`release`), where ``fits(hit)`` says the admission
        still fits the pool with them held; None (nothing held) otherwise."""
        n = num_hit_blocks
        max_units = (req.num_tokens - 1 - n * self.block_size) // self.unit
        if max_units <= 0:
            return None
        k, block_hash = self.index.longest(self.units(req), n, max_units, pool.get_cached_block)
        if not k:
            return None
        sources = [pool.get_cached_block(group_key(g, block_hash)) for g in range(self.num_groups)]
        if any(b is None for b in sources):
            return None
        pool.touch(sources)
        hit = PartialHit(n, k * self.unit, tuple(sources))  # type: ignore[arg-type]
        if fits(hit):
            return hit
        self.release(pool, hit)
        return None

    def release(self, pool: Any, hit: PartialHit) -> None:
        """Give the held sources back (the admission did not take the hit)."""
        pool.free(list(hit.sources))

    def copy_into(self, hit: PartialHit, tables: Sequence[Sequence[int]], pool: Any, *, first: bool) -> None:
        """Copy the hit into the request's fresh block ``hit.block`` of each group's table, count it (in
        :attr:`first_stats` too when ``first``, a first admission), and release the sources."""
        pairs = [(src, table[hit.block]) for src, table in zip(hit.sources, tables, strict=True)]
        if self.copy is not None:
            self.copy(pairs, hit.tokens)
        self.stats.record(hit.tokens, len(pairs))
        if first:
            self.first_stats.record(hit.tokens, len(pairs))
        self.release(pool, hit)

    def published(self, req: Request, start: int, end: int, pool: Any) -> None:
        """Index the units of ``req``'s full blocks ``start .. end - 1``, just published."""
        if end > start:
            self.index.register(self.units(req), req.block_hashes[start:end], start, pool.get_cached_block)

    def report(self) -> dict[str, int]:
        """The replay's fields: ``match_unit`` and the first admissions' :class:`PartialHitStats`, prefixed
        ``partial_``."""
        return {"match_unit": self.unit, **{f"partial_{k}": v for k, v in asdict(self.first_stats).items()}}
