"""docs/build-an-engine.md: its engine (``tests/test_readme.py`` runs the page as written, on tiny-llama) on
other models, with negative controls, and the counting rules the page states.

Every expected token and logit comes from transformers' own greedy ``generate`` (the page's last block, or
``reference_greedy``: the model's stock attention and its own cache, no kvpool code); expected counts are
worked out by hand in the comments.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_readme import blocks

from kvpool import BlockHasher, BlockPool, KVCacheSpec, block_hashes
from kvpool.requests.kv_manager import KVCacheManager
from kvpool.requests.request import Request

PAGE = Path(__file__).resolve().parents[1] / "docs" / "build-an-engine.md"
SETTINGS = 'MODEL, NEW_TOKENS, B = "tiny-llama", 12, 4'

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def engine_blocks() -> list[str]:
    """The page's engine, block by block: model and attention, pool moves, step, run, check."""
    return [code for name, code in blocks(PAGE) if name == "engine"]


def run(code: str) -> dict[str, object]:
    """Exec the page's code in a fresh namespace; returns the namespace."""
    pytest.importorskip("transformers")
    namespace: dict[str, object] = {"__name__": "doc_build_an_engine"}
    exec(compile(code, str(PAGE), "exec"), namespace)  # noqa: S102 - our own docs
    return namespace


def _edited(code: str, edits: list[tuple[str, str]]) -> str:
    for old, new in edits:
        assert old in code, f"the page no longer has {old!r}"
        code = code.replace(old, new)
    return code


def test_the_page_has_its_five_engine_blocks() -> None:
    codes = engine_blocks()
    assert len(codes) == 5 and SETTINGS in codes[0] and "model.generate(" in codes[-1]


@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-gpt2"])
def test_the_engine_matches_transformers_on(model: str) -> None:
    # the page's own last block asserts tokens and logits (atol 1e-4) against transformers' generate;
    # its run block asserts that prefixes were hit, a request was preempted and every block came back
    code = _edited("".join(engine_blocks()), [(SETTINGS, f'MODEL, NEW_TOKENS, B = "{model}", 12, 4')])
    ns = run(code)
    assert ns["preemptions"] >= 1 and ns["pool"].stats.hits > 0


@pytest.mark.slow
def test_the_engine_matches_transformers_on_smollm2() -> None:
    pytest.importorskip("gguf")
    from kvpool.engine.models import smollm2_folder

    smollm2_folder()  # a clear error when the wheel is missing
    code = _edited("".join(engine_blocks()), [(SETTINGS, 'MODEL, NEW_TOKENS, B = "smollm2", 16, 4')])
    ns = run(code)  # ~1.5 minutes on 2 busy cores
    assert ns["preemptions"] >= 1 and ns["pool"].stats.hits > 0
    assert all(len(set(req.out)) >= 4 for req in ns["requests"])  # real text, so equality is a real test


def _diverges(edits: list[tuple[str, str]]) -> None:
    """Run the page's engine (not its check) with ``edits`` and assert some request's tokens differ from
    transformers' greedy generate; the unedited engine matches (the check block, run by test_readme)."""
    from kvpool.engine.models import reference_greedy

    code = _edited("".join(engine_blocks()[:-1]), edits)
    ns = run(code.replace("assert pool.stats.hits > 0 and preemptions > 0", "pass"))
    model, new = ns["model"], ns["NEW_TOKENS"]
    got = [req.out for req in ns["requests"]]
    expected = [reference_greedy(model, req.prompt, new)[0] for req in ns["requests"]]
    assert got != expected


def test_a_slot_mapping_without_the_block_size_diverges() -> None:
    # slot = block_table[p // B] + p % B (the "* B" forgotten): new K/V lands in other slots than attention
    # reads (the contexts keep the right mapping)
    _diverges([("slots.append(slot_mapping(req.table, range(start, end), B))",
                "slots.append(torch.tensor([req.table[p // B] + p % B for p in range(start, end)]))")])


def test_a_layer_that_skips_store_kv_diverges() -> None:
    store = "cache.store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), pool_step.slots, layer)"
    _diverges([(store, "pass")])


# ---- what the page says about counting -------------------------------------------------------------------


def test_lookup_counts_every_call_and_the_probes_count_nothing() -> None:
    pool = BlockPool(8)
    hashes = block_hashes(list(range(12)), 4)  # 3 full blocks
    table = pool.allocate(3)
    pool.cache_blocks(table, hashes)
    pool.free(reversed(table))  # 3 cached free blocks, 5 uncached free
    held = pool.allocate(5)  # the 5 uncached ones go first (the cached prefix stays)
    # a request of 4 blocks hitting the 3 cached ones needs 4 free blocks (a hit on a cached free block
    # takes one); 3 are free: refused, and the probes counted nothing
    assert pool.match_prefix(hashes) == table and pool.get_cached_block(hashes[0]) == table[0]
    assert pool.num_blocks_to_allocate(hashes, 4) == 4 and not pool.can_allocate(hashes, 4)
    assert (pool.stats.hits, pool.stats.misses) == (0, 0)
    # the same refused attempt through lookup, twice (a retry the next step): 3 hits each time
    for _ in range(2):
        assert pool.lookup(hashes) == table and pool.num_free_blocks == 3
    assert (pool.stats.hits, pool.stats.misses) == (6, 0)
    pool.free(held)
    pool.check_integrity()


def test_the_kv_manager_counts_an_admission_only_when_it_succeeds() -> None:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, block_size=4)
    kv = KVCacheManager(spec.groups, num_blocks=14, hasher=BlockHasher())
    a = Request("a", list(range(40)), max_tokens=1)  # 10 blocks, none cached: 9 queried ((40 - 1) // 4)
    c = Request("c", [200] * 8, max_tokens=1)  # 2 blocks, 1 queried
    for req in (a, c):
        kv.hash_blocks(req)
        assert kv.admit(req, 256) == req.num_tokens
        req.num_computed_tokens = req.num_tokens
        kv.publish(req)
    b = Request("b", list(range(40)) + [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=1)  # 49 tokens: 13 blocks
    kv.hash_blocks(b)
    # b would hit a's 10 blocks (its hit limit is (49 - 1) // 4 = 12 blocks) and needs 3 more; 14 - 12 = 2
    # are free: refused, twice, and nothing counted
    assert kv.admit(b, 256) is None and kv.admit(b, 256) is None
    assert (kv.stats.requests, kv.stats.queried_blocks, kv.stats.hit_blocks) == (2, 9 + 1, 0)
    kv.free(c)  # 4 free now
    assert kv.admit(b, 256) == 49 - 40
    assert (kv.stats.requests, kv.stats.queried_blocks, kv.stats.hit_blocks) == (3, 9 + 1 + 12, 10)
    assert kv.pool.stats.hits == 0  # the manager never calls lookup: its own stats are the count
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
