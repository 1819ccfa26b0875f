"""Compaction of an elastic pool (issue 32, kvpool.requests.compaction) against a brute-force model.

The store is a page model (4 blocks a page, block b on page b // 4) under a coordinator of two KV cache
groups (a sliding window and full attention, one pool, a null block). Seeded random operations (requests
that allocate, grow, hit the prefix cache, publish, free, evictions, pins, compactions) run beside a model
kept here without kvpool: the KV "written" in each block (a tag ``(request, group, position)``, copied as a
compaction's ``copy`` is asked to), each request's expected tags, the tag each published hash names, and
the ref counts counted from the tables and pins. After every operation each request's tables read its own
tags, each hashed block holds its hash's tag, the ref counts equal the model's, the live blocks are the
used and cached ones; after each compaction the pages holding live blocks are at most ``ceil(live / 4) +
1`` and the committed ones that plus the reserve, and the eviction order names the same hashes as
before it (under LRU in the same order; the other policies, run on one seed each, take a moved cached
block as newly released).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from kvpool.allocators.block_pool import BlockPool
from kvpool.allocators.groups import KVCacheCoordinator, group_key
from kvpool.errors import InvalidIdError, OutOfBlocksError
from kvpool.requests.block_memory import PoolMemory
from kvpool.requests.compaction import Compactor, holding_pages, plan_moves
from kvpool.spec import LayerKind, kv_cache_groups
from kvpool.storage.elastic import PageModel

S, F = LayerKind.SLIDING, LayerKind.FULL
B = 4  # tokens a block
PER_PAGE = 4
PAGE = 4096
RESERVE = 1


class Model:
    """The pool, its coordinator, the page model, the compactor, and the brute-force state beside them."""

    def __init__(self, seed: int, num_blocks: int = 96, copy: bool = True, policy: str = "lru") -> None:
        self.rng = random.Random(seed)
        groups = kv_cache_groups((S, F), {S: 8}, B)
        self.coord = KVCacheCoordinator(groups, num_blocks, policy=policy)
        self.exact_order = policy == "lru"  # other policies take a moved cached block as newly released
        self.pool = self.coord.pool
        self.store = PageModel(num_blocks, PAGE // PER_PAGE, page_size=PAGE, reserve_pages=RESERVE)
        self.memory = PoolMemory(self.store, lambda: self.pool, self.coord.null_block)
        kv = SimpleNamespace(pool=self.pool, coordinator=self.coord, memory=self.memory, tiers=None)
        self.compactor = Compactor(kv, self._copy if copy else None)
        self.data: dict[int, tuple] = {}  # block -> the tag of the KV written in it
        self.expected: dict[int, list[list[tuple | None]]] = {}  # request -> group -> tags
        self.tokens: dict[int, list[int]] = {}
        self.hash_tags: dict[object, set] = {}  # published key -> the tags of the KV published under it
        self.next_id = 0

    def _copy(self, moves) -> None:
        for src, dst in moves:
            self.data[dst] = self.data[src]

    # ---- operations --------------------------------------------------------------------------------
    def admit(self) -> None:
        rid, rng = self.next_id, self.rng
        self.next_id += 1
        prefix = [7] * B * rng.randrange(0, 4)  # shared prefixes make hits
        tokens = prefix + [rng.randrange(100) for _ in range(rng.randrange(1, 5 * B))]
        hashes = self._hashes(tokens)
        hit = self.coord.find_longest_cache_hit(hashes[:(len(tokens) - 1) // B])
        try:
            self.coord.allocate(rid, len(tokens), hit)
        except OutOfBlocksError:
            return
        self.tokens[rid] = tokens
        tables = self.coord.block_tables(rid)
        assert self.memory.handed_out(tables)
        null = self.coord.null_block
        self.expected[rid] = [[self.data[b] if i < hit.num_blocks and b != null else None  # checked: its
                               for i, b in enumerate(t)] for t in tables]  # hash's KV (check)
        self._write(rid)

    def _write(self, rid: int) -> None:
        """The forward writes each block of ``rid`` it has not written yet (a tag per group and position)."""
        for g, table in enumerate(self.coord.block_tables(rid)):
            for i, b in enumerate(table):
                if b != self.coord.null_block and self.expected[rid][g][i] is None:
                    self.data[b] = self.expected[rid][g][i] = (rid, g, i)

    def _hashes(self, tokens: list[int]) -> list[int]:
        out, h = [], 0
        for i in range(len(tokens) // B):
            h = hash((h, tuple(tokens[i * B:(i + 1) * B]))) & (2**62 - 1)
            out.append(h)
        return out

    def publish(self, rid: int) -> None:
        tokens = self.tokens[rid]
        hashes = self._hashes(tokens)
        self.coord.cache_blocks(rid, hashes, len(tokens))
        for g, table in enumerate(self.coord.block_tables(rid)):
            for i, b in enumerate(table[:len(hashes)]):
                if b != self.coord.null_block:
                    self.hash_tags.setdefault(group_key(g, hashes[i]), set()).add(self.data[b])

    def grow(self, rid: int) -> None:
        """One step: the window's blocks are freed, blocks for ``more`` tokens allocated and written."""
        tokens = self.tokens[rid]
        more = self.rng.randrange(1, 2 * B)
        before = self.coord.block_tables(rid)
        grown = self.coord.reserve(rid, len(tokens), len(tokens) + more)
        tables = self.coord.block_tables(rid)
        self.memory.emptied(b for t in before for b in t)  # blocks the window left behind
        exp = self.expected[rid]
        for g, table in enumerate(tables):
            exp[g] += [None] * (len(table) - len(exp[g]))
            for i, b in enumerate(table):
                if b == self.coord.null_block:
                    exp[g][i] = None  # out of the window
        if grown:
            tokens += [self.rng.randrange(100) for _ in range(more)]
            assert self.memory.handed_out(tables)
            self._write(rid)

    def finish(self, rid: int) -> None:
        tables = self.coord.block_tables(rid)
        self.coord.free(rid)
        self.memory.emptied(b for t in tables for b in t)
        del self.expected[rid], self.tokens[rid]

    def evict(self) -> None:
        cached = self.pool.evictable_blocks()
        victims = self.rng.sample(cached, min(len(cached), self.rng.randrange(0, 4)))
        self.pool.evict_blocks(victims)
        self.memory.emptied(victims)

    def compact(self, force: bool) -> int:
        order = [self.pool.block_hash(b) for b in self.pool.evictable_blocks()]
        moved = self.compactor.compact(force=force)
        after = [self.pool.block_hash(b) for b in self.pool.evictable_blocks()]
        assert after == order if self.exact_order else sorted(map(str, after)) == sorted(map(str, order))
        pages = self.store.pages
        live = pages.num_live
        assert holding_pages(pages) <= -(-live // PER_PAGE) + 1
        assert pages.arena.num_committed <= -(-live // PER_PAGE) + 1 + RESERVE
        return moved

    # ---- the checks ---------------------------------------------------------------------------------
    def check(self) -> None:
        self.coord.check_integrity()
        self.memory.check()
        self.store.pages.check_integrity()
        refs: dict[int, int] = dict(self.pool.pinned_blocks())
        null = self.coord.null_block
        for rid, exp in self.expected.items():
            for g, table in enumerate(self.coord.block_tables(rid)):
                for i, b in enumerate(table):
                    if b == null:
                        continue
                    refs[b] = refs.get(b, 0) + 1
                    assert self.data[b] == exp[g][i], (rid, g, i, b)  # the request reads its own KV
        for b in range(self.pool.num_blocks):
            if b != null:
                assert self.pool.ref_count(b) == refs.get(b, 0), b
                h = self.pool.block_hash(b)
                if h is not None:
                    assert self.data[b] in self.hash_tags[h], b  # a hashed block holds its hash's KV


@pytest.mark.parametrize(("seed", "policy"), [(seed, "lru") for seed in range(12)] +
                         [(0, p) for p in ("fifo", "lfu", "slru", "arc", "s3fifo", "sieve", "lineage")])
def test_random_operations_keep_every_block_and_pack_the_pages(seed: int, policy: str) -> None:
    model, moved = Model(seed, policy=policy), 0
    rng = model.rng
    for _ in range(400):
        running = list(model.expected)
        op = rng.random()
        if op < 0.3 or not running:
            model.admit()
        elif op < 0.55:
            model.grow(rng.choice(running))
        elif op < 0.7:
            model.publish(rng.choice(running))
        elif op < 0.85:
            model.finish(rng.choice(running))
        elif op < 0.9:
            model.evict()
        elif op < 0.93:
            cached = model.pool.evictable_blocks()
            if cached and model.pool.num_pinned_blocks < 4:
                model.pool.pin([rng.choice(cached)])
        elif op < 0.95 and model.pool.pinned_blocks():
            model.pool.unpin([rng.choice(list(model.pool.pinned_blocks()))])
        else:
            moved += model.compact(force=rng.random() < 0.5)
        model.check()
    for pinned, count in model.pool.pinned_blocks().items():
        for _ in range(count):
            model.pool.unpin([pinned])
    moved += model.compact(force=True)
    model.check()
    assert moved > 0  # the walk moved blocks (in use and cached)


def test_a_compaction_empties_the_sparse_pages_by_hand() -> None:
    """16 blocks on pages 0-3; live: 1 | 4 5 6 | 8 | 12 13 14 15, 9 blocks, 3 pages packed (ceil(9 / 4)),
    4 holding them: within the slack (3 + 1), so only a forced compaction runs. The emptiest pages are 0
    and 2 (one block each; the later page first): block 8 goes to the fullest page with a hole, page 1
    (page 3 is full), hole 7. Then 3 pages hold the 9 blocks: done, one move."""
    pool = BlockPool(16)
    store = PageModel(16, PAGE // PER_PAGE, page_size=PAGE)
    memory = PoolMemory(store, lambda: pool, None)
    blocks = pool.allocate(16)
    memory.handed_out([blocks])
    pool.free([b for b in blocks if b not in (1, 4, 5, 6, 8, 12, 13, 14, 15)])
    memory.emptied(blocks)
    assert holding_pages(store.pages) == 4
    assert plan_moves(store.pages, pool.block_states()) == [(8, 7)]
    renamed = []
    kv = SimpleNamespace(pool=pool, memory=memory, tiers=None,
                         coordinator=SimpleNamespace(rename_blocks=renamed.append))
    compactor = Compactor(kv)
    assert not compactor.due() and compactor.compact() == 0
    assert compactor.compact(force=True) == 1 and renamed == [{8: 7}]
    assert holding_pages(store.pages) == 3 and pool.ref_count(7) == 1 and pool.ref_count(8) == 0
    assert compactor.stats.moved == 1 and compactor.stats.released_bytes == PAGE
    pool.check_integrity()
    memory.check()


def test_move_block_refuses_what_it_cannot_move() -> None:
    pool = BlockPool(8)
    a, b, c = pool.allocate(3)
    pool.cache_blocks([a], [11])
    pool.pin([a])
    for src, dst in ((a, 5), (b, c), (4, 5), (b, b), (b, 8)):
        with pytest.raises(InvalidIdError):
            pool.move_block(src, dst)
    pool.check_integrity()
    pool.move_block(b, 6)  # a never handed out id: 3, 4, 5 join the free stack
    pool.check_integrity()
    assert pool.ref_count(6) == 1 and pool.ref_count(b) == 0 and pool.num_free_blocks == 5


def test_the_strips_of_the_2_l_n_layout_compact_by_page_rows() -> None:
    """An elastic HND cache (the ``[2, L, N, B, H, D]`` layout): 2 layers x K and V = 4 strips, a block 16
    tokens x 2 heads x 64 x 2 B = 4 KiB in each, 16 KiB pages: 4 blocks a page, and 16 blocks make each
    strip 64 KiB, so every strip starts on a page. The by-hand case above: block 8 moves to hole 7 with
    its KV in every strip, and one page row (4 pages, 64 KiB) goes back. With 15 blocks a strip is 60 KiB:
    the strips after the first start inside a page, nothing to compact."""
    import torch

    from kvpool.requests.compaction import blocks_per_page
    from kvpool.spec import KVCacheSpec
    from kvpool.storage.arena import ElasticConfig
    from kvpool.storage.paged import PagedKVCache

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, block_size=16)
    page = 16384
    misaligned = PagedKVCache(spec, 15, elastic=ElasticConfig(page_size=page), layout="HND")
    assert len(misaligned.pages.map.strips) == 4 and blocks_per_page(misaligned.pages) is None
    cache = PagedKVCache(spec, 16, elastic=ElasticConfig(page_size=page), layout="HND")
    assert len(cache.pages.map.strips) == 4 and blocks_per_page(cache.pages) == 4
    pool = BlockPool(16)
    memory = PoolMemory(cache, lambda: pool, None)
    blocks = pool.allocate(16)
    memory.handed_out([blocks])
    for layer in range(2):
        for b in blocks:
            cache.k_cache(layer)[b] = b + 10 * layer
            cache.v_cache(layer)[b] = -b - 10 * layer
    pool.free([b for b in blocks if b not in (1, 4, 5, 6, 8, 12, 13, 14, 15)])
    memory.emptied(blocks)
    assert holding_pages(cache.pages) == 4 and cache.committed_bytes == 4 * 4 * page
    kv = SimpleNamespace(pool=pool, memory=memory, tiers=None,
                         coordinator=SimpleNamespace(rename_blocks=lambda moved: None))
    compactor = Compactor(kv, cache.copy_blocks)
    assert compactor.compact(force=True) == 1
    assert holding_pages(cache.pages) == 3 and cache.committed_bytes == 3 * 4 * page
    assert compactor.stats.released_bytes == 4 * page
    for layer in range(2):
        assert bool((cache.k_cache(layer)[7] == 8 + 10 * layer).all())
        assert bool((cache.v_cache(layer)[7] == -8 - 10 * layer).all())
    pool.check_integrity()
    cache.pages.check_integrity()
