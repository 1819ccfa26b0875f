"""An elastic engine under tensor parallelism (tests/test_tp.py runs it on 2 ranks): what is not shipped to
the other ranks yet is refused on rank 0's engine with a one-line ConfigError, changing nothing."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from kvpool.engine.engine import LLMEngine  # noqa: E402
from kvpool.engine.models import load_model  # noqa: E402
from kvpool.errors import ConfigError  # noqa: E402
from kvpool.storage.arena import ElasticConfig  # noqa: E402


def test_sleep_and_tiers_are_refused_with_tp_on_an_elastic_cache() -> None:
    model = load_model("tiny-llama", seed=1).model
    engine = LLMEngine(model, num_blocks=16, block_size=4, tp_size=2, elastic=ElasticConfig(page_size=4096))
    with pytest.raises(ConfigError, match="tp_size 1"):
        engine.sleep()
    with pytest.raises(ConfigError, match="tp_size 1"):
        engine.enable_offload(["host://4"])
    assert not engine.asleep and engine.offload is None
    assert engine.trim() == 0  # nothing committed yet; trim is shipped (through the store)
