"""Hits finer than a block for recurrent hybrids: state checkpoints at match-unit boundaries.

A plain model's partial hit (:mod:`kvpool.requests.partial_hits`) copies the first ``r`` units of a cached
block and prefills from there. A recurrent hybrid also needs its recurrent state *at that position*, and a
state is saved only where the forward stops to copy it (:mod:`kvpool.requests.state_checkpoints`: at block
boundaries). :class:`UnitSaves` adds save points at unit boundaries, and :class:`StatePartialHits` lets a
hit end at one:

* **Keys.** The state after unit ``u`` (the first ``u * U`` tokens, ``U`` the match unit) is kept under
  :func:`~kvpool.requests.checkpoint_store.unit_key` of the request's chained unit hash ``unit_hashes[u -
  1]``, in the same :class:`~kvpool.requests.checkpoint_store.StateCheckpoints` as the block checkpoints:
  one capacity, one eviction policy (``make_policy``), the same pins (by key), admission, KV events and
  tiers. Events and tier keys name unit checkpoints in a group of their own, the block checkpoints' group
  plus one, kind ``"mamba"`` (:func:`~kvpool.requests.checkpoint_store.state_key`): their hashes are unit
  hashes, never a block's.
* **Save points** (:class:`~kvpool.requests.state_checkpoints.SavePolicy` over units, :attr:`UnitSaves.
  policy`): ``tail+junction`` (the default) saves at the last unit boundary of the prompt and of the longest
  sequence, and at the request's **junction**: the last unit whose KV a cached block holds when it is
  admitted, where its prompt leaves a prefix others computed (a shared system prompt, a document; SGLang's
  mamba radix cache saves at such branch points too), so the next request sharing that prefix hits it whole:
  at most three state copies a request. ``tail`` drops the junction; ``interval=N`` saves every N units;
  ``dense`` every unit (one state copy per unit: costly for large states). Unit boundaries
  that are block boundaries are left to the block policy; a unit without a hash is never saved. A save is
  reserved when the step that crosses it is scheduled and committed when the step's KV is published, as a
  block save (the engine's recurrent runner already cuts a span at any save position:
  :meth:`~kvpool.engine.recurrent.RecurrentStates.step`).
* **Joint hit** (:meth:`StatePartialHits.joint`): past the longest prefix ending at a block checkpoint
  (``j`` blocks), the hit may end at the last unit ``u`` (``j * m < u``, ``m = B / U``, not a block
  boundary, before the last prompt token) whose KV is cached (the full blocks before it in the KV hit, its
  units held by a cached device block: the :class:`~kvpool.allocators.partial_index.PartialIndex`) and
  whose unit checkpoint exists on the device or in a tier (read then, so a fault below shortens the hit).
  The KV hit is cut to ``u // m`` blocks; :meth:`StatePartialHits.hold` then holds the source block of the
  ``u % m`` units (copied as for a plain model), and admission fills the request's state slot from the
  unit checkpoint (:meth:`UnitSaves.take`). Where the source is gone by then (a tier restore evicted it) or
  the pool cannot hold it, the hit falls back to the block checkpoint.

Bookkeeping only (hashes and slot ids), like the block checkpoints; the data moves through the state side's
mover and tiers.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.allocators.groups import group_key
from kvpool.allocators.hashing import BlockHasher
from kvpool.errors import ConfigError
from kvpool.requests.checkpoint_store import STATE_EVENT_KIND, unit_key
from kvpool.requests.partial_hits import PartialHit, PartialHits
from kvpool.requests.request import Request
from kvpool.requests.state_checkpoints import RequestStates, SavePolicy


@dataclass(frozen=True)
class UnitHit(PartialHit):
    """A hybrid's partial hit: also the request, the unit checkpoint's ``key``, whether a tier gave it
    (``below``) and then its ``row`` (None where the tiers move no data)."""

    request_id: Hashable = None
    key: Hashable = None
    below: bool = False
    row: Any = None


class UnitSaves:
    """The unit checkpoints of one :class:`RequestStates` (see the module docstring).

    Args:
        states: the hybrid's request states (their checkpoints, mover and tiers).
        unit: tokens per match unit.
        units_per_block: ``m = B / U``.
        unit_hashes: the request's unit hashes, hashing any full unit not hashed yet.
        policy: the save points over units (default ``tail``).
    """

    def __init__(self, states: RequestStates, unit: int, units_per_block: int,
                 unit_hashes: Callable[[Request], Sequence[Hashable]],
                 policy: SavePolicy | str = "tail+junction") -> None:
        self.states, self.unit, self.m, self.unit_hashes = states, unit, units_per_block, unit_hashes
        self.policy = policy if isinstance(policy, SavePolicy) else SavePolicy.parse(policy, "unit_save")
        self._pending: dict[Hashable, list[tuple[int, int]]] = {}  # request -> (unit u, slot)
        self._taken: dict[Hashable, UnitHit] = {}
        self._junctions: dict[Hashable, int] = {}  # request -> its junction unit
        #: Unit checkpoints committed, and admissions that restored one.
        self.saved = self.restored = 0

    def points(self, req: Request, start: int, end: int) -> list[int]:
        """The unit save points ``u`` of ``req`` with ``start < u * U <= end`` (not block boundaries)."""
        lo, hi, pol = start // self.unit + 1, end // self.unit, self.policy
        step = pol.interval
        found = set(range(-(-lo // step) * step, hi + 1, step)) if step else set()
        if pol.tail:
            found |= {n // self.unit for n in (req.num_prompt_tokens, req.max_kv_tokens)}
        if pol.junction and req.request_id in self._junctions:
            found.add(self._junctions[req.request_id])
        return sorted(u for u in found if lo <= u <= hi and u % self.m)

    def plan(self, req: Request, start: int, end: int) -> None:
        """Reserve checkpoint slots for the unit save points computing ``start .. end - 1`` crosses."""
        points = self.points(req, start, end)
        if not points:
            return
        hashes, checkpoints = self.unit_hashes(req), self.states.checkpoints
        for u in points:
            if u <= len(hashes) and unit_key(hashes[u - 1]) not in checkpoints:
                slot = checkpoints.reserve()
                if slot is not None:
                    self._pending.setdefault(req.request_id, []).append((u, slot))

    def pending(self, req: Request) -> list[tuple[int, int]]:
        """``(tokens before the unit boundary, checkpoint slot)`` of ``req``'s planned unit saves."""
        return [(u * self.unit, slot) for u, slot in self._pending.get(req.request_id, ())]

    def commit(self, req: Request) -> None:
        """The planned unit saves ``req`` has computed become checkpoints; the others are released."""
        pending = self._pending.pop(req.request_id, None)
        if not pending:
            return
        checkpoints, hashes = self.states.checkpoints, req.unit_hashes
        for u, slot in pending:
            if u * self.unit <= req.num_computed_tokens:
                checkpoints.commit(unit_key(hashes[u - 1]), slot)
                self.saved += 1
            else:
                checkpoints.release(slot)

    def junction(self, req: Request, u: int) -> None:
        """``req``'s KV is cached up to unit ``u`` (a junction save point when the policy has them)."""
        if self.policy.junction and u > self._junctions.get(req.request_id, 0):
            self._junctions[req.request_id] = u

    def took(self, hit: UnitHit) -> None:
        """``hit`` was copied into its request's blocks: admission restores its state (:meth:`take`)."""
        self._taken[hit.request_id] = hit

    def take(self, req: Request) -> UnitHit | None:
        """The unit hit ``req``'s admission took (once), or None."""
        return self._taken.pop(req.request_id, None)

    def free(self, req: Request) -> None:
        """Release ``req``'s planned unit saves and forget its hit."""
        for _, slot in self._pending.pop(req.request_id, ()):
            self.states.checkpoints.release(slot)
        self._taken.pop(req.request_id, None)
        self._junctions.pop(req.request_id, None)

    def describe(self) -> dict[str, object]:
        return {"unit_save": str(self.policy), "unit_checkpoints_saved": self.saved,
                "unit_checkpoint_hits": self.restored}


class StatePartialHits(PartialHits):
    """:class:`PartialHits` for a recurrent hybrid: a hit ends at a unit boundary only where a unit
    checkpoint of the state is (see the module docstring).

    Args:
        match_unit: tokens per unit, dividing ``block_size`` (as :class:`PartialHits`).
        block_size: the KV cache groups' block size.
        num_groups: KV cache groups (a copy per group).
        num_blocks: pool blocks (sizes the index's sweeps).
        hasher: hashes the units of requests with token ids (None: requests bring ``unit_hashes``).
        states: the hybrid's :class:`RequestStates` (its unit saves are attached to it).
        lookup: the pool's ``get_cached_block`` at call time (the pool may be wrapped later).
    """

    def __init__(self, match_unit: object, block_size: int, num_groups: int, num_blocks: int,
                 hasher: BlockHasher | None, states: RequestStates,
                 lookup: Callable[[Hashable], Any]) -> None:
        super().__init__(match_unit, block_size, num_groups, num_blocks, hasher)
        self.states, self.lookup = states, lookup
        self.saves = UnitSaves(states, self.unit, block_size // self.unit, self.units)
        states.units = self.saves
        checkpoints = states.checkpoints
        if checkpoints.sink is not None:
            checkpoints.sink.describe_group(checkpoints.group + 1, STATE_EVENT_KIND, None)
        self._target: dict[Hashable, tuple[int, bool, Any]] = {}  # request -> (unit u, below, tier row)
        self._refused: set[Hashable] = set()

    def joint(self, req: Request, kv_blocks: int, j: int) -> int:
        """Blocks to cut a hit of ``kv_blocks`` KV blocks to when its state's block joint is ``j``: ``u //
        m`` for the last unit ``u`` past ``j * m`` that ends at a unit checkpoint with its KV cached (kept
        for :meth:`hold`), else ``j``."""
        rid, m, unit = req.request_id, self.saves.m, self.unit
        self._target.pop(rid, None)
        hashes, checkpoints, below = self.units(req), self.states.checkpoints, self.states.below
        top = min(kv_blocks * m + m - 1, (req.num_tokens - 1) // unit, len(hashes))
        if top > kv_blocks * m:  # the junction: where the KV cached ends, units included
            more = self.index.longest(hashes, kv_blocks, top - kv_blocks * m, self.lookup)[0]
            self.saves.junction(req, kv_blocks * m + more)
        for u in range(top, j * m, -1):
            key = unit_key(hashes[u - 1])
            on_device = key in checkpoints
            if not u % m or not (on_device or below is not None):
                continue
            k, r = divmod(u, m)
            if self.index.longest(hashes, k, r, self.lookup)[0] != r:
                continue  # its units' KV is not on the device
            found = None if on_device else below.find(key)  # type: ignore[union-attr]
            if on_device or found is not None:
                self._target[rid] = (u, found is not None, None if found is None else found[1])
                return k
        return j

    def hold(self, req: Request, num_hit_blocks: int, pool: Any, fits: Callable[[PartialHit], bool]
             ) -> PartialHit | None:
        """The hit :meth:`joint` found, its source held as :meth:`PartialHits.hold` does; None when there
        is none, and None with :meth:`refused` true when it cannot be held now (its source left the pool,
        or the pool cannot fit it)."""
        target = self._target.pop(req.request_id, None)
        if target is None:
            return None
        if target[0] // self.saves.m != num_hit_blocks:  # not the hit joint() cut to: back to a block
            self._refused.add(req.request_id)
            return None
        (k, r), below, row = divmod(target[0], self.saves.m), target[1], target[2]
        hashes = self.units(req)
        got, block_hash = self.index.longest(hashes, k, r, pool.get_cached_block)
        sources = [pool.get_cached_block(group_key(g, block_hash)) for g in range(self.num_groups)] \
            if got == r else [None]
        if any(b is None for b in sources):
            self._refused.add(req.request_id)
            return None
        pool.touch(sources)
        key = unit_key(hashes[target[0] - 1])
        hit = UnitHit(k, r * self.unit, tuple(sources), req.request_id, key, below, row)
        if fits(hit):
            return hit
        self.release(pool, hit)
        self._refused.add(req.request_id)
        return None

    def refused(self, req: Request) -> bool:
        """Whether :meth:`hold` refused ``req``'s unit hit just now (once): the hit must then be cut back to
        a block checkpoint."""
        if req.request_id in self._refused:
            self._refused.discard(req.request_id)
            return True
        return False

    def copy_into(self, hit: PartialHit, tables: Sequence[Sequence[int]], pool: Any, *, first: bool) -> None:
        super().copy_into(hit, tables, pool, first=first)
        self.saves.took(hit)  # type: ignore[arg-type]


def partial_hits(match_unit: object, manager: Any, num_blocks: int) -> PartialHits:
    """The :class:`PartialHits` of a :class:`~kvpool.requests.kv_manager.KVCacheManager` (its block size,
    groups and hasher).

    A recurrent hybrid's (its state side's hits are block aligned) is a :class:`StatePartialHits`, saving
    states at unit boundaries too. Here, not in :mod:`kvpool.requests.partial_hits`, which this module builds
    on.

    Raises:
        ConfigError: a bad ``match_unit``; the manager has no prefix caching.
    """
    if not manager.caching:
        raise ConfigError("a match unit needs prefix caching")
    args = (match_unit, manager.block_size, len(manager.groups), num_blocks, manager.hasher)
    if manager.state.block_aligned_hits:
        return StatePartialHits(*args, manager.states, lambda h: manager.pool.get_cached_block(h))
    return PartialHits(*args)
