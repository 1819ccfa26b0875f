"""Mixture-of-experts layers under tensor parallelism: every expert's MLP sharded as a dense MLP (its gate and
up units split, its down projection row-parallel), the router replicated, one all-reduce of the experts'
output; attention sinks sliced by head. Families: gpt-oss (interleaved, transposed fused experts with biases,
sinks), MiMo-V2-Flash (concatenated experts; K and V heads of other sizes; sliding layers with twice the KV
heads of the full ones), Qwen3-Next with expert layers (and a shared expert), Nemotron-H's expert layers
(experts without a gate, shared experts).

Expected values come from the whole model in one process (logits) and transformers' own greedy ``generate``
(``--check``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from _tp_threads import (  # noqa: E402
    assert_same_tokens_as_transformers,
    cli_tp1_tp2,
    forward_on_threads,
    shards_match_whole,
    threaded_ranks,
)

from kvpool.engine.models import build_tiny_model, load_model  # noqa: E402
from kvpool.engine.sharding import check_shardable  # noqa: E402
from kvpool.engine.sharding_experts import shard_experts  # noqa: E402
from kvpool.errors import ConfigError  # noqa: E402

QWEN3_NEXT_MOE = "qwen3-next with experts"
NEMOTRON_MOE = "nemotron-h with experts"


def _model(name: str) -> Any:
    if name not in (QWEN3_NEXT_MOE, NEMOTRON_MOE):
        return load_model(name, seed=1).model
    from kvpool.engine.models import tiny_config

    base = "tiny-qwen3-next" if name == QWEN3_NEXT_MOE else "tiny-nemotron-h"
    config = tiny_config(base)
    if name == QWEN3_NEXT_MOE:  # every layer's MLP an experts block with a shared expert
        config.mlp_only_layers, config.num_experts, config.num_experts_per_tok = [], 4, 2
        config.moe_intermediate_size, config.shared_expert_intermediate_size = 32, 64
    else:  # Nemotron-H: its last layer an experts block without gates, with shared experts
        config.layers_block_type = ["linear_attention", "full_attention", "linear_attention", "moe"]
        config.n_routed_experts, config.num_experts_per_tok, config.n_group, config.topk_group = 4, 2, 1, 1
        config.moe_intermediate_size, config.moe_shared_expert_intermediate_size = 32, 64
    return build_tiny_model(base, seed=1, config=config).eval()


def _blocks(model: Any) -> list[tuple[Any, str]]:
    """(decoder layer, attribute) of every experts block of ``model``."""
    return [(layer, attr) for layer in model.model.layers for attr in ("mlp", "mixer")
            if hasattr(getattr(layer, attr, None), "experts")]


def _experts(model: Any) -> list[Any]:
    return [getattr(layer, attr).experts for layer, attr in _blocks(model)]


@pytest.mark.parametrize("name", ["tiny-gpt-oss", "tiny-mimo", QWEN3_NEXT_MOE, NEMOTRON_MOE])
def test_sharded_experts_compute_the_whole_models_logits_and_a_wrong_shard_diverges(name: str) -> None:
    model = _model(name)
    shards, ids, whole = shards_match_whole(model)  # crosses the window
    # rank 1 holds half of each expert's units: gpt-oss 64 / 2, the others 32 / 2 (gate + up: 2x; Nemotron-H
    # has no gate)
    units = {"tiny-gpt-oss": 32}.get(name, 16)
    for experts in _experts(shards[1]):
        up = experts.gate_up_proj if experts.has_gate else experts.up_proj
        assert (2 if experts.has_gate else 1) * units in up.shape and units in experts.down_proj.shape[1:]
    # control: rank 1's experts keep rank 0's units (its attention and the rest as they should be)
    hook = next(iter(_experts(shards[1])[0]._forward_hooks.values()))
    for (layer, attr), (original, _) in zip(_blocks(shards[1]), _blocks(model), strict=True):
        experts = copy.deepcopy(getattr(original, attr).experts)
        shard_experts(experts, 0, 2, lambda t: None)
        experts._forward_hooks.clear()
        experts.register_forward_hook(hook)  # rank 1's all-reduce
        getattr(layer, attr).experts = experts
    for logits in forward_on_threads(shards, ids):
        assert (logits - whole).abs().max() > 1e-2


def test_a_rank_holding_the_wrong_attention_sinks_diverges() -> None:
    model = _model("tiny-gpt-oss")
    ids = torch.randint(0, 256, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids).logits
    shards = threaded_ranks(model, 2)
    assert shards[1].model.layers[0].self_attn.sinks.shape == (2,)  # 4 query heads over 2 ranks
    with torch.no_grad():
        for layer, original in zip(shards[1].model.layers, model.model.layers, strict=True):
            layer.self_attn.sinks.copy_(original.self_attn.sinks[:2])  # rank 0's heads' sinks
    for logits in forward_on_threads(shards, ids):
        assert (logits - whole).abs().max() > 1e-3


def test_expert_tp_checks() -> None:
    gpt_oss = load_model("tiny-gpt-oss").model.config.to_dict()  # experts of 64 units
    check_shardable(gpt_oss, 2)
    with pytest.raises(ConfigError, match="does not divide intermediate_size 60"):  # gpt-oss's: the experts'
        check_shardable({**gpt_oss, "intermediate_size": 60, "num_attention_heads": 8}, 8)
    mimo = load_model("tiny-mimo").model.config.to_dict()  # experts of 32 units, dense MLPs of 128
    with pytest.raises(ConfigError, match="does not divide the experts' moe_intermediate_size 30"):
        check_shardable({**mimo, "moe_intermediate_size": 30}, 4)

    class Experts(torch.nn.Module):  # fused experts without transformers' layout flags
        gate_up_proj = torch.zeros(4, 8, 16)

    with pytest.raises(ConfigError, match="not fused experts of transformers' layout"):
        shard_experts(Experts(), 0, 2, lambda t: None)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["tiny-gpt-oss", "tiny-mimo"])
def test_cli_generate_tp2_on_experts_is_token_identical_to_tp1_and_transformers(name: str) -> None:
    prompts = ["the experts are sharded by unit, the router is whole", "the experts are sharded by unit",
               "each rank sums its share of every expert"]
    one, two = cli_tp1_tp2(name, prompts)
    assert_same_tokens_as_transformers(one, two)
    assert [r["matches_reference"] for r in one["requests"]] == [True] * 3
