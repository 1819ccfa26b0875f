"""Trace replay through the real BlockPool: brute-force oracles, hand-computed schedules, the CLI and bench.

Oracles here never use the replay's code: prefixes are identified by a trie of (hash id, sub-block index)
paths, so they do not rely on the trace's ids being chained nor on the replay's packed sub-block ids.
"""

import importlib
import json
import math
import random
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

from kvpool.allocators.block_pool import BlockPool
from kvpool.cli import main
from kvpool.errors import ConfigError
from kvpool.trace.loaders import TraceRequest, load_trace
from kvpool.trace.replay import ReplayConfig, run_replay
from kvpool.trace.replay_result import prefill_percentiles

replay_module = importlib.import_module("kvpool.trace.replayer")  # where FAST_FORWARD is read
CONFIGS = Path(__file__).parent / "configs"
UNIT_COSTS = {"step_s": 1.0, "prefill_token_s": 0.0, "decode_token_s": 0.0}  # every step lasts 1 s


# ---- brute-force models -------------------------------------------------------------------------------

class PrefixTrie:
    """Node ids for prompt-block paths: node((..., b_i)) is the same id exactly when the whole path is."""

    def __init__(self) -> None:
        self.children: dict[tuple[int, tuple[int, int]], int] = {}

    def path(self, req: TraceRequest, block_size: int, create: bool) -> list[int]:
        """Node ids of the request's full blocks; block i is sub-block j of hash block h (i = h_idx*k + j)."""
        k, full = 512 // block_size, req.input_tokens // block_size
        nodes, node = [], 0
        for i in range(full):
            key = (node, (req.hash_ids[i // k], i % k))
            nxt = self.children.get(key)
            if nxt is None:
                if not create:
                    break
                nxt = self.children[key] = len(self.children) + 1
            nodes.append(nxt)
            node = nxt
        return nodes


def unbounded_oracle(requests: list[TraceRequest], block_size: int) -> tuple[int, int, int]:
    """(hit blocks, full prompt blocks, prompt tokens): a block hits when it and every block before it
    appeared as full blocks in an earlier request, among the full blocks of the first input - 1 tokens
    (the engine always computes the last prompt token, for its logits)."""
    trie, hits, blocks, tokens = PrefixTrie(), 0, 0, 0
    for req in requests:
        hits += min(len(trie.path(req, block_size, create=False)), (req.input_tokens - 1) // block_size)
        blocks += len(trie.path(req, block_size, create=True))
        tokens += req.input_tokens
    return hits, blocks, tokens


def kv_blocks(req: TraceRequest, block_size: int) -> int:
    """Blocks a request holds at its end: its KV covers input + output - 1 tokens (the last sampled token
    is never written; a request without output holds its prompt)."""
    return math.ceil((req.input_tokens + max(req.output_tokens - 1, 0)) / block_size)


def lru_model(requests: list[TraceRequest], block_size: int, num_blocks: int) -> tuple[int, int, int]:
    """(hits, evictions, rejected) of a serial replay on a pool that hands out never-cached free blocks
    first, then evicts the least recently freed cached block. A request hits at most the full blocks of its
    first input - 1 tokens, allocates the rest of its prompt's blocks, publishes its full prompt blocks
    after the prefill, allocates its decode blocks, and frees its blocks tail first. (None of the blocks
    it publishes is cached already: a request frees its tail first, so a cached block's parent is more
    recent than it, hence cached too, and the hit stops only where the rest of the chain is gone.)"""
    trie, cached, plain = PrefixTrie(), OrderedDict(), num_blocks
    hits = evictions = rejected = 0

    def take(n: int) -> None:
        nonlocal plain, evictions
        got = min(plain, n)
        plain -= got
        for _ in range(n - got):
            cached.popitem(last=False)
            evictions += 1

    for req in requests:
        total = kv_blocks(req, block_size)
        if total > num_blocks:
            rejected += 1
            continue
        nodes = trie.path(req, block_size, create=True)
        h, limit = 0, min(len(nodes), (req.input_tokens - 1) // block_size)
        while h < limit and nodes[h] in cached:
            del cached[nodes[h]]  # touched: in use now
            h += 1
        hits += h
        prompt = math.ceil(req.input_tokens / block_size)
        take(prompt - h)
        published = nodes[h:]
        assert not any(n in cached for n in published)
        take(total - prompt)
        held = nodes[:h] + published
        plain += total - len(held)
        for node in reversed(held):
            cached[node] = None
    return hits, evictions, rejected


def synthetic_trace(seed: int, n: int = 160) -> list[TraceRequest]:
    """Chained hash ids (one id per (parent id, label)), much prefix sharing, partial last blocks."""
    rng = random.Random(seed)
    ids: dict[tuple[int, int], int] = {}
    labels_seen: list[list[int]] = []
    requests = []
    for i in range(n):
        if labels_seen and rng.random() < 0.7:
            base = rng.choice(labels_seen)
            labels = base[:rng.randint(1, len(base))] + [rng.randrange(3) for _ in range(rng.randint(0, 3))]
        else:
            labels = [rng.randrange(3) for _ in range(rng.randint(1, 6))]
        labels = labels[:8]
        chain, parent = [], -1
        for label in labels:
            parent = ids.setdefault((parent, label), len(ids))
            chain.append(parent)
        input_tokens = (len(chain) - 1) * 512 + rng.randint(1, 512)
        requests.append(TraceRequest(i * 0.4, input_tokens, rng.randint(0, 900), tuple(chain)))
        labels_seen.append(labels)
    return requests


# ---- oracles on the real trace --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mooncake() -> list[TraceRequest]:
    return load_trace().requests


def _check_against_oracle(requests: list[TraceRequest], block_size: int) -> tuple[int, int, int]:
    hits, blocks, tokens = unbounded_oracle(requests, block_size)
    pool = BlockPool(sum(math.ceil((r.input_tokens + r.output_tokens) / block_size) for r in requests))
    result = run_replay(requests, ReplayConfig(block_size=block_size, timing="instant"), pool=pool)
    assert (result.hit_blocks, result.prompt_blocks) == (hits, blocks)
    assert result.block_hit_ratio == hits / blocks
    assert result.token_hit_ratio == hits * block_size / tokens
    assert (result.requests_completed, result.requests_rejected, result.evictions) == (len(requests), 0, 0)
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_integrity()
    return hits, blocks, tokens


def test_unbounded_instant_replay_equals_oracle_at_512(mooncake: list[TraceRequest]) -> None:
    hits, blocks, tokens = _check_against_oracle(mooncake, 512)
    # The oracle against the figures published in issue 6.
    assert (hits, blocks) == (105_592, 276_491)
    assert round(hits / blocks, 6) == 0.381900 and round(hits * 512 / tokens, 6) == 0.373380


def test_unbounded_instant_replay_equals_oracle_at_128(mooncake: list[TraceRequest]) -> None:
    _check_against_oracle(mooncake[:6000], 128)


@pytest.mark.slow
def test_unbounded_instant_replay_equals_oracle_at_16(mooncake: list[TraceRequest]) -> None:
    hits, blocks, _ = _check_against_oracle(mooncake, 16)
    # issue 6's figure, 0.373849, counts every full prompt block a request could hit; the engine's rule
    # (the last prompt token is always computed) leaves out the last block of prompts of a multiple of 16
    trie, every = PrefixTrie(), 0
    for req in mooncake:
        every += len(trie.path(req, 16, create=False))
        trie.path(req, 16, create=True)
    assert round(every / blocks, 6) == 0.373849 and hits < every
    assert round(hits / blocks, 6) == 0.373848


def test_default_pool_is_unbounded(mooncake: list[TraceRequest]) -> None:
    requests = mooncake[:500]
    result = run_replay(requests, ReplayConfig(block_size=64))
    assert result.num_blocks == sum(kv_blocks(r, 64) for r in requests)
    assert (result.evictions, result.preemptions, result.requests_rejected) == (0, 0, 0)
    assert result.hit_blocks == unbounded_oracle(requests, 64)[0]


# ---- bounded pools: brute-force LRU model ---------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("block_size", [512, 128, 32])
@pytest.mark.parametrize("scale", [0.5, 1, 2, 5])
def test_bounded_instant_replay_matches_lru_model(seed: int, block_size: int, scale: float) -> None:
    requests = synthetic_trace(seed)
    biggest = max(kv_blocks(r, block_size) for r in requests)
    num_blocks = int(biggest * scale)
    pool = BlockPool(num_blocks)
    result = run_replay(requests, ReplayConfig(block_size=block_size, num_blocks=num_blocks), pool=pool)
    hits, evictions, rejected = lru_model(requests, block_size, num_blocks)
    assert (result.hit_blocks, result.evictions, result.requests_rejected) == (hits, evictions, rejected)
    assert result.requests_completed == len(requests) - rejected
    assert pool.num_used_blocks == 0
    pool.check_integrity()
    if scale >= 1:
        assert result.evictions > 0  # the bound really bites


# ---- trace timing: hand-computed schedules --------------------------------------------------------------

def test_preemption_by_recompute_hand_schedule() -> None:
    # Block size 4, 4 blocks; A and B: 4 prompt + 8 output tokens (KV of 11 tokens: 3 blocks each), both at
    # t = 0. Step 1 prefills A and B (1 block each) and samples their first tokens; step 2 both decode
    # position 4 into a 2nd block (4 used); steps 3-5 decode positions 5-7 (4 used). Step 6: A needs a 3rd
    # block for position 8, none free: B (newest) is preempted, A takes one (3 used). Step 7: B (4 prompt +
    # 5 generated = 9 tokens, 3 blocks) does not fit the 1 free block. Step 8: A samples its 8th token and
    # finishes. Step 9: B recomputes its 9 tokens (3 used) and samples its 6th; steps 10-11 decode it.
    requests = [TraceRequest(0.0, 4, 8), TraceRequest(0.0, 4, 8)]
    pool = BlockPool(4)
    result = run_replay(requests, ReplayConfig(block_size=4, num_blocks=4, timing="trace", **UNIT_COSTS),
                        pool=pool)
    assert result.preemptions == 1 and result.requests_completed == 2
    assert result.simulated_s == 11 and result.peak_blocks_used == 4
    used_per_step = [2, 4, 4, 4, 4, 3, 3, 3, 3, 3, 3]
    assert result.mean_blocks_used == pytest.approx(sum(used_per_step) / 11)
    assert pool.num_used_blocks == 0
    pool.check_integrity()


@pytest.mark.parametrize(("budget", "max_running", "expected_s"), [
    (8192, 256, 1),  # step 1 prefills all three; each samples its one output token and finishes
    (250, 256, 2),   # A and B prefill and finish in step 1 beside C's first 50 tokens; C's 50 more in step 2
    (8192, 2, 2),    # two at a time: A, B prefill and finish; C prefills and finishes
])
def test_token_budget_and_max_running(budget: int, max_running: int, expected_s: int) -> None:
    requests = [TraceRequest(0.0, 100, 1) for _ in range(3)]
    config = ReplayConfig(block_size=16, num_blocks=100, timing="trace", max_batched_tokens=budget,
                          max_running=max_running, **UNIT_COSTS)
    result = run_replay(requests, config)
    assert result.simulated_s == expected_s and result.requests_completed == 3


def test_chunked_prefill_by_hand() -> None:
    """Issue 9, item 8: a prompt longer than the budget is prefilled in chunks, as the engine does.
    100 tokens at a budget of 32, block 16, 2 output tokens: chunks 32, 32, 32, 4 (steps 1-4; the last
    samples the first output), then one decode step (position 100, the second output). Blocks held per
    step (allocated per chunk): 2, 4, 6, 7, then 7 (101 tokens)."""
    pool = BlockPool(20)
    config = ReplayConfig(block_size=16, num_blocks=20, timing="trace", max_batched_tokens=32, **UNIT_COSTS)
    result = run_replay([TraceRequest(0.0, 100, 2)], config, pool=pool, record_timeline=True)
    assert result.simulated_s == 5 and result.peak_blocks_used == 7
    assert result.mean_blocks_used == pytest.approx((2 + 4 + 6 + 7 + 7) / 5)
    assert [used for _, used, _, _ in result.timeline[:5]] == [2, 4, 6, 7, 7]


def test_chunked_prefill_publishes_each_full_block_after_its_chunk() -> None:
    """The 64-token prompt of hash id 5 is 4 blocks of 16 (sub-blocks of one 512-token hash block). Budget
    24: the first request computes tokens 0-23 in step 1 (block 0 full: published), 24-47 in step 2
    (blocks 1, 2). The second, same prompt, arrives at t = 2; in step 3 the first takes its last 16 tokens
    and the second is admitted with the 8 tokens left: its lookup finds blocks 0, 1, 2, not block 3, which
    the first publishes only after step 3 (and which the second would not take anyway: it computes its
    last prompt token, so it may hit the blocks of its first 63 tokens only)."""
    first, second = TraceRequest(0.0, 64, 1, (5,)), TraceRequest(2.0, 64, 1, (5,))
    config = ReplayConfig(block_size=16, num_blocks=20, timing="trace", max_batched_tokens=24, **UNIT_COSTS)
    result = run_replay([first, second], config)
    assert (result.hit_blocks, result.prompt_blocks, result.requests_completed) == (3, 8, 2)


def test_a_long_prompt_no_longer_drains_the_server() -> None:
    """A decoding request keeps decoding while a prompt of 4x the budget is prefilled beside it. A: 16
    prompt tokens, 10 output, at t = 0; B: 256 prompt tokens, 1 output, at t = 1; budget 64 tokens, block
    16. Step 1 prefills A (its first output); steps 2-10 decode A's 9 others (1 token each) while steps
    2-6 give B chunks of 63, 63, 63, 63 and 4 tokens (what A's decode leaves of the budget): B samples
    its one output in step 6 and finishes. Without chunks B would wait for an empty step, after A's last
    decode (step 10)."""
    requests = [TraceRequest(0.0, 16, 10), TraceRequest(1.0, 256, 1)]
    config = ReplayConfig(block_size=16, num_blocks=40, timing="trace", max_batched_tokens=64, **UNIT_COSTS)
    result = run_replay(requests, config, record_timeline=True)
    assert result.simulated_s == 10 and result.requests_completed == 2
    # B's blocks: 4, 8, 12, 16, 16 in steps 2-6 beside A's 2 (A needs its 2nd block at position 16, step 2)
    assert [used for _, used, _, _ in result.timeline[1:7]] == [6, 10, 14, 18, 18, 2]


def test_instant_time_model_by_hand() -> None:
    # Request 1: 100 prompt + 20 output tokens, block size 16. Prefill: 0.01 + 100 x 0.001 = 0.11 s holding
    # 7 blocks, sampling the first output; 19 decode steps of 0.012 s: positions 100-111 on 7 blocks,
    # 112-118 on 8 blocks. Request 2 arrives at t = 10: 16 tokens, no output: 0.01 + 16 x 0.001 = 0.026 s
    # on 1 block.
    requests = [TraceRequest(0.0, 100, 20), TraceRequest(10.0, 16, 0)]
    config = ReplayConfig(block_size=16, step_s=0.01, prefill_token_s=0.001, decode_token_s=0.002)
    result = run_replay(requests, config)
    block_seconds = 7 * 0.11 + (12 * 7 + 7 * 8) * 0.012 + 1 * 0.026
    assert result.simulated_s == pytest.approx(10.026)
    assert result.mean_blocks_used == pytest.approx(block_seconds / 10.026)
    assert result.peak_blocks_used == 8 and result.prompt_blocks == 6 + 1
    # block ops: lookup (none: no hash ids), allocate 7 + 1, free 8; then allocate 1, free 1.
    assert result.block_ops == 18


def test_oversized_request_is_rejected_and_counted() -> None:
    requests = [TraceRequest(0.0, 100, 20), TraceRequest(1.0, 16, 0)]  # KV of 119 tokens: 8 blocks; 1
    for timing in ("instant", "trace"):
        result = run_replay(requests, ReplayConfig(block_size=16, num_blocks=7, timing=timing))
        # the rejected prompt counts as misses: 100 // 16 = 6 of its blocks, and 1 of the 16-token prompt
        assert (result.requests_rejected, result.requests_completed, result.prompt_blocks) == (1, 1, 6 + 1)
        assert (result.rejected_prompt_blocks, result.hit_blocks, result.token_hit_ratio) == (6, 0, 0.0)


def test_every_pool_size_shares_the_hit_ratio_denominator() -> None:
    # A (2 blocks of 512) twice around a 10-block request that shares nothing: a 4-block pool rejects it
    # (its 5,120 tokens need 10 blocks) and the second A hits 1 block ((1,024 - 1) // 512); the ratio is
    # over all 2 + 10 + 2 = 14 prompt blocks at every size, the rejected 10 as misses
    a, huge = TraceRequest(0.0, 1024, 1, (1, 2)), TraceRequest(1.0, 5120, 1, tuple(range(100, 110)))
    requests = [a, huge, TraceRequest(2.0, 1024, 1, (1, 2))]
    small, big = (run_replay(requests, ReplayConfig(block_size=512, num_blocks=n)) for n in (4, 40))
    assert (small.requests_rejected, small.rejected_prompt_blocks, small.hit_blocks) == (1, 10, 1)
    assert (big.requests_rejected, big.rejected_prompt_blocks, big.hit_blocks) == (0, 0, 1)
    assert small.prompt_blocks == big.prompt_blocks == 14
    assert small.block_hit_ratio == big.block_hit_ratio == 1 / 14
    assert small.token_hit_ratio == 512 / (1024 + 5120 + 1024)


def test_hits_on_a_hand_trace() -> None:
    # Block size 256: ids (1, 2) -> sub-blocks (1,0) (1,1) (2,0) (2,1); ids (1, 3) share only (1,0) (1,1).
    requests = [TraceRequest(0.0, 1024, 0, (1, 2)), TraceRequest(1.0, 1024, 0, (1, 3)),
                TraceRequest(2.0, 700, 0, (1, 2))]  # 700 tokens: 2 full sub-blocks, both cached
    result = run_replay(requests, ReplayConfig(block_size=256))
    assert (result.hit_blocks, result.prompt_blocks) == (0 + 2 + 2, 4 + 4 + 2)
    assert result.token_hit_ratio == 4 * 256 / (1024 + 1024 + 700)


def test_prefill_percentiles_on_the_hand_trace() -> None:
    # The same hand trace: the requests prefill 1,024, 1,024 - 512 and 700 - 512 tokens; nearest rank over
    # 3 values: p50 the 2nd smallest (ceil(1.5)), p90, p95 and p99 the 3rd (ceil(2.7), ...)
    requests = [TraceRequest(0.0, 1024, 0, (1, 2)), TraceRequest(1.0, 1024, 0, (1, 3)),
                TraceRequest(2.0, 700, 0, (1, 2))]
    result = run_replay(requests, ReplayConfig(block_size=256))
    assert [getattr(result, f"prefill_tokens_p{q}") for q in (50, 90, 95, 99)] == [512, 1024, 1024, 1024]


def test_prefill_percentiles_leave_out_rejected_requests() -> None:
    # The shared-denominator trace: the 4-block pool rejects the 5,120-token request, so only A (1,024
    # prefilled) and A again (1,024 - 512) count; the 40-block pool serves all three
    a, huge = TraceRequest(0.0, 1024, 1, (1, 2)), TraceRequest(1.0, 5120, 1, tuple(range(100, 110)))
    requests = [a, huge, TraceRequest(2.0, 1024, 1, (1, 2))]
    small, big = (run_replay(requests, ReplayConfig(block_size=512, num_blocks=n)) for n in (4, 40))
    assert (small.prefill_tokens_p50, small.prefill_tokens_p90) == (512, 1024)
    assert (big.prefill_tokens_p50, big.prefill_tokens_p90, big.prefill_tokens_p99) == (1024, 5120, 5120)


def test_prefill_percentiles_nearest_rank_by_hand() -> None:
    # 1..200: the q-th percentile by nearest rank is the value at rank ceil(q x 200 / 100) = 2q
    values = list(range(200, 0, -1))
    assert prefill_percentiles(values) == {"prefill_tokens_p50": 100, "prefill_tokens_p90": 180,
                                           "prefill_tokens_p95": 190, "prefill_tokens_p99": 198}
    assert prefill_percentiles([7]) == dict.fromkeys(prefill_percentiles([7]), 7)
    assert set(prefill_percentiles([]).values()) == {0}


def test_fast_forward_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    requests = synthetic_trace(7, n=120)
    config = ReplayConfig(block_size=64, num_blocks=150, timing="trace", max_batched_tokens=2048,
                          **UNIT_COSTS)
    fast = run_replay(requests, config).to_dict()
    monkeypatch.setattr(replay_module, "FAST_FORWARD", False)
    slow = run_replay(requests, config).to_dict()
    for noisy in ("wall_s", "block_ops_per_s"):
        del fast[noisy], slow[noisy]
    assert fast == slow and fast["preemptions"] > 0 and fast["evictions"] > 0


@pytest.mark.parametrize(("block_size", "num_blocks", "policy"), [
    (16, None, "lru"), (1, None, "lru"), (64, 150, "lru"), (32, 120, "priority"), (16, 400, "fifo")])
def test_lone_decode_changes_nothing(monkeypatch: pytest.MonkeyPatch, block_size: int, num_blocks: int | None,
                                     policy: str) -> None:
    # Instant timing runs a lone request's decode steps at once (Scheduler.run_lone_decode) where its
    # blocks come without eviction, and steps otherwise (bounded pools: evictions and preemptions). With
    # step costs that are not round numbers the clock's sums must come out to the last bit as the
    # replay without it adds them (the pure decode steps of a block in one tick); with whole seconds,
    # as stepping one step at a time (FAST_FORWARD off).
    requests = synthetic_trace(11, n=60)
    odd = ReplayConfig(block_size=block_size, num_blocks=num_blocks, policy=policy, step_s=0.0031,
                       prefill_token_s=1.7e-5, decode_token_s=9.3e-5)
    unit = ReplayConfig(block_size=block_size, num_blocks=num_blocks, policy=policy, **UNIT_COSTS)
    runs: list[int] = []
    real = replay_module.Scheduler.run_lone_decode

    def replay(config: ReplayConfig, lone: bool = True, fast: bool = True) -> dict:
        monkeypatch.setattr(replay_module.Scheduler, "run_lone_decode",
                            (lambda sched: runs.append(real(sched)) or runs[-1]) if lone else lambda sched: 0)
        monkeypatch.setattr(replay_module, "FAST_FORWARD", fast)
        out = run_replay(requests, config).to_dict()
        del out["wall_s"], out["block_ops_per_s"]
        return out

    assert replay(odd) == replay(odd, lone=False)
    assert replay(unit) == replay(unit, lone=False, fast=False)
    assert sum(1 for n in runs if n) > 10
    if num_blocks is not None and policy == "lru":
        assert replay(odd)["evictions"] > 0 and 0 in runs  # some requests stepped: their blocks evict


@pytest.mark.parametrize("seed", [3, 4])
def test_trace_timing_bounded_pool_ends_clean(seed: int) -> None:
    requests = synthetic_trace(seed)
    pool = BlockPool(60)
    config = ReplayConfig(block_size=32, num_blocks=60, timing="trace", max_batched_tokens=1024)
    result = run_replay(requests, config, pool=pool)
    assert result.requests_completed + result.requests_rejected == len(requests)
    assert result.peak_blocks_used <= 60 and result.preemptions > 0
    assert pool.num_used_blocks == 0
    pool.check_integrity()
    # Concurrency can only hide prefixes that are not yet published: never more hits than serial, unbounded.
    unbounded = run_replay(requests, ReplayConfig(block_size=32, timing="trace"))
    assert unbounded.hit_blocks <= unbounded_oracle(requests, 32)[0]
    assert unbounded.preemptions == 0 and unbounded.requests_completed == len(requests)


def test_bad_configs_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="divide 512"):
        run_replay([TraceRequest(0.0, 600, 1, (1, 2))], ReplayConfig(block_size=100))
    run_replay([TraceRequest(0.0, 600, 1)], ReplayConfig(block_size=100))  # no hash ids: any block size
    with pytest.raises(ConfigError, match="timing"):
        ReplayConfig(timing="realtime")
    with pytest.raises(ConfigError, match="num_blocks"):
        ReplayConfig(num_blocks=0)
    with pytest.raises(ConfigError, match="step_s"):
        ReplayConfig(step_s=-1.0)
    with pytest.raises(ConfigError, match="all-free pool"):
        run_replay([TraceRequest(0.0, 16, 1)], ReplayConfig(num_blocks=5), pool=BlockPool(4))


# ---- CLI, plot and bench --------------------------------------------------------------------------------

ISSUE_NAMES = {"requests_completed", "requests_rejected", "prompt_blocks", "hit_blocks", "block_hit_ratio",
               "token_hit_ratio", "peak_blocks_used", "mean_blocks_used", "preemptions", "block_ops",
               "block_ops_per_s", "wall_s"}


def _json_run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["replay", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_has_the_issue_names(capsys: pytest.CaptureFixture[str], mooncake: list[TraceRequest]
                                      ) -> None:
    report = _json_run(capsys, "--block-size", "512", "--max-requests", "300")
    assert report.keys() >= ISSUE_NAMES
    hits, blocks, _ = unbounded_oracle(mooncake[:300], 512)
    assert (report["hit_blocks"], report["prompt_blocks"]) == (hits, blocks)
    assert report["requests_completed"] == 300


def test_cli_human_output_and_azure(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--format", "azure", "--max-requests", "50", "--num-blocks", "4000"]) == 0
    out = capsys.readouterr().out
    assert "AzureLLMInferenceTrace_code.csv" in out and "requests_completed   50" in out
    assert "hit_blocks           0" in out


def test_a_replay_imports_no_torch() -> None:
    """In a fresh process, the replay's modules and a whole ``kvpool replay`` run leave torch (~220 MB
    resident) out of the process: a replay makes no tensor. It still replays: the 5 requests asked for
    complete on a pool of 1,000 blocks (each of the trace's first 5 prompts needs under 500 blocks of 16)."""
    code = ("import contextlib, io, json, sys; import kvpool.cli.replay, kvpool.trace.replayer; "
            "from kvpool.cli import main; out = io.StringIO(); imported = 'torch' in sys.modules\n"
            "with contextlib.redirect_stdout(out):\n"
            "    code = main(['replay', '--num-blocks', '1000', '--max-requests', '5', '--json'])\n"
            "print(imported, code, json.loads(out.getvalue())['requests_completed'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "0", "5", "False"]


def test_a_replay_with_a_model_config_imports_no_torch() -> None:
    """``--model-config`` sizes the pool from the model's KV spec, whose dtype is read by name: in a fresh
    process the run leaves torch out too, and still sizes the pool as test_cli_num_blocks_from_model_config
    does (Qwen2.5-0.5B: 192 KiB per 16-token block, 1 GiB x 0.9 / 192 KiB = 4,915 blocks)."""
    config = CONFIGS / "qwen2.5-0.5b.json"
    code = ("import contextlib, io, json, sys; from kvpool.cli import main; out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            f"    code = main(['replay', '--max-requests', '5', '--model-config', {str(config)!r}, "
            "'--gpu-memory', '1GiB', '--json'])\n"
            "print(code, json.loads(out.getvalue())['num_blocks'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", str(1024 * 1024 * 9 // 10 // 192), "False"]


def test_a_hybrid_replay_imports_no_torch() -> None:
    """A recurrent hybrid's ``--model-config`` (Qwen3-Next-80B) sizes its state from dtype names too: in a
    fresh process ``--state-split all`` leaves torch out, and each request's state is, by hand from the
    config (36 gated-delta-net layers of 48, bfloat16): conv (2 x 16 x 128 + 32 x 128) channels x (4 - 1)
    x 2 B = 49,152 B, SSM 32 x 128 x 128 x 2 B = 1,048,576 B; 36 x 1,097,728 B = 39,518,208 B."""
    config = CONFIGS / "hybrid" / "qwen3-next-80b-a3b-instruct.json"
    code = ("import contextlib, io, json, sys; from kvpool.cli import main; out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            f"    code = main(['replay', '--max-requests', '5', '--model-config', {str(config)!r}, "
            "'--gpu-memory', '80GiB', '--state-split', 'all', '--json'])\n"
            "runs = json.loads(out.getvalue())['runs']\n"
            "print(code, len(runs), {r['state_bytes'] for r in runs}.pop(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", "3", str(36 * (8192 * 3 * 2 + 32 * 128 * 128 * 2)), "False"]


def test_cli_num_blocks_from_model_config(capsys: pytest.CaptureFixture[str]) -> None:
    # Qwen2.5-0.5B: 12 KiB per token (DESIGN.md), 192 KiB per 16-token block; 1 GiB x 0.5 = 512 MiB.
    report = _json_run(capsys, "--max-requests", "20", "--model-config", str(CONFIGS / "qwen2.5-0.5b.json"),
                       "--gpu-memory", "1GiB", "--gpu-memory-utilization", "0.5")
    assert report["num_blocks"] == 512 * 1024 // 192
    assert main(["replay", "--model-config", str(CONFIGS / "qwen2.5-0.5b.json")]) == 2
    assert "--gpu-memory" in capsys.readouterr().err


def test_cli_malformed_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 7, "hash_ids": [1, 2]}\n'
    path.write_text(good + "{oops\n" + good)
    assert main(["replay", str(path)]) == 2
    assert f"{path}:2:" in capsys.readouterr().err
    report = _json_run(capsys, str(path), "--skip-malformed", "--block-size", "512")
    assert (report["skipped_rows"], report["requests_completed"], report["hit_blocks"]) == (1, 2, 1)


def test_cli_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "replay.png"
    report = _json_run(capsys, "--block-size", "512", "--max-requests", "200", "--timing", "trace",
                       "--num-blocks", "400", "--plot", str(png))
    assert report["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bench_replay_suite(capsys: pytest.CaptureFixture[str], mooncake: list[TraceRequest]) -> None:
    assert main(["bench", "replay", "--json", "--max-requests", "200", "--block-sizes", "512,64"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert set(rows) == {"block_size_512", "block_size_64"}
    for block_size in (512, 64):
        row = rows[f"block_size_{block_size}"]
        hits, blocks, _ = unbounded_oracle(mooncake[:200], block_size)
        assert row["block_hit_ratio"] == hits / blocks and row["block_ops"] > 0 and row["block_ops_per_s"] > 0


# ---- regressions: bad input exits 2 with one line before any replay work -------------------------------

@pytest.mark.parametrize("plot", ["replay.txt", "no-such-folder/replay.png"])
def test_cli_bad_plot_path_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], plot: str) -> None:
    assert main(["replay", "--max-requests", "5", "--plot", str(tmp_path / plot)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool replay: error: --plot") and err.count("\n") == 1


def test_pool_too_large_for_memory_is_a_config_error() -> None:
    requests = [TraceRequest(0.0, 16, 10**14)]  # the unbounded pool would be 6e12 blocks
    with pytest.raises(ConfigError, match="past the largest pool"):
        run_replay(requests, ReplayConfig(block_size=16))


def test_a_long_sweep_off_a_terminal_prints_a_line_per_run(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 30: a sweep with --report ran 18 minutes without a word into a log; now each finished run says
    so on stderr (stdout keeps the report, --json's too). 600 requests x 2 sizes (lru alone: --no-bound)
    = 1,200 >= the 1,000 from which progress shows; --no-progress silences it; at a terminal it is a tqdm
    bar instead."""
    argv = ["replay", "--max-requests", "600", "--sweep", "300,900", "--json", "--no-bound"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    runs = json.loads(out)["runs"]
    assert [line.split(":")[1].split(" done")[0] for line in lines] == [" run 1 of 2", " run 2 of 2"]
    for line, size, run in zip(lines, ("300", "900"), runs, strict=True):
        assert line.startswith("replay: run ") and f"({size} blocks, lru): block hit ratio " \
            f"{run['block_hit_ratio']:.4f}," in line
    assert main([*argv, "--no-progress"]) == 0 and capsys.readouterr().err == ""
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "replay: run" not in err and "1200/1200" in err  # the bar, ended full
