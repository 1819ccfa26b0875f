"""Model types tensor parallelism shards beyond the Llama family's layout: Llama 4 text (its dense MLPs are
``feed_forward``, its first layers chunked-local attention), against transformers and one process as
tests/test_tp.py checks tiny-llama and tiny-qwen2."""

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
