"""Model types tensor parallelism shards beyond the Llama family's layout: GPT-2 (Conv1D projections, a fused
``c_attn``) and Llama 4 text (its dense MLPs are ``feed_forward``, its first layers chunked-local attention),
against transformers and one process as tests/test_tp.py checks tiny-llama and tiny-qwen2."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import _tp_helpers as helpers  # noqa: E402
import torch  # noqa: E402

from kvpool.engine.launch import launch  # noqa: E402
from kvpool.engine.models import load_model, reference_greedy  # noqa: E402
from kvpool.engine.sharding import check_shardable  # noqa: E402
from kvpool.errors import ConfigError  # noqa: E402


def test_llama4_checks() -> None:
    config = load_model("tiny-llama4").model.config.to_dict()  # moe_layers [], intermediate_size_mlp 128
    check_shardable(config, 2)
    with pytest.raises(ConfigError, match="does not divide intermediate_size 126"):
        check_shardable({**config, "intermediate_size_mlp": 126}, 4)  # the dense MLPs' size, not the experts'
    with pytest.raises(ConfigError, match="not the 1 experts of 'llama4_text'"):
        check_shardable({**config, "moe_layers": [1, 3]}, 2)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tp2_tiny_llama4_matches_one_process_and_transformers() -> None:
    # (the preemption scenarios' 14 blocks hold no prompt of its 4 KV cache groups)
    scenario = "batch then prefix hits"
    (got, ship), = launch(helpers.run_scenarios, 2, ["tiny-llama4"], [scenario])["tiny-llama4"].values()
    single = helpers.run_scenarios(None, ["tiny-llama4"], [scenario])["tiny-llama4"][scenario][0]
    model = helpers.build_model("tiny-llama4")
    prompts = [p for call in helpers.SCENARIOS[scenario][1] for p in call]
    for prompt, tokens, logits in zip(prompts, got["tokens"], got["logits"], strict=True):
        ref_tokens, ref_logits = reference_greedy(model, prompt, helpers.NEW)  # transformers' own
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert single["stats"][0] > 0  # prefix hits happened
    assert got["tokens"] == single["tokens"] and got["stats"] == single["stats"]  # the same decisions
    assert got["all_free"] == single["all_free"] and ship["steps"] == got["stats"][-1]


def test_sharded_gpt2_computes_the_whole_models_logits_and_a_wrong_shard_diverges() -> None:
    # GPT-2's Conv1D projections become linear layers: its fused c_attn split by head in each of q, k, v
    from _tp_threads import forward_on_threads, shards_match_whole

    from kvpool.engine.sharding import _keep_rows
    from kvpool.engine.sharding_gpt2 import _as_linear

    model = load_model("tiny-gpt2", seed=1).model
    shards, ids, whole = shards_match_whole(model)
    attn = shards[1].transformer.h[0].attn
    assert attn.c_attn.weight.shape == (3 * 32, 64) and attn.num_heads == 2  # 4 heads of 16 over 2 ranks
    # control: rank 1's c_attn keeps rank 0's heads (its output projection and MLP as they should be)
    for block, original in zip(shards[1].transformer.h, model.transformer.h, strict=True):
        block.attn.c_attn = _as_linear(original.attn.c_attn)
        _keep_rows(block.attn.c_attn, torch.cat([torch.arange(32) + 64 * i for i in range(3)]))
    for logits in forward_on_threads(shards, ids):
        assert (logits - whole).abs().max() > 1e-2


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cli_generate_tp2_on_gpt2_is_token_identical_to_tp1_and_transformers() -> None:
    from _tp_threads import assert_same_tokens_as_transformers, cli_tp1_tp2

    one, two = cli_tp1_tp2("tiny-gpt2", ["the fused attention is split by head", "the fused attention"])
    assert_same_tokens_as_transformers(one, two)


def test_sharded_gemma4_computes_the_whole_models_logits_and_a_wrong_shard_diverges() -> None:
    # Gemma 4: its full layers' K = V (no v_proj, 1 KV head of 64, replicated), its last 2 layers read the KV
    # of layers 3 and 2 (no k_proj: the source's KV shard serves), per-layer inputs whole on every rank
    from _tp_threads import forward_on_threads, shards_match_whole

    model = load_model("tiny-gemma4", seed=1).model
    shards, ids, whole = shards_match_whole(model)  # crosses the window
    full = shards[1].model.layers[2].self_attn
    assert full.k_proj.weight.shape == (64, 64) and full.q_proj.weight.shape == (2 * 64, 64)
    # control: rank 1's full layers keep rank 0's query heads
    with torch.no_grad():
        for i in (2, 5):
            rank_0s = model.model.layers[i].self_attn.q_proj.weight[:128]
            shards[1].model.layers[i].self_attn.q_proj.weight.copy_(rank_0s)
    for logits in forward_on_threads(shards, ids):
        assert (logits - whole).abs().max() > 1e-2


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cli_generate_tp2_on_gemma4_is_token_identical_to_tp1_and_transformers() -> None:
    from _tp_threads import assert_same_tokens_as_transformers, cli_tp1_tp2

    prompts = ["the shared layers read their source's shard of the keys", "the shared layers read",
               "the shared layers read their source's shard of the keys"]
    one, two = cli_tp1_tp2("tiny-gemma4", prompts)
    assert_same_tokens_as_transformers(one, two)
