"""BlockPool against a brute-force model, driven by hypothesis: random sequences of every operation,
error paths included, with ``check_integrity()`` and a full comparison of observable state after each step.

The model keeps per-block ref counts, hashes and the time each block last became free, and answers every
question by scanning all blocks: LRU order is "sorted by free time", the index is "which block holds h".
It never predicts which uncached block ``allocate`` picks, only the rules: uncached blocks first, then the
oldest cached free blocks. With a null block (block 0) the model never frees, hands out or hashes it, and
the machine slips it (repeated) into the ids of free, touch, cache_blocks and evict_blocks.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool import BlockPool, DoubleFreeError, InvalidArgumentError, InvalidIdError, OutOfBlocksError

HASHES = st.integers(0, 11)  # a small universe, so hash collisions and re-publishing happen often


class Model:
    """Brute force: every query scans all blocks."""

    def __init__(self, n: int, caching: bool, null: bool) -> None:
        self.n, self.caching = n, caching
        self.first = 1 if null else 0  # the first id allocate may hand out
        self.ref = [0] * n
        self.hash: list[int | None] = [None] * n
        self.freed_at = [0] * n  # a clock value; only meaningful for cached free blocks
        self.clock = 0
        self.hits = self.misses = self.evictions = 0

    def holder(self, h: int) -> int | None:
        found = [b for b in range(self.n) if self.hash[b] == h]
        return found[0] if found else None

    def uncached_free(self) -> set[int]:
        return {b for b in range(self.first, self.n) if self.ref[b] == 0 and self.hash[b] is None}

    def lru(self) -> list[int]:
        cached = [b for b in range(self.n) if self.ref[b] == 0 and self.hash[b] is not None]
        return sorted(cached, key=lambda b: self.freed_at[b])

    def match(self, hashes: list[int]) -> list[int]:
        out = []
        for h in hashes if self.caching else []:
            block = self.holder(h)
            if block is None:
                break
            out.append(block)
        return out


class BlockPoolMachine(RuleBasedStateMachine):
    caching = True
    null = False

    @initialize(n=st.integers(2, 9))
    def setup(self, n: int) -> None:
        self.pool = BlockPool(n, enable_caching=self.caching, reserve_null_block=self.null)
        self.model = Model(n, self.caching, self.null)

    def used(self) -> list[int]:
        return [b for b in range(self.model.n) if self.model.ref[b] > 0]

    def with_nulls(self, data: st.DataObject, ids: list, null: object = 0) -> list:
        """``ids`` in their order with 0-2 copies of ``null`` slipped in at random places (none without a
        null block)."""
        out = list(ids)
        for _ in range(data.draw(st.integers(0, 2)) if self.null else 0):
            out.insert(data.draw(st.integers(0, len(out))), null)
        return out

    def expect_error(self, error: type[Exception], call, *args: object) -> None:
        with pytest.raises(error):
            call(*args)  # the invariant below then proves nothing changed

    # ---- allocate -------------------------------------------------------------------------------------

    @rule(n=st.integers(0, 10))
    def allocate(self, n: int) -> None:
        m = self.model
        uncached, lru = m.uncached_free(), m.lru()
        if n > len(uncached) + len(lru):
            self.expect_error(OutOfBlocksError, self.pool.allocate, n)
            return
        got = self.pool.allocate(n)
        assert len(got) == len(set(got)) == n
        k = min(n, len(uncached))
        evicted = lru[: n - k]
        assert (set(got) <= uncached) if n <= len(uncached) else (set(got) == uncached | set(evicted))
        for b in evicted:
            m.hash[b] = None
        m.evictions += len(evicted)
        for b in got:
            m.ref[b] = 1

    @rule(n=st.sampled_from([-1, 1.0, True, "2"]))
    def allocate_bad_count(self, n: object) -> None:
        self.expect_error(InvalidArgumentError, self.pool.allocate, n)

    # ---- free / touch ---------------------------------------------------------------------------------

    @precondition(lambda self: any(self.model.ref))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.used()), unique=True, min_size=1))
        self.pool.free(self.with_nulls(data, ids))
        m = self.model
        for b in ids:
            m.ref[b] -= 1
            if m.ref[b] == 0:
                m.clock += 1
                m.freed_at[b] = m.clock

    @rule(data=st.data())
    def free_bad(self, data: st.DataObject) -> None:
        m, used = self.model, self.used()
        kind = data.draw(st.sampled_from(["not-allocated", "out-of-range", "duplicate", "negative"]))
        good = data.draw(st.lists(st.sampled_from(used), unique=True, max_size=3)) if used else []
        if kind == "not-allocated" and len(used) < m.n - m.first:
            free_ids = [b for b in range(m.first, m.n) if m.ref[b] == 0]
            bad, error = [data.draw(st.sampled_from(free_ids))], DoubleFreeError
        elif kind == "duplicate" and good:
            bad, error = [good[0]], InvalidIdError
        else:
            bad, error = [m.n + 3 if kind == "out-of-range" else -1], InvalidIdError
        ids = data.draw(st.permutations(good + bad))
        self.expect_error(error, self.pool.free, ids)

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        m = self.model
        candidates = [b for b in range(m.n) if m.ref[b] > 0 or m.hash[b] is not None]
        ids = data.draw(st.lists(st.sampled_from(candidates), unique=True)) if candidates else []
        self.pool.touch(self.with_nulls(data, ids))
        for b in ids:
            m.ref[b] += 1

    @precondition(lambda self: self.model.uncached_free())
    @rule(data=st.data())
    def touch_uncached_free(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.model.uncached_free())))
        self.expect_error(InvalidIdError, self.pool.touch, [block])

    # ---- prefix cache ---------------------------------------------------------------------------------

    @precondition(lambda self: any(self.model.ref))
    @rule(data=st.data())
    def cache_blocks(self, data: st.DataObject) -> None:
        m = self.model
        ids = data.draw(st.lists(st.sampled_from(self.used()), unique=True, min_size=1))
        hashes = data.draw(st.lists(HASHES, min_size=len(ids), max_size=len(ids)))
        pairs = self.with_nulls(data, list(zip(ids, hashes, strict=True)), null=(0, 99))
        call_ids, call_hashes = [p[0] for p in pairs], [p[1] for p in pairs]
        if any(m.hash[b] is not None and m.hash[b] != h for b, h in zip(ids, hashes, strict=True)):
            self.expect_error(InvalidIdError, self.pool.cache_blocks, call_ids, call_hashes)
            return
        self.pool.cache_blocks(call_ids, call_hashes)
        for b, h in zip(ids, hashes, strict=True):
            if m.caching and m.hash[b] is None and m.holder(h) is None:
                m.hash[b] = h

    @precondition(lambda self: any(r == 0 for r in self.model.ref))
    @rule(data=st.data(), h=HASHES)
    def cache_free_block(self, data: st.DataObject, h: int) -> None:
        m = self.model
        block = data.draw(st.sampled_from([b for b in range(m.first, m.n) if m.ref[b] == 0] or [m.n]))
        self.expect_error(InvalidIdError, self.pool.cache_blocks, [block], [h])

    @rule(data=st.data())
    def evict_blocks(self, data: st.DataObject) -> None:
        m = self.model
        ids = data.draw(st.lists(st.integers(m.first, m.n - 1), unique=True, max_size=4))
        self.pool.evict_blocks(self.with_nulls(data, ids))
        for b in ids:
            m.hash[b] = None

    @rule(data=st.data())
    def evict_blocks_bad(self, data: st.DataObject) -> None:
        m = self.model
        bad = data.draw(st.sampled_from([[m.n], [-1], [m.n - 1, m.n - 1], [True], [1.0]]))
        self.expect_error(InvalidIdError, self.pool.evict_blocks, bad)

    @rule()
    def reset_prefix_cache(self) -> None:
        m = self.model
        ok = not any(m.ref)
        assert self.pool.reset_prefix_cache() is ok
        if ok:
            m.hash = [None] * m.n

    @rule(hashes=st.lists(HASHES, max_size=6))
    def lookup(self, hashes: list[int]) -> None:
        expected = self.model.match(hashes)
        assert self.pool.lookup(hashes) == expected
        self.model.hits += len(expected)
        self.model.misses += len(hashes) - len(expected)

    @rule(hashes=st.lists(HASHES, max_size=6), extra=st.integers(0, 4))
    def admission(self, hashes: list[int], extra: int) -> None:
        m, num_blocks = self.model, len(hashes) + extra
        in_use_hits = sum(1 for b in m.match(hashes) if m.ref[b] > 0)
        assert self.pool.num_blocks_to_allocate(hashes, num_blocks) == num_blocks - in_use_hits
        free = len(m.uncached_free()) + len(m.lru())
        assert self.pool.can_allocate(hashes, num_blocks) == (num_blocks - in_use_hits <= free)

    # ---- after every step -----------------------------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool, m = self.pool, self.model
        pool.check_integrity()
        assert [pool.ref_count(b) for b in range(m.n)] == m.ref
        assert [pool.block_hash(b) for b in range(m.n)] == m.hash
        assert pool.evictable_blocks() == m.lru()
        assert pool.num_free_blocks == len(m.uncached_free()) + len(m.lru())
        assert pool.num_cached_blocks == sum(h is not None for h in m.hash)
        assert pool.num_used_blocks == sum(r > 0 for r in m.ref)
        assert (pool.stats.hits, pool.stats.misses, pool.stats.evictions) == (m.hits, m.misses, m.evictions)


class BlockPoolNoCachingMachine(BlockPoolMachine):
    caching = False


class BlockPoolNullBlockMachine(BlockPoolMachine):
    null = True


TestBlockPoolStateful = BlockPoolMachine.TestCase
TestBlockPoolStateful.settings = settings(max_examples=1000, stateful_step_count=30)
TestBlockPoolNoCachingStateful = BlockPoolNoCachingMachine.TestCase
TestBlockPoolNoCachingStateful.settings = settings(max_examples=200, stateful_step_count=30)
TestBlockPoolNullBlockStateful = BlockPoolNullBlockMachine.TestCase
TestBlockPoolNullBlockStateful.settings = settings(max_examples=200, stateful_step_count=30)
