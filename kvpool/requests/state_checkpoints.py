"""Recurrent state on the request path: each request's state slot, the checkpoints a prefix cache keeps of
states, and the save policy that decides where they are taken (vLLM's mamba prefix caching, SGLang's mamba
radix cache).

A recurrent layer's state after token t sums up the whole prefix before it and cannot be cut back like KV,
so a cached prefix of KV is reusable for a hybrid only where the state *at its end* was saved. The contract:

* **Boundaries.** Boundary k (k >= 1 blocks of ``block_size`` B tokens) is the state after the first k B
  tokens; a checkpoint there is keyed by the request's ``block_hashes[k - 1]`` (chained, so the key names the
  whole prefix). Boundary 0 is the zero state: always there, never stored.
* **Save policies** (:meth:`SavePolicy.parse`): ``tail`` saves at the last block boundary of the prompt and
  of the request's longest sequence (``max_kv_tokens``), vLLM's default; ``interval=N`` every N blocks;
  ``dense`` every block (``interval=1``); ``tail+junction`` also where a new request's cached KV ends beyond
  its last checkpoint, i.e. where its prefix leaves a chain another request published (the divergence point,
  saved when this request computes it). A boundary without a block hash (a trace's outputs) is never saved.
* **Joint hit.** The prefix a request may skip is the longest one that every KV cache group can restore
  *and* that ends at boundary 0 or at a checkpoint (:meth:`RequestStates.joint_blocks`); the KV cached past
  it is counted (``kv_only_tokens``), not reused.
* **Save timing.** A save is planned when the step that crosses its boundary is scheduled (a checkpoint slot
  is reserved then, so the forward can write the state into it as it passes the boundary) and becomes a
  visible checkpoint when the step's KV is published (:meth:`RequestStates.commit`), never before.
* **Checkpoint slots** (:class:`StateCheckpoints`, :mod:`kvpool.requests.checkpoint_store`): at most
  ``capacity`` checkpoints (pending saves included), evicted in the order of an eviction policy of
  :mod:`kvpool.allocators.policies` (``make_policy``: the KV pool's, so ``--policy`` applies to states too;
  ``lru`` by default: least recently used first, a restore touching one), pinned with a pinned prefix,
  filtered by the KV side's admission, announced as KV events of their own group; with a
  :class:`~kvpool.allocators.state_pool.StatePool` each holds a slot of the state buffers, without one it is
  counted only (a replay). A save that finds no slot (every one pending) is skipped and counted.
* **Tiers** (:class:`~kvpool.requests.state_offload.CheckpointTiers`, :meth:`RequestStates.attach_tiers`):
  a checkpoint the device evicts goes down to the tiers; the joint hit also ends at a checkpoint a tier
  gives back intact (read when the hit is cut, so a fault below shortens the hit, never restores a wrong
  state), which admission writes into the request's slot.
* **Request slots.** A running request owns one state slot from admission to its end or preemption; at
  admission it is zeroed or filled from the checkpoint of its hit, at once (``mover``: the
  :class:`~kvpool.storage.state.RecurrentStateCache`, whose ``zero_slots`` / ``copy_slots`` move the data;
  None for a replay), so a checkpoint evicted later in the same step has already been copied.

Bookkeeping only (slot ids and hashes), like the allocators below; O(1) per save, restore and eviction.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool.allocators.state_pool import StatePool
from kvpool.errors import ConfigError, IntegrityError, InvalidIdError, OutOfBlocksError
from kvpool.numeric import as_int
from kvpool.requests.checkpoint_store import NO_SLOT, CheckpointStats, StateCheckpoints
from kvpool.requests.request import Request
from kvpool.requests.state_offload import CheckpointTiers

__all__ = ["NO_SLOT", "SAVE_POLICIES", "CheckpointStats", "RequestStates", "SavePolicy", "StateCheckpoints",
           "StateMover"]

#: The save policies by name (``interval`` takes ``=N``).
SAVE_POLICIES = ("tail", "dense", "interval=N", "tail+junction")


@dataclass(frozen=True)
class SavePolicy:
    """Where a request's recurrent state is saved (see the module docstring).

    Attributes:
        tail: save at the last block boundary of the prompt and of the longest sequence.
        interval: save every ``interval`` blocks (0: no interval saves; ``dense`` is 1).
        junction: save where a new request's cached KV ends past its last checkpoint.
    """

    tail: bool = True
    interval: int = 0
    junction: bool = False

    @classmethod
    def parse(cls, text: str, field: str = "state_save") -> SavePolicy:
        """``tail``, ``dense``, ``interval=N`` (N >= 1) or ``tail+junction``; ConfigError naming ``field``
        otherwise."""
        name = str(text).strip().lower()
        if name == "tail":
            return cls()
        if name == "dense":
            return cls(tail=False, interval=1)
        if name == "tail+junction":
            return cls(junction=True)
        match = re.fullmatch(r"interval=(\S+)", name)
        if match:
            n = as_int(_int_or_text(match.group(1)), f"{field} interval", minimum=1, error=ConfigError)
            return cls(tail=False, interval=n)
        raise ConfigError(f"{field} must be one of {', '.join(SAVE_POLICIES)}, got {text!r}")

    def __str__(self) -> str:
        if self.interval == 1 and not self.tail:
            return "dense"
        if self.interval:
            return f"interval={self.interval}"
        return "tail+junction" if self.junction else "tail"

    def saves_at(self, k: int, req: Request, block_size: int) -> bool:
        """Whether boundary ``k`` >= 1 of ``req`` is a save point by the policy's rule (junctions aside)."""
        if self.interval and k % self.interval == 0:
            return True
        return self.tail and k in (req.num_prompt_tokens // block_size, req.max_kv_tokens // block_size)


def _int_or_text(text: str) -> int | str:
    return int(text) if re.fullmatch(r"[+-]?\d+", text) else text


class StateMover(Protocol):
    """What moves state data between slots: :class:`~kvpool.storage.state.RecurrentStateCache`."""

    def zero_slots(self, slots: Sequence[int]) -> None: ...

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None: ...


class RequestStates:
    """Each running request's state slot, its planned saves and the checkpoints (see the module docstring).

    Args:
        policy: the :class:`SavePolicy` (or its text, :meth:`SavePolicy.parse`).
        block_size: tokens per block (the attention groups').
        pool: the :class:`StatePool` request slots come from (it may also hold ``checkpoints``' slots: size
            it ``max_num_seqs + capacity``).
        checkpoints: the :class:`StateCheckpoints` (a fresh unbounded, counted-only one when None).
        mover: moves the data at admission (None: bookkeeping only).

    Raises:
        ConfigError: a bad policy or block size.
    """

    #: Every step reaches :meth:`plan` and :meth:`commit` (the state side of
    #: :class:`~kvpool.requests.no_state.StateSide`).
    follows_each_step = True
    #: A hit ends at a block boundary: a state is checkpointed there only (no partial hit inside a block).
    block_aligned_hits = True

    def __init__(self, policy: SavePolicy | str, block_size: int, pool: StatePool, *,
                 checkpoints: StateCheckpoints | None = None, mover: StateMover | None = None) -> None:
        self.policy = policy if isinstance(policy, SavePolicy) else SavePolicy.parse(policy)
        self.block_size = as_int(block_size, "block_size", minimum=1, error=ConfigError)
        self.pool, self.mover = pool, mover
        self.checkpoints = StateCheckpoints() if checkpoints is None else checkpoints
        self.stats = self.checkpoints.stats
        self._slots: dict[Hashable, int] = {}
        self._junctions: dict[Hashable, int] = {}
        self._pending: dict[Hashable, list[tuple[int, int]]] = {}  # request -> (boundary k, slot)
        #: The tiers under the checkpoints (:meth:`attach_tiers`), or None.
        self.below: CheckpointTiers | None = None
        self._staged: dict[Hashable, tuple[int, int, Any]] = {}  # request -> (k asked, boundary, row)
        #: The saves at match-unit boundaries (:class:`~kvpool.requests.unit_states.UnitSaves`, attached with
        #: a match unit), or None.
        self.units: Any = None

    def join(self, group: int, sink: Any = None, admission: Any = None) -> None:
        """Take the KV side's settings as the state's group ``group`` (the number of KV cache groups): its
        event ``sink`` (each checkpoint an event of that group) and, for a
        :class:`~kvpool.allocators.policies.FrequencyAdmission` ``admission``, a fresh filter of the same
        ``min_count`` over the checkpoints (one filter counts one stream; the device policy's
        ``ValuedAdmission`` has no meaning for states and is not copied)."""
        from kvpool.allocators.policies import FrequencyAdmission

        checkpoints = self.checkpoints
        checkpoints.group = as_int(group, "group", minimum=1)
        if sink is not None:
            checkpoints.attach_events(sink, group)
        if type(admission) is FrequencyAdmission:
            checkpoints.admission = FrequencyAdmission(admission.min_count)

    def check_block_size(self, block_size: int) -> None:
        """ConfigError unless the checkpoints' block size is the KV cache groups' ``block_size``."""
        if self.block_size != block_size:
            raise ConfigError(f"the state checkpoints' block size {self.block_size} is not the KV cache "
                              f"groups' {block_size}")

    def pin(self, hashes: Sequence[Any]) -> None:
        """Pin the checkpoints at the block hashes ``hashes`` of a pinned prefix
        (:meth:`StateCheckpoints.pin`)."""
        self.checkpoints.pin(hashes)

    def unpin_all(self) -> None:
        """Unpin every pinned checkpoint."""
        self.checkpoints.unpin_all()

    def tiers_under(self, tiers: Sequence[Any], *, data: bool) -> None:
        """Attach :class:`CheckpointTiers` over ``tiers`` (rows of this state's slots when ``data``)."""
        self.attach_tiers(CheckpointTiers(tiers, self.checkpoints.group,
                                          rows=self.mover if data else None))  # type: ignore[arg-type]

    def attach_tiers(self, below: CheckpointTiers) -> None:
        """Store each checkpoint the device evicts into ``below`` and find checkpoints there (see the
        module docstring). Raises ConfigError for tiers that move no data under states that do."""
        if self.mover is not None and below.rows is None:
            raise ConfigError("the state moves data: its checkpoint tiers need the state store's rows")
        self.below = below
        self.checkpoints.on_evict = below.store

    def wrap_pool(self, wrap: Callable[[StatePool], Any]) -> None:
        """Put ``wrap(pool)`` in front of the slot pool, for the request slots and the checkpoints alike (a
        tensor-parallel leader's recorder: :func:`kvpool.engine.tp_state.record_states`)."""
        shared, self.pool = self.checkpoints.pool is self.pool, wrap(self.pool)
        if shared:
            self.checkpoints.pool = self.pool

    # ---- admission ----------------------------------------------------------------------------------

    @property
    def has_free_slot(self) -> bool:
        return self.pool.available_size > 0

    def joint_blocks(self, req: Request, k: int) -> int:
        """The longest prefix of at most ``k`` blocks of ``req`` that ends at a checkpoint (or is empty): on
        the device, or past the device's longest one in a tier that gives it back intact (read now, kept
        for :meth:`admit`; a later call with a smaller ``k`` reuses it while it still fits)."""
        j = self.checkpoints.longest(req.block_hashes, k)
        if self.below is None:
            return j
        rid = req.request_id
        staged = self._staged.get(rid)
        if staged is not None and staged[1] <= k <= staged[0]:
            return max(j, staged[1])
        self._staged.pop(rid, None)
        for i in range(k, j, -1):
            found = self.below.find(req.block_hashes[i - 1])
            if found is not None:
                self._staged[rid] = (k, i, found[1])
                return i
        return j

    def admit(self, req: Request, hit_blocks: int, kv_blocks: int, *, first: bool) -> int:
        """Give ``req`` a state slot: the checkpoint at ``hit_blocks`` copied in (zeroed when 0).
        ``kv_blocks``: the prefix its KV alone could restore (a junction when longer; counted at a
        ``first`` admission). Returns the slot. Raises OutOfBlocksError (nothing changed) when no slot
        is free."""
        if not self.pool.available_size:
            raise OutOfBlocksError(f"request {req.request_id!r} needs a state slot, none of "
                                   f"{self.pool.capacity} is free")
        staged = self._staged.pop(req.request_id, None)
        unit = None if self.units is None else self.units.take(req)  # a hit ending at a unit checkpoint
        key = req.block_hashes[hit_blocks - 1] if hit_blocks else None
        below = staged is not None and staged[1] == hit_blocks and key not in self.checkpoints
        if unit is not None:
            key, below, staged = unit.key, unit.below, (0, 0, unit.row)
            self.units.restored += 1
        source = self.checkpoints.touch(key) if key is not None and not below else None
        slot = self.pool.alloc(1)[0]
        self._slots[req.request_id] = slot
        self.stats.peak_request_slots = max(self.stats.peak_request_slots, len(self._slots))
        if key is not None:
            self.stats.restored += 1
            self.stats.tier_restored += below
        if below:
            self.below.restore(slot, staged[2], key)  # type: ignore[union-attr, index]
        elif self.mover is not None:
            if source is None or source == NO_SLOT:
                self.mover.zero_slots([slot])
            else:
                self.mover.copy_slots([(source, slot)])
        if self.policy.junction and kv_blocks > hit_blocks:
            self._junctions[req.request_id] = kv_blocks
        if first:
            kv_only = (kv_blocks - hit_blocks) * self.block_size  # less a unit hit's tokens inside it
            self.stats.kv_only_tokens += max(0, kv_only - (unit.tokens if unit is not None else 0))
        return slot

    def slot(self, req: Request) -> int:
        """The state slot of running ``req``. Raises InvalidIdError for a request that holds none."""
        slot = self._slots.get(req.request_id)
        if slot is None:
            raise InvalidIdError(f"request {req.request_id!r} holds no state slot")
        return slot

    def batch_slots(self, reqs: Sequence[Request]) -> tuple[list[int], list[list[tuple[int, int]]]]:
        """For a step's requests in order: each one's state slot (:meth:`slot`) and saves (:meth:`pending`),
        as :class:`~kvpool.engine.runner.StepBatch` takes them."""
        return [self.slot(r) for r in reqs], [self.pending(r) for r in reqs]

    # ---- saves --------------------------------------------------------------------------------------

    def plan(self, req: Request, start: int, end: int) -> None:
        """Reserve checkpoint slots for the save points ``req`` crosses computing tokens ``start .. end - 1``
        (boundaries k with ``start < k B <= end``, hashed, not held already)."""
        bs, hashes = self.block_size, req.block_hashes
        junction = self._junctions.get(req.request_id, 0)
        for k in range(start // bs + 1, min(end // bs, len(hashes)) + 1):
            if (k == junction or self.policy.saves_at(k, req, bs)) and hashes[k - 1] not in self.checkpoints:
                slot = self.checkpoints.reserve()
                if slot is not None:
                    self._pending.setdefault(req.request_id, []).append((k, slot))
        if self.units is not None:
            self.units.plan(req, start, end)

    def pending(self, req: Request) -> list[tuple[int, int]]:
        """The saves of ``req`` this step writes: ``(tokens before the boundary, checkpoint slot)``."""
        saves = [(k * self.block_size, slot) for k, slot in self._pending.get(req.request_id, ())]
        return saves if self.units is None else sorted(saves + self.units.pending(req))

    def commit(self, req: Request) -> None:
        """After the step: the saves ``req`` has now computed become checkpoints (call after its KV is
        published)."""
        if self.units is not None:
            self.units.commit(req)
        pending = self._pending.pop(req.request_id, None)
        if not pending:
            return
        done = req.num_computed_tokens // self.block_size
        for k, slot in pending:
            if k <= done:
                self.checkpoints.commit(req.block_hashes[k - 1], slot)
            else:
                self.checkpoints.release(slot)

    # ---- the end ------------------------------------------------------------------------------------

    def free(self, req: Request) -> None:
        """Release ``req``'s state slot and any save not committed (a no-op for a request that holds none)."""
        for _, slot in self._pending.pop(req.request_id, ()):
            self.checkpoints.release(slot)
        if self.units is not None:
            self.units.free(req)
        self._junctions.pop(req.request_id, None)
        self._staged.pop(req.request_id, None)
        slot = self._slots.pop(req.request_id, None)
        if slot is not None:
            self.pool.free([slot])

    def clear(self) -> None:
        """Drop every checkpoint (an emptied cache); request slots stay."""
        self.checkpoints.clear()

    @property
    def num_request_slots(self) -> int:
        """State slots held by running requests."""
        return len(self._slots)

    @property
    def num_request_capacity(self) -> int:
        """State slots requests can hold: the pool's, less the checkpoints' when they share it."""
        shared = self.checkpoints.pool is self.pool and self.checkpoints.capacity is not None
        return self.pool.capacity - (self.checkpoints.capacity if shared else 0)  # type: ignore[operator]

    def describe(self) -> dict[str, object]:
        """The counts as one JSON-ready dict: the policy, request slots used and capacity, checkpoints held
        and their capacity (None: unbounded), and :class:`CheckpointStats`."""
        s = self.stats
        return {"state_save": str(self.policy), "state_slots_used": self.num_request_slots,
                "state_slots_capacity": self.num_request_capacity, "checkpoints": len(self.checkpoints),
                "checkpoints_capacity": self.checkpoints.capacity, "checkpoints_saved": s.saved,
                "checkpoint_hits": s.restored, "checkpoint_evictions": s.evicted, "saves_skipped": s.skipped,
                "kv_only_tokens": s.kv_only_tokens, "state_slots_peak": s.peak_request_slots,
                "checkpoints_peak": s.peak_checkpoints, "checkpoints_pinned": self.checkpoints.num_pinned,
                "checkpoints_not_admitted": s.not_admitted, "checkpoint_tier_hits": s.tier_restored,
                **({} if self.units is None else self.units.describe())}

    def stats_entries(self) -> dict[str, object]:
        """What a run's stats hold of the state: ``{"recurrent_state": describe()}``."""
        return {"recurrent_state": self.describe()}

    def replay_fields(self, state_save: str | None) -> dict[str, Any]:
        """The replay's result fields of the state slots and checkpoints (``state_save`` as the replay names
        its policy; :func:`kvpool.trace.replay_result.state_report`)."""
        s = self.stats
        return {"state_save": state_save, "state_slots_peak": s.peak_request_slots,
                "checkpoints_saved": s.saved, "checkpoints_peak": s.peak_checkpoints,
                "checkpoint_hits": s.restored, "checkpoint_evictions": s.evicted,
                "checkpoint_tier_hits": s.tier_restored, "kv_only_tokens": s.kv_only_tokens}

    def slots_digest(self) -> bytes:
        """32 bytes naming every state slot's ref count (and the free count), after the slot pool's own
        integrity check (IntegrityError): what tensor-parallel ranks compare."""
        pool = self.pool
        pool.check_integrity()
        refs = [pool.ref_count(s) for s in range(pool.num_slots - pool.capacity, pool.num_slots)]
        return hashlib.sha256(repr((refs, pool.available_size)).encode()).digest()

    def free_among(self, slots: Sequence[int]) -> list[int]:
        """The slots of ``slots`` the slot pool holds free (a step that uses one diverged)."""
        return [slot for slot in slots if self.pool.ref_count(slot) == 0]

    def check_integrity(self) -> None:
        """The pool's and the checkpoints' invariants; request slots distinct and allocated, none also a
        checkpoint's. Raises IntegrityError."""
        self.pool.check_integrity()
        self.checkpoints.check_integrity()
        slots = list(self._slots.values())
        if len(set(slots)) != len(slots) or any(self.pool.ref_count(s) < 1 for s in slots):
            raise IntegrityError("request state slots are not distinct allocated slots")
        if self.checkpoints.pool is self.pool and set(slots) & set(self.checkpoints.slots()):
            raise IntegrityError("a request's state slot is also a checkpoint's")
