"""ModelMemory (``kvpool.spec.memory``): what a model needs, made once from its config, and the commands that
ask it instead of reading the config again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvpool.spec.hf_config as hf_config
from kvpool.cli import main
from kvpool.errors import ConfigError
from kvpool.spec import KVCacheSpec
from kvpool.spec.kinds import FullAttention, RecurrentState, SlidingWindow
from kvpool.spec.memory import ModelMemory
from kvpool.spec.state import HybridSpec

HYBRID = Path(__file__).parent / "configs" / "hybrid"
MAMBA2 = {"model_type": "mamba2", "num_hidden_layers": 2, "hidden_size": 64, "num_heads": 4, "head_dim": 32,
          "n_groups": 1, "state_size": 8, "conv_kernel": 4}


def test_an_attention_model_is_its_kv_spec() -> None:
    memory = ModelMemory.from_config("gemma-3-1b", block_size=32, tp_size=1)
    assert memory.kv == KVCacheSpec.from_hf_config("gemma-3-1b", block_size=32)
    assert memory.hybrid is None and memory.state is None and memory.model_type == "gemma3_text"
    # gemma-3-1b: 5 sliding layers (window 512) to 1 global layer (its config.json's layer_types)
    assert set(memory.kinds) == {SlidingWindow(512), FullAttention()} and len(memory.kinds) == 2


def test_a_hybrid_is_its_attention_layers_and_a_state() -> None:
    path = HYBRID / "qwen3-next-80b-a3b-instruct.json"
    memory = ModelMemory.from_config(path, block_size=16)
    hybrid = HybridSpec.from_hf_config(path, block_size=16)
    assert memory.hybrid == hybrid and memory.kv == hybrid.attention and memory.state == hybrid.state
    # Qwen3-Next: full attention every 4th layer, gated delta net in the others (full_attention_interval 4)
    assert memory.kinds == (FullAttention(), RecurrentState())
    assert memory.require_kv() is memory.kv


def test_only_a_model_without_state_is_its_kv_alone() -> None:
    # a KV spec alone describes gemma-3-1b's memory; Qwen3-Next's 12 attention layers of 48 are not its memory
    plain = ModelMemory.from_config("gemma-3-1b")
    assert plain.require_kv_only() is plain.kv
    hybrid = ModelMemory.from_config(HYBRID / "qwen3-next-80b-a3b-instruct.json")
    assert hybrid.kv.num_layers == 12
    with pytest.raises(ConfigError, match="qwen3_next keeps a recurrent state per request"):
        hybrid.require_kv_only()
    with pytest.raises(ConfigError, match="mamba2 keeps a recurrent state"):
        ModelMemory.from_config(MAMBA2).require_kv_only()


def test_a_state_only_model_has_no_kv_to_plan() -> None:
    memory = ModelMemory.from_config(MAMBA2)
    assert memory.kv is None and memory.kinds == (RecurrentState(),)
    with pytest.raises(ConfigError, match="mamba2 has no attention layers"):
        memory.require_kv()


def test_a_consumer_without_state_sharding_refuses_a_hybrid_over_ranks() -> None:
    path = HYBRID / "qwen3-next-80b-a3b-instruct.json"
    assert ModelMemory.from_config(path, tp_size=2).state.conv_shape != \
        ModelMemory.from_config(path).state.conv_shape  # the planner shards it by head
    with pytest.raises(ConfigError, match="one rank"):
        ModelMemory.from_config(path, tp_size=2, shard_state=False)
    assert ModelMemory.from_config("llama-3.1-8b", tp_size=2, shard_state=False).kv.num_kv_heads_per_rank == 4


QWEN3_NEXT = str(HYBRID / "qwen3-next-80b-a3b-instruct.json")


@pytest.mark.parametrize("argv", [
    ["plan", "llama-3.1-8b", "--gpu-memory", "80GiB", "--max-model-len", "4096"],
    ["plan", QWEN3_NEXT, "--gpu-memory", "80GiB", "--max-model-len", "4096"],
    ["replay", "--model-config", QWEN3_NEXT, "--gpu-memory", "80GiB", "--max-requests", "5", "--no-progress"],
], ids=["plan", "plan-hybrid", "replay-hybrid"])
def test_a_command_reads_the_config_once(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    paths: list[Path] = []
    config_path = hf_config.config_path

    def counted(name: str | Path) -> Path:
        paths.append(config_path(name))
        return paths[-1]

    monkeypatch.setattr(hf_config, "config_path", counted)  # every reading of a config file asks it
    assert main([*argv, "--json"]) == 0
    assert len(paths) == 1, paths
    report = json.loads(capsys.readouterr().out)
    assert ("recurrent_state" in report or "state_save" in json.dumps(report)) == (QWEN3_NEXT in argv)
