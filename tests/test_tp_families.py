"""Recurrent families under tensor parallelism beyond Gated DeltaNet: LFM2's short convolutions (sharded by
channel) and the Mamba-2 mixers of Nemotron-H, GraniteMoeHybrid (Granite 4.0-H), Bamba and Falcon-H1 (by head
and group). Each rank's mixers hold the state shapes the per-rank state spec gives (its state slots hold its
shard, as tests/test_tp_hybrid.py checks for Gated DeltaNet).

Expected values come from the whole model in one process (logits) and transformers' own greedy ``generate``
(``--check``). The tiny Bamba, Granite 4.0-H and Falcon-H1 have one Mamba-2 group, which both ranks keep
whole (Bamba's and Granite's gated norm over it reduced across the ranks); Nemotron-H's 2 groups split; a
2-group Bamba checks the split path in Bamba's layout.
"""

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
)

from kvpool.engine.models import build_tiny_model, load_config, load_model, tiny_config  # noqa: E402
from kvpool.engine.sharding import RowParallelLinear, check_shardable, shard_model  # noqa: E402
from kvpool.errors import ConfigError  # noqa: E402
from kvpool.spec.memory import ModelMemory  # noqa: E402

MAMBA2 = ("tiny-nemotron-h", "tiny-bamba", "tiny-granite-4.0-h", "tiny-falcon-h1")


def _model(name: str) -> Any:
    """The tiny model ``name`` (seed 1), or for ``"<name> 2 groups"`` its variant of 2 Mamba-2 groups."""
    if not name.endswith(" 2 groups"):
        return load_model(name, seed=1).model
    base = name.removesuffix(" 2 groups")
    config = tiny_config(base)
    config.mamba_n_groups = 2
    return build_tiny_model(base, seed=1, config=config).eval()


def _mixers(model: Any) -> dict[int, tuple[str, Any]]:
    """The recurrent mixers of ``model``, by layer: (attribute, module)."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        for name in ("conv", "mamba", "mixer"):
            module = getattr(layer, name, None)
            if module is not None and (hasattr(module, "A_log") or hasattr(module, "in_proj")):
                out[i] = (name, module)
    return out


@pytest.mark.parametrize("name", ["tiny-lfm2", *MAMBA2, "tiny-bamba 2 groups"])
def test_sharded_recurrent_family_computes_the_whole_models_logits_and_a_wrong_shard_diverges(name: str
                                                                                                ) -> None:
    model = _model(name)
    shards, ids, whole = shards_match_whole(model)
    # each rank's mixers hold the state the per-rank spec sizes (what its state slots hold)
    spec = ModelMemory.from_config(model.config.to_dict(), tp_size=2).state
    for layer, (_, mixer) in _mixers(shards[1]).items():
        conv = getattr(mixer, "conv1d", None) or mixer.conv
        assert layer in spec.layers and conv.weight.shape[0] == spec.conv_shape[0]
        if spec.ssm_shape:  # Mamba-2: heads halved (LFM2 keeps no SSM state)
            assert mixer.num_heads == spec.ssm_shape[0]
    # control: rank 1's mixers keep rank 0's channels and heads (its state shard is rank 0's)
    all_reduce = next(m for m in shards[1].modules() if isinstance(m, RowParallelLinear)).all_reduce
    for layer, (attr, _) in _mixers(shards[1]).items():
        whole_layer = copy.deepcopy(model.model.layers[layer])
        shard_model(_Layers(whole_layer, model.config), 0, 2, all_reduce)
        setattr(shards[1].model.layers[layer], attr, getattr(whole_layer, attr))
    for logits in forward_on_threads(shards, ids):
        assert (logits - whole).abs().max() > 1e-2


class _Layers(torch.nn.Module):
    """One decoder layer posing as a model, for :func:`shard_model`."""

    def __init__(self, layer: Any, config: Any) -> None:
        super().__init__()
        self.model, self.config = torch.nn.Module(), config
        self.model.layers = torch.nn.ModuleList([layer])


def test_mamba2_groups_the_ranks_neither_divide_nor_multiply_are_refused_in_one_line() -> None:
    config = load_config("tiny-bamba")  # 4 heads, 1 group: any tp dividing the heads is a multiple of it
    check_shardable(config, 2)
    check_shardable(config, 4)
    with pytest.raises(ConfigError, match="tp_size 2 neither divides nor is a multiple of the Mamba-2 "
                                          "n_groups 3"):
        check_shardable({**config, "mamba_n_groups": 3}, 2)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["tiny-lfm2", "tiny-nemotron-h", "tiny-bamba"])
def test_cli_generate_tp2_on_a_recurrent_family_is_token_identical_to_tp1_and_transformers(name: str) -> None:
    prompts = ["the state is sharded by channel and head", "the state is sharded by rank",
               "the state is sharded by channel and head"]
    one, two = cli_tp1_tp2(name, prompts, "--state-save", "dense")
    assert_same_tokens_as_transformers(one, two)
    # the same slot and checkpoint decisions (rank 0 decides as the one process does)
    assert two["stats"]["recurrent_state"] == one["stats"]["recurrent_state"]
    assert two["stats"]["recurrent_state"]["checkpoints_saved"] > 0
