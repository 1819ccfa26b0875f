"""A recurrent hybrid's state slots under tensor parallelism: rank 0 decides, the followers apply.

Each rank holds its shard of every state (its heads: :mod:`kvpool.engine.sharding_recurrent`) in its own
state slots, numbered as rank 0's. Rank 0's :class:`~kvpool.requests.state_checkpoints.RequestStates` is the
only one that decides: which slot a request or a checkpoint takes (its
:class:`~kvpool.allocators.state_pool.StatePool`), and what data moves at admission (a slot zeroed for a
fresh request, a checkpoint copied into a request's slot for a hit: its mover). :func:`record_states` puts a
recorder in front of both; their calls join the pool log (:class:`~kvpool.engine.pool_log.RecordingPool`'s,
shipped with each step), and a follower applies them (:func:`apply_state_call`) to its own ``StatePool``
(comparing each result with rank 0's) and to its shard of the state buffers, before the step's forward reads
them. The step's saves (a state copied into a checkpoint slot as the forward passes a block boundary) ride in
the step's batch, so every rank saves its shard at the same point. The cross-rank check covers the slots:
:func:`state_digest` names every slot's ref count, and :func:`check_batch_slots` refuses a batch whose slots
this rank's pool holds free.

**Checkpoint tiers.** Each rank keeps its shard of the checkpoints the device evicts in its own tiers
(:class:`~kvpool.requests.state_offload.CheckpointTiers`, built on every rank by ``enable_offload``). Rank
0's stores, finds and restores join the log by block hash (:class:`_TierRecorder`); a follower stores its
own slot's shard, finds in its own tiers (so their contents and recency stay rank 0's), and writes the row
it found into the slot rank 0 restored. A follower whose tiers lack a checkpoint rank 0 restores raises
IntegrityError (never a wrong state).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from typing import Any

from kvpool.engine.tp_group import follow_call
from kvpool.errors import IntegrityError
from kvpool.requests.no_state import StateSide

#: The ``StatePool`` calls that change it, and the mover's, logged as ``state.<name>``.
POOL_CALLS = ("alloc", "incref", "free", "clear")
MOVER_CALLS = ("zero_slots", "copy_slots")
#: Rank 0's checkpoint tier calls, logged by block hash (:class:`_TierRecorder`).
TIER_CALLS = ("tier_store", "tier_find", "tier_restore")
_PREFIX = "state."
#: A follower's rows found in its tiers, by block hash, until rank 0 restores them (at most
#: :data:`_MAX_FOUND` per ``RequestStates``: rank 0 stages one a request).
_FOUND: weakref.WeakKeyDictionary[Any, dict[Hashable, Any]] = weakref.WeakKeyDictionary()
_MAX_FOUND = 64


class _Recorder:
    """``target`` with the calls of ``names`` applied and, when they return, appended to ``recorder.log``
    (read at each call: it is drained per message) as ``("state.<name>", args, {}, result)``; every other
    attribute passes through."""

    def __init__(self, target: Any, recorder: Any, names: Sequence[str]) -> None:
        self.target, self.recorder, self.names = target, recorder, frozenset(names)

    def __getattr__(self, name: str) -> Any:
        if name in ("target", "recorder", "names"):
            raise AttributeError(name)
        attr = getattr(self.target, name)
        if name not in self.names:
            return attr

        def call(*args: Any) -> Any:
            args = tuple(list(a) if not isinstance(a, int) else a for a in args)
            result = attr(*args)
            self.recorder.log.append((_PREFIX + name, args, {}, result))
            return result
        return call


class _TierRecorder:
    """Rank 0's :class:`~kvpool.requests.state_offload.CheckpointTiers` with each store, find and restore
    appended to ``recorder.log`` as ``("state.tier_<call>", (block hash, ...), {}, result)``; the rows stay
    on rank 0 (each rank moves its own shard)."""

    def __init__(self, target: Any, recorder: Any) -> None:
        self.target, self.recorder = target, recorder

    def __getattr__(self, name: str) -> Any:
        if name in ("target", "recorder"):
            raise AttributeError(name)
        return getattr(self.target, name)

    def _log(self, call: str, args: tuple, result: Any) -> None:
        self.recorder.log.append((_PREFIX + call, args, {}, result))

    def store(self, block_hash: Hashable, slot: int) -> None:
        self.target.store(block_hash, slot)
        self._log("tier_store", (block_hash, slot), None)

    def find(self, block_hash: Hashable) -> tuple[int, Any] | None:
        found = self.target.find(block_hash)
        self._log("tier_find", (block_hash,), None if found is None else found[0])
        return found

    def restore(self, slot: int, row: Any, block_hash: Hashable = None) -> None:
        self.target.restore(slot, row, block_hash)
        self._log("tier_restore", (block_hash, slot), None)


def record_states(states: Any, recorder: Any) -> None:
    """Put recorders in front of ``states``' slot pool (its requests' and its checkpoints'), its mover and
    its checkpoint tiers (a :class:`~kvpool.requests.state_checkpoints.RequestStates` of rank 0, its tiers
    attached before); ``recorder``: the :class:`~kvpool.engine.pool_log.RecordingPool` whose log ships."""
    states.wrap_pool(lambda pool: _Recorder(pool, recorder, POOL_CALLS))
    if states.mover is not None:
        states.mover = _Recorder(states.mover, recorder, MOVER_CALLS)
    if states.below is not None:
        states.attach_tiers(_TierRecorder(states.below, recorder))


def is_state_call(name: str) -> bool:
    """Whether a logged call is one of :func:`record_states`' (a follower applies it:
    :func:`apply_state_call`)."""
    return name.startswith(_PREFIX) and name[len(_PREFIX):] in POOL_CALLS + MOVER_CALLS + TIER_CALLS


def _apply_tier_call(states: Any, call: str, args: tuple, rank: int) -> None:
    """A follower's side of rank 0's checkpoint tier call (see the module docstring)."""
    below, found = states.below, _FOUND.setdefault(states, {})
    if below is None:
        raise IntegrityError(f"rank {rank}: rank 0 shipped state.{call} but this rank's states keep no tiers")
    if call == "tier_store":
        below.store(*args)
    elif call == "tier_find":
        (block_hash,) = args
        hit = below.find(block_hash)
        found.pop(block_hash, None)
        if hit is not None:
            found[block_hash] = hit[1]
            while len(found) > _MAX_FOUND:
                del found[next(iter(found))]
    else:
        block_hash, slot = args
        if block_hash not in found:
            raise IntegrityError(f"rank {rank}: rank 0 restored the checkpoint of {block_hash!r} from its "
                                 f"tiers, this rank's tiers do not hold it: the tiers diverged")
        below.restore(slot, found.pop(block_hash), block_hash)


def apply_state_call(states: Any, name: str, args: tuple, expected: Any, rank: int) -> None:
    """Apply one logged call of rank 0's states to this rank's ``states`` (its ``RequestStates``): a pool call
    to its ``StatePool`` (IntegrityError when it raises here or returns another result than rank 0's), a
    mover call to its shard of the state buffers. IntegrityError for a rank that keeps no state."""
    if states is None:
        raise IntegrityError(f"rank {rank}: rank 0 shipped {name} but this rank's model keeps no state")
    call = name[len(_PREFIX):]
    if call in TIER_CALLS:
        _apply_tier_call(states, call, args, rank)
        return
    if call in MOVER_CALLS:
        if states.mover is not None:
            getattr(states.mover, call)(*args)
        return
    follow_call(getattr(states.pool, call), name, args, {}, expected, rank, "state slots")


def state_digest(states: StateSide) -> bytes:
    """32 bytes naming every state slot's ref count of ``states`` (a hybrid's ``RequestStates``, or
    :data:`~kvpool.requests.no_state.NO_STATE`: 32 zero bytes), after the slot pool's own integrity check
    (IntegrityError): ``states.slots_digest()``."""
    return states.slots_digest()


def check_batch_slots(states: StateSide, batch: Any, rank: int) -> None:
    """Every state slot a step reads or writes (each request's, each save's checkpoint) is in use in this
    rank's slot pool (``states``: its state side); IntegrityError otherwise."""
    saves = batch.state_saves or []
    free = states.free_among([*(batch.state_slots or ()), *(c for cuts in saves for _, c in cuts)])
    if free:
        raise IntegrityError(f"rank {rank}: the step uses state slot {free[0]}, which this rank's slot pool "
                             f"holds free")
