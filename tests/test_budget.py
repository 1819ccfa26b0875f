"""One byte budget for a recurrent hybrid's KV blocks and state slots (kvpool.requests.budget): the rule
against a sequence worked by hand, the static splits against the planners' published figures, the
constraints under random traces (hypothesis), capacity following the side whose demand dominates, and
``kvpool replay --state-split``."""

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpool.cli import main
from kvpool.errors import ConfigError
from kvpool.requests.budget import BudgetConfig, Rebalancer, RebalanceRule
from kvpool.requests.state_budget import BudgetStates, StateBudget
from kvpool.spec.memory import ModelMemory
from kvpool.trace import replayer
from kvpool.trace.loaders import TraceRequest
from kvpool.trace.replay import ReplayConfig, run_replay

GIB = 2**30


@pytest.mark.parametrize("kwargs", [{"threshold": 0}, {"threshold": 1}, {"threshold": -0.1},
                                    {"threshold": 1.5}, {"threshold": float("nan")}, {"threshold": "x"},
                                    {"cooldown": -1}, {"cooldown": 1.5}, {"window": 0}, {"max_step": 0},
                                    {"max_step": 1.5}, {"cache": -0.1}, {"cache": 2}])
def test_bad_rule_is_a_config_error(kwargs):
    with pytest.raises(ConfigError):
        RebalanceRule(**kwargs)


def test_bad_budget_is_a_config_error():
    with pytest.raises(ConfigError, match="state split"):
        BudgetConfig("half", 10_000, 100, 1_000, 1)
    with pytest.raises(ConfigError, match="cannot hold"):  # 10 slots of 1,000 B + 2 blocks > 10,000 B
        BudgetConfig("rebalanced", 10_000, 100, 1_000, 10)
    with pytest.raises(ConfigError):
        BudgetConfig("rebalanced", 10_000, 0, 1_000, 1)


def test_rule_against_a_hand_computed_sequence():
    # budget 1,000 B; moves over 100 B (threshold 0.1), of at most 300 B (max_step 0.3), 3 steps apart,
    # demand over a window of 2 samples, at least 200 B (cache 0.2) split between the caches by reuse
    rule = RebalanceRule(threshold=0.1, cooldown=3, window=2, max_step=0.3, cache=0.2)
    reb = Rebalancer(rule)
    reb.sample(600, 100)
    assert reb.propose(100, 1000) == 0  # the window is not full yet
    reb.sample(400, 100)
    # in use 500 : 100 (means); spare 1000 - 600 = 400, no reuse yet: half each -> target 100 + 200 = 300;
    # 300 - 100 = 200 > 100: move 200
    assert reb.propose(100, 1000) == pytest.approx(200)
    reb.moved()
    reb.sample(700, 200, 3, 1)
    # in use 550 : 150, spare 300, reuse 3 : 1 -> target 150 + 300 / 4 = 225; 225 - 300 = -75: under 100
    assert reb.propose(300, 1000) == 0
    reb.sample(100, 50, 0, 8)
    # in use 400 : 125, spare 475, reuse 3 : 9 -> target 125 + 475 x 0.75 = 481.25; 181.25 over the
    # threshold, but 2 steps since the move < 3
    assert reb.propose(300, 1000) == 0
    reb.sample(100, 50)
    # in use 100 : 50, spare 850 -> target 50 + 637.5 = 687.5; 387.5 over, 3 steps: a step of 300
    assert reb.propose(300, 1000) == pytest.approx(300)
    reb.sample(950, 50)
    reb.sample(950, 50)
    # in use 950 : 50 leaves 0, but the caches keep 200: target 50 + 150 = 200; 200 - 600 = -400 -> -300
    assert reb.demand() == (950, 50, 3, 9)
    assert reb.propose(600, 1000) == pytest.approx(-300)


def test_static_splits_are_the_planners():
    hybrid = ModelMemory.from_config("qwen3-next-80b-a3b").hybrid
    block = 12 * 2 * 2 * 256 * 2 * 16  # 12 attention layers x (K, V) x 2 KV heads x 256 x 2 B x 16 tokens
    # docs/state-pools.md (the doc-test): 40 GiB holds 50 requests of 32K tokens in vLLM's one pool
    vllm = BudgetConfig.plan("vllm-one-pool", hybrid, 40 * GIB, block, 32768)
    assert vllm.state_slots == 50 and vllm.state_bytes == 39_518_208
    # SGLang: 40 GiB x 0.9 / 1.9 = 20,344,581,928 B // 39,518,208 B = 514 slots
    assert BudgetConfig.plan("sglang-ratio", hybrid, 40 * GIB, block, 32768).state_slots == 514
    assert BudgetConfig.plan("rebalanced", hybrid, 40 * GIB, block, 32768).state_slots == 514  # starts there


def test_budget_states_share_slots_between_requests_and_checkpoints():
    from kvpool.requests.request import Request

    states = BudgetStates("dense", 4, 3, 10)
    a = Request("a", None, 1, num_prompt_tokens=12, block_hashes=[1, 2, 3])
    states.admit(a, 0, 0, first=True)
    states.plan(a, 0, 12)  # dense: boundaries 1, 2 and 3; 3 slots - 1 request = 2 for saves, the third
    a.num_computed_tokens = 12  # finds both pending and is skipped
    states.commit(a)
    assert len(states.checkpoints) == 2 and states.stats.skipped == 1
    b = Request("b", None, 1, num_prompt_tokens=8, block_hashes=[1, 9])
    states.admit(b, 1, 1, first=True)  # restores boundary 1, then evicts the least recently used (2)
    assert len(states.checkpoints) == 1 and 1 in states.checkpoints and states.has_free_slot
    c = Request("c", None, 1, num_prompt_tokens=8, block_hashes=[7, 8])
    states.admit(c, 0, 0, first=True)  # the last checkpoint gives its slot to a third request
    assert len(states.checkpoints) == 0 and not states.has_free_slot
    states.free(c)
    with pytest.raises(ConfigError):
        states.set_limit(1)  # two requests run
    states.free(a)
    states.set_limit(2)
    assert len(states.checkpoints) == 0  # 2 slots - 1 request: the checkpoint went
    states.check_integrity()


def small_budget(split: str, slots: int, rule: RebalanceRule | None = None) -> BudgetConfig:
    # a KV block of 100 B, a state of 1,000 B, a budget of 20,000 B: 200 blocks were it all KV
    return BudgetConfig(split, 20_000, 100, 1_000, slots, rule or RebalanceRule(0.05, 0, 1))


def replay(requests, budget: BudgetConfig, **kwargs):
    cfg = ReplayConfig(block_size=4, num_blocks=200, timing="trace", state_save="dense", state_budget=budget,
                       max_batched_tokens=64, step_s=0.01, prefill_token_s=0, decode_token_s=0, **kwargs)
    return run_replay(requests, cfg)


class CheckedBudget(StateBudget):
    """Checks the constraints around every move: the budget, and each running request's blocks and
    slot untouched."""

    def before_step(self) -> None:
        running = self._sched.running
        before = {r.request_id: (self._kv.block_tables(r), self.states.slot(r)) for r in running}
        super().before_step()
        self.check_integrity()
        assert self.kv_blocks * 100 + self.slots * 1_000 <= 20_000
        for r in running:
            assert (self._kv.block_tables(r), self.states.slot(r)) == before[r.request_id]
        for table in (t for r in running for t in self._kv.block_tables(r)):
            assert all(self._kv.pool.ref_count(b) >= 1 for b in table)


@settings(max_examples=40)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 40), st.integers(1, 30), st.integers(0, 3)),
                min_size=1, max_size=25),
       st.integers(1, 12), st.floats(0.01, 0.5), st.integers(0, 4), st.integers(1, 4))
@example([(0, 12, 1, 1), (0, 4, 1, 0), (0, 1, 10, 0), (0, 5, 1, 0)], 1, 0.125, 0, 1)
# a move to the state side once left the head of an empty batch no room:
@example([(0, 16, 1, 0), (2, 12, 30, 1), (0, 1, 1, 0), (0, 16, 1, 2), (1, 1, 2, 0), (0, 5, 1, 0)], 1, 0.125,
         0, 1)
def test_constraints_always_fit(rows, slots, threshold, cooldown, window):
    requests = [TraceRequest(t / 10, n, out, hash_ids=(p, 100 + t)) for t, n, out, p in rows]
    rule = RebalanceRule(threshold, cooldown, window, max_step=0.2, cache=0.2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replayer, "StateBudget", CheckedBudget)
        result = replay(requests, small_budget("rebalanced", slots, rule))
    b = result.state_budget
    assert result.requests_completed + result.requests_rejected == len(requests)
    assert b["constraint_refusals"] == 0
    assert 1 <= b["state_slots_min"] <= b["state_slots_max"] <= 19  # (20,000 - 2 x 100) // 1,000


def test_capacity_moves_to_the_side_whose_demand_dominates():
    # 40 short requests at once (8 prompt tokens, 2 blocks each at most): the state slots are the demand
    many = [TraceRequest(0.0, 8, 2, hash_ids=(i,)) for i in range(40)]
    result = replay(many, small_budget("rebalanced", 2))
    b = result.state_budget
    assert b["state_slots_end"] > 2 and b["peak_running"] > 2 and b["moves"] >= 1
    static = replay(many, small_budget("vllm-one-pool", 2)).state_budget
    assert static["peak_running"] == 2 and b["mean_running"] > static["mean_running"]
    # two long requests (160 + 100 tokens: 65 blocks each at the peak), starting with 15 slots (150 blocks'
    # worth): the KV is the demand, the slots go back to it
    long = [TraceRequest(0.0, 160, 100, hash_ids=(i,)) for i in range(2)]
    b = replay(long, small_budget("rebalanced", 15)).state_budget
    assert b["state_slots_end"] < 15 and b["state_slots_min"] < 15


def test_static_split_rejects_what_its_kv_side_never_holds():
    # 15 slots leave 20,000 - 15,000 = 5,000 B: 50 blocks; a request of 260 tokens needs 65
    result = replay([TraceRequest(0.0, 160, 100, hash_ids=(1,))], small_budget("sglang-ratio", 15))
    assert result.requests_rejected == 1 and result.state_budget["moves"] == 0


def test_cli_state_split_all(capsys):
    code = main(["replay", "--max-requests", "20", "--timing", "trace", "--model-config",
                 "qwen3-next-80b-a3b", "--gpu-memory", "80GiB", "--non-kv-memory", "60GiB", "--state-split",
                 "all", "--json"])
    assert code == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [r["split"] for r in runs] == ["vllm-one-pool", "sglang-ratio", "rebalanced"]
    assert len({r["budget_bytes"] for r in runs}) == 1 and all(r["constraint_refusals"] == 0 for r in runs)
    assert runs[1]["moves"] == 0 and runs[1]["state_slots_start"] == runs[1]["state_slots_end"]


@pytest.mark.parametrize("argv, message", [
    (["--state-split", "rebalanced"], "--state-split needs"),
    (["--model-config", "qwen3-next-80b-a3b", "--gpu-memory", "80GiB", "--state-split", "rebalanced",
      "--rebalance-threshold", "2"], "rebalance threshold"),
    (["--model-config", "qwen3-next-80b-a3b", "--gpu-memory", "80GiB", "--state-split", "rebalanced",
      "--rebalance-cooldown", "-1"], "rebalance cooldown"),
    (["--model-config", "qwen3-next-80b-a3b", "--gpu-memory", "80GiB", "--state-split", "rebalanced",
      "--rebalance-cache", "1.5"], "rebalance cache"),
])
def test_cli_bad_split_options(capsys, argv, message):
    assert main(["replay", "--max-requests", "5", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
