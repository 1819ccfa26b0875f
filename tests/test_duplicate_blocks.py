"""Several blocks of one hash (issue 20 item 13): a block computed again while another block holds its hash
is published too, and stays findable once the first is gone (vLLM's ``BlockHashToBlockMap``).

The directed case is three identical prompts on the request path; the pool cases pin what lookups find,
what eviction and ``evict_blocks`` leave, and what the events and listeners hear. Every number is worked
out in the comments.
"""

from __future__ import annotations

from collections import Counter

import pytest

from kvpool.allocators.block_pool import BlockPool
from kvpool.allocators.groups import KVCacheCoordinator, group_key
from kvpool.allocators.hashing import BlockHasher, block_hashes
from kvpool.allocators.policies import FrequencyAdmission
from kvpool.requests import Request
from kvpool.requests.kv_manager import KVCacheManager
from kvpool.requests.scheduler import Scheduler
from kvpool.spec import KVCacheSpec, LayerKind, kv_cache_groups


def _step(sched: Scheduler) -> list[Request]:
    out = sched.schedule()
    return sched.update(out, [7] * out.num_sampled)


def test_the_third_identical_prompt_hits_the_second_ones_blocks() -> None:
    """B = 16, 10 blocks, one full group. P is 64 tokens (4 full blocks h0..h3; a hit is at most
    (64 - 1) // 16 = 3 blocks, 48 tokens). The free stack hands out 0, 1, 2, ... in order.

    step 1: A (P, 1 new token) and B (P, 2) are admitted together, neither hits (nothing published):
        A = [0, 1, 2, 3], B = [4, 5, 6, 7]. After the step A publishes h0..h3 on 0..3 and finishes (freed
        tail first: LRU 3, 2, 1, 0); B publishes the same hashes on 4..7, further holders of each.
    step 2: B decodes token 65: a 5th block, 8 (the stack holds 9, 8). D (48 other tokens, 3 blocks)
        takes 9, then evicts the LRU head 3 and 2: h3 and h2 are now found on 7 and 6. B finishes (8 has
        no hash: stack; 7, 6, 5, 4 join the LRU), D publishes and finishes.
    step 3: C (P) hits h0 -> 0, h1 -> 1, h2 -> 6: 48 tokens, and allocates 8 for its last block.
    Had B's blocks stayed private (one block per hash), h2 would be gone with block 2: 32 tokens.
    """
    groups = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16).groups
    kv = KVCacheManager(groups, 10, hasher=BlockHasher("sha256", shared=True))
    sched = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=4)
    prompt, other = list(range(100, 164)), list(range(500, 548))
    a, b = Request("A", prompt, 1), Request("B", prompt, 2)
    sched.add_request(a)
    sched.add_request(b)
    assert _step(sched) == [a]
    assert kv.block_tables(b) == ([4, 5, 6, 7],) and kv.pool.evictable_blocks() == [3, 2, 1, 0]
    assert kv.pool.num_cached_blocks == 8
    d = Request("D", other, 1)
    sched.add_request(d)
    assert _step(sched) == [b, d]
    assert kv.pool.evictable_blocks() == [1, 0, 7, 6, 5, 4, 2, 3, 9]
    h = b.block_hashes
    assert [kv.pool.get_cached_block(x) for x in h] == [0, 1, 6, 7]
    c = Request("C", prompt, 1)
    sched.add_request(c)
    sched.schedule()
    assert c.num_cached_tokens == 48 and kv.block_tables(c) == ([0, 1, 6, 8],)
    kv.check_integrity()


def test_a_second_block_of_a_hash_is_published_and_found_after_the_first() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)  # [0, 1]
    pool.cache_blocks(blocks[:1], ["h"])
    pool.cache_blocks(blocks[1:], ["h"])  # a duplicate computation of the same block: published too
    assert pool.lookup(["h"]) == [0]  # the first published is the one found
    assert pool.block_hash(1) == "h" and pool.num_cached_blocks == 2
    pool.free([1, 0])  # both hashed: LRU 1, 0
    assert pool.evictable_blocks() == [1, 0]
    assert pool.allocate(3) == [2, 3, 1]  # the stack (2, 3) first, then the LRU head 1
    assert pool.lookup(["h"]) == [0] and pool.num_cached_blocks == 1
    pool.check_integrity()


def test_the_next_holder_is_found_when_the_first_is_evicted() -> None:
    pool = BlockPool(4)
    first, second, third = pool.allocate(1), pool.allocate(1), pool.allocate(1)  # [0], [1], [2]
    for ids in (first, second, third):
        pool.cache_blocks(ids, ["h"])
    pool.free(first)  # LRU: 0
    assert pool.allocate(2) == [3, 0]  # the stack's last block, then 0 is evicted: 1 is found now
    assert pool.get_cached_block("h") == 1 and pool.num_cached_blocks == 2
    pool.evict_blocks([1])  # 1 loses its entry (stays in use, private): 2 is found
    assert pool.get_cached_block("h") == 2 and pool.block_hash(1) is None
    pool.evict_blocks([2])
    assert pool.get_cached_block("h") is None and pool.num_cached_blocks == 0
    pool.check_integrity()


def test_a_further_holder_evicted_first_leaves_the_found_one() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(1), pool.allocate(1)  # [0], [1]
    pool.cache_blocks(a, ["h"])
    pool.cache_blocks(b, ["h"])
    pool.free(b)  # LRU: 1
    pool.evict_blocks(b)  # 1 becomes uncached free; 0 still holds h and is found
    assert pool.get_cached_block("h") == 0 and pool.evictable_blocks() == []
    assert pool.allocate(1) == [1]  # the free stack (2 below 1) hands out 1 first
    pool.check_integrity()


def test_the_eviction_listener_hears_only_hashes_that_leave_the_index() -> None:
    pool = BlockPool(3)
    heard: list = []
    pool.set_eviction_listener(lambda ids, hashes: heard.append((list(ids), list(hashes))))
    a, b = pool.allocate(2), pool.allocate(1)  # [0, 1], [2]
    pool.cache_blocks(a, ["x", "h"])
    pool.cache_blocks(b, ["h"])
    pool.free(a[::-1])  # LRU: 1, 0
    pool.allocate(1)  # evicts 1: h is still on 2, nothing left the index
    assert heard == [] and pool.get_cached_block("h") == 2
    pool.allocate(1)  # evicts 0: x leaves
    assert heard == [([0], ["x"])]
    pool.check_integrity()


def test_the_publish_listener_hears_only_hashes_new_to_the_index() -> None:
    pool = BlockPool(4)
    heard: list = []
    pool.set_publish_listener(lambda ids, hashes: heard.append((list(ids), list(hashes))))
    pool.cache_blocks(pool.allocate(2), ["x", "h"])  # [0, 1]
    pool.cache_blocks(pool.allocate(2), ["h", "y"])  # [2, 3]: 2 joins h's holders, y is new
    assert heard == [([0, 1], ["x", "h"]), ([3], ["y"])]
    assert pool.num_cached_blocks == 4


def test_admission_offers_a_hash_once_not_per_holder() -> None:
    pool = BlockPool(6, admission=FrequencyAdmission(2))
    pool.cache_blocks(pool.allocate(1), ["h"])  # first offer: block 0 stays private
    pool.cache_blocks(pool.allocate(1), ["h"])  # second offer: admitted on block 1
    pool.cache_blocks(pool.allocate(1), ["h"])  # h is admitted: block 2 joins, not an offer
    assert [pool.block_hash(b) for b in range(3)] == [None, "h", "h"]
    assert pool.admission.counts == {} and pool.get_cached_block("h") == 1
    pool.check_integrity()


def test_a_policy_orders_every_holder() -> None:
    pool = BlockPool(3, policy="fifo")  # evict by publish time
    a, b = pool.allocate(1), pool.allocate(1)  # [0], [1]
    pool.cache_blocks(b, ["h"])  # published first
    pool.cache_blocks(a, ["h"])
    pool.free(b + a)
    assert pool.evictable_blocks() == [1, 0] and pool.get_cached_block("h") == 1
    assert pool.allocate(2) == [2, 1]  # the free block, then 1 (published first): 0 is found now
    assert pool.get_cached_block("h") == 0
    pool.check_integrity()


def test_reset_forgets_every_holder() -> None:
    pool = BlockPool(3)
    for _ in range(2):
        pool.cache_blocks(pool.allocate(1), ["h"])
    pool.free([1, 0])
    assert pool.reset_prefix_cache() and pool.num_cached_blocks == 0 and pool.get_cached_block("h") is None
    pool.check_integrity()


@pytest.mark.parametrize("events", [False, True])
def test_a_hybrid_coordinator_keys_every_holder_by_group(events: bool) -> None:
    """B = 4, a sliding group (W 8, group 0) and a full group (group 1) over 19 blocks (0 is null).

    Requests x and y prefill the same 12 tokens (3 blocks) before either publishes: x = [1, 2, 3] / [4, 5, 6]
    (group 0 / 1), y = [7, 8, 9] / [10, 11, 12]; y's blocks hold the same (group, hash) keys as x's. x is
    freed (tail first, both groups at each position: LRU 3, 6, 2, 5, 1, 4), then z takes 24 tokens, 6 blocks
    per group: the stack's 13..18, then it evicts 3, 6, 2, 5, 1, 4, all of x's. y's blocks are found for every
    key: a hit of (12 - 1) // 4 = 2 blocks, whose sliding part needs only blocks from skipped_blocks(8) = (8 -
    8 + 1) // 4 = 0: [7, 8] and [10, 11].
    """
    from kvpool.events import KVEventSink, QueueEventPublisher

    groups = kv_cache_groups([LayerKind.SLIDING, LayerKind.FULL], {LayerKind.SLIDING: 8}, 4)
    sink = KVEventSink(QueueEventPublisher(), block_size=4) if events else None
    coord = KVCacheCoordinator(groups, 19, event_sink=sink)
    tokens = list(range(12))
    hashes = block_hashes(tokens, 4)
    for rid in ("x", "y"):
        coord.allocate(rid, 12)
    for rid in ("x", "y"):
        coord.cache_blocks(rid, hashes, 12, token_ids=tokens)
    assert coord.block_tables("x") == ([1, 2, 3], [4, 5, 6])
    assert coord.block_tables("y") == ([7, 8, 9], [10, 11, 12])
    assert [coord.pool.get_cached_block(group_key(1, h)) for h in hashes] == [4, 5, 6]
    coord.free("x")
    assert coord.pool.evictable_blocks() == [3, 6, 2, 5, 1, 4]
    coord.allocate("z", 24)  # 12 blocks in all: 13..18, then x's 6 are evicted
    assert coord.pool.evictable_blocks() == []
    hit = coord.find_longest_cache_hit(hashes, 2)
    assert hit.num_blocks == 2 and hit.blocks == ([7, 8], [10, 11])
    assert coord.pool.num_cached_blocks == 6  # y's six
    coord.check_integrity()
    if sink is not None:
        held = Counter()
        for event in sink.take_events():
            sign = 1 if type(event).__name__ == "BlockStored" else -1
            for h in event.block_hashes:
                held[(event.group_idx, h)] += sign
        assert +held == Counter({(g, h): 1 for g in (0, 1) for h in hashes})
