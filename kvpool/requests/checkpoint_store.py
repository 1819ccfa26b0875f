"""The state checkpoints a hybrid's prefix cache keeps (:class:`StateCheckpoints`): saved recurrent states
keyed by block hash, in the memory kind's own KV cache group, held under an eviction policy of
:func:`~kvpool.allocators.policies.make_policy` as a :class:`~kvpool.allocators.block_pool.BlockPool` holds
cached blocks.

What the KV side's blocks get, a checkpoint gets too (:class:`~kvpool.requests.kv_manager.KVCacheManager`
wires it when it is built, and when tiers are attached):

* **Policy.** ``--policy`` names the KV pool's policy and a fresh one of the same name orders the
  checkpoints (``lru``, ``arc``, ...).
* **Pins.** A checkpoint at a hash of a pinned prefix (:meth:`StateCheckpoints.pin`) is never evicted while
  the pin lasts (at most half the capacity is pinned, as the pool's default pin cap; the rest stays
  evictable).
* **Admission.** With a :class:`~kvpool.allocators.policies.FrequencyAdmission` (:attr:`admission`), a save
  becomes a checkpoint only once its hash has been offered ``min_count`` times; the others are released and
  counted (``not_admitted``).
* **Events.** With a :class:`~kvpool.events.sink.KVEventSink` (:meth:`StateCheckpoints.attach_events`), a
  new checkpoint is a ``BlockStored`` and an evicted or dropped one a ``BlockRemoved``, each naming the
  state's group (``group_idx`` = the number of KV cache groups, ``kv_cache_spec_kind`` ``"mamba"``, vLLM's
  name), so a consumer tells a state checkpoint from KV by its group.
* **Tiers.** :attr:`on_evict` is told each evicted checkpoint's hash and slot before the slot is reused
  (:class:`~kvpool.requests.state_offload.CheckpointTiers` stores it below).

Bookkeeping only (slot ids and hashes); O(1) per commit, touch and eviction.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.allocators.groups import group_key
from kvpool.allocators.policies import EvictionPolicy, make_policy
from kvpool.allocators.state_pool import StatePool
from kvpool.errors import ConfigError, IntegrityError, InvalidIdError
from kvpool.numeric import as_int, as_optional_int

if TYPE_CHECKING:
    from kvpool.events.sink import KVEventSink

#: The slot id of a counted-only checkpoint (no state buffers behind it).
NO_SLOT = -1
#: vLLM's ``kv_cache_spec_kind`` of a recurrent state group (its ``MambaSpec``).
STATE_EVENT_KIND = "mamba"
#: The tag of a unit checkpoint's key (:func:`unit_key`).
UNIT_TAG = "unit"


def unit_key(unit_hash: Hashable) -> tuple[str, Hashable]:
    """The checkpoint key of the state at the end of the match unit ``unit_hash`` (a hybrid's partial hits:
    :mod:`kvpool.requests.unit_states`): ``("unit", unit_hash)``, never equal to a block hash (an int or
    bytes), so unit and block checkpoints share one store without meeting."""
    return (UNIT_TAG, unit_hash)


def state_key(group: int, key: Hashable) -> Hashable:
    """The event and tier key of the checkpoint ``key`` of state group ``group``: a block checkpoint's
    :func:`~kvpool.allocators.groups.group_key` ``(group, block hash)``; a unit checkpoint's
    (:func:`unit_key`) ``(group + 1, unit hash)``, the unit checkpoints being a group of their own
    (described as ``"mamba"`` too), so a consumer never reads a unit hash as a block's."""
    if type(key) is tuple and len(key) == 2 and key[0] == UNIT_TAG:
        return group_key(group + 1, key[1])
    return group_key(group, key)


@dataclass
class CheckpointStats:
    """Counters of the state side, since the manager was built. ``saved``: checkpoints stored (a save of a
    key already held only touches it); ``restored``: admissions that started from a checkpoint;
    ``evicted``; ``skipped``: saves without a free slot; ``not_admitted``: saves the admission filter
    kept out; ``tier_restored``: restores whose checkpoint came from a tier; ``kv_only_tokens``: at first
    admissions, the tokens whose KV every group could restore but that lay past the last checkpoint;
    ``peak_checkpoints``, ``peak_request_slots``: the most held at once."""

    saved: int = 0
    restored: int = 0
    evicted: int = 0
    skipped: int = 0
    not_admitted: int = 0
    tier_restored: int = 0
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
        self._pin_hashes: set[Hashable] = set()  # hashes of pinned prefixes
        self._pinned: set[int] = set()  # entry ids held out of the policy by a pin
        #: The group whose key (:func:`~kvpool.allocators.groups.group_key`) names a checkpoint in events
        #: and tiers: set by :meth:`attach_events` / the manager (0 until then).
        self.group = 0
        self.sink: KVEventSink | None = None
        #: Filters commits (a :class:`~kvpool.allocators.policies.FrequencyAdmission`), or None.
        self.admission: Any = None
        #: Told ``(block_hash, slot)`` of each evicted checkpoint before its slot is reused, or None.
        self.on_evict: Callable[[Hashable, int], None] | None = None

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
        if self._ordered and entry not in self._pinned:
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
            if len(self._entries) == len(self._pinned):
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
        if self.admission is not None and not self.admission.admit(block_hash):
            self._free_slot(slot)
            self.stats.not_admitted += 1
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
            if not self._pin_entry(entry, block_hash):
                policy.insert(entry, 0)
        if self.sink is not None:
            self.sink.check_and_store([state_key(self.group, block_hash)], None, None, None, None, None)
        self.stats.saved += 1
        self.stats.peak_checkpoints = max(self.stats.peak_checkpoints, len(self._entries))

    def release(self, slot: int) -> None:
        """Give back the slot of a pending save that will not be committed."""
        self._unpend(slot)
        self._free_slot(slot)

    def clear(self) -> None:
        """Drop every checkpoint (pending saves stay pending)."""
        self._unpin_entries()
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
        entries = self._entries
        while len(entries) > len(self._pinned) and len(entries) + self._num_pending > self.capacity:
            self._evict()
            evicted += 1
        return evicted

    @property
    def num_pending(self) -> int:
        """Saves reserved and not yet committed or released."""
        return self._num_pending

    def _evict(self) -> None:
        entry = self.policy.pop()
        if self.on_evict is not None:
            self.on_evict(self._hashes[entry], self._slots[entry])
        self._drop(entry)
        self.stats.evicted += 1

    def _drop(self, entry: int) -> None:
        block_hash = self._hashes[entry]
        del self._entries[block_hash]
        self._pinned.discard(entry)
        if self.sink is not None:
            self.sink.removed([state_key(self.group, block_hash)])
        self._free_slot(self._slots[entry])
        self._hashes[entry] = None
        self._free_ids.append(entry)

    # ---- pins and events ----------------------------------------------------------------------------

    def pin(self, block_hashes: Iterable[Hashable]) -> None:
        """Keep the checkpoints at ``block_hashes`` (a pinned prefix's) out of eviction until
        :meth:`unpin_all`: those held now and those committed later, while pinned ones fill at most half
        the capacity (a bounded, ordered set; others are not evicted anyway)."""
        for block_hash in block_hashes:
            self._pin_hashes.add(block_hash)
            entry = self._entries.get(block_hash)
            if entry is not None and entry not in self._pinned and self._ordered and \
                    self._pin_entry(entry, block_hash):
                self.policy.remove(entry)

    def _pin_entry(self, entry: int, block_hash: Hashable) -> bool:
        """Mark ``entry`` pinned when its hash is and the pin cap has room (the caller takes it out of the
        policy); whether it did."""
        if block_hash not in self._pin_hashes or 2 * (len(self._pinned) + 1) > (self.capacity or 0):
            return False
        self._pinned.add(entry)
        return True

    def unpin_all(self) -> int:
        """Drop every pin (the checkpoints become evictable, most recently used); returns how many were
        held pinned."""
        n = len(self._pinned)
        self._unpin_entries()
        self._pin_hashes.clear()
        return n

    def _unpin_entries(self) -> None:
        for entry in sorted(self._pinned):
            self.policy.insert(entry, 0)
        self._pinned.clear()

    @property
    def num_pinned(self) -> int:
        """Checkpoints held pinned."""
        return len(self._pinned)

    def attach_events(self, sink: KVEventSink, group: int) -> None:
        """Record each new checkpoint (``BlockStored``) and each one that leaves (``BlockRemoved``) into
        ``sink``, keyed as group ``group`` (described to the sink as vLLM's ``"mamba"`` kind)."""
        self.group = as_int(group, "group", minimum=1)
        sink.describe_group(self.group, STATE_EVENT_KIND, None)
        self.sink = sink

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
        if self._ordered and len(self.policy) != len(self._entries) - len(self._pinned):
            raise IntegrityError(f"{len(self.policy)} checkpoints in the eviction order, "
                                 f"{len(self._entries) - len(self._pinned)} evictable")
        if self.pool is None:
            return
        slots = [*self.slots(), *self._pending]
        if len(set(slots)) != len(slots) or len(self._pending) != self._num_pending:
            raise IntegrityError("a state checkpoint slot is held twice")
        if any(self.pool.ref_count(s) < 1 for s in slots):
            raise IntegrityError("a state checkpoint holds a free slot")
