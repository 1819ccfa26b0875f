"""Drive vLLM's ``CPUOffloadingManager`` (0.33.0 or 0.34.0) with a slice of the Mooncake trace, the way its
scheduler does, beside a kvpool ``BlockPool`` given the same events (the reference: kvpool's own pool and
policy).

One request: ``on_new_request``; ``lookup`` of its keys until the first non-HIT; ``prepare_load`` of the
hits; ``prepare_store`` of the rest. Its loads and stores complete (``complete_load``, ``complete_store``,
``on_request_finished``) only after ``WINDOW`` later requests have started, so chunks being read or
written are in flight while others evict. Keys: the trace's hash ids (one per 512-token block) as 32-byte
hashes in KV cache group 0, as vLLM's SHA-256 block hashes are.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvpool.allocators.block_pool import BlockPool
from kvpool.allocators.policies import make_policy
from kvpool.trace.loaders import load_trace

WINDOW = 4
#: Retention priorities handed out round robin (kv_transfer_params["kvpool_priority"]).
PRIORITIES = (0, 2, -1, 0, 1)
#: The ``priority`` policy's clock: advanced by one per request.
CLOCK = [0.0]
RETENTION = 40.0


def tick() -> float:
    return CLOCK[0]


def trace_keys(num_requests: int) -> list[list[bytes]]:
    """Each request's block hashes: hash id -> 32 bytes big-endian."""
    trace = load_trace(max_requests=num_requests)
    return [[h.to_bytes(32, "big") for h in req.block_hashes(512)] for req in trace.requests]


@dataclass
class Run:
    """What one side did: per request, the hit count and whether its store was refused; the evictions."""

    hits: list[int] = field(default_factory=list)
    refused: list[bool] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)


def drive_vllm(manager, requests: list[list[bytes]]) -> Run:
    """Run ``requests`` through vLLM's ``manager``; evictions as block hashes (the group index cut off)."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    run, inflight = Run(), deque()

    def finish(job):
        ctx, loads, stored = job
        if loads:
            manager.complete_load(loads, ctx)
        if stored:
            manager.complete_store(stored, ctx)
        manager.on_request_finished(ctx)

    CLOCK[0] = 0.0
    for i, hashes in enumerate(requests):
        CLOCK[0] = float(i)
        keys = [make_offload_key(h, 0) for h in hashes]
        ctx = ReqContext(f"r{i}", kv_transfer_params={"kvpool_priority": PRIORITIES[i % len(PRIORITIES)]})
        for pos, key in enumerate(keys):
            ctx.set_offload_key_position(key, (pos + 1) * 512)
        manager.on_new_request(ctx)
        hits = 0
        for key in keys:
            if manager.lookup(key, ctx) is not LookupResult.HIT:
                break
            hits += 1
        if hits:
            manager.prepare_load(keys[:hits], ctx)
        out = manager.prepare_store(keys[hits:], ctx) if hits < len(keys) else None
        run.hits.append(hits)
        run.refused.append(hits < len(keys) and out is None)
        if out is not None:
            run.evicted += [k[:-4] for k in out.evicted_keys]
        inflight.append((ctx, keys[:hits], list(out.keys_to_store) if out is not None else []))
        if len(inflight) > WINDOW:
            finish(inflight.popleft())
    while inflight:
        finish(inflight.popleft())
    return run


class PoolModel:
    """The same events on a kvpool ``BlockPool`` of ``capacity`` blocks with policy ``name``: a store
    allocates and publishes (``cache_blocks``), a completed store or load frees, a load holds its blocks
    (``pin``, or ``touch`` where the policy's hit is a no-op and a retention priority must reach ``free``),
    a reuse is ``touch`` + ``free``; the keys a store is offered that are not cached are reported with
    ``missed`` before it allocates (vLLM's ``on_store_miss``); a store that must evict holds the offer's
    evictable blocks while it allocates. Evictions are read from the pool's eviction listener."""

    TOUCH_HOLD = ("lru", "fifo", "priority")

    def __init__(self, name: str, capacity: int) -> None:
        policy = make_policy(name, retention_s=RETENTION, clock=tick)
        self.pool = BlockPool(capacity, policy=policy, pin_cap=1.0)
        self.name, self.evicted, self.pending = name, [], set()
        self.prio, self.freed, self.clock = [0] * capacity, [0] * capacity, 0
        self.pool.set_eviction_listener(lambda ids, hashes: self.evicted.extend(hashes))

    def block(self, h: bytes) -> int | None:
        return self.pool.get_cached_block(h)

    def _free(self, block: int) -> None:
        self.pool.free([block], self.prio[block])
        if self.pool.ref_count(block) == 0:
            self.clock += 1
            self.freed[block] = self.clock

    def hold(self, blocks: list[int]) -> None:
        (self.pool.touch if self.name in self.TOUCH_HOLD else self.pool.pin)(blocks)

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.name in self.TOUCH_HOLD:
                self._free(b)
            else:
                self.pool.unpin([b])
                if self.pool.ref_count(b) == 0:
                    self.clock += 1
                    self.freed[b] = self.clock

    def start(self, hashes: list[bytes], prio: int) -> tuple[int, bool, list[int], list[bytes], list[bytes]]:
        """Lookup, load and store of one request: (hits, store refused, loaded blocks, reused hashes, stored
        hashes)."""
        hits = 0
        for h in hashes:
            if self.block(h) is None or h in self.pending:
                break
            hits += 1
        loads = [self.block(h) for h in hashes[:hits]]
        self.hold(loads)
        for b in loads:
            self.prio[b] = prio
        rest = hashes[hits:]
        new = [h for h in rest if self.block(h) is None]
        self.pool.missed(new)  # vLLM's on_store_miss: before the eviction that makes room
        ready = [h for h in rest if self.block(h) is not None and h not in self.pending]
        for h in ready:
            self.prio[self.block(h)] = prio
        reused = hashes[:hits] + ready
        if not rest:
            return hits, False, loads, reused, []
        pool = self.pool
        need = len(new) - (pool.num_free_blocks - pool.num_evictable_blocks)  # uncached free first
        held: list[int] = []
        if need > 0:
            offer = {self.block(h) for h in rest} - {None}
            evictable = set(pool.evictable_blocks())
            held = sorted(offer & evictable, key=self.freed.__getitem__)
            if need > len(evictable) - len(held):
                return hits, True, loads, reused, []
            self.hold(held)
        ids = pool.allocate(len(new)) if new else []
        self.release(held)
        if new:
            pool.cache_blocks(ids, new)
            self.pending.update(new)
            for b in ids:
                self.prio[b] = prio
        return hits, False, loads, reused, new

    def finish(self, hashes: list[bytes], loads: list[int], stored: list[bytes], reused: list[bytes],
               prio: int) -> None:
        """Completion of the request's loads and stores, then its end: every block it reused or stored is
        freed again tail first (``touch`` + ``free``; a stored-only block without a hit: ``pin`` +
        ``unpin`` where the policy counts hits)."""
        self.release(loads)
        for h in stored:
            self.pending.discard(h)
            self._free(self.block(h))
        stored_set = set(stored)
        reused_set = set(reused) - stored_set
        for h in reversed([h for h in hashes if h in reused_set or h in stored_set]):
            b = self.block(h)
            if b is None:
                continue
            self.prio[b] = prio
            if h in reused_set:
                self.pool.touch([b])
                self._free(b)
            else:
                self.hold([b])
                self.release([b])


def drive_model(name: str, capacity: int, requests: list[list[bytes]]) -> Run:
    """The reference run of :class:`PoolModel` on ``requests``."""
    model, run, inflight = PoolModel(name, capacity), Run(), deque()
    CLOCK[0] = 0.0
    for i, hashes in enumerate(requests):
        CLOCK[0] = float(i)
        prio = PRIORITIES[i % len(PRIORITIES)]
        hits, refused, loads, reused, stored = model.start(hashes, prio)
        run.hits.append(hits)
        run.refused.append(refused)
        inflight.append((hashes, loads, stored, reused, prio))
        if len(inflight) > WINDOW:
            model.finish(*inflight.popleft())
    while inflight:
        model.finish(*inflight.popleft())
    run.evicted = list(model.evicted)
    return run
