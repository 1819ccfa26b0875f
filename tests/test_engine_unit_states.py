"""Hits finer than a block on recurrent hybrids (tiny Qwen3-Next, tiny LFM2): the engine against
transformers' own greedy ``generate``.

A hybrid's hit may end inside a block only where its recurrent state was saved at that unit boundary
(:mod:`kvpool.requests.unit_states`): the matched units' KV is copied from a cached block, the state comes
from the unit checkpoint. Block size 8, unit 2, block checkpoints at the prompt's tail only (48 tokens), so
every hit below is a unit hit or nothing; hit counts are worked out by hand in the comments. Controls: the
same runs with the restored unit state zeroed, or the copied KV zeroed, must leave transformers' logits.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from _partial_helpers import BLOCK, DOC, FIRST, SECOND, UNIT, zeroing_copy  # noqa: E402

from kvpool.engine.engine import LLMEngine  # noqa: E402
from kvpool.engine.models import load_model, reference_greedy  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402
from kvpool.requests.state_checkpoints import SavePolicy  # noqa: E402

NEW = 6  # FIRST: block checkpoint at 48 (its tail); SECOND shares 29 tokens: 3 blocks + 2 units of 2 = 28
THIRD = DOC[:29] + list(range(60, 75))  # shares the same 29 tokens with both

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["tiny-qwen3-next", "tiny-lfm2"])
def tiny(request: pytest.FixtureRequest) -> tuple:
    model = load_model(request.param, seed=1).model
    return model, reference_greedy(model, SECOND, NEW), reference_greedy(model, THIRD, NEW)


def _engine(model: object, unit_save: str | None = "dense", **kwargs: object) -> LLMEngine:
    engine = LLMEngine(model, num_blocks=64, block_size=BLOCK, keep_logits=True, state_save="tail",
                       state_checkpoints=64, match_unit=UNIT, **kwargs)
    if unit_save is not None:
        engine.kv_manager.partial.saves.policy = SavePolicy.parse(unit_save)  # type: ignore[union-attr]
    return engine


def _run(engine: LLMEngine, *prompts: list[int]) -> list:
    out = []
    for prompt in prompts:
        (req,) = engine.generate([prompt], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        out.append(req)
    assert engine.pool.num_used_blocks == 0 and engine.states.num_request_slots == 0
    engine.kv_manager.check_integrity()
    return out


def test_a_unit_hit_on_a_hybrid_is_token_identical(tiny: tuple) -> None:
    """Dense unit saves: FIRST's state is saved at every unit boundary; SECOND's KV hit is 3 blocks, no block
    checkpoint before 48, so its hit ends at the unit checkpoint at 28 tokens (unit 14): 24 + 4 copied."""
    model, (tokens, logits), _ = tiny
    engine = _engine(model)
    _, second = _run(engine, FIRST, SECOND)
    assert second.num_cached_tokens == 28
    assert second.output_token_ids == tokens
    torch.testing.assert_close(torch.stack(second.logits), logits, atol=1e-3, rtol=0)
    stats, units = engine.kv_manager.partial.first_stats, engine.kv_manager.partial.saves  # type: ignore[union-attr]
    assert (stats.hits, stats.tokens) == (1, 4) and units.restored == 1
    # FIRST's 24 units less the 6 block boundaries, all committed (SECOND's own units add to them)
    assert units.saved >= 18


def test_the_junction_saves_a_shared_prefix_for_the_next_request(tiny: tuple) -> None:
    """The default unit policy (tail+junction): FIRST saves at its tail only (48, a block boundary), so
    SECOND hits nothing, but its KV was cached up to unit 14 (28 tokens: its junction), where it saves its
    state as it passes; THIRD then hits those 28 tokens (3 blocks + 2 units copied)."""
    model, (tokens2, _), (tokens3, logits3) = tiny
    engine = _engine(model, unit_save=None)
    assert str(engine.kv_manager.partial.saves.policy) == "tail+junction"  # type: ignore[union-attr]
    _, second, third = _run(engine, FIRST, SECOND, THIRD)
    assert second.num_cached_tokens == 0 and second.output_token_ids == tokens2
    assert third.num_cached_tokens == 28 and third.output_token_ids == tokens3
    # (2e-3: the chunked recurrent kernels sum in another order from a restored state than in one pass)
    torch.testing.assert_close(torch.stack(third.logits), logits3, atol=2e-3, rtol=0)


def test_whole_blocks_only_a_hybrid_hits_nothing_here(tiny: tuple) -> None:
    model, (tokens, _), _ = tiny
    engine = LLMEngine(model, num_blocks=64, block_size=BLOCK, state_save="tail", state_checkpoints=64)
    (_, second) = _run(engine, FIRST, SECOND)
    assert second.num_cached_tokens == 0 and second.output_token_ids == tokens


def test_zeroing_the_restored_unit_state_diverges(tiny: tuple) -> None:
    """The control: the restore of the unit checkpoint zeroes the request's slot instead, so the state the
    request continues from is not the prefix's: its logits leave transformers'."""
    model, (_, logits), _ = tiny
    engine = _engine(model)
    mover = engine.states.mover
    engine.states.mover = type("ZeroingMover", (), {
        "zero_slots": staticmethod(mover.zero_slots),
        "copy_slots": staticmethod(lambda pairs: mover.zero_slots([dst for _, dst in pairs]))})()
    _, second = _run(engine, FIRST, SECOND)
    assert second.num_cached_tokens == 28
    assert (torch.stack(second.logits)[0] - logits[0]).abs().max() > 1e-2


def test_zeroing_the_copied_kv_diverges(tiny: tuple) -> None:
    model, (_, logits), _ = tiny
    engine = _engine(model)
    engine.kv_manager.partial.copy = zeroing_copy(engine.cache)  # type: ignore[union-attr]
    _, second = _run(engine, FIRST, SECOND)
    assert second.num_cached_tokens == 28
    assert (torch.stack(second.logits)[0] - logits[0]).abs().max() > 1e-2


def test_a_unit_checkpoint_evicted_to_the_host_tier_comes_back(tiny: tuple) -> None:
    """4 checkpoint slots and 8-token steps: FIRST's unit saves (3 a step, dense) turn the slots over, each
    evicted one going down to the host tier with its state's bytes; SECOND's hit still ends at the unit
    checkpoint at 28 tokens, read back from the tier, and its tokens are transformers'."""
    model, (tokens, logits), _ = tiny
    engine = LLMEngine(model, num_blocks=64, block_size=BLOCK, keep_logits=True, state_save="tail",
                       state_checkpoints=4, match_unit=UNIT, max_num_batched_tokens=8)
    engine.kv_manager.partial.saves.policy = SavePolicy.parse("dense")  # type: ignore[union-attr]
    offload = engine.enable_offload(["host://?blocks=64"])
    _, second = _run(engine, FIRST, SECOND)
    offload.close()
    stats = engine.states.stats
    assert second.num_cached_tokens == 28 and stats.evicted > 0 and stats.tier_restored == 1
    assert second.output_token_ids == tokens
    torch.testing.assert_close(torch.stack(second.logits), logits, atol=1e-3, rtol=0)


def test_cli_generate_match_unit_on_a_hybrid(capsys: pytest.CaptureFixture) -> None:
    """``kvpool generate --match-unit``: a non-divisor exits 2 with one line; on tiny LFM2 the run is
    transformers' greedy generate (``--check``) and exits 0."""
    import json

    from kvpool.cli import main

    base = ["generate", "--model", "tiny-lfm2", "--block-size", "8", "--max-new-tokens", "4"]
    assert main([*base, "--match-unit", "3", "--prompt", "hi"]) == 2
    assert "match_unit must divide the block size 8" in capsys.readouterr().err
    prompt = "A state pool keeps one slot per request, and checkpoints at unit boundaries."
    assert main([*base, "--match-unit", "2", "--check", "--json", "--prompt", prompt]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["matches_reference"] for r in out["requests"]] == [True]
