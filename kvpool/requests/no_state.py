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
* ``join(group, sink, admission)``: the KV side's event sink and admission taken as the state's own group;
* ``clear()`` (what an emptied cache drops) and ``check_integrity()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvpool.requests.request import Request


class StateSide(Protocol):
    """What :class:`~kvpool.requests.kv_manager.KVCacheManager` asks of a request's state (see the module
    docstring)."""

    follows_each_step: bool

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


class NoRecurrentState:
    """The state side of a model without recurrent layers: every request has its (empty) state, every KV
    hit is a whole hit, nothing is saved or freed (see the module docstring)."""

    follows_each_step = False
    has_free_slot = True

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

    def check_integrity(self) -> None:
        """Nothing to check."""

    def __repr__(self) -> str:
        return "NoRecurrentState()"


#: The one state side of every model without recurrent layers (it holds nothing).
NO_STATE = NoRecurrentState()
