"""tlru, lineage and the queue-informed variants on a BlockPool, against hand counts (each in a comment);
tlru against SGLang itself: tests/integrations/test_sglang_tlru.py."""

from __future__ import annotations

import pytest

from kvpool.allocators.block_pool import BlockPool
from kvpool.allocators.policies import POLICIES, make_policy
from kvpool.allocators.prefix_policies import LineagePolicy, QueueInformedPolicy, TLRUPolicy
from kvpool.errors import InvalidArgumentError


def run(pool: BlockPool, hashes: list[int]) -> list[int]:
    """One request: hit its cached prefix, compute the rest, free its table tail first; its block ids."""
    hit = pool.lookup(hashes)
    pool.touch(hit)
    new = pool.allocate(len(hashes) - len(hit))
    pool.cache_blocks(new, hashes[len(hit):])
    pool.free((hit + new)[::-1])
    return hit + new


def test_tlru_evicts_the_tel_safe_tail_first() -> None:
    # one request of 10 blocks, threshold 4, next prompt 1: L = 10, budget = 10 + 1 - 4 = 7, so depths 7-9
    # are TEL-safe and go first (freed tail first: 9, 8, 7), then the rest least recently freed first
    pool = BlockPool(10, policy=TLRUPolicy(threshold=4, next_prompt_estimate=1))
    ids = run(pool, list(range(100, 110)))
    assert [pool.policy.is_safe(b) for b in ids] == [False] * 7 + [True] * 3
    assert pool.evictable_blocks() == [ids[9], ids[8], ids[7], *ids[6::-1]]


def test_tlru_high_water_depth_does_not_shrink() -> None:
    # a 6-block turn then its 10-block continuation: L = 10 marks depths < 10 + 0 - 3 = 7 unsafe; the
    # continuation's tail evicted, a later short turn on the same branch (6 blocks) does not lift the marks
    pool = BlockPool(12, policy=TLRUPolicy(threshold=3, next_prompt_estimate=0))
    first = run(pool, list(range(6)))
    run(pool, list(range(10)))
    assert [pool.policy.is_safe(b) for b in first] == [False] * 6
    pool.free(pool.allocate(12))  # evict everything
    again = run(pool, list(range(6)))  # a new tree: L = 6, depths < 3 unsafe
    assert [pool.policy.is_safe(b) for b in again] == [False] * 3 + [True] * 3


def test_tlru_refuses_what_sglang_refuses() -> None:
    with pytest.raises(InvalidArgumentError, match="threshold > next_prompt_estimate"):
        TLRUPolicy(threshold=4, next_prompt_estimate=4)


def test_lineage_generations_follow_the_turns() -> None:
    # a system prompt (2 blocks) then a conversation: turn 1 reuses the system prompt (generation 1), so its
    # blocks get 2; turn 2 reuses turn 1's (2): 3; a one-off prompt on the system prompt alone: 2
    pool = BlockPool(64, policy="lineage")
    policy = pool.policy
    assert isinstance(policy, LineagePolicy)
    system = run(pool, [1, 2])
    turn1 = run(pool, [1, 2, 10, 11])
    turn2 = run(pool, [1, 2, 10, 11, 20])
    other = run(pool, [1, 2, 30])
    assert [policy.generation(b) for b in system] == [1, 1]
    assert [policy.generation(b) for b in turn1[2:]] == [2, 2]
    assert policy.generation(turn2[4]) == 3 and policy.generation(other[2]) == 2
    # keys: generation x (4 x 64) + blocks freed so far: the one-off prompt's blocks (generation 2, freed
    # last) go before turn 2's (generation 3); turn 1's blocks were last freed by turn 2 (generation 3)
    order = pool.evictable_blocks()
    assert order.index(other[2]) < order.index(turn2[4]) and order.index(other[2]) < order.index(turn1[2])


def test_lineage_remembers_an_evicted_prefix_generation() -> None:
    # ghost_sample 1 remembers every evicted hash: turn 2 recomputes turn 1's evicted blocks and still
    # learns generation 2 from them, so its own block gets 3
    pool = BlockPool(6, policy=LineagePolicy(ghost_sample=1))
    run(pool, [1, 2])
    run(pool, [1, 2, 10, 11])
    pool.free(pool.allocate(6))  # evict everything
    turn2 = run(pool, [1, 2, 10, 11, 20])
    assert [pool.policy.generation(b) for b in turn2] == [1, 1, 2, 2, 3]


def test_lineage_ghost_remembers_a_requests_marked_depths_and_its_deepest_block() -> None:
    # default ghost: a request's blocks at depth 0, 1, 3 (2^j - 1) and its deepest are remembered when
    # evicted. turn 1 = [1, 2, 10, 11, 12, 13] (generation 1: nothing reused); depths 0, 1, 3 (hashes 1, 2,
    # 11) and the deepest (13) are marked; 10 and 12 are not. After everything is evicted, a continuation
    # [1, 2, 10, 11, 12, 13, 20] learns generation 1 from 1, 2, 11 and 13, so its new blocks (10, 12, 20)
    # get 2; then [40, 10, 12] (10 and 12 were unmarked in both requests) learns nothing: generation 1
    pool = BlockPool(8, policy=LineagePolicy())
    run(pool, [1, 2, 10, 11, 12, 13])
    pool.free(pool.allocate(8))  # evict everything: the ghost holds 1, 2, 11, 13
    assert list(pool.policy._ghost) == [13, 11, 2, 1]  # noqa: SLF001 (evicted deepest first)
    turn2 = run(pool, [1, 2, 10, 11, 12, 13, 20])
    assert [pool.policy.generation(b) for b in turn2] == [1, 1, 2, 1, 2, 1, 2]
    pool.free(pool.allocate(8))
    assert [pool.policy.generation(b) for b in run(pool, [40, 10, 12])] == [1, 1, 1]


def test_queue_informed_keeps_what_a_waiting_request_will_hit() -> None:
    # 4 blocks freed a, b, c, d: LRU evicts a first; with a waiting request wanting a, b goes first and a
    # last; when the request leaves the queue, a rejoins as freed now (after d)
    for name, first in (("lru", 0), ("queue-lru", 1)):
        pool = BlockPool(4, policy=name)
        ids = [run(pool, [h])[0] for h in (10, 11, 12, 13)]
        pool.waiting([10], 1)
        assert pool.allocate(1) == [ids[first]], name
    assert pool.evictable_blocks() == [ids[2], ids[3], ids[0]]
    pool.waiting([10], -1)
    assert pool.evictable_blocks() == [ids[2], ids[3], ids[0]]
    pool.check_integrity()


def test_queue_informed_through_the_scheduler() -> None:
    from kvpool.requests.kv_manager import KVCacheManager
    from kvpool.requests.request import Request
    from kvpool.requests.scheduler import Scheduler
    from kvpool.spec import KVCacheGroup, LayerKind

    kv = KVCacheManager((KVCacheGroup(0, LayerKind.FULL, None, (0,), 1, 16),), 8, policy="queue-lru")
    sched = Scheduler(kv, max_num_batched_tokens=1 << 20, max_num_seqs=1)
    sched.add_request(Request(0, None, 1, num_prompt_tokens=32, block_hashes=[5, 6]))
    assert kv.pool.policy._wanted == {}  # noqa: SLF001  (nothing cached: nothing it would hit)
    out = sched.schedule()
    sched.update(out, [1])  # one output token: it finishes, its two blocks cached
    assert kv.pool.num_evictable_blocks == 2
    # 5 is its cached prefix; 6 is cached but past 9, which is not: it would not hit 6
    sched.add_request(Request(1, None, 1, num_prompt_tokens=48, block_hashes=[5, 9, 6]))
    assert kv.pool.policy._wanted == {5: 1}  # noqa: SLF001
    sched.schedule()
    assert kv.pool.policy._wanted == {}  # noqa: SLF001  (admitted: no longer waiting)


@pytest.mark.parametrize("base", ["lru", "lineage"])
def test_queue_informed_evicts_as_its_base_when_nothing_waits(tmp_path, base: str) -> None:
    # Instant timing: a request waits only until its own admission, and announces only the cached prefix
    # it hits there, so nothing is kept aside and nothing comes back out of order: the queue-informed
    # variant hits and evicts exactly as its base (on this slice of the generated trace queue-lineage
    # differed when a request announced every hash it named: cached blocks past a break in its prefix came
    # back as freed now after its admission)
    import json

    from kvpool.trace.loaders import load_trace
    from kvpool.trace.replay import ReplayConfig, run_replay
    from kvpool.trace.synthetic import generate

    path = tmp_path / "syn.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in generate(0)[:600]))
    requests = load_trace(path).requests
    for n in (1000, 2000):
        plain, queued = (run_replay(requests, ReplayConfig(num_blocks=n, policy=p))
                         for p in (base, f"queue-{base}"))
        assert (queued.hit_blocks, queued.evictions) == (plain.hit_blocks, plain.evictions), n


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_builds_by_name_and_keeps_the_pool_whole(name: str) -> None:
    import random

    rng, pool = random.Random(7), BlockPool(48, policy=name)
    assert pool.policy.name == name and make_policy(name).name == name
    for _ in range(400):
        conversation = rng.randrange(12)
        run(pool, [conversation * 100 + j for j in range(rng.randrange(1, 9))])
        if rng.random() < 0.2:
            pool.waiting([conversation * 100], 1 if rng.random() < 0.5 else -1)
    pool.check_integrity()


def test_queue_informed_wraps_a_plain_policy_only() -> None:
    with pytest.raises(InvalidArgumentError):
        QueueInformedPolicy(QueueInformedPolicy(make_policy("fifo")))


def test_valued_admission_keeps_one_hit_wonders_out_of_the_tiers() -> None:
    # lru values every block (nothing kept out); s3fifo values only what reached its main queue: the
    # blocks evicted from the small queue unhit stay out, counted in not_admitted
    from kvpool.tiers.backend import Namespace
    from kvpool.tiers.host import HostTier
    from kvpool.trace.loaders import load_trace
    from kvpool.trace.replay import ReplayConfig, run_replay

    requests = load_trace(max_requests=300).requests
    out = {}
    for policy in ("lru", "s3fifo"):
        host = HostTier(4000, Namespace("t", "none", "hash-only", hash_scheme="trace-block-ids"))
        result = run_replay(requests, ReplayConfig(block_size=64, num_blocks=1500, policy=policy),
                            tiers=[host], tier_admission="valued")
        out[policy] = result.tiers["not_admitted"]
    assert out["lru"] == 0 and out["s3fifo"] > 0


def test_lineage_caps_the_level_so_a_finished_loop_ages_out() -> None:
    # an agent loop: 4 steps, each reusing the last, so its last step's block has generation 5; then a
    # one-off turn on the system prompt (generation 2). max_level 2: both at level 2, so recency decides and
    # the loop's blocks (freed earlier) go first; uncapped (max_level 16) the loop's generation-5 block
    # outlives the one-off by 3 levels
    for max_level, loop_first in ((2, True), (16, False)):
        pool = BlockPool(64, policy=LineagePolicy(max_level=max_level, reuse_aging=0))
        run(pool, [1])
        loop = [run(pool, [1, *range(10, 10 + k)]) for k in range(1, 5)][-1]
        other = run(pool, [1, 50])
        assert pool.policy.generation(loop[4]) == 5 and pool.policy.generation(other[1]) == 2
        order = pool.evictable_blocks()
        assert (order.index(loop[4]) < order.index(other[1])) is loop_first, max_level


def test_lineage_span_follows_the_reuse_distance_past_lrus_reach() -> None:
    # The policy alone, a pool of 4 blocks, aging 8: the span starts at 8 x 4 = 32 (level L at offset 32 L)
    # and the mean reuse distance at 32 / reuse_aging = 32.
    policy = LineagePolicy(aging=8.0, reuse_aging=1.0)
    policy.bind(4)
    offsets = policy._queues.offsets  # noqa: SLF001
    policy.published(0, "a")
    policy.released([0], [0], 0)  # generation 1, freed 1
    policy.published(1, "b")
    policy.released([1], [1], 0)  # generation 1, freed 2
    assert policy.pop() == 0  # the older of the two level-1 blocks; evictions 1
    policy.remove(1)  # a request reuses b (a hit takes it off the queue) and publishes c: generation 2
    policy.published(2, "c")
    policy.released([2, 1], [2, 1], 0)  # tail first: c freed 3rd, b 4th; frees 4
    assert offsets[:4] == [0, 32, 64, 96]  # no generation-2 block reused yet
    # a request reuses b and c: c (generation 2) was freed 3rd, now 4 frees in: distance 1, the mean
    # 32 + (1 - 32) / 32 = 31.03125; LRU's reach 4 blocks x 4 frees / 1 eviction = 16: span int(15.03) = 15
    policy.remove(2)
    policy.remove(1)
    policy.published(3, "d")
    policy.released([3, 2, 1], [3, 2, 1], 0)  # d (generation 3) freed 5th, c 6th, b 7th
    assert offsets[:4] == [0, 15, 30, 45]
    for _ in range(10):  # b hit and freed again 10 times: frees 7 + 10 = 17, still 1 eviction
        policy.remove(1)
        policy.released([1], [1], 0)
    # d (freed 5th) reused 17 - 5 = 12 frees later: the mean 31.03125 + (12 - 31.03125) / 32 = 30.43; LRU's
    # reach 4 x 17 / 1 = 68 is past it, so a level buys nothing: every offset 0, LRU's order
    for block in (3, 2, 1):
        policy.remove(block)
    policy.published(0, "e")  # on the block a's eviction left free
    policy.released([0, 3, 2, 1], [0, 3, 2, 1], 0)
    assert offsets[:4] == [0, 0, 0, 0]
    assert policy.order() == [0, 3, 2, 1]  # freed in that order, generations 4, 3, 2, 1 now at one offset
