"""KVCacheCoordinator case by case: tables per group, freeing out of the window, the per-group hit rule,
atomic allocation, the block bound while decoding past the window, and check_integrity.

Setting for most cases: block size B = 4, a sliding group with window W = 8 (group 0) and a full group
(group 1); every expected number is worked out in the comments.
"""

import numpy as np
import pytest

from kvpool.allocators.block_pool import BlockPool
from kvpool.allocators.groups import KVCacheCoordinator, group_key
from kvpool.allocators.hashing import block_hashes
from kvpool.errors import IntegrityError, InvalidArgumentError, InvalidIdError, OutOfBlocksError
from kvpool.spec import KVCacheSpec, LayerKind, kv_cache_groups

S, F, C = LayerKind.SLIDING, LayerKind.FULL, LayerKind.CHUNKED
B = 4


def coordinator(num_blocks: int = 64, kinds=(S, F), window: int = 8, caching: bool = True):
    groups = kv_cache_groups(kinds, {S: window, C: window}, B)
    return KVCacheCoordinator(groups, num_blocks, enable_caching=caching)


def prefill(coord, request, tokens, num_tokens=None):
    """Allocate and publish the first ``num_tokens`` (default all) tokens of ``tokens`` in one step."""
    n = len(tokens) if num_tokens is None else num_tokens
    coord.allocate(request, n)
    coord.cache_blocks(request, block_hashes(tokens, B), n)


def test_tables_per_group_and_the_null_block():
    coord = coordinator()
    assert coord.null_block == 0 and coord.pool.null_block == 0
    coord.allocate("a", 10)  # cdiv(10, 4) = 3 blocks in each of the 2 groups
    sliding, full = coord.block_tables("a")
    assert len(sliding) == len(full) == 3 and coord.num_used_blocks == 6
    assert 0 not in sliding + full and not set(sliding) & set(full)
    # before token 13: blocks wholly before 13 - 8 + 1 = 6 are dead in the sliding group: 6 // 4 = 1
    coord.allocate("a", 16)
    assert coord.remove_skipped_blocks("a", 13) == 1
    sliding, full = coord.block_tables("a")
    assert sliding[0] == 0 and 0 not in sliding[1:] and 0 not in full and len(full) == 4
    assert coord.num_used_blocks == 7 and coord.num_blocks_held("a") == 7
    coord.check_integrity()
    coord.free("a")
    assert coord.num_used_blocks == 0 and coord.requests == []
    coord.check_integrity()


def test_uniform_model_keys_like_a_plain_pool():
    groups = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=B).groups
    coord = KVCacheCoordinator(groups, 8)
    assert coord.null_block == -1 and coord.pool.null_block is None  # no window: no null block
    tokens = list(range(8))
    prefill(coord, "a", tokens)
    (table,) = coord.block_tables("a")
    assert [coord.pool.block_hash(b) for b in table] == block_hashes(tokens, B)
    assert group_key(0, b"h") == b"h" and group_key(2, b"h") == (2, b"h")


def test_hit_needs_full_prefix_and_the_sliding_window_tail():
    coord = coordinator()
    tokens = list(range(20))
    hashes = block_hashes(tokens, B)  # 5 full blocks
    prefill(coord, "a", tokens)
    sliding_a, full_a = coord.block_tables("a")
    coord.free("a")
    # prefix of k = 4 blocks: full needs blocks 0..3; sliding needs blocks from (16 - 8 + 1) // 4 = 2 on
    hit = coord.find_longest_cache_hit(hashes, 4)
    assert hit.num_blocks == 4
    assert hit.blocks == ([0, 0, sliding_a[2], sliding_a[3]], full_a[:4])
    coord.allocate("b", 17, hit)  # 4 hit blocks; cdiv(17, 4) = 5: one new block per group
    assert coord.block_tables("b")[0][:4] == [0, 0, sliding_a[2], sliding_a[3]]
    assert coord.num_used_blocks == 2 + 4 + 2  # 2 sliding hits, 4 full hits, 2 new
    coord.check_integrity()
    coord.free("b")
    # lose sliding block 3: k = 4 fails (needs 2, 3); k = 3 needs blocks (12 - 7) // 4 = 1 and 2: block 2
    # is there but 1 must be too; it is (freed cached); so k = 3
    coord.pool.evict_blocks([sliding_a[3]])
    assert coord.find_longest_cache_hit(hashes, 4).num_blocks == 3
    # lose sliding block 1 too: k = 3 fails; k = 2 needs blocks (8 - 7) // 4 = 0 and 1: fails; k = 1 needs
    # block 0 only (from (4 - 7) clamped to 0): a hit of 1
    coord.pool.evict_blocks([sliding_a[1]])
    assert coord.find_longest_cache_hit(hashes, 4).num_blocks == 1
    # lose a full block at 0: nothing is restorable
    coord.pool.evict_blocks([full_a[0]])
    assert coord.find_longest_cache_hit(hashes, 4).num_blocks == 0
    assert coord.stats.hits == 4 + 3 + 1 and coord.stats.misses == 0 + 1 + 3 + 4


def test_a_sliding_hit_with_its_window_cached_beats_a_missing_head():
    # only the sliding group's head is gone: the full group still needs it, so no hit
    coord = coordinator()
    tokens = list(range(20))
    prefill(coord, "a", tokens)
    sliding_a, _ = coord.block_tables("a")
    coord.free("a")
    coord.pool.evict_blocks([sliding_a[0]])
    # k = 4 needs sliding blocks 2, 3 only: block 0 of the sliding group does not matter
    assert coord.find_longest_cache_hit(block_hashes(tokens, B), 4).num_blocks == 4


def test_chunked_group_hit_and_skip():
    coord = coordinator(kinds=(C, F), window=8)  # chunks of 8 tokens = 2 blocks
    tokens = list(range(24))
    hashes = block_hashes(tokens, B)
    prefill(coord, "a", tokens)
    chunked_a, _ = coord.block_tables("a")
    # before token 17 the chunk starts at 16: blocks 0..3 are dead
    assert coord.remove_skipped_blocks("a", 17) == 4
    coord.free("a")
    # k = 5 (20 tokens): the chunk of token 20 starts at 16 = block 4: needs block 4 only
    hit = coord.find_longest_cache_hit(hashes, 5)
    assert hit.num_blocks == 5 and hit.blocks[0] == [0, 0, 0, 0, chunked_a[4]]
    # k = 4 (16 tokens) is a chunk boundary: the chunked group needs no block at all
    coord.pool.evict_blocks([chunked_a[4]])
    hit = coord.find_longest_cache_hit(hashes, 5)
    assert hit.num_blocks == 4 and hit.blocks[0] == [0, 0, 0, 0]


def test_allocate_is_atomic():
    coord = coordinator(num_blocks=8)  # 7 usable (block 0 is the null block)
    coord.allocate("a", 12)  # 3 + 3 blocks
    before = (coord.block_tables("a"), coord.num_free_blocks)
    with pytest.raises(OutOfBlocksError):
        coord.allocate("a", 16)  # needs 2 more, 1 free
    with pytest.raises(OutOfBlocksError):
        coord.allocate("b", 4)  # needs 2 (one per group), 1 free
    assert (coord.block_tables("a"), coord.num_free_blocks) == before and coord.requests == ["a"]
    with pytest.raises(InvalidArgumentError):
        coord.allocate("a", -1)
    assert coord.num_blocks_to_allocate("a", 16) == 2 and coord.num_blocks_to_allocate("b", 4) == 2
    coord.check_integrity()


def test_hit_rules_for_misuse():
    coord = coordinator()
    tokens = list(range(12))
    prefill(coord, "a", tokens)
    hit = coord.find_longest_cache_hit(block_hashes(tokens, B), 2)
    with pytest.raises(InvalidArgumentError, match="running"):
        coord.allocate("a", 12, hit)
    coord.free("a")
    coord.pool.evict_blocks(coord.pool.evictable_blocks())  # every cached block loses its hash
    with pytest.raises(InvalidArgumentError, match="stale"):
        coord.allocate("b", 12, hit)
    assert coord.requests == []
    with pytest.raises(InvalidIdError):
        coord.remove_skipped_blocks("nobody", 4)
    with pytest.raises(InvalidArgumentError):
        KVCacheCoordinator([], 4)


def test_decoding_past_the_window_is_bounded():
    # W 8, B 4: the sliding group never holds more than cdiv(7, 4) + 1 = 3 blocks while decoding
    coord = coordinator()
    tokens = list(range(100))
    prefill(coord, "a", tokens, 1)
    peak_sliding = 0
    for n in range(1, 100):  # token n is computed now: free what position n cannot read, then grow
        coord.remove_skipped_blocks("a", n)
        coord.allocate("a", n + 1)
        coord.cache_blocks("a", block_hashes(tokens, B), n + 1)
        sliding, full = coord.block_tables("a")
        peak_sliding = max(peak_sliding, sum(b != 0 for b in sliding))
        assert len(full) == -(-(n + 1) // B)
    assert peak_sliding == 3 == coord.groups[0].max_blocks(10**6)
    coord.check_integrity()


def test_check_integrity_finds_a_corrupted_table():
    coord = coordinator()
    coord.allocate("a", 8)
    tables = coord._reqs["a"].tables
    tables[1].append(tables[0][0])  # a block in two groups' tables
    with pytest.raises(IntegrityError):
        coord.check_integrity()


def test_free_is_tail_first_across_groups():
    coord = coordinator(caching=True)
    tokens = list(range(12))
    prefill(coord, "a", tokens)
    sliding, full = coord.block_tables("a")
    coord.free("a")
    # position 2 of both groups first, then 1, then 0: the LRU head is evicted first
    assert coord.pool.evictable_blocks() == [sliding[2], full[2], sliding[1], full[1], sliding[0], full[0]]


def test_plain_block_pool_has_the_probe():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.cache_blocks([b], [b"x" * 16])
    assert pool.get_cached_block(b"x" * 16) == b and pool.get_cached_block(b"y") is None
    assert pool.stats.hits == pool.stats.misses == 0
    with pytest.raises(InvalidArgumentError):
        pool.get_cached_block([1])  # unhashable


def test_a_hit_whose_blocks_were_evicted_and_reused_is_stale():
    # One full group, 4 blocks. "a" publishes 2 blocks and ends: they are cached free. The hit on them is
    # taken, then "b" allocates all 4 blocks (both cached ones are evicted and now hold b's KV, in use).
    # Sharing them with "c" would hand it b's KV for a's prefix: the hit must be refused as stale.
    coord = coordinator(num_blocks=4, kinds=(F,))
    tokens = list(range(8))
    prefill(coord, "a", tokens)
    coord.free("a")
    hit = coord.find_longest_cache_hit(block_hashes(tokens, B), 2)
    assert hit.num_blocks == 2 and hit.block_hashes == tuple(block_hashes(tokens, B))
    coord.allocate("b", 16)  # 4 blocks: the 2 uncached first, then the 2 cached ones (evicted)
    assert set(hit.blocks[0]) <= set(coord.block_tables("b")[0])
    before = (coord.block_tables("b"), coord.num_free_blocks, coord.requests)
    with pytest.raises(InvalidArgumentError, match="stale"):
        coord.allocate("c", 8, hit)
    assert (coord.block_tables("b"), coord.num_free_blocks, coord.requests) == before
    coord.check_integrity()
    coord.free("b")  # b published nothing, so its blocks go back uncached: a fresh lookup misses
    assert coord.find_longest_cache_hit(block_hashes(tokens, B), 2).num_blocks == 0


def test_a_hit_on_a_block_shared_with_a_running_request_is_not_stale():
    coord = coordinator()
    tokens = list(range(16))
    prefill(coord, "a", tokens)  # a keeps running: its blocks are in use and published
    hit = coord.find_longest_cache_hit(block_hashes(tokens, B), 3)
    coord.allocate("b", 16, hit)  # shares a's 3 full-group blocks (and the sliding window's 2)
    assert coord.block_tables("b")[1][:3] == coord.block_tables("a")[1][:3]
    coord.check_integrity()


@pytest.mark.parametrize("bad", [-4, 2.5, True, "8", None, np.int64(-1)])
def test_counts_follow_the_integer_rule_and_change_nothing(bad):
    # cache_blocks(r, hashes, -4) used to publish every block but the last (their KV unwritten): -4 // 4 = -1
    coord = coordinator()
    tokens = list(range(16))
    coord.allocate("a", 16)
    full = coordinator(kinds=(F,))
    full.allocate("a", 16)
    hashes = block_hashes(tokens, B)
    state = (coord.block_tables("a"), coord.pool.num_cached_blocks, coord.num_free_blocks)
    calls = [lambda: coord.cache_blocks("a", hashes, bad), lambda: coord.remove_skipped_blocks("a", bad),
             lambda: coord.num_blocks_to_allocate("a", bad), lambda: coord.allocate("a", bad),
             lambda: coord.reserve("a", bad, 16), lambda: coord.reserve("a", 0, bad),
             lambda: full.reserve("a", bad, 16)]  # a model without windows checks the computed count too
    if bad is not None:
        calls.append(lambda: coord.find_longest_cache_hit(hashes, bad))
    for call in calls:
        with pytest.raises(InvalidArgumentError):
            call()
        assert (coord.block_tables("a"), coord.pool.num_cached_blocks, coord.num_free_blocks) == state
    coord.cache_blocks("a", hashes, np.int64(8))  # a numpy count is the int it holds: 2 blocks x 2 groups
    assert coord.pool.num_cached_blocks == 4
    assert coord.find_longest_cache_hit(hashes, np.int64(1)).num_blocks == 1
    coord.check_integrity()


@pytest.mark.parametrize(("kinds", "spare"), [((F,), 0), ((F,), 1), ((S, F), 0), ((S, F), 1)])
def test_can_allocate_counts_cached_free_hits_as_taken(kinds, spare):
    """A hit on cached free blocks takes them off the free list. Request "a" publishes 12 tokens (3 blocks
    per group) and ends, so its blocks are cached free; a new 13-token request hitting those 3 blocks needs
    1 new block per group plus the hit's cached free blocks: 3 in a full group, 2 in the sliding group of
    window 8 (the blocks of tokens 4..11). A pool of exactly "a"'s blocks + ``spare`` fits it only with a
    spare block: full 1 + 3 = 4 of 3 + spare; sliding and full 2 + 5 = 7 of 6 + spare."""
    held = 3 * len(kinds)
    coord = coordinator(num_blocks=held + spare + (S in kinds), kinds=kinds)  # + the null block
    tokens = list(range(13))
    prefill(coord, "a", tokens[:12])
    coord.free("a")
    hit = coord.find_longest_cache_hit(block_hashes(tokens, B), 3)
    need = len(kinds) + {(F,): 3, (S, F): 5}[kinds]
    assert hit.num_blocks == 3 and coord.num_blocks_to_allocate("b", 13, hit) == need == held + 1
    assert coord.num_free_blocks == held + spare
    assert coord.can_allocate("b", 13, hit) is bool(spare)
    if spare:
        coord.allocate("b", 13, hit)
        assert coord.num_free_blocks == 0
    coord.check_integrity()


def test_pool_prefix_match_and_unreferenced_count():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    hashes = block_hashes(list(range(12)), B)
    pool.cache_blocks(blocks, hashes)
    pool.free([blocks[2]])
    before = pool.stats
    assert pool.match_prefix(hashes) == blocks and pool.match_prefix([hashes[1]]) == [blocks[1]]
    assert pool.match_prefix([b"x" * 16, hashes[0]]) == []
    assert pool.stats == before  # no hit or miss counted, unlike lookup
    assert pool.num_unreferenced(blocks) == 1 and pool.num_unreferenced([blocks[2], blocks[2]]) == 2
    for bad in ([6], [-1], [True]):
        with pytest.raises(InvalidIdError):
            pool.num_unreferenced(bad)
