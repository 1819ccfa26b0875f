"""The StepRunner protocol declares what the engine reads of its runner (``cache``, ``spec``, ``recurrent``):
every runner the engine can hold (its own ModelRunner, a tensor-parallel leader's shipping wrapper) has
each declared attribute, and the engine's sleep / wake read ``recurrent`` through it."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from kvpool.engine.distributed import _ShippingRunner  # noqa: E402
from kvpool.engine.engine import LLMEngine  # noqa: E402
from kvpool.engine.models import load_model  # noqa: E402
from kvpool.engine.runner import StepRunner  # noqa: E402


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-next"])
def test_every_runner_has_what_the_protocol_declares(name: str) -> None:
    declared = set(StepRunner.__annotations__)
    assert {"cache", "spec", "recurrent"} <= declared
    engine = LLMEngine(load_model(name, seed=1).model, num_blocks=16, block_size=4)
    runner = engine.runner
    shipping = _ShippingRunner(leader=None, runner=runner)  # type: ignore[arg-type]
    for attr in declared:
        assert getattr(shipping, attr) is getattr(runner, attr)
    # tiny-llama has no recurrent layer: its runner's recurrent half holds no state buffer (a null object),
    # tiny-qwen3-next's holds one state cache beside the KV cache.
    assert len(runner.recurrent.caches) == (0 if name == "tiny-llama" else 1)
    assert runner.stores == (runner.cache, *runner.recurrent.caches)
