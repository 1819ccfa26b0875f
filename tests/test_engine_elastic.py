"""The engine on an elastic KV cache (issue 32): the request path commits a block's pages as it is handed out
and releases them once it holds no KV.

Expected tokens and logits come from transformers' own greedy ``generate`` (no kvpool code); the expected
committed bytes are counted by hand from the pool's block states: with 4 KiB pages and tiny-llama's
2 KiB blocks (2 layers x 2 KV heads x 16 x fp32 x 4 tokens x K and V = 2,048 B) in the block-major layout,
block b lives on page b // 2 alone, so the committed bytes are 4 KiB x the pages holding a used or cached
block (plus the reserve, 0 here).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvpool.allocators.block_pool import CACHED, IN_USE, NULL, PINNED  # noqa: E402
from kvpool.engine.engine import LLMEngine  # noqa: E402
from kvpool.engine.models import TINY_WINDOW, load_model, reference_greedy  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402
from kvpool.errors import AsleepError, ConfigError  # noqa: E402
from kvpool.storage.arena import ElasticConfig, MemoryBudget  # noqa: E402

BLOCK = 4
NEW = 12
PAGE = 4096
BASE = list(range(7, 47))
PROMPTS = [BASE, BASE[:30] + [200, 201, 202, 203, 204], [99, 98, 97, 96, 95, 94, 93], BASE[:17],
           [150 + i % 40 for i in range(51)]]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny() -> tuple:
    model = load_model("tiny-llama", seed=1).model
    return model, [reference_greedy(model, p, NEW) for p in PROMPTS]


def elastic_engine(model, num_blocks: int = 64, **kwargs) -> LLMEngine:
    kwargs.setdefault("elastic", ElasticConfig(page_size=PAGE))
    return LLMEngine(model, num_blocks=num_blocks, block_size=BLOCK, keep_logits=True, **kwargs)


def pages_by_hand(engine: LLMEngine) -> int:
    """Bytes of the pages under every block that holds KV (in use or cached) and the null block (a windowed
    model's table entry that kernels may read), from the pool's block states."""
    per_page = PAGE // engine.cache.bytes_per_block
    holding = [b for b, s in enumerate(engine.pool.block_states()) if s in (IN_USE, CACHED, PINNED, NULL)]
    return PAGE * len({b // per_page for b in holding})


def run_checked(engine: LLMEngine, prompts, limit: int | None = None) -> list:
    """Generate step by step, checking after each step that the committed bytes are the hand count (and
    under ``limit``) and that the live blocks are the used and cached ones."""
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW)) for p in prompts]
    peak = 0
    while engine.has_unfinished():
        engine.step()
        engine.kv_manager.check_integrity()
        committed = engine.memory_stats()["committed"]
        assert committed == pages_by_hand(engine)
        assert limit is None or committed <= limit
        peak = max(peak, committed)
    assert engine.stats.peak_committed_bytes >= peak  # (measured after scheduling, before the frees)
    return [engine.requests[i] for i in ids]


def assert_matches(requests, refs) -> None:
    for req, (tokens, logits) in zip(requests, refs, strict=True):
        assert req.output_token_ids == tokens
        torch.testing.assert_close(torch.stack(req.logits), logits, atol=1e-4, rtol=0)


def test_block_and_page_sizes_are_the_hand_figures(tiny) -> None:
    engine = elastic_engine(tiny[0])
    assert engine.cache.bytes_per_block == 2 * 2 * 2 * 16 * 4 * BLOCK  # K and V, layers, heads, dim, fp32
    assert engine.cache.packed and engine.memory_stats() == {"reserved": 64 * 2048, "committed": 0, "used": 0,
                                                             "cached": 0, "elastic": True}


def test_committed_bytes_follow_the_blocks_and_tokens_match(tiny) -> None:
    model, refs = tiny
    engine = elastic_engine(model)
    assert_matches(run_checked(engine, PROMPTS), refs)
    stats = engine.memory_stats()
    assert stats["used"] == 0 and stats["cached"] == engine.pool.num_evictable_blocks * 2048 > 0
    assert stats["committed"] == pages_by_hand(engine) < stats["reserved"]


def test_without_prefix_caching_every_page_goes_back(tiny) -> None:
    model, refs = tiny
    engine = elastic_engine(model, enable_prefix_caching=False)
    assert_matches(run_checked(engine, PROMPTS), refs)
    assert engine.memory_stats()["committed"] == 0 and engine.stats.peak_committed_bytes > 0


def test_a_memory_limit_waits_and_preempts_but_never_passes(tiny) -> None:
    # 16 pages: the 51-token prompt alone needs (51 + 12 - 1) / 4 -> 16 blocks, at worst one a page (its
    # hit blocks may lie anywhere); all five prompts at once need more, so they wait or are preempted
    model, refs = tiny
    limit = 16 * PAGE
    engine = elastic_engine(model, elastic=ElasticConfig(page_size=PAGE, limit_bytes=limit))
    assert_matches(run_checked(engine, PROMPTS, limit), refs)
    assert engine.kv_manager.memory.refused > 0  # the limit did bite


def test_a_shared_budget_bounds_the_engine(tiny) -> None:
    model, refs = tiny
    budget = MemoryBudget(16 * PAGE)
    engine = elastic_engine(model, elastic=ElasticConfig(page_size=PAGE, budget=budget))
    assert_matches(run_checked(engine, PROMPTS, 16 * PAGE), refs)
    assert budget.committed_bytes == engine.memory_stats()["committed"]


def test_sliding_window_blocks_are_released_as_the_window_moves() -> None:
    model = load_model("tiny-mistral", seed=1).model
    prompt = [3 + i % 200 for i in range(100)]
    ref = reference_greedy(model, prompt, NEW)
    engine = elastic_engine(model, num_blocks=200, enable_prefix_caching=False, max_num_batched_tokens=16)
    (req,) = run_checked(engine, [prompt])
    assert req.output_token_ids == ref[0]
    # prefilled 16 tokens a step, a window of 16 tokens: at most the window's 4 blocks (5 when it starts
    # mid-block) and the chunk's 4 are held at once, of the 28 blocks of the 111 tokens written
    assert TINY_WINDOW == 16
    assert engine.stats.peak_blocks_used <= 5 + 4
    # each of those blocks and the null block on a page of its own at worst: under the 14 pages of 28 blocks
    assert engine.stats.peak_committed_bytes <= PAGE * (engine.stats.peak_blocks_used + 1) < 14 * PAGE


def test_restores_from_a_host_tier_commit_what_they_load(tiny) -> None:
    # 14 blocks: the 51-token prompt takes the whole device, so the shared prefix of prompts 1 and 2 is
    # evicted to the host tier and restored from it into blocks whose pages the restore commits
    from kvpool.allocators.hashing import BlockHasher
    from kvpool.tiers.backend import Namespace
    from kvpool.tiers.host import HostTier

    model, refs = tiny
    engine = elastic_engine(model, num_blocks=16, hasher=BlockHasher("sha256", shared=True))
    namespace = Namespace.for_cache(engine.cache, model="tiny-llama-elastic", hash_scheme="sha256")
    engine.enable_offload([HostTier(64, namespace, like=engine.cache)], asynchronous=False)
    order = [0, 4, 1]
    for i in order:
        (req,) = run_checked(engine, [PROMPTS[i]])
        assert req.output_token_ids == refs[i][0]
    assert engine.offload.tier_hits()["host"] > 0


def test_the_memory_gauges_scrape_the_hand_count(tiny) -> None:
    from kvpool.metrics import KVPoolCollector

    engine = elastic_engine(tiny[0])
    run_checked(engine, PROMPTS[:2])
    collector = KVPoolCollector().add_memory(engine.memory_stats)
    (family,) = [f for f in collector.collect() if f.name == "kvpool_kv_memory_bytes"]
    got = {s.labels["state"]: s.value for s in family.samples}
    cached = engine.pool.num_evictable_blocks * 2048  # both finished: every full block is cached
    assert got == {"reserved": 64 * 2048, "committed": pages_by_hand(engine), "used": 0, "cached": cached}
    # KV is written for 40 + 12 - 1 and 35 + 12 - 1 tokens: 12 and 11 full blocks, each cached (the 7 shared
    # ones twice: both requests computed them in the same steps)
    assert cached == (51 // BLOCK + 46 // BLOCK) * 2048


# ---- sleep and wake ----------------------------------------------------------------------------------


def test_sleep_mid_generation_then_wake_gives_transformers_tokens(tiny) -> None:
    from kvpool.events import AllBlocksCleared, QueueEventPublisher

    model, refs = tiny
    publisher = QueueEventPublisher()
    engine = elastic_engine(model, kv_events=publisher, max_num_batched_tokens=32)
    assert engine.pin_prefix(BASE[:16]) is False  # waits for the blocks to be cached
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW)) for p in PROMPTS]
    for _ in range(4):
        engine.step()
    running = len(engine.running)
    assert running > 0 and engine.kv_manager.pins and engine.memory_stats()["committed"] > 0
    given = engine.sleep()
    assert given > 0 and engine.cache.committed_bytes == 0 and engine.memory_stats()["committed"] == 0
    assert engine.pool.num_free_blocks == 64 and engine.pool.num_cached_blocks == 0
    assert engine.stats.preemptions >= running and not engine.running
    batches = []
    while (batch := publisher.get(timeout=0)) is not None:
        batches.append(batch)
    assert isinstance(batches[-1].events[-1], AllBlocksCleared)
    with pytest.raises(AsleepError):
        engine.step()
    with pytest.raises(AsleepError):
        engine.generate([PROMPTS[0]])
    assert engine.sleep() == 0 and len(engine.requests) == len(PROMPTS)  # nothing queued by generate
    engine.wake()
    assert engine.wake() == 0
    while engine.has_unfinished():
        engine.step()
        engine.kv_manager.check_integrity()
        assert engine.memory_stats()["committed"] == pages_by_hand(engine)
    assert_matches([engine.requests[i] for i in ids], refs)
    assert engine.kv_manager.pins  # pinned again once recomputed


def test_sleep_leaves_the_tiers_alone(tiny) -> None:
    from kvpool.allocators.hashing import BlockHasher
    from kvpool.tiers.backend import Namespace
    from kvpool.tiers.host import HostTier

    model, refs = tiny
    engine = elastic_engine(model, hasher=BlockHasher("sha256", shared=True), enable_prefix_caching=True)
    namespace = Namespace.for_cache(engine.cache, model="tiny-llama-sleep", hash_scheme="sha256")
    host = HostTier(64, namespace, like=engine.cache)
    engine.enable_offload([host], write_through=True, asynchronous=False)
    run_checked(engine, [PROMPTS[0]])
    held = host.pool.num_cached_blocks
    assert held == 51 // BLOCK
    engine.sleep()
    engine.wake()
    assert host.pool.num_cached_blocks == held
    (req,) = run_checked(engine, [PROMPTS[1]])  # its 7 shared blocks come back from the host
    assert req.output_token_ids == refs[1][0] and engine.offload.tier_hits()["host"] == 7


def test_a_fixed_engine_cannot_sleep(tiny) -> None:
    with pytest.raises(ConfigError, match="elastic"):
        LLMEngine(tiny[0], num_blocks=8).sleep()


RSS_SCRIPT = r"""
import gc, json, sys
import psutil, torch, transformers
from kvpool.engine.engine import LLMEngine
from kvpool.engine.sampling import SamplingParams

torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4, head_dim=512, intermediate_size=128,
                                  max_position_embeddings=4096)
model = transformers.AutoModelForCausalLM.from_config(config).eval()
engine = LLMEngine(model, num_blocks=512, block_size=16, elastic=True)
prompts = [[(7 * i + j) % 256 for j in range(300)] for i in range(4)]
params = SamplingParams(max_new_tokens=4)
first = [r.output_token_ids for r in engine.generate(prompts, params)]
rss = lambda: (gc.collect(), psutil.Process().memory_info().rss)[1]
before, committed = rss(), engine.memory_stats()["committed"]
given = engine.sleep()
after = rss()
engine.wake()
again = [r.output_token_ids for r in engine.generate(prompts, params)]
print(json.dumps({"committed": committed, "given": given, "drop": before - after, "same": first == again,
                  "block": engine.cache.bytes_per_block}))
"""


def test_sleep_gives_the_kv_memory_back_to_the_os() -> None:
    # 2 layers x K and V x 4 heads x 512 x fp32 = 32 KiB a token, 512 KiB a 16-token block, 4 blocks on a
    # 2 MiB page; 4 prompts of 300 tokens + 4 new keep 4 x 18 full blocks cached (~36 MiB) when they end
    import json
    import subprocess
    import sys

    pytest.importorskip("psutil")
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT], capture_output=True, text=True, timeout=600,
                         check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["block"] == 2 * 2 * 4 * 512 * 4 * 16 and got["same"]
    assert got["committed"] == got["given"] >= 4 * 18 * got["block"]
    assert 0.9 * got["committed"] <= got["drop"] <= got["committed"] + 8 * 2**20, got


def test_a_hybrid_gives_its_state_pages_back_too() -> None:
    model = load_model("tiny-qwen3-next", seed=1).model
    prompts = PROMPTS[:3]
    refs = [reference_greedy(model, p, 8)[0] for p in prompts]
    engine = elastic_engine(model, max_num_batched_tokens=16)
    states = engine.runner.recurrent.cache
    committed = states.committed_bytes
    assert committed > 0 and states.pages.num_live == states.num_slots  # every slot committed up front
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=8)) for p in prompts]
    for _ in range(3):
        engine.step()
    assert engine.sleep() >= committed
    assert states.committed_bytes == 0 and engine.cache.committed_bytes == 0
    engine.wake()
    assert states.committed_bytes == committed
    while engine.has_unfinished():
        engine.step()
        engine.kv_manager.check_integrity()
    assert [engine.requests[i].output_token_ids for i in ids] == refs


# ---- several engines, one budget ---------------------------------------------------------------------


def test_two_engines_under_one_budget_run_interleaved_and_never_pass_it(tiny) -> None:
    # two models in one process, one limit of 24 pages (96 KiB) for both: alone, the five prompts of one
    # model took more (checked below), so the engines wait, preempt and give pages back in turn; each
    # steps in turn, and an idle one trims its cached blocks' pages for the busy one
    llama, llama_refs = tiny
    qwen = load_model("tiny-qwen2", seed=1).model
    qwen_prompts = PROMPTS[::-1]
    qwen_refs = [reference_greedy(qwen, p, NEW) for p in qwen_prompts]
    limit = 24 * PAGE
    budget = MemoryBudget(limit)
    engines = [elastic_engine(model, elastic=ElasticConfig(page_size=PAGE, budget=budget))
               for model in (llama, qwen)]
    ids = [[e.add_request(p, SamplingParams(max_new_tokens=NEW)) for p in prompts]
           for e, prompts in zip(engines, (PROMPTS, qwen_prompts), strict=True)]
    peak = 0
    while any(e.has_unfinished() for e in engines):
        for engine in engines:
            if engine.has_unfinished():
                engine.step()
                engine.kv_manager.check_integrity()
            else:
                engine.trim()
            committed = [e.memory_stats()["committed"] for e in engines]
            assert budget.committed_bytes == sum(committed) <= limit
            peak = max(peak, budget.committed_bytes)
    for engine, rids, refs in zip(engines, ids, (llama_refs, qwen_refs), strict=True):
        assert_matches([engine.requests[i] for i in rids], refs)
    assert sum(e.kv_manager.memory.refused for e in engines) > 0 and peak > limit // 2
    alone = elastic_engine(llama)
    alone.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))
    assert alone.stats.peak_committed_bytes > limit  # the budget did bite


def test_a_limit_too_small_for_one_request_is_a_typed_error(tiny) -> None:
    from kvpool.errors import MemoryLimitError

    engine = elastic_engine(tiny[0], elastic=ElasticConfig(page_size=PAGE, limit_bytes=2 * PAGE))
    with pytest.raises(MemoryLimitError, match="cannot be admitted although nothing runs"):
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=NEW))
    assert engine.memory_stats()["committed"] == 0 and engine.pool.num_used_blocks == 0
