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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.errors import IntegrityError, KVPoolError
from kvpool.requests.no_state import StateSide

#: The ``StatePool`` calls that change it, and the mover's, logged as ``state.<name>``.
POOL_CALLS = ("alloc", "incref", "free", "clear")
MOVER_CALLS = ("zero_slots", "copy_slots")
_PREFIX = "state."


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


def record_states(states: Any, recorder: Any) -> None:
    """Put recorders in front of ``states``' slot pool (its requests' and its checkpoints') and its mover
    (a :class:`~kvpool.requests.state_checkpoints.RequestStates` of rank 0); ``recorder``: the
    :class:`~kvpool.engine.pool_log.RecordingPool` whose log ships."""
    states.wrap_pool(lambda pool: _Recorder(pool, recorder, POOL_CALLS))
    if states.mover is not None:
        states.mover = _Recorder(states.mover, recorder, MOVER_CALLS)


def is_state_call(name: str) -> bool:
    """Whether a logged call is one of :func:`record_states`' (a follower applies it:
    :func:`apply_state_call`)."""
    return name.startswith(_PREFIX) and name[len(_PREFIX):] in POOL_CALLS + MOVER_CALLS


def apply_state_call(states: Any, name: str, args: tuple, expected: Any, rank: int) -> None:
    """Apply one logged call of rank 0's states to this rank's ``states`` (its ``RequestStates``): a pool call
    to its ``StatePool`` (IntegrityError when it raises here or returns another result than rank 0's), a
    mover call to its shard of the state buffers. IntegrityError for a rank that keeps no state."""
    if states is None:
        raise IntegrityError(f"rank {rank}: rank 0 shipped {name} but this rank's model keeps no state")
    call = name[len(_PREFIX):]
    if call in MOVER_CALLS:
        if states.mover is not None:
            getattr(states.mover, call)(*args)
        return
    try:
        result = getattr(states.pool, call)(*args)
    except KVPoolError as exc:
        raise IntegrityError(f"rank {rank}: rank 0's {name} raised here ({exc}): the state slots diverged") \
            from exc
    if result != expected:
        raise IntegrityError(f"rank {rank}: {name} returned {result!r} where rank 0's returned {expected!r}: "
                             f"the state slots diverged")


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
