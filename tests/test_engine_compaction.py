"""The engine's compaction of its elastic KV cache (issue 32, kvpool.requests.compaction): blocks of running
requests moved between steps, their KV copied in every layer, give the tokens and logits of transformers'
own greedy ``generate`` (no kvpool code); the same moves without the copy give other tokens.

tiny-llama's blocks are 2 KiB (2 layers x 2 KV heads x 16 x fp32 x 4 tokens x K and V), so 16 KiB pages
hold 8 blocks each: requests of different lengths finishing at different steps leave holes (prefix caching
off: a finished request's blocks all go; cached blocks' moves are checked against a model in
test_compaction.py), and a forced compaction after every step moves the live blocks off the emptiest pages.
With a host tier attached the compactions complete its jobs first; the tier then serves a hit after the
device cache was emptied.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvpool.engine.engine import LLMEngine  # noqa: E402
from kvpool.engine.models import load_model, reference_greedy  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402
from kvpool.requests.compaction import holding_pages, packed_pages  # noqa: E402
from kvpool.storage.arena import ElasticConfig  # noqa: E402

BLOCK = 4
PAGE = 16384
PROMPTS = [list(range(7, 47)), [99, 98, 97, 96, 95, 94, 93], list(range(7, 30)) + [200, 201],
           [150 + i % 40 for i in range(51)], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
NEW = [12, 3, 9, 5, 14]
# with prefix caching on (a tier needs it) a finished request keeps its full blocks cached: only its last,
# unhashed blocks leave holes, so more requests of other lengths
CACHED_PROMPTS = [PROMPTS[0], PROMPTS[1], [5] * 6, list(range(100, 113)), PROMPTS[3], [1, 2, 3], PROMPTS[2],
                  [9] * 10]
CACHED_NEW = [12, 3, 2, 9, 14, 1, 9, 5]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny() -> tuple:
    model = load_model("tiny-llama", seed=1).model
    return model, [reference_greedy(model, p, n) for p, n in zip(PROMPTS, NEW, strict=True)]


def build(model, **options) -> LLMEngine:
    engine = LLMEngine(model, num_blocks=64, block_size=BLOCK, keep_logits=True, max_num_batched_tokens=24,
                       elastic=ElasticConfig(page_size=PAGE), **options)
    assert engine.compactor is not None and engine.cache.bytes_per_block * 8 == PAGE
    return engine


def run_compacting(model, copy: bool) -> tuple[list, int]:
    """Generate with a forced compaction after every step; return the requests and the blocks moved that
    a running request's block table named."""
    engine = build(model, enable_prefix_caching=False)
    if not copy:
        engine.compactor.copy = None
    return drive(engine, PROMPTS, NEW)


def drive(engine: LLMEngine, prompts: list, news: list) -> tuple[list, int]:
    """Run ``prompts`` to the end with a forced compaction after every step (checked: the pool's integrity,
    the pages packed within one); return the requests and the moved blocks a running request's table
    named."""
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n))
           for p, n in zip(prompts, news, strict=True)]
    moved_running = 0
    while engine.has_unfinished():
        engine.step()
        running = {b for req in engine.running for t in engine.kv_manager.block_tables(req) for b in t}
        before = engine.compactor.stats.moved
        sources = set(engine.kv_manager.memory.store.live_blocks())
        engine.compactor.compact(force=True)
        moved_now = engine.compactor.stats.moved - before
        if moved_now:
            gone = sources - set(engine.kv_manager.memory.store.live_blocks())
            moved_running += len(gone & running)
        engine.kv_manager.check_integrity()
        pages = engine.cache.pages
        assert holding_pages(pages) <= packed_pages(pages.num_live, 8) + 1
    return [engine.requests[i] for i in ids], moved_running


def test_moves_of_running_requests_keep_transformers_tokens(tiny) -> None:
    model, refs = tiny
    requests, moved_running = run_compacting(model, copy=True)
    assert moved_running > 0
    for req, (tokens, logits) in zip(requests, refs, strict=True):
        assert req.output_token_ids == tokens
        torch.testing.assert_close(torch.stack(req.logits), logits, atol=1e-4, rtol=0)


def test_the_same_moves_without_the_copy_diverge(tiny) -> None:
    model, refs = tiny
    requests, moved_running = run_compacting(model, copy=False)
    assert moved_running > 0
    assert any(req.output_token_ids != tokens or
               not torch.allclose(torch.stack(req.logits), logits, atol=1e-4, rtol=0)
               for req, (tokens, logits) in zip(requests, refs, strict=True))


def test_compaction_with_a_host_tier_keeps_transformers_tokens_and_the_tier_serves_a_hit(tiny) -> None:
    """A write-through host tier attached (each store holds its device blocks until it lands): the
    compactions complete the tier's jobs first, so moves of running requests keep transformers' tokens;
    then ``trim()`` empties the device cache and PROMPTS[0] runs again from the tier."""
    model, _ = tiny
    refs = [reference_greedy(model, p, n) for p, n in zip(CACHED_PROMPTS, CACHED_NEW, strict=True)]
    engine = build(model)
    offload = engine.enable_offload(["host://?blocks=64"], write_through=True)
    try:
        requests, moved_running = drive(engine, CACHED_PROMPTS, CACHED_NEW)
        assert moved_running > 0
        for req, (tokens, logits) in zip(requests, refs, strict=True):
            assert req.output_token_ids == tokens
            torch.testing.assert_close(torch.stack(req.logits), logits, atol=1e-4, rtol=0)
        assert engine.trim() > 0 and engine.pool.num_evictable_blocks == 0  # no cached block on the device
        before = engine.kv_manager.hits_by_place()
        (again,), _ = drive(engine, [PROMPTS[0]], [NEW[0]])
        assert again.output_token_ids == refs[0][0]
        torch.testing.assert_close(torch.stack(again.logits), refs[0][1], atol=1e-4, rtol=0)
        # the 40-token prompt hits at most (40 - 1) // 4 = 9 full blocks (its last token is computed), all
        # from the host tier (its 64 blocks hold every block the first run published)
        after = engine.kv_manager.hits_by_place()
        assert {place: after[place] - before[place] for place in after} == {"device": 0, "host": 9}
    finally:
        offload.close()
