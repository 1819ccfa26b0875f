"""Prefix hits finer than a block (copy-on-partial-reuse): the request path, the replay and the engine.

Expected hit counts are worked out by hand in the comments; the engine's tokens and logits come from
transformers' own greedy ``generate`` (no kvpool code); the replay is checked against a brute force over
the requests' unit sequences (no index, no pool).
"""

from __future__ import annotations

import random

import pytest

from kvpool.allocators.hashing import BlockHasher
from kvpool.allocators.partial_index import PartialIndex, check_match_unit
from kvpool.errors import ConfigError
from kvpool.requests.kv_manager import KVCacheManager
from kvpool.requests.request import Request
from kvpool.spec import KVCacheGroup
from kvpool.trace.loaders import TraceRequest
from kvpool.trace.replay import ReplayConfig, run_replay

BASE = list(range(7, 47))  # 40 tokens
SEED = "partial-hits-test-seed"


@pytest.mark.parametrize("unit", [0, -4, 3, 5, 16, True, 2.0, "2"])
def test_a_bad_match_unit_is_a_config_error(unit: object) -> None:
    with pytest.raises(ConfigError, match="match_unit"):
        check_match_unit(unit, 8)
    with pytest.raises(ConfigError, match="match_unit"):
        KVCacheManager([KVCacheGroup.full(8)], 16, match_unit=unit)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="match_unit"):
        ReplayConfig(block_size=8, match_unit=unit)  # type: ignore[arg-type]


def test_a_match_unit_needs_caching() -> None:
    with pytest.raises(ConfigError, match="prefix caching"):
        KVCacheManager([KVCacheGroup.full(8)], 16, enable_caching=False, match_unit=2)


def _prefill(kv: KVCacheManager, req: Request) -> None:
    """Admit ``req`` and compute its whole prompt in one step, then publish and free it."""
    assert kv.admit(req, 10_000) is not None
    kv.hash_blocks(req)
    req.num_computed_tokens = req.num_tokens
    kv.publish(req)
    kv.free(req)


def test_a_hit_ending_inside_a_block_copies_its_units() -> None:
    kv = KVCacheManager([KVCacheGroup.full(8)], 32, hasher=BlockHasher(seed=SEED), match_unit=2)
    copies: list[tuple[list[tuple[int, int]], int]] = []
    kv.partial.copy = lambda pairs, n: copies.append((pairs, n))  # type: ignore[union-attr]
    first = Request("a", BASE, 1)
    kv.hash_blocks(first)
    _prefill(kv, first)  # 40 tokens: 5 full blocks of 8 published, units of 2 indexed
    source = kv.pool.get_cached_block(first.block_hashes[2])
    other = Request("b", BASE[:21] + [200, 201, 202], 1)  # shares 21 tokens: 2 full blocks + 5 tokens
    kv.hash_blocks(other)
    assert kv.admit(other, 10_000) is not None
    # full blocks 0-1 (16 tokens), then 2 whole units of block 2 (4 tokens: 5 // 2): 20 tokens
    assert other.num_computed_tokens == other.num_cached_tokens == 20
    assert copies == [([(source, kv.block_tables(other)[0][2])], 4)]
    stats = kv.partial.first_stats  # type: ignore[union-attr]
    assert (stats.hits, stats.tokens, stats.copied_blocks, stats.copied_tokens) == (1, 4, 1, 4)
    assert kv.pool.ref_count(source) == 0  # the source was held for the copy only
    kv.free(other)
    kv.check_integrity()


def test_the_last_prompt_token_is_never_a_partial_hit() -> None:
    kv = KVCacheManager([KVCacheGroup.full(8)], 32, hasher=BlockHasher(seed=SEED), match_unit=2)
    first = Request("a", BASE, 1)
    kv.hash_blocks(first)
    _prefill(kv, first)
    again = Request("b", BASE[:21], 1)  # 21 tokens: at most 20 hit, the 21st computed
    kv.hash_blocks(again)
    kv.admit(again, 10_000)
    assert again.num_computed_tokens == 20
    kv.free(again)
    short = Request("c", BASE[:20], 1)  # 20 tokens: at most 19 -> 16 + 1 unit of 2 = 18
    kv.hash_blocks(short)
    kv.admit(short, 10_000)
    assert short.num_computed_tokens == 18


def test_the_index_drops_entries_whose_block_left_the_pool() -> None:
    index = PartialIndex(4, 0)
    cached = {"B1": 7}.get  # the pool's get_cached_block: B1 is block 7, B2 left
    index.register(["u0", "u1", "u2", "u3", "v0", "v1", "v2", "v3"], ["B1", "B2"], 0, cached)
    assert len(index) == 6  # 3 units of each block (the 4th ends the block: a full hit)
    assert index.longest(["u0", "u1", "u2", "x"], 0, 3, cached) == (3, "B1")
    assert index.longest(["u0", "u1", "x"], 0, 3, cached) == (2, "B1")
    assert index.longest(["u0", "u1", "u2", "u3", "v0", "v1", "v2"], 1, 3, cached) == (0, None)
    assert len(index) == 3  # B2's entries found stale on the way
    assert index.sweep(cached) == 0 and len(index) == 3  # nothing of B2 left to drop
    assert index.sweep(lambda h: None) == 1 and len(index) == 0  # B1's 3 entries dropped


# ---- the replay -------------------------------------------------------------------------------------


def _random_trace(seed: int, n: int = 60) -> list[TraceRequest]:
    """Requests that reuse a prefix of an earlier one's hash ids (tail ids included, with other lengths)."""
    rng, out, next_id = random.Random(seed), [], 0
    for _ in range(n):
        if out and rng.random() < 0.8:
            parent = rng.choice(out)
            ids = list(parent.hash_ids[:rng.randint(1, len(parent.hash_ids))])
        else:
            ids = []
        for _ in range(rng.randint(0 if ids else 1, 2)):
            ids.append(next_id)
            next_id += 1
        tokens = (len(ids) - 1) * 512 + rng.randint(1, 512)
        out.append(TraceRequest(0.0, tokens, rng.randint(1, 4), tuple(ids)))
    return out


def _units(req: TraceRequest, unit: int) -> list[tuple[int, int]]:
    """The request's full units as (hash id, unit within the 512-token hash block)."""
    per = 512 // unit
    return [(req.hash_ids[i // per], i % per) for i in range(req.input_tokens // unit)]


def _brute_force_hit_tokens(requests: list[TraceRequest], block: int, unit: int) -> int:
    """Unbounded pool, one request at a time: a request hits, from each earlier request, the common prefix
    of their units, no further than that one's published full blocks nor its own first input - 1 tokens."""
    total = 0
    for i, req in enumerate(requests):
        mine, limit = _units(req, unit), (req.input_tokens - 1) // unit * unit
        best = 0
        for earlier in requests[:i]:
            theirs = _units(earlier, unit)
            shared = min(len(mine), len(theirs))
            common = next((j for j in range(shared) if mine[j] != theirs[j]), shared)
            best = max(best, min(common * unit, earlier.input_tokens // block * block, limit))
        total += best
    return total


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_unbounded_replay_hits_what_a_brute_force_finds(seed: int) -> None:
    requests = _random_trace(seed)
    whole = run_replay(requests, ReplayConfig(block_size=64))
    finer = run_replay(requests, ReplayConfig(block_size=64, match_unit=16))
    hit_tokens = finer.hit_blocks * 64 + finer.partial_tokens
    assert hit_tokens == _brute_force_hit_tokens(requests, 64, 16)
    assert whole.hit_blocks * 64 == _brute_force_hit_tokens(requests, 64, 64)
    assert finer.partial_hits > 0 and hit_tokens > whole.hit_blocks * 64  # the seeds do share tails
    assert finer.partial_copied_tokens == finer.partial_tokens  # one group: one copy per partial hit
    assert finer.token_hit_ratio == hit_tokens / sum(r.input_tokens for r in requests)


def test_a_bounded_replay_with_partial_hits_ends_clean() -> None:
    requests = _random_trace(4, n=150)
    result = run_replay(requests, ReplayConfig(block_size=64, num_blocks=80, match_unit=16, timing="trace"))
    assert result.requests_completed + result.requests_rejected == 150 and result.evictions > 0


def test_tier_hits_and_events_are_unchanged_by_a_match_unit() -> None:
    """The tiers and the KV events stay per full block: under an unbounded host tier a small device pool
    still hits the unbounded pool's full blocks (the partial hits come on top, from the device), and the
    stored events name the trace's full blocks, every one of them, with or without a match unit."""
    from kvpool.events.publishers import QueueEventPublisher
    from kvpool.events.sink import KVEventSink
    from kvpool.tiers.backend import Namespace
    from kvpool.tiers.host import HostTier
    from kvpool.trace.replay import request_blocks, unbounded_num_blocks

    requests = _random_trace(5, n=80)
    device = max(request_blocks(r, 64) for r in requests) + 4
    runs = {}
    for unit in (None, 16):
        host = HostTier(unbounded_num_blocks(requests, 64), Namespace("t", "none", "hash-only"))
        publisher = QueueEventPublisher()
        sink = KVEventSink(publisher, block_size=64)
        runs[unit] = (run_replay(requests, ReplayConfig(block_size=64, num_blocks=device, match_unit=unit),
                                 tiers=[host], event_sink=sink), publisher.drain())
    (whole, whole_events), (finer, finer_events) = runs[None], runs[16]
    oracle = run_replay(requests, ReplayConfig(block_size=64))
    assert whole.hit_blocks == finer.hit_blocks == oracle.hit_blocks and finer.tier_hits["host"] > 0
    assert finer.partial_hits > 0

    def stored(batches: list) -> set:
        return {h for b in batches for e in b.events if type(e).__name__ == "BlockStored"
                for h in e.block_hashes}

    # the same full blocks are stored (the eviction order may differ: a source block is touched to copy it)
    full_blocks = {h for r in requests for h in r.block_hashes(64)}
    assert stored(finer_events) == stored(whole_events) == full_blocks


def test_the_index_sweeps_blocks_that_left_the_pool_as_it_grows() -> None:
    index = PartialIndex(2, 0)  # capacity 1,024 blocks at least: a sweep past 4 x 1,024 tracked
    for b in range(5000):
        live = {b - 1: 0, b: 1}  # two blocks cached at a time
        index.register([("u", b), ("end", b)], [b], 0, live.get)
    # one sweep at the 4,097th block kept the 2 live ones; 903 registered since
    assert index.sweeps == 1 and len(index) == 2 + 903


def test_cli_match_unit(capsys: pytest.CaptureFixture) -> None:
    import json

    from kvpool.cli import main

    for bad in ("3", "0", "-16"):  # 3 does not divide 64; 0 and negatives are not units
        assert main(["replay", "--block-size", "64", "--match-unit", bad, "--max-requests", "5"]) == 2
        err = capsys.readouterr().err
        assert "match" in err and "Traceback" not in err
    assert main(["replay", "--block-size", "64", "--match-unit", "16", "--max-requests", "50", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["match_unit"] == 16 and report["partial_copied_tokens"] == report["partial_tokens"]
    assert main(["replay", "--block-size", "64", "--match-unit", "16", "--max-requests", "50"]) == 0
    assert "partial_copied_blocks" in capsys.readouterr().out


# ---- the storage copy ---------------------------------------------------------------------------------


def _views(cache) -> list:
    """Every layer's K and V (or latent) ``[N, B, ...]`` views, read independently of the copy."""
    if hasattr(cache, "v_cache"):
        return [v for layer in range(cache.num_layers) for v in (cache.k_cache(layer), cache.v_cache(layer))]
    return [cache.kv_cache(layer) for layer in range(cache.num_layers)]


@pytest.mark.parametrize("store", ["NHD", "HND", "packed", "mla"])
def test_copy_token_prefix_copies_the_first_slots_of_every_layer(store: str) -> None:
    import torch

    from kvpool.errors import InvalidArgumentError, InvalidIdError
    from kvpool.spec import AttentionKind, KVCacheSpec
    from kvpool.storage.block_copy import copy_token_prefix
    from kvpool.storage.mla import MLAKVCache
    from kvpool.storage.paged import PagedKVCache

    if store == "mla":
        spec = KVCacheSpec(num_layers=3, num_kv_heads=1, head_dim=12, dtype=torch.float32, block_size=8,
                           attention=AttentionKind.MLA, kv_lora_rank=8, qk_rope_head_dim=4)
        cache = MLAKVCache(spec, 6)
    else:
        spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=8)
        cache = PagedKVCache(spec, 6, layout="NHD" if store == "packed" else store, packed=store == "packed")
    torch.manual_seed(0)
    for view in _views(cache):
        view.copy_(torch.randn(view.shape))
    before = [view.clone() for view in _views(cache)]
    copy_token_prefix(cache, [(1, 4), (2, 5)], 5)
    for old, new in zip(before, _views(cache), strict=True):
        expected = old.clone()
        expected[4, :5], expected[5, :5] = old[1, :5], old[2, :5]  # the first 5 slots of blocks 1 and 2
        assert torch.equal(new, expected)
    copied = [view.clone() for view in _views(cache)]
    with pytest.raises(InvalidArgumentError, match="num_tokens"):
        copy_token_prefix(cache, [(1, 4)], 9)  # more than a block
    with pytest.raises(InvalidIdError):
        copy_token_prefix(cache, [(0, 3), (1, 6)], 2)  # no block 6: nothing copied, block 3 included
    assert all(torch.equal(a, b) for a, b in zip(copied, _views(cache), strict=True))
