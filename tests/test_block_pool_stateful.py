"""BlockPool against a brute-force model, driven by hypothesis: random sequences of every operation,
error paths included, with ``check_integrity()`` and a full comparison of observable state after each step.

The model keeps per-block ref counts, hashes, publish times and pins, and answers every question by scanning
all blocks: the index is "of the blocks holding h, the one published first" (several blocks may hold one hash:
each publish of a block holding none publishes it), the eviction order is a sort of the cached free blocks by
what the policy's model (below) records. It never predicts which uncached block ``allocate`` picks, only the
rules: uncached blocks first, then the cached free blocks in eviction order. With a null block (block 0) the
model never frees, hands out or hashes it, and the machine slips it (repeated) into the ids of free, touch,
cache_blocks and evict_blocks. One machine runs per eviction policy, one with frequency admission.

Every machine builds its pool with a growth chunk of 1-4 blocks, so its per-block arrays (and its policy's)
grow again and again as the high-water mark rises, and every step crosses chunk boundaries: the model also
restates the growth rule (``capacity`` follows the ids handed out so far, by a chunk or an eighth).
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool import (
    BlockPool,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidIdError,
    OutOfBlocksError,
    PinLimitError,
)
from kvpool.allocators.policies import FrequencyAdmission, PriorityPolicy, SLRUPolicy, make_policy

HASHES = st.integers(0, 11)  # a small universe, so hash collisions and re-publishing happen often
RETENTION_S = 2.0  # the priority policy's, on the machine's own clock
PROTECTED = 0.3  # the SLRU policy's protected fraction: a cap of 1-2 blocks, so demotion happens


# ---- policy models: each records per-block facts and sorts by them ------------------------------------

class LRUModel:
    """Evict by free time (each event ticks the model's clock)."""

    def __init__(self, model: Model) -> None:
        self.m, self.freed = model, [0] * model.n

    def published(self, b: int, h: int) -> None: ...

    def hit(self, b: int) -> None: ...

    def freed_now(self, b: int, priority: int) -> None:
        self.freed[b] = self.m.tick()

    def evicted(self, b: int, h: int) -> None: ...

    def dropped(self, b: int) -> None: ...

    def order(self, cached_free: list[int]) -> list[int]:
        return sorted(cached_free, key=lambda b: self.freed[b])

    def extra(self, pool: BlockPool) -> None: ...


class FIFOModel(LRUModel):
    """Evict by publish time, whatever the hits since."""

    def __init__(self, model: Model) -> None:
        super().__init__(model)
        self.born = [0] * model.n

    def published(self, b: int, h: int) -> None:
        self.born[b] = self.m.tick()

    def order(self, cached_free: list[int]) -> list[int]:
        return sorted(cached_free, key=lambda b: self.born[b])


class LFUModel(LRUModel):
    """Evict by hits since published, then free time."""

    def __init__(self, model: Model) -> None:
        super().__init__(model)
        self.hits = [0] * model.n

    def published(self, b: int, h: int) -> None:
        self.hits[b] = 0

    def hit(self, b: int) -> None:
        self.hits[b] += 1

    def order(self, cached_free: list[int]) -> list[int]:
        return sorted(cached_free, key=lambda b: (self.hits[b], self.freed[b]))


class PriorityModel(LRUModel):
    """Evict by the priority given at the last free (0 once RETENTION_S passed since), then free time."""

    def __init__(self, model: Model) -> None:
        super().__init__(model)
        self.priority, self.freed_s = [0] * model.n, [0.0] * model.n

    def freed_now(self, b: int, priority: int) -> None:
        super().freed_now(b, priority)
        self.priority[b], self.freed_s[b] = priority, self.m.now

    def order(self, cached_free: list[int]) -> list[int]:
        def key(b: int) -> tuple[int, int]:
            live = self.m.now - self.freed_s[b] < RETENTION_S
            return (self.priority[b] if live else 0, self.freed[b])

        return sorted(cached_free, key=key)


class SLRUModel(LRUModel):
    """A hit promotes; a free enters the tail of the block's segment; past the cap the protected block
    that entered first is demoted to the probation tail. Probation (by entry) goes before protected."""

    def __init__(self, model: Model) -> None:
        super().__init__(model)
        self.promoted = [False] * model.n
        self.cap = max(1, int(PROTECTED * model.n))

    def published(self, b: int, h: int) -> None:
        self.promoted[b] = False

    def hit(self, b: int) -> None:
        self.promoted[b] = True

    def freed_now(self, b: int, priority: int) -> None:
        super().freed_now(b, priority)
        protected = [x for x in self.m.cached_free() if self.promoted[x]]
        if len(protected) > self.cap:
            first = min(protected, key=lambda x: self.freed[x])
            self.promoted[first] = False
            self.freed[first] = self.m.tick()

    def dropped(self, b: int) -> None:
        self.promoted[b] = False

    def order(self, cached_free: list[int]) -> list[int]:
        return sorted(cached_free, key=lambda b: (self.promoted[b], self.freed[b]))

    def extra(self, pool: BlockPool) -> None:
        assert isinstance(pool.policy, SLRUPolicy)
        assert len(pool.policy.protected) == sum(self.promoted[b] for b in self.m.cached_free())


class ARCModel(LRUModel):
    """ARC restated over scans: T1 / T2 are the cached blocks hit never / at least once (sizes counted
    by scanning), ghost lists are plain lists, and the eviction order replays the victim rule."""

    def __init__(self, model: Model) -> None:
        super().__init__(model)
        self.in_t2 = [False] * model.n
        self.p, self.b1, self.b2 = 0.0, [], []

    def sizes(self) -> tuple[int, int]:
        cached = [b for b in range(self.m.n) if self.m.hash[b] is not None]
        t2 = sum(self.in_t2[b] for b in cached)
        return len(cached) - t2, t2

    def trim(self) -> None:
        c = self.m.n
        while self.b1 and self.sizes()[0] + len(self.b1) > c:
            self.b1.pop(0)
        while self.b2 and sum(self.sizes()) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.pop(0)

    def published(self, b: int, h: int) -> None:
        c, ghost = self.m.n, h in self.b1 or h in self.b2
        if h in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1))
            self.b1.remove(h)
        elif h in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
            self.b2.remove(h)
        self.in_t2[b] = ghost
        self.trim()

    def hit(self, b: int) -> None:
        self.in_t2[b] = True

    def evicted(self, b: int, h: int) -> None:
        ghosts = self.b2 if self.in_t2[b] else self.b1
        if h not in ghosts:  # (a second holder of h evicted: h is a ghost already, in its place)
            ghosts.append(h)
        self.in_t2[b] = False
        self.trim()

    def dropped(self, b: int) -> None:
        self.in_t2[b] = False

    def order(self, cached_free: list[int]) -> list[int]:
        t1 = sorted((b for b in cached_free if not self.in_t2[b]), key=lambda b: self.freed[b])
        t2 = sorted((b for b in cached_free if self.in_t2[b]), key=lambda b: self.freed[b])
        size_t1, out = self.sizes()[0], []
        while t1 or t2:
            if t1 and (size_t1 > self.p or not t2):
                out.append(t1.pop(0))
                size_t1 -= 1
            else:
                out.append(t2.pop(0))
        return out

    def extra(self, pool: BlockPool) -> None:
        arc = pool.policy
        assert (arc.p, list(arc.b1), list(arc.b2)) == (self.p, self.b1, self.b2)
        assert (arc.size_t1, arc.size_t2) == self.sizes()


MODELS = {"lru": LRUModel, "fifo": FIFOModel, "lfu": LFUModel, "priority": PriorityModel, "slru": SLRUModel,
          "arc": ARCModel}


class Model:
    """Brute force: every query scans all blocks."""

    def __init__(self, n: int, caching: bool, null: bool, policy: str, admission: bool) -> None:
        self.n, self.caching = n, caching
        self.first = 1 if null else 0  # the first id allocate may hand out
        self.ref = [0] * n
        self.hash: list[int | None] = [None] * n
        self.published_at = [0] * n  # the clock when each hashed block was published
        self.pins: dict[int, int] = {}
        self.max_pinned = int(0.5 * (n - self.first))
        self.clock, self.now = 0, 0.0
        self.hits = self.misses = self.evictions = 0
        self.offers: dict[int, int] | None = {} if admission else None
        self.policy = MODELS[policy](self)
        self.high_water = self.first  # ids handed out at least once: 0 (or 1 past the null block) up to it
        self.capacity = 0  # what the pool's per-block arrays cover (set by the machine)

    def handed_out(self, ids: list[int], chunk: int) -> None:
        """The growth rule restated: past the capacity, grow to the new high-water mark, at least a chunk
        or an eighth more, at most the pool."""
        if ids:
            self.high_water = max(self.high_water, max(ids) + 1)
        if self.high_water > self.capacity:
            grown = self.capacity + max(chunk, self.capacity // 8)
            self.capacity = min(self.n, max(self.high_water, grown))

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def holder(self, h: int) -> int | None:
        """The block a lookup of ``h`` finds: of those holding it, the one published first."""
        found = [b for b in range(self.n) if self.hash[b] == h]
        return min(found, key=lambda b: self.published_at[b]) if found else None

    def uncached_free(self) -> set[int]:
        return {b for b in range(self.first, self.n) if self.ref[b] == 0 and self.hash[b] is None}

    def cached_free(self) -> list[int]:
        return [b for b in range(self.n) if self.ref[b] == 0 and self.hash[b] is not None]

    def lru(self) -> list[int]:
        """The eviction order (named for the default policy)."""
        return self.policy.order(self.cached_free())

    def unref(self, b: int, priority: int = 0) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0 and self.hash[b] is not None:
            self.policy.freed_now(b, priority)

    def admit(self, h: int) -> bool:
        """FrequencyAdmission(min_count=2, max_tracked=4), restated."""
        if self.offers is None:
            return True
        seen = self.offers.get(h, 0) + 1
        if seen >= 2:
            self.offers.pop(h, None)
            return True
        if h not in self.offers and len(self.offers) >= 4:
            self.offers = {k: c // 2 for k, c in self.offers.items() if c > 1}
        self.offers[h] = seen
        return False

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
    policy = "lru"
    frequency_admission = False

    @initialize(n=st.integers(2, 9), chunk=st.integers(1, 4))
    def setup(self, n: int, chunk: int) -> None:
        self.model = Model(n, self.caching, self.null, self.policy, self.frequency_admission)
        self.chunk = chunk
        self.model.capacity = min(n, chunk)
        if self.policy == "priority":
            policy = PriorityPolicy(RETENTION_S, clock=lambda: self.model.now)
        else:
            policy = SLRUPolicy(PROTECTED) if self.policy == "slru" else make_policy(self.policy)
        admission = FrequencyAdmission(2, max_tracked=4) if self.frequency_admission else None
        self.pool = BlockPool(n, enable_caching=self.caching, reserve_null_block=self.null, policy=policy,
                              admission=admission, growth_chunk=chunk)

    def used(self) -> list[int]:
        """Blocks holding a reference the caller may free (a pin's reference is the pool's: see pin)."""
        m = self.model
        return [b for b in range(m.n) if m.ref[b] > m.pins.get(b, 0)]

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
        if n > len(m.uncached_free()) + len(m.lru()):
            self.expect_error(OutOfBlocksError, self.pool.allocate, n)
            return
        self.allocated(n)

    def allocated(self, n: int) -> list[int]:
        """Allocate ``n`` (which fit), check the rules and update the model."""
        m = self.model
        uncached, lru = m.uncached_free(), m.lru()
        got = self.pool.allocate(n)
        assert len(got) == len(set(got)) == n
        m.handed_out(got, self.chunk)
        k = min(n, len(uncached))
        evicted = lru[: n - k]
        assert (set(got) <= uncached) if n <= len(uncached) else (set(got) == uncached | set(evicted))
        for b in evicted:
            h, m.hash[b] = m.hash[b], None
            m.policy.evicted(b, h)
        m.evictions += len(evicted)
        for b in got:
            m.ref[b] = 1
        return got

    @rule(requests=st.lists(st.tuples(st.lists(HASHES, min_size=1, max_size=4), st.integers(0, 2),
                                       st.sampled_from([0, 1, -1])), min_size=1, max_size=8))
    def serve(self, requests: list[tuple[list[int], int, int]]) -> None:
        """Requests one after another, each its whole life (what the eviction policies see most)."""
        for hashes, extra, priority in requests:
            self.request(hashes, extra, priority)

    def request(self, hashes: list[int], extra: int, priority: int) -> None:
        """Look up, touch the hits, allocate the rest, publish the prompt blocks, free all tail first."""
        m = self.model
        hits = m.match(hashes)
        if len(set(hits)) < len(hits) or len(hashes) + extra - len(hits) > len(m.uncached_free()) + len(
                [b for b in m.lru() if b not in hits]):
            return
        self.lookup(hashes)
        self.touched(hits)
        new = self.allocated(len(hashes) + extra - len(hits))
        self.cached(new[:len(hashes) - len(hits)], hashes[len(hits):])
        self.pool.free([*hits, *new][::-1], priority)
        for b in [*hits, *new][::-1]:
            m.unref(b, priority)

    @rule(n=st.sampled_from([-1, 1.0, True, "2"]))
    def allocate_bad_count(self, n: object) -> None:
        self.expect_error(InvalidArgumentError, self.pool.allocate, n)

    # ---- free / touch ---------------------------------------------------------------------------------

    @precondition(lambda self: self.used())
    @rule(data=st.data(), priority=st.sampled_from([0, 0, 1, 2, -1]))
    def free(self, data: st.DataObject, priority: int) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.used()), unique=True, min_size=1))
        self.pool.free(self.with_nulls(data, ids), priority)
        for b in ids:
            self.model.unref(b, priority)

    @precondition(lambda self: self.used())
    @rule(data=st.data(), priority=st.sampled_from(["1", 1.5, True]))
    def free_bad_priority(self, data: st.DataObject, priority: object) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.used()), unique=True, min_size=1))
        self.expect_error(InvalidArgumentError, self.pool.free, ids, priority)

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0]))
    def advance_clock(self, dt: float) -> None:
        self.model.now += dt

    @rule(data=st.data())
    def free_bad(self, data: st.DataObject) -> None:
        m, used = self.model, self.used()
        kind = data.draw(st.sampled_from(["not-allocated", "out-of-range", "duplicate", "negative"]))
        good = data.draw(st.lists(st.sampled_from(used), unique=True, max_size=3)) if used else []
        free_ids = [b for b in range(m.first, m.n) if m.ref[b] == 0]  # (a pinned-only block is neither)
        if kind == "not-allocated" and free_ids:
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
        self.touched(ids, call=False)

    def touched(self, ids: list[int], call: bool = True) -> None:
        m = self.model
        if call:
            self.pool.touch(ids)
        for b in ids:
            if m.hash[b] is not None:
                m.policy.hit(b)
            m.ref[b] += 1

    @precondition(lambda self: self.model.uncached_free())
    @rule(data=st.data())
    def touch_uncached_free(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.model.uncached_free())))
        self.expect_error(InvalidIdError, self.pool.touch, [block])

    # ---- prefix cache ---------------------------------------------------------------------------------

    @precondition(lambda self: self.used())
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
        self.cached(ids, hashes, call=False)

    def cached(self, ids: list[int], hashes: list[int], call: bool = True) -> None:
        m = self.model
        if call:
            self.pool.cache_blocks(ids, hashes)
        for b, h in zip(ids, hashes, strict=True):  # a hash held already is not offered to admission
            if m.caching and m.hash[b] is None and (m.holder(h) is not None or m.admit(h)):
                m.hash[b] = h
                m.published_at[b] = m.tick()
                m.policy.published(b, h)

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
            if m.hash[b] is not None:
                m.hash[b] = None
                m.policy.dropped(b)
                m.ref[b] -= m.pins.pop(b, 0)

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
            for b in m.cached_free():
                m.policy.dropped(b)
            m.hash = [None] * m.n

    # ---- pins -----------------------------------------------------------------------------------------

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        m = self.model
        hashed = [b for b in range(m.n) if m.hash[b] is not None]
        ids = data.draw(st.lists(st.sampled_from(hashed), unique=True, max_size=3)) if hashed else []
        if len(m.pins) + sum(b not in m.pins for b in ids) > m.max_pinned:
            self.expect_error(PinLimitError, self.pool.pin, ids)
            return
        self.pool.pin(ids)
        for b in ids:
            m.ref[b] += 1
            m.pins[b] = m.pins.get(b, 0) + 1

    @rule(hashes=st.lists(HASHES, max_size=3))
    def pin_prefix(self, hashes: list[int]) -> None:
        m = self.model
        ids = m.match(hashes)
        if len(ids) < len(hashes) or len(set(ids)) < len(ids):
            self.expect_error(InvalidIdError, self.pool.pin_prefix, hashes)
        elif len(m.pins) + sum(b not in m.pins for b in ids) > m.max_pinned:
            self.expect_error(PinLimitError, self.pool.pin_prefix, hashes)
        else:
            assert self.pool.pin_prefix(hashes) == ids
            for b in ids:
                m.ref[b] += 1
                m.pins[b] = m.pins.get(b, 0) + 1

    @precondition(lambda self: any(h is None for h in self.model.hash[self.model.first:]))
    @rule(data=st.data())
    def pin_uncached(self, data: st.DataObject) -> None:
        m = self.model
        block = data.draw(st.sampled_from([b for b in range(m.first, m.n) if m.hash[b] is None]))
        self.expect_error(InvalidIdError, self.pool.pin, [block])

    @precondition(lambda self: self.model.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        m = self.model
        ids = data.draw(st.lists(st.sampled_from(sorted(m.pins)), unique=True, min_size=1))
        self.pool.unpin(ids)
        for b in ids:
            m.pins[b] -= 1
            if not m.pins[b]:
                del m.pins[b]
            m.unref(b)

    @rule(data=st.data())
    def unpin_not_pinned(self, data: st.DataObject) -> None:
        m = self.model
        block = data.draw(st.sampled_from([b for b in range(m.n) if b not in m.pins] + [m.n]))
        self.expect_error(InvalidIdError, self.pool.unpin, [block])

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
        assert [pool.get_cached_block(h) for h in range(12)] == [m.holder(h) if m.caching else None
                                                                 for h in range(12)]
        assert pool.num_used_blocks == sum(r > 0 for r in m.ref)
        assert (pool.stats.hits, pool.stats.misses, pool.stats.evictions) == (m.hits, m.misses, m.evictions)
        assert pool.pinned_blocks() == m.pins
        assert (pool.high_water_mark, pool.capacity) == (m.high_water, m.capacity)
        states = [3 if b in m.pins else 4 if b < m.first else 1 if m.ref[b] else 2 if m.hash[b] is not None
                  else 0 for b in range(m.n)]
        assert list(pool.block_states()) == states
        m.policy.extra(pool)


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


class BlockPoolAdmissionMachine(BlockPoolMachine):
    frequency_admission = True


TestBlockPoolAdmissionStateful = BlockPoolAdmissionMachine.TestCase
TestBlockPoolAdmissionStateful.settings = settings(max_examples=150, stateful_step_count=30)


#: Rules the policy machines leave to the machines above (their error paths do not depend on the policy),
#: so that the steps go to what orders and evicts blocks.
POLICY_FREE_RULES = ("allocate_bad_count", "free_bad", "free_bad_priority", "touch_uncached_free",
                     "cache_free_block", "evict_blocks_bad", "admission", "pin_uncached", "unpin_not_pinned")


def _policy_machine(name: str) -> type[BlockPoolMachine]:
    not_rules = dict.fromkeys(POLICY_FREE_RULES)
    return type(f"BlockPool{name.upper()}Machine", (BlockPoolMachine,), {"policy": name, **not_rules})


TestFIFOStateful = _policy_machine("fifo").TestCase
TestLFUStateful = _policy_machine("lfu").TestCase
TestPriorityStateful = _policy_machine("priority").TestCase
TestSLRUStateful = _policy_machine("slru").TestCase
TestARCStateful = _policy_machine("arc").TestCase
for _case in (TestFIFOStateful, TestLFUStateful, TestPriorityStateful, TestSLRUStateful, TestARCStateful):
    _case.settings = settings(max_examples=250, stateful_step_count=40)
del _case
