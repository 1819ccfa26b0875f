"""KVCacheCoordinator against a brute-force model, driven by hypothesis.

Random request lives (admission with a prefix-cache hit, chunked prefill, decode steps, preemption, finish)
over four group layouts. After every step ``check_integrity()`` runs, and the model checks what each
request holds per group: a table of ``cdiv(tokens allocated, B)`` entries whose null entries are exactly
the ``skipped_blocks`` prefix of the last ``remove_skipped_blocks`` (or of the hit). Every lookup is checked
against a brute-force hit: the longest k for which every group has a cached block under its own key at each
position ``skipped_blocks(k * B) .. k - 1``, tried for every k (O(k^2), independent of the coordinator's
fixed-point scan), where "cached under a key" is brute force too: of the blocks holding the key (a scan of
every block; several may hold one, when two requests computed the same block), the one published first
(the machine notes each block's publish time after every call that can publish or evict); the hit's blocks
must be those blocks. Allocation must raise exactly when the
pool has fewer free blocks than the model's count, and change nothing then. A hit taken before another
request took its blocks over must be refused as stale exactly when a hit block no longer holds its group's
key; counts that break the integer rule change nothing. Every step, the holders per key counted from the
pool's KV events alone (each event's group and kind; one BlockStored or BlockRemoved per block) equal the
pool's blocks holding each key.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.allocators.block_pool import BlockPool
from kvpool.allocators.groups import KVCacheCoordinator, group_key
from kvpool.allocators.hashing import block_hashes
from kvpool.errors import InvalidArgumentError, OutOfBlocksError
from kvpool.events import BlockRemoved, BlockStored, KVEventSink, QueueEventPublisher
from kvpool.spec import LayerKind, cdiv, kv_cache_groups

S, F, C = LayerKind.SLIDING, LayerKind.FULL, LayerKind.CHUNKED
B = 4
LAYOUTS = {
    "sliding+full": ((S, F), {S: 8}),
    "full": ((F, F), {}),
    "2 sliding groups + full": ((S, S, F), {S: 6}),
    "chunked+full": ((C, F), {C: 8}),
    "sliding only": ((S,), {S: 5}),
}
PREFIXES = [list(range(100, 140)), list(range(200, 240))]  # two shared documents


class Req:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.hashes = block_hashes(tokens, B)
        self.computed = 0  # tokens whose KV is written and published
        self.allocated = 0  # tokens the tables cover
        self.removed_at = 0  # num_computed of the last remove_skipped_blocks


class CoordinatorMachine(RuleBasedStateMachine):
    @initialize(layout=st.sampled_from(sorted(LAYOUTS)), n=st.integers(6, 40),
                batch=st.sampled_from([1, 3, 4096]), chunk=st.sampled_from([1, 3, 16_384]))
    def setup(self, layout: str, n: int, batch: int, chunk: int) -> None:
        kinds, windows = LAYOUTS[layout]
        self.groups = kv_cache_groups(kinds, windows, B)
        self.publisher = QueueEventPublisher(maxsize=100_000)
        sink = KVEventSink(self.publisher, block_size=B, max_batch_events=batch)
        # the pool's per-block arrays grow by 1 or 3 ids at a time (or cover the pool at once): every
        # layout runs across their chunk boundaries
        windowed = any(g.kind is not LayerKind.FULL for g in self.groups)
        pool = BlockPool(n, reserve_null_block=windowed, event_sink=sink, growth_chunk=chunk)
        self.coord = KVCacheCoordinator(self.groups, n, pool=pool)
        self.seen: Counter = Counter()  # holders per key as the events tell it
        self.null = self.coord.null_block  # 0, or -1 (none) for a model without windows
        self.reqs: dict[int, Req] = {}
        self.next_id = 0
        self.n = n
        self.keys: list = [None] * n  # each block's key when last noted
        self.published_at = [0] * n  # and when it was published (a call number)
        self.calls = 0
        self.index: dict = {}

    # ---- brute force ------------------------------------------------------------------------------------

    def noted(self) -> None:
        """After a call that can publish or evict: note the publish time of each block whose key changed,
        and rebuild the index (each key -> its holder published first) by a scan of every block."""
        self.calls += 1
        pool, index = self.coord.pool, {}
        for b in range(self.n):
            key = pool.block_hash(b)
            if key != self.keys[b]:
                self.keys[b], self.published_at[b] = key, self.calls
            if key is not None and (key not in index or self.published_at[b] < self.published_at[index[key]]):
                index[key] = b
        self.index = index

    def cached(self, g: int, h: object) -> int | None:
        return self.index.get(group_key(g, h))

    def brute_hit(self, hashes: list) -> int:
        best = 0
        for k in range(len(hashes) + 1):
            if all(self.cached(g.index, hashes[i]) is not None
                   for g in self.groups for i in range(g.skipped_blocks(k * B), k)):
                best = k
        return best

    def expected_nulls(self, req: Req, g: int) -> int:
        return min(self.groups[g].skipped_blocks(req.removed_at), cdiv(req.allocated, B))

    # ---- rules --------------------------------------------------------------------------------------------

    @rule(data=st.data(), prefix=st.integers(0, 2), tail=st.lists(st.integers(0, 9), max_size=14),
          cut=st.integers(0, 40), chunk=st.integers(1, 24))
    def admit(self, data: st.DataObject, prefix: int, tail: list[int], cut: int, chunk: int) -> None:
        tokens = (PREFIXES[prefix][:cut] if prefix < 2 else []) + tail
        if not tokens:
            return
        req = Req(tokens)
        max_hit = (len(tokens) - 1) // B  # the last token is always computed
        hit = self.coord.find_longest_cache_hit(req.hashes, max_hit)
        assert hit.num_blocks == self.brute_hit(req.hashes[:max_hit])
        for g in self.groups:
            start = g.skipped_blocks(hit.num_blocks * B) if hit.num_blocks else 0
            assert hit.blocks[g.index] == [self.null] * start + [self.cached(g.index, h)
                                                         for h in req.hashes[start:hit.num_blocks]]
        computed = hit.num_blocks * B
        target = min(len(tokens), computed + chunk)
        revived = sum(1 for blocks in hit.blocks for b in blocks
                      if b != self.null and self.coord.pool.ref_count(b) == 0)
        need = (cdiv(target, B) - hit.num_blocks) * len(self.groups) + revived
        rid = self.next_id
        self.next_id += 1
        free_before = self.coord.num_free_blocks
        if need > free_before:
            with pytest.raises(OutOfBlocksError):
                self.coord.allocate(rid, target, hit)
            assert self.coord.num_free_blocks == free_before and rid not in self.coord.requests
            return
        self.coord.allocate(rid, target, hit)
        self.noted()
        req.computed = req.removed_at = computed
        req.allocated = target
        self.coord.cache_blocks(rid, req.hashes, target)  # the forward pass wrote the chunk
        self.noted()
        req.computed = target
        self.reqs[rid] = req

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def step(self, data: st.DataObject, chunk: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[rid]
        if req.computed == len(req.tokens):
            req.tokens.append(data.draw(st.integers(0, 9)))  # decode: the sampled token joins the sequence
            req.hashes = block_hashes(req.tokens, B)
        target = min(len(req.tokens), req.computed + chunk)
        self.coord.remove_skipped_blocks(rid, req.computed)
        req.removed_at = req.computed
        need = sum(max(0, cdiv(target, B) - cdiv(req.allocated, B)) for _ in self.groups)
        if need > self.coord.num_free_blocks:
            tables = self.coord.block_tables(rid)
            with pytest.raises(OutOfBlocksError):
                self.coord.allocate(rid, target)
            assert self.coord.block_tables(rid) == tables
            self.finish(rid)  # preempted by recompute
            return
        self.coord.allocate(rid, target)
        self.noted()
        req.allocated = max(req.allocated, target)
        self.coord.cache_blocks(rid, req.hashes, target)
        self.noted()
        req.computed = target

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish_one(self, data: st.DataObject) -> None:
        self.finish(data.draw(st.sampled_from(sorted(self.reqs))))

    @rule(prefix=st.integers(0, 1), cut=st.integers(5, 40))
    def stale_hit(self, prefix: int, cut: int) -> None:
        """Take a hit, let another request take every free block (cached ones evicted and reused), then
        offer the old hit: stale exactly when a hit block no longer holds the key it was found under."""
        tokens = PREFIXES[prefix][:cut] + [0]
        hashes = block_hashes(tokens, B)
        hit = self.coord.find_longest_cache_hit(hashes, (len(tokens) - 1) // B)
        filler = self.next_id
        self.next_id += 2
        per_group = self.coord.num_free_blocks // len(self.groups)
        self.coord.allocate(filler, per_group * B)  # publishes nothing
        self.noted()
        pool = self.coord.pool
        stale = any(b != self.null and pool.block_hash(b) != group_key(g, hashes[i])
                    for g, blocks in enumerate(hit.blocks) for i, b in enumerate(blocks))
        free = self.coord.num_free_blocks
        try:
            self.coord.allocate(filler + 1, hit.num_blocks * B, hit)
        except InvalidArgumentError:
            assert stale and self.coord.num_free_blocks == free and filler + 1 not in self.coord.requests
        except OutOfBlocksError:
            assert not stale and self.coord.num_free_blocks == free
        else:
            assert not stale
            self.noted()
            self.coord.free(filler + 1)
        self.coord.free(filler)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), bad=st.sampled_from([-4, 2.5, True, "8", None]))
    def bad_counts(self, data: st.DataObject, bad: object) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        state = (self.coord.block_tables(rid), self.coord.num_free_blocks, self.coord.pool.num_cached_blocks)
        for call in (lambda: self.coord.cache_blocks(rid, self.reqs[rid].hashes, bad),
                     lambda: self.coord.remove_skipped_blocks(rid, bad),
                     lambda: self.coord.allocate(rid, bad)):
            with pytest.raises(InvalidArgumentError):
                call()
        assert state == (self.coord.block_tables(rid), self.coord.num_free_blocks,
                         self.coord.pool.num_cached_blocks)

    def finish(self, rid: int) -> None:
        self.coord.free(rid)
        del self.reqs[rid]

    # ---- checks -------------------------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "coord"):
            return
        self.coord.check_integrity()
        assert sorted(self.coord.requests) == sorted(self.reqs)
        held = 0
        for rid, req in self.reqs.items():
            tables = self.coord.block_tables(rid)
            for g, table in enumerate(tables):
                nulls = self.expected_nulls(req, g)
                assert len(table) == cdiv(req.allocated, B)
                assert table[:nulls] == [self.null] * nulls and self.null not in table[nulls:]
                held += len(table) - nulls
        assert self.coord.num_used_blocks <= held  # shared hit blocks count once
        self.coord.pool.event_sink.flush()
        for batch in self.publisher.drain():
            for event in batch.events:
                keys = [group_key(event.group_idx, h) for h in getattr(event, "block_hashes", ())]
                if isinstance(event, BlockStored):
                    kind = self.groups[event.group_idx].kind
                    assert event.kv_cache_spec_kind == {S: "sliding_window", F: "full_attention",
                                                        C: "chunked_local_attention"}[kind]
                    self.seen.update(keys)
                elif isinstance(event, BlockRemoved):
                    assert all(self.seen[k] > 0 for k in keys)
                    self.seen.subtract(keys)
        pool = self.coord.pool
        held_keys = [pool.block_hash(b) for b in range(self.n)]
        assert +self.seen == Counter(k for k in held_keys if k is not None)
        assert sum(self.seen.values()) == pool.num_cached_blocks
        assert all(pool.get_cached_block(k) == b for k, b in self.index.items())

    def teardown(self) -> None:
        if hasattr(self, "coord"):
            for rid in list(self.reqs):
                self.finish(rid)
            assert self.coord.num_used_blocks == 0
            self.coord.check_integrity()


TestCoordinator = CoordinatorMachine.TestCase
TestCoordinator.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
