"""The engine on sliding-window models against transformers' own greedy generate.

tiny-mistral (every layer slides), tiny-gemma2 (alternating sliding and full, logit soft-capping, which
transformers runs with its eager attention) and tiny-gemma3 (6 layers, 2 full among sliding ones), all with a
window of 16 tokens, at block size 4, on prompts of 40-120 tokens: well past the window. Expected tokens and
logits come from ``model.generate`` (no kvpool code); block bounds are worked out by hand from the window.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvpool.engine.engine import LLMEngine  # noqa: E402
from kvpool.engine.models import TINY_WINDOW, kv_spec, load_model, reference_greedy  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402
from kvpool.spec import LayerKind  # noqa: E402

BLOCK = 4
NEW = 16
DOC = [(7 * i + 3) % 251 for i in range(60)]  # a 60-token shared document (byte ids)
PROMPTS = [
    DOC + [10, 11, 12, 13, 14],  # 65 tokens
    DOC[:52] + list(range(150, 190)),  # 92 tokens, shares 52 (13 blocks) with the first
    [(5 * i + 1) % 256 for i in range(41)],  # 41 tokens, unrelated
    DOC + DOC[:60],  # 120 tokens
]
HYBRID = ("tiny-mistral", "tiny-gemma2", "tiny-gemma3", "tiny-gpt-oss", "tiny-gemma4", "tiny-mimo",
          "tiny-llama4")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=HYBRID)
def tiny(request: pytest.FixtureRequest) -> tuple:
    model = load_model(request.param, seed=1).model
    return request.param, model, [reference_greedy(model, p, NEW) for p in PROMPTS]


def run(model, prompts=PROMPTS, num_blocks: int = 400, **kwargs) -> tuple[LLMEngine, list]:
    engine = LLMEngine(model, num_blocks=num_blocks, block_size=BLOCK, keep_logits=True, **kwargs)
    requests = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert engine.pool.num_used_blocks == 0
    engine.kv.check_integrity()
    return engine, requests


def assert_matches(requests, refs) -> None:
    for req, (tokens, logits) in zip(requests, refs, strict=True):
        assert req.output_token_ids == tokens
        torch.testing.assert_close(torch.stack(req.logits), logits, atol=1e-4, rtol=0)


def test_groups_of_the_tiny_models():
    kinds = {name: [(g.kind, len(g.layers)) for g in kv_spec(load_model(name).model, block_size=4).groups]
             for name in HYBRID}
    assert kinds == {"tiny-mistral": [(LayerKind.SLIDING, 2)],
                     "tiny-gemma2": [(LayerKind.SLIDING, 2), (LayerKind.FULL, 2)],
                     "tiny-gemma3": [(LayerKind.SLIDING, 2), (LayerKind.SLIDING, 2), (LayerKind.FULL, 2)],
                     "tiny-gpt-oss": [(LayerKind.SLIDING, 1), (LayerKind.FULL, 1)],
                     # 4 layers own KV (4 and 5 reuse 3 and 2): sliding 2 x (16 + 16) x 4 B = 256 B per
                     # token, full 1 x (64 + 64) x 4 B = 512 B: 2 sliding slots per block, 1 full
                     "tiny-gemma4": [(LayerKind.SLIDING, 2), (LayerKind.SLIDING, 1), (LayerKind.FULL, 1)],
                     # full 1 x (24 + 16) x 4 B = 160 B per token, sliding 2 x 40 x 4 = 320 B: full layers
                     # 2 x 160 = 320 B per token in all, the fewest: 2 full slots, 1 sliding
                     "tiny-mimo": [(LayerKind.FULL, 2)] + [(LayerKind.SLIDING, 1)] * 4,
                     # Llama 4's layout: layers 0-2 chunked, 3 full, one group each (as Scout's 36 + 12)
                     "tiny-llama4": [(LayerKind.CHUNKED, 1)] * 3 + [(LayerKind.FULL, 1)]}


def test_tokens_and_logits_match_transformers(tiny):
    _, model, refs = tiny
    assert_matches(run(model)[1], refs)


def test_chunked_prefill_matches(tiny):
    # 8 tokens per step: every prompt prefills over 6-15 steps, each chunk past the window
    _, model, refs = tiny
    engine, requests = run(model, max_num_batched_tokens=8)
    assert_matches(requests, refs)


def test_shared_prefix_hits_every_group(tiny):
    _, model, refs = tiny
    # the first prompt alone publishes its 16 full blocks; the second then restores 13 blocks (52 tokens):
    # full groups hold them all, sliding groups the blocks of the last 15 tokens before token 52
    engine = LLMEngine(model, num_blocks=400, block_size=BLOCK, keep_logits=True)
    first = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=NEW))
    second = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=NEW))
    assert engine.stats.prefix_hit_tokens == 52
    assert_matches(first + second, refs[:2])
    engine.kv.check_integrity()


def test_preemption_matches(tiny):
    name, model, refs = tiny
    # too few blocks for all four at once: tiny-mistral's one sliding group needs up to cdiv(16 + 16 - 2, 4)
    # + 1 = 9 blocks per request with chunks of 16 (12 blocks, 11 usable); the full groups of the Gemmas
    # need up to 34 for the 120-token prompt (60 and 90 blocks); tiny-llama4's three chunked groups up to
    # cdiv(16 - 1 + 16, 4) = 8 each beside its full group's 34 (70 blocks)
    blocks = {"tiny-mistral": 12, "tiny-gemma2": 60, "tiny-gemma3": 90, "tiny-gpt-oss": 60,
              "tiny-gemma4": 60, "tiny-mimo": 90, "tiny-llama4": 70}[name]
    engine, requests = run(model, num_blocks=blocks, max_num_batched_tokens=16)
    assert engine.stats.preemptions > 0
    assert_matches(requests, refs)


def test_blocks_stay_bounded_by_the_window():
    # tiny-mistral slides every layer (one group): decoding 150 tokens past a 41-token prompt with chunks of
    # 8, the request never holds more than cdiv(16 + 8 - 2, 4) + 1 = 7 blocks; all full it would end at
    # cdiv(41 + 150 - 1, 4) = 48
    model = load_model("tiny-mistral", seed=1).model
    engine = LLMEngine(model, num_blocks=64, block_size=BLOCK, max_num_batched_tokens=8)
    (req,) = engine.generate([PROMPTS[2]], SamplingParams(max_new_tokens=150))
    group = engine.kv.groups[0]
    assert group.max_blocks(10**6, 8) == 7 == -(-(TINY_WINDOW + 8 - 2) // BLOCK) + 1
    assert engine.stats.peak_blocks_used <= 7 < 48
    assert len(req.output_token_ids) == 150
    tokens, _ = reference_greedy(model, PROMPTS[2], 150)
    assert req.output_token_ids == tokens


def test_gemma3_full_layers_keep_every_block():
    # tiny-gemma3's full group holds cdiv(n, 4) blocks, each sliding group at most cdiv(15, 4) + 1 = 5 while
    # decoding: for one 120-token prompt + 16 new tokens (135 written) the peak is 34 + 2 x 5 plus what a
    # 256-token prefill step holds (all 30 blocks of each sliding group)
    model = load_model("tiny-gemma3", seed=1).model
    engine = LLMEngine(model, num_blocks=200, block_size=BLOCK)
    engine.generate([PROMPTS[3]], SamplingParams(max_new_tokens=NEW))
    assert engine.stats.peak_blocks_used == 3 * 30  # the one-step prefill of 120 tokens: 30 blocks x 3 groups
    engine = LLMEngine(model, num_blocks=200, block_size=BLOCK, max_num_batched_tokens=4)
    engine.generate([PROMPTS[3]], SamplingParams(max_new_tokens=NEW))
    # chunks of 4: sliding groups at most cdiv(16 + 4 - 2, 4) + 1 = 6 each; full 34 at the end
    assert engine.stats.peak_blocks_used <= 34 + 2 * 6


def test_gpt_oss_sinks_change_what_the_engine_must_match():
    """The sinks of tiny-gpt-oss take visible weight: with them at -1e9 (no sink) transformers' own logits
    move by more than 0.1, so the engine matching the model with its sinks (above) carries them."""
    model = load_model("tiny-gpt-oss", seed=1).model
    tokens, logits = reference_greedy(model, PROMPTS[0], 4)
    ids = torch.tensor([PROMPTS[0] + tokens[:3]])
    sinks = [layer.self_attn.sinks for layer in model.model.layers]
    saved = [s.detach().clone() for s in sinks]
    with torch.no_grad():
        with_sinks = model(ids).logits[0, -4:]
        for s in sinks:
            s.fill_(-1e9)
        without = model(ids).logits[0, -4:]
        for s, value in zip(sinks, saved, strict=True):
            s.copy_(value)
    torch.testing.assert_close(with_sinks, logits, atol=1e-4, rtol=0)
    assert (without - with_sinks).abs().max() > 0.1


def test_gemma4_layers_keep_their_own_shapes():
    """tiny-gemma4's cache is packed: each layer's views have its own heads and head_dim, the two layers
    that reuse KV read their source's memory, and a block is 512 B per token x 4 tokens in every group."""
    model = load_model("tiny-gemma4", seed=1).model
    engine = LLMEngine(model, num_blocks=16, block_size=BLOCK)
    cache = engine.cache
    assert cache.packed and cache.buffer.shape == (16, 512 * BLOCK // 4)
    assert [tuple(cache.k_cache(layer).shape[2:]) for layer in range(6)] == [(2, 16), (2, 16), (1, 64),
                                                                            (2, 16), (2, 16), (1, 64)]
    assert cache.k_cache(4).data_ptr() == cache.k_cache(3).data_ptr()
    assert cache.v_cache(5).data_ptr() == cache.v_cache(2).data_ptr()
    assert cache.spec.bytes_per_token == 3 * 256 + 512


def test_mimo_values_are_narrower_than_keys():
    """tiny-mimo stores V heads of 16 beside K heads of 24 (a packed cache): 1 x 40 x 4 B per token in a
    full layer, 2 x 40 x 4 B in a sliding one, not 2 x 24 per head."""
    model = load_model("tiny-mimo", seed=1).model
    cache = LLMEngine(model, num_blocks=8, block_size=BLOCK).cache
    assert cache.packed and (cache.k_cache(0).shape[2:], cache.v_cache(1).shape[2:]) == ((1, 24), (2, 16))
    assert cache.spec.bytes_per_token == 2 * 160 + 4 * 320 and cache.bytes_per_block == 320 * BLOCK
