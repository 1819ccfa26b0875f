"""The replay's state kinds (:mod:`kvpool.trace.replay_state`): a config's ``state_save`` chooses one once,
and the replay asks it for its state side instead of asking whether the model is a hybrid."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from kvpool.errors import ConfigError
from kvpool.requests.budget import BudgetConfig
from kvpool.requests.state_checkpoints import RequestStates
from kvpool.trace.loaders import TraceRequest
from kvpool.trace.replay import ReplayConfig, run_replay
from kvpool.trace.replay_state import NO_REPLAY_STATE, RecurrentReplayState


def _never() -> None:
    raise AssertionError("a replay without state makes no eviction policy for it")


def test_a_config_without_state_save_keeps_no_state() -> None:
    config = ReplayConfig()
    assert config.state is NO_REPLAY_STATE
    assert (config.state.save, config.state.checkpoints, config.state.budget) == (None, None, None)
    assert config.state.request_states(16, 4, _never) == (None, None)
    with pytest.raises(ConfigError, match="^needs a state$"):
        config.state.require("needs a state")


def test_a_hybrid_config_holds_its_save_policy_and_bound() -> None:
    # "interval=4" is SavePolicy's canonical text of an interval of 4 blocks; the bound 3 a plain count
    config = ReplayConfig(state_save=" Interval=4 ", state_checkpoints=3)
    assert config.state == RecurrentReplayState("interval=4", 3)
    assert (config.state_save, config.state_checkpoints) == ("interval=4", 3)
    config.state.require("never raised")
    made = []
    states, budget = config.state.request_states(16, 5, lambda: made.append(1) or "lru")
    assert isinstance(states, RequestStates) and budget is None and made == [1]
    assert (states.pool.num_slots, states.checkpoints.capacity, str(states.policy)) == (5, 3, "interval=4")


def test_a_config_copy_and_pickle_keep_the_kind() -> None:
    config = ReplayConfig(state_save="tail")
    assert dataclasses.replace(config, block_size=32).state == RecurrentReplayState("tail")
    assert dataclasses.replace(config, state_save=None).state is NO_REPLAY_STATE
    assert pickle.loads(pickle.dumps(config)).state == config.state


#: A budget of 10,000 B: 1 state slot of 1,000 B and KV blocks of 100 B.
BUDGET = BudgetConfig("sglang-ratio", 10_000, 100, 1_000, 1)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"state_checkpoints": 2}, "state_checkpoints needs a state_save policy"),
    ({"state_budget": BUDGET}, "state_budget needs a state_save"),
    ({"state_save": "tail", "state_checkpoints": 2, "state_budget": BUDGET}, "sizes the state_checkpoints"),
    ({"state_save": "tail", "state_checkpoints": 0}, "state_checkpoints"),
    ({"state_save": "every-other"}, "state_save"),
])
def test_state_options_that_do_not_go_together(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ReplayConfig(**kwargs)


def test_a_replay_of_either_kind_reports_its_state() -> None:
    """The replay builds the state side its kind gives: with ``tail`` each request holds a slot while it
    runs (instant timing: one at a time, so 1 at peak) and the first one's tail is saved once its prompt's
    blocks are published; without it the report holds no state."""
    requests = [TraceRequest(0.0, 1024, 4, (1, 2)), TraceRequest(1.0, 1024, 4, (1, 2))]
    hybrid = run_replay(requests, ReplayConfig(num_blocks=400, state_save="tail"))
    plain = run_replay(requests, ReplayConfig(num_blocks=400))
    assert (hybrid.state_save, hybrid.state_slots_peak, hybrid.checkpoints_saved >= 1) == ("tail", 1, True)
    assert (plain.state_save, plain.state_slots_peak, plain.checkpoints_saved) == (None, 0, 0)
