"""Recurrent hybrids under tensor parallelism: the recurrent mixers sharded by head like the KV, each rank's
state shard in its own state slots, rank 0's slot decisions and state moves shipped in the pool log.

Expected tokens come from transformers' own greedy ``generate`` on the whole model in one process, and the
counters from the single-process engine on the same requests (rank 0 makes the same decisions).
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import _tp_hybrid_helpers as helpers  # noqa: E402
from _tp_threads import forward_on_threads as _forward_on_threads  # noqa: E402
from _tp_threads import shards_match_whole  # noqa: E402
from _tp_threads import threaded_ranks as _threaded_ranks  # noqa: E402

from kvpool.allocators.state_pool import StatePool  # noqa: E402
from kvpool.engine.launch import launch  # noqa: E402
from kvpool.engine.models import load_model, reference_greedy  # noqa: E402
from kvpool.engine.pool_log import replay  # noqa: E402
from kvpool.engine.sharding import _keep_rows, _row_parallel, check_shardable  # noqa: E402
from kvpool.engine.sharding_recurrent import shard_recurrent_mixer  # noqa: E402
from kvpool.engine.tp_state import check_batch_slots, record_states, state_digest  # noqa: E402
from kvpool.errors import ConfigError, IntegrityError  # noqa: E402
from kvpool.requests.state_checkpoints import RequestStates, StateCheckpoints  # noqa: E402
from kvpool.spec.memory import ModelMemory  # noqa: E402

HYBRIDS = ("tiny-qwen3-next", "tiny-qwen3.5")


@pytest.mark.parametrize("name", HYBRIDS)
def test_sharded_hybrid_computes_the_whole_models_logits(name: str) -> None:
    model = load_model(name, seed=1).model
    shards, ids, whole = shards_match_whole(model, 11)
    # each rank's mixer holds the state the per-rank spec sizes: conv channels and SSM heads halved
    spec = ModelMemory.from_config(model.config.to_dict(), tp_size=2).state
    for layer in spec.layers:
        mixer = shards[1].model.layers[layer].linear_attn
        assert mixer.conv1d.weight.shape[0] == spec.conv_shape[0]  # (2 * 2 * 8 + 4 * 8) / 2 = 32
        assert mixer.num_v_heads == spec.ssm_shape[0] == 2


def test_a_rank_holding_the_wrong_heads_of_its_state_diverges() -> None:
    # control: rank 1's mixers keep rank 0's heads (its state shard is rank 0's), everything else as it
    # should be: the ranks' sums miss half the heads
    model = load_model("tiny-qwen3-next", seed=1).model
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids).logits
    shards = _threaded_ranks(model, 2)
    all_reduce = shards[1].model.layers[0].mlp.down_proj.all_reduce  # rank 1's

    def row_parallel(linear: Any, columns: slice) -> Any:
        return _row_parallel(linear, columns, all_reduce)

    for layer, original in zip(shards[1].model.layers, model.model.layers, strict=True):
        if hasattr(layer, "linear_attn"):
            layer.linear_attn = copy.deepcopy(original.linear_attn)
            shard_recurrent_mixer(layer.linear_attn, 0, 2, row_parallel, _keep_rows)
    for logits in _forward_on_threads(shards, ids):
        assert (logits - whole).abs().max() > 1e-2


def test_hybrid_tp_checks() -> None:
    config = load_model("tiny-qwen3-next", seed=1).model.config.to_dict()  # 2 key heads, 4 value heads
    check_shardable(config, 2)
    with pytest.raises(ConfigError, match="does not divide"):
        check_shardable(config, 4)  # 4 query heads, but 2 GDN key heads
    with pytest.raises(ConfigError, match="not 'jamba'"):  # Mamba-1: not sharded
        check_shardable({**config, "model_type": "jamba"}, 2)


def _states(slots: int = 6) -> RequestStates:
    pool = StatePool(slots)
    return RequestStates("dense", 4, pool, checkpoints=StateCheckpoints(3, pool=pool))


class _Mover:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def zero_slots(self, slots: Any) -> None:
        self.calls.append(("zero", list(slots)))

    def copy_slots(self, pairs: Any) -> None:
        self.calls.append(("copy", list(pairs)))


def test_state_slot_calls_and_moves_replay_on_a_follower() -> None:
    leader, follower = _states(), _states()
    leader.mover, follower.mover = _Mover(), _Mover()
    recorder = SimpleNamespace(log=[])
    record_states(leader, recorder)
    slot = leader.pool.alloc(1)[0]
    leader.mover.zero_slots([slot])
    checkpoint = leader.checkpoints.pool.alloc(1)[0]  # the checkpoints' pool is the recorded one too
    leader.mover.copy_slots([(checkpoint, slot)])
    leader.pool.free([checkpoint])
    replay(None, recorder.log, 1, states=follower)
    assert follower.mover.calls == [("zero", [slot]), ("copy", [(checkpoint, slot)])]
    assert state_digest(follower) == state_digest(leader) != state_digest(_states())
    check_batch_slots(follower, SimpleNamespace(state_slots=[slot], state_saves=[[]]), 1)
    with pytest.raises(IntegrityError, match="holds free"):
        check_batch_slots(follower, SimpleNamespace(state_slots=[slot], state_saves=[[(4, checkpoint)]]), 1)


def test_a_follower_whose_slots_diverged_is_caught() -> None:
    leader, follower = _states(), _states()
    recorder = SimpleNamespace(log=[])
    record_states(leader, recorder)
    follower.pool.alloc(1)  # a slot rank 0 never took
    leader.pool.alloc(1)
    with pytest.raises(IntegrityError, match="state slots diverged"):
        replay(None, recorder.log, 1, states=follower)
    with pytest.raises(IntegrityError, match="keeps no state"):
        replay(None, recorder.log, 1, states=None)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tp2_hybrid_matches_one_process_and_transformers_and_a_broken_shard_diverges() -> None:
    name = "tiny-qwen3-next"
    model = helpers.build(name)
    refs = [reference_greedy(model, p, helpers.NEW)[0] for call in helpers.CALLS for p in call]
    single = helpers.run_hybrid(None, name)
    assert single["tokens"] == refs and single["checkpoint_hits"] > 0  # restores happened
    tp2 = launch(helpers.run_hybrid, 2, name)
    assert tp2 == single  # tokens, checkpoint hits and saves, prefix hits, steps
    broken = launch(helpers.run_hybrid, 2, name, True)
    assert broken["tokens"] != refs


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cli_generate_tp2_on_a_hybrid_is_token_identical_to_tp1_and_transformers() -> None:
    from test_tp import cli

    prompts = ["the recurrent state is sharded by head", "the recurrent state is sharded by rank",
               "the recurrent state is sharded by head"]
    args = ["--model", "tiny-qwen3-next", "--max-new-tokens", "8", "--block-size", "4", "--state-save",
            "dense", "--json", "--check", *(a for p in prompts for a in ("--prompt", p))]
    one, two = cli(*args), cli(*args, "--tp-size", "2")
    (out1, err1), (out2, err2) = (p.communicate(timeout=300) for p in (one, two))
    assert one.returncode == 0 and two.returncode == 0, (err1[-2000:], err2[-2000:])
    report1, report2 = json.loads(out1), json.loads(out2)
    assert all(r["matches_reference"] for r in report2["requests"])  # transformers' own generate
    assert [r["output_token_ids"] for r in report2["requests"]] == \
        [r["output_token_ids"] for r in report1["requests"]]
    assert report2["stats"]["tp_size"] == 2
    # the same slot and checkpoint decisions (rank 0 decides as the one process does)
    assert report2["stats"]["recurrent_state"] == report1["stats"]["recurrent_state"]
    assert report2["stats"]["recurrent_state"]["checkpoints_saved"] > 0


def test_a_rank_without_state_digests_zeros_and_checks_no_slot() -> None:
    # A model without recurrent layers: its state side (NO_STATE) names no slot, so every rank gives the
    # same 32 zero bytes (what the digest was for a stateless rank) and a batch without slots passes.
    from kvpool.requests.no_state import NO_STATE

    assert state_digest(NO_STATE) == bytes(32)
    check_batch_slots(NO_STATE, SimpleNamespace(state_slots=None, state_saves=None), 1)


def _tiered_states(seed: int, tier_rows: int = 4) -> RequestStates:
    """States over a 3-slot state cache of random contents (``seed``: this rank's shard), one checkpoint
    slot, a host rows tier under the checkpoints."""
    from kvpool.spec.state import RecurrentKind, RecurrentStateSpec
    from kvpool.storage.state import RecurrentStateCache
    from kvpool.tiers.backend import Namespace
    from kvpool.tiers.host_rows import HostRowsTier

    cache = RecurrentStateCache(RecurrentStateSpec(RecurrentKind.MAMBA2, (0,), (4, 3), (2, 2, 2), "float32",
                                                   "float32"), 3)
    gen = torch.Generator().manual_seed(seed)
    cache.conv.copy_(torch.randn(cache.conv.shape, generator=gen))
    cache.ssm.copy_(torch.randn(cache.ssm.shape, generator=gen))
    pool = StatePool(3)
    states = RequestStates("dense", 4, pool, checkpoints=StateCheckpoints(1, pool=pool), mover=cache)
    states.checkpoints.group = 1
    states.tiers_under([HostRowsTier(tier_rows, Namespace("t", "f32", "rows", layer_group=1),
                                     cache.bytes_per_slot)], data=True)
    return states


def test_checkpoint_tier_calls_replay_on_a_follower() -> None:
    """Rank 0 evicts checkpoint 7 into its tier (slot 0's rows), finds it there and restores it into slot
    1: a follower replaying the log stores its own slot 0 (its shard: other values) and restores that, not
    rank 0's row; a follower whose tier never got the store raises IntegrityError instead of a wrong state."""
    leader, follower = _tiered_states(0), _tiered_states(1)
    own = follower.mover.read_slots([0]).clone()
    recorder = SimpleNamespace(log=[])
    record_states(leader, recorder)
    ckpt = leader.checkpoints
    ckpt.commit(7, ckpt.reserve())  # slot 0
    ckpt.commit(8, ckpt.reserve())  # evicts 7 (stored from slot 0), slot 0 again
    found = leader.below.find(7)
    slot = leader.pool.alloc(1)[0]
    leader.below.restore(slot, found[1], 7)
    assert slot == 1 and [name for name, *_ in recorder.log].count("state.tier_store") == 1
    replay(None, recorder.log, 1, states=follower)
    assert torch.equal(follower.mover.read_slots([1]), own)
    assert not torch.equal(own, leader.mover.read_slots([1]))  # the shards differ: rank 0's row is not it
    lost = _tiered_states(1)
    stores = [call for call in recorder.log if call[0] != "state.tier_store"]
    with pytest.raises(IntegrityError, match="tiers diverged"):
        replay(None, stores, 1, states=lost)
