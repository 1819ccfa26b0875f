"""What a replay keeps of a model's recurrent state, one class per kind (as the spec's
:mod:`kvpool.spec.state_kind` and the request path's :mod:`kvpool.requests.no_state`):
:class:`RecurrentReplayState` (an attention / recurrent hybrid's state slots and checkpoints, under a save
policy) and :class:`NoReplayState` (nothing: :data:`NO_REPLAY_STATE`).

:attr:`ReplayConfig.state <kvpool.trace.replay_config.ReplayConfig.state>` is one of them, chosen once
from the config's ``state_save`` by :func:`replay_state`. The replayer and ``kvpool replay --state-split``
ask it instead of asking whether the model is a hybrid. Each answers with the same members:

* ``save`` / ``checkpoints`` / ``budget``: the save policy (its canonical text), the checkpoints held at
  most, the one budget of KV and state (None each without a state);
* ``request_states(block_size, slots, eviction)``: the state side the replay's
  :class:`~kvpool.requests.kv_manager.KVCacheManager` takes and the :class:`StateBudget` that sizes it
  (``(None, None)`` without a state);
* ``require(message)``: nothing with a state, ConfigError(``message``) without one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from kvpool.allocators.policy_base import EvictionPolicy
from kvpool.allocators.state_pool import StatePool
from kvpool.errors import ConfigError
from kvpool.numeric import as_optional_int
from kvpool.requests.budget import BudgetConfig
from kvpool.requests.state_budget import StateBudget
from kvpool.requests.state_checkpoints import RequestStates, SavePolicy, StateCheckpoints


@dataclass(frozen=True)
class RecurrentReplayState:
    """A recurrent hybrid's state in a replay (see the module docstring): each running request holds a
    state slot, and a prefix is a hit only up to a state checkpoint.

    Attributes:
        save: the save policy (``tail``, ``dense``, ``interval=N``, ``tail+junction``:
            :class:`~kvpool.requests.state_checkpoints.SavePolicy`), kept as its canonical text.
        checkpoints: checkpoints held at most (evicted by the replay's policy); None: unbounded.
        budget: one budget for the KV blocks and the state slots, and its split; None: the state slots are
            the running requests' and the KV pool is the replay's own.

    Raises:
        ConfigError: an unknown save policy, a checkpoint bound under 1, or a bound given with a budget
            (the budget sizes the checkpoints itself).
    """

    save: str
    checkpoints: int | None = None
    budget: BudgetConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "save", str(SavePolicy.parse(self.save, "state_save")))
        if self.budget is not None and self.checkpoints is not None:
            raise ConfigError("state_budget needs a state_save policy and sizes the state_checkpoints itself")
        object.__setattr__(self, "checkpoints", as_optional_int(self.checkpoints, "state_checkpoints",
                                                                minimum=1, error=ConfigError))

    def request_states(self, block_size: int, slots: int, eviction: Callable[[], EvictionPolicy]
                       ) -> tuple[RequestStates, StateBudget | None]:
        """The replay's state side: :class:`RequestStates` of ``slots`` state slots (the most requests that
        run at once) and :attr:`checkpoints` evicted by ``eviction()``; with a :attr:`budget`, the
        :class:`StateBudget`'s states (its slots drawn from the budget) and the budget."""
        if self.budget is not None:
            budget = StateBudget(self.budget, self.save, block_size, eviction=eviction())
            return budget.states, budget
        checkpoints = StateCheckpoints(self.checkpoints, policy=eviction())
        return RequestStates(self.save, block_size, StatePool(slots), checkpoints=checkpoints), None

    def require(self, message: str) -> None:
        """Nothing: the replay keeps a state."""


@dataclass(frozen=True)
class NoReplayState:
    """The state part of a replay of a model without recurrent layers: nothing to hold, save or budget
    (see the module docstring). Every instance equals every other."""

    save: ClassVar[None] = None
    checkpoints: ClassVar[None] = None
    budget: ClassVar[None] = None

    def request_states(self, block_size: int, slots: int, eviction: Callable[[], EvictionPolicy]
                       ) -> tuple[None, None]:
        """``(None, None)``: the replay's requests hold KV only (``eviction`` is not called)."""
        return None, None

    def require(self, message: str) -> None:
        """ConfigError(``message``): what asks it needs a recurrent state."""
        raise ConfigError(message)


#: The state part of every replay of a model without recurrent layers.
NO_REPLAY_STATE = NoReplayState()


def replay_state(state_save: str | None, state_checkpoints: int | None = None,
                 state_budget: BudgetConfig | None = None) -> RecurrentReplayState | NoReplayState:
    """The replay's state kind for :class:`~kvpool.trace.replay_config.ReplayConfig`'s ``state_save``
    (None: a model without recurrent state), ``state_checkpoints`` and ``state_budget``: the one place the
    replay tells a hybrid from a model without state. ConfigError for a bound or a budget without a save
    policy, and as :class:`RecurrentReplayState`."""
    if state_save is not None:
        return RecurrentReplayState(state_save, state_checkpoints, state_budget)
    if state_budget is not None:
        raise ConfigError("state_budget needs a state_save policy and sizes the state_checkpoints itself")
    if state_checkpoints is not None:
        raise ConfigError("state_checkpoints needs a state_save policy (a recurrent hybrid)")
    return NO_REPLAY_STATE
