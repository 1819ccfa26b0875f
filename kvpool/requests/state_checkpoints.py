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
* **Checkpoint slots** (:class:`StateCheckpoints`): at most ``capacity`` checkpoints (pending saves
  included), evicted in the order of an eviction policy of :mod:`kvpool.allocators.policies` (``make_policy``:
  the KV pool's, so ``--policy`` applies to states too; ``lru`` by default: least recently used first, a
  restore touching one); with a
  :class:`~kvpool.allocators.state_pool.StatePool` each holds a slot of the state buffers, without one it is
  counted only (a replay). A save that finds no slot (every one pending) is skipped and counted.
* **Request slots.** A running request owns one state slot from admission to its end or preemption; at
  admission it is zeroed or filled from the checkpoint of its hit, at once (``mover``: the
  :class:`~kvpool.storage.state.RecurrentStateCache`, whose ``zero_slots`` / ``copy_slots`` move the data;
  None for a replay), so a checkpoint evicted later in the same step has already been copied.

Bookkeeping only (slot ids and hashes), like the allocators below; O(1) per save, restore and eviction.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool.allocators.policies import EvictionPolicy, make_policy
from kvpool.allocators.state_pool import StatePool
from kvpool.errors import ConfigError, IntegrityError, InvalidIdError, OutOfBlocksError
from kvpool.numeric import as_int, as_optional_int
from kvpool.requests.request import Request

#: The save policies by name (``interval`` takes ``=N``).
SAVE_POLICIES = ("tail", "dense", "interval=N", "tail+junction")
#: The slot id of a counted-only checkpoint (no state buffers behind it).
NO_SLOT = -1


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


@dataclass
class CheckpointStats:
    """Counters of the state side, since the manager was built. ``saved``: checkpoints stored (a save of a
    key already held only touches it); ``restored``: admissions that started from a checkpoint;
    ``evicted``; ``skipped``: saves without a free slot; ``kv_only_tokens``: at first admissions, the tokens
    whose KV every group could restore but that lay past the last checkpoint; ``peak_checkpoints``,
    ``peak_request_slots``: the most held at once."""

    saved: int = 0
    restored: int = 0
    evicted: int = 0
    skipped: int = 0
    kv_only_tokens: int = 0
    peak_checkpoints: int = 0
    peak_request_slots: int = 0


class StateCheckpoints:
    """Saved states keyed by block hash, at most ``capacity`` (None: unbounded), evicted in the order of an
    eviction policy.

    Each checkpoint has an entry id in ``[0, capacity)``, the "block" its policy orders: a commit is a new
    block's ``missed(hash)``, ``published(id, hash)`` and ``insert(id, 0)`` (a checkpoint is evictable at
    once: nothing references it between restores), a restore ``hit(id)``, ``remove(id)`` and ``insert(id,
    0)``, an eviction ``pop()``, a clear ``dropped(id)``: the calls a :class:`~kvpool.allocators.block_pool.
    BlockPool` makes of a block that a request stores, later hits, and frees at once.

    Args:
        capacity: checkpoints held at most, pending saves included (None: no bound, needs ``pool`` None; 0:
            none, every save skipped).
        pool: the :class:`StatePool` checkpoint slots come from (None: counted only, slot :data:`NO_SLOT`).
        policy: the eviction order, a name of :data:`~kvpool.allocators.policies.POLICIES` or a fresh
            :class:`~kvpool.allocators.policies.EvictionPolicy` (default ``"lru"``; unused when unbounded,
            where nothing is evicted).
        max_capacity: the most :meth:`resize` may ever set (the policy is bound to it); None: ``capacity``.

    Raises:
        ConfigError: a capacity that is not an integer >= 0, or a pool with no capacity.
        InvalidArgumentError: an unknown policy name, or a policy that serves a pool already.
    """

    def __init__(self, capacity: int | None = None, *, pool: StatePool | None = None,
                 policy: str | EvictionPolicy = "lru", max_capacity: int | None = None) -> None:
        self.capacity = as_optional_int(capacity, "state checkpoints", minimum=0, error=ConfigError)
        if pool is not None and self.capacity is None:
            raise ConfigError("checkpoints in state slots need a capacity (the slots set aside for them)")
        self.pool = pool
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        bound = self.capacity if max_capacity is None or self.capacity is None else \
            as_int(max_capacity, "max_capacity", minimum=self.capacity, error=ConfigError)
        #: The most checkpoints :meth:`resize` may allow; whether the policy orders them (bounded and > 0).
        self.max_capacity, self._ordered = bound, bool(bound)
        if bound:
            self.policy.bind(bound)
        self._entries: dict[Hashable, int] = {}  # block hash -> entry id
        self._slots: list[int] = []  # entry id -> state slot
        self._hashes: list[Hashable] = []  # entry id -> block hash
        self._free_ids: list[int] = []
        self._pending: set[int] = set()
        self._num_pending = 0
        self.stats = CheckpointStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: Hashable) -> bool:
        return block_hash in self._entries

    def longest(self, block_hashes: Sequence[Hashable], k: int) -> int:
        """The largest j <= k that is 0 or has a checkpoint at ``block_hashes[j - 1]`` (touches nothing)."""
        entries = self._entries
        while k > 0 and block_hashes[k - 1] not in entries:
            k -= 1
        return k

    def touch(self, block_hash: Hashable) -> int:
        """Tell the policy the checkpoint of ``block_hash`` was used (a restore: LRU's most recently used)
        and return its slot. Raises InvalidIdError when there is none."""
        entry = self._entries.get(block_hash)
        if entry is None:
            raise InvalidIdError(f"no state checkpoint at block hash {block_hash!r}")
        if self._ordered:
            policy = self.policy
            policy.hit(entry)
            policy.remove(entry)
            policy.insert(entry, 0)
        return self._slots[entry]

    def reserve(self) -> int | None:
        """A slot for a pending save (:data:`NO_SLOT` without a pool), evicting the least recently used
        checkpoint when at capacity; None (counted in ``skipped``) when every slot is pending."""
        full = self.capacity is not None and len(self._entries) + self._num_pending >= self.capacity
        if full or (self.pool is not None and not self.pool.available_size):
            if not self._entries:
                self.stats.skipped += 1
                return None
            self._evict()
        slot = self.pool.alloc(1)[0] if self.pool is not None else NO_SLOT
        self._num_pending += 1
        if slot != NO_SLOT:
            self._pending.add(slot)
        return slot

    def commit(self, block_hash: Hashable, slot: int) -> None:
        """Make the pending save in ``slot`` the checkpoint of ``block_hash`` (most recently used); when one
        is held already, it is touched and ``slot`` released."""
        self._unpend(slot)
        if block_hash in self._entries:
            self.touch(block_hash)
            self._free_slot(slot)
            return
        entry = self._free_ids.pop() if self._free_ids else len(self._slots)
        if entry == len(self._slots):
            self._slots.append(slot)
            self._hashes.append(block_hash)
        else:
            self._slots[entry], self._hashes[entry] = slot, block_hash
        self._entries[block_hash] = entry
        if self._ordered:
            policy = self.policy
            policy.missed(block_hash)
            policy.published(entry, block_hash)
            policy.insert(entry, 0)
        self.stats.saved += 1
        self.stats.peak_checkpoints = max(self.stats.peak_checkpoints, len(self._entries))

    def release(self, slot: int) -> None:
        """Give back the slot of a pending save that will not be committed."""
        self._unpend(slot)
        self._free_slot(slot)

    def clear(self) -> None:
        """Drop every checkpoint (pending saves stay pending)."""
        for entry in list(self._entries.values()):
            if self._ordered:
                self.policy.dropped(entry)
            self._drop(entry)

    def resize(self, capacity: int) -> int:
        """Hold at most ``capacity`` (at most :attr:`max_capacity`) checkpoints and pending saves from now
        on, evicting committed checkpoints in the policy's order until they fit (pending saves are never
        taken, so ``capacity`` must be at least :attr:`num_pending`); returns how many were evicted.
        Raises ConfigError for an unbounded set or a capacity out of range."""
        if not self._ordered:
            raise ConfigError("only bounded checkpoints (max_capacity >= 1) can be resized")
        self.capacity = as_int(capacity, "state checkpoints", minimum=self._num_pending,
                               maximum=self.max_capacity, error=ConfigError)
        evicted = 0
        while self._entries and len(self._entries) + self._num_pending > self.capacity:
            self._evict()
            evicted += 1
        return evicted

    @property
    def num_pending(self) -> int:
        """Saves reserved and not yet committed or released."""
        return self._num_pending

    def _evict(self) -> None:
        self._drop(self.policy.pop())
        self.stats.evicted += 1

    def _drop(self, entry: int) -> None:
        del self._entries[self._hashes[entry]]
        self._free_slot(self._slots[entry])
        self._hashes[entry] = None
        self._free_ids.append(entry)

    def slots(self) -> list[int]:
        """The state slots of the checkpoints held (:data:`NO_SLOT` for each without a pool)."""
        return [self._slots[entry] for entry in self._entries.values()]

    def _unpend(self, slot: int) -> None:
        if self._num_pending < 1 or (slot != NO_SLOT and slot not in self._pending):
            raise InvalidIdError(f"state slot {slot} holds no pending save")
        self._num_pending -= 1
        self._pending.discard(slot)

    def _free_slot(self, slot: int) -> None:
        if self.pool is not None:
            self.pool.free([slot])

    def check_integrity(self) -> None:
        """At most ``capacity`` checkpoints and pending saves; with a pool, every slot distinct and
        allocated. Raises IntegrityError."""
        held = len(self._entries) + self._num_pending
        if self.capacity is not None and held > self.capacity:
            raise IntegrityError(f"{held} state checkpoints and pending saves exceed {self.capacity}")
        if self.pool is None:
            return
        slots = [*self.slots(), *self._pending]
        if len(set(slots)) != len(slots) or len(self._pending) != self._num_pending:
            raise IntegrityError("a state checkpoint slot is held twice")
        if any(self.pool.ref_count(s) < 1 for s in slots):
            raise IntegrityError("a state checkpoint holds a free slot")


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
        """The longest prefix of at most ``k`` blocks of ``req`` that ends at a checkpoint (or is empty)."""
        return self.checkpoints.longest(req.block_hashes, k)

    def admit(self, req: Request, hit_blocks: int, kv_blocks: int, *, first: bool) -> int:
        """Give ``req`` a state slot: the checkpoint at ``hit_blocks`` copied in (zeroed when 0).
        ``kv_blocks``: the prefix its KV alone could restore (a junction when longer; counted at a
        ``first`` admission). Returns the slot. Raises OutOfBlocksError (nothing changed) when no slot
        is free."""
        if not self.pool.available_size:
            raise OutOfBlocksError(f"request {req.request_id!r} needs a state slot, none of "
                                   f"{self.pool.capacity} is free")
        source = self.checkpoints.touch(req.block_hashes[hit_blocks - 1]) if hit_blocks else None
        slot = self.pool.alloc(1)[0]
        self._slots[req.request_id] = slot
        self.stats.peak_request_slots = max(self.stats.peak_request_slots, len(self._slots))
        if source is not None:
            self.stats.restored += 1
        if self.mover is not None:
            if source is None or source == NO_SLOT:
                self.mover.zero_slots([slot])
            else:
                self.mover.copy_slots([(source, slot)])
        if self.policy.junction and kv_blocks > hit_blocks:
            self._junctions[req.request_id] = kv_blocks
        if first:
            self.stats.kv_only_tokens += (kv_blocks - hit_blocks) * self.block_size
        return slot

    def slot(self, req: Request) -> int:
        """The state slot of running ``req``. Raises InvalidIdError for a request that holds none."""
        slot = self._slots.get(req.request_id)
        if slot is None:
            raise InvalidIdError(f"request {req.request_id!r} holds no state slot")
        return slot

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

    def pending(self, req: Request) -> list[tuple[int, int]]:
        """The saves of ``req`` this step writes: ``(tokens before the boundary, checkpoint slot)``."""
        return [(k * self.block_size, slot) for k, slot in self._pending.get(req.request_id, ())]

    def commit(self, req: Request) -> None:
        """After the step: the saves ``req`` has now computed become checkpoints (call after its KV is
        published)."""
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
        self._junctions.pop(req.request_id, None)
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
                "checkpoints_peak": s.peak_checkpoints}

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
