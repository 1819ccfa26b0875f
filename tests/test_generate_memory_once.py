"""``kvpool generate`` makes one ModelMemory from one config read, and the CLI, the planner and the engine
ask it (issue: the config was read and classified again on every floor)."""

from __future__ import annotations

import json
import pickle

import pytest

pytest.importorskip("transformers")

import kvpool.cli.generate as generate  # noqa: E402
import kvpool.engine.models as models  # noqa: E402
from kvpool.cli import main  # noqa: E402
from kvpool.engine.recurrent import model_memory  # noqa: E402
from kvpool.spec.memory import ModelMemory  # noqa: E402


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-next"])
def test_generate_reads_the_config_once_and_makes_one_model_memory(
        name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    loads, made = [], []
    load_config, from_config = models.load_config, ModelMemory.from_config.__func__

    def counting_load(*args, **kwargs):
        loads.append(args)
        return load_config(*args, **kwargs)

    def counting_from_config(cls, *args, **kwargs):
        made.append(args)
        return from_config(cls, *args, **kwargs)

    monkeypatch.setattr(models, "load_config", counting_load)
    monkeypatch.setattr(ModelMemory, "from_config", classmethod(counting_from_config))
    assert main(["generate", "--model", name, "--prompt", "abc", "--max-new-tokens", "3", "--check",
                 "--json", "--block-size", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"][0]["matches_reference"]
    assert len(loads) == 1 and len(made) == 1  # one read, one ModelMemory (2 before: again from the model)


@pytest.mark.parametrize("name", [*models.TINY_MODELS, *models.TINY_HYBRID_MODELS])
def test_the_memory_made_before_loading_is_the_loaded_models(name: str) -> None:
    # what the CLI makes from the config before the weights load (float32 as loaded) equals what the engine
    # makes from the loaded model, and it travels to the ranks (pickled for spawned processes)
    before = ModelMemory.from_config(models.config_before_load(name), block_size=4, kv_cache_dtype="float32",
                                     conv_dtype="float32", ssm_dtype="float32")
    loaded = model_memory(models.load_model(name).model, block_size=4)
    assert (before.kv, before.hybrid) == (loaded.kv, loaded.hybrid)
    assert pickle.loads(pickle.dumps(before)) == before


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-next"])
def test_generate_at_tp_2_makes_one_model_memory_for_its_ranks(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At ``--tp-size 2`` the command checks the layout, then makes the one ModelMemory at TP 2 (whose making
    checks the KV and recurrent heads) that its ranks receive: no second one for the check. Only the
    command's own process is counted: the ranks are not started here (test_tp.py and test_tp_hybrid.py run
    them)."""
    loads, made, handed = [], [], []
    load_config, from_config = models.load_config, ModelMemory.from_config.__func__
    monkeypatch.setattr(models, "load_config", lambda *a, **k: loads.append(a) or load_config(*a, **k))
    monkeypatch.setattr(ModelMemory, "from_config",
                        classmethod(lambda cls, *a, **k: made.append(a) or from_config(cls, *a, **k)))
    monkeypatch.setattr(generate, "run_ranks", lambda target, tp_size, *args, command: handed.append(
        (tp_size, args[-1])))
    assert main(["generate", "--model", name, "--prompt", "abc", "--max-new-tokens", "3", "--block-size", "4",
                 "--tp-size", "2"]) == 0
    assert len(loads) == 1 and len(made) == 1  # one read, one ModelMemory (2 before: check_shardable's)
    (tp_size, memory), = handed
    assert tp_size == 2 and memory.kv.tp_size == 2
