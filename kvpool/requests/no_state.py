"""The state side of a model that keeps no recurrent state: :class:`NoRecurrentState`.

:class:`~kvpool.requests.kv_manager.KVCacheManager` drives a request's state through one object
(:attr:`~kvpool.requests.kv_manager.KVCacheManager.state`) whatever the model: a recurrent hybrid's
:class:`~kvpool.requests.state_checkpoints.RequestStates` (a state slot per running request, checkpoints
at block boundaries), or this one, whose answers are those of a model without recurrent layers. So the
request path asks the state side ("is a slot free?", "how far does a hit reach?", "save what was planned")
instead of asking whether the model is a hybrid. Adding another kind of per-request state is one class with
these members and its tests.

The members a state side has (:class:`StateSide`):

* ``has_free_slot``: whether a new request can get its state now (always, without a state);
* ``joint_blocks(req, k)``: the longest prefix of at most k hit blocks whose state can be restored
  (k: a prefix of KV alone needs nothing more);
* ``admit`` / ``plan`` / ``commit`` / ``free``: a request's state taken, its saves planned for a step,
  committed once the step's blocks are published, given back (nothing to do without a state);
* ``follows_each_step``: whether every step must reach ``plan`` and ``commit`` (so a publish with no new
  block cannot be skipped and decode steps cannot be batched into one pool call): False here;
* ``block_aligned_hits``: whether a hit must end at a block boundary (a state is checkpointed there only,
  so no partial hit can end inside a block): False here;
* ``join(group, sink, admission)``: the KV side's event sink and admission taken as the state's own group;
* ``clear()`` (what an emptied cache drops) and ``check_integrity()``;
* ``check_block_size(b)`` (ConfigError when checkpoints at another block size than the KV groups' b),
  ``tiers_under(tiers, data=...)`` (checkpoint tiers), ``pin(hashes)`` / ``unpin_all()`` (a pinned
  prefix's checkpoints), ``wrap_pool(wrap)`` (a tensor-parallel leader's recorder in front of the slot
  pool); nothing to do without a state;
* ``batch_slots(reqs)``: a step's state slots and saves, in request order (``(None, None)`` without a
  state), and ``stats_entries()`` / ``replay_fields(state_save)``: what a run's stats and a replay's result
  hold of the state (``{}`` without one);
* ``slots_digest()`` (32 bytes naming every slot's ref count; zeros without a state) and
  ``free_among(slots)`` (the slots a step uses that the slot pool holds free): what tensor-parallel ranks
  compare.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvpool.requests.request import Request


class StateSide(Protocol):
    """What :class:`~kvpool.requests.kv_manager.KVCacheManager` asks of a request's state (see the module
    docstring)."""

    follows_each_step: bool
    block_aligned_hits: bool
    mover: Any
    below: Any

    @property
    def has_free_slot(self) -> bool: ...

    def joint_blocks(self, req: Request, k: int) -> int: ...

    def admit(self, req: Request, hit_blocks: int, kv_blocks: int, *, first: bool) -> int: ...

    def plan(self, req: Request, start: int, end: int) -> None: ...

    def commit(self, req: Request) -> None: ...

    def free(self, req: Request) -> None: ...

    def join(self, group: int, sink: Any = None, admission: Any = None) -> None: ...

    def clear(self) -> None: ...

    def check_integrity(self) -> None: ...

    def check_block_size(self, block_size: int) -> None: ...

    def tiers_under(self, tiers: Any, *, data: bool) -> None: ...

    def pin(self, hashes: Any) -> None: ...

    def unpin_all(self) -> None: ...

    def wrap_pool(self, wrap: Any) -> None: ...

    def batch_slots(self, reqs: Any) -> tuple[Any, Any]: ...

    def stats_entries(self) -> dict[str, object]: ...

    def replay_fields(self, state_save: str | None) -> dict[str, Any]: ...

    def slots_digest(self) -> bytes: ...

    def free_among(self, slots: Any) -> list[int]: ...


class NoRecurrentState:
    """The state side of a model without recurrent layers: every request has its (empty) state, every KV
    hit is a whole hit, nothing is saved or freed (see the module docstring)."""

    follows_each_step = False
    block_aligned_hits = False
    has_free_slot = True
    mover = None
    #: No checkpoint tiers under it.
    below = None

    def joint_blocks(self, req: Request, k: int) -> int:
        """``k``: a KV prefix needs no state beside it."""
        return k

    def admit(self, req: Request, hit_blocks: int, kv_blocks: int, *, first: bool) -> int:
        """No slot to take: -1."""
        return -1

    def plan(self, req: Request, start: int, end: int) -> None:
        """No save to plan."""

    def commit(self, req: Request) -> None:
        """No save to commit."""

    def free(self, req: Request) -> None:
        """No slot to give back."""

    def join(self, group: int, sink: Any = None, admission: Any = None) -> None:
        """No checkpoint group to join (the KV side's events and admission are the KV groups' alone)."""

    def clear(self) -> None:
        """No checkpoint to drop."""

    def check_block_size(self, block_size: int) -> None:
        """Any block size: no checkpoint to align."""

    def tiers_under(self, tiers: Any, *, data: bool) -> None:
        """No checkpoint to keep in tiers."""

    def pin(self, hashes: Any) -> None:
        """No checkpoint to pin."""

    def unpin_all(self) -> None:
        """No checkpoint pinned."""

    def wrap_pool(self, wrap: Any) -> None:
        """No slot pool to wrap (a tensor-parallel leader records nothing of a state)."""

    def batch_slots(self, reqs: Any) -> tuple[None, None]:
        """No state slots and no saves for a step's batch."""
        return None, None

    def stats_entries(self) -> dict[str, object]:
        """Nothing of a state in a run's stats."""
        return {}

    def replay_fields(self, state_save: str | None) -> dict[str, Any]:
        """Nothing of a state in a replay's result."""
        return {}

    def slots_digest(self) -> bytes:
        """32 zero bytes: no state slot."""
        return bytes(32)

    def free_among(self, slots: Any) -> list[int]:
        """No slot pool to hold a slot free: ``[]``."""
        return []

    def check_integrity(self) -> None:
        """Nothing to check."""

    def __repr__(self) -> str:
        return "NoRecurrentState()"


#: The one state side of every model without recurrent layers (it holds nothing).
NO_STATE = NoRecurrentState()
