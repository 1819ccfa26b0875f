"""Eviction policies, pins and frequency admission in the BlockPool, case by case: which block goes first.

Every expected order below is worked out by hand from the policy's rule (its docstring and source paper),
as vLLM's tests pin LRU order. The state machine (test_block_pool_stateful.py) runs each policy against a
brute-force model on random sequences.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvpool import BlockPool, InvalidArgumentError, InvalidIdError, OutOfBlocksError, PinLimitError
from kvpool.allocators.block_lists import LevelQueues
from kvpool.allocators.block_pool import BLOCK_STATES
from kvpool.allocators.policies import (
    POLICIES,
    ARCPolicy,
    FrequencyAdmission,
    KeyedHeap,
    LRUPolicy,
    PriorityPolicy,
    SLRUPolicy,
    make_policy,
)
from kvpool.allocators.policy_base import STAMP_BITS


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scenario(policy: object, clock: Clock | None = None) -> BlockPool:
    """Six blocks. Publish A..E on blocks 0..4 (in that order) and free them tail first (E, D, C, B, A);
    then A is hit twice (touched, freed with priority 2 each time), B once (priority 1), and finally E
    is touched and freed again (priority 0). Free order afterwards: D, C, A, B, E; hits A 2, B 1, E 1."""
    pool = BlockPool(6, policy=policy)
    blocks = pool.allocate(5)
    pool.cache_blocks(blocks, ["A", "B", "C", "D", "E"])
    pool.free(blocks[::-1])
    for block, priority in ((0, 2), (0, 2), (1, 1), (4, 0)):
        assert pool.lookup([["A", "B", "C", "D", "E"][block]]) == [block]
        pool.touch([block])
        pool.free([block], priority)
    return pool


#: Eviction order of the scenario, by hand, for each policy.
EXPECTED = {
    # free order
    "lru": [3, 2, 0, 1, 4],
    # publish order A B C D E, whatever the hits
    "fifo": [0, 1, 2, 3, 4],
    # hits: C 0, D 0 (D freed before C), then B 1 and E 1 (B freed before E), then A 2
    "lfu": [3, 2, 1, 4, 0],
    # probation (never hit): D, C; protected (hit) by entry: A, B, E (cap int(0.8 x 6) = 4, no demotion)
    "slru": [3, 2, 0, 1, 4],
    # priority 0 by free time: D, C, E; then B (1), then A (2)
    "priority": [3, 2, 4, 1, 0],
    # T1 (never hit) = C, D; T2 = A, B, E; p = 0 < |T1| = 2: T1 first in free order, then T2
    "arc": [3, 2, 0, 1, 4],
    # vLLM's rules: the same lists; |T1| = 2 >= int(p) = 0: T1 first, then T2 (A, B, E)
    "arc-vllm": [3, 2, 0, 1, 4],
    # 6 blocks: small queue int(0.6) = 0 blocks, so A..E enter the main queue in publish order, counts A 2,
    # B 1, E 1; the clock: A -> 1 and B -> 0 go round, C goes; D; E -> 0, A -> 0 round, B; then E, A
    "s3fifo": [2, 3, 1, 4, 0],
    # queue A..E (oldest first), visited A, B, E: the hand clears A, B, evicts C; D; clears E, wraps past
    # the newest to A (cleared), evicts it; then B, E
    "sieve": [2, 3, 0, 1, 4],
    # threshold 64, next prompt 16 blocks: budget 5 + 16 - 64 < 0, every block TEL-safe: LRU
    "tlru": [3, 2, 0, 1, 4],
    # the first free is a request of generation 1 (keys 1 x span + 1..5: E, D, C, B, A); each later free
    # of A, B, E reuses generation-1 blocks: generation 2, keyed after every generation-1 block
    "lineage": [3, 2, 0, 1, 4],
    # nothing waits: as lru and lineage
    "queue-lru": [3, 2, 0, 1, 4],
    "queue-lineage": [3, 2, 0, 1, 4],
}


@pytest.mark.parametrize("name", POLICIES)
def test_eviction_order_by_hand(name: str) -> None:
    pool = scenario(name)
    assert pool.policy.name == name
    assert pool.evictable_blocks() == EXPECTED[name]
    pool.check_integrity()
    # allocate hands out the uncached block 5 first, then evicts in that order
    got = [pool.allocate(1)[0] for _ in range(6)]
    assert got == [5, *EXPECTED[name]]
    assert pool.num_cached_blocks == 0 and pool.stats.evictions == 5
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)


@pytest.mark.parametrize("name", POLICIES)
def test_batched_eviction_takes_the_same_victims(name: str) -> None:
    pool = scenario(name)
    assert pool.allocate(4) == [5, *EXPECTED[name][:3]]
    assert pool.evictable_blocks() == EXPECTED[name][3:]
    assert [pool.block_hash(b) is None for b in EXPECTED[name]] == [True, True, True, False, False]


@pytest.mark.parametrize("seed", [0, 1])
def test_lru_chunk_queue_keeps_an_ordered_dicts_order_through_sweeps(seed: int) -> None:
    # The model: an OrderedDict of the evictable blocks (insert at the tail, revive in place, evict the
    # head). The chunk queue gets the same calls, many revivals between evictions, so stale entries pile
    # up past the sweep threshold (4,096) several times.
    rng, n = random.Random(seed), 3000
    policy, model = LRUPolicy(), OrderedDict[int, None]()
    policy.bind(n)
    held = set(range(n))  # blocks not evictable
    for _ in range(1500):
        chunk = rng.sample(sorted(held), min(len(held), rng.randrange(1, 60)))
        held -= set(chunk)
        policy.insert_chunk(list(chunk))
        model.update(dict.fromkeys(chunk))
        for b in rng.sample(list(model), min(len(model), rng.randrange(0, 40))):  # revived by a hit
            policy.remove(b)
            del model[b]
            held.add(b)
        for _ in range(rng.randrange(0, 4) if model else 0):
            b = policy.pop()
            assert b == model.popitem(last=False)[0]
            held.add(b)
        assert len(policy) == len(model)
    assert policy.order() == list(model)
    policy.clear()
    assert policy.order() == [] and len(policy) == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_keyed_heap_pops_as_a_sorted_model_through_sweeps_and_renumbering(seed: int) -> None:
    # The model: a dict block -> (key, push number); the next pop is its minimum (equal keys: the earlier
    # push). Keys repeat and go negative; discards pile stale entries past the sweep threshold; the stamp
    # counter is set near its limit so the stamps are renumbered mid-run.
    rng, n = random.Random(seed), 400
    heap, model, pushes = KeyedHeap(n), dict[int, tuple[int, int]](), 0
    heap._stamp = (1 << STAMP_BITS) - 700  # renumbered after 700 pushes
    for _ in range(4000):
        b = rng.randrange(n)
        roll = rng.random()
        if roll < 0.5:
            key = rng.randrange(-5, 20)
            pushes += 1
            heap.push(b, key)
            model[b] = (key, pushes)
        elif roll < 0.8:
            assert heap.discard(b) == (b in model)
            model.pop(b, None)
        elif model:
            expected = min(model, key=lambda x: model[x])
            assert heap.pop() == expected
            del model[expected]
        assert len(heap) == len(model)
        assert heap.key(b) == (model[b][0] if b in model else None)
    assert heap._stamp < 4000  # renumbered (else near 2 ** STAMP_BITS)
    assert heap.order() == sorted(model, key=lambda x: model[x])


def test_lru_queue_drops_spent_entries_and_keeps_popping_in_order() -> None:
    # 10,000 blocks freed in one call, every third revived, then all popped: the spent head of the log is
    # dropped past 4,096 entries and the order stays the free order (by hand: the blocks not divisible by
    # 3, ascending), then a second call's blocks follow
    policy = LRUPolicy()
    policy.bind(12_000)
    policy.insert_chunk(list(range(10_000)))
    for b in range(0, 10_000, 3):
        policy.remove(b)
    policy.insert_chunk([10_001, 10_000])
    expected = [b for b in range(10_000) if b % 3] + [10_001, 10_000]
    assert [policy.pop() for _ in range(len(expected))] == expected and len(policy) == 0


def test_priority_decays_to_zero_after_retention_s() -> None:
    clock = Clock()
    pool = scenario(PriorityPolicy(retention_s=10.0, clock=clock))
    clock.now = 9.99
    assert pool.evictable_blocks() == EXPECTED["priority"]
    clock.now = 10.0  # exactly retention_s after A's and B's frees: both count as priority 0 now
    assert pool.evictable_blocks() == EXPECTED["lru"]
    assert pool.allocate(2) == [5, 3]


def test_priority_negative_goes_first_and_a_fresh_free_restarts_the_clock() -> None:
    clock = Clock()
    pool = BlockPool(3, policy=PriorityPolicy(retention_s=5.0, clock=clock))
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, ["x", "y", "z"])
    pool.free([0], 3)
    clock.now = 4.0
    pool.free([1], -1)
    pool.free([2], 0)
    assert pool.evictable_blocks() == [1, 2, 0]  # -1, 0, 3
    clock.now = 6.0  # block 0's priority 3 expired (freed at 0); block 1's -1 still holds (freed at 4)
    assert pool.evictable_blocks() == [1, 0, 2]
    pool.touch([0])
    pool.free([0], 3)  # freed again at 6: priority 3 until 11
    clock.now = 10.5  # block 1's -1 decayed at 9: it and block 2 are both 0 now, block 1 freed first
    assert pool.evictable_blocks() == [1, 2, 0]


def test_slru_demotes_the_oldest_protected_block_past_the_cap() -> None:
    # 5 blocks, protected_fraction 0.4: at most 2 evictable protected blocks.
    pool = BlockPool(5, policy=SLRUPolicy(protected_fraction=0.4))
    blocks = pool.allocate(4)
    pool.cache_blocks(blocks, ["a", "b", "c", "d"])
    pool.free(blocks[::-1])  # probation: d c b a
    for block in (0, 1, 2):  # a, b, c hit and freed: protected a, b; then c pushes a back to probation
        pool.touch([block])
        pool.free([block])
    policy = pool.policy
    assert isinstance(policy, SLRUPolicy)
    assert list(policy.probation) == [3, 0] and list(policy.protected) == [1, 2]
    assert pool.evictable_blocks() == [3, 0, 1, 2]
    pool.touch([0])  # a is promoted again by a hit
    pool.free([0])  # ... and its return demotes b
    assert list(policy.probation) == [3, 1] and list(policy.protected) == [2, 0]


def test_arc_ghost_hits_move_the_target_and_enter_t2() -> None:
    pool = BlockPool(4, policy="arc")
    arc = pool.policy
    assert isinstance(arc, ARCPolicy)
    blocks = pool.allocate(4)
    pool.cache_blocks(blocks, ["a", "b", "c", "d"])  # all four in T1
    pool.touch([2, 3])  # c, d hit: T2
    pool.free(blocks[::-1])  # b, a become evictable (T1); c, d still held once
    pool.free([2, 3])  # c, d evictable (T2)
    assert (arc.size_t1, arc.size_t2, arc.p) == (2, 2, 0.0)
    assert pool.evictable_blocks() == [1, 0, 2, 3]  # T1 (b, a in free order) while |T1| > p = 0, then T2
    assert pool.allocate(1) == [1]  # b evicted from T1: ghost in B1
    assert list(arc.b1) == ["b"]
    pool.cache_blocks([1], ["b"])  # b comes back: a B1 hit, p += max(|B2| / |B1|, 1) = 1; b enters T2
    assert arc.p == 1.0 and not arc.b1 and (arc.size_t1, arc.size_t2) == (1, 3)
    pool.free([1])
    assert pool.evictable_blocks() == [2, 3, 1, 0]  # |T1| = 1 is not > p = 1: T2 first (c, d, b), then a
    assert pool.allocate(2) == [2, 3]  # c, d evicted from T2: ghosts in B2
    assert list(arc.b2) == ["c", "d"]
    pool.cache_blocks([3], ["d"])  # a B2 hit: p -= max(|B1| / |B2|, 1) = 1, to 0
    assert arc.p == 0.0 and list(arc.b2) == ["c"]


def paper_arc(c: int, refs: list[str]) -> list[str]:
    """Megiddo and Modha's ARC(c) (FAST 2003, Fig. 4) on a reference string, brute force: the hashes it
    evicts from the cache, in order. Lists are LRU first. One guard the figure leaves implicit: REPLACE
    takes T1 when T2 is empty."""
    t1: list[str] = []
    t2: list[str] = []
    b1: list[str] = []
    b2: list[str] = []
    p, out = 0.0, []

    def replace(x: str) -> None:
        if t1 and ((x in b2 and len(t1) == p) or len(t1) > p or not t2):
            out.append(t1.pop(0))
            b1.append(out[-1])
        else:
            out.append(t2.pop(0))
            b2.append(out[-1])

    for x in refs:
        if x in t1 or x in t2:  # case I: a hit
            (t1 if x in t1 else t2).remove(x)
            t2.append(x)
        elif x in b1:  # case II
            p = min(c, p + max(len(b2) / len(b1), 1))
            replace(x)
            b1.remove(x)
            t2.append(x)
        elif x in b2:  # case III
            p = max(0.0, p - max(len(b1) / len(b2), 1))
            replace(x)
            b2.remove(x)
            t2.append(x)
        else:  # case IV
            l1 = len(t1) + len(b1)
            if l1 == c:
                if len(t1) < c:
                    b1.pop(0)
                    replace(x)
                else:
                    out.append(t1.pop(0))
            elif l1 + len(t2) + len(b2) >= c:
                if l1 + len(t2) + len(b2) == 2 * c:
                    b2.pop(0)
                replace(x)
            t1.append(x)
    return out


def pool_arc(c: int, refs: list[str], policy: str) -> list[str]:
    """The same reference string on a BlockPool of ``c`` blocks: a hit is touch + free, a miss is
    ``missed`` (before the allocation, as an engine that looked the prefix up), allocate, publish, free."""
    pool, out = BlockPool(c, policy=policy), []
    pool.set_eviction_listener(lambda ids, hashes: out.extend(hashes))
    for x in refs:
        block = pool.get_cached_block(x)
        if block is None:
            pool.missed([x])
            block = pool.allocate(1)[0]
            pool.cache_blocks([block], [x])
        else:
            pool.touch([block])
        pool.free([block])
    pool.check_integrity()
    return out


@pytest.mark.parametrize("seed", range(6))
def test_arc_evicts_as_the_papers_arc(seed: int) -> None:
    import random

    rng = random.Random(seed)
    c = rng.choice([3, 5, 8])
    # a skewed working set larger than the cache, with scans: every ARC case occurs
    refs = [f"h{min(int(rng.paretovariate(1.0)), 4 * c)}" if rng.random() < 0.7
            else f"s{rng.randrange(3 * c)}" for _ in range(3000)]
    expected = paper_arc(c, refs)
    assert len(expected) > 500
    assert pool_arc(c, refs, "arc") == expected


def test_arc_vllm_departs_from_the_paper_on_the_same_string() -> None:
    import random

    rng = random.Random(7)
    refs = [f"k{rng.randrange(12)}" for _ in range(500)]
    assert pool_arc(5, refs, "arc-vllm") != paper_arc(5, refs)


def test_arc_vllm_rules_by_hand() -> None:
    # vLLM 0.33's arc: a ghost that misses moves p and returns to T1; T1 gives victims while |T1| >= int(p)
    pool = BlockPool(3, policy="arc-vllm")
    arc = pool.policy
    assert isinstance(arc, ARCPolicy) and arc.variant == "vllm" and arc.name == "arc-vllm"
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, ["a", "b", "c"])  # T1: a b c
    pool.touch([2])  # c hit: T2
    pool.free(blocks)
    pool.free([2])  # evictable: T1 a, b; T2 c
    assert pool.allocate(1) == [0]  # |T1| = 2 >= int(0): a, to B1
    assert list(arc.b1) == ["a"]
    pool.missed(["a"])  # a B1 ghost misses: p += max(|B2| / |B1|, 1) = 1
    assert arc.p == 1.0
    pool.cache_blocks([0], ["a"])  # ... and re-enters T1 (the paper: T2), leaving B1
    assert (arc.size_t1, arc.size_t2) == (2, 1) and not arc.b1
    pool.free([0])
    # |T1| = 2 >= int(1): T1 first (b, a), then c; the paper's |T1| > p holds too, so they agree here
    assert pool.evictable_blocks() == [1, 0, 2]
    pool.missed(["zz"])  # no ghost: nothing moves
    arc.p = 2.0  # (as after a second B1 hit) |T1| = 2 >= int(2): b from T1 (the paper: c from T2 first);
    assert pool.evictable_blocks() == [1, 2, 0]  # then |T1| = 1 < 2: c from T2, then a
    assert ARCPolicy().order() == [] and make_policy("arc-vllm").name == "arc-vllm"


def test_arc_variant_is_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="variant"):
        ARCPolicy("vLLM")


# ---- pins -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", POLICIES)
def test_a_pinned_block_is_never_evicted(name: str) -> None:
    pool = scenario(name)
    victim = EXPECTED[name][0]
    pool.pin([victim])
    assert pool.num_pinned_blocks == 1 and pool.ref_count(victim) == 1
    assert pool.evictable_blocks() == EXPECTED[name][1:]
    assert pool.allocate(5) == [5, *EXPECTED[name][1:]]
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    assert pool.block_states()[victim] == BLOCK_STATES.index("pinned")
    pool.unpin([victim])
    assert pool.evictable_blocks() == [victim] and pool.allocate(1) == [victim]
    pool.check_integrity()


def test_pin_prefix_pins_shared_blocks_until_unpinned_and_a_pin_can_be_shared() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, ["sys0", "sys1", "user"])
    assert pool.pin_prefix(["sys0", "sys1"]) == [0, 1]
    pool.free(blocks[::-1])
    assert pool.evictable_blocks() == [2] and pool.num_used_blocks == 2
    assert pool.lookup(["sys0", "sys1"]) == [0, 1]
    pool.touch([0, 1])  # a request shares the pinned prefix
    pool.free([1, 0])
    pool.pin([0])  # a second pin on block 0
    assert pool.pinned_blocks() == {0: 2, 1: 1}
    pool.unpin([0, 1])
    assert pool.pinned_blocks() == {0: 1} and pool.evictable_blocks() == [2, 1]
    pool.unpin([0])
    assert pool.evictable_blocks() == [2, 1, 0] and pool.num_used_blocks == 0
    pool.check_integrity()


def test_pin_cap_refuses_past_the_fraction_and_changes_nothing() -> None:
    pool = BlockPool(10, pin_cap=0.25)  # at most 2 pinned blocks
    assert pool.max_pinned_blocks == 2
    blocks = pool.allocate(4)
    pool.cache_blocks(blocks, ["a", "b", "c", "d"])
    pool.pin([0, 1])
    pool.pin([0])  # pinning a pinned block again needs no more room
    with pytest.raises(PinLimitError, match="cap of 2"):
        pool.pin([2])
    with pytest.raises(PinLimitError):
        pool.pin_prefix(["c", "d"])
    assert pool.pinned_blocks() == {0: 2, 1: 1} and [pool.ref_count(b) for b in blocks] == [3, 2, 1, 1]
    pool.check_integrity()


def test_bad_pins_raise_typed_errors_and_change_nothing() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks[:2], ["a", "b"])  # block 2 in use, unhashed; 3..5 uncached free
    before = (pool.pinned_blocks(), [pool.ref_count(b) for b in range(6)])
    for call, error in [
        (lambda: pool.pin([0, 2]), InvalidIdError),  # 2 holds no hash
        (lambda: pool.pin([4]), InvalidIdError),  # free, not cached
        (lambda: pool.pin([0, 0]), InvalidIdError),
        (lambda: pool.pin([9]), InvalidIdError),
        (lambda: pool.pin_prefix(["a", "zzz"]), InvalidIdError),  # not all cached
        (lambda: pool.unpin([0]), InvalidIdError),  # not pinned
        (lambda: pool.unpin([True]), InvalidIdError),
    ]:
        with pytest.raises(error):
            call()
        assert (pool.pinned_blocks(), [pool.ref_count(b) for b in range(6)]) == before
    pool.check_integrity()


def test_evict_blocks_drops_pins_and_reset_waits_for_unpin() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, ["a", "b"])
    pool.pin(blocks)
    pool.free(blocks)
    assert pool.reset_prefix_cache() is False  # pinned blocks are in use
    pool.evict_blocks([0])  # its KV is invalid: the hash and the pin go, the block is free again
    assert pool.pinned_blocks() == {1: 1} and pool.ref_count(0) == 0 and pool.block_hash(0) is None
    pool.unpin([1])
    assert pool.reset_prefix_cache() is True
    pool.check_integrity()


def test_block_states_of_every_kind() -> None:
    pool = BlockPool(6, reserve_null_block=True)
    blocks = pool.allocate(4)  # 1..4
    pool.cache_blocks(blocks[:3], ["a", "b", "c"])
    pool.pin([1])
    pool.free([1, 2, 4])
    names = [BLOCK_STATES[s] for s in pool.block_states()]
    assert names == ["null", "pinned", "cached", "in use", "free", "free"]


# ---- frequency admission --------------------------------------------------------------------------------


def test_frequency_admission_publishes_a_hash_on_its_second_offer() -> None:
    pool = BlockPool(6, admission=FrequencyAdmission(min_count=2))
    first = pool.allocate(2)
    pool.cache_blocks(first, ["a", "b"])  # first offers: not published, the blocks stay private
    assert pool.num_cached_blocks == 0
    pool.free(first[::-1])
    assert pool.evictable_blocks() == []  # back on the free stack, reused first
    second = pool.allocate(2)
    pool.cache_blocks(second, ["a", "c"])  # "a" offered twice: published; "c" once
    assert pool.lookup(["a"]) == [second[0]] and pool.lookup(["c"]) == []
    pool.free(second[::-1])
    assert pool.evictable_blocks() == [second[0]]


def test_frequency_admission_bounds_its_counts_by_halving() -> None:
    admission = FrequencyAdmission(min_count=3, max_tracked=2)
    assert [admission.admit(h) for h in ["a", "a", "b"]] == [False, False, False]  # a: 2, b: 1
    assert admission.counts == {"a": 2, "b": 1}
    assert admission.admit("c") is False  # full: halve (a: 1, b dropped), then c: 1
    assert admission.counts == {"a": 1, "c": 1}
    assert [admission.admit("a"), admission.admit("a")] == [False, True]
    assert "a" not in admission.counts


# ---- bad configuration ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"policy": "mru"}, "unknown eviction policy 'mru'"),
    ({"policy": "belady"}, "only the replay"),
    ({"policy": 3}, "policy must be"),
    ({"pin_cap": 0}, "pin_cap"),
    ({"pin_cap": 1.5}, "pin_cap"),
    ({"pin_cap": float("nan")}, "pin_cap"),
    ({"admission": 2}, "admission"),
])
def test_bad_pool_options_raise_invalid_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        BlockPool(4, **kwargs)


def test_a_policy_serves_one_pool() -> None:
    policy = make_policy("lfu")
    BlockPool(4, policy=policy)
    with pytest.raises(InvalidArgumentError, match="already serves a pool"):
        BlockPool(4, policy=policy)


@pytest.mark.parametrize("make", [
    lambda: PriorityPolicy(retention_s=0), lambda: PriorityPolicy(retention_s=float("nan")),
    lambda: SLRUPolicy(protected_fraction=0), lambda: SLRUPolicy(protected_fraction=True),
    lambda: FrequencyAdmission(min_count=0), lambda: FrequencyAdmission(max_tracked=1.5),
])
def test_bad_policy_options_raise_invalid_argument(make) -> None:
    with pytest.raises(InvalidArgumentError):
        make()


def test_free_with_a_bad_priority_changes_nothing() -> None:
    for name in ("lru", "priority"):
        pool = BlockPool(2, policy=name)
        blocks = pool.allocate(2)
        with pytest.raises(InvalidArgumentError, match="priority"):
            pool.free(blocks, "high")  # type: ignore[arg-type]
        assert [pool.ref_count(b) for b in blocks] == [1, 1]


@pytest.mark.parametrize("priority", [None, 0.0, False, "", []])
@pytest.mark.parametrize("name", POLICIES)
def test_a_falsy_priority_that_is_no_integer_changes_nothing(name: str, priority: object) -> None:
    # free(ids, None) under "priority" reached the policy's key arithmetic after the first ref count had
    # dropped: a TypeError that left a block neither in use nor free
    pool = BlockPool(3, policy=name)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [10, 11])
    with pytest.raises(InvalidArgumentError, match="priority"):
        pool.free(blocks, priority)  # type: ignore[arg-type]
    assert [pool.ref_count(b) for b in blocks] == [1, 1] and pool.evictable_blocks() == []
    pool.check_integrity()
    pool.free(blocks, 0)
    assert sorted(pool.evictable_blocks()) == blocks and pool.num_free_blocks == 3


@pytest.mark.parametrize("name", ["lfu", "arc"])
def test_events_and_the_eviction_listener_follow_the_policy(name: str) -> None:
    from kvpool.events import BlockRemoved, BlockStored, KVEventSink, QueueEventPublisher

    publisher, told = QueueEventPublisher(), []
    pool = BlockPool(6, event_sink=KVEventSink(publisher, block_size=16), policy=name,
                     admission=FrequencyAdmission(min_count=1))
    pool.set_eviction_listener(lambda ids, hashes: told.append((ids, hashes)))
    blocks = pool.allocate(5)
    pool.cache_blocks(blocks, [1, 2, 3, 4, 5])
    pool.free(blocks[::-1])
    pool.touch([0])  # hash 1 hit: kept longest by both policies (LFU: one hit; ARC: T2)
    pool.free([0])
    assert pool.allocate(5) == [5, 4, 3, 2, 1]  # the uncached block, then the never-hit ones in free order
    assert told == [([4, 3, 2, 1], [5, 4, 3, 2])]
    pool.event_sink.flush()
    events = [e for batch in publisher.drain() for e in batch.events]
    assert [type(e) for e in events] == [BlockStored, BlockRemoved]
    assert events[0].block_hashes == [1, 2, 3, 4, 5] and events[1].block_hashes == [5, 4, 3, 2]


@pytest.mark.parametrize(("seed", "strict"), [(0, True), (1, True), (2, False), (3, False), (4, False)])
def test_level_queues_pop_in_the_order_of_a_keyed_heap(seed: int, strict: bool) -> None:
    # brute-force model: LevelQueues pops what a min-heap of (offset of the level + stamp, stamp) pops
    # (strict: (level, stamp), the key level x SEQ_SPAN + stamp of lfu); stamps grow by 1-2 a push, offsets
    # are small and change mid-run (each level's FIFO stays in order), so keys tie across levels (the
    # earlier stamp first), and levels empty and fill again
    rng, n = random.Random(seed), 300
    queues, model, stamp = LevelQueues(strict), dict[int, tuple[int, int]](), 0
    queues.grow(n)

    def key(b: int) -> tuple[int, int]:
        level, s = model[b]
        offsets = queues.offsets
        return (level, s) if strict else ((offsets[level] if level < len(offsets) else 0) + s, s)

    for step in range(5000):
        if not strict and step % 500 == 0:
            queues.offsets = [rng.randrange(0, 40) for _ in range(10)]  # levels past 10: offset 0
        b = rng.randrange(n)
        roll = rng.random()
        if roll < 0.5:
            level = rng.randrange(6) if rng.random() < 0.9 else rng.randrange(6, 60)
            stamp += 1 + rng.randrange(2)
            queues.push(b, level, stamp)
            model[b] = (level, stamp)
        elif roll < 0.75:
            assert queues.discard(b) == (b in model)
            model.pop(b, None)
        elif model:
            expected = min(model, key=key)
            assert queues.pop() == expected
            del model[expected]
        assert len(queues) == len(model) and (b in queues) == (b in model)
    assert [key(x) for x in queues.order()] == sorted(key(x) for x in model)
    with pytest.raises(IndexError):
        while True:
            queues.pop()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_priority_pops_as_a_sorted_model_with_many_priorities(seed: int) -> None:
    # brute-force model: the key (priority at the last free while younger than retention_s, else 0; free
    # sequence); 40 distinct priorities, more than the levels the policy keeps before reusing empty ones
    rng, n, clock = random.Random(seed), 200, Clock()
    policy = PriorityPolicy(retention_s=50.0, clock=clock)
    policy.bind(n)
    model: dict[int, tuple[int, float, int]] = {}  # evictable block -> (priority, freed at, sequence)
    seq = 0

    def key(b: int) -> tuple[int, int]:
        priority, freed_at, s = model[b]
        return (priority if clock.now - freed_at < 50.0 else 0, s)

    for _ in range(6000):
        clock.now += rng.randrange(3)
        b, roll = rng.randrange(n), rng.random()
        if roll < 0.45 and b not in model:
            priority = rng.randrange(-20, 20) if rng.random() < 0.5 else 0
            seq += 1
            policy.insert(b, priority)
            model[b] = (priority, clock.now, seq)
        elif roll < 0.65 and b in model:
            policy.remove(b)
            del model[b]
        elif roll >= 0.65 and model:
            expected = min(model, key=key)
            assert policy.pop() == expected
            del model[expected]
        assert len(policy) == len(model)
    assert policy.order() == sorted(model, key=key)
